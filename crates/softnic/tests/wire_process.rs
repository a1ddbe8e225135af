//! Two processes on 127.0.0.1: the test binary re-executes itself as a responder
//! (`SOFTNIC_WIRE_ROLE=responder`, `--exact child`), the two exchange UDP ports, QPNs and keys
//! over the child's stdin/stdout, and the parent runs every kind of work against the child's
//! memory over RoCEv2 with packet loss on both sides; the child checks its memory itself.
//! A killed child is detected by the parent's retransmission timer (TRANSPORT_RETRY_EXC).

mod common;
mod wire_util;

use common::*;
use prm::wqe::{Local, Op};
use prm::{Completion, Syndrome};
use softnic::outcome::vendor;
use softnic::{Access, Device, Gid, WireFaults};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use wire_util::*;

const ROLE: &str = "SOFTNIC_WIRE_ROLE";
const MIB: usize = 1 << 20;
const SIZE: usize = 16 * MIB;
const SEED: u64 = 0x7e57_0002;

fn env<T: std::str::FromStr>(k: &str) -> T {
    std::env::var(k)
        .unwrap_or_else(|_| panic!("{k} not set"))
        .parse()
        .unwrap_or_else(|_| panic!("{k} malformed"))
}

/// The child's side: a responder that checks its own memory when told to.
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return; // an ordinary run of the suite: nothing to do
    };
    assert_eq!(role, "responder");
    let node = wire_node(WireFaults::loss(env("SOFTNIC_LOSS"), 77));
    let parent: SocketAddr = env("SOFTNIC_PARENT_ADDR");
    let parent_qpn: u32 = env("SOFTNIC_PARENT_QPN");
    let parent_gid = match parent {
        SocketAddr::V4(a) => Gid::from_ipv4(*a.ip()),
        SocketAddr::V6(_) => unreachable!("IPv4 only"),
    };
    node.dev.add_peer(parent_gid, parent).unwrap();
    let o = wire_opts();
    let mut ep = endpoint(&node, &o);
    bring_up_to(&ep.qp, &o, parent_gid, parent_qpn, o.rts.sq_psn, 4096);
    let dst = node.buf(SIZE, ALL_REMOTE);
    let rbuf = node.buf(64, Access::LOCAL_WRITE);
    let r = ep.ini.post_recv(&[rbuf.sge(0, 64)]).unwrap();
    println!(
        "READY {} {} {} {}",
        node.dev.wire_addr().unwrap(),
        ep.qpn(),
        dst.addr(0),
        dst.rkey().0
    );
    std::io::stdout().flush().unwrap();
    // the parent's SEND says it is done
    match ep.ini.wait_recv(Duration::from_secs(60)) {
        Ok(Completion::Resp { wqe_counter, .. }) if wqe_counter == r => {}
        other => panic!("child: no verify message: {other:?}"),
    }
    assert_eq!(rbuf.read(0, 6), b"verify");
    let want = node.buf(SIZE, Access::NONE);
    fill_random(&want, SEED);
    let mut ok = dst.read(0, SIZE - 8) == want.read(0, SIZE - 8);
    ok &= dst.u64_at(SIZE - 8) == want.u64_at(SIZE - 8).wrapping_add(5);
    println!("VERIFIED {}", if ok { "ok" } else { "mismatch" });
    std::io::stdout().flush().unwrap();
    // stay up until the parent closes our stdin
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    fn spawn(parent: &Device, parent_qpn: u32, loss: f64) -> Self {
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args(["--exact", "child", "--nocapture", "--test-threads=1"])
            .env(ROLE, "responder")
            .env(
                "SOFTNIC_PARENT_ADDR",
                parent.wire_addr().unwrap().to_string(),
            )
            .env("SOFTNIC_PARENT_QPN", parent_qpn.to_string())
            .env("SOFTNIC_LOSS", loss.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        Self {
            child,
            stdin,
            lines,
        }
    }

    /// The next line of ours holding `tag` (libtest's own lines skipped; it may print
    /// `test child ... ` in front of our first line).
    fn expect(&self, tag: &str) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let l = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("child said no {tag}"));
            if let Some(at) = l.find(tag) {
                return l[at + tag.len()..]
                    .split_whitespace()
                    .map(String::from)
                    .collect();
            }
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Opens the parent's device and QP, spawns the child and connects to it. Returns the node,
/// its endpoint, the child, and the child's buffer (address, rkey).
fn connect_child(loss: f64, o: &Opts) -> (Node, Ep, Peer, prm::wqe::RemoteAddr) {
    let node = wire_node(WireFaults::loss(loss, 78));
    let ep = endpoint(&node, o);
    let peer = Peer::spawn(&node.dev, ep.qpn(), loss);
    let f = peer.expect("READY ");
    let addr: SocketAddr = f[0].parse().unwrap();
    let qpn: u32 = f[1].parse().unwrap();
    let remote = prm::wqe::RemoteAddr {
        addr: f[2].parse().unwrap(),
        rkey: prm::Rkey(f[3].parse().unwrap()),
    };
    let gid = match addr {
        SocketAddr::V4(a) => Gid::from_ipv4(*a.ip()),
        SocketAddr::V6(_) => unreachable!(),
    };
    node.dev.add_peer(gid, addr).unwrap();
    bring_up_to(&ep.qp, o, gid, qpn, wire_opts().rts.sq_psn, 4096);
    (node, ep, peer, remote)
}

fn at(r: prm::wqe::RemoteAddr, off: usize) -> prm::wqe::RemoteAddr {
    prm::wqe::RemoteAddr {
        addr: r.addr + off as u64,
        rkey: r.rkey,
    }
}

#[test]
fn two_processes_with_loss() {
    let _s = serial();
    let t0 = Instant::now();
    let (node, mut ep, mut peer, remote) = connect_child(0.01, &wire_opts());
    let src = node.buf(SIZE, Access::NONE);
    fill_random(&src, SEED);
    // 16 MiB of writes in 1 MiB WQEs, 16 outstanding, every 8th signaled
    let mut posted = 0;
    while posted < SIZE / MIB {
        let sig = posted % 8 == 7;
        ep.post(
            &Op::Write {
                remote: at(remote, posted * MIB),
                local: Local::Sges(&[src.sge(posted * MIB, MIB as u32)]),
                imm: None,
            },
            flags(sig),
        );
        posted += 1;
        if sig {
            ep.ini.ring();
            let c = ep.send_cqe();
            assert!(matches!(c, Completion::Req { .. }), "{c:?}");
        }
    }
    // READ back the first MiB and a piece across the end
    let back = node.buf(2 * MIB, Access::LOCAL_WRITE);
    let i = ep.go(
        &Op::Read {
            remote,
            local: &[back.sge(0, MIB as u32)],
        },
        SIG,
    );
    ep.expect_req(0x10, i);
    assert!(back.read(0, MIB) == src.read(0, MIB), "READ back differs");
    // an atomic on the last word, with the original value returned
    let res = node.buf(8, Access::LOCAL_WRITE);
    let i = ep.go(
        &Op::FetchAdd {
            remote: at(remote, SIZE - 8),
            add: 5,
            result: res.sge(0, 8),
        },
        SIG,
    );
    ep.expect_req(0x12, i);
    assert_eq!(res.u64_at(0), src.u64_at(SIZE - 8));
    // tell the child to check its memory
    let i = ep.go(
        &Op::Send {
            local: Local::Inline(b"verify"),
            imm: None,
        },
        SIG,
    );
    ep.expect_req(0x0a, i);
    assert_eq!(peer.expect("VERIFIED "), ["ok"]);
    drop(peer.stdin.take());
    let status = peer.child.wait().unwrap();
    assert!(status.success(), "child exited with {status}");
    let c = node.dev.counters().wire;
    eprintln!(
        "two processes: 16 MiB written, read back and verified in {:?}; {} packets, {} \
         retransmitted",
        t0.elapsed(),
        c.tx_packets,
        c.retransmits
    );
    assert!(c.injected_drops > 0 && c.retransmits > 0);
}

#[test]
fn killed_peer_process_gives_transport_retry_exc() {
    let _s = serial();
    let o = Opts {
        rts: softnic::RtsAttr {
            timeout: 12, // 16.8 ms
            retry_cnt: 3,
            ..wire_opts().rts
        },
        ..wire_opts()
    };
    let (node, mut ep, mut peer, remote) = connect_child(0.0, &o);
    let src = node.buf(MIB, Access::NONE);
    src.fill(9);
    let i = ep.go(
        &Op::Write {
            remote,
            local: Local::Sges(&[src.sge(0, 4096)]),
            imm: None,
        },
        SIG,
    );
    ep.expect_req(0x08, i);
    peer.child.kill().unwrap();
    peer.child.wait().unwrap();
    let t0 = Instant::now();
    let i = ep.go(
        &Op::Write {
            remote,
            local: Local::Sges(&[src.sge(0, MIB as u32)]),
            imm: None,
        },
        SIG,
    );
    ep.expect_err(Syndrome::TransportRetryExc, vendor::NO_PEER, 0x08, i);
    let took = t0.elapsed();
    let one = Duration::from_nanos(4096 << 12);
    assert!(took >= one * 4, "gave up after {took:?}");
    assert!(took < Duration::from_secs(5), "gave up only after {took:?}");
    ep.expect_flushes_after(2);
}
