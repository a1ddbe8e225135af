//! Cross-channel: WAIT on a companion QP (a cross-channel master, `QpConfig::cross_channel`)
//! for a CQE of another QP, then a fetch-add on a counter: the NIC-moved completion counters
//! of DOCA GPUNetIO (and of gpuverbs' `put_counter`). The counter must never move before the
//! counted WQE's CQE, nor ever for a counted WQE that failed; a WAIT on a QP that is not a
//! cross-channel master fails (docs/softnic.md, "What WAIT waits for").

mod common;

use common::*;
use prm::wqe::{Local, Op, Opcode};
use prm::{Rkey, Syndrome};
use softnic::outcome::vendor;
use softnic::{Access, QpState};
use std::time::Duration;

const ATOMIC_RW: Access = Access(
    Access::LOCAL_WRITE.0
        | Access::REMOTE_WRITE.0
        | Access::REMOTE_READ.0
        | Access::REMOTE_ATOMIC.0,
);

/// The companion's two WQEs for the main QP's CQE number `cqe`: WAIT, then a fetch-add of 1
/// on `counter` (8 bytes of a buffer the companion reaches, loopback), rung. Returns the
/// indexes of both.
fn count(
    companion: &mut Ep,
    cqn: u32,
    cqe: u32,
    counter: prm::wqe::RemoteAddr,
    res: prm::wqe::Sge,
) -> (u16, u16) {
    let wait = Op::Wait {
        cqn,
        max_index: cqe,
    };
    let fa = Op::FetchAdd {
        remote: counter,
        add: 1,
        result: res,
    };
    let w = companion.post(&wait, UNSIG);
    let f = companion.post(&fa, SIG);
    companion.ini.ring();
    (w, f)
}

fn companion_opts() -> Opts {
    Opts {
        access: ATOMIC_RW,
        cross_channel: true,
        rq_wqes: 0,
        ..Opts::default()
    }
}

#[test]
fn a_wait_on_a_qp_without_cross_channel_fails_with_local_qp_op() {
    let mut p = Pair::new();
    let wait = Op::Wait {
        cqn: p.ea.scq.cqn(),
        max_index: 0,
    };
    let idx = p.ea.go(&wait, SIG);
    p.ea.expect_err(
        Syndrome::LocalQpOp,
        vendor::NOT_CROSS_CHANNEL,
        Opcode::Wait as u8,
        idx,
    );
    assert_eq!(p.ea.qp.state(), QpState::Err);
}

#[test]
fn a_wait_on_an_unknown_cq_fails_with_local_qp_op() {
    let p = Pair::new();
    let mut companion = self_connected(&p.a, &companion_opts());
    let wait = Op::Wait {
        cqn: 0xfff,
        max_index: 1,
    };
    let idx = companion.go(&wait, SIG);
    companion.expect_err(
        Syndrome::LocalQpOp,
        vendor::INVALID_REQUEST,
        Opcode::Wait as u8,
        idx,
    );
}

#[test]
fn a_companion_connected_to_itself_moves_the_counter_only_after_the_counted_write() {
    let o = Opts {
        access: ATOMIC_RW,
        ..Opts::default()
    };
    let mut p = Pair::with(o.clone(), o);
    let mut companion = self_connected(&p.a, &companion_opts());
    let dst = p.b.buf(4096, ATOMIC_RW);
    let ctr = p.a.buf(64, ATOMIC_RW);
    let res = p.a.buf(64, Access::LOCAL_WRITE);
    p.ea.qp
        .inject(softnic::Fault::DelayCompletions(Duration::from_millis(150)));
    for round in 0..3u64 {
        let write = Op::Write {
            remote: dst.remote(64 * round as usize),
            local: Local::Inline(b"counted payload!"),
            imm: None,
        };
        let widx = p.ea.go(&write, SIG);
        // every WQE of the main QP is signaled: WRITE number n makes CQE number n
        let (_, fidx) = count(
            &mut companion,
            p.ea.scq.cqn(),
            round as u32,
            ctr.remote(0),
            res.sge(0, 8),
        );
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(
            ctr.u64_at(0),
            round,
            "the counter moved before its WRITE's CQE"
        );
        assert_eq!(
            companion.ini.poll_send(),
            None,
            "the fetch-add completed early"
        );
        p.ea.expect_req(0x08, widx);
        companion.expect_req(Opcode::AtomicFa as u8, fidx);
        assert_eq!(ctr.u64_at(0), round + 1);
        assert_eq!(
            u64::from_ne_bytes(res.read(0, 8).try_into().unwrap()),
            round
        );
        assert_eq!(dst.read(64 * round as usize, 16), b"counted payload!");
    }
}

#[test]
fn a_counter_never_moves_for_a_counted_write_that_failed() {
    let o = Opts {
        access: ATOMIC_RW,
        ..Opts::default()
    };
    let mut p = Pair::with(o.clone(), o);
    let mut companion = self_connected(&p.a, &companion_opts());
    let dst = p.b.buf(4096, ATOMIC_RW);
    let ctr = p.a.buf(64, ATOMIC_RW);
    let res = p.a.buf(64, Access::LOCAL_WRITE);
    let cqn = p.ea.scq.cqn();
    // CQE 0: a WRITE that completes, counted
    let good = Op::Write {
        remote: dst.remote(0),
        local: Local::Inline(b"good"),
        imm: None,
    };
    let g = p.ea.go(&good, SIG);
    let (_, f0) = count(&mut companion, cqn, 0, ctr.remote(0), res.sge(0, 8));
    p.ea.expect_req(0x08, g);
    companion.expect_req(Opcode::AtomicFa as u8, f0);
    assert_eq!(ctr.u64_at(0), 1);
    // CQE 1: a WRITE into a forged rkey. Its completion is delayed, so the companion's WAIT
    // is already waiting when the error CQE comes; a third counted WRITE behind it is flushed.
    p.ea.qp
        .inject(softnic::Fault::DelayCompletions(Duration::from_millis(100)));
    let mut bad_remote = dst.remote(64);
    bad_remote.rkey = Rkey(bad_remote.rkey.0 ^ 0x5500);
    let bad = Op::Write {
        remote: bad_remote,
        local: Local::Inline(b"bad!"),
        imm: None,
    };
    let b = p.ea.go(&bad, SIG);
    let (w1, f1) = count(&mut companion, cqn, 1, ctr.remote(0), res.sge(8, 8));
    let after = p.ea.go(&good, SIG);
    let (w2, f2) = count(&mut companion, cqn, 2, ctr.remote(0), res.sge(16, 8));
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(
        companion.ini.poll_send(),
        None,
        "the WAIT ended before its CQE"
    );
    p.ea.expect_err(Syndrome::RemoteAccess, vendor::REMOTE_KEY, 0x08, b);
    p.ea.expect_flush(0x08, after);
    // the WAIT for the error CQE ends in error, and everything behind it is flushed
    companion.expect_err(
        Syndrome::WrFlush,
        vendor::WAITED_FOR_ERROR,
        Opcode::Wait as u8,
        w1,
    );
    for (opcode, idx) in [
        (Opcode::AtomicFa as u8, f1),
        (Opcode::Wait as u8, w2),
        (Opcode::AtomicFa as u8, f2),
    ] {
        companion.expect_flush(opcode, idx);
    }
    assert_eq!(companion.qp.state(), QpState::Err);
    assert_eq!(
        ctr.u64_at(0),
        1,
        "a failed or flushed WRITE moved its counter"
    );
    assert_eq!(dst.read(64, 4), [0u8; 4]);
}
