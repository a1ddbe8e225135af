//! Error classes, continued from `errors.rs` (same fixture, `errors_util`): doorbells that
//! name another QP or run too far, a peer QP or device gone (TRANSPORT_RETRY_EXC), a peer not
//! ready yet, injected failures and dropped doorbells, delayed completions, a WAIT on an
//! unknown CQ, and a QP moved to ERR by hand.

mod common;
mod errors_util;

use common::*;
use errors_util::*;
use prm::doorbell::DoorbellValue;
use prm::wqe::{Local, Op};
use prm::Syndrome;
use softnic::outcome::vendor;
use softnic::{Fault, QpState};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------- doorbells

#[test]
fn doorbell_with_another_qpn() {
    let mut fx = Fx::new();
    fx.warm_up();
    let pi = fx.p.ea.ini.producer();
    let ci = fx.p.ea.qp.sq_consumer();
    assert_eq!(pi, ci);
    let idx = fx.p.ea.post(&Op::Nop, SIG);
    fx.p.ea.set_dbrec(pi + 1);
    let h = 1
        - (0..2)
            .find(|&h| fx.p.ea.reg_value(h).index() == pi)
            .unwrap_or(1);
    fx.p.ea.ring_raw(
        &fx.p.a.dev,
        h,
        DoorbellValue::from_pi(pi + 1, fx.p.ea.qpn() ^ 0x40),
    );
    fx.p.ea
        .expect_err(Syndrome::LocalQpOp, vendor::DOORBELL_QPN, 0, ci);
    assert_eq!(fx.p.ea.qp.state(), QpState::Err);
    // the WQE it (wrongly) announced flushes at the next good doorbell, then later ones
    fx.p.ea.ini.ring();
    fx.p.ea.expect_flush(0, idx);
    fx.p.ea.expect_flushes_after(2);
    let c = fx.p.a.dev.counters();
    assert_eq!(c.bad_doorbells, 1);
}

#[test]
fn doorbell_producer_too_far_ahead_and_behind() {
    // too far ahead: more than a ring (64 blocks) past the consumer, in DBREC and value
    let mut fx = Fx::new();
    fx.warm_up();
    let ci = fx.p.ea.qp.sq_consumer();
    fx.p.ea.set_dbrec(ci + 65);
    fx.p.ea.ring_raw(
        &fx.p.a.dev,
        0,
        DoorbellValue::from_pi(ci + 65, fx.p.ea.qpn()),
    );
    fx.p.ea
        .expect_err(Syndrome::LocalQpOp, vendor::DOORBELL_AHEAD, 0, ci);
    assert_eq!(fx.p.ea.qp.state(), QpState::Err);
    fx.p.ea.expect_flushes_after(2);
    fx.untouched();

    // behind: the consumer is at 4, both DBREC and value say 2
    let mut fx = Fx::with(
        Opts {
            ring: softnic::initiator::RingMode::Doca,
            ..Opts::default()
        },
        Opts::default(),
    );
    for _ in 0..4 {
        let i = fx.p.ea.go(&Op::Nop, SIG);
        fx.p.ea.expect_req(0, i);
    }
    assert_eq!(fx.p.ea.qp.sq_consumer(), 4);
    fx.p.ea.set_dbrec(2);
    fx.p.ea
        .ring_raw(&fx.p.a.dev, 0, DoorbellValue::from_pi(2, fx.p.ea.qpn()));
    fx.p.ea
        .expect_err(Syndrome::LocalQpOp, vendor::DOORBELL_BEHIND, 0, 4);
    fx.p.ea.expect_flushes_after(3);
    assert_eq!(fx.p.a.dev.counters().bad_doorbells, 1);
}

#[test]
fn stale_doorbell_value_with_a_good_dbrec_is_accepted() {
    // Documented: the device takes the furthest producer that fits from DBREC and value.
    let mut fx = Fx::new();
    fx.warm_up();
    let idx = fx.p.ea.post(&Op::Nop, SIG);
    fx.p.ea.set_dbrec(idx + 1);
    fx.p.ea.ring_raw(
        &fx.p.a.dev,
        0,
        DoorbellValue::from_pi(idx.wrapping_sub(30), fx.p.ea.qpn()),
    );
    fx.p.ea.expect_req(0, idx);
    assert_eq!(fx.p.ea.qp.state(), QpState::Rts);
}

// ---------------------------------------------------------------- peer gone

#[test]
fn destroyed_peer_qp_times_out_with_transport_retry_exc() {
    // timeout 10 → 4.19 ms per try, retry_cnt 2 → 3 tries ≈ 12.6 ms
    let oa = Opts {
        rts: softnic::RtsAttr {
            timeout: 10,
            retry_cnt: 2,
            ..Opts::default().rts
        },
        ..Opts::default()
    };
    let mut fx = Fx::with(oa, Opts::default());
    fx.warm_up();
    fx.p.b.dev.destroy_qp(&fx.p.eb.qp);
    let op = Op::Write {
        remote: fx.dst.remote(0),
        local: Local::Sges(&[fx.src.sge(0, 8)]),
        imm: None,
    };
    let t0 = Instant::now();
    let idx = fx.p.ea.go(&op, UNSIG);
    fx.p.ea
        .expect_err(Syndrome::TransportRetryExc, vendor::NO_PEER, 0x08, idx);
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_micros(4096 * 3 * 1024 / 1000),
        "gave up after {took:?}"
    );
    assert!(took < Duration::from_secs(5));
    fx.p.ea.expect_flushes_after(2);
    fx.untouched();
}

#[test]
fn dropped_peer_device_times_out_with_transport_retry_exc() {
    let oa = Opts {
        rts: softnic::RtsAttr {
            timeout: 8,
            retry_cnt: 1,
            ..Opts::default().rts
        },
        ..Opts::default()
    };
    let mut fx = Fx::with(oa, Opts::default());
    fx.warm_up();
    let Fx {
        p,
        src,
        dst,
        res: _res,
    } = fx;
    let Pair { a, b, mut ea, eb } = p;
    // the peer device goes away while a handle to its QP is still held
    let t = dst.remote(0);
    drop(b);
    let op = Op::Write {
        remote: t,
        local: Local::Sges(&[src.sge(0, 8)]),
        imm: None,
    };
    let idx = ea.go(&op, SIG);
    ea.expect_err(Syndrome::TransportRetryExc, vendor::NO_PEER, 0x08, idx);
    ea.expect_flushes_after(2);
    assert!(dst.bytes().iter().all(|&x| x == 0));
    drop(eb);
    drop(a);
}

#[test]
fn peer_not_ready_then_ready_within_the_timeout() {
    // a peer that is not yet in RTR is retried until it is
    let oa = Opts {
        rts: softnic::RtsAttr {
            timeout: 18,
            retry_cnt: 7,
            ..Opts::default().rts
        },
        ..Opts::default()
    };
    let fx = Fx::with(oa, Opts::default());
    let Fx {
        p,
        src,
        dst,
        res: _res,
    } = fx;
    let Pair { a, b, mut ea, eb } = p;
    eb.qp.modify(softnic::Modify::Reset).unwrap();
    let op = Op::Write {
        remote: dst.remote(0),
        local: Local::Sges(&[src.sge(0, 8)]),
        imm: None,
    };
    let idx = ea.go(&op, SIG);
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(ea.ini.poll_send(), None);
    eb.qp
        .modify(softnic::Modify::Init { access: ALL_REMOTE })
        .unwrap();
    eb.qp
        .modify(softnic::Modify::Rtr(softnic::RtrAttr {
            remote_gid: a.dev.gid(),
            remote_qpn: ea.qpn(),
            rq_psn: 0,
            mtu: 1024,
            min_rnr_timer: 1,
            selective_repeat: false,
        }))
        .unwrap();
    ea.expect_req(0x08, idx);
    assert_eq!(dst.read(0, 8), [0x11; 8]);
    drop((eb, b));
}

// ---------------------------------------------------------------- fault injection

#[test]
fn injected_failure() {
    let mut fx = Fx::new();
    fx.warm_up();
    fx.p.ea.qp.inject(Fault::FailNext {
        count: 1,
        syndrome: Syndrome::RemoteOp,
    });
    let op = Op::Write {
        remote: fx.dst.remote(0),
        local: Local::Sges(&[fx.src.sge(0, 8)]),
        imm: None,
    };
    let idx = fx.p.ea.post(&op, UNSIG);
    let after = fx.trailers();
    fx.p.ea.ini.ring();
    fx.p.ea
        .expect_err(Syndrome::RemoteOp, vendor::INJECTED, 0x08, idx);
    for (o, i) in after {
        fx.p.ea.expect_flush(o, i);
    }
    fx.p.ea.expect_flushes_after(2);
    fx.untouched();
    // only the requester is affected
    assert_eq!(fx.p.eb.qp.state(), QpState::Rts);
    // NOPs fail too
    let mut fx = Fx::new();
    fx.p.ea.qp.inject(Fault::FailNext {
        count: 1,
        syndrome: Syndrome::LocalQpOp,
    });
    let idx = fx.p.ea.go(&Op::Nop, UNSIG);
    fx.p.ea
        .expect_err(Syndrome::LocalQpOp, vendor::INJECTED, 0, idx);
    fx.p.ea.expect_flushes_after(1);
}

#[test]
fn dropped_doorbell_means_no_completion_until_the_next_one() {
    for mode in [
        softnic::initiator::RingMode::RdmaCore,
        softnic::initiator::RingMode::Doca,
    ] {
        let mut fx = Fx::with(
            Opts {
                ring: mode,
                ..Opts::default()
            },
            Opts::default(),
        );
        fx.p.ea.qp.inject(Fault::DropDoorbells(1));
        let op = Op::Write {
            remote: fx.dst.remote(0),
            local: Local::Inline(b"first"),
            imm: None,
        };
        let i0 = fx.p.ea.go(&op, SIG);
        // the engine must have seen (and dropped) this doorbell before the next one replaces
        // it (DOCA writers use one half)
        wait_until("the dropped doorbell", || {
            fx.p.a.dev.counters().doorbells_dropped == 1
        });
        std::thread::sleep(Duration::from_millis(10));
        assert_eq!(fx.p.ea.ini.poll_send(), None);
        assert_eq!(fx.dst.read(0, 5), [0; 5], "WQE of a dropped doorbell ran");
        let op = Op::Write {
            remote: fx.dst.remote(8),
            local: Local::Inline(b"second"),
            imm: None,
        };
        let i1 = fx.p.ea.go(&op, SIG);
        fx.p.ea.expect_req(0x08, i0);
        fx.p.ea.expect_req(0x08, i1);
        assert_eq!(fx.dst.read(0, 5), b"first");
        assert_eq!(fx.dst.read(8, 6), b"second");
        let c = fx.p.a.dev.counters();
        assert_eq!(c.doorbells_dropped, 1);
        assert_eq!(c.doorbells_seen, 2);
    }
}

#[test]
fn delayed_completions_arrive_late_but_in_order() {
    let mut fx = Fx::new();
    let d = Duration::from_millis(60);
    fx.p.ea.qp.inject(Fault::DelayCompletions(d));
    let t0 = Instant::now();
    let op = Op::Write {
        remote: fx.dst.remote(0),
        local: Local::Inline(b"delayed"),
        imm: None,
    };
    let i0 = fx.p.ea.go(&op, SIG);
    let i1 = fx.p.ea.go(&Op::Nop, SIG);
    // the work happens now; only its CQE is late
    wait_until("the write", || fx.dst.read(0, 7) == b"delayed");
    if t0.elapsed() < d {
        assert_eq!(fx.p.ea.ini.poll_send(), None, "CQE before its delay");
    }
    fx.p.ea.expect_req(0x08, i0);
    assert!(t0.elapsed() >= d, "CQE after {:?}", t0.elapsed());
    fx.p.ea.expect_req(0x00, i1);
    // error CQEs are delayed the same way
    let t1 = Instant::now();
    let bad = Op::Write {
        remote: fx.dst.remote(4095),
        local: Local::Inline(b"xx"),
        imm: None,
    };
    let i2 = fx.p.ea.go(&bad, SIG);
    fx.p.ea
        .expect_err(Syndrome::RemoteAccess, vendor::REMOTE_KEY, 0x08, i2);
    assert!(t1.elapsed() >= d);
    fx.p.ea.qp.inject(Fault::DelayCompletions(Duration::ZERO));
    fx.p.ea.expect_flushes_after(2);
}

// ---------------------------------------------------------------- misc

#[test]
fn wait_on_a_qp_without_cross_channel_is_local_qp_op() {
    // (a WAIT on an unknown CQ, from a cross-channel QP: tests/cross_channel.rs)
    let mut fx = Fx::new();
    let op = Op::Wait {
        cqn: 0xfff,
        max_index: 1,
    };
    fx.fails(&op, Syndrome::LocalQpOp, vendor::NOT_CROSS_CHANNEL);
}

#[test]
fn modify_to_err_flushes_sq_and_rq() {
    let mut fx = Fx::new();
    fx.warm_up();
    let r = fx.p.ea.ini.post_recv(&[fx.res.sge(0, 8)]).unwrap();
    fx.p.ea.qp.modify(softnic::Modify::Err).unwrap();
    fx.p.ea.expect_recv_err(Syndrome::WrFlush, 0, r);
    fx.p.ea.expect_flushes_after(3);
    fx.untouched();
}
