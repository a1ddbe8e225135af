//! The engine: one thread per device that notices doorbells, reads WQEs from the SQ ring (or a
//! BlueFlame register) as a ConnectX would, checks them, executes them against registered
//! memory, and writes CQEs.
//!
//! This is the requester side. It checks a WQE locally (shared by every route), then either
//! runs it on a peer QP of this process ([`crate::responder`], a function call) or hands it to
//! the wire transport ([`crate::wire`]), which completes it when the peer's ACK arrives. The
//! engine calls down into both and nothing calls back up into it: the layers are formats
//! (`prm`) → objects (`mem`, `cq`, `srq`, `qp`, `shared`) → outcomes and completions →
//! responder → wire transport → engine → [`crate::Device`].

use crate::buffer::prefetch;
use crate::completion::{count_cq_error, flush_cqe, push_cqe_delayed};
use crate::counters::Counters;
use crate::devmem::same_memory;
use crate::event::AsyncEvent;
use crate::gather::{gather, local_ranges};
use crate::mem::{total, write_range, Access, MemRange, MrGuard, MwBinding, MwRequest};
use crate::outcome::{local_devmem_err, local_err, rnr_delay, vendor, Done, Fail, Stall, MAX_MSG};
use crate::qp::{Qp, QpState, SqState, Transport};
use crate::responder::{respond, QueuedCopy, Request, Response};
use crate::shared::{lookup, Shared};
use crate::staged::STAGE_MAX;
use crate::wire::{requester, responder};
use parking_lot::MutexGuard;
use prm::cqe::{Cqe64, ErrorCqe};
use prm::doorbell::{DoorbellValue, BF_HALF_SIZE};
use prm::parse::{
    parse_dc_wqe, parse_wqe, parse_xrc_wqe, sge_of, AtomicKind, LocalSeg, MwOp, ParsedLocal,
    ParsedOp, UmrOp,
};
use prm::wqe::{
    blocks_for_ds, CtrlSeg, Fence, Sge, MKEY_ACCESS_ATOMIC, MKEY_ACCESS_REMOTE_READ,
    MKEY_ACCESS_REMOTE_WRITE,
};
use prm::{Syndrome, DS_UNIT, MAX_WQE_BBS, WQEBB};
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Spins of an idle engine before it starts to sleep.
const IDLE_SPINS: u32 = 4096;
/// While it spins idle, an engine gives its core away once in this many rounds
/// (`sched_yield`): alone on a core the call returns at once, but where a poster shares the
/// core with it (a busy machine, `taskset`) the poster runs and posts a batch instead of
/// waiting for the engine's spin to end, so the two alternate per batch, not per WQE.
const YIELD_EVERY: u32 = 32;
/// Longest sleep of an idle engine; a GPU doorbell (which cannot wake the thread) waits at
/// most this long to be noticed.
const MAX_PARK: Duration = Duration::from_micros(500);
/// For this long after it last saw a doorbell that nobody woke it for (a GPU's: a kernel
/// cannot wake a thread), an engine sleeps at most [`WARM_PARK`] at a time, so that the
/// next one (a ping-pong, a kernel's next batch) is noticed within that; otherwise, and once
/// idle for longer, it sleeps up to [`MAX_PARK`] (well under 5% of a core). CPU initiators
/// wake it themselves.
const WARM: Duration = Duration::from_millis(10);
const WARM_PARK: Duration = Duration::from_micros(20);
/// The longest sleep while something waits on time (wire timers, delayed CQEs; their
/// granularity is hundreds of microseconds).
const TIMED_PARK: Duration = Duration::from_micros(50);
/// The longest sleep while a thread of the program carries the device ([`Shared::carried`]):
/// that thread runs doorbells and timers itself; the engine only catches a doorbell rung
/// after the program's last poll (a program that goes to sleep on a completion channel ends
/// the carrying and wakes the engine: [`crate::Device::carry_end`]).
const CARRIED_PARK: Duration = MAX_PARK;
/// The longest sleep while the wire I/O thread finds the program's doorbells itself, right
/// after the datagrams they answer ([`Shared::answering`], [`crate::sched::AnswerWatch`]):
/// the engine then only catches a doorbell that answers nothing (a first request), within
/// this.
const ANSWERING_PARK: Duration = Duration::from_micros(200);
/// WQEs one QP runs before the engine looks at the next.
const BUDGET: u32 = 64;

/// Engine thread `k` of `n`: runs the QPs whose QPN is `k` modulo `n` (and, thread 0, the
/// delayed CQEs of every CQ) until the device shuts down.
pub(crate) fn run(dev: Arc<Shared>, k: u32, n: u32) {
    // Sleeps of [`WARM_PARK`] mean little with Linux's default 50 µs timer slack, and a wake-up
    // means little if a busy poller keeps the core for its whole slice (crate::sched).
    let mut me = crate::sched::DeviceThread::new();
    let mut generation = u64::MAX;
    let (mut qps, mut cqs): (Vec<Arc<Qp>>, Vec<_>) = (Vec::new(), Vec::new());
    let mut idle = 0u32;
    let mut park = Duration::from_micros(10);
    let mut polled_at: Option<Instant> = None;
    let mut turn = 0u64;
    let mut spinner = crate::sched::Spinner::default();
    while !dev.shutdown.load(Ordering::Acquire) {
        turn = turn.wrapping_add(1);
        let g = dev.generation.load(Ordering::Acquire);
        if g != generation {
            (qps, cqs) = dev.snapshot();
            qps.retain(|q| q.qpn % n == k);
            if k != 0 {
                cqs.clear();
            }
            generation = g;
        }
        let mut work = false;
        let mut timed = false;
        for qp in &qps {
            if qp.kicking_poster.load(Ordering::Relaxed) {
                qp.engine_turn.store(turn, Ordering::Relaxed);
            }
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
        if dev.polled_doorbell.swap(false, Ordering::Relaxed) {
            polled_at = Some(now);
        }
        if work {
            idle = 0;
            park = Duration::from_micros(10);
        } else {
            idle = idle.saturating_add(1);
            let carried = dev.carried();
            let answering = !carried && dev.answering();
            me.set_prompt(!carried);
            if idle < IDLE_SPINS && !carried && !answering && spinner.may_spin(now) {
                if idle % YIELD_EVERY == 0 {
                    spinner.yield_now();
                } else {
                    std::hint::spin_loop();
                }
            } else {
                let warm = polled_at.is_some_and(|t| now.duration_since(t) < WARM);
                let limit = match (warm, timed) {
                    _ if carried => CARRIED_PARK,
                    (true, _) => WARM_PARK,
                    (false, true) => TIMED_PARK,
                    (false, false) => MAX_PARK,
                };
                // while the I/O thread finds the doorbells, the whole of ANSWERING_PARK at once
                let sleep = if answering {
                    ANSWERING_PARK
                } else {
                    park.min(limit)
                };
                std::thread::park_timeout(sleep);
                park = (park * 2).min(MAX_PARK);
            }
        }
    }
}

/// One pass of the engine's work on the caller's thread: every QP's doorbells and WQEs (up
/// to [`BUDGET`] each) and the CQEs that fell due. The engine thread keeps running; the two
/// take turns on a QP through its SQ lock. Returns whether anything was done.
pub(crate) fn turn(dev: &Shared) -> bool {
    let (qps, cqs) = dev.snapshot();
    let mut work = false;
    for qp in &qps {
        work |= service(dev, qp).0;
    }
    let now = Instant::now();
    for cq in &cqs {
        if let Err(e) = cq.flush_due(now) {
            count_cq_error(&dev.counters, e);
        }
    }
    work
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
    let holding = state == QpState::Rts && responder::responder_tick(dev, qp, Instant::now());
    let Some(mut sq) = qp.lock_sq_live() else {
        // destroyed since the snapshot was taken: its memory may be gone
        return (false, false);
    };
    let mut r = service_locked(dev, qp, &mut sq);
    r.1 |= holding;
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
        let Some(mut sq) = qp.lock_sq_live() else {
            return;
        };
        service_locked(dev, qp, &mut sq);
        if sq.ci == sq.target {
            break;
        }
    }
}

fn service_locked(dev: &Shared, qp: &Arc<Qp>, sq: &mut SqState) -> (bool, bool) {
    let mut work = false;
    for h in 0..qp.halves {
        let v = qp.half_word(h);
        if v != sq.last_half[h] {
            sq.last_half[h] = v;
            work = true;
            // The next WQE to run is most likely what this doorbell announces: start loading
            // it while the doorbell record is read.
            qp.sq_ring
                .prefetch((sq.ci as usize & (qp.sq_blocks as usize - 1)) * WQEBB);
            if !qp.kicking_poster.load(Ordering::Relaxed) {
                dev.polled_doorbell.store(true, Ordering::Relaxed);
            }
            doorbell(dev, qp, sq, h, v);
            if qp.takes_doorbells_out() && qp.take_half(h, v) {
                // the next write, of any value, is a doorbell of its own
                sq.last_half[h] = 0;
            }
        }
    }
    let mut timed = false;
    if sq.wire.is_some() {
        if qp.state() == QpState::Err {
            // WQEs already handed to the wire complete (flush) before those still in the ring.
            work |= requester::flush_all(dev, qp, sq);
        } else {
            let (sent, outstanding) = requester::tick(dev, qp, sq, Instant::now());
            work |= sent;
            timed |= outstanding;
        }
    }
    let mut budget = BUDGET;
    // in-process WRITEs whose copies are queued: completed (one settle) before this returns
    let mut batch = LocalBatch::default();
    let mut held = false;
    while sq.ci != sq.target && budget > 0 {
        if sq.wire.as_ref().is_some_and(|w| w.blocked) && qp.state() != QpState::Err {
            // a WQE failed behind WQEs still on the wire: nothing runs until it completes
            held = true;
            break;
        }
        if let Some(stall) = sq.stall {
            let over = match stall {
                Stall::Until(t) => Instant::now() >= t,
                Stall::Wait { cqn, max_index } => {
                    dev.cq(cqn).is_none_or(|cq| cq.has_written(max_index))
                }
                Stall::Drain => sq.wire.as_ref().is_none_or(|w| w.msgs.is_empty()),
            };
            if !over && qp.state() != QpState::Err {
                held = true;
                break;
            }
            sq.stall = None;
        }
        budget -= 1;
        work = true;
        step(dev, qp, sq, &mut batch);
    }
    settle_batch(dev, qp, sq, &mut batch);
    (work, held || timed || sq.stall.is_some())
}

/// Most in-process WRITEs whose queued copies one settle completes ([`LocalBatch`]); the
/// engine's turn on a QP ([`BUDGET`]) bounds a batch as well.
const LOCAL_BATCH_MAX: usize = 64;

/// In-process WRITEs (no immediate, no fence) whose bytes move within one device memory:
/// their copies are queued ([`crate::mem::copy_ranges_queued`]) and their completions held
/// until one settle of those memories ([`settle_batch`]), so that a run of them costs one wait,
/// not one per WQE, and no CQE is written before its bytes are in place. The batch is
/// completed before any other WQE runs, before a WQE that failed or did not queue its copy
/// completes, at [`LOCAL_BATCH_MAX`] WQEs, and at the end of the engine's turn on the QP.
#[derive(Default)]
struct LocalBatch {
    /// The memories holding queued copies.
    mems: SmallVec<[Arc<dyn crate::DeviceMemory>; 1]>,
    /// Per WQE, in order: index, opcode, signaled, byte count.
    wqes: Vec<(u16, u8, bool, u32)>,
    /// A settle of `mems` that failed before the batch's own (a later WRITE's bytes moved
    /// another way and settled them first, [`QueuedCopy`]).
    failed: Option<crate::DeviceMemoryError>,
}

impl LocalBatch {
    /// Whether the WQE with control segment `ctrl` may join the batch (if its copy turns out
    /// to be queued): an RDMA WRITE without immediate and without a fence, with room left.
    fn takes(&self, ctrl: &CtrlSeg) -> bool {
        ctrl.opcode() == prm::wqe::Opcode::RdmaWrite as u8
            && ctrl.fm_ce_se >> 5 == 0
            && self.wqes.len() < LOCAL_BATCH_MAX
    }

    fn is_empty(&self) -> bool {
        self.wqes.is_empty()
    }

    /// Adds a WQE whose copy was queued in `mem`.
    fn add(&mut self, mem: Arc<dyn crate::DeviceMemory>, wqe: (u16, u8, bool, u32)) {
        if !self.mems.iter().any(|m| same_memory(m, &mem)) {
            self.mems.push(mem);
        }
        self.wqes.push(wqe);
    }
}

/// Completes a [`LocalBatch`]: one settle per memory, then each WQE's completion in order.
/// When a settle fails (the driver cannot say which copy failed), no WQE of the batch
/// reports success: the first one completes with the device-memory error a failing copy
/// gives (LOCAL_PROT, vendor `DEVICE_MEMORY`; the responder is not affected), the QP goes to
/// ERR and the others flush.
fn settle_batch(dev: &Shared, qp: &Qp, sq: &mut SqState, batch: &mut LocalBatch) {
    if batch.is_empty() {
        return;
    }
    let mems = std::mem::take(&mut batch.mems);
    let wqes = std::mem::take(&mut batch.wqes);
    let earlier = batch.failed.take().map_or(Ok(()), Err);
    // every memory settles, after a failure too
    let settled = mems.iter().map(|m| m.settle()).fold(earlier, Result::and);
    Counters::add(&dev.counters.local_copy_batches, 1);
    Counters::add(&dev.counters.local_copy_wqes, wqes.len() as u64);
    match settled {
        Ok(()) => {
            for (idx, opcode, signaled, byte_cnt) in wqes {
                Counters::add(&dev.counters.wqes, 1);
                if signaled {
                    let cqe = Cqe64::requester(opcode, qp.qpn, idx, byte_cnt, 0);
                    push_cqe(dev, qp, sq, &qp.send_cq, cqe);
                }
            }
        }
        Err(e) => {
            let (syndrome, why) = local_devmem_err(&dev.counters, &e);
            let Some((first, rest)) = wqes.split_first() else {
                return;
            };
            fail_at(dev, qp, sq, first.0, first.1, syndrome, why);
            for &(idx, opcode, ..) in rest {
                flush_wqe(dev, qp, sq, opcode, idx);
            }
        }
    }
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
    if !mine {
        // Another QP's doorbell on a shared register (every DEVX QP of a context rings the
        // same one) may have replaced ours before the engine saw it: a ConnectX takes each
        // doorbell as a write of its own, this register is a word of memory. The record is
        // then all that is left of ours, so it is read wherever it lives, by a copy from
        // device memory too (without it a QP whose record is in GPU memory lost its last
        // doorbell for good and its WQEs never ran).
        if let Some(rec) = qp.sq_dbrec_anywhere() {
            let ahead = rec.wrapping_sub(sq.ci);
            if ahead as u32 <= qp.sq_blocks && ahead > sq.target.wrapping_sub(sq.ci) {
                sq.target = rec;
            }
        }
        return;
    }
    // our own doorbell: a record in device memory is not read (each read is a copy), the
    // producer comes from the doorbell, as on a ConnectX
    let rec = qp.sq_dbrec();
    let ahead = |pi: u16| pi.wrapping_sub(sq.ci);
    let fits = |d: u16| d as u32 <= qp.sq_blocks;
    let best = std::iter::once(from_value)
        .chain(rec)
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
    if qp.doorbell.is_blueflame() && dv.ds() != 0 {
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

/// Reads, checks and runs the WQE at the consumer index. An in-process WRITE whose copy is
/// queued joins `batch` (its completion held); before anything else completes or runs, the
/// batch is completed.
fn step(dev: &Shared, qp: &Arc<Qp>, sq: &mut SqState, batch: &mut LocalBatch) {
    let idx = sq.ci;
    if !sq.staged.is_empty() {
        // sources read ahead for WQEs the consumer has passed are dropped
        sq.staged.prune(idx, sq.target);
    }
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
        // the consumer moves past the blocks read ahead without them
        sq.ahead = Default::default();
        Counters::add(&dev.counters.bf_run, 1);
        Ok(())
    } else {
        fetch_wqe(qp, sq, idx, &mut buf)
    };
    if let Err(e) = fetched {
        settle_batch(dev, qp, sq, batch);
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
    if !batch.takes(&ctrl) {
        // the batch's completions come first (a failed settle puts the QP in ERR: this WQE
        // then flushes below)
        settle_batch(dev, qp, sq, batch);
    }
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
        // the WQEs of the batch executed: their completions come before this flush
        settle_batch(dev, qp, sq, batch);
        sq.staged.clear();
        flush_wqe(dev, qp, sq, opcode, idx);
        advance(sq);
        return;
    }
    let check = check_ctrl(dev, qp, sq, &ctrl, idx, from_bf);
    // where this WQE's copy was left queued, if it may join the batch (only then does it
    // need the batch's memories)
    let may_queue = batch.takes(&ctrl);
    let mut qc = QueuedCopy {
        pending: if may_queue {
            batch.mems.clone()
        } else {
            Default::default()
        },
        into: None,
        failed: None,
    };
    let queue = may_queue.then_some(&mut qc);
    let outcome = check.and_then(|()| run_wqe(dev, qp, sq, &buf[..blocks * WQEBB], queue));
    let QueuedCopy { into, failed, .. } = qc;
    if let Some(e) = failed {
        // the batch's copies, settled before this WRITE's own, failed: so does the batch
        batch.failed.get_or_insert(e);
    }
    match batch_turn(dev, qp, sq, batch, &outcome, into, (idx, opcode)) {
        Some(true) => return advance(sq),
        Some(false) => return,
        None => {}
    }
    // Behind WQEs still on the wire, a WQE that completes or fails right away takes its turn
    // in the wire's completion order.
    let queued = sq.wire.as_ref().is_some_and(|w| !w.msgs.is_empty());
    match outcome {
        Ok((Done::Complete(byte_cnt), signaled)) if queued => {
            requester::enqueue_local(sq, idx, opcode, signaled, byte_cnt, None);
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
            requester::enqueue_local(sq, idx, opcode, true, 0, Some((syndrome, why)));
            advance(sq);
        }
        Err((syndrome, why)) => {
            fail(dev, qp, sq, opcode, syndrome, why);
            advance(sq);
        }
    }
}

/// Parses the WQE `bytes` as the QP's transport has them and runs it: its outcome and whether
/// it is signaled. `queue`: see [`execute`].
fn run_wqe(
    dev: &Shared,
    qp: &Qp,
    sq: &mut SqState,
    bytes: &[u8],
    queue: Option<&mut QueuedCopy>,
) -> Result<(Done, bool), Fail> {
    let malformed = |e: prm::WqeError| (e.syndrome(), vendor::MALFORMED_WQE);
    let wqe = match qp.transport {
        Transport::Ud => return crate::ud::execute(dev, qp, sq, bytes),
        Transport::Rc => parse_wqe(bytes).map_err(malformed)?,
        Transport::Uc => {
            let wqe = parse_wqe(bytes).map_err(malformed)?;
            // UC carries SENDs and RDMA WRITEs only (IBTA's UC opcodes)
            let on_uc = match wqe.op {
                ParsedOp::Read { .. } | ParsedOp::Atomic { .. } => false,
                ParsedOp::Send { .. } => wqe.invalidate().is_none(),
                _ => true,
            };
            if !on_uc {
                return Err((Syndrome::LocalQpOp, vendor::INVALID_REQUEST));
            }
            wqe
        }
        Transport::Dci => {
            let (wqe, av) = parse_dc_wqe(bytes).map_err(malformed)?;
            if let Some(stall) = av.and_then(|av| crate::dc::aim(sq, &av)) {
                return Ok((Done::Stalled(stall), wqe.flags.signaled));
            }
            wqe
        }
        Transport::XrcIni => xrc_wqe(sq, bytes)?,
        // a DC or XRC target has no send queue
        Transport::Dct { .. } | Transport::XrcTgt => {
            return Err((Syndrome::LocalQpOp, vendor::INVALID_REQUEST))
        }
    };
    execute(dev, qp, sq, &wqe, queue).map(|r| (r, wqe.flags.signaled))
}

/// The checks of a WQE's control segment at `idx` before it is parsed: its index, its size
/// against the producer and the ring, its QPN, and an injected failure.
fn check_ctrl(
    dev: &Shared,
    qp: &Qp,
    sq: &mut SqState,
    ctrl: &CtrlSeg,
    idx: u16,
    from_bf: bool,
) -> Result<(), Fail> {
    let blocks = blocks_for_ds(ctrl.ds().max(1));
    let past_producer = blocks > sq.target.wrapping_sub(idx) as usize
        || blocks > qp.sq_blocks as usize
        || (from_bf && blocks * WQEBB > BF_HALF_SIZE);
    if ctrl.wqe_index() != idx {
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
    }
}

/// The in-process batch's part in a WQE's outcome: a WRITE whose copy was queued (`copied`)
/// joins it (`Some(true)`: the consumer moves on, no CQE yet); any other outcome completes
/// the batch first, and if that failed (the QP is in ERR) the WQE flushes (`Some(true)`) or,
/// stalled, flushes at its next turn (`Some(false)`). `None`: the WQE completes as usual.
fn batch_turn(
    dev: &Shared,
    qp: &Qp,
    sq: &mut SqState,
    batch: &mut LocalBatch,
    outcome: &Result<(Done, bool), Fail>,
    copied: Option<Arc<dyn crate::DeviceMemory>>,
    (idx, opcode): (u16, u8),
) -> Option<bool> {
    if let (Ok((Done::Complete(byte_cnt), signaled)), Some(mem)) = (outcome, copied) {
        sq.rnr_attempts = 0;
        sq.retry_deadline = None;
        batch.add(mem, (idx, opcode, *signaled, *byte_cnt));
        return Some(true);
    }
    if batch.is_empty() {
        return None;
    }
    settle_batch(dev, qp, sq, batch);
    if qp.state() != QpState::Err {
        return None;
    }
    if matches!(outcome, Ok((Done::Stalled(_) | Done::Queued, _))) {
        return Some(false);
    }
    flush_wqe(dev, qp, sq, opcode, idx);
    Some(true)
}

/// Most blocks read ahead from a send ring in device memory in one copy (a copy costs a
/// round trip through the driver whatever its size, up to a few KiB).
const READ_AHEAD_BLOCKS: usize = 64;

/// Reads the WQE at `idx` from the SQ ring into `buf`: its first block, then as many more as
/// its ds names (up to the ring size). From a ring in device memory the blocks come from
/// [`SqState::ahead`]: every block announced from `idx` on (up to [`READ_AHEAD_BLOCKS`]) is
/// read in one copy per contiguous span, and the WQEs behind this one run from that copy
/// while they lie in it.
fn fetch_wqe(
    qp: &Qp,
    sq: &mut SqState,
    idx: u16,
    buf: &mut [u8; MAX_WQE_BBS * WQEBB],
) -> Result<(), crate::DeviceMemoryError> {
    let ring = &qp.sq_ring;
    let mask = qp.sq_blocks as usize - 1;
    let mut have = 1;
    if ring.is_host() {
        ring.try_read((idx as usize & mask) * WQEBB, &mut buf[..WQEBB])?;
    } else {
        let announced = (sq.target.wrapping_sub(idx) as usize).clamp(1, qp.sq_blocks as usize);
        if sq.ahead_blocks(idx) < ahead_wqe_blocks(sq, idx).min(announced) {
            read_ahead(qp, sq, idx, announced.min(READ_AHEAD_BLOCKS))?;
        }
        let off = idx.wrapping_sub(sq.ahead.start) as usize;
        have = sq.ahead_blocks(idx).min(MAX_WQE_BBS);
        buf[..have * WQEBB].copy_from_slice(&sq.ahead.bytes[off * WQEBB..(off + have) * WQEBB]);
    }
    let ctrl: CtrlSeg = bytemuck::pod_read_unaligned(&buf[..DS_UNIT]);
    let blocks = blocks_for_ds(ctrl.ds().max(1)).min(qp.sq_blocks as usize);
    for i in have..blocks {
        let slot = (idx as usize + i) & mask;
        ring.try_read(slot * WQEBB, &mut buf[i * WQEBB..(i + 1) * WQEBB])?;
    }
    Ok(())
}

/// The blocks the WQE at `idx` needs by its ds, read from [`SqState::ahead`] (at most
/// [`MAX_WQE_BBS`]; 1 when the block is not there: it is read first).
fn ahead_wqe_blocks(sq: &SqState, idx: u16) -> usize {
    if sq.ahead_blocks(idx) == 0 {
        return 1;
    }
    let at = idx.wrapping_sub(sq.ahead.start) as usize * WQEBB;
    let ctrl: CtrlSeg = bytemuck::pod_read_unaligned(&sq.ahead.bytes[at..at + DS_UNIT]);
    blocks_for_ds(ctrl.ds().max(1)).min(MAX_WQE_BBS)
}

/// Replaces [`SqState::ahead`] with blocks `idx .. idx + n` of the send ring (device memory;
/// one read, two where the span wraps).
fn read_ahead(
    qp: &Qp,
    sq: &mut SqState,
    idx: u16,
    n: usize,
) -> Result<(), crate::DeviceMemoryError> {
    let ring = &qp.sq_ring;
    let first = idx as usize & (qp.sq_blocks as usize - 1);
    let head = n.min(qp.sq_blocks as usize - first);
    let bytes = &mut sq.ahead.bytes;
    bytes.resize(n * WQEBB, 0);
    let read = ring
        .try_read(first * WQEBB, &mut bytes[..head * WQEBB])
        .and_then(|()| match head < n {
            true => ring.try_read(0, &mut bytes[head * WQEBB..]),
            false => Ok(()),
        });
    sq.ahead.start = idx;
    if read.is_err() {
        bytes.clear();
    }
    read
}

/// Writes a CQE to `cq` on behalf of `qp` (delayed when fault injection asks).
fn push_cqe(dev: &Shared, qp: &Qp, sq: &SqState, cq: &crate::cq::Cq, cqe: Cqe64) {
    push_cqe_delayed(dev, qp, sq.delay, cq, cqe)
}

/// Completes the WQE at the consumer index with an error CQE and moves the QP to ERR.
/// WQEs still on the wire flush first, keeping completions in WQE order.
fn fail(dev: &Shared, qp: &Qp, sq: &mut SqState, opcode: u8, syndrome: Syndrome, why: u8) {
    fail_at(dev, qp, sq, sq.ci, opcode, syndrome, why)
}

/// [`fail`] for the WQE at `idx`.
fn fail_at(
    dev: &Shared,
    qp: &Qp,
    sq: &mut SqState,
    idx: u16,
    opcode: u8,
    syndrome: Syndrome,
    why: u8,
) {
    requester::flush_all(dev, qp, sq);
    sq.staged.clear();
    dev.counters.error(syndrome);
    tracing::debug!(
        qpn = qp.qpn,
        ?syndrome,
        vendor = why,
        wqe = idx,
        "WQE failed"
    );
    let e = ErrorCqe {
        responder: false,
        syndrome: syndrome as u8,
        vendor_syndrome: why,
        wqe_opcode: opcode,
        qpn: qp.qpn,
        wqe_counter: idx,
    };
    qp.set_state(QpState::Err);
    push_cqe(dev, qp, sq, &qp.send_cq, Cqe64::error(&e, 0));
}

fn flush_wqe(dev: &Shared, qp: &Qp, sq: &SqState, opcode: u8, idx: u16) {
    flush_cqe(dev, qp, sq.delay, opcode, idx)
}

/// Completes every posted receive of a QP in ERR with WR_FLUSH. A QP on an SRQ flushes only
/// the SRQ WQE it holds for a message in progress (the others stay for the SRQ's other QPs)
/// and raises LAST_WQE_REACHED once.
fn flush_rq(dev: &Shared, qp: &Qp) {
    // The state is checked again under the RQ lock: a QP reset (and perhaps brought up and
    // given new receives) since the engine saw ERR must not have them flushed.
    if qp.transport == Transport::XrcTgt {
        return flush_xrc(dev, qp);
    }
    if qp.srq.is_some() {
        let held = {
            let Some(mut rq) = qp.lock_rq_live() else {
                return;
            };
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
    let Some(mut rq) = qp.lock_rq_live() else {
        return;
    };
    // The state was read without the lock: a move out of ERR (RESET, then receives posted
    // again) may have happened since, and those receives must not be flushed.
    if qp.state() != QpState::Err {
        return;
    }
    let head = qp.rq_head(rq.ci as u16);
    while (rq.ci as u16) != head && head.wrapping_sub(rq.ci as u16) as u32 <= qp.rq_wqes {
        flush_recv_cqe(dev, qp, rq.ci as u16);
        rq.ci = rq.ci.wrapping_add(1);
    }
}

/// An XRC target in ERR: the XRC SRQ WQE it holds for a message in progress completes with
/// WR_FLUSH on that SRQ's CQ (the SRQ's other WQEs stay for the domain's other targets).
fn flush_xrc(dev: &Shared, qp: &Qp) {
    let (held, srq) = {
        let Some(mut rq) = qp.lock_rq_live() else {
            return;
        };
        if qp.state() != QpState::Err {
            return;
        }
        (rq.srq_wqe.take(), rq.xrc_srq.clone())
    };
    let (Some(idx), Some(s)) = (held, srq) else {
        return;
    };
    let Some(x) = s.xrc.as_ref() else { return };
    let mut cqe = recv_flush(dev, qp, idx);
    cqe.srqn_uidx = prm::Be32::new(x.user_index.unwrap_or(s.srqn()));
    push_recv_flush(dev, &x.cq, cqe);
}

/// The WR_FLUSH completion of receive WQE `idx` of an errored QP.
fn flush_recv_cqe(dev: &Shared, qp: &Qp, idx: u16) {
    let cqe = qp.stamp(recv_flush(dev, qp, idx));
    push_recv_flush(dev, &qp.recv_cq, cqe);
}

/// A WR_FLUSH CQE for receive WQE `idx` of `qp` (counted as an error completion).
fn recv_flush(dev: &Shared, qp: &Qp, idx: u16) -> Cqe64 {
    dev.counters.error(Syndrome::WrFlush);
    let e = ErrorCqe {
        responder: true,
        syndrome: Syndrome::WrFlush as u8,
        vendor_syndrome: 0,
        wqe_opcode: 0,
        qpn: qp.qpn,
        wqe_counter: idx,
    };
    Cqe64::error(&e, 0)
}

/// Writes a receive's flush CQE to `cq`, counting it or the CQ's refusal.
fn push_recv_flush(dev: &Shared, cq: &crate::cq::Cq, cqe: Cqe64) {
    match cq.push(cqe, None) {
        Ok(()) => Counters::add(&dev.counters.cqes, 1),
        Err(e) => count_cq_error(&dev.counters, e),
    }
}

/// Starts loading the first line of a WRITE's or SEND's source and, when the peer may be in
/// this process (`local_peer`), of a WRITE's target (for writing) or a READ's source; a READ's
/// target too. This happens before the keys are checked, so that the checks overlap the loads
/// (on the GPU host a line the initiator wrote costs about 100 ns). Addresses are only hints
/// here (see [`prefetch`]): nothing is accessed before its check.
fn prefetch_data(op: &ParsedOp<'_>, local_peer: bool) {
    let first = |l: &ParsedLocal<'_>| match l {
        ParsedLocal::Sges(list) => list.first().map(|d| sge_of(d).addr),
        ParsedLocal::Inline(_) => None,
        ParsedLocal::Mixed(_) => l.segments().find_map(|s| match s {
            LocalSeg::Sge(s) => Some(s.addr),
            LocalSeg::Inline(_) => None,
        }),
    };
    match op {
        ParsedOp::Write { remote, local } => {
            if let Some(a) = first(local) {
                prefetch(a, false);
            }
            if local_peer {
                prefetch(remote.addr, true);
            }
        }
        ParsedOp::Send { local } => {
            if let Some(a) = first(local) {
                prefetch(a, false);
            }
        }
        ParsedOp::Read { remote, local } => {
            if local_peer {
                prefetch(remote.addr, false);
            }
            if let Some(d) = local.first() {
                prefetch(sge_of(d).addr, true);
            }
        }
        _ => {}
    }
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
/// default UDP port. A DC initiator's target (the WQE's address vector: [`crate::dc::aim`])
/// is found the same way, and its requests on the wire carry a DCETH ([`dc_on_wire`]). In
/// process the QP found must be of the requester's kind (an RC QP for RC, a DC target that
/// holds the presented key for a DC initiator), else nobody answers.
fn route(dev: &Shared, qp: &Qp, sq: &mut SqState) -> Result<Result<Route, Stall>, Fail> {
    if sq.wire.is_some() {
        return Ok(Ok(Route::Wire));
    }
    let cached = sq.peer.as_ref().and_then(|w| w.upgrade());
    let found = match (cached, sq.remote) {
        (Some(p), _) => Some(p),
        (None, None) => None,
        (None, Some((gid, qpn))) => {
            if let Some(to) = dev.peer_addr(&gid) {
                if requester::connect(dev, sq, gid, qpn, to) {
                    on_wire(dev, qp, sq);
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
                        if requester::connect(dev, sq, gid, qpn, to) {
                            on_wire(dev, qp, sq);
                            return Ok(Ok(Route::Wire));
                        }
                    }
                    None
                }
            }
        }
    };
    let accepts = |p: &Qp| match (qp.transport, p.transport) {
        (Transport::Dci, Transport::Dct { key }) if key != sq.dc_key => {
            // a ConnectX's DCT drops a request with the wrong key: the initiator times out
            Counters::add(&p.counters.dc_key_violations, 1);
            false
        }
        (Transport::Dci, Transport::Dct { .. })
        | (Transport::XrcIni, Transport::XrcTgt)
        | (Transport::Rc, Transport::Rc)
        | (Transport::Uc, Transport::Uc) => true,
        _ => false,
    };
    match found {
        Some(p) if accepts(&p) && matches!(p.state(), QpState::Rtr | QpState::Rts) => {
            Ok(Ok(Route::Local(p)))
        }
        // UC runs no transport timer: the caller drops the message
        _ if qp.is_uc() => Ok(Err(Stall::Until(Instant::now()))),
        _ => no_answer(sq).map(Err),
    }
}

/// A QP's requester transport on the wire takes the QP's packet class. A DC initiator's
/// requests carry the DCETH (the key, the initiator, this connection's generation and first
/// PSN), and only that target's answers are taken.
fn on_wire(dev: &Shared, qp: &Qp, sq: &mut SqState) {
    if let Some(w) = sq.wire.as_mut() {
        w.class = qp.wire_class();
    }
    if !qp.is_dci() {
        return;
    }
    let (Some(w), Some((gid, dctn))) = (sq.wire.as_mut(), sq.remote) else {
        return;
    };
    w.dc = Some(crate::net::packet::Dceth {
        key: sq.dc_key,
        generation: sq.dc_generation,
        dci: qp.qpn,
        start_psn: w.next_psn,
        reply_port: dev.port().map_or(0, |p| p.local.port()),
    });
    qp.set_wire_remote(gid.to_ipv4().map(|ip| (ip, dctn)));
}

/// No peer answers (none found, or it vanished under the request): the transport timer runs
/// `retry_cnt + 1` times, then the QP fails with TRANSPORT_RETRY_EXC.
fn no_answer(sq: &mut SqState) -> Result<Stall, Fail> {
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
        Ok(Stall::Until(deadline.min(now + Duration::from_millis(1))))
    }
}

/// The device's reading of a UMR WQE on a memory window.
fn mw_request(op: &MwOp) -> MwRequest {
    let bind = op.bind.map(|b| {
        let right = |bit: u8, a: Access| if b.access & bit != 0 { a.0 } else { 0 };
        MwBinding {
            start: b.start,
            len: b.len,
            access: Access(
                right(MKEY_ACCESS_REMOTE_WRITE, Access::REMOTE_WRITE)
                    | right(MKEY_ACCESS_REMOTE_READ, Access::REMOTE_READ)
                    | right(MKEY_ACCESS_ATOMIC, Access::REMOTE_ATOMIC),
            ),
            mr_key: b.mr_key,
            mr_addr: b.mr_addr,
            qpn: (op.qpn != 0xff_ffff).then_some(op.qpn),
        }
    });
    MwRequest {
        key: op.key,
        variant: op.variant,
        bind,
        check_free: op.check_free,
        check_qpn: op.check_qpn,
    }
}

/// Runs a parsed WQE as the requester: local WQEs here, the rest checked locally, then sent
/// to the peer (over the wire: handed to the requester transport) and its answer taken.
///
/// With `queue` given, a WRITE to an in-process peer whose bytes move within one device
/// memory may leave its copy queued: the memory is put there, and the caller settles it
/// before the WQE's completion is written.
fn execute(
    dev: &Shared,
    qp: &Qp,
    sq: &mut SqState,
    wqe: &prm::ParsedWqe<'_>,
    queue: Option<&mut QueuedCopy>,
) -> Result<Done, Fail> {
    if let ParsedOp::Nop = wqe.op {
        return Ok(Done::Complete(0));
    }
    if let ParsedOp::Wait { cqn, max_index } = wqe.op {
        if !qp.cross_channel {
            return Err((Syndrome::LocalQpOp, vendor::NOT_CROSS_CHANNEL));
        }
        return match dev.cq(cqn) {
            None => Err((Syndrome::LocalQpOp, vendor::INVALID_REQUEST)),
            Some(cq) if cq.has_written(max_index) && cq.wrote_error(max_index) => {
                Err((Syndrome::WrFlush, vendor::WAITED_FOR_ERROR))
            }
            Some(cq) if cq.has_written(max_index) => Ok(Done::Complete(0)),
            Some(_) => Ok(Done::Stalled(Stall::Wait { cqn, max_index })),
        };
    }
    let g = qp.mrs.read();
    if let ParsedOp::Dump { local } = wqe.op {
        return dump(qp, &g, local);
    }
    if let ParsedOp::Umr(op) = wqe.op {
        return umr(qp, &g, &op);
    }
    prefetch_data(&wqe.op, sq.wire.is_none());
    let from = qp.qpn;
    // Local checks come first: the requester gathers (or validates its scatter list) before
    // anything goes out.
    let prepared = prepare(qp, &g, wqe)?;
    let peer = match route(dev, qp, sq)? {
        Ok(Route::Local(p)) => p,
        Ok(Route::Wire) => {
            let staged = stage_for_wire(dev, qp, sq, &g, wqe, &prepared)?;
            drop(prepared);
            drop(g);
            return requester::enqueue(dev, qp, sq, wqe, staged);
        }
        // UC: nobody answers, so nobody is waited for: the message is lost
        Err(_) if qp.is_uc() => return Ok(Done::Complete(total_of(&prepared) as u32)),
        Err(stall) => return Ok(Done::Stalled(stall)),
    };
    let move_data = !dev.completion_only;
    let xrc = sq.xrc_srqn;
    let (response, len) = request(&peer, from, xrc, &prepared, wqe, move_data, queue);
    let own_failure = response == Response::Nak(Syndrome::LocalProt, vendor::DEVICE_MEMORY);
    if qp.is_uc() && !own_failure {
        // UC has no ACK: whatever the responder made of it, the message has left
        Counters::add(&dev.counters.bytes, len);
        return Ok(Done::Complete(len as u32));
    }
    answered(dev, sq, &prepared, response, len)
}

/// An XRC initiator's WQE: the XRC segment names the remote XRC SRQ (kept for the message);
/// masked atomics (no XRC form on the wire) are LOCAL_QP_OP.
fn xrc_wqe<'a>(sq: &mut SqState, bytes: &'a [u8]) -> Result<prm::ParsedWqe<'a>, Fail> {
    let (wqe, srqn) = parse_xrc_wqe(bytes).map_err(|e| (e.syndrome(), vendor::MALFORMED_WQE))?;
    if let ParsedOp::Atomic {
        kind: AtomicKind::MaskedFetchAdd { .. } | AtomicKind::MaskedCompareSwap { .. },
        ..
    } = wqe.op
    {
        return Err((Syndrome::LocalQpOp, vendor::INVALID_REQUEST));
    }
    sq.xrc_srqn = srqn;
    Ok(wqe)
}

/// Bytes a prepared WQE's message carries.
fn total_of(p: &Prepared) -> u64 {
    match p {
        Prepared::Write(_, r) | Prepared::Send(r) | Prepared::Read(_, r) => total(r),
        Prepared::Atomic(_, kind, _) => kind.size() as u64,
    }
}

/// A DUMP, a local read of one segment: the lkey, PD and range are checked as for any gather.
/// The device's own writes are complete before their CQEs, so there is nothing left to flush:
/// the read moves no byte.
fn dump(qp: &Qp, g: &MrGuard<'_>, local: Sge) -> Result<Done, Fail> {
    g.check(
        qp.pd,
        Access::NONE,
        local.lkey.0,
        local.addr,
        local.len as u64,
    )
    .map_err(local_err)?;
    Ok(Done::Complete(local.len))
}

/// A UMR: local, done when the mkey is changed. The mkey it names decides how the WQE reads:
/// an indirect mkey's layout, or a memory window's binding.
fn umr(qp: &Qp, g: &MrGuard<'_>, op: &UmrOp<'_>) -> Result<Done, Fail> {
    if g.is_indirect(op.key) {
        g.umr_indirect(qp.pd, qp.qpn, op).map_err(|e| {
            tracing::debug!(qpn = qp.qpn, error = %e, "UMR on an indirect mkey failed");
            (Syndrome::MwBind, vendor::UMR)
        })?;
        return Ok(Done::Complete(0));
    }
    let mw = op
        .window()
        .ok_or((Syndrome::LocalQpOp, vendor::MALFORMED_WQE))?;
    g.bind_mw(qp.pd, qp.qpn, &mw_request(&mw)).map_err(|e| {
        tracing::debug!(qpn = qp.qpn, error = %e, "memory window operation failed");
        (Syndrome::MwBind, vendor::MEMORY_WINDOW)
    })?;
    Ok(Done::Complete(0))
}

/// A WQE's local side, checked before anything goes out (see [`prepare`]).
enum Prepared {
    Write(prm::RemoteAddr, SmallVec<[MemRange; 4]>),
    Send(SmallVec<[MemRange; 4]>),
    Read(prm::RemoteAddr, SmallVec<[MemRange; 4]>),
    Atomic(prm::RemoteAddr, AtomicKind, MemRange),
}

/// The local checks of a WRITE, SEND, READ or atomic: its gather list, its scatter list or its
/// result segment resolved into checked ranges.
fn prepare(qp: &Qp, g: &MrGuard<'_>, wqe: &prm::ParsedWqe<'_>) -> Result<Prepared, Fail> {
    Ok(match wqe.op {
        ParsedOp::Write { remote, local } => Prepared::Write(remote, gather(g, qp, &local)?),
        ParsedOp::Send { local } => Prepared::Send(gather(g, qp, &local)?),
        ParsedOp::Read { remote, local } => {
            let dst = local_ranges(g, qp, Access::LOCAL_WRITE, local)?;
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
        ParsedOp::Nop | ParsedOp::Wait { .. } | ParsedOp::Dump { .. } | ParsedOp::Umr(_) => {
            unreachable!("execute handles them before")
        }
    })
}

/// The source of a WRITE or SEND whose payload is read ahead for the wire: one with device
/// memory, up to [`STAGE_MAX`] bytes. A source wholly in host memory is not: packets are built
/// from it directly.
fn wire_source(prepared: &Prepared) -> Option<&SmallVec<[MemRange; 4]>> {
    let (Prepared::Write(_, src) | Prepared::Send(src)) = prepared else {
        return None;
    };
    (total(src) <= STAGE_MAX && src.iter().any(|r| !r.is_host())).then_some(src)
}

/// The payload of a WRITE or SEND bound for the wire whose source has device memory
/// ([`wire_source`]), read now or earlier (one read for the message instead of one per
/// packet, each a round trip through the driver); `None` for any other WQE. The packets
/// still check the source's keys as they are built; the bytes are those the source held after
/// the doorbell announced the WQE, which is what a NIC reads as long as the application keeps
/// the buffer until the completion, as verbs requires.
///
/// The sources of the WQEs announced behind this one are read with it, in one batched read
/// per device memory ([`crate::readahead::stage_batch`]), and kept ([`SqState::staged`])
/// until their turn: a WQE whose entry is there (its keys checked again by `prepare`, its
/// ranges the same) takes its bytes, or fails with the device-memory error its read met.
fn stage_for_wire(
    dev: &Shared,
    qp: &Qp,
    sq: &mut SqState,
    g: &MrGuard<'_>,
    wqe: &prm::ParsedWqe<'_>,
    prepared: &Prepared,
) -> Result<Option<Vec<u8>>, Fail> {
    let Some(src) = wire_source(prepared) else {
        return Ok(None);
    };
    if wqe.flags.fence != Fence::None && sq.wire.as_ref().is_some_and(|w| !w.msgs.is_empty()) {
        // requester::enqueue holds it back until the wire drains: read once it goes
        return Ok(None);
    }
    let got = match sq.staged.take(sq.ci, src) {
        Some(got) => got,
        None => crate::readahead::stage_batch(dev, qp, sq, g, wqe, src),
    };
    got.map(Some)
        .map_err(|e| local_devmem_err(&dev.counters, &e))
}

/// Sends the request to the in-process peer; its response, and the message's length. A WRITE
/// may leave its copy queued where `queue` is given (see [`execute`]).
fn request(
    peer: &Qp,
    from: u32,
    xrc: Option<u32>,
    prepared: &Prepared,
    wqe: &prm::ParsedWqe<'_>,
    move_data: bool,
    queue: Option<&mut QueuedCopy>,
) -> (Response, u64) {
    let imm = wqe.imm();
    match prepared {
        Prepared::Write(r, src) => {
            let len = total(src);
            let req = Request::Write {
                raddr: r.addr,
                rkey: r.rkey.0,
                src,
                len,
                imm,
                queue,
            };
            (respond(peer, from, xrc, req, move_data), len)
        }
        Prepared::Send(src) => {
            let len = total(src);
            let req = Request::Send {
                src,
                len,
                imm,
                invalidate: wqe.invalidate(),
            };
            (respond(peer, from, xrc, req, move_data), len)
        }
        Prepared::Read(r, dst) => {
            let len = total(dst);
            let req = Request::Read {
                raddr: r.addr,
                rkey: r.rkey.0,
                dst,
                len,
            };
            (respond(peer, from, xrc, req, move_data), len)
        }
        Prepared::Atomic(r, kind, _) => {
            let req = Request::Atomic {
                raddr: r.addr,
                rkey: r.rkey.0,
                kind: *kind,
            };
            (respond(peer, from, xrc, req, move_data), kind.size() as u64)
        }
    }
}

/// Takes the peer's response: the WQE completes (an atomic's original value written to its
/// result segment), stalls (RNR, no peer) or fails.
fn answered(
    dev: &Shared,
    sq: &mut SqState,
    prepared: &Prepared,
    response: Response,
    len: u64,
) -> Result<Done, Fail> {
    match response {
        Response::Ack | Response::AtomicAck(_) => {
            if let (Response::AtomicAck(old), Prepared::Atomic(_, kind, res)) =
                (&response, prepared)
            {
                let bytes = crate::responder::atomic_result_bytes(*old, kind.size());
                let src = &bytes[..kind.size() as usize];
                // SAFETY: `res` was checked (LOCAL_WRITE, exactly n bytes) under the caller's
                // guard, still held.
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
        Response::Vanished => {
            sq.peer = None;
            no_answer(sq).map(Done::Stalled)
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
