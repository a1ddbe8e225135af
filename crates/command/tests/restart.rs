//! A peer process that dies and starts again: the survivor's QP reports the failure within its
//! retry budget (TRANSPORT_RETRY_EXC), `Qp::recover` brings it back, and it connects to the new
//! process's endpoint; every byte the survivor writes is checked by the peer process that
//! received it. On soft NICs over RoCEv2/UDP, and on the mlx5 backend: both processes under
//! `gpuverbs emu`, each with its own emulated ConnectX on its own address.
//!
//! Roles are this test binary run again: `RESTART_ROLE` = `survivor` or `peer`.

mod emu_util;

use emu_util::{emu, run, serial};
use gpuverbs::bootstrap::{Bootstrap, Listener};
use gpuverbs::{
    Access, ConnectOptions, Context, CqOptions, DeviceRequest, Endpoint, HostBuffer, QpOptions,
    RemoteMemory,
};
use prm::wqe::{CtrlFlags, Local, Op, RemoteAddr};
use prm::{Completion, Rkey};
use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::Duration;
use verbs::initiator::RingMode;

const T: Duration = Duration::from_secs(20);
const ROLE: &str = "RESTART_ROLE";
const BOOT: &str = "RESTART_BOOT";
/// `emu` when the roles run under `gpuverbs emu` (the peer's `--ip` in `RESTART_PEER_IP`).
const KIND: &str = "RESTART_KIND";
const PEER_IP: &str = "RESTART_PEER_IP";

struct Side {
    _ctx: Context,
    qp: gpuverbs::Qp,
    buf: HostBuffer,
    mr: gpuverbs::Mr,
}

/// A context of this role: a wire soft NIC on 127.0.0.1, or (under `gpuverbs emu`) the
/// emulated `mlx5_0`.
fn side() -> Side {
    let ctx = if std::env::var(KIND).as_deref() == Ok("emu") {
        let c = Context::open(DeviceRequest::Named("mlx5_0".into())).unwrap();
        assert_eq!(c.selection().kind, gpuverbs::device::BackendKind::Mlx5);
        c
    } else {
        Context::open_soft(gpuverbs::soft::DeviceConfig {
            wire: Some(gpuverbs::soft::WireConfig::new(SocketAddr::from((
                Ipv4Addr::LOCALHOST,
                0,
            )))),
            ..Default::default()
        })
        .unwrap()
    };
    let pd = ctx.alloc_pd();
    let scq = ctx.create_cq(CqOptions::default()).unwrap();
    let rcq = ctx.create_cq(CqOptions::default()).unwrap();
    let qp = pd.create_qp(QpOptions::new(&scq, &rcq)).unwrap();
    let buf = HostBuffer::new(1 << 17);
    let mr = pd
        .register_with(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    Side {
        _ctx: ctx,
        qp,
        buf,
        mr,
    }
}

/// A short ACK timeout (4 ms) with the most retries (8 tries): a dead peer is seen within
/// about 35 ms, and a live one on a loaded machine has that long to answer once (3 tries, 12 ms,
/// were too few beside a build on the 2-core machine: a write to the new peer ran out).
fn opts() -> ConnectOptions {
    ConnectOptions {
        access: Access::REMOTE_WRITE,
        timeout: 10,
        retry_cnt: 7,
        ..Default::default()
    }
}

/// The endpoint and the memory descriptor, as the bytes that travel.
fn travel(s: &Side) -> (Vec<u8>, Vec<u8>) {
    let mem = RemoteMemory::export_rkey(s.mr.addr(), s.mr.len(), s.mr.rkey().0).unwrap();
    (s.qp.endpoint().to_bytes(), mem.to_bytes())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// This test binary in `role`, under `gpuverbs emu --ip ip` when the kind is `emu`.
fn role(role: &str, ip: Option<&str>, boot: Option<&str>) -> Command {
    let exe = std::env::current_exe().unwrap();
    let exe = exe.to_str().unwrap();
    let args = [exe, "--exact", "roles", "--nocapture", "--test-threads=1"];
    let mut c = match ip {
        Some(ip) => emu(ip, None, &args),
        None => {
            let mut c = Command::new(exe);
            c.args(&args[1..]);
            c
        }
    };
    c.env(ROLE, role);
    if let Some(b) = boot {
        c.env(BOOT, b);
    }
    c
}

/// The peer: sends its endpoint and memory, connects, then checks each pattern the survivor
/// says it wrote (`[len: u32 LE, seed]`), answering `[1]` (the bytes are there) or `[0]`,
/// until an empty message (or its death).
fn peer() {
    let b = side();
    let mut bs = Bootstrap::client(std::env::var(BOOT).unwrap(), T).unwrap();
    let (ep_a, _): (Vec<u8>, Vec<u8>) = bs.exchange(&travel(&b)).unwrap();
    b.qp.connect(&Endpoint::from_bytes(&ep_a).unwrap(), opts())
        .unwrap();
    bs.barrier().unwrap();
    loop {
        let m = bs.recv().unwrap();
        let [l0, l1, l2, l3, seed] = m[..] else {
            return;
        };
        let len = u32::from_le_bytes([l0, l1, l2, l3]) as usize;
        let good = b.buf.to_vec()[..len] == pattern(len, seed)[..];
        bs.send(&[u8::from(good)]).unwrap();
    }
}

/// The survivor: connects to a peer process, writes, sees the peer killed, recovers, and
/// connects to a new peer process.
fn survivor() {
    let a = side();
    let peer_ip = std::env::var(PEER_IP).ok();
    let start_peer = || {
        let l = Listener::bind("127.0.0.1:0").unwrap();
        let child = role(
            "peer",
            peer_ip.as_deref(),
            Some(&l.local_addr().to_string()),
        )
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
        let mut bs = l.accept(T).unwrap();
        let (ep_b, mem_b): (Vec<u8>, Vec<u8>) = bs.exchange(&travel(&a)).unwrap();
        a.qp.connect(&Endpoint::from_bytes(&ep_b).unwrap(), opts())
            .unwrap();
        bs.barrier().unwrap();
        (child, bs, RemoteMemory::from_bytes(&mem_b).unwrap())
    };
    let write = |ini: &mut verbs::initiator::Initiator, mem: &RemoteMemory, len, seed| {
        a.buf.write(0, &pattern(len, seed));
        let op = Op::Write {
            remote: RemoteAddr {
                addr: mem.addr(),
                rkey: Rkey(mem.rkey()),
            },
            local: Local::Sges(&[a.mr.sge(0, len as u32)]),
            imm: None,
        };
        ini.post_and_ring(&op, CtrlFlags::SIGNALED).unwrap();
        ini.wait_send(T).unwrap()
    };
    let checked = |bs: &mut Bootstrap, len: usize, seed: u8| {
        let mut m = (len as u32).to_le_bytes().to_vec();
        m.push(seed);
        bs.send(&m).unwrap();
        assert_eq!(bs.recv().unwrap(), [1], "the peer process has the bytes");
    };

    let (mut child, mut bs, mem) = start_peer();
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    for (len, seed) in [(4096, 1), (65536, 2)] {
        let c = write(&mut ini, &mem, len, seed);
        assert!(matches!(c, Completion::Req { .. }), "{c:?}");
        checked(&mut bs, len, seed);
    }
    // the peer process (and under emu its launcher) dies without a word
    // SAFETY: plain system call on the process group this role started.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.kill();
    child.wait().unwrap();
    let t = std::time::Instant::now();
    match write(&mut ini, &mem, 4096, 3) {
        Completion::Error(e) => assert_eq!(
            (e.responder, e.syndrome(), e.wqe_counter),
            (false, Some(prm::Syndrome::TransportRetryExc), 2)
        ),
        c => panic!("a dead peer: {c:?}"),
    }
    println!("failure seen after {:?}", t.elapsed());
    drop(ini);
    let drained = a.qp.recover(T).unwrap();
    assert!(drained.send.is_empty(), "{drained:?}");

    // a new peer process: new endpoints both ways, and traffic resumes
    let (mut child, mut bs, mem) = start_peer();
    let mut ini = a.qp.cpu_initiator(RingMode::RdmaCore);
    for (len, seed) in [(4096, 4), (100_000, 5), (8, 6)] {
        let c = write(&mut ini, &mem, len, seed);
        assert!(matches!(c, Completion::Req { .. }), "{c:?}");
        checked(&mut bs, len, seed);
    }
    bs.send(&[]).unwrap();
    assert!(child.wait().unwrap().success());
    println!("recovered: 3 patterns checked by the new peer process");
}

/// The roles' entry point (the outer test runs this binary again with `RESTART_ROLE` set).
#[test]
fn roles() {
    match std::env::var(ROLE).as_deref() {
        Ok("survivor") => survivor(),
        Ok("peer") => peer(),
        _ => {} // not a role: the tests below start them
    }
}

#[test]
fn a_soft_nic_survivor_recovers_against_a_restarted_peer_process() {
    let _g = serial();
    let out = run(role("survivor", None, None), T * 3, "survivor (soft NIC)");
    assert!(out.contains("recovered: 3 patterns"), "{out}");
}

#[test]
fn an_mlx5_survivor_recovers_against_a_restarted_peer_process_under_the_emulation() {
    let _g = serial();
    let mut c = role("survivor", Some("127.0.98.1"), None);
    c.env(KIND, "emu").env(PEER_IP, "127.0.99.1");
    let out = run(c, T * 3, "survivor (mlx5 under gpuverbs emu)");
    assert!(out.contains("recovered: 3 patterns"), "{out}");
    eprintln!("{out}");
}
