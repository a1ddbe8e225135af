//! The engine: one thread per device that notices doorbells, reads WQEs from the SQ ring (or a
//! BlueFlame register) as a ConnectX would, checks them, executes them against registered
//! memory, and writes CQEs.
//!
//! Requester and responder sides are split so that a transport can sit between them: the
//! requester checks a WQE locally (shared by every route), then either runs it on a peer QP of
//! this process ([`respond`], a function call) or hands it to the wire transport
//! ([`crate::wire`]), which completes it when the peer's ACK arrives. Both [`respond`] and the
//! wire responder run requests through the same responder checks (`Resp`).

use crate::counters::Counters;
use crate::cq::CqError;
use crate::device::{lookup, Shared};
use crate::event::AsyncEvent;
use crate::mem::{copy_ranges, write_range, Access, AccessError, CopyError, MemRange, MrGuard};
use crate::qp::{DoorbellKind, Qp, QpState, RqState, SqState, Stall};
use crate::wire::transport;
use parking_lot::MutexGuard;
use prm::cqe::{Cqe64, ErrorCqe, RespKind};
use prm::doorbell::{DoorbellValue, BF_HALF_SIZE};
use prm::parse::{parse_wqe, sge_of, AtomicKind, ParsedLocal, ParsedOp};
use prm::wqe::{blocks_for_ds, CtrlSeg, DataSeg};
use prm::{Syndrome, DS_UNIT, MAX_WQE_BBS, WQEBB};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Vendor syndromes the soft NIC puts in byte 54 of its error CQEs, so a test (or a person)
/// can tell apart causes that share a syndrome.
pub mod vendor {
    /// The WQE failed the format check (opcode, opmod, ds, inline or atomic length).
    pub const MALFORMED_WQE: u8 = 0x81;
    /// The WQE's control-segment index is not its ring position (stale or half-written WQE:
    /// the initiator published out of order).
    pub const STALE_WQE: u8 = 0x82;
    /// The QPN in the WQE's control segment is not this QP's.
    pub const WQE_QPN: u8 = 0x83;
    /// The QPN in the doorbell value is not this QP's.
    pub const DOORBELL_QPN: u8 = 0x84;
    /// The doorbell producer index is behind the device's consumer index.
    pub const DOORBELL_BEHIND: u8 = 0x85;
    /// The doorbell producer index is more than a ring ahead of the consumer index.
    pub const DOORBELL_AHEAD: u8 = 0x86;
    /// The WQE extends past the producer index, or a BlueFlame WQE past its register.
    pub const WQE_PAST_PRODUCER: u8 = 0x87;
    /// Fault injection.
    pub const INJECTED: u8 = 0x88;
    /// Local key, PD, range or right.
    pub const LOCAL_KEY: u8 = 0x89;
    /// Remote key, PD, range or right (or QP access flags).
    pub const REMOTE_KEY: u8 = 0x8a;
    /// Receive buffer too small, or its key refused.
    pub const RECV_BUFFER: u8 = 0x8b;
    /// No peer answered (absent device or QP, or peer not ready).
    pub const NO_PEER: u8 = 0x8c;
    /// Receiver not ready (no receive WQE posted).
    pub const RNR: u8 = 0x8d;
    /// Misaligned atomic or a WAIT on an unknown CQ.
    pub const INVALID_REQUEST: u8 = 0x8e;
    /// Message longer than the device's maximum.
    pub const TOO_LONG: u8 = 0x8f;
    /// The CQ the completion went to overran.
    pub const CQ_OVERRUN: u8 = 0x90;
    /// A wire response that does not fit its request (opcode or length): BAD_RESP.
    pub const BAD_RESPONSE: u8 = 0x91;
    /// A device-memory (GPU memory) access failed: a payload copy, an atomic, a WQE read from
    /// a GPU-resident ring (the driver's error is logged at warn level).
    pub const DEVICE_MEMORY: u8 = 0x92;
}

/// Largest message (bytes), as ConnectX's `max_msg_sz`.
pub const MAX_MSG: u64 = 1 << 30;

/// Spins of an idle engine before it starts to sleep.
const IDLE_SPINS: u32 = 4096;
/// Longest sleep of an idle engine; a GPU doorbell (which cannot wake the thread) waits at
/// most this long to be noticed.
const MAX_PARK: Duration = Duration::from_micros(500);
/// WQEs one QP runs before the engine looks at the next.
const BUDGET: u32 = 64;

pub(crate) fn run(dev: Arc<Shared>) {
    let mut generation = u64::MAX;
    let (mut qps, mut cqs) = (Vec::new(), Vec::new());
    let mut idle = 0u32;
    let mut park = Duration::from_micros(10);
    while !dev.shutdown.load(Ordering::Acquire) {
        let g = dev.generation.load(Ordering::Acquire);
        if g != generation {
            (qps, cqs) = dev.snapshot();
            generation = g;
        }
        let mut work = false;
        let mut timed = false;
        for qp in &qps {
            let (w, t) = service(&dev, qp);
            work |= w;
            timed |= t;
        }
        let now = Instant::now();
        for cq in &cqs {
            timed |= cq.flush_due(now).unwrap_or_else(|e| {
                count_cq_error(&dev.counters, e);
                false
            });
        }
        if work {
            idle = 0;
            park = Duration::from_micros(10);
        } else {
            idle = idle.saturating_add(1);
            if idle < IDLE_SPINS {
                std::hint::spin_loop();
            } else {
                let limit = if timed {
                    Duration::from_micros(20)
                } else {
                    MAX_PARK
                };
                std::thread::park_timeout(park.min(limit));
                park = (park * 2).min(MAX_PARK);
            }
        }
    }
}

/// Runs one QP: doorbells, the wire transport's timers, then up to [`BUDGET`] WQEs. Returns
/// (did work, waits on time).
fn service(dev: &Shared, qp: &Arc<Qp>) -> (bool, bool) {
    let state = qp.state();
    if state == QpState::Err {
        flush_rq(dev, qp);
    }
    if !matches!(state, QpState::Rts | QpState::Err) {
        return (false, false);
    }
    let mut sq = qp.lock_sq();
    let r = service_locked(dev, qp, &mut sq);
    if sq.wire.is_some() {
        // The I/O thread may be waiting to process ACKs: hand the lock over rather than
        // take it again on the next loop before it got a chance.
        MutexGuard::unlock_fair(sq);
    }
    r
}

/// Completes, now and on the caller's thread, what a QP in ERR still owes: a flush CQE for
/// every receive WQE and every announced send WQE (what a ConnectX has done by the time its
/// transition out of ERR returns). A QP in another state is left alone.
pub(crate) fn drain_err(dev: &Shared, qp: &Arc<Qp>) {
    if qp.state() != QpState::Err {
        return;
    }
    flush_rq(dev, qp);
    // each round executes (flushes) up to BUDGET WQEs; a ring holds at most 32K blocks
    for _ in 0..=(qp.sq_blocks / BUDGET + 1) {
        let mut sq = qp.lock_sq();
        service_locked(dev, qp, &mut sq);
        if sq.ci == sq.target {
            break;
        }
    }
}

fn service_locked(dev: &Shared, qp: &Arc<Qp>, sq: &mut SqState) -> (bool, bool) {
    let mut work = false;
    for h in 0..2 {
        let v = qp.half_word(h);
        if v != sq.last_half[h] {
            sq.last_half[h] = v;
            work = true;
            doorbell(dev, qp, sq, h, v);
        }
    }
    let mut timed = false;
    if sq.wire.is_some() {
        if qp.state() == QpState::Err {
            // WQEs already handed to the wire complete (flush) before those still in the ring.
            work |= transport::flush_all(dev, qp, sq);
        } else {
            let (sent, outstanding) = transport::tick(dev, qp, sq, Instant::now());
            work |= sent;
            timed |= outstanding;
        }
    }
    let mut budget = BUDGET;
    while sq.ci != sq.target && budget > 0 {
        if sq.wire.as_ref().is_some_and(|w| w.blocked) && qp.state() != QpState::Err {
            // a WQE failed behind WQEs still on the wire: nothing runs until it completes
            return (work, true);
        }
        if let Some(stall) = sq.stall {
            let over = match stall {
                Stall::Until(t) => Instant::now() >= t,
                Stall::Wait { cqn, max_index } => dev
                    .cq(cqn)
                    .is_none_or(|cq| cq.produced().wrapping_sub(max_index) as i32 >= 0),
                Stall::Drain => sq.wire.as_ref().is_none_or(|w| w.msgs.is_empty()),
            };
            if !over && qp.state() != QpState::Err {
                return (work, true);
            }
            sq.stall = None;
        }
        budget -= 1;
        work = true;
        step(dev, qp, sq);
    }
    (work, timed || sq.stall.is_some())
}

/// Handles a new value in BlueFlame half `h`.
fn doorbell(dev: &Shared, qp: &Qp, sq: &mut SqState, h: usize, v: u64) {
    if v == 0 {
        // A BlueFlame writer cleared the half before rewriting it: not a doorbell (no valid
        // doorbell is all zeros: its QPN field is never 0).
        return;
    }
    let dv = DoorbellValue::from_u64(v);
    // On a shared register a doorbell for another QP is that QP's; it may have overwritten
    // ours before we saw it, so the doorbell record is looked at all the same.
    let mine = dv.qpn() == qp.qpn;
    if mine || !qp.shared_uar {
        Counters::add(&dev.counters.doorbells, 1);
        if sq.drop_doorbells > 0 {
            sq.drop_doorbells -= 1;
            Counters::add(&dev.counters.doorbells_dropped, 1);
            return;
        }
    }
    if !mine && !qp.shared_uar {
        Counters::add(&dev.counters.bad_doorbells, 1);
        fail(dev, qp, sq, 0, Syndrome::LocalQpOp, vendor::DOORBELL_QPN);
        return;
    }
    let from_value = match dv.ds() {
        0 => dv.index(),
        ds => dv.index().wrapping_add(blocks_for_ds(ds & 0x3f) as u16),
    };
    let rec = u32::from_be(qp.dbrec_word(1).load(Ordering::Acquire)) as u16;
    if !mine {
        let ahead = rec.wrapping_sub(sq.ci);
        if ahead as u32 <= qp.sq_blocks && ahead > sq.target.wrapping_sub(sq.ci) {
            sq.target = rec;
        }
        return;
    }
    let ahead = |pi: u16| pi.wrapping_sub(sq.ci);
    let fits = |d: u16| d as u32 <= qp.sq_blocks;
    let best = [from_value, rec]
        .into_iter()
        .filter(|&pi| fits(ahead(pi)))
        .max_by_key(|&pi| ahead(pi));
    let Some(pi) = best else {
        Counters::add(&dev.counters.bad_doorbells, 1);
        let why = if ahead(from_value) > 0x8000 {
            vendor::DOORBELL_BEHIND
        } else {
            vendor::DOORBELL_AHEAD
        };
        fail(dev, qp, sq, 0, Syndrome::LocalQpOp, why);
        return;
    };
    if ahead(pi) > ahead(sq.target) {
        sq.target = pi;
    }
    if qp.doorbell == DoorbellKind::BlueFlame && dv.ds() != 0 {
        let mut copy = [0u8; BF_HALF_SIZE];
        qp.uar.read(qp.bf_off + h * BF_HALF_SIZE, &mut copy);
        // Writers clear the first 8 bytes, write bytes 8.., then the first 8 bytes (a seqlock):
        // if the half no longer holds `v`, a later write started while we copied and the copy
        // may mix two WQEs. The WQE is in the ring too: it then runs from there. (A ConnectX
        // takes the register write as one burst; memory cannot.)
        std::sync::atomic::fence(Ordering::Acquire);
        if qp.half_word(h) == v {
            copy[..8].copy_from_slice(&v.to_ne_bytes());
            sq.bf = Some((dv.index(), copy));
        } else {
            Counters::add(&dev.counters.bf_torn, 1);
        }
    }
}

/// Reads, checks and runs the WQE at the consumer index.
fn step(dev: &Shared, qp: &Arc<Qp>, sq: &mut SqState) {
    let idx = sq.ci;
    let mut buf = [0u8; MAX_WQE_BBS * WQEBB];
    // A register copy only stands for a WQE still to run. One whose WQE already ran from the
    // ring (its BlueFlame write was seen after the DBREC had announced it) or was skipped is
    // dropped; kept, it would run instead of the ring's WQE when the 16-bit index comes
    // round again, 64K blocks later.
    if matches!(sq.bf, Some((i, _)) if i.wrapping_sub(idx) >= sq.target.wrapping_sub(idx)) {
        sq.bf = None;
    }
    let from_bf = matches!(sq.bf, Some((i, _)) if i == idx);
    let fetched = if let (true, Some((_, copy))) = (from_bf, &sq.bf) {
        buf[..BF_HALF_SIZE].copy_from_slice(copy);
        Counters::add(&dev.counters.bf_run, 1);
        Ok(())
    } else {
        fetch_wqe(qp, sq, idx, &mut buf)
    };
    if let Err(e) = fetched {
        // The ring (device memory) cannot be read: the WQE's size is unknown, so it ends
        // after one block; the blocks behind it fail (flush) the same way, one by one.
        tracing::warn!(qpn = qp.qpn, wqe = idx, error = %e, "WQE fetch failed");
        Counters::add(&dev.counters.devmem_errors, 1);
        if qp.state() == QpState::Err {
            flush_wqe(dev, qp, sq, 0, idx);
        } else {
            fail(dev, qp, sq, 0, Syndrome::LocalQpOp, vendor::DEVICE_MEMORY);
        }
        sq.ci = sq.ci.wrapping_add(1);
        return;
    }
    let ctrl: CtrlSeg = bytemuck::pod_read_unaligned(&buf[..DS_UNIT]);
    let blocks = blocks_for_ds(ctrl.ds().max(1));
    let opcode = ctrl.opcode();
    // Never move past the announced producer: a failed or flushed WQE whose ds claims more
    // blocks than were announced (stale, half-written or past-producer WQE) ends at the
    // producer, or the loop in `service` would flush ~64K blocks of garbage until the 16-bit
    // consumer wrapped around to the target.
    let step_blocks = (blocks as u16).min(sq.target.wrapping_sub(idx));
    let advance = |sq: &mut SqState| {
        sq.ci = sq.ci.wrapping_add(step_blocks);
        if from_bf {
            sq.bf = None;
        }
    };
    if qp.state() == QpState::Err {
        flush_wqe(dev, qp, sq, opcode, idx);
        advance(sq);
        return;
    }
    let past_producer = blocks > sq.target.wrapping_sub(idx) as usize
        || blocks > qp.sq_blocks as usize
        || (from_bf && blocks * WQEBB > BF_HALF_SIZE);
    let check = if ctrl.wqe_index() != idx {
        Counters::add(&dev.counters.stale_wqes, 1);
        Err((Syndrome::LocalQpOp, vendor::STALE_WQE))
    } else if past_producer {
        Err((Syndrome::LocalQpOp, vendor::WQE_PAST_PRODUCER))
    } else if ctrl.qpn() != qp.qpn {
        Err((Syndrome::LocalQpOp, vendor::WQE_QPN))
    } else if let Some((n, syndrome)) = sq.fail_next {
        sq.fail_next = (n > 1).then_some((n - 1, syndrome));
        Err((syndrome, vendor::INJECTED))
    } else {
        Ok(())
    };
    let outcome = check.and_then(|()| {
        let wqe =
            parse_wqe(&buf[..blocks * WQEBB]).map_err(|e| (e.syndrome(), vendor::MALFORMED_WQE))?;
        execute(dev, qp, sq, &wqe).map(|r| (r, wqe.flags.signaled))
    });
    // Behind WQEs still on the wire, a WQE that completes or fails right away takes its turn
    // in the wire's completion order.
    let queued = sq.wire.as_ref().is_some_and(|w| !w.msgs.is_empty());
    match outcome {
        Ok((Done::Complete(byte_cnt), signaled)) if queued => {
            transport::enqueue_local(sq, idx, opcode, signaled, byte_cnt, None);
            advance(sq);
        }
        Ok((Done::Complete(byte_cnt), signaled)) => {
            Counters::add(&dev.counters.wqes, 1);
            sq.rnr_attempts = 0;
            sq.retry_deadline = None;
            if signaled {
                let cqe = Cqe64::requester(opcode, qp.qpn, idx, byte_cnt, 0);
                push_cqe(dev, qp, sq, &qp.send_cq, cqe);
            }
            advance(sq);
        }
        Ok((Done::Queued, _)) => {
            sq.rnr_attempts = 0;
            sq.retry_deadline = None;
            advance(sq);
        }
        Ok((Done::Stalled(stall), _)) => sq.stall = Some(stall),
        Err((syndrome, why)) if queued => {
            tracing::debug!(
                qpn = qp.qpn,
                ?syndrome,
                vendor = why,
                wqe = idx,
                "WQE failed"
            );
            transport::enqueue_local(sq, idx, opcode, true, 0, Some((syndrome, why)));
            advance(sq);
        }
        Err((syndrome, why)) => {
            fail(dev, qp, sq, opcode, syndrome, why);
            advance(sq);
        }
    }
}

/// Reads the WQE at `idx` from the SQ ring into `buf`: its first block, then as many more as
/// its ds names (up to the ring size). From a ring in device memory every block announced so
/// far (up to the largest WQE) comes in one read per contiguous span, since each read is a
/// round trip through the driver.
fn fetch_wqe(
    qp: &Qp,
    sq: &SqState,
    idx: u16,
    buf: &mut [u8; MAX_WQE_BBS * WQEBB],
) -> Result<(), crate::DeviceMemoryError> {
    let ring = &qp.sq_ring;
    let mask = qp.sq_blocks as usize - 1;
    let first = idx as usize & mask;
    let mut have = 1;
    if ring.is_host() {
        ring.try_read(first * WQEBB, &mut buf[..WQEBB])?;
    } else {
        let announced = (sq.target.wrapping_sub(idx) as usize).clamp(1, MAX_WQE_BBS);
        have = announced.min(qp.sq_blocks as usize);
        let head = have.min(qp.sq_blocks as usize - first);
        ring.try_read(first * WQEBB, &mut buf[..head * WQEBB])?;
        if head < have {
            ring.try_read(0, &mut buf[head * WQEBB..have * WQEBB])?;
        }
    }
    let ctrl: CtrlSeg = bytemuck::pod_read_unaligned(&buf[..DS_UNIT]);
    let blocks = blocks_for_ds(ctrl.ds().max(1)).min(qp.sq_blocks as usize);
    for i in have..blocks {
        let slot = (idx as usize + i) & mask;
        ring.try_read(slot * WQEBB, &mut buf[i * WQEBB..(i + 1) * WQEBB])?;
    }
    Ok(())
}

/// Counts a CQE the CQ refused.
pub(crate) fn count_cq_error(c: &Counters, e: CqError) {
    match e {
        CqError::Overrun(_) => Counters::add(&c.cq_overruns, 1),
        CqError::DeviceMemory(_) => Counters::add(&c.devmem_errors, 1),
        CqError::Failed(_) => {}
    }
}

/// Writes a CQE to `cq` on behalf of `qp` (delayed when fault injection asks).
fn push_cqe(dev: &Shared, qp: &Qp, sq: &SqState, cq: &crate::cq::Cq, cqe: Cqe64) {
    push_cqe_delayed(dev, qp, sq.delay, cq, cqe)
}

/// Writes a CQE to `cq` on behalf of `qp`, `delay` late when fault injection asks.
pub(crate) fn push_cqe_delayed(
    dev: &Shared,
    qp: &Qp,
    delay: Option<Duration>,
    cq: &crate::cq::Cq,
    cqe: Cqe64,
) {
    let due = delay.map(|d| Instant::now() + d);
    match cq.push(qp.stamp(cqe), due) {
        Ok(()) => Counters::add(&dev.counters.cqes, 1),
        Err(e) => {
            count_cq_error(&dev.counters, e);
            qp.fatal(AsyncEvent::QpFatal);
        }
    }
}

/// Completes the WQE at the consumer index with an error CQE and moves the QP to ERR.
/// WQEs still on the wire flush first, keeping completions in WQE order.
fn fail(dev: &Shared, qp: &Qp, sq: &mut SqState, opcode: u8, syndrome: Syndrome, why: u8) {
    transport::flush_all(dev, qp, sq);
    dev.counters.error(syndrome);
    tracing::debug!(
        qpn = qp.qpn,
        ?syndrome,
        vendor = why,
        wqe = sq.ci,
        "WQE failed"
    );
    let e = ErrorCqe {
        responder: false,
        syndrome: syndrome as u8,
        vendor_syndrome: why,
        wqe_opcode: opcode,
        qpn: qp.qpn,
        wqe_counter: sq.ci,
    };
    qp.set_state(QpState::Err);
    push_cqe(dev, qp, sq, &qp.send_cq, Cqe64::error(&e, 0));
}

fn flush_wqe(dev: &Shared, qp: &Qp, sq: &SqState, opcode: u8, idx: u16) {
    flush_cqe(dev, qp, sq.delay, opcode, idx)
}

/// Writes the WR_FLUSH CQE of the WQE at `idx`.
pub(crate) fn flush_cqe(dev: &Shared, qp: &Qp, delay: Option<Duration>, opcode: u8, idx: u16) {
    dev.counters.error(Syndrome::WrFlush);
    let e = ErrorCqe {
        responder: false,
        syndrome: Syndrome::WrFlush as u8,
        vendor_syndrome: 0,
        wqe_opcode: opcode,
        qpn: qp.qpn,
        wqe_counter: idx,
    };
    push_cqe_delayed(dev, qp, delay, &qp.send_cq, Cqe64::error(&e, 0));
}

/// Completes every posted receive of a QP in ERR with WR_FLUSH. A QP on an SRQ flushes only
/// the SRQ WQE it holds for a message in progress (the others stay for the SRQ's other QPs)
/// and raises LAST_WQE_REACHED once.
fn flush_rq(dev: &Shared, qp: &Qp) {
    // The state is checked again under the RQ lock: a QP reset (and perhaps brought up and
    // given new receives) since the engine saw ERR must not have them flushed.
    if qp.srq.is_some() {
        let held = {
            let mut rq = qp.lock_rq();
            if qp.state() != QpState::Err {
                return;
            }
            rq.srq_wqe.take()
        };
        if let Some(idx) = held {
            flush_recv_cqe(dev, qp, idx);
        }
        if !qp.last_wqe_raised.swap(true, Ordering::AcqRel) {
            qp.events.raise(AsyncEvent::LastWqeReached);
        }
        return;
    }
    if qp.rq_wqes == 0 {
        return;
    }
    let mut rq = qp.lock_rq();
    // The state was read without the lock: a move out of ERR (RESET, then receives posted
    // again) may have happened since, and those receives must not be flushed.
    if qp.state() != QpState::Err {
        return;
    }
    let head = rq_head(qp);
    while (rq.ci as u16) != head && head.wrapping_sub(rq.ci as u16) as u32 <= qp.rq_wqes {
        flush_recv_cqe(dev, qp, rq.ci as u16);
        rq.ci = rq.ci.wrapping_add(1);
    }
}

/// The WR_FLUSH completion of receive WQE `idx` of an errored QP.
fn flush_recv_cqe(dev: &Shared, qp: &Qp, idx: u16) {
    dev.counters.error(Syndrome::WrFlush);
    let e = ErrorCqe {
        responder: true,
        syndrome: Syndrome::WrFlush as u8,
        vendor_syndrome: 0,
        wqe_opcode: 0,
        qpn: qp.qpn,
        wqe_counter: idx,
    };
    match qp.recv_cq.push(qp.stamp(Cqe64::error(&e, 0)), None) {
        Ok(()) => Counters::add(&dev.counters.cqes, 1),
        Err(e) => count_cq_error(&dev.counters, e),
    }
}

pub(crate) fn rq_head(qp: &Qp) -> u16 {
    u32::from_be(qp.dbrec_word(0).load(Ordering::Acquire)) as u16
}

/// How a WQE ended when it did not fail.
pub(crate) enum Done {
    /// Completed; the byte count for the CQE.
    Complete(u32),
    /// Must run again later (RNR back-off, transport retry, WAIT).
    Stalled(Stall),
    /// Handed to the wire transport, which completes it when the peer answers.
    Queued,
}

pub(crate) type Fail = (Syndrome, u8);

pub(crate) fn local_err(_: AccessError) -> Fail {
    (Syndrome::LocalProt, vendor::LOCAL_KEY)
}

/// A device-memory access of the requester's own buffers failed (gather source, READ
/// destination, atomic result): LOCAL_PROT, as a ConnectX reports a local buffer it cannot
/// access, with vendor syndrome [`vendor::DEVICE_MEMORY`].
pub(crate) fn local_devmem_err(c: &Counters, e: &crate::DeviceMemoryError) -> Fail {
    tracing::warn!(error = %e, "device memory failed (requester)");
    Counters::add(&c.devmem_errors, 1);
    (Syndrome::LocalProt, vendor::DEVICE_MEMORY)
}

/// The responder's answer when its own device memory failed (WRITE target, READ source, atomic
/// target, receive buffer or receive WQE): NAK remote operational error (REMOTE_OP at the
/// requester), fatal for the responder.
pub(crate) fn remote_devmem_nak(c: &Counters, e: &crate::DeviceMemoryError) -> Response {
    tracing::warn!(error = %e, "device memory failed (responder)");
    Counters::add(&c.devmem_errors, 1);
    Response::Nak(Syndrome::RemoteOp, vendor::DEVICE_MEMORY)
}

/// Checked local ranges of a gather/scatter list.
fn local_ranges(
    g: &MrGuard<'_>,
    qp: &Qp,
    need: Access,
    list: &[DataSeg],
) -> Result<SmallVec<[MemRange; 4]>, Fail> {
    list.iter()
        .map(|d| {
            let s = sge_of(d);
            g.check(qp.pd, need, s.lkey.0, s.addr, s.len as u64)
                .map_err(local_err)
        })
        .collect()
}

pub(crate) fn total(r: &[MemRange]) -> u64 {
    r.iter().map(|r| r.len).sum()
}

/// Where a QP's peer is.
enum Route {
    /// A QP of a device in this process: requests are function calls ([`respond`]).
    Local(Arc<Qp>),
    /// Over the wire; the transport state is in `sq.wire`.
    Wire,
}

/// Finds the connected peer QP, or decides how long to keep retrying. The first use decides
/// the route: a peer-table entry of this device for the remote GID means the wire; else a
/// device of this process with that GID means the in-process path; else, when this device
/// has a wire port and the GID is IPv4-mapped, the wire at the GID's address and the port's
/// default UDP port.
fn route(dev: &Shared, sq: &mut SqState) -> Result<Result<Route, Stall>, Fail> {
    if sq.wire.is_some() {
        return Ok(Ok(Route::Wire));
    }
    let cached = sq.peer.as_ref().and_then(|w| w.upgrade());
    let found = match (cached, sq.remote) {
        (Some(p), _) => Some(p),
        (None, None) => None,
        (None, Some((gid, qpn))) => {
            if let Some(to) = dev.peer_addr(&gid) {
                if transport::connect(dev, sq, gid, qpn, to) {
                    return Ok(Ok(Route::Wire));
                }
            }
            match lookup(&gid) {
                Some(d) => {
                    let p = d.qp(qpn);
                    if let Some(p) = &p {
                        sq.peer = Some(Arc::downgrade(p));
                    }
                    p
                }
                None => {
                    let to = dev.port().and_then(|port| {
                        let ip = gid.to_ipv4()?;
                        Some(std::net::SocketAddr::from((ip, port.cfg.default_port)))
                    });
                    if let Some(to) = to {
                        if transport::connect(dev, sq, gid, qpn, to) {
                            return Ok(Ok(Route::Wire));
                        }
                    }
                    None
                }
            }
        }
    };
    match found {
        Some(p) if matches!(p.state(), QpState::Rtr | QpState::Rts) => Ok(Ok(Route::Local(p))),
        _ => {
            // No answer: the transport timer runs retry_cnt + 1 times, then the QP fails.
            let now = Instant::now();
            let rts = sq.rts;
            let deadline = *sq.retry_deadline.get_or_insert_with(|| {
                if rts.timeout == 0 {
                    now + Duration::from_secs(u64::MAX / 4)
                } else {
                    let one = Duration::from_nanos(4096u64 << rts.timeout.min(31));
                    now + one * (rts.retry_cnt as u32 + 1)
                }
            });
            if now >= deadline {
                Err((Syndrome::TransportRetryExc, vendor::NO_PEER))
            } else {
                Ok(Err(Stall::Until(
                    deadline.min(now + Duration::from_millis(1)),
                )))
            }
        }
    }
}

/// The IBTA RNR NAK timer table (encoding → microseconds).
pub(crate) fn rnr_delay(code: u8) -> Duration {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
        5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
        245_760, 327_680, 491_520,
    ];
    Duration::from_micros(US[code as usize & 31] as u64)
}

/// What a request asks of the responder.
pub(crate) enum Request<'a> {
    Write {
        raddr: u64,
        rkey: u32,
        src: &'a [MemRange],
        len: u64,
        imm: Option<u32>,
    },
    Send {
        src: &'a [MemRange],
        len: u64,
        imm: Option<u32>,
    },
    Read {
        raddr: u64,
        rkey: u32,
        dst: &'a [MemRange],
        len: u64,
    },
    Atomic {
        raddr: u64,
        rkey: u32,
        kind: AtomicKind,
    },
}

/// The responder's answer, as it would travel back in an ACK/NAK.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Response {
    Ack,
    /// The original value of an atomic.
    AtomicAck(u64),
    /// Receiver not ready, retry after this RNR timer code.
    Rnr(u8),
    /// NAK: the requester completes with this syndrome. (In-process only, also the
    /// requester's own failure found during the transfer: LOCAL_PROT for a source or READ
    /// destination in device memory that failed; the responder is not affected.)
    Nak(Syndrome, u8),
}

/// The responder side of one QP, held for one request (in-process) or one packet (wire):
/// its receive state and its device's memory table. Every check a responder makes is here, so
/// the in-process path ([`respond`]) and the wire responder ([`crate::wire`]) make the same
/// ones with the same outcomes.
pub(crate) struct Resp<'a> {
    pub qp: &'a Qp,
    pub rq: MutexGuard<'a, RqState>,
    pub g: MrGuard<'a>,
    /// Whether a receive completion reported this request's failure.
    reported: bool,
}

impl<'a> Resp<'a> {
    /// Takes the QP's receive state and its memory table.
    pub fn lock(qp: &'a Qp) -> Self {
        let rq = qp.lock_rq();
        let g = qp.mrs.read();
        Self {
            qp,
            rq,
            g,
            reported: false,
        }
    }

    /// A remote access: the QP's access flags, then key, PD, range and right of the region.
    /// Not fatal by itself (see [`Resp::fatal`]).
    pub fn remote(
        &self,
        need: Access,
        raddr: u64,
        rkey: u32,
        len: u64,
    ) -> Result<MemRange, Response> {
        if !self.rq.access.contains(need) {
            return Err(Response::Nak(Syndrome::RemoteAccess, vendor::REMOTE_KEY));
        }
        self.g
            .check(self.qp.pd, need, rkey, raddr, len)
            .map_err(|_| Response::Nak(Syndrome::RemoteAccess, vendor::REMOTE_KEY))
    }

    /// Error classes that put the responder in ERR (as an RC responder does on NAK-invalid
    /// request, remote access and remote operational errors).
    /// A failure no receive completion reported raises the affiliated event a ConnectX
    /// responder raises: QP_REQ_ERR for an invalid request, QP_ACCESS_ERR for a remote access
    /// violation, QP_FATAL otherwise.
    pub fn fatal(&self, r: Response) -> Response {
        if let Response::Nak(syndrome, _) = r {
            if self.reported {
                self.qp.set_state(QpState::Err);
            } else {
                self.qp.fatal(match syndrome {
                    Syndrome::RemoteInvalReq => AsyncEvent::QpRequestError,
                    Syndrome::RemoteAccess => AsyncEvent::QpAccessError,
                    _ => AsyncEvent::QpFatal,
                });
            }
        }
        r
    }

    /// Whether a receive WQE is posted. A QP on an SRQ takes the SRQ's next WQE here and
    /// holds it for the message (other QPs of the SRQ cannot take it meanwhile).
    pub fn has_recv(&mut self) -> bool {
        match &self.qp.srq {
            Some(s) => {
                if self.rq.srq_wqe.is_none() {
                    self.rq.srq_wqe = s.take();
                }
                self.rq.srq_wqe.is_some()
            }
            None => self.qp.rq_wqes != 0 && self.rq.ci as u16 != rq_head(self.qp),
        }
    }

    /// The `wqe_counter` of the receive at the head: the RQ's counter, or the index of the
    /// SRQ WQE held.
    fn recv_counter(&self) -> u16 {
        match (&self.qp.srq, self.rq.srq_wqe) {
            (Some(_), Some(i)) => i,
            _ => self.rq.ci as u16,
        }
    }

    /// Moves past the receive just completed.
    fn recv_advance(&mut self) {
        if self.qp.srq.is_some() {
            self.rq.srq_wqe = None;
        } else {
            self.rq.ci = self.rq.ci.wrapping_add(1);
        }
    }

    /// Receiver not ready, with this QP's RNR timer.
    pub fn rnr(&self) -> Response {
        Response::Rnr(self.rq.min_rnr_timer)
    }

    /// The checked scatter list of the receive WQE at the head (which must be posted). A bad
    /// key completes the receive with LOCAL_PROT and NAKs remote operational error (fatal).
    pub fn recv_ranges(&mut self) -> Result<SmallVec<[MemRange; 4]>, Response> {
        let qp = self.qp;
        let (ring, off, nsge, pd) = match &qp.srq {
            Some(s) => {
                if !self.has_recv() {
                    return Err(self.rnr());
                }
                let idx = self.recv_counter();
                (s.ring(), s.data_offset(idx), s.max_sge() as usize, s.pd())
            }
            None => {
                if qp.rq_wqes == 0 {
                    return Err(self.fatal(Response::Nak(Syndrome::RemoteOp, vendor::RECV_BUFFER)));
                }
                let off = (self.rq.ci & (qp.rq_wqes - 1)) as usize * qp.rq_stride as usize;
                (&qp.rq_ring, off, qp.max_recv_sge as usize, qp.pd)
            }
        };
        // The whole receive WQE at once (one round trip when the ring is device memory).
        let mut wqe = [0u8; 16 * 32];
        let n = nsge.min(32) * 16;
        if let Err(e) = ring.try_read(off, &mut wqe[..n]) {
            self.recv_error(Syndrome::LocalAccess, vendor::DEVICE_MEMORY);
            let nak = remote_devmem_nak(&qp.counters, &e);
            return Err(self.fatal(nak));
        }
        let mut segs: SmallVec<[DataSeg; 4]> = SmallVec::new();
        for j in 0..n / 16 {
            let d: DataSeg = bytemuck::pod_read_unaligned(&wqe[j * 16..(j + 1) * 16]);
            if d.is_terminator() {
                break;
            }
            segs.push(d);
        }
        let dst: Result<SmallVec<[MemRange; 4]>, _> = segs
            .iter()
            .map(|d| {
                let s = sge_of(d);
                self.g
                    .check(pd, Access::LOCAL_WRITE, s.lkey.0, s.addr, s.len as u64)
            })
            .collect();
        dst.map_err(|_| {
            self.recv_error(Syndrome::LocalProt, vendor::RECV_BUFFER);
            self.fatal(Response::Nak(Syndrome::RemoteOp, vendor::RECV_BUFFER))
        })
    }

    /// A message longer than the receive buffer: the receive completes with LOCAL_LENGTH and
    /// the requester gets NAK invalid request (fatal).
    pub fn recv_too_small(&mut self) -> Response {
        self.recv_error(Syndrome::LocalLength, vendor::RECV_BUFFER);
        self.fatal(Response::Nak(Syndrome::RemoteInvalReq, vendor::RECV_BUFFER))
    }

    /// Scattering into the receive buffer (device memory) failed: the receive completes with
    /// LOCAL_ACCESS (a responder's local access error) and the requester gets NAK remote
    /// operational error (fatal).
    pub fn recv_devmem_failed(&mut self, e: &crate::DeviceMemoryError) -> Response {
        self.recv_error(Syndrome::LocalAccess, vendor::DEVICE_MEMORY);
        let nak = remote_devmem_nak(&self.qp.counters, e);
        self.fatal(nak)
    }

    /// Completes the receive WQE at the head successfully.
    pub fn recv_done(&mut self, kind: RespKind, len: u64, imm: Option<u32>, from: u32) {
        let qp = self.qp;
        if qp.srq.is_some() && !self.has_recv() {
            // only after has_recv said yes, which holds the WQE: not reached
            return;
        }
        let counter = self.recv_counter();
        let cqe = Cqe64::responder(kind, qp.qpn, from, counter, len as u32, imm, 0);
        self.recv_advance();
        match qp.recv_cq.push(qp.stamp(cqe), None) {
            Ok(()) => Counters::add(&qp.counters.cqes, 1),
            Err(e) => {
                count_cq_error(&qp.counters, e);
                qp.fatal(AsyncEvent::QpFatal);
            }
        }
    }

    fn recv_error(&mut self, syndrome: Syndrome, why: u8) {
        let qp = self.qp;
        qp.counters.error(syndrome);
        let e = ErrorCqe {
            responder: true,
            syndrome: syndrome as u8,
            vendor_syndrome: why,
            wqe_opcode: 0,
            qpn: qp.qpn,
            wqe_counter: self.recv_counter(),
        };
        self.recv_advance();
        self.reported = true;
        if let Err(e) = qp.recv_cq.push(qp.stamp(Cqe64::error(&e, 0)), None) {
            count_cq_error(&qp.counters, e);
        }
        Counters::add(&qp.counters.cqes, 1);
    }

    /// Runs an atomic: alignment, access, then the operation (skipped with `move_data`
    /// false). Errors are fatal.
    pub fn atomic(&self, raddr: u64, rkey: u32, kind: AtomicKind, move_data: bool) -> Response {
        let size = kind.size() as u64;
        if raddr % size != 0 {
            return self.fatal(Response::Nak(
                Syndrome::RemoteInvalReq,
                vendor::INVALID_REQUEST,
            ));
        }
        let target = match self.remote(Access::REMOTE_ATOMIC, raddr, rkey, size) {
            Ok(t) => t,
            Err(r) => return self.fatal(r),
        };
        if !move_data {
            return Response::Ack;
        }
        match &target.dev {
            // SAFETY: `target` is checked, live host memory (guard held), naturally aligned.
            None => Response::AtomicAck(unsafe { atomic(target.addr, kind) }),
            Some(m) => match device_atomic(m.as_ref(), target.addr, kind) {
                Ok(old) => Response::AtomicAck(old),
                Err(e) => {
                    let nak = remote_devmem_nak(&self.qp.counters, &e);
                    self.fatal(nak)
                }
            },
        }
    }
}

/// Executes a request at the responder `peer`, from requester QPN `from`. With `move_data`
/// false (completion-only mode) every check and completion happens but no payload byte moves
/// and atomics leave their target alone.
pub(crate) fn respond(peer: &Qp, from: u32, req: Request<'_>, move_data: bool) -> Response {
    let mut r = Resp::lock(peer);
    let needs_recv = matches!(
        req,
        Request::Send { .. } | Request::Write { imm: Some(_), .. }
    );
    if needs_recv && !r.has_recv() {
        return r.rnr();
    }
    match req {
        Request::Write {
            raddr,
            rkey,
            src,
            len,
            imm,
        } => {
            let dst = match r.remote(Access::REMOTE_WRITE, raddr, rkey, len) {
                Ok(d) => d,
                Err(e) => return r.fatal(e),
            };
            if move_data {
                // SAFETY: `dst` was checked under `r.g` (still held); `src` was checked by the
                // requester under its own guard, still held by the caller.
                if let Err(e) = unsafe { copy_ranges(&[dst], src) } {
                    return copy_failed(&r, e);
                }
            }
            if let Some(imm) = imm {
                r.recv_done(RespKind::WriteImm, len, Some(imm), from);
            }
            Response::Ack
        }
        Request::Send { src, len, imm } => {
            let dst = match r.recv_ranges() {
                Ok(d) => d,
                Err(e) => return e,
            };
            if total(&dst) < len {
                return r.recv_too_small();
            }
            if move_data {
                // SAFETY: `dst` checked under `r.g` (held); `src` checked by the requester
                // (held).
                match unsafe { copy_ranges(&dst, src) } {
                    Ok(_) => {}
                    Err(CopyError::Dst(e)) => return r.recv_devmem_failed(&e),
                    Err(e) => return copy_failed(&r, e),
                }
            }
            let kind = if imm.is_some() {
                RespKind::SendImm
            } else {
                RespKind::Send
            };
            r.recv_done(kind, len, imm, from);
            Response::Ack
        }
        Request::Read {
            raddr,
            rkey,
            dst,
            len,
        } => {
            let src = match r.remote(Access::REMOTE_READ, raddr, rkey, len) {
                Ok(s) => s,
                Err(e) => return r.fatal(e),
            };
            if move_data {
                // SAFETY: as for writes, with the directions swapped.
                if let Err(e) = unsafe { copy_ranges(dst, &[src]) } {
                    // the sides swap: the source is the responder's, the destination ours
                    let e = match e {
                        CopyError::Src(e) => CopyError::Dst(e),
                        CopyError::Dst(e) => CopyError::Src(e),
                    };
                    return copy_failed(&r, e);
                }
            }
            Response::Ack
        }
        Request::Atomic { raddr, rkey, kind } => r.atomic(raddr, rkey, kind, move_data),
    }
}

/// A failed in-process transfer, seen from the requester: `Dst` is the responder's memory
/// (REMOTE_OP, responder to ERR), `Src` the requester's own (LOCAL_PROT, responder unchanged).
fn copy_failed(r: &Resp<'_>, e: CopyError) -> Response {
    match e {
        CopyError::Dst(e) => {
            let nak = remote_devmem_nak(&r.qp.counters, &e);
            r.fatal(nak)
        }
        CopyError::Src(e) => {
            // counted by the requester (`execute`), whose memory it is
            tracing::warn!(error = %e, "device memory failed (requester)");
            Response::Nak(Syndrome::LocalProt, vendor::DEVICE_MEMORY)
        }
    }
}

/// What an atomic makes of the original value: the new value, or `None` to leave it.
fn atomic_op(kind: AtomicKind) -> impl Fn(u64) -> Option<u64> {
    move |old: u64| -> Option<u64> {
        match kind {
            AtomicKind::FetchAdd { add } => Some(old.wrapping_add(add)),
            AtomicKind::CompareSwap { compare, swap } => (old == compare).then_some(swap),
            AtomicKind::MaskedFetchAdd {
                add,
                field_boundary,
                size,
            } => Some(field_add(old, add, field_boundary, size.bytes() * 8)),
            AtomicKind::MaskedCompareSwap {
                compare,
                compare_mask,
                swap,
                swap_mask,
                ..
            } => ((old & compare_mask) == (compare & compare_mask))
                .then_some((old & !swap_mask) | (swap & swap_mask)),
        }
    }
}

/// Serialises the soft NIC's read-modify-writes on device memory (every device of the
/// process): atomic with respect to each other, NOT with respect to GPU threads, which the
/// host cannot lock out (a GPU atomic on the same word between the read and the write is lost
/// or overwritten).
static DEVICE_ATOMICS: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Performs an atomic on device memory as a read-modify-write through `mem` (original value
/// returned, host-endian as in host memory). See [`DEVICE_ATOMICS`] for what is atomic.
fn device_atomic(
    mem: &dyn crate::DeviceMemory,
    addr: u64,
    kind: AtomicKind,
) -> Result<u64, crate::DeviceMemoryError> {
    let op = atomic_op(kind);
    let _one_at_a_time = DEVICE_ATOMICS.lock();
    if kind.size() == 8 {
        let mut b = [0u8; 8];
        mem.read(addr, &mut b)?;
        let old = u64::from_ne_bytes(b);
        if let Some(new) = op(old) {
            mem.write(addr, &new.to_ne_bytes())?;
        }
        Ok(old)
    } else {
        let mut b = [0u8; 4];
        mem.read(addr, &mut b)?;
        let old = u32::from_ne_bytes(b) as u64;
        if let Some(new) = op(old) {
            mem.write(addr, &(new as u32).to_ne_bytes())?;
        }
        Ok(old)
    }
}

/// Performs an atomic on host memory and returns the original value.
///
/// # Safety
/// `addr` must be live host memory, aligned to the operand size.
unsafe fn atomic(addr: u64, kind: AtomicKind) -> u64 {
    let op = atomic_op(kind);
    if kind.size() == 8 {
        // SAFETY: aligned live memory per the contract; all device access is atomic.
        let a = unsafe { AtomicU64::from_ptr(addr as *mut u64) };
        let mut old = a.load(Ordering::Acquire);
        loop {
            let Some(new) = op(old) else { return old };
            match a.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return old,
                Err(cur) => old = cur,
            }
        }
    } else {
        // SAFETY: as above for a 4-byte operand.
        let a = unsafe { AtomicU32::from_ptr(addr as *mut u32) };
        let mut old = a.load(Ordering::Acquire);
        loop {
            let Some(new) = op(old as u64) else {
                return old as u64;
            };
            match a.compare_exchange_weak(old, new as u32, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return old as u64,
                Err(cur) => old = cur,
            }
        }
    }
}

/// Adds `add` to `old` field by field: a set bit in `boundary` is the top bit of a field, and
/// no carry crosses it.
pub fn field_add(old: u64, add: u64, boundary: u64, bits: u32) -> u64 {
    let mut out = 0u64;
    let mut carry = 0u64;
    for i in 0..bits {
        let a = (old >> i) & 1;
        let b = (add >> i) & 1;
        let s = a + b + carry;
        out |= (s & 1) << i;
        carry = if (boundary >> i) & 1 == 1 { 0 } else { s >> 1 };
    }
    out
}

/// Checked local ranges of a WRITE/SEND source (SGEs, or the inline bytes in the WQE copy).
fn gather(g: &MrGuard<'_>, qp: &Qp, l: &ParsedLocal<'_>) -> Result<SmallVec<[MemRange; 4]>, Fail> {
    let ranges = match l {
        ParsedLocal::Sges(list) => local_ranges(g, qp, Access::NONE, list)?,
        ParsedLocal::Inline(bytes) => {
            if bytes.len() as u32 > qp.max_inline {
                return Err((Syndrome::LocalLength, vendor::TOO_LONG));
            }
            smallvec::smallvec![MemRange::host(bytes.as_ptr() as u64, bytes.len() as u64)]
        }
    };
    if total(&ranges) > MAX_MSG {
        return Err((Syndrome::LocalLength, vendor::TOO_LONG));
    }
    Ok(ranges)
}

/// Runs a parsed WQE as the requester.
fn execute(
    dev: &Shared,
    qp: &Qp,
    sq: &mut SqState,
    wqe: &prm::ParsedWqe<'_>,
) -> Result<Done, Fail> {
    if let ParsedOp::Nop = wqe.op {
        return Ok(Done::Complete(0));
    }
    if let ParsedOp::Wait { cqn, max_index } = wqe.op {
        return match dev.cq(cqn) {
            None => Err((Syndrome::LocalQpOp, vendor::INVALID_REQUEST)),
            Some(cq) if cq.produced().wrapping_sub(max_index) as i32 >= 0 => Ok(Done::Complete(0)),
            Some(_) => Ok(Done::Stalled(Stall::Wait { cqn, max_index })),
        };
    }
    let g = qp.mrs.read();
    if let ParsedOp::Dump { local } = wqe.op {
        // A local read of one segment: the lkey, PD and range are checked as for any gather.
        // The device's own writes are complete before their CQEs, so there is nothing left
        // to flush: the read moves no byte.
        g.check(
            qp.pd,
            Access::NONE,
            local.lkey.0,
            local.addr,
            local.len as u64,
        )
        .map_err(local_err)?;
        return Ok(Done::Complete(local.len));
    }
    let from = qp.qpn;
    let imm = wqe.imm();
    // Local checks come first: the requester gathers (or validates its scatter list) before
    // anything goes out.
    enum Prepared {
        Write(prm::RemoteAddr, SmallVec<[MemRange; 4]>),
        Send(SmallVec<[MemRange; 4]>),
        Read(prm::RemoteAddr, SmallVec<[MemRange; 4]>),
        Atomic(prm::RemoteAddr, AtomicKind, MemRange),
    }
    let prepared = match wqe.op {
        ParsedOp::Write { remote, local } => Prepared::Write(remote, gather(&g, qp, &local)?),
        ParsedOp::Send { local } => Prepared::Send(gather(&g, qp, &local)?),
        ParsedOp::Read { remote, local } => {
            let dst = local_ranges(&g, qp, Access::LOCAL_WRITE, local)?;
            if total(&dst) > MAX_MSG {
                return Err((Syndrome::LocalLength, vendor::TOO_LONG));
            }
            Prepared::Read(remote, dst)
        }
        ParsedOp::Atomic {
            remote,
            kind,
            result,
        } => {
            let res = g
                .check(
                    qp.pd,
                    Access::LOCAL_WRITE,
                    result.lkey.0,
                    result.addr,
                    result.len as u64,
                )
                .map_err(local_err)?;
            Prepared::Atomic(remote, kind, res)
        }
        ParsedOp::Nop | ParsedOp::Wait { .. } | ParsedOp::Dump { .. } => {
            unreachable!("handled above")
        }
    };
    let peer = match route(dev, sq)? {
        Ok(Route::Local(p)) => p,
        Ok(Route::Wire) => {
            drop(prepared);
            drop(g);
            return transport::enqueue(dev, qp, sq, wqe);
        }
        Err(stall) => return Ok(Done::Stalled(stall)),
    };
    let move_data = !dev.completion_only;
    let (response, len) = match &prepared {
        Prepared::Write(r, src) => {
            let len = total(src);
            let req = Request::Write {
                raddr: r.addr,
                rkey: r.rkey.0,
                src,
                len,
                imm,
            };
            (respond(&peer, from, req, move_data), len)
        }
        Prepared::Send(src) => {
            let len = total(src);
            (
                respond(&peer, from, Request::Send { src, len, imm }, move_data),
                len,
            )
        }
        Prepared::Read(r, dst) => {
            let len = total(dst);
            let req = Request::Read {
                raddr: r.addr,
                rkey: r.rkey.0,
                dst,
                len,
            };
            (respond(&peer, from, req, move_data), len)
        }
        Prepared::Atomic(r, kind, _) => {
            let req = Request::Atomic {
                raddr: r.addr,
                rkey: r.rkey.0,
                kind: *kind,
            };
            (respond(&peer, from, req, move_data), kind.size() as u64)
        }
    };
    match response {
        Response::Ack | Response::AtomicAck(_) => {
            if let (Response::AtomicAck(old), Prepared::Atomic(_, kind, res)) =
                (&response, &prepared)
            {
                let bytes = old.to_ne_bytes();
                let n = kind.size() as usize;
                // The original value lands host-endian (mlx5 in host-endian atomic mode).
                let src = if n == 8 {
                    &bytes[..]
                } else {
                    &(*old as u32).to_ne_bytes()[..]
                };
                // SAFETY: `res` was checked (LOCAL_WRITE, exactly n bytes) under `g`, still held.
                if let Err(e) = unsafe { write_range(res, 0, src) } {
                    return Err(local_devmem_err(&dev.counters, &e));
                }
            }
            Counters::add(&dev.counters.bytes, len);
            Ok(Done::Complete(len as u32))
        }
        Response::Rnr(code) => {
            sq.rnr_attempts += 1;
            if sq.rts.rnr_retry != 7 && sq.rnr_attempts > sq.rts.rnr_retry as u32 {
                Err((Syndrome::RnrRetryExc, vendor::RNR))
            } else {
                Ok(Done::Stalled(Stall::Until(
                    Instant::now() + rnr_delay(code),
                )))
            }
        }
        Response::Nak(syndrome, why) => {
            if (syndrome, why) == (Syndrome::LocalProt, vendor::DEVICE_MEMORY) {
                // our own memory failed during the transfer (see `copy_failed`)
                Counters::add(&dev.counters.devmem_errors, 1);
            }
            Err((syndrome, why))
        }
    }
}
