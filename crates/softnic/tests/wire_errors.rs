//! Errors over the wire: every remote error class travels as a NAK and becomes the same
//! requester error CQE (syndrome and vendor syndrome) as on the in-process path, with the
//! same responder completions, the same QP states and the same memory; RNR NAKs retry and
//! exhaust as in-process; retry exhaustion, a vanished peer QP and a dropped peer device give
//! TRANSPORT_RETRY_EXC within the configured timeouts.

mod common;
mod wire_util;

use common::*;
use prm::wqe::{Local, Op, RemoteAddr};
use prm::{Completion, Lkey, Rkey, Sge, Syndrome};
use softnic::outcome::vendor;
use softnic::{Access, QpState, RtsAttr, WireFaults};
use std::time::{Duration, Instant};
use wire_util::*;

/// What a scenario left behind.
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    a_send: Vec<Completion>,
    b_recv: Vec<Completion>,
    states: (QpState, QpState),
    mem: Vec<Vec<u8>>,
}

/// Buffers: a source on A (0x11), a target on B (zeros, every right), a result buffer on A,
/// a receive buffer on B.
struct Fx {
    src: Buf,
    dst: Buf,
    res: Buf,
    rbuf: Buf,
}

/// Drains completions until none arrived for `settle`.
fn drain(ep: &mut Ep, recv: bool, settle: Duration) -> Vec<Completion> {
    let mut out = Vec::new();
    let mut last = Instant::now();
    while last.elapsed() < settle {
        let c = if recv {
            ep.ini.poll_recv()
        } else {
            ep.ini.poll_send()
        };
        match c {
            Some(c) => {
                out.push(c);
                last = Instant::now();
            }
            None => std::thread::sleep(Duration::from_micros(100)),
        }
    }
    out
}

fn run_on(mut p: Pair, scenario: &dyn Fn(&mut Pair, &Fx)) -> Outcome {
    let fx = Fx {
        src: p.a.buf(64 << 10, Access::NONE),
        dst: p.b.buf(64 << 10, ALL_REMOTE),
        res: p.a.buf(64, Access::LOCAL_WRITE),
        rbuf: p.b.buf(256, Access::LOCAL_WRITE),
    };
    fx.src.fill(0x11);
    // a good WRITE first, so that error CQEs carry a non-zero wqe_counter
    let i = p.ea.go(
        &Op::Write {
            remote: fx.dst.remote(0),
            local: Local::Sges(&[fx.src.sge(0, 8)]),
            imm: None,
        },
        SIG,
    );
    p.ea.expect_req(0x08, i);
    fx.dst.fill(0);
    scenario(&mut p, &fx);
    let (qa, qb) = (p.ea.qpn(), p.eb.qpn());
    let settle = Duration::from_millis(150);
    let a_send = drain(&mut p.ea, false, settle);
    let b_recv = drain(&mut p.eb, true, Duration::from_millis(30));
    let mem = [&fx.dst, &fx.res, &fx.rbuf]
        .iter()
        .map(|b| {
            assert!(b.guards_intact());
            b.bytes()
        })
        .collect();
    Outcome {
        a_send: a_send.into_iter().map(|c| norm(c, qa, qb)).collect(),
        b_recv: b_recv.into_iter().map(|c| norm(c, qa, qb)).collect(),
        states: (p.ea.qp.state(), p.eb.qp.state()),
        mem,
    }
}

/// Runs `scenario` in-process and over the wire (MTU `mtu`); the outcomes must be equal.
/// Returns the outcome.
fn same(name: &str, oa: Opts, ob: Opts, mtu: u32, scenario: &dyn Fn(&mut Pair, &Fx)) -> Outcome {
    let want = run_on(local_pair(oa.clone(), ob.clone()), scenario);
    let wire = wire_pair(oa, ob, mtu, WireFaults::default(), WireFaults::default());
    let got = run_on(wire, scenario);
    assert_eq!(want, got, "{name}: wire differs from in-process");
    got
}

/// The error CQE of A's WQE `idx` (after the warm-up write, the first WQE is 1).
fn err(syndrome: Syndrome, why: u8, opcode: u8, idx: u16) -> Completion {
    Completion::Error(prm::ErrorCqe {
        responder: false,
        syndrome: syndrome as u8,
        vendor_syndrome: why,
        wqe_opcode: opcode,
        qpn: 0,
        wqe_counter: idx,
    })
}

/// Posts `op` unsignaled, then a signaled WRITE and an unsignaled NOP, in one doorbell.
fn with_trailers(p: &mut Pair, fx: &Fx, op: &Op<'_>) {
    p.ea.post(op, UNSIG);
    let w = Op::Write {
        remote: fx.dst.remote(100),
        local: Local::Sges(&[fx.src.sge(0, 64)]),
        imm: None,
    };
    p.ea.post(&w, SIG);
    p.ea.post(&Op::Nop, UNSIG);
    p.ea.ini.ring();
}

fn wo() -> Opts {
    wire_opts()
}

#[test]
fn remote_access_errors_match() {
    let _s = serial();
    let o = same("bad rkey", wo(), wo(), 1024, &|p, fx| {
        let op = Op::Write {
            remote: RemoteAddr {
                addr: fx.dst.addr(0),
                rkey: Rkey(0x00de_ad00),
            },
            local: Local::Sges(&[fx.src.sge(0, 3000)]),
            imm: None,
        };
        with_trailers(p, fx, &op);
    });
    assert_eq!(
        o.a_send[0],
        err(Syndrome::RemoteAccess, vendor::REMOTE_KEY, 0x08, 1)
    );
    assert_eq!(o.a_send.len(), 3, "error, then one flush per trailer");
    assert_eq!(o.states, (QpState::Err, QpState::Err));
    same(
        "write past the region (multi-packet)",
        wo(),
        wo(),
        256,
        &|p, fx| {
            let op = Op::Write {
                remote: fx.dst.remote((64 << 10) - 1000),
                local: Local::Sges(&[fx.src.sge(0, 1001)]),
                imm: None,
            };
            with_trailers(p, fx, &op);
        },
    );
    same("read past the region", wo(), wo(), 512, &|p, fx| {
        let op = Op::Read {
            remote: fx.dst.remote((64 << 10) - 8),
            local: &[fx.res.sge(0, 16)],
        };
        with_trailers(p, fx, &op);
    });
    let no_atomic = Opts {
        access: Access(Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0),
        ..wo()
    };
    let o = same(
        "atomic without the QP right",
        wo(),
        no_atomic,
        4096,
        &|p, fx| {
            let op = Op::FetchAdd {
                remote: fx.dst.remote(64),
                add: 5,
                result: fx.res.sge(0, 8),
            };
            with_trailers(p, fx, &op);
        },
    );
    assert_eq!(
        o.a_send[0],
        err(Syndrome::RemoteAccess, vendor::REMOTE_KEY, 0x12, 1)
    );
}

#[test]
fn invalid_request_and_receive_errors_match() {
    let _s = serial();
    let o = same("misaligned atomic", wo(), wo(), 1024, &|p, fx| {
        let op = Op::CompareSwap {
            remote: fx.dst.remote(4),
            compare: 0,
            swap: 1,
            result: fx.res.sge(0, 8),
        };
        with_trailers(p, fx, &op);
    });
    assert_eq!(
        o.a_send[0],
        err(Syndrome::RemoteInvalReq, vendor::INVALID_REQUEST, 0x11, 1)
    );
    let o = same("receive too small", wo(), wo(), 1024, &|p, fx| {
        p.eb.ini
            .post_recv(&[fx.rbuf.sge(0, 8), fx.rbuf.sge(16, 8)])
            .unwrap();
        p.eb.ini.post_recv(&[fx.rbuf.sge(32, 32)]).unwrap();
        let op = Op::Send {
            local: Local::Sges(&[fx.src.sge(0, 17)]),
            imm: None,
        };
        with_trailers(p, fx, &op);
    });
    assert_eq!(
        o.a_send[0],
        err(Syndrome::RemoteInvalReq, vendor::RECV_BUFFER, 0x0a, 1)
    );
    assert_eq!(
        o.b_recv.len(),
        2,
        "LOCAL_LENGTH, then the next receive flushed"
    );
    let o = same("receive with a bad key", wo(), wo(), 1024, &|p, fx| {
        p.eb.ini
            .post_recv(&[Sge {
                addr: 0x1000,
                len: 64,
                lkey: Lkey(0x00de_ad00),
            }])
            .unwrap();
        let op = Op::Send {
            local: Local::Inline(b"hello"),
            imm: Some(7),
        };
        with_trailers(p, fx, &op);
    });
    assert_eq!(
        o.a_send[0],
        err(Syndrome::RemoteOp, vendor::RECV_BUFFER, 0x0b, 1)
    );
    assert_eq!(o.states, (QpState::Err, QpState::Err));
}

#[test]
fn multi_packet_send_overflowing_its_receive() {
    let _s = serial();
    // The wire finds the overflow at the packet that crosses the buffer's end (earlier packets
    // were placed, as on hardware); completions and states are those of the in-process path.
    let mut p = wire_pair(
        wo(),
        wo(),
        256,
        WireFaults::default(),
        WireFaults::default(),
    );
    let src = p.a.buf(4096, Access::NONE);
    let rbuf = p.b.buf(2048, Access::LOCAL_WRITE);
    let r = p.eb.ini.post_recv(&[rbuf.sge(0, 1000)]).unwrap();
    let i = p.ea.go(
        &Op::Send {
            local: Local::Sges(&[src.sge(0, 2000)]),
            imm: None,
        },
        SIG,
    );
    p.ea.expect_err(Syndrome::RemoteInvalReq, vendor::RECV_BUFFER, 0x0a, i);
    p.eb.expect_recv_err(Syndrome::LocalLength, vendor::RECV_BUFFER, r);
    assert_eq!(
        (p.ea.qp.state(), p.eb.qp.state()),
        (QpState::Err, QpState::Err)
    );
    assert!(rbuf.guards_intact());
    assert!(
        rbuf.read(1000, 1048).iter().all(|&b| b == 0),
        "written past the receive"
    );
}

#[test]
fn rnr_naks_retry_and_exhaust_as_in_process() {
    let _s = serial();
    let rnr = |n| Opts {
        rts: RtsAttr {
            rnr_retry: n,
            ..wo().rts
        },
        ..wo()
    };
    let o = same(
        "SEND without a receive, rnr_retry 2",
        rnr(2),
        wo(),
        1024,
        &|p, fx| {
            let op = Op::Send {
                local: Local::Sges(&[fx.src.sge(0, 3000)]),
                imm: None,
            };
            with_trailers(p, fx, &op);
        },
    );
    assert_eq!(
        o.a_send[0],
        err(Syndrome::RnrRetryExc, vendor::RNR, 0x0a, 1)
    );
    assert_eq!(
        o.states,
        (QpState::Err, QpState::Rts),
        "RNR is not the responder's error"
    );
    same(
        "WRITE_IMM without a receive, rnr_retry 0",
        rnr(0),
        wo(),
        4096,
        &|p, fx| {
            let op = Op::Write {
                remote: fx.dst.remote(0),
                local: Local::Inline(b"x"),
                imm: Some(1),
            };
            with_trailers(p, fx, &op);
        },
    );
    // rnr_retry 7 waits as long as it takes
    let mut p = wire_pair(
        wo(),
        wo(),
        512,
        WireFaults::default(),
        WireFaults::default(),
    );
    let rbuf = p.b.buf(4096, Access::LOCAL_WRITE);
    let src = p.a.buf(4096, Access::NONE);
    src.fill(0x5a);
    let op = Op::Send {
        local: Local::Sges(&[src.sge(0, 3000)]),
        imm: Some(77),
    };
    let idx = p.ea.go(&op, SIG);
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(p.ea.ini.poll_send(), None, "completed without a receive");
    let r = p.eb.ini.post_recv(&[rbuf.sge(0, 4096)]).unwrap();
    p.ea.expect_req(0x0b, idx);
    assert_eq!(
        p.eb.recv_cqe(),
        Completion::Resp {
            kind: prm::cqe::RespKind::SendImm,
            qpn: p.eb.qpn(),
            wqe_counter: r,
            byte_cnt: 3000,
            imm: Some(77),
            remote_qpn: p.ea.qpn(),
        }
    );
    assert_eq!(rbuf.read(0, 3000), vec![0x5a; 3000]);
    assert!(p.a.dev.counters().wire.rnr_naks_received > 0);
}

#[test]
fn local_error_behind_wqes_on_the_wire_completes_in_order() {
    let _s = serial();
    let o = same(
        "bad lkey behind a long write",
        wo(),
        wo(),
        1024,
        &|p, fx| {
            let long = Op::Write {
                remote: fx.dst.remote(0),
                local: Local::Sges(&[fx.src.sge(0, 60 << 10)]),
                imm: None,
            };
            p.ea.post(&long, SIG);
            let bad = Op::Write {
                remote: fx.dst.remote(0),
                local: Local::Sges(&[Sge {
                    addr: fx.src.addr(0),
                    len: 8,
                    lkey: Lkey(0x00de_ad00),
                }]),
                imm: None,
            };
            with_trailers(p, fx, &bad);
        },
    );
    assert!(matches!(
        o.a_send[0],
        Completion::Req { wqe_counter: 1, .. }
    ));
    assert_eq!(
        o.a_send[1],
        err(Syndrome::LocalProt, vendor::LOCAL_KEY, 0x08, 2)
    );
    assert_eq!(o.a_send.len(), 4);
    assert_eq!(o.states, (QpState::Err, QpState::Rts));
}

#[test]
fn fenced_and_mixed_work_matches() {
    let _s = serial();
    same("read, fenced write, atomics", wo(), wo(), 256, &|p, fx| {
        let f = prm::wqe::CtrlFlags {
            signaled: true,
            solicited: false,
            fence: prm::Fence::Small,
        };
        p.ea.post(
            &Op::Read {
                remote: fx.dst.remote(0),
                local: &[fx.res.sge(0, 64)],
            },
            UNSIG,
        );
        p.ea.post(
            &Op::Write {
                remote: fx.dst.remote(0),
                local: Local::Sges(&[fx.src.sge(0, 5000)]),
                imm: None,
            },
            f,
        );
        p.ea.post(
            &Op::FetchAdd {
                remote: fx.dst.remote(8000),
                add: 3,
                result: fx.res.sge(0, 8),
            },
            SIG,
        );
        p.ea.ini.ring();
    });
}

/// Options with a short ACK timeout: 4.2 ms per try, `retry_cnt` retries.
fn short(retry_cnt: u8) -> Opts {
    Opts {
        rts: RtsAttr {
            timeout: 10,
            retry_cnt,
            ..wo().rts
        },
        ..wo()
    }
}

/// Expects TRANSPORT_RETRY_EXC for `idx` between (retries + 1) timeouts and a bound.
fn expect_retry_exc(ea: &mut Ep, idx: u16, retry_cnt: u8, t0: Instant) {
    ea.expect_err(Syndrome::TransportRetryExc, vendor::NO_PEER, 0x08, idx);
    let took = t0.elapsed();
    let one = Duration::from_nanos(4096 << 10);
    assert!(
        took >= one * (retry_cnt as u32 + 1),
        "gave up after {took:?}"
    );
    assert!(took < Duration::from_secs(3), "gave up only after {took:?}");
    ea.expect_flushes_after(2);
}

#[test]
fn retry_exhaustion_when_nothing_comes_back() {
    let _s = serial();
    // B's replies are all lost: A retries retry_cnt times, then gives up
    let mut p = wire_pair(
        short(2),
        wo(),
        1024,
        WireFaults::default(),
        WireFaults::loss(1.0, 1),
    );
    let src = p.a.buf(4096, Access::NONE);
    let dst = p.b.buf(4096, ALL_REMOTE);
    src.fill(3);
    let t0 = Instant::now();
    let idx = p.ea.go(
        &Op::Write {
            remote: dst.remote(0),
            local: Local::Sges(&[src.sge(0, 4096)]),
            imm: None,
        },
        UNSIG,
    );
    expect_retry_exc(&mut p.ea, idx, 2, t0);
    let c = p.a.dev.counters().wire;
    assert_eq!(c.timeouts, 3, "{c:?}");
    // the WRITE itself arrived (once: retransmissions are duplicates)
    assert_eq!(dst.bytes(), vec![3; 4096]);
    assert!(p.b.dev.counters().wire.duplicates > 0);
}

#[test]
fn vanished_peer_qp_and_dropped_peer_device() {
    let _s = serial();
    // the peer QP is destroyed
    let mut p = wire_pair(
        short(1),
        wo(),
        1024,
        WireFaults::default(),
        WireFaults::default(),
    );
    let src = p.a.buf(64, Access::NONE);
    let dst = p.b.buf(64, ALL_REMOTE);
    p.b.dev.destroy_qp(&p.eb.qp);
    let t0 = Instant::now();
    let idx = p.ea.go(
        &Op::Write {
            remote: dst.remote(0),
            local: Local::Sges(&[src.sge(0, 8)]),
            imm: None,
        },
        SIG,
    );
    expect_retry_exc(&mut p.ea, idx, 1, t0);
    assert!(p.b.dev.counters().wire.rx_unknown_qp > 0);
    // the peer device goes away (its port closes)
    let Pair { a, b, mut ea, eb } = wire_pair(
        short(3),
        wo(),
        1024,
        WireFaults::default(),
        WireFaults::default(),
    );
    let src = a.buf(1 << 20, Access::NONE);
    let dst = b.buf(1 << 20, ALL_REMOTE);
    let target = dst.remote(0);
    drop(eb);
    drop(b);
    let t0 = Instant::now();
    let idx = ea.go(
        &Op::Write {
            remote: target,
            local: Local::Sges(&[src.sge(0, 1 << 20)]),
            imm: None,
        },
        SIG,
    );
    expect_retry_exc(&mut ea, idx, 3, t0);
    drop(dst);
}

#[test]
fn peer_not_ready_then_ready_within_the_timeout() {
    let _s = serial();
    let mut p = wire_pair(
        wo(),
        wo(),
        1024,
        WireFaults::default(),
        WireFaults::default(),
    );
    let src = p.a.buf(64, Access::NONE);
    src.fill(0x11);
    let dst = p.b.buf(64, ALL_REMOTE);
    p.eb.qp.modify(softnic::Modify::Reset).unwrap();
    let idx = p.ea.go(
        &Op::Write {
            remote: dst.remote(0),
            local: Local::Sges(&[src.sge(0, 8)]),
            imm: None,
        },
        SIG,
    );
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(p.ea.ini.poll_send(), None);
    bring_up_to(
        &p.eb.qp,
        &wo(),
        p.a.dev.gid(),
        p.ea.qpn(),
        wo().rts.sq_psn,
        1024,
    );
    p.ea.expect_req(0x08, idx);
    assert_eq!(dst.read(0, 8), [0x11; 8]);
}
