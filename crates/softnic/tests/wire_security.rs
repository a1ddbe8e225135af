//! Adversarial packets at a wire port, crafted by the test on a plain UDP socket: requests
//! and responses from an address that is not the connected peer's (127.0.0.2 against peers on
//! 127.0.0.1) are dropped and counted with no effect on the QP; duplicate READs are served
//! only inside a READ the responder still holds; ACKs of PSNs never sent, and gap reports
//! naming nothing in flight, are counted.

mod common;
mod wire_util;

use common::*;
use prm::wqe::{Local, Op};
use prm::Completion;
use softnic::wire::packet::{self, aeth, opcode, Aeth, AtomicEth, Bth, Flow, Packet, Reth};
use softnic::{Access, QpState, WireCounters, WireFaults};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};
use wire_util::*;

/// The address the attacker sends from: on loopback, but not the peer's.
const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// A UDP socket on `ip` that crafts RoCEv2 packets for the wire port at `to`. `claimed` is the
/// source address the ICRC is computed over (the connected peer's, as a spoofer would).
struct Raw {
    sock: UdpSocket,
    to: SocketAddr,
    flow: Flow,
}

impl Raw {
    fn new(ip: Ipv4Addr, claimed: Ipv4Addr, to: SocketAddr) -> Self {
        let sock = UdpSocket::bind((ip, 0)).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let SocketAddr::V4(t4) = to else {
            panic!("IPv4 only")
        };
        let flow = Flow {
            src: claimed,
            dst: *t4.ip(),
            sport: sock.local_addr().unwrap().port(),
            dport: to.port(),
        };
        Self { sock, to, flow }
    }

    fn send(&self, p: &Packet<'_>) {
        let mut out = Vec::new();
        packet::encode(p, &self.flow, &mut out).unwrap();
        self.sock.send_to(&out, self.to).unwrap();
    }

    /// Every datagram that arrives until none has for `quiet` (at most 5 s in all).
    fn collect(&self, quiet: Duration) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        let (start, mut last) = (Instant::now(), Instant::now());
        while last.elapsed() < quiet && start.elapsed() < Duration::from_secs(5) {
            if let Ok((n, _)) = self.sock.recv_from(&mut buf) {
                got.push(buf[..n].to_vec());
                last = Instant::now();
            }
        }
        got
    }
}

fn bth(op: u8, qp: u32, psn: u32) -> Bth {
    Bth {
        opcode: op,
        mig_req: true,
        pkey: packet::DEFAULT_PKEY,
        dest_qp: qp,
        psn: psn & packet::MASK24,
        ack_req: true,
        ..Bth::default()
    }
}

fn psn(base: u32, n: u32) -> u32 {
    base.wrapping_add(n) & packet::MASK24
}

/// Waits until the device received `n` more datagrams than in `before`.
fn wait_rx(n: &Node, before: &WireCounters, more: u64) -> WireCounters {
    wait_for("the crafted datagrams", Duration::from_secs(5), || {
        n.dev.counters().wire.rx_packets >= before.rx_packets + more
    });
    // they are counted before they are handled: let the I/O thread finish the last one
    std::thread::sleep(Duration::from_millis(20));
    n.dev.counters().wire
}

fn pair() -> Pair {
    wire_pair(
        wire_opts(),
        wire_opts(),
        1024,
        WireFaults::default(),
        WireFaults::default(),
    )
}

#[test]
fn requests_from_another_address_are_dropped() {
    let _s = serial();
    let mut p = pair();
    let dst = p.b.buf(4096, ALL_REMOTE);
    let atom = p.b.buf(64, ALL_REMOTE);
    let rbuf = p.b.buf(256, Access::LOCAL_WRITE);
    let src = p.a.buf(4096, Access::NONE);
    src.fill(0x42);
    p.eb.ini.post_recv(&[rbuf.sge(0, 256)]).unwrap();
    let epsn = wire_opts().rts.sq_psn; // B expects A's first PSN
    let qpn = p.eb.qpn();
    let to = p.b.dev.wire_addr().unwrap();
    // ICRC over the peer's address (a spoofer knows it) and over the real source
    let spoofers = [
        Raw::new(OTHER, Ipv4Addr::LOCALHOST, to),
        Raw::new(OTHER, OTHER, to),
    ];
    let payload = [0x66u8; 64];
    let before = p.b.dev.counters().wire;
    for raw in &spoofers {
        raw.send(&Packet {
            bth: bth(opcode::WRITE_ONLY, qpn, epsn),
            reth: Some(Reth {
                va: dst.addr(0),
                rkey: dst.rkey().0,
                len: 64,
            }),
            payload: &payload,
            ..Packet::default()
        });
        raw.send(&Packet {
            bth: bth(opcode::SEND_ONLY, qpn, epsn),
            payload: &payload,
            ..Packet::default()
        });
        raw.send(&Packet {
            bth: bth(opcode::FETCH_ADD, qpn, epsn),
            atomic: Some(AtomicEth {
                va: atom.addr(0),
                rkey: atom.rkey().0,
                swap_add: 5,
                compare: 0,
            }),
            ..Packet::default()
        });
        raw.send(&Packet {
            bth: bth(opcode::READ_REQUEST, qpn, epsn),
            reth: Some(Reth {
                va: dst.addr(0),
                rkey: dst.rkey().0,
                len: 4096,
            }),
            ..Packet::default()
        });
        // a "duplicate" READ with a bad key (once took the responder QP to ERR)
        raw.send(&Packet {
            bth: bth(opcode::READ_REQUEST, qpn, psn(epsn, packet::MASK24)),
            reth: Some(Reth {
                va: 0x1000,
                rkey: 0x00de_ad00,
                len: 64,
            }),
            ..Packet::default()
        });
    }
    let sent = 10;
    let c = wait_rx(&p.b, &before, sent);
    assert_eq!(c.rx_wrong_source - before.rx_wrong_source, sent, "{c:?}");
    assert_eq!(
        c.tx_packets, before.tx_packets,
        "answered a spoofed request"
    );
    for raw in &spoofers {
        assert!(raw.collect(Duration::from_millis(50)).is_empty());
    }
    assert_eq!(dst.bytes(), vec![0; 4096], "a spoofed WRITE was applied");
    assert_eq!(atom.bytes(), vec![0; 64], "a spoofed atomic was applied");
    assert_eq!(
        p.eb.ini.poll_recv(),
        None,
        "a spoofed SEND consumed a receive"
    );
    assert_eq!(p.eb.qp.state(), QpState::Rts);
    // the expected PSN did not move and the receive is still there
    let i = p.ea.go(
        &Op::Write {
            remote: dst.remote(0),
            local: Local::Sges(&[src.sge(0, 4096)]),
            imm: None,
        },
        SIG,
    );
    p.ea.expect_req(0x08, i);
    assert_eq!(dst.bytes(), vec![0x42; 4096]);
    let i = p.ea.go(
        &Op::Send {
            local: Local::Sges(&[src.sge(0, 100)]),
            imm: None,
        },
        SIG,
    );
    p.ea.expect_req(0x0a, i);
    match p.eb.recv_cqe() {
        Completion::Resp {
            byte_cnt,
            remote_qpn,
            ..
        } => assert_eq!((byte_cnt, remote_qpn), (100, p.ea.qpn())),
        c => panic!("{c:?}"),
    }
    assert_eq!(rbuf.read(0, 100), vec![0x42; 100]);
}

#[test]
fn forged_responses_from_another_address_are_dropped() {
    let _s = serial();
    let mut p = pair();
    let dst = p.b.buf(4096, ALL_REMOTE);
    let src = p.a.buf(4096, Access::NONE);
    src.fill(0x17);
    let sge = [src.sge(0, 8)];
    let w = |i: usize| Op::Write {
        remote: dst.remote(i * 8),
        local: Local::Sges(&sge),
        imm: None,
    };
    let i = p.ea.go(&w(0), SIG);
    p.ea.expect_req(0x08, i);
    // B's answers are lost for now: A's next WRITE stays outstanding at PSN s+1
    p.b.dev.set_wire_faults(WireFaults::loss(1.0, 1)).unwrap();
    let tx = p.a.dev.counters().wire.tx_packets;
    let i = p.ea.go(&w(1), SIG);
    wait_for("the WRITE on the wire", Duration::from_secs(5), || {
        p.a.dev.counters().wire.tx_packets > tx
    });
    let s = wire_opts().rts.sq_psn;
    let raw = Raw::new(OTHER, Ipv4Addr::LOCALHOST, p.a.dev.wire_addr().unwrap());
    let before = p.a.dev.counters().wire;
    let qpn = p.ea.qpn();
    // a remote access NAK for the outstanding WRITE, an ACK of it, a sequence NAK
    for (psn, syndrome) in [
        (psn(s, 1), aeth::NAK_ACCESS),
        (psn(s, 1), aeth::ACK),
        (psn(s, 1), aeth::NAK_SEQ),
    ] {
        raw.send(&Packet {
            bth: bth(opcode::ACK, qpn, psn),
            aeth: Some(Aeth { syndrome, msn: 1 }),
            ..Packet::default()
        });
    }
    let c = wait_rx(&p.a, &before, 3);
    assert_eq!(c.rx_wrong_source - before.rx_wrong_source, 3, "{c:?}");
    assert_eq!(c.seq_naks_received, before.seq_naks_received);
    assert_eq!(
        p.ea.ini.poll_send(),
        None,
        "a forged ACK or NAK completed the WRITE"
    );
    assert_eq!(p.ea.qp.state(), QpState::Rts);
    // the real answers come back: the WRITE completes as if nothing had happened
    p.b.dev.set_wire_faults(WireFaults::default()).unwrap();
    p.ea.expect_req(0x08, i);
    assert_eq!(dst.read(8, 8), vec![0x17; 8]);
}

/// After one WRITE completed on `p`, sends `forged` ACK packets (PSN, AETH syndrome, MSN) to
/// the requester from the peer's own address (the source port is not checked): each is
/// dropped and counted as unexpected, nothing is resent, no gap report taken, the QP stays in
/// RTS and the next WRITE completes.
fn forged_answers_change_nothing(p: &mut Pair, forged: &[(u32, u8, u32)]) {
    let dst = p.b.buf(64, ALL_REMOTE);
    let src = p.a.buf(64, Access::NONE);
    let op = Op::Write {
        remote: dst.remote(0),
        local: Local::Sges(&[src.sge(0, 64)]),
        imm: None,
    };
    let i = p.ea.go(&op, SIG);
    p.ea.expect_req(0x08, i);
    std::thread::sleep(Duration::from_millis(20));
    let raw = Raw::new(
        Ipv4Addr::LOCALHOST,
        Ipv4Addr::LOCALHOST,
        p.a.dev.wire_addr().unwrap(),
    );
    let before = p.a.dev.counters().wire;
    for &(first, syndrome, msn) in forged {
        raw.send(&Packet {
            bth: bth(opcode::ACK, p.ea.qpn(), first),
            aeth: Some(Aeth { syndrome, msn }),
            ..Packet::default()
        });
    }
    let c = wait_rx(&p.a, &before, forged.len() as u64);
    assert_eq!(
        c.rx_unexpected - before.rx_unexpected,
        forged.len() as u64,
        "{c:?}"
    );
    assert_eq!(c.retransmits, before.retransmits, "{c:?}");
    assert_eq!(c.sr_gap_reports_received, before.sr_gap_reports_received);
    assert_eq!(p.ea.qp.state(), QpState::Rts);
    let i = p.ea.go(&op, SIG);
    p.ea.expect_req(0x08, i);
}

#[test]
fn acks_of_psns_never_sent_are_counted() {
    let _s = serial();
    let s = wire_opts().rts.sq_psn;
    forged_answers_change_nothing(
        &mut pair(),
        &[
            (psn(s, 1000), aeth::ACK, 7),
            (psn(s, 1000), aeth::NAK_SEQ, 7),
        ],
    );
}

#[test]
fn gap_reports_that_name_nothing_in_flight_are_counted() {
    let _s = serial();
    // Gap reports (selective repeat's reserved NAK code) that name PSNs never sent, already
    // acknowledged, or none, and the same to a QP without selective repeat.
    let s = wire_opts().rts.sq_psn;
    for opts in [wire_opts(), go_back_n_opts()] {
        let mut p = wire_pair(
            opts.clone(),
            opts,
            1024,
            WireFaults::default(),
            WireFaults::default(),
        );
        forged_answers_change_nothing(
            &mut p,
            &[
                (psn(s, 1000), aeth::GAP_REPORT, 5),
                (s, aeth::GAP_REPORT, 1),
                (psn(s, 1), aeth::GAP_REPORT, 0),
            ],
        );
    }
}

#[test]
fn duplicate_reads_are_served_only_inside_a_held_read() {
    let _s = serial();
    let mut p = pair();
    let tgt = p.b.buf(16 << 10, ALL_REMOTE);
    fill_random(&tgt, 0x1234);
    let other = p.b.buf(4096, ALL_REMOTE);
    let src = p.a.buf(64, Access::NONE);
    let rdst = p.a.buf(8192, Access::LOCAL_WRITE);
    // WRITE at PSN s, READ of 64 bytes at s+1, READ of 3000 bytes at s+2..s+4 (MTU 1024)
    let i = p.ea.go(
        &Op::Write {
            remote: tgt.remote(12 << 10),
            local: Local::Sges(&[src.sge(0, 8)]),
            imm: None,
        },
        SIG,
    );
    p.ea.expect_req(0x08, i);
    let i = p.ea.go(
        &Op::Read {
            remote: tgt.remote(0),
            local: &[rdst.sge(0, 64)],
        },
        SIG,
    );
    p.ea.expect_req(0x10, i);
    let i = p.ea.go(
        &Op::Read {
            remote: tgt.remote(4096),
            local: &[rdst.sge(4096, 3000)],
        },
        SIG,
    );
    p.ea.expect_req(0x10, i);
    std::thread::sleep(Duration::from_millis(20));
    let s = wire_opts().rts.sq_psn;
    let qpn = p.eb.qpn();
    // from the peer's address: the READs must be judged by what they ask for
    let raw = Raw::new(
        Ipv4Addr::LOCALHOST,
        Ipv4Addr::LOCALHOST,
        p.b.dev.wire_addr().unwrap(),
    );
    let read = |psn: u32, va: u64, rkey: u32, len: u32| Packet {
        bth: bth(opcode::READ_REQUEST, qpn, psn),
        reth: Some(Reth { va, rkey, len }),
        ..Packet::default()
    };
    let key = tgt.rkey().0;
    let before_a = p.a.dev.counters().wire;
    let served = [
        // the 64-byte READ again
        read(psn(s, 1), tgt.addr(0), key, 64),
        // the 3000-byte READ retried from its second response packet
        read(psn(s, 3), tgt.addr(4096 + 1024), key, 3000 - 1024),
    ];
    let dropped = [
        // the WRITE's PSN: no READ there
        read(s, tgt.addr(0), key, 8192),
        // more than the held READ had
        read(psn(s, 1), tgt.addr(0), key, 8192),
        // another part of the region
        read(psn(s, 1), tgt.addr(8192), key, 64),
        // another region
        read(psn(s, 1), other.addr(0), other.rkey().0, 64),
        // a bad key (once took the responder QP to ERR)
        read(psn(s, 1), 0x1000, 0x00de_ad00, 64),
        // inside the range, but the responses would run past the READ's PSN window
        read(psn(s, 4), tgt.addr(4096), key, 3000),
        // long behind: nothing held there
        read(psn(s, packet::MASK24 - 1000), tgt.addr(0), key, 64),
    ];
    let before = p.b.dev.counters().wire;
    let mut c = before.clone();
    // the answers go to the connected peer, A, whatever the source of the requests
    let frames = captured(&p.a.dev, || {
        for d in &dropped {
            raw.send(d);
        }
        for d in &served {
            raw.send(d);
        }
        c = wait_rx(&p.b, &before, (dropped.len() + served.len()) as u64);
        wait_for("the answers at A", Duration::from_secs(5), || {
            p.a.dev.counters().wire.rx_packets >= before_a.rx_packets + 3
        });
    });
    assert!(raw.collect(Duration::from_millis(50)).is_empty());
    let got: Vec<Vec<u8>> = frames.into_iter().map(|(_, _, d)| d).collect();
    assert_eq!(
        c.rx_bad_duplicate_reads - before.rx_bad_duplicate_reads,
        dropped.len() as u64,
        "{c:?}"
    );
    assert_eq!(c.duplicates - before.duplicates, served.len() as u64);
    assert_eq!(p.eb.qp.state(), QpState::Rts);
    // exactly the responses of the two served duplicates, with the bytes they asked for
    let want: Vec<(u8, u32, Vec<u8>)> = vec![
        (opcode::READ_RESPONSE_ONLY, psn(s, 1), tgt.read(0, 64)),
        (
            opcode::READ_RESPONSE_FIRST,
            psn(s, 3),
            tgt.read(4096 + 1024, 1024),
        ),
        (
            opcode::READ_RESPONSE_LAST,
            psn(s, 4),
            tgt.read(4096 + 2048, 3000 - 2048),
        ),
    ];
    let seen: Vec<(u8, u32, Vec<u8>)> = got
        .iter()
        .map(|d| {
            let k = packet::parse(d).unwrap();
            (k.bth.opcode, k.bth.psn, k.payload.to_vec())
        })
        .collect();
    assert_eq!(seen, want);
    // the connection goes on at the expected PSN
    let i = p.ea.go(
        &Op::Read {
            remote: tgt.remote(100),
            local: &[rdst.sge(0, 500)],
        },
        SIG,
    );
    p.ea.expect_req(0x10, i);
    assert_eq!(rdst.read(0, 500), tgt.read(100, 500));
}

#[test]
fn requesters_send_from_an_entropy_port_per_flow() {
    let _s = serial();
    let a = wire_node(WireFaults::default());
    // the peer is this socket: it sees the UDP source port of every request
    let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
    peer.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let gid = softnic::Gid::from_ipv4(Ipv4Addr::LOCALHOST);
    a.dev.add_peer(gid, peer.local_addr().unwrap()).unwrap();
    let src = a.buf(64, Access::NONE);
    let mut eps = Vec::new();
    for k in 0..4u32 {
        let o = wire_opts();
        let ep = endpoint(&a, &o);
        bring_up_to(&ep.qp, &o, gid, 0x40 + k, 0, 1024);
        eps.push(ep);
    }
    for ep in &mut eps {
        // twice: both requests of one flow leave from one port
        for _ in 0..2 {
            ep.go(
                &Op::Write {
                    remote: prm::wqe::RemoteAddr {
                        addr: 0x1000,
                        rkey: prm::Rkey(0x1234),
                    },
                    local: Local::Sges(&[src.sge(0, 64)]),
                    imm: None,
                },
                SIG,
            );
        }
    }
    let bound = a.dev.wire_addr().unwrap().port();
    let mut ports = std::collections::BTreeMap::<u32, std::collections::BTreeSet<u16>>::new();
    let mut buf = [0u8; 2048];
    let start = Instant::now();
    while ports.values().map(|s| s.len()).sum::<usize>() < 4 || ports.len() < 4 {
        assert!(start.elapsed() < Duration::from_secs(5), "{ports:?}");
        let Ok((n, from)) = peer.recv_from(&mut buf) else {
            continue;
        };
        let k = packet::parse(&buf[..n]).unwrap();
        assert_eq!(k.bth.opcode, opcode::WRITE_ONLY);
        ports.entry(k.bth.dest_qp).or_default().insert(from.port());
    }
    // a little longer: retransmissions too come from the flow's port
    let until = Instant::now() + Duration::from_millis(100);
    while Instant::now() < until {
        if let Ok((n, from)) = peer.recv_from(&mut buf) {
            let k = packet::parse(&buf[..n]).unwrap();
            ports.entry(k.bth.dest_qp).or_default().insert(from.port());
        }
    }
    let used: std::collections::BTreeSet<u16> = ports.values().flatten().copied().collect();
    assert_eq!(ports.len(), 4, "{ports:?}");
    assert!(
        ports.values().all(|s| s.len() == 1),
        "one port per flow: {ports:?}"
    );
    assert_eq!(used.len(), 4, "a port of its own for each flow: {ports:?}");
    assert!(
        used.iter()
            .all(|p| (0xC000..=0xFFFF).contains(p) && *p != bound),
        "entropy ports: {ports:?} (bound {bound})"
    );
}
