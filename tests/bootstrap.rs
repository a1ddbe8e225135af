//! Endpoint encoding and the TCP bootstrap: round trips, bad input, two threads, two processes,
//! framing errors, timeouts and a three-rank all-gather. CPU only, 127.0.0.1, ephemeral ports.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use gpuverbs::bootstrap::{
    Bootstrap, BootstrapError, Direction, FramePart, JobConfig, Listener, DEFAULT_MAX_FRAME,
    TIMEOUT_ENV,
};
use gpuverbs::endpoint::{Endpoint, EndpointError, Gid, RemoteMemory, WIRE_VERSION};

const T: Duration = Duration::from_secs(10);

fn soft_gid(last: u8) -> Gid {
    gpuverbs::soft::Gid::from_ipv4(Ipv4Addr::new(127, 1, 0, last)).into()
}

fn endpoint(rank: u8) -> Endpoint {
    Endpoint::new(
        soft_gid(rank + 1),
        0x100 + u32::from(rank),
        0x12_3456 + u32::from(rank),
        1024,
        format!("softnic:soft{rank}"),
    )
    .unwrap()
}

fn json(v: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&v).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Endpoint
// ---------------------------------------------------------------------------------------------

#[test]
fn endpoint_round_trip() {
    let ep = endpoint(0);
    let bytes = ep.to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["v"], WIRE_VERSION);
    assert_eq!(v["gid"], "::ffff:127.1.0.1");
    assert_eq!(v["qpn"], 0x100);
    assert!(v.get("rkey").is_none(), "an endpoint never carries a key");
    assert_eq!(Endpoint::from_bytes(&bytes).unwrap(), ep);
    assert_eq!(ep.gid().bytes(), gpuverbs::soft::Gid::from(ep.gid()).0);
    assert_eq!(ep.psn(), 0x12_3456);
    assert_eq!(ep.mtu(), 1024);
    assert_eq!(ep.device(), "softnic:soft0");

    let mr = RemoteMemory::export_rkey(0x7f00_0000_1000, 1 << 20, 0xabcd).unwrap();
    assert_eq!(RemoteMemory::from_bytes(&mr.to_bytes()).unwrap(), mr);
    let sub = mr.slice(4096, 64).unwrap();
    assert_eq!(
        (sub.addr(), sub.len(), sub.rkey()),
        (0x7f00_0000_2000, 64, 0xabcd)
    );

    // Through serde, inside other types: the same checks apply.
    let both = serde_json::to_vec(&(ep.clone(), mr)).unwrap();
    let (ep2, mr2): (Endpoint, RemoteMemory) = serde_json::from_slice(&both).unwrap();
    assert_eq!((ep2, mr2), (ep, mr));

    // Every MTU and the range edges are accepted.
    for mtu in [256, 512, 1024, 2048, 4096] {
        Endpoint::new(Gid([0; 16]), 2, 0, mtu, "").unwrap();
    }
    Endpoint::new(Gid([0xff; 16]), 0xff_ffff, 0xff_ffff, 4096, "mlx5_0").unwrap();
}

#[test]
fn endpoint_version_mismatch() {
    let mut v: serde_json::Value = serde_json::from_slice(&endpoint(0).to_bytes()).unwrap();
    v["v"] = 2.into();
    match Endpoint::from_bytes(&json(v.clone())) {
        Err(EndpointError::UnsupportedVersion {
            found: 2,
            supported: 1,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    // A future version with other fields still reports the version, not a missing field.
    let future = json(serde_json::json!({"v": 7, "address": "x"}));
    assert!(matches!(
        Endpoint::from_bytes(&future),
        Err(EndpointError::UnsupportedVersion { found: 7, .. })
    ));
    assert!(matches!(
        RemoteMemory::from_bytes(&future),
        Err(EndpointError::UnsupportedVersion { found: 7, .. })
    ));
    v.as_object_mut().unwrap().remove("v");
    assert!(matches!(
        Endpoint::from_bytes(&json(v)),
        Err(EndpointError::MissingVersion { .. })
    ));
    // Serde path: the error message names the version.
    let err = serde_json::from_slice::<Endpoint>(&future).unwrap_err();
    assert!(err.to_string().contains("version 7"), "{err}");
}

#[test]
fn endpoint_bad_values() {
    let g = soft_gid(1);
    let e = |r: Result<Endpoint, EndpointError>| r.unwrap_err();
    assert!(matches!(
        e(Endpoint::new(g, 0x100_0000, 0, 1024, "")),
        EndpointError::QpnOutOfRange(0x100_0000)
    ));
    assert!(matches!(
        e(Endpoint::new(g, 1, 0, 1024, "")),
        EndpointError::QpnOutOfRange(1)
    ));
    assert!(matches!(
        e(Endpoint::new(g, 2, 0x100_0000, 1024, "")),
        EndpointError::PsnOutOfRange(0x100_0000)
    ));
    for mtu in [0, 128, 1500, 8192] {
        assert!(matches!(
            e(Endpoint::new(g, 2, 0, mtu, "")),
            EndpointError::InvalidMtu(m) if m == mtu
        ));
    }
    assert!(matches!(
        e(Endpoint::new(g, 2, 0, 1024, "x".repeat(300))),
        EndpointError::InvalidDeviceName { .. }
    ));
    assert!(matches!(
        e(Endpoint::new(g, 2, 0, 1024, "evil\u{1b}[2J")),
        EndpointError::InvalidDeviceName { .. }
    ));

    // The same checks on decode.
    let base: serde_json::Value = serde_json::from_slice(&endpoint(0).to_bytes()).unwrap();
    let with = |k: &str, val: serde_json::Value| {
        let mut v = base.clone();
        v[k] = val;
        Endpoint::from_bytes(&json(v))
    };
    assert!(matches!(
        with("qpn", 0x100_0000.into()),
        Err(EndpointError::QpnOutOfRange(_))
    ));
    assert!(matches!(
        with("psn", 0xffff_ffffu32.into()),
        Err(EndpointError::PsnOutOfRange(_))
    ));
    assert!(matches!(
        with("mtu", 1500.into()),
        Err(EndpointError::InvalidMtu(1500))
    ));
    assert!(matches!(
        with("qpn", (-1).into()),
        Err(EndpointError::Decode { .. })
    ));
    assert!(matches!(
        with("gid", "not-a-gid".into()),
        Err(EndpointError::Decode { .. })
    ));
    assert!(matches!(
        Endpoint::from_bytes(b"\x00\xffgarbage"),
        Err(EndpointError::Decode { .. })
    ));
    // A memory descriptor is not an endpoint: by its version (2) since descriptors carry a
    // generation, and by its fields in version 1.
    let mr = RemoteMemory::export_rkey(0x1000, 16, 1).unwrap();
    assert!(matches!(
        Endpoint::from_bytes(&mr.to_bytes()),
        Err(EndpointError::UnsupportedVersion { found: 2, .. })
    ));
    let v1 = json(serde_json::json!({"v": 1, "addr": 4096, "len": 16, "rkey": 1}));
    assert!(matches!(
        Endpoint::from_bytes(&v1),
        Err(EndpointError::Decode { .. })
    ));

    assert!(matches!(
        RemoteMemory::export_rkey(u64::MAX - 1, 2, 1),
        Err(EndpointError::RangeOverflow { .. })
    ));
    assert!(matches!(
        mr.slice(8, 9),
        Err(EndpointError::OutOfBounds { .. })
    ));
    assert!(matches!(
        mr.slice(u64::MAX, 2),
        Err(EndpointError::OutOfBounds { .. })
    ));
    let overflow = json(serde_json::json!({"v": 1, "addr": u64::MAX, "len": 1, "rkey": 5}));
    assert!(matches!(
        RemoteMemory::from_bytes(&overflow),
        Err(EndpointError::RangeOverflow { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A connected pair over 127.0.0.1: (rank 0, rank 1).
fn pair() -> (Bootstrap, Bootstrap) {
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr();
    let client = thread::spawn(move || Bootstrap::client(addr, T).unwrap());
    let server = l.accept(T).unwrap();
    (server, client.join().unwrap())
}

fn hello(rank: u32, world: u32) -> Vec<u8> {
    let mut f = 16u32.to_be_bytes().to_vec();
    f.extend_from_slice(b"GVBS");
    f.extend_from_slice(&1u16.to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(&rank.to_be_bytes());
    f.extend_from_slice(&world.to_be_bytes());
    f
}

/// A hand-written rank 0 that completes the handshake, then runs `then` on the raw socket.
fn fake_root(
    then: impl FnOnce(TcpStream) + Send + 'static,
) -> (SocketAddr, thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut got = [0u8; 20];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got[..], &hello(1, 2)[..]);
        s.write_all(&hello(0, 2)).unwrap();
        then(s);
    });
    (addr, h)
}

/// A port nobody listens on (bound once by the OS, then released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn vars(pairs: &[(&str, String)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    move |k| m.get(k).cloned()
}

// ---------------------------------------------------------------------------------------------
// Two threads
// ---------------------------------------------------------------------------------------------

#[test]
fn threads_exchange_endpoints_and_remote_memory() {
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr();
    let client = thread::spawn(move || {
        let mut bs = Bootstrap::client(addr, T).unwrap();
        assert_eq!((bs.rank(), bs.world_size()), (1, 2));
        let mine = (
            endpoint(1),
            RemoteMemory::export_rkey(0x2000, 8192, 0x22).unwrap(),
        );
        let theirs: (Endpoint, RemoteMemory) = bs.exchange(&mine).unwrap();
        bs.barrier().unwrap();
        bs.send(b"raw bytes from rank 1").unwrap();
        assert_eq!(bs.recv().unwrap(), b"");
        // Endpoint alone (no key) in the other direction.
        let ep: Endpoint = bs.exchange(&endpoint(1)).unwrap();
        assert_eq!(ep, endpoint(0));
        theirs
    });
    let mut bs = l.accept(T).unwrap();
    assert_eq!((bs.rank(), bs.world_size()), (0, 2));
    assert!(bs.peer_addr(1).unwrap().ip().is_loopback());
    let mine = (
        endpoint(0),
        RemoteMemory::export_rkey(0x1000, 4096, 0x11).unwrap(),
    );
    let (ep, mr): (Endpoint, RemoteMemory) = bs.exchange(&mine).unwrap();
    assert_eq!(ep, endpoint(1));
    assert_eq!((mr.addr(), mr.len(), mr.rkey()), (0x2000, 8192, 0x22));
    bs.barrier().unwrap();
    assert_eq!(bs.recv().unwrap(), b"raw bytes from rank 1");
    bs.send(b"").unwrap();
    let ep1: Endpoint = bs.exchange(&endpoint(0)).unwrap();
    assert_eq!(ep1, endpoint(1));

    let (ep0, mr0) = client.join().unwrap();
    assert_eq!(ep0, endpoint(0));
    assert_eq!(mr0, mine.1);
    // The RTR attributes come from the peer's endpoint.
    let rtr = ep0.rtr_attr(12);
    assert_eq!((rtr.remote_qpn, rtr.rq_psn), (ep0.qpn(), ep0.psn()));
}

#[test]
fn exchange_of_large_messages_does_not_deadlock() {
    let (mut a, mut b) = pair();
    let big_a = vec![7u8; 600 * 1024];
    let big_b = vec![9u8; 600 * 1024];
    let encoded = serde_json::to_vec(&big_a).unwrap().len();
    assert!(
        encoded > 1 << 20,
        "above the default frame limit: needs set_max_frame"
    );
    a.set_max_frame(4 << 20);
    b.set_max_frame(4 << 20);
    let t = thread::spawn(move || b.exchange(&big_b).unwrap());
    let got_b: Vec<u8> = a.exchange(&big_a).unwrap();
    let got_a: Vec<u8> = t.join().unwrap();
    assert_eq!(got_b.len(), 600 * 1024);
    assert!(got_a.iter().all(|&x| x == 7) && got_b.iter().all(|&x| x == 9));
}

#[test]
fn client_retries_until_the_server_starts() {
    let port = free_port();
    let client = thread::spawn(move || {
        let mut bs = Bootstrap::client(format!("127.0.0.1:{port}"), T).unwrap();
        bs.exchange(&1u32).unwrap()
    });
    thread::sleep(Duration::from_millis(300));
    let mut server = Bootstrap::server(format!("127.0.0.1:{port}"), T).unwrap();
    assert_eq!(server.exchange(&0u32).unwrap(), 1);
    assert_eq!(client.join().unwrap(), 0);
}

// ---------------------------------------------------------------------------------------------
// Two processes
// ---------------------------------------------------------------------------------------------

const CHILD_ENV: &str = "GPUVERBS_BOOTSTRAP_TEST_CHILD";

/// Rank 1 of `two_processes`; a no-op unless the parent test started this process.
#[test]
fn child_process_role() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let mut bs = Bootstrap::from_env().expect("child: from_env");
    assert_eq!((bs.rank(), bs.world_size()), (1, 2));
    let mine = (
        endpoint(1),
        RemoteMemory::export_rkey(0xbeef_0000, 65536, 0x5151).unwrap(),
    );
    let (ep, mr): (Endpoint, RemoteMemory) = bs.exchange(&mine).unwrap();
    assert_eq!(ep, endpoint(0));
    assert_eq!(mr.rkey(), 0x4242);
    let all: Vec<u32> = bs.all_gather(&(std::process::id())).unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[1], std::process::id());
    bs.barrier().unwrap();
    println!("child: ok, peer endpoint {ep}, peer memory {mr}");
}

#[test]
fn two_processes() {
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().port();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "child_process_role",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env(TIMEOUT_ENV, "10000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let result = (|| -> Result<Vec<u32>, BootstrapError> {
        let mut bs = l.accept(T)?;
        let mine = (
            endpoint(0),
            RemoteMemory::export_rkey(0xcafe_0000, 4096, 0x4242).unwrap(),
        );
        let (ep, mr): (Endpoint, RemoteMemory) = bs.exchange(&mine)?;
        assert_eq!(ep, endpoint(1));
        assert_eq!(
            (mr.addr(), mr.len(), mr.rkey()),
            (0xbeef_0000, 65536, 0x5151)
        );
        let all: Vec<u32> = bs.all_gather(&std::process::id())?;
        bs.barrier()?;
        Ok(all)
    })();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("child did not finish");
        }
        thread::sleep(Duration::from_millis(10));
    };
    let out = child.wait_with_output().unwrap();
    let log = format!(
        "child stdout:\n{}\nchild stderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.success(), "child failed ({status})\n{log}");
    assert!(log.contains("child: ok"), "child test did not run\n{log}");
    let all = result.unwrap_or_else(|e| panic!("parent: {e}\n{log}"));
    assert_eq!(all[0], std::process::id());
    assert_ne!(all[1], all[0]);
}

// ---------------------------------------------------------------------------------------------
// Framing errors and timeouts
// ---------------------------------------------------------------------------------------------

#[test]
fn truncated_frame() {
    let (addr, root) = fake_root(|mut s| {
        s.write_all(&[0, 0]).unwrap(); // half a length prefix, then close
    });
    let mut bs = Bootstrap::client(addr, T).unwrap();
    match bs.recv() {
        Err(BootstrapError::Truncated {
            peer: 0,
            part: FramePart::Header,
            got: 2,
            expected: 4,
        }) => {}
        other => panic!("{other:?}"),
    }
    // The stream is out of step now.
    assert!(matches!(bs.recv(), Err(BootstrapError::Broken { peer: 0 })));
    root.join().unwrap();

    // A payload cut short.
    let (addr, root) = fake_root(|mut s| {
        s.write_all(&10u32.to_be_bytes()).unwrap();
        s.write_all(b"abc").unwrap();
    });
    let mut bs = Bootstrap::client(addr, T).unwrap();
    let err = bs.recv().unwrap_err();
    assert!(
        matches!(
            err,
            BootstrapError::Truncated {
                part: FramePart::Payload,
                got: 3,
                expected: 10,
                ..
            }
        ),
        "{err:?}"
    );
    root.join().unwrap();
}

#[test]
fn peer_closed_between_frames() {
    let (mut a, b) = pair();
    drop(b);
    assert!(matches!(
        a.recv(),
        Err(BootstrapError::PeerClosed { peer: 1 })
    ));
}

#[test]
fn oversized_frame_is_refused_without_allocating() {
    // The peer announces 4 GiB - 1 and sends nothing more: refused from the header at once.
    let (addr, root) = fake_root(|mut s| {
        s.write_all(&u32::MAX.to_be_bytes()).unwrap();
        // Stay connected (sending nothing more) until the client hangs up.
        let _ = s.read(&mut [0u8; 1]);
    });
    let mut bs = Bootstrap::client(addr, T).unwrap();
    let t0 = Instant::now();
    match bs.recv() {
        Err(BootstrapError::FrameTooLarge {
            peer: 0,
            dir: Direction::Read,
            len,
            limit,
        }) => {
            assert_eq!(len, u64::from(u32::MAX));
            assert_eq!(limit, DEFAULT_MAX_FRAME);
        }
        other => panic!("{other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_millis(400));
    drop(bs);
    root.join().unwrap();

    // A configured limit, on both ends. Sending too much is refused locally and leaves the
    // connection usable.
    let (mut a, mut b) = pair();
    b.set_max_frame(8);
    assert_eq!(b.max_frame(), 8);
    assert!(matches!(
        b.send(&[0u8; 9]),
        Err(BootstrapError::FrameTooLarge {
            dir: Direction::Write,
            len: 9,
            ..
        })
    ));
    b.send(b"12345678").unwrap();
    assert_eq!(a.recv().unwrap(), b"12345678");
    // Receiving too much is refused from the header; the stream is then out of step.
    a.send(b"123456789").unwrap();
    assert!(matches!(
        b.recv(),
        Err(BootstrapError::FrameTooLarge {
            dir: Direction::Read,
            len: 9,
            limit: 8,
            ..
        })
    ));
    assert!(matches!(b.recv(), Err(BootstrapError::Broken { peer: 0 })));
}

#[test]
fn garbage_payload_is_a_decode_error() {
    let (mut a, mut b) = pair();
    let t = thread::spawn(move || {
        a.send(b"\xff\x00 this is not JSON").unwrap();
        // The victim still sends its own frame before it decodes.
        let got = a.recv().unwrap();
        // An endpoint of an unknown version also fails to decode through exchange.
        a.send(&json(serde_json::json!({"v": 2, "gid": "::1"})))
            .unwrap();
        let _ = a.recv().unwrap();
        got
    });
    match b.exchange(&endpoint(1)) {
        Err(BootstrapError::Decode { rank: 0, len, .. }) => assert_eq!(len, 19),
        other => panic!("{other:?}"),
    }
    let err = b.exchange(&endpoint(1)).unwrap_err();
    assert!(
        matches!(err, BootstrapError::Decode { .. }) && err.to_string().contains("version 2"),
        "{err}"
    );
    let got = t.join().unwrap();
    assert_eq!(Endpoint::from_bytes(&got).unwrap(), endpoint(1));
}

#[test]
fn read_timeout_when_the_peer_is_silent() {
    let (mut a, mut b) = pair();
    b.set_timeout(Duration::from_millis(200));
    let t0 = Instant::now();
    match b.recv() {
        Err(BootstrapError::Timeout {
            peer: 0,
            dir: Direction::Read,
            timeout,
        }) => assert_eq!(timeout, Duration::from_millis(200)),
        other => panic!("{other:?}"),
    }
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(190) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // Nothing was consumed, so the connection is still good.
    a.send(b"late").unwrap();
    assert_eq!(b.recv().unwrap(), b"late");
}

#[test]
fn connect_timeout_when_nobody_listens() {
    let addr = format!("127.0.0.1:{}", free_port());
    let t0 = Instant::now();
    match Bootstrap::client(addr.as_str(), Duration::from_millis(300)) {
        Err(BootstrapError::ConnectTimeout {
            addr: a,
            timeout,
            last_error,
        }) => {
            assert_eq!(a, addr);
            assert_eq!(timeout, Duration::from_millis(300));
            assert!(last_error.is_some());
        }
        other => panic!("{other:?}"),
    }
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(290) && took < Duration::from_secs(3),
        "{took:?}"
    );
}

#[test]
fn accept_timeout_when_nobody_connects() {
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let t0 = Instant::now();
    match l.accept(Duration::from_millis(200)) {
        Err(BootstrapError::AcceptTimeout {
            joined: 0,
            expected: 1,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(3));
}

#[test]
fn handshake_rejects_strangers_and_mismatched_jobs() {
    // Not a bootstrap peer at all.
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr();
    let t = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    });
    let err = l.accept(T).unwrap_err();
    assert!(matches!(err, BootstrapError::Handshake { .. }), "{err:?}");
    t.join().unwrap();

    // A peer that thinks the job has three ranks.
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr();
    let t = thread::spawn(move || Bootstrap::join(addr, 1, 3, T));
    let err = l.accept(T).unwrap_err();
    assert!(
        matches!(err, BootstrapError::Handshake { ref reason, .. } if reason.contains("world size")),
        "{err:?}"
    );
    let peer_err = t.join().unwrap().unwrap_err();
    assert!(
        matches!(peer_err, BootstrapError::Handshake { .. }),
        "{peer_err:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Jobs
// ---------------------------------------------------------------------------------------------

#[test]
fn all_gather_world_3_threads() {
    let port = free_port();
    let job = |rank: u32| {
        vars(&[
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "3".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.to_string()),
            (TIMEOUT_ENV, "10000".into()),
        ])
    };
    let handles: Vec<_> = (0..3u32)
        .map(|rank| {
            let lookup = job(rank);
            thread::spawn(move || {
                let cfg = JobConfig::from_lookup(lookup).unwrap();
                assert_eq!(
                    (cfg.rank, cfg.world_size, cfg.timeout),
                    (rank, 3, Duration::from_secs(10))
                );
                // Non-root ranks may start first: they retry until rank 0 listens.
                if rank == 0 {
                    thread::sleep(Duration::from_millis(100));
                }
                let mut bs = Bootstrap::from_config(&cfg).unwrap();
                assert_eq!((bs.rank(), bs.world_size()), (rank, 3));
                let eps: Vec<Endpoint> = bs.all_gather(&endpoint(rank as u8)).unwrap();
                bs.barrier().unwrap();
                let names: Vec<(u32, String)> =
                    bs.all_gather(&(rank, format!("rank-{rank}"))).unwrap();
                assert!(matches!(
                    bs.exchange(&0u8),
                    Err(BootstrapError::NotPairwise { world_size: 3, .. })
                ));
                bs.barrier().unwrap();
                (eps, names)
            })
        })
        .collect();
    for h in handles {
        let (eps, names) = h.join().unwrap();
        assert_eq!(eps, (0..3u8).map(endpoint).collect::<Vec<_>>());
        assert_eq!(
            names,
            (0..3u32)
                .map(|r| (r, format!("rank-{r}")))
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn world_of_one_needs_no_network() {
    let cfg = JobConfig::from_lookup(vars(&[
        ("OMPI_COMM_WORLD_RANK", "0".into()),
        ("OMPI_COMM_WORLD_SIZE", "1".into()),
    ]))
    .unwrap();
    let mut bs = Bootstrap::from_config(&cfg).unwrap();
    assert_eq!((bs.rank(), bs.world_size()), (0, 1));
    let all: Vec<String> = bs.all_gather(&"solo".to_string()).unwrap();
    assert_eq!(all, ["solo"]);
    bs.barrier().unwrap();
}

#[test]
fn job_config_from_variables() {
    let ok = JobConfig::from_lookup(vars(&[
        ("PMI_RANK", "2".into()),
        ("PMI_SIZE", "4".into()),
        ("MASTER_ADDR", " node-0 ".into()),
        ("MASTER_PORT", "29500".into()),
    ]))
    .unwrap();
    assert_eq!(
        (
            ok.rank,
            ok.world_size,
            ok.master_addr.as_str(),
            ok.master_port
        ),
        (2, 4, "node-0", 29500)
    );
    assert_eq!(ok.master_socket_addr(), "node-0:29500");

    // torchrun's variables win over MPI's.
    let both = JobConfig::from_lookup(vars(&[
        ("RANK", "1".into()),
        ("WORLD_SIZE", "2".into()),
        ("OMPI_COMM_WORLD_RANK", "0".into()),
        ("OMPI_COMM_WORLD_SIZE", "8".into()),
        ("MASTER_ADDR", "::1".into()),
        ("MASTER_PORT", "1".into()),
    ]))
    .unwrap();
    assert_eq!((both.rank, both.world_size), (1, 2));
    assert_eq!(both.master_socket_addr(), "[::1]:1");

    let err = |pairs: &[(&str, String)]| JobConfig::from_lookup(vars(pairs)).unwrap_err();
    let missing = |e: BootstrapError| match e {
        BootstrapError::MissingEnv { var, .. } => var,
        other => panic!("{other:?}"),
    };
    let invalid = |e: BootstrapError| match e {
        BootstrapError::InvalidEnv { var, .. } => var,
        other => panic!("{other:?}"),
    };
    assert_eq!(missing(err(&[])), "RANK");
    assert_eq!(missing(err(&[("RANK", "0".into())])), "WORLD_SIZE");
    assert_eq!(
        missing(err(&[("OMPI_COMM_WORLD_SIZE", "2".into())])),
        "OMPI_COMM_WORLD_RANK"
    );
    assert_eq!(missing(err(&[("PMI_RANK", "0".into())])), "PMI_SIZE");
    fn two<'a>(extra: &[(&'a str, String)]) -> Vec<(&'a str, String)> {
        let mut v = vec![("RANK", "1".to_string()), ("WORLD_SIZE", "2".to_string())];
        v.extend(extra.iter().cloned());
        v
    }
    assert_eq!(missing(err(&two(&[]))), "MASTER_ADDR");
    assert_eq!(
        missing(err(&two(&[("MASTER_ADDR", "h".into())]))),
        "MASTER_PORT"
    );
    assert_eq!(
        invalid(err(&[("RANK", "one".into()), ("WORLD_SIZE", "2".into())])),
        "RANK"
    );
    assert_eq!(
        invalid(err(&[("RANK", "2".into()), ("WORLD_SIZE", "2".into())])),
        "RANK"
    );
    assert_eq!(
        invalid(err(&[("RANK", "0".into()), ("WORLD_SIZE", "0".into())])),
        "WORLD_SIZE"
    );
    assert_eq!(
        invalid(err(&[("RANK", "0".into()), ("WORLD_SIZE", "-3".into())])),
        "WORLD_SIZE"
    );
    for port in ["70000", "0", "http"] {
        assert_eq!(
            invalid(err(&two(&[
                ("MASTER_ADDR", "h".into()),
                ("MASTER_PORT", port.into())
            ]))),
            "MASTER_PORT"
        );
    }
    assert_eq!(
        invalid(err(&two(&[
            ("MASTER_ADDR", "h".into()),
            ("MASTER_PORT", "5".into()),
            (TIMEOUT_ENV, "soon".into())
        ]))),
        TIMEOUT_ENV
    );
    // The message names the variable and its value.
    let msg = err(&[("RANK", "x".into()), ("WORLD_SIZE", "2".into())]).to_string();
    assert!(msg.contains("RANK") && msg.contains("\"x\""), "{msg}");
}
