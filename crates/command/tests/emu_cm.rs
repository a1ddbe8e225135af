//! `gpuverbs emu` serves the RDMA connection manager: librdmacm's programs (rdmacm-utils'
//! `rping`, `ucmatose`, `udaddy`, `mckey`, `rdma_server` / `rdma_client`, rsockets' `rstream`,
//! perftest's `-R` mode), server and client each under its own `gpuverbs emu` with its own address
//! (127.0.200.x .. 127.0.219.x, used by no other test), connect through the emulated ucma
//! device and CM messages on QP1 between their soft NICs, move data with their own checks, and
//! disconnect. Both sides must exit 0, and their soft NICs' counters must show no sanitizer
//! complaint.
//!
//! Needs Debian's rdmacm-utils and perftest (CI installs them); a missing tool fails the test
//! with the package to install.

mod emu_util;
use emu_util::*;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Whether a UDP socket is bound to `ip`:`port` (from /proc/net/udp): the server's soft NIC
/// started.
fn udp_bound(ip: [u8; 4], port: u16) -> bool {
    let want = format!(
        "{:02X}{:02X}{:02X}{:02X}:{:04X}",
        ip[3], ip[2], ip[1], ip[0], port
    );
    std::fs::read_to_string("/proc/net/udp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .any(|l| l.split_whitespace().nth(1) == Some(want.as_str()))
}

/// A server's launcher: its process group is killed when the test ends early.
struct Server(Option<std::process::Child>);

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            // SAFETY: plain system call on the process group this test started.
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.wait();
        }
    }
}

/// Runs `server` under `gpuverbs emu --ip 127.0.<net>.1` and, once its device is up,
/// `client` under `--ip 127.0.<net>.2` (`SIP` in either stands for the server's address).
/// Returns both outputs; both must exit 0 with clean counters.
///
/// A client whose request comes before the server listens is rejected (no listener: REJ,
/// invalid service ID), as on a ConnectX host; the pair then runs again (perftest's `-R` makes
/// two connections one after the other, and its client's second can overtake its server's
/// second listen on a loaded machine).
fn cm_pair(net: u8, server: &[&str], client: &[&str]) -> (String, String) {
    assert!(
        (200..220).contains(&net),
        "127.0.200.x .. 127.0.219.x are this file's"
    );
    let sip = format!("127.0.{net}.1");
    let cip = format!("127.0.{net}.2");
    let subst = |a: &[&str]| -> Vec<String> { a.iter().map(|s| s.replace("SIP", &sip)).collect() };
    let (sargs, cargs) = (subst(server), subst(client));
    let sargs: Vec<&str> = sargs.iter().map(String::as_str).collect();
    let cargs: Vec<&str> = cargs.iter().map(String::as_str).collect();
    let (sc, cc) = (tmp(&format!("cm-{net}-s")), tmp(&format!("cm-{net}-c")));
    let (swhat, cwhat) = (
        format!("{} server", sargs[0]),
        format!("{} client", cargs[0]),
    );
    for attempt in 1.. {
        let mut srv = Server(Some(
            emu(&sip, Some(&sc), &sargs)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        ));
        let t = Instant::now();
        while !udp_bound([127, 0, net, 1], 4791) {
            if let Some(st) = srv.0.as_mut().and_then(|c| c.try_wait().unwrap()) {
                let o = srv.0.take().unwrap().wait_with_output().unwrap();
                panic!(
                    "{swhat} ended ({st}) before it started its device:\n{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                );
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{swhat} never started its device"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // from the device's start to its listen is the program's own set-up
        std::thread::sleep(Duration::from_millis(300));
        let child = emu(&cip, Some(&cc), &cargs)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let o = wait(child, Duration::from_secs(120), &cwhat);
        let c =
            String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        if !o.status.success() {
            // RC: REJ (invalid service ID); UD: SIDR_REP "service ID not supported"
            assert!(
                (c.contains("REJECTED") || c.contains("UNREACHABLE; error: 1")) && attempt < 5,
                "{cwhat} failed ({}):\n{c}",
                o.status
            );
            continue;
        }
        let so = wait(srv.0.take().unwrap(), Duration::from_secs(60), &swhat);
        let s =
            String::from_utf8_lossy(&so.stdout).to_string() + &String::from_utf8_lossy(&so.stderr);
        assert!(so.status.success(), "{swhat} failed:\n{s}\nclient:\n{c}");
        check_counters_flush_ok(&cc, &cwhat, true);
        check_counters_flush_ok(&sc, &swhat, false);
        return (c, s);
    }
    unreachable!()
}

/// The ping lines rping prints with `-v`: `ping data: rdma-ping-<n>: <rotating alphabet>`.
fn check_pings(out: &str, count: usize, side: &str) {
    let pings: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("ping data: rdma-ping-"))
        .collect();
    assert_eq!(pings.len(), count, "{side}:\n{out}");
    for (n, l) in pings.iter().enumerate() {
        let data = l.split(": ").nth(2).unwrap_or("");
        let want: String = (0..data.len())
            .map(|k| (b'A' + ((n + k) % (b'z' - b'A' + 1) as usize) as u8) as char)
            .collect();
        assert!(l.contains(&format!("rdma-ping-{n}: ")), "{side}: {l}");
        assert_eq!(data, want, "{side}: ping {n}");
    }
}

#[test]
fn rping_pings_and_validates_every_buffer() {
    need("rping", "rdmacm-utils");
    let _g = serial();
    // -V: both sides compare every buffer (the server's RDMA READ of the client's, the
    // client's of the server's RDMA WRITE); -v: they print it too
    let (c, s) = cm_pair(
        200,
        &[
            "rping", "-s", "-a", "SIP", "-p", "7200", "-v", "-V", "-C", "20", "-S", "100",
        ],
        &[
            "rping", "-c", "-a", "SIP", "-p", "7200", "-v", "-V", "-C", "20", "-S", "100",
        ],
    );
    check_pings(&c, 20, "client");
    check_pings(&s, 20, "server");
    for (side, out) in [("client", &c), ("server", &s)] {
        assert!(!out.contains("mismatch"), "{side}:\n{out}");
    }
    assert!(s.contains("DISCONNECT EVENT"), "server:\n{s}");
}

#[test]
fn rping_with_its_own_qp_transitions() {
    need("rping", "rdmacm-utils");
    let _g = serial();
    // -q: the program moves its QP itself with rdma_init_qp_attr's attributes
    let (c, s) = cm_pair(
        201,
        &[
            "rping", "-s", "-a", "SIP", "-p", "7201", "-q", "-V", "-C", "10", "-S", "4000",
        ],
        &[
            "rping", "-c", "-a", "SIP", "-p", "7201", "-q", "-V", "-C", "10", "-S", "4000",
        ],
    );
    for (side, out) in [("client", &c), ("server", &s)] {
        assert!(!out.contains("mismatch"), "{side}:\n{out}");
    }
}

#[test]
fn ucmatose_connects_several_and_moves_data() {
    need("ucmatose", "rdmacm-utils");
    let _g = serial();
    let (c, s) = cm_pair(
        202,
        &[
            "ucmatose", "-p", "7202", "-c", "4", "-C", "50", "-S", "4096",
        ],
        &[
            "ucmatose", "-s", "SIP", "-p", "7202", "-c", "4", "-C", "50", "-S", "4096",
        ],
    );
    for (side, out) in [("client", &c), ("server", &s)] {
        assert!(out.contains("data transfers complete"), "{side}:\n{out}");
        assert!(out.contains("return status 0"), "{side}:\n{out}");
    }
    assert!(s.contains("disconnected"), "server:\n{s}");
}

#[test]
fn udaddy_resolves_a_ud_service_and_exchanges_datagrams() {
    need("udaddy", "rdmacm-utils");
    let _g = serial();
    let (c, s) = cm_pair(
        203,
        // (udaddy's -p is the port space; it uses port 7174)
        &["udaddy", "-c", "2", "-C", "20", "-S", "512"],
        &["udaddy", "-s", "SIP", "-c", "2", "-C", "20", "-S", "512"],
    );
    for (side, out) in [("client", &c), ("server", &s)] {
        assert!(out.contains("data transfers complete"), "{side}:\n{out}");
        assert!(out.contains("return status 0"), "{side}:\n{out}");
    }
}

#[test]
fn rdma_server_and_rdma_client() {
    need("rdma_server", "rdmacm-utils");
    let _g = serial();
    let (c, s) = cm_pair(
        204,
        &["rdma_server", "-p", "7204"],
        &["rdma_client", "-s", "SIP", "-p", "7204"],
    );
    assert!(c.contains("rdma_client: end 0"), "client:\n{c}");
    assert!(s.contains("rdma_server: end 0"), "server:\n{s}");
}

#[test]
fn rstream_over_rsockets_verifies_its_data() {
    need("rstream", "rdmacm-utils");
    let _g = serial();
    // -T v: rsockets (not TCP: that is -T s) with every transfer's bytes verified
    let (c, s) = cm_pair(
        205,
        &[
            "rstream", "-p", "7205", "-T", "v", "-S", "4096", "-C", "200",
        ],
        &[
            "rstream", "-s", "SIP", "-p", "7205", "-T", "v", "-S", "4096", "-C", "200",
        ],
    );
    for (side, out) in [("client", &c), ("server", &s)] {
        let row = out
            .lines()
            .find(|l| l.starts_with("custom"))
            .unwrap_or_else(|| panic!("{side}: no result row:\n{out}"));
        let f: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(&f[1..3], &["4k", "200"], "{side}: {row}");
    }
}

#[test]
fn perftest_over_rdma_cm() {
    need("ib_write_bw", "perftest");
    let _g = serial();
    for (i, (tool, size)) in [
        ("ib_write_bw", "65536"),
        ("ib_read_bw", "4096"),
        ("ib_send_bw", "4096"),
        ("ib_send_lat", "8"),
        ("ib_write_lat", "8"),
    ]
    .into_iter()
    .enumerate()
    {
        let port = (7210 + i).to_string();
        let args = ["-R", "-x", "0", "-n", "200", "-s", size, "-p", &port];
        let mut sargs = vec![tool];
        sargs.extend_from_slice(&args);
        let mut cargs = sargs.clone();
        cargs.push("SIP");
        let (c, s) = cm_pair(206 + i as u8, &sargs, &cargs);
        for (side, out) in [("client", &c), ("server", &s)] {
            let r = rows(out);
            assert!(
                r.iter().any(
                    |row| row[0] as u64 == size.parse::<u64>().unwrap() && row[1] as u64 == 200
                ),
                "{tool} {side}:\n{out}"
            );
        }
    }
}

#[test]
fn perftest_ud_over_rdma_cm() {
    need("ib_send_bw", "perftest");
    let _g = serial();
    // the CM's SIDR exchange gives each side the other's QPN and Q_Key
    for (i, (tool, size)) in [("ib_send_bw", "1024"), ("ib_send_lat", "64")]
        .into_iter()
        .enumerate()
    {
        let port = (7230 + i).to_string();
        let args = [
            "-R", "-c", "UD", "-x", "0", "-n", "200", "-s", size, "-p", &port,
        ];
        let mut sargs = vec![tool];
        sargs.extend_from_slice(&args);
        let mut cargs = sargs.clone();
        cargs.push("SIP");
        let (c, s) = cm_pair(211 + i as u8, &sargs, &cargs);
        for (side, out) in [("client", &c), ("server", &s)] {
            assert!(
                rows(out).iter().any(
                    |row| row[0] as u64 == size.parse::<u64>().unwrap() && row[1] as u64 == 200
                ),
                "{tool} UD {side}:\n{out}"
            );
        }
    }
}

#[test]
fn a_request_for_a_port_nobody_listens_on_is_rejected() {
    need("rping", "rdmacm-utils");
    let _g = serial();
    // the server's CM answers a REQ for a service it has no listener for with REJ (invalid
    // service ID, 8), as a ConnectX host's does; the client reports REJECTED at once
    let sip = "127.0.215.1";
    let srv = emu(
        sip,
        None,
        &["rping", "-s", "-a", sip, "-p", "7215", "-C", "1"],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let t = Instant::now();
    while !udp_bound([127, 0, 215, 1], 4791) {
        assert!(t.elapsed() < Duration::from_secs(20), "rping never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = emu(
        "127.0.215.2",
        None,
        &["rping", "-c", "-a", sip, "-p", "7216", "-C", "1"],
    );
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let o = wait(child, Duration::from_secs(30), "rping client");
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{text}");
    assert!(text.contains("RDMA_CM_EVENT_REJECTED, error 8"), "{text}");
    // SAFETY: plain system call on the process group this test started.
    unsafe { libc::kill(-(srv.id() as i32), libc::SIGKILL) };
    let _ = srv.wait_with_output();
}

/// Whether a TCP port is listening on IPv4 or IPv6 (qperf's daemon takes an IPv6 socket).
fn listening_any(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 3 && f[3] == "0A" && f[1].ends_with(&want)
            })
    })
}

#[test]
fn qperf_cm_mode_rc_bw_and_rc_lat() {
    need("qperf", "qperf");
    let _g = serial();
    // qperf's daemon forks a child per client; Debian's qperf 0.4.11 child ends its -cm1 test
    // with a crash (rdma_destroy_qp on its listening id, fixed upstream after 0.4.11), and the
    // client then waits for its DISCONNECTED: the emulated kernel's side of a dying process
    // tells the peer (a DREP), as a kernel closing the dead process's files does
    let sip = "127.0.216.1";
    let mut srv = Server(Some(
        emu(sip, None, &["qperf", "-lp", "19830"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let t = Instant::now();
    while !listening_any(19830) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "qperf never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let cc = tmp("cm-216-c");
    let out = run(
        emu(
            "127.0.216.2",
            Some(&cc),
            &[
                "qperf", sip, "-lp", "19830", "-cm1", "-t", "1", "rc_bw", "rc_lat",
            ],
        ),
        Duration::from_secs(60),
        "qperf client",
    );
    let value = |key: &str| -> f64 {
        out.lines()
            .find_map(|l| {
                let l = l.trim();
                l.strip_prefix(key)?
                    .trim_start()
                    .strip_prefix('=')?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no {key}:\n{out}"))
    };
    assert!(value("bw") > 0.0, "{out}");
    assert!(value("latency") > 0.0, "{out}");
    check_counters_flush_ok(&cc, "qperf client", true);
    drop(srv.0.take().map(|mut c| {
        // SAFETY: plain system call on the process group this test started.
        unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
        c.wait()
    }));
}

#[test]
fn cmtime_makes_and_ends_a_hundred_connections() {
    need("cmtime", "rdmacm-utils");
    let _g = serial();
    // the server runs until stopped; the client times each step of 100 connections made at
    // once (create, resolve address and route, QP, connect, disconnect, destroy)
    let sip = "127.0.217.1";
    let mut srv = Server(Some(
        emu(sip, None, &["cmtime", "-p", "7217"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let t = Instant::now();
    while !udp_bound([127, 0, 217, 1], 4791) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "cmtime never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let cc = tmp("cm-217-c");
    let out = run(
        emu(
            "127.0.217.2",
            Some(&cc),
            &["cmtime", "-s", sip, "-p", "7217", "-c", "100"],
        ),
        Duration::from_secs(60),
        "cmtime client",
    );
    for step in [
        "create id",
        "resolve addr",
        "resolve route",
        "create qp",
        "connect",
        "disconnect",
        "destroy",
    ] {
        assert!(
            out.lines().any(|l| l.starts_with(step) && l.contains(':')),
            "no {step} row:\n{out}"
        );
    }
    check_counters_flush_ok(&cc, "cmtime client", false);
    drop(srv.0.take().map(|mut c| {
        // SAFETY: plain system call on the process group this test started.
        unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
        c.wait()
    }));
}

/// A process's ids in its RDMA netlink resource summary (`rdma resource`'s `cm_id`): one bound
/// to mlx5_1's address, one listening on every device (counted on each, as the kernel's
/// internal per-device listeners are). librdmacm through ctypes, netlink through a raw socket.
const CM_IDS: &str = r#"
import ctypes, struct, socket
rdmacm = ctypes.CDLL("librdmacm.so.1")
rdmacm.rdma_create_event_channel.restype = ctypes.c_void_p
c = rdmacm.rdma_create_event_channel()
def listener(ip, port):
    idp = ctypes.c_void_p()
    assert rdmacm.rdma_create_id(ctypes.c_void_p(c), ctypes.byref(idp), None, 0x0106) == 0
    sa = struct.pack('=H', 2) + struct.pack('>H', port) + bytes(ip) + bytes(8)
    assert rdmacm.rdma_bind_addr(idp, ctypes.create_string_buffer(sa, 16)) == 0
    assert rdmacm.rdma_listen(idp, 1) == 0
def request(op, attrs):
    body = b''.join(struct.pack('=HH', 4 + len(p), t) + p + b'\0' * (-len(p) % 4) for t, p in attrs)
    return struct.pack('=IHHII', 16 + len(body), (5 << 10) | op, 1, 1, 0) + body
def attrs(b):
    out = {}
    while len(b) >= 4:
        ln, t = struct.unpack('=HH', b[:4])
        out.setdefault(t & 0x3fff, []).append(b[4:ln])
        b = b[(ln + 3) & ~3:]
    return out
def cm_ids(dev):
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 20)
    s.bind((0, 0))
    s.send(request(9, [(1, struct.pack('=I', dev))]))
    d = s.recv(65536)
    s.close()
    for entry in attrs(attrs(d[16:])[15][0])[16]:
        a = attrs(entry)
        if a[17][0].rstrip(b'\0') == b'cm_id':
            return struct.unpack('=Q', a[18][0])[0]
before = (cm_ids(0), cm_ids(1))
listener([127, 0, 218, 2], 7301)   # on mlx5_1
listener([0, 0, 0, 0], 7302)       # on every device
after = (cm_ids(0), cm_ids(1))
assert before == (0, 0) and after == (1, 2), (before, after)
print('ok')
"#;

#[test]
fn the_resource_summary_counts_the_ids() {
    need("python3", "python3");
    let py = tmp("cm_ids.py");
    std::fs::write(&py, CM_IDS).unwrap();
    let mut c = std::process::Command::new(GPUVERBS);
    c.env("GPUVERBS_PRELOAD", preload()).args([
        "emu",
        "--ip",
        "127.0.218.1",
        "--devices",
        "2",
        "--",
        "/usr/bin/python3",
        py.to_str().unwrap(),
    ]);
    let out = run(c, Duration::from_secs(60), "cm_ids.py");
    let _ = std::fs::remove_file(&py);
    assert!(out.contains("ok"), "{out}");
}

/// mckey (rdma_cm multicast over UD), receiver and sender each under its own `gpuverbs emu`
/// on loopback addresses: both join group 239.216.0.1 (JOIN_MCAST; the MULTICAST_JOIN event's
/// address vector names the IPv4-mapped group GID; librdmacm attaches each QP, and each soft NIC
/// joins the group on `lo`), the sender sends 20 datagrams of 512 bytes to QP 0xFFFFFF, and
/// the receiver, which counts its completions, ends only once all 20 arrived. A second run
/// with `-l` on both sides (IBV_QP_CREATE_BLOCK_SELF_MCAST_LB, through EX_CREATE_QP) and a
/// send-only join (`-o`, no attach) for the sender. Multicast on `lo` works for IPv4 (the
/// kernel loops a datagram sent with IP_MULTICAST_IF on a loopback address back to the
/// sockets that joined on `lo`), so no network namespaces are needed.
#[test]
fn mckey_joins_a_group_and_every_message_arrives() {
    need("mckey", "rdmacm-utils");
    let _g = serial();
    let (rip, sip) = ("127.0.216.1", "127.0.216.2");
    for (k, (rx_extra, tx_extra)) in [(&[][..], &[][..]), (&["-l"][..], &["-l", "-o"][..])]
        .into_iter()
        .enumerate()
    {
        let group = format!("239.216.0.{}", k + 1);
        let (rc, sc) = (tmp(&format!("mckey-{k}-r")), tmp(&format!("mckey-{k}-s")));
        let common = ["-m", group.as_str(), "-C", "20", "-S", "512"];
        let mut rargs = vec!["mckey", "-b", rip];
        rargs.extend(common);
        rargs.extend(rx_extra);
        let mut sargs = vec!["mckey", "-s", "-b", sip];
        sargs.extend(common);
        sargs.extend(tx_extra);
        let mut rx = Server(Some(
            emu(rip, Some(&rc), &rargs)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        ));
        // the receiver's soft NIC joined: its socket for the group is bound
        let t = Instant::now();
        while !udp_bound([239, 216, 0, k as u8 + 1], 4791) {
            if let Some(st) = rx.0.as_mut().and_then(|c| c.try_wait().unwrap()) {
                let o = rx.0.take().unwrap().wait_with_output().unwrap();
                panic!(
                    "mckey receiver ended ({st}) before it joined:\n{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                );
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "mckey receiver never joined"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let tx = emu(sip, Some(&sc), &sargs)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let so = wait(tx, Duration::from_secs(60), "mckey sender");
        let s =
            String::from_utf8_lossy(&so.stdout).to_string() + &String::from_utf8_lossy(&so.stderr);
        assert!(so.status.success(), "sender:\n{s}");
        let ro = wait(
            rx.0.take().unwrap(),
            Duration::from_secs(30),
            "mckey receiver",
        );
        let r =
            String::from_utf8_lossy(&ro.stdout).to_string() + &String::from_utf8_lossy(&ro.stderr);
        assert!(ro.status.success(), "receiver:\n{r}\nsender:\n{s}");
        for (side, out) in [("receiver", &r), ("sender", &s)] {
            assert!(
                out.contains(&format!("joined dgid: ::ffff:{group}")),
                "{side}:\n{out}"
            );
            assert!(out.contains("data transfers complete"), "{side}:\n{out}");
        }
        assert!(r.contains("receiving data transfers"), "receiver:\n{r}");
        check_counters_flush_ok(&sc, "mckey sender", true);
        check_counters_flush_ok(&rc, "mckey receiver", false);
    }
}
