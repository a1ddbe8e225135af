//! RC reliability over the wire: the requester's state machine (PSNs, send window,
//! segmentation, ACK processing, go-back-N retransmission, timers, in-order completion) and
//! the responder's (expected PSN, MSN, duplicate detection, NAKs, READ responses, the atomic
//! result cache).
//!
//! Locking: the requester state lives in the QP's SQ state and the responder state in its RQ
//! state, so each is touched under the same lock as the rest of that side (the engine holds
//! the SQ lock while it runs WQEs; the I/O thread takes it to process responses). Neither path
//! ever holds both.

use super::packet::{
    self, aeth, opcode as op, Aeth, AtomicEth, Bth, Flow, MaskedAtomicEth, Packet, Reth, BTH_LEN,
    DEFAULT_PKEY, ICRC_LEN, MASK24, MAX_DATAGRAM,
};
use super::socket::{self, Port, TxBatch};
use super::state::{
    psn_add, psn_diff, same_request, Acked, GapReport, HeldRead, Hold, InMsg, OutMsg, OutOp,
    ReqWire, Src, FAST_RTO_MAX,
};
use crate::completion::{flush_cqe, push_cqe_delayed};
use crate::counters::Counters;
use crate::mem::{read_range, total, write_range, Access, MemRange, MrGuard};
use crate::outcome::{local_devmem_err, local_err, rnr_delay, vendor, Done, Fail, Stall};
use crate::qp::{Qp, QpState, SqState};
use crate::responder::{remote_devmem_nak, Resp, Response};
use crate::shared::Shared;
use crate::DeviceMemoryError;
use crate::Gid;
use prm::cqe::{Cqe64, ErrorCqe, RespKind};
use prm::parse::{sge_of, AtomicKind, ParsedLocal, ParsedOp, ParsedWqe};
use prm::wqe::{AtomicSize, Fence, Sge};
use prm::Syndrome;
use smallvec::SmallVec;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The most PSNs a requester keeps outstanding (well inside the 2^23 half of PSN space in
/// which ordering is defined).
const MAX_OUTSTANDING_PSNS: i64 = 1 << 22;

/// Atomic results a responder remembers for duplicate atomics.
const ATOMIC_CACHE: usize = 64;

/// READ requests a responder holds for duplicates at least (more when its port's window is
/// larger: a requester has at most a window of READs outstanding).
const READ_CACHE: usize = 1024;

/// Packets one pump sends before it lets go of the QP (so that ACKs are taken between
/// bursts); the engine and every ACK pump again.
const BURST: u32 = 32;

/// Sets up the wire transport of a QP whose peer (`gid`, `qpn`) listens at `to`. False when
/// the device has no port or the GID names no IPv4 address.
pub(crate) fn connect(dev: &Shared, sq: &mut SqState, gid: Gid, qpn: u32, to: SocketAddr) -> bool {
    let (Some(port), Some(ip), SocketAddr::V4(to4)) = (dev.port(), gid.to_ipv4(), to) else {
        return false;
    };
    let psn = sq.rts.sq_psn & MASK24;
    // RoCE never fragments: the RTR path MTU, but no more than the route's link allows.
    let mtu = port.path_mtu(ip).map_or(sq.mtu, |m| m.min(sq.mtu));
    if mtu != sq.mtu {
        tracing::debug!(rtr = sq.mtu, mtu, "path MTU lowered to the route's");
    }
    let window = port.cfg.window.clamp(1, MAX_WINDOW);
    let flow = Flow {
        src: port.ip,
        dst: ip,
        // an entropy port per flow (answers come back to it)
        sport: port.source_port(qpn ^ u32::from(ip)),
        dport: to4.port(),
    };
    let mut w = ReqWire::new(to, flow, qpn, mtu, window, psn);
    w.selective = sq.selective_repeat;
    w.set_rts(sq.rts.timeout, sq.rts.retry_cnt, sq.rts.rnr_retry);
    tracing::debug!(to = %to, remote_qpn = qpn, "QP on the wire");
    sq.wire = Some(Box::new(w));
    true
}

/// Queues a WQE that needs no packet (or failed locally) behind the WQEs on the wire.
pub(crate) fn enqueue_local(
    sq: &mut SqState,
    idx: u16,
    opcode: u8,
    signaled: bool,
    byte_cnt: u32,
    fail: Option<Fail>,
) {
    let Some(w) = sq.wire.as_mut() else { return };
    w.blocked |= fail.is_some();
    w.msgs.push_back(OutMsg {
        idx,
        opcode,
        signaled,
        solicited: false,
        op: OutOp::Local { byte_cnt },
        len: 0,
        psn: w.next_psn,
        npkts: 0,
        fail,
    });
}

fn src_of(l: &ParsedLocal<'_>) -> Src {
    match l {
        ParsedLocal::Sges(list) => Src::Sges(list.iter().map(sge_of).collect()),
        ParsedLocal::Inline(b) => Src::Inline(b.to_vec()),
    }
}

/// Hands a WQE that passed the local checks to the wire.
pub(crate) fn enqueue(
    dev: &Shared,
    qp: &Qp,
    sq: &mut SqState,
    wqe: &ParsedWqe<'_>,
) -> Result<Done, Fail> {
    let Some(w) = sq.wire.as_mut() else {
        return Err((Syndrome::TransportRetryExc, vendor::NO_PEER));
    };
    if wqe.flags.fence != Fence::None && !w.msgs.is_empty() {
        return Ok(Done::Stalled(Stall::Drain));
    }
    let imm = wqe.imm();
    let (op, len) = match wqe.op {
        ParsedOp::Write { remote, local } => (
            OutOp::Write {
                raddr: remote.addr,
                rkey: remote.rkey.0,
                imm,
                src: src_of(&local),
            },
            local.len(),
        ),
        ParsedOp::Send { local } => (
            OutOp::Send {
                imm,
                invalidate: wqe.invalidate(),
                src: src_of(&local),
            },
            local.len(),
        ),
        ParsedOp::Read { remote, local } => {
            let dst: SmallVec<[Sge; 4]> = local.iter().map(sge_of).collect();
            let len = dst.iter().map(|s| s.len as u64).sum();
            (
                OutOp::Read {
                    raddr: remote.addr,
                    rkey: remote.rkey.0,
                    dst,
                },
                len,
            )
        }
        ParsedOp::Atomic {
            remote,
            kind,
            result,
        } => (
            OutOp::Atomic {
                raddr: remote.addr,
                rkey: remote.rkey.0,
                kind,
                result,
            },
            kind.size() as u64,
        ),
        ParsedOp::Nop | ParsedOp::Wait { .. } | ParsedOp::Dump { .. } | ParsedOp::Window(_) => {
            return Ok(Done::Complete(0))
        }
    };
    let npkts = match op {
        OutOp::Atomic { .. } => 1,
        _ => len.div_ceil(w.mtu as u64).max(1) as u32,
    };
    let outstanding = psn_diff(w.next_psn, w.una) as i64;
    if !w.msgs.is_empty() && outstanding + npkts as i64 > MAX_OUTSTANDING_PSNS {
        return Ok(Done::Stalled(Stall::Drain));
    }
    let psn = w.next_psn;
    w.next_psn = psn_add(psn, npkts);
    w.msgs.push_back(OutMsg {
        idx: wqe.wqe_index,
        opcode: wqe.opcode as u8,
        signaled: wqe.flags.signaled,
        solicited: wqe.flags.solicited,
        op,
        len,
        psn,
        npkts,
        fail: None,
    });
    pump(dev, qp, w, Instant::now());
    Ok(Done::Queued)
}

/// Copies `n` bytes at offset `off` of a message's source into `out`.
fn gather(
    c: &Counters,
    g: &MrGuard<'_>,
    pd: crate::PdId,
    src: &Src,
    off: u64,
    n: u64,
    out: &mut Vec<u8>,
) -> Result<(), Fail> {
    match src {
        Src::Inline(b) => {
            let (a, e) = (off as usize, (off + n) as usize);
            out.extend_from_slice(
                b.get(a..e)
                    .ok_or((Syndrome::LocalLength, vendor::TOO_LONG))?,
            );
        }
        Src::Sges(list) => {
            let mut pos = 0u64;
            for s in list {
                let slen = s.len as u64;
                let (a, e) = (off.max(pos), (off + n).min(pos + slen));
                if a < e {
                    let r = g
                        .check(pd, Access::NONE, s.lkey.0, s.addr + (a - pos), e - a)
                        .map_err(local_err)?;
                    // SAFETY: `r` was checked under `g`, which the caller still holds.
                    unsafe { append_range(out, &r, 0, r.len) }
                        .map_err(|e| local_devmem_err(c, &e))?;
                }
                pos += slen;
                if pos >= off + n {
                    break;
                }
            }
        }
    }
    Ok(())
}

/// Appends `n` bytes at offset `off` of a checked range (host or device memory). On a
/// device-memory failure `out` keeps its length.
///
/// # Safety
/// `r` must have been checked under an `MrGuard` the caller still holds, and
/// `off + n <= r.len`.
unsafe fn append_range(
    out: &mut Vec<u8>,
    r: &MemRange,
    off: u64,
    n: u64,
) -> Result<(), DeviceMemoryError> {
    let (start, n) = (out.len(), n as usize);
    if r.is_host() {
        out.reserve(n);
        // SAFETY: `r` is live host memory (checked under a guard the caller holds) with
        // `off + n` bytes; the destination has `n` bytes reserved past its length. The source
        // may be written concurrently (DMA semantics): it is copied raw, never referenced.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (r.addr + off) as *const u8,
                out.as_mut_ptr().add(start),
                n,
            );
            out.set_len(start + n);
        }
        return Ok(());
    }
    out.resize(start + n, 0);
    // SAFETY: per the contract.
    let read = unsafe { read_range(r, off, &mut out[start..]) };
    if read.is_err() {
        out.truncate(start);
    }
    read
}

/// Scatters `bytes` at offset `off` of a local list (LOCAL_WRITE checked).
fn scatter(
    c: &Counters,
    g: &MrGuard<'_>,
    pd: crate::PdId,
    dst: &[Sge],
    off: u64,
    bytes: &[u8],
) -> Result<(), Fail> {
    let n = bytes.len() as u64;
    let mut pos = 0u64;
    for s in dst {
        let slen = s.len as u64;
        let (a, e) = (off.max(pos), (off + n).min(pos + slen));
        if a < e {
            let r = g
                .check(pd, Access::LOCAL_WRITE, s.lkey.0, s.addr + (a - pos), e - a)
                .map_err(local_err)?;
            // SAFETY: `r` checked under `g` (held by the caller), exactly `e - a` bytes.
            unsafe { write_range(&r, 0, &bytes[(a - off) as usize..(e - off) as usize]) }
                .map_err(|e| local_devmem_err(c, &e))?;
        }
        pos += slen;
        if pos >= off + n {
            break;
        }
    }
    Ok(())
}

/// What [`build`] made of one PSN.
enum Built {
    /// A packet at the end of the buffer; the next PSN to send after it, and whether it asks
    /// for an ACK.
    Packet { next: u32, ack_req: bool },
    /// The PSN belongs to no message that sends packets: sending stops here, at `next`.
    Skip { next: u32 },
    /// The message failed (or had failed): send nothing more.
    Halt,
}

/// Builds the packet of PSN `p` at the end of `buf` (in place in a batch, see
/// [`Port::send_built`]): its message's opcode for that position, headers, payload gathered
/// from local memory, ICRC for IPv4 identification `ip_id`. A message that cannot be built
/// fails (and the transport halts); unless a packet was built, `buf` may hold part of one
/// past its old length (the caller cuts it off).
#[allow(clippy::too_many_arguments)]
fn build(
    dev: &Shared,
    g: &MrGuard<'_>,
    pd: crate::PdId,
    w: &mut ReqWire,
    p: u32,
    limit: i32,
    buf: &mut Vec<u8>,
    ip_id: u16,
) -> Built {
    let start = buf.len();
    let ack_every = (limit as u32 / 4).max(1);
    let i = w.find(p);
    let next_psn = w.next_psn;
    let window_edge = psn_diff(psn_add(p, 1), w.una) >= limit;
    let (mtu, dest_qp) = (w.mtu as u64, w.remote_qpn);
    let flow = w.flow;
    let Some(m) = w.msgs.get_mut(i) else {
        return Built::Skip { next: next_psn };
    };
    if m.fail.is_some() {
        w.halted = true;
        return Built::Halt;
    }
    let k = psn_diff(p, m.psn).max(0) as u32;
    let mut bth = Bth {
        opcode: 0,
        mig_req: true,
        pkey: DEFAULT_PKEY,
        dest_qp,
        psn: p,
        ..Bth::default()
    };
    let mut pkt = Packet::default();
    let mut next = psn_add(p, 1);
    let built: Result<(), Fail> = match &m.op {
        OutOp::Write { .. } | OutOp::Send { .. } => {
            let off = k as u64 * mtu;
            let n = mtu.min(m.len.saturating_sub(off));
            let first = k == 0;
            let last = k + 1 >= m.npkts;
            let (opc, src) = match &m.op {
                OutOp::Write {
                    imm,
                    src,
                    raddr,
                    rkey,
                } => {
                    if first {
                        pkt.reth = Some(Reth {
                            va: *raddr,
                            rkey: *rkey,
                            len: m.len as u32,
                        });
                    }
                    let o = match (first, last, imm.is_some()) {
                        (true, true, false) => op::WRITE_ONLY,
                        (true, true, true) => op::WRITE_ONLY_IMM,
                        (true, false, _) => op::WRITE_FIRST,
                        (false, false, _) => op::WRITE_MIDDLE,
                        (false, true, false) => op::WRITE_LAST,
                        (false, true, true) => op::WRITE_LAST_IMM,
                    };
                    if last {
                        pkt.imm = *imm;
                    }
                    (o, src)
                }
                OutOp::Send {
                    imm,
                    invalidate,
                    src,
                } => {
                    let o = match (first, last, imm.is_some(), invalidate.is_some()) {
                        (true, false, ..) => op::SEND_FIRST,
                        (false, false, ..) => op::SEND_MIDDLE,
                        (true, true, _, true) => op::SEND_ONLY_INV,
                        (false, true, _, true) => op::SEND_LAST_INV,
                        (true, true, false, _) => op::SEND_ONLY,
                        (true, true, true, _) => op::SEND_ONLY_IMM,
                        (false, true, false, _) => op::SEND_LAST,
                        (false, true, true, _) => op::SEND_LAST_IMM,
                    };
                    if last {
                        pkt.imm = *imm;
                        pkt.ieth = *invalidate;
                    }
                    (o, src)
                }
                _ => unreachable!("matched above"),
            };
            bth.opcode = opc;
            bth.solicited = last && m.solicited && (imm_of(&m.op) || is_send(&m.op));
            // a resend always asks: its answer is what the requester waits for
            bth.ack_req = last
                || window_edge
                || psn_add(p, 1) == next_psn
                || p % ack_every == 0
                || psn_diff(p, w.sent_hi) < 0;
            pkt.bth = bth;
            let _ = packet::encode_headers(&pkt, n as usize, buf);
            gather(&dev.counters, g, pd, src, off, n, buf)
                .map(|()| packet::finish_at(&flow, ip_id, start, n as usize, buf))
        }
        OutOp::Read { raddr, rkey, .. } => {
            let off = k as u64 * mtu;
            bth.opcode = op::READ_REQUEST;
            pkt.bth = bth;
            pkt.reth = Some(Reth {
                va: raddr.wrapping_add(off),
                rkey: *rkey,
                len: m.len.saturating_sub(off) as u32,
            });
            next = m.end();
            packet::encode_at(&pkt, &flow, ip_id, buf).map_err(|_| bad_wire())
        }
        OutOp::Atomic {
            raddr, rkey, kind, ..
        } => {
            match *kind {
                AtomicKind::FetchAdd { add } => {
                    bth.opcode = op::FETCH_ADD;
                    pkt.atomic = Some(AtomicEth {
                        va: *raddr,
                        rkey: *rkey,
                        swap_add: add,
                        compare: 0,
                    });
                }
                AtomicKind::CompareSwap { compare, swap } => {
                    bth.opcode = op::CMP_SWAP;
                    pkt.atomic = Some(AtomicEth {
                        va: *raddr,
                        rkey: *rkey,
                        swap_add: swap,
                        compare,
                    });
                }
                AtomicKind::MaskedFetchAdd {
                    size,
                    add,
                    field_boundary,
                } => {
                    bth.opcode = op::MASKED_FETCH_ADD;
                    pkt.masked = Some(MaskedAtomicEth {
                        va: *raddr,
                        rkey: *rkey,
                        size: size.bytes() as u8,
                        swap_add: add,
                        compare_boundary: field_boundary,
                        swap_mask: 0,
                        compare_mask: 0,
                    });
                }
                AtomicKind::MaskedCompareSwap {
                    size,
                    compare,
                    compare_mask,
                    swap,
                    swap_mask,
                } => {
                    bth.opcode = op::MASKED_CMP_SWAP;
                    pkt.masked = Some(MaskedAtomicEth {
                        va: *raddr,
                        rkey: *rkey,
                        size: size.bytes() as u8,
                        swap_add: swap,
                        compare_boundary: compare,
                        swap_mask,
                        compare_mask,
                    });
                }
            }
            pkt.bth = bth;
            packet::encode_at(&pkt, &flow, ip_id, buf).map_err(|_| bad_wire())
        }
        OutOp::Local { .. } => {
            // Holds no PSN: `find` never returns it for a PSN still to send.
            return Built::Skip { next: next_psn };
        }
    };
    match built {
        Ok(()) => Built::Packet {
            next,
            ack_req: bth.ack_req,
        },
        Err(f) => {
            m.fail = Some(f);
            w.halted = true;
            Built::Halt
        }
    }
}

/// Transmits what the window allows, at most [`BURST`] packets, after the packet a sequence
/// NAK asked for again (selective repeat). Returns whether it sent anything.
fn pump(dev: &Shared, qp: &Qp, w: &mut ReqWire, now: Instant) -> bool {
    let Some(port) = dev.port() else {
        return false;
    };
    if w.halted || qp.state() != QpState::Rts {
        return false;
    }
    if let Some(t) = w.rnr_until {
        if now < t {
            return false;
        }
        w.rnr_until = None;
    }
    let mut sent = 0u32;
    let g = qp.mrs.read();
    // Packets are built in place at the end of the batch (no copy into it; alone while fault
    // injection is on, see `TxBatch::slot`); `send_built` takes each from there.
    let mut batch = std::mem::take(&mut w.batch);
    let in_place = !port.is_faulty();
    let limit = w.window.min(w.cwnd).max(1) as i32;
    while sent < BURST {
        let Some(p) = w.resend.pop_front() else {
            break;
        };
        // only a PSN sent and not yet acknowledged
        if psn_diff(p, w.una) >= 0 && psn_diff(p, w.sent_hi) < 0 {
            let (start, id) = batch.slot(in_place);
            if let Built::Packet { .. } = build(dev, &g, qp.pd, w, p, limit, batch.buf(), id) {
                port.send_built(&mut batch, start, w.to, &w.flow);
                Counters::add(&dev.counters.wire.retransmits, 1);
                // the early timer waits behind the resend
                w.fast_deadline = Some(now + w.fast_rto());
                sent += 1;
            } else {
                batch.cut(start);
            }
        }
    }
    while !w.halted
        && w.send_psn != w.next_psn
        && psn_diff(w.send_psn, w.una) < limit
        && sent < BURST
    {
        let p = w.send_psn;
        let (start, id) = batch.slot(in_place);
        let (next, ack_req) = match build(dev, &g, qp.pd, w, p, limit, batch.buf(), id) {
            Built::Packet { next, ack_req } => (next, ack_req),
            Built::Skip { next } => {
                batch.cut(start);
                w.send_psn = next;
                break;
            }
            Built::Halt => {
                batch.cut(start);
                break;
            }
        };
        port.send_built(&mut batch, start, w.to, &w.flow);
        if psn_diff(p, w.sent_hi) < 0 {
            Counters::add(&dev.counters.wire.retransmits, 1);
        } else if ack_req || next != psn_add(p, 1) {
            w.probe(p, Instant::now());
        }
        w.send_psn = next;
        if psn_diff(next, w.sent_hi) > 0 {
            w.sent_hi = next;
        }
        sent += 1;
    }
    w.batch = batch;
    port.flush(&mut w.batch);
    if sent > 0 {
        // from the end of the burst: a slow sender must not time itself out
        let end = Instant::now();
        if w.deadline.is_none() {
            w.deadline = w.timeout.map(|t| end + t);
        }
        if w.fast_deadline.is_none() {
            w.fast_deadline = Some(end + w.fast_rto());
        }
    }
    sent > 0
}

fn imm_of(o: &OutOp) -> bool {
    matches!(
        o,
        OutOp::Write { imm: Some(_), .. } | OutOp::Send { imm: Some(_), .. }
    )
}
fn is_send(o: &OutOp) -> bool {
    matches!(o, OutOp::Send { .. })
}
fn bad_wire() -> Fail {
    (Syndrome::LocalQpOp, vendor::MALFORMED_WQE)
}

/// Writes the CQEs of every finished message at the front, in order; an error completes
/// with its syndrome, moves the QP to ERR and flushes the rest.
fn complete_front(dev: &Shared, qp: &Qp, w: &mut ReqWire, delay: Option<Duration>) {
    while let Some(m) = w.msgs.front() {
        let done = m.fail.is_some() || m.npkts == 0 || psn_diff(w.una, m.end()) >= 0;
        if !done {
            break;
        }
        let Some(m) = w.msgs.pop_front() else { break };
        if let Some((syndrome, why)) = m.fail {
            dev.counters.error(syndrome);
            tracing::debug!(
                qpn = qp.qpn,
                ?syndrome,
                vendor = why,
                wqe = m.idx,
                "WQE failed"
            );
            let e = ErrorCqe {
                responder: false,
                syndrome: syndrome as u8,
                vendor_syndrome: why,
                wqe_opcode: m.opcode,
                qpn: qp.qpn,
                wqe_counter: m.idx,
            };
            qp.set_state(QpState::Err);
            push_cqe_delayed(dev, qp, delay, &qp.send_cq, Cqe64::error(&e, 0));
            flush_msgs(dev, qp, w, delay);
            return;
        }
        let byte_cnt = match m.op {
            OutOp::Local { byte_cnt } => byte_cnt,
            _ => {
                Counters::add(&dev.counters.bytes, m.len);
                m.len as u32
            }
        };
        Counters::add(&dev.counters.wqes, 1);
        if m.signaled {
            let cqe = Cqe64::requester(m.opcode, qp.qpn, m.idx, byte_cnt, 0);
            push_cqe_delayed(dev, qp, delay, &qp.send_cq, cqe);
        }
    }
}

fn flush_msgs(dev: &Shared, qp: &Qp, w: &mut ReqWire, delay: Option<Duration>) {
    for m in w.msgs.drain(..) {
        flush_cqe(dev, qp, delay, m.opcode, m.idx);
    }
    w.blocked = false;
    w.halted = true;
    w.deadline = None;
    w.fast_deadline = None;
    w.rnr_until = None;
}

/// Flushes every WQE on the wire (QP in ERR). Returns whether there were any.
pub(crate) fn flush_all(dev: &Shared, qp: &Qp, sq: &mut SqState) -> bool {
    let delay = sq.delay;
    match sq.wire.as_mut() {
        Some(w) if !w.msgs.is_empty() => {
            flush_msgs(dev, qp, w, delay);
            true
        }
        _ => false,
    }
}

/// Runs the timers (retransmission, RNR back-off) and the window. Returns (sent something,
/// anything outstanding: the engine then polls on time).
pub(crate) fn tick(dev: &Shared, qp: &Qp, sq: &mut SqState, now: Instant) -> (bool, bool) {
    let delay = sq.delay;
    let Some(w) = sq.wire.as_mut() else {
        return (false, false);
    };
    if w.msgs.is_empty() {
        return (false, false);
    }
    if w.rnr_until.is_none() && w.una == w.sent_hi {
        w.deadline = None;
        w.fast_deadline = None;
    }
    if let Some(d) = w.deadline.filter(|&d| now >= d && w.rnr_until.is_none()) {
        let _ = d;
        Counters::add(&dev.counters.wire.timeouts, 1);
        w.retries += 1;
        let una = w.una;
        if w.retries > w.retry_cnt {
            w.fail_at(una, (Syndrome::TransportRetryExc, vendor::NO_PEER));
        } else {
            w.go_back(una, now);
            w.deadline = None;
            w.fast_deadline = None;
        }
    } else if let Some(d) = w
        .fast_deadline
        .filter(|&d| now >= d && w.rnr_until.is_none())
    {
        let _ = d;
        // Nothing answered in time: a lost tail, a lost ACK or NAK, or a pause of the peer (or
        // of this process, its ACKs still unread). Probe, without counting a retry.
        Counters::add(&dev.counters.wire.early_timeouts, 1);
        w.probe_tail(now);
        w.rttvar = (w.rttvar * 2)
            .max(Duration::from_micros(100))
            .min(FAST_RTO_MAX);
    }
    complete_front(dev, qp, w, delay);
    let sent = pump(dev, qp, w, now);
    (sent, !w.msgs.is_empty())
}

/// Handles a response (ACK/NAK, READ response, atomic ACK) for requester QP `qp`.
fn on_response(dev: &Shared, qp: &Qp, pkt: &Packet<'_>) {
    let now = Instant::now();
    let mut sq = qp.lock_sq();
    let delay = sq.delay;
    let Some(w) = sq.wire.as_mut() else {
        Counters::add(&dev.counters.wire.rx_unexpected, 1);
        return;
    };
    if qp.state() != QpState::Rts {
        Counters::add(&dev.counters.wire.rx_unknown_qp, 1);
        return;
    }
    let wc = &dev.counters.wire;
    let p = pkt.bth.psn;
    let g = qp.mrs.read();
    match pkt.bth.opcode {
        op::ACK => {
            let s = pkt.aeth.map_or(0, |a| a.syndrome);
            if s == aeth::GAP_REPORT {
                // Only a peer that agreed on selective repeat sends it; it acknowledges
                // nothing (the NAK code is reserved by IBTA: a real NIC never sends it).
                let n = pkt.aeth.map_or(0, |a| a.msn);
                let c = match w.selective.then(|| w.resend_gap(p, n, now)) {
                    Some(GapReport::Acted) => &wc.sr_gap_reports_received,
                    Some(GapReport::Ignored) => &wc.sr_gap_reports_ignored,
                    Some(GapReport::NotInFlight) | None => &wc.rx_unexpected,
                };
                Counters::add(c, 1);
                drop(g);
                pump(dev, qp, w, now);
                return;
            }
            match s >> 5 {
                0 => match w.ack_to(psn_add(p, 1), now) {
                    Acked::Bogus => {
                        // acknowledges PSNs never sent
                        Counters::add(&wc.rx_unexpected, 1);
                        return;
                    }
                    Acked::Implicit => w.go_back_once(now),
                    Acked::Ok => {}
                },
                1 | 3 => match w.ack_to(p, now) {
                    Acked::Bogus => {
                        Counters::add(&wc.rx_unexpected, 1);
                        return;
                    }
                    Acked::Implicit => w.go_back_once(now),
                    Acked::Ok if w.una != p => Counters::add(&wc.rx_unexpected, 1),
                    Acked::Ok if s >> 5 == 1 => {
                        Counters::add(&wc.rnr_naks_received, 1);
                        w.rnr_retries += 1;
                        if w.rnr_retry != 7 && w.rnr_retries > w.rnr_retry as u32 {
                            w.fail_at(p, (Syndrome::RnrRetryExc, vendor::RNR));
                        } else {
                            w.rnr_until = Some(now + rnr_delay(s & 0x1f));
                            w.send_psn = p;
                            w.deadline = None;
                            w.fast_deadline = None;
                        }
                    }
                    Acked::Ok => match s {
                        aeth::NAK_SEQ => {
                            Counters::add(&wc.seq_naks_received, 1);
                            if w.selective {
                                w.resend_nak(now);
                            } else {
                                w.go_back_nak(now);
                            }
                        }
                        aeth::NAK_INVALID => {
                            let i = w.find(p);
                            let recv = w.msgs.get(i).is_some_and(|m| {
                                matches!(
                                    m.op,
                                    OutOp::Send { .. } | OutOp::Write { imm: Some(_), .. }
                                )
                            });
                            let why = if recv {
                                vendor::RECV_BUFFER
                            } else {
                                vendor::INVALID_REQUEST
                            };
                            w.fail_at(p, (Syndrome::RemoteInvalReq, why));
                        }
                        aeth::NAK_ACCESS => {
                            w.fail_at(p, (Syndrome::RemoteAccess, vendor::REMOTE_KEY))
                        }
                        aeth::NAK_OPERATIONAL => {
                            // The NAK carries no cause: a SEND's is its receive buffer (key
                            // or device memory), any other request's the responder's device
                            // memory, the only operational error it can meet.
                            let i = w.find(p);
                            let send = w.msgs.get(i).is_some_and(|m| is_send(&m.op));
                            let why = if send {
                                vendor::RECV_BUFFER
                            } else {
                                vendor::DEVICE_MEMORY
                            };
                            w.fail_at(p, (Syndrome::RemoteOp, why))
                        }
                        _ => Counters::add(&wc.rx_unexpected, 1),
                    },
                },
                _ => Counters::add(&wc.rx_unexpected, 1),
            }
        }
        op::READ_RESPONSE_FIRST
        | op::READ_RESPONSE_MIDDLE
        | op::READ_RESPONSE_LAST
        | op::READ_RESPONSE_ONLY => {
            let i = w.find(p);
            let (mpsn, is_read) = match w.msgs.get(i) {
                Some(m) => (m.psn, matches!(m.op, OutOp::Read { .. })),
                None => (p, false),
            };
            if !is_read || psn_diff(p, mpsn) < 0 {
                Counters::add(&wc.rx_unexpected, 1);
            } else {
                match w.ack_to(mpsn, now) {
                    Acked::Bogus => Counters::add(&wc.rx_unexpected, 1),
                    Acked::Implicit => w.go_back_once(now),
                    Acked::Ok if p != w.una => {
                        if psn_diff(p, w.una) > 0 {
                            w.go_back_once(now);
                        } else {
                            Counters::add(&wc.rx_unexpected, 1);
                        }
                    }
                    Acked::Ok => {
                        let mtu = w.mtu as u64;
                        let m = &mut w.msgs[i];
                        let k = psn_diff(p, m.psn) as u32;
                        let off = k as u64 * mtu;
                        let last = k + 1 == m.npkts;
                        // A READ retried from packet k is a new request for the rest: its
                        // responses start again with FIRST (or ONLY).
                        let o = pkt.bth.opcode;
                        let op_ok = match (k == 0, last) {
                            (_, true) => o == op::READ_RESPONSE_LAST || o == op::READ_RESPONSE_ONLY,
                            (true, false) => o == op::READ_RESPONSE_FIRST,
                            (false, false) => {
                                o == op::READ_RESPONSE_MIDDLE || o == op::READ_RESPONSE_FIRST
                            }
                        };
                        let op_ok = op_ok && (o != op::READ_RESPONSE_LAST || k > 0);
                        let want_len = if last { m.len.saturating_sub(off) } else { mtu };
                        if !op_ok || pkt.payload.len() as u64 != want_len {
                            m.fail = Some((Syndrome::BadResp, vendor::BAD_RESPONSE));
                            w.halted = true;
                        } else if let OutOp::Read { dst, .. } = &m.op {
                            match scatter(&dev.counters, &g, qp.pd, dst, off, pkt.payload) {
                                Ok(()) => {
                                    w.una = psn_add(p, 1);
                                    w.progress(p, now);
                                }
                                Err(f) => {
                                    m.fail = Some(f);
                                    w.halted = true;
                                }
                            }
                        }
                    }
                }
            }
        }
        op::ATOMIC_ACK => {
            let i = w.find(p);
            let ok = w
                .msgs
                .get(i)
                .is_some_and(|m| m.psn == p && matches!(m.op, OutOp::Atomic { .. }));
            if !ok {
                Counters::add(&wc.rx_unexpected, 1);
            } else {
                match w.ack_to(p, now) {
                    Acked::Bogus => Counters::add(&wc.rx_unexpected, 1),
                    Acked::Implicit => w.go_back_once(now),
                    Acked::Ok if p != w.una => Counters::add(&wc.rx_unexpected, 1),
                    Acked::Ok => {
                        let m = &mut w.msgs[i];
                        if let OutOp::Atomic { kind, result, .. } = &m.op {
                            let old = pkt.atomic_ack.unwrap_or(0);
                            let n = kind.size() as usize;
                            let bytes = old.to_ne_bytes();
                            let small = (old as u32).to_ne_bytes();
                            // The original value lands host-endian (mlx5 host-endian
                            // atomic mode), as on the in-process path.
                            let v: &[u8] = if n == 8 { &bytes } else { &small };
                            match g.check(
                                qp.pd,
                                Access::LOCAL_WRITE,
                                result.lkey.0,
                                result.addr,
                                n as u64,
                            ) {
                                Ok(r) => {
                                    // SAFETY: `r` checked under `g` (held), exactly n bytes.
                                    match unsafe { write_range(&r, 0, v) } {
                                        Ok(()) => {
                                            w.una = psn_add(p, 1);
                                            w.progress(p, now);
                                        }
                                        Err(e) => {
                                            m.fail = Some(local_devmem_err(&dev.counters, &e));
                                            w.halted = true;
                                        }
                                    }
                                }
                                Err(e) => {
                                    m.fail = Some(local_err(e));
                                    w.halted = true;
                                }
                            }
                        }
                    }
                }
            }
        }
        _ => Counters::add(&wc.rx_unexpected, 1),
    }
    drop(g);
    complete_front(dev, qp, w, delay);
    pump(dev, qp, w, now);
}

// ---------------------------------------------------------------------------- responder

/// Sends the responder's packets back to the requester.
struct Reply<'a> {
    port: &'a Port,
    to: SocketAddr,
    flow: Flow,
    dest_qp: u32,
    buf: &'a mut Vec<u8>,
    batch: &'a mut TxBatch,
}

impl Reply<'_> {
    fn bth(&self, opcode: u8, psn: u32) -> Bth {
        Bth {
            opcode,
            mig_req: true,
            pkey: DEFAULT_PKEY,
            dest_qp: self.dest_qp,
            psn,
            ..Bth::default()
        }
    }

    fn send(&mut self, p: &Packet<'_>) {
        if packet::encode(p, &self.flow, self.buf).is_ok() {
            self.port.send(self.buf, self.to, &self.flow, self.batch);
        }
    }

    fn aeth(&mut self, psn: u32, syndrome: u8, msn: u32) {
        let p = Packet {
            bth: self.bth(op::ACK, psn),
            aeth: Some(Aeth { syndrome, msn }),
            ..Packet::default()
        };
        self.send(&p);
    }
}

/// The AETH syndrome of a NAK response.
fn nak_syndrome(r: &Response) -> u8 {
    match r {
        Response::Rnr(t) => aeth::RNR | (t & 0x1f),
        Response::Nak(Syndrome::RemoteAccess, _) => aeth::NAK_ACCESS,
        Response::Nak(Syndrome::RemoteInvalReq, _) => aeth::NAK_INVALID,
        _ => aeth::NAK_OPERATIONAL,
    }
}

/// What a new request packet led to.
enum Outcome {
    /// Accepted: the expected PSN moves on by this many PSNs.
    Accepted(u32),
    /// Answered by a NAK (RNR or error); the expected PSN stays.
    Nak(Response),
    /// Dropped without an answer (malformed against this QP's MTU).
    Dropped,
    /// Already answered by a NAK in the middle of READ responses (the responder's memory
    /// failed); the responder is in ERR.
    Answered,
}

/// The most PSNs a requester may have in flight ([`crate::WireConfig::window`] is capped
/// there), and so the farthest ahead of the expected PSN a responder holds a request.
pub(crate) const MAX_WINDOW: u32 = 4096;

/// How far ahead of the expected PSN this device's responders hold requests (selective
/// repeat): the window its requesters use, which two soft NICs share (the default unless both
/// set another), within 64 ..= [`MAX_WINDOW`].
fn hold_window(port: &Port) -> u32 {
    port.cfg.window.clamp(64, MAX_WINDOW)
}

/// PSNs a request consumes: a READ one per response packet, anything else one.
fn request_psns(pkt: &Packet<'_>, mtu: u32) -> u32 {
    match (pkt.bth.opcode, pkt.reth) {
        (op::READ_REQUEST, Some(reth)) => {
            (reth.len as u64).div_ceil(mtu.max(1) as u64).max(1) as u32
        }
        _ => 1,
    }
}

/// Whether a request fits the message in progress (`cur`) as a packet of it or a new message,
/// by the structure [`new_request`] checks: a held packet that does not is dropped and asked
/// for again rather than run (a forged one must not fail the QP; the requester's own error
/// shows in sequence, with the NAK IBTA asks for).
fn fits(cur: Option<InMsg>, pkt: &Packet<'_>, mtu: u32) -> bool {
    let n = pkt.payload.len() as u64;
    let mtu = mtu as u64;
    match (pkt.bth.opcode, cur) {
        (op::SEND_FIRST | op::WRITE_FIRST, None) => n == mtu,
        (
            op::SEND_ONLY
            | op::SEND_ONLY_IMM
            | op::SEND_ONLY_INV
            | op::WRITE_ONLY
            | op::WRITE_ONLY_IMM
            | op::READ_REQUEST
            | op::CMP_SWAP
            | op::FETCH_ADD
            | op::MASKED_CMP_SWAP
            | op::MASKED_FETCH_ADD,
            None,
        ) => true,
        (op::SEND_MIDDLE, Some(InMsg::Send { .. })) => n == mtu,
        (op::SEND_LAST | op::SEND_LAST_IMM | op::SEND_LAST_INV, Some(InMsg::Send { .. })) => n >= 1,
        (op::WRITE_MIDDLE, Some(InMsg::Write { len, off, .. })) => n == mtu && off + n < len,
        (op::WRITE_LAST | op::WRITE_LAST_IMM, Some(InMsg::Write { len, off, .. })) => {
            n >= 1 && off + n == len
        }
        _ => false,
    }
}

/// Handles a request packet for responder QP `qp` (`raw`: the datagram it was parsed from,
/// which came from UDP port `sport`).
fn on_request(
    dev: &Shared,
    qp: &Qp,
    pkt: &Packet<'_>,
    raw: &[u8],
    sport: u16,
    reply: &mut Reply<'_>,
) {
    let wc = &dev.counters.wire;
    let mut r = Resp::lock(qp);
    let from = reply.dest_qp;
    let psn = pkt.bth.psn;
    let d = psn_diff(psn, r.rq.wire.epsn);
    if !r.rq.wire.route_checked {
        // as the requester does: the RTR path MTU, but no more than the route's link allows
        r.rq.wire.route_checked = true;
        if let Some(m) = reply.port.path_mtu(reply.flow.dst) {
            r.rq.wire.mtu = r.rq.wire.mtu.min(m);
        }
    }
    if pkt.payload.len() > r.rq.wire.mtu as usize {
        Counters::add(&wc.rx_malformed, 1);
        return;
    }
    r.rq.wire.reply_to = Some((reply.to, reply.flow, reply.dest_qp));
    if d > 0 {
        ahead(dev, qp, &mut r, pkt, raw, sport, reply);
        return;
    }
    if d < 0 {
        if duplicate(&mut r, pkt, reply) {
            Counters::add(&wc.duplicates, 1);
        } else {
            Counters::add(&wc.rx_bad_duplicate_reads, 1);
        }
        return;
    }
    let w = &mut r.rq.wire;
    if let Some(h) = w.held.remove(&psn) {
        // It opened a gap and was held, and waits to be vouched for: this copy decides. A
        // different packet means one of them is forged (or corrupted): neither runs, the
        // requester sends it again.
        if !same_request(&h.raw, raw) {
            Counters::add(&wc.rx_conflicting_duplicates, 1);
            w.nak_sent = true;
            seq_nak(wc, w, reply);
            qp.holding.store(!w.held.is_empty(), Ordering::Release);
            return;
        }
    }
    if std::mem::take(&mut w.nak_sent) && w.selective {
        w.filled(Instant::now());
    }
    if w.selective {
        w.sport = Some(sport);
    }
    let Some(ack) = in_sequence(wc, &mut r, pkt, from, reply) else {
        return;
    };
    if r.rq.wire.held.is_empty() {
        if ack {
            let w = &r.rq.wire;
            reply.aeth(psn_add(w.epsn, MASK24), aeth::ACK, w.msn);
        }
        return;
    }
    // Selective repeat: the gap is filled; run what was held behind it, in order.
    Counters::add(&wc.sr_gaps_filled, 1);
    run_held(wc, qp, &mut r, from, reply);
}

/// A request ahead of the expected PSN. With selective repeat, from the requester's flow
/// and inside the hold window: held ([`super::state::RespWire::hold`]), the gaps it shows
/// named, and what is vouched for run. Otherwise go-back-N's answer: one sequence NAK per
/// gap, the packet dropped.
fn ahead(
    dev: &Shared,
    qp: &Qp,
    r: &mut Resp<'_>,
    pkt: &Packet<'_>,
    raw: &[u8],
    sport: u16,
    reply: &mut Reply<'_>,
) {
    let wc = &dev.counters.wire;
    Counters::add(&wc.out_of_sequence, 1);
    let psn = pkt.bth.psn;
    let window = hold_window(reply.port);
    let w = &mut r.rq.wire;
    let d = psn_diff(psn, w.epsn) as u32;
    let in_window = d < window;
    if !in_window {
        // farther ahead than any requester sends: forged, stale or broken
        Counters::add(&wc.out_of_window, 1);
    }
    if w.selective && in_window && w.sport.is_none_or(|s| s == sport) {
        let npkts = request_psns(pkt, w.mtu);
        let report = match w.hold(psn, npkts, raw) {
            Hold::New(report) => report,
            Hold::Copy => None,
            Hold::Conflict => {
                // neither copy runs; the requester resends it when asked
                Counters::add(&wc.rx_conflicting_duplicates, 1);
                Some((psn, 1))
            }
        };
        if !w.nak_sent && !w.held.contains_key(&w.epsn) {
            w.nak_sent = true;
            w.oos_hi = psn;
            seq_nak(wc, w, reply);
        }
        if let Some((first, n)) = report {
            // Every gap is named as it opens, not one per round trip (a sequence NAK names
            // one, and acknowledges everything before it).
            Counters::add(&wc.sr_gap_reports_sent, 1);
            reply.aeth(first, aeth::GAP_REPORT, n);
        }
        qp.holding.store(!w.held.is_empty(), Ordering::Release);
        if w.held.get(&w.epsn).is_some_and(|h| h.trusted) {
            run_held(wc, qp, r, reply.dest_qp, reply);
        }
        return;
    }
    if w.selective && in_window {
        // from another UDP port than the requester's flow
        Counters::add(&wc.out_of_window, 1);
    }
    // One NAK per gap (IBTA, rxe). Once NAKed, a packet out of sequence but not past the
    // highest one seen since is a retransmission: the requester went back and the expected
    // packet is still missing (its retransmission was lost too): NAK again. A packet outside
    // the window neither repeats the NAK nor counts as the highest seen.
    let again = in_window && !w.selective && w.nak_sent && psn_diff(psn, w.oos_hi) <= 0;
    if in_window && !w.selective && (!w.nak_sent || psn_diff(psn, w.oos_hi) > 0) {
        w.oos_hi = psn;
    }
    if !w.nak_sent || again {
        w.nak_sent = true;
        if !in_window || w.selective {
            w.oos_hi = w.epsn;
        } else {
            w.oos_hi = psn;
        }
        seq_nak(wc, w, reply);
    }
}

/// Selective repeat: runs the held packets from the expected PSN on, in order, while they are
/// vouched for and fit the message in progress; then one ACK for what they completed, and
/// the next gap named at once (or, when the packet at the expected PSN waits to be vouched
/// for, left to the responder's timer).
fn run_held(
    wc: &crate::counters::WireCounters<std::sync::atomic::AtomicU64>,
    qp: &Qp,
    r: &mut Resp<'_>,
    from: u32,
    reply: &mut Reply<'_>,
) {
    let mut misfit = false;
    loop {
        let w = &mut r.rq.wire;
        let e = w.epsn;
        if !w.held.get(&e).is_some_and(|h| h.trusted) {
            break;
        }
        let Some(held) = w.held.remove(&e) else {
            break;
        };
        let Ok(p) = packet::parse(&held.raw) else {
            // parsed once already: cannot happen; dropped as malformed
            Counters::add(&wc.rx_malformed, 1);
            continue;
        };
        if !fits(w.cur, &p, w.mtu) {
            Counters::add(&wc.sr_held_dropped, 1);
            misfit = true;
            break;
        }
        Counters::add(&wc.sr_held_run, 1);
        if in_sequence(wc, r, &p, from, reply).is_none() {
            // answered with a NAK: the requester goes back to it, resending the rest
            r.rq.wire.held.clear();
            qp.holding.store(false, Ordering::Release);
            return;
        }
    }
    let w = &mut r.rq.wire;
    let e = w.epsn;
    w.held.retain(|&p, _| psn_diff(p, e) >= 0);
    // one ACK for what the held packets completed, then the next gap, if any, named at once
    reply.aeth(psn_add(e, MASK24), aeth::ACK, w.msn);
    qp.holding.store(!w.held.is_empty(), Ordering::Release);
    if w.held.contains_key(&e) {
        // waits to be vouched for: the next request past it does, or the timer asks for it
        w.nak_sent = true;
        w.last_nak = Some(Instant::now());
    } else if misfit || !w.held.is_empty() {
        w.nak_sent = true;
        seq_nak(wc, w, reply);
    } else {
        // no gap left
        w.nak_sent = false;
    }
}

/// Sends a sequence NAK for the expected PSN.
fn seq_nak(
    wc: &crate::counters::WireCounters<std::sync::atomic::AtomicU64>,
    w: &mut super::state::RespWire,
    reply: &mut Reply<'_>,
) {
    w.naked(Instant::now());
    Counters::add(&wc.seq_naks_sent, 1);
    reply.aeth(w.epsn, aeth::NAK_SEQ, w.msn);
}

/// Selective repeat: names a gap again that stayed unfilled for a while
/// ([`super::state::RespWire::renak_wait`], doubled at each try) with packets held behind it,
/// or asks again for a held packet at the expected PSN that nothing vouched for (its NAK, the
/// resend or the answer to it was lost, and the requester may have nothing more to send that
/// would make the responder NAK again). After [`RENAK_TRIES`] tries without progress the
/// held packets are dropped (the requester's timers resend them if they were real). Returns
/// whether packets are held (the engine then polls on time).
pub(crate) fn responder_tick(dev: &Shared, qp: &Qp, now: Instant) -> bool {
    if !qp.holding.load(Ordering::Acquire) {
        return false;
    }
    let Some(port) = dev.port() else {
        return false;
    };
    let mut rq = qp.lock_rq();
    let w = &mut rq.wire;
    if w.held.is_empty() {
        return false;
    }
    let first = if w.unconfirmed() {
        w.copy_wait()
    } else {
        w.renak_wait()
    };
    let wait = first * (1 << w.renaks.min(RENAK_TRIES));
    let due = w.last_nak.is_none_or(|t| now.duration_since(t) >= wait);
    if !due {
        return true;
    }
    if w.renaks >= RENAK_TRIES {
        Counters::add(&dev.counters.wire.sr_held_dropped, w.held.len() as u64);
        w.held.clear();
        w.renaks = 0;
        w.nak_sent = false;
        w.last_nak = None;
        qp.holding.store(false, Ordering::Release);
        return false;
    }
    if let Some((to, flow, dest_qp)) = w.reply_to {
        let (mut buf, mut batch) = (Vec::new(), TxBatch::default());
        let mut reply = Reply {
            port,
            to,
            flow,
            dest_qp,
            buf: &mut buf,
            batch: &mut batch,
        };
        w.renaks += 1;
        let wc = &dev.counters.wire;
        if let Some(last) = w.unconfirmed().then(|| w.run_last()) {
            // The run at the expected PSN waits and nothing more came (the requester's tail):
            // ask for a copy of its newest packet, which vouches for all before it, and say
            // again how far the responder got.
            w.last_nak = Some(now);
            reply.aeth(psn_add(w.epsn, MASK24), aeth::ACK, w.msn);
            Counters::add(&wc.sr_gap_reports_sent, 1);
            reply.aeth(last, aeth::GAP_REPORT, 1);
        } else {
            seq_nak(wc, w, &mut reply);
        }
        port.flush(&mut batch);
    }
    true
}

/// Times the responder's timer asks again for a gap (or a held packet nobody vouched for)
/// before it drops what it holds.
const RENAK_TRIES: u32 = 8;

/// Runs a request packet with the expected PSN and moves the expected PSN on. Returns
/// whether it asks for an ACK (not sent yet), or `None` when it was answered (NAK) or dropped.
fn in_sequence(
    wc: &crate::counters::WireCounters<std::sync::atomic::AtomicU64>,
    r: &mut Resp<'_>,
    pkt: &Packet<'_>,
    from: u32,
    reply: &mut Reply<'_>,
) -> Option<bool> {
    let psn = pkt.bth.psn;
    match new_request(r, pkt, from, reply) {
        Outcome::Accepted(n) => {
            let w = &mut r.rq.wire;
            w.epsn = psn_add(w.epsn, n);
            w.renaks = 0;
            Some(pkt.bth.ack_req && packet::layout(pkt.bth.opcode).is_some_and(|l| l.payload))
        }
        Outcome::Nak(resp) => {
            let c = if matches!(resp, Response::Rnr(_)) {
                &wc.rnr_naks_sent
            } else {
                &wc.error_naks_sent
            };
            Counters::add(c, 1);
            let msn = r.rq.wire.msn;
            reply.aeth(psn, nak_syndrome(&resp), msn);
            None
        }
        Outcome::Dropped => {
            Counters::add(&wc.rx_malformed, 1);
            None
        }
        Outcome::Answered => {
            Counters::add(&wc.error_naks_sent, 1);
            None
        }
    }
}

fn invalid(r: &Resp<'_>) -> Outcome {
    Outcome::Nak(r.fatal(Response::Nak(
        Syndrome::RemoteInvalReq,
        vendor::INVALID_REQUEST,
    )))
}

/// Completes the receive of a SEND whose last packet `pkt` arrived (`len` bytes in all): with
/// its immediate, or after invalidating the rkey its IETH names.
fn send_done(r: &mut Resp<'_>, pkt: &Packet<'_>, len: u64, from: u32) -> Result<(), Response> {
    let (kind, imm) = match (pkt.ieth, pkt.imm) {
        (Some(rkey), _) => {
            r.invalidate(rkey)?;
            (RespKind::SendInv, Some(rkey))
        }
        (None, Some(imm)) => (RespKind::SendImm, Some(imm)),
        (None, None) => (RespKind::Send, None),
    };
    r.recv_done(kind, len, imm, from);
    Ok(())
}

/// Runs a request packet with the expected PSN.
fn new_request(r: &mut Resp<'_>, pkt: &Packet<'_>, from: u32, reply: &mut Reply<'_>) -> Outcome {
    let opc = pkt.bth.opcode;
    let mtu = r.rq.wire.mtu as u64;
    let n = pkt.payload.len() as u64;
    let cur = r.rq.wire.cur;
    match opc {
        op::SEND_FIRST | op::SEND_ONLY | op::SEND_ONLY_IMM | op::SEND_ONLY_INV => {
            if cur.is_some() {
                return invalid(r);
            }
            if !r.has_recv() {
                return Outcome::Nak(r.rnr());
            }
            if opc == op::SEND_FIRST && n != mtu {
                return invalid(r);
            }
            let dst = match r.recv_ranges() {
                Ok(d) => d,
                Err(e) => return Outcome::Nak(e),
            };
            if total(&dst) < n {
                return Outcome::Nak(r.recv_too_small());
            }
            if let Err(e) = scatter_ranges(&dst, 0, pkt.payload) {
                return Outcome::Nak(r.recv_devmem_failed(&e));
            }
            if opc == op::SEND_FIRST {
                r.rq.wire.cur = Some(InMsg::Send { off: n });
            } else {
                if let Err(nak) = send_done(r, pkt, n, from) {
                    return Outcome::Nak(nak);
                }
                r.rq.wire.msn = psn_add(r.rq.wire.msn, 1);
            }
            Outcome::Accepted(1)
        }
        op::SEND_MIDDLE | op::SEND_LAST | op::SEND_LAST_IMM | op::SEND_LAST_INV => {
            let Some(InMsg::Send { off }) = cur else {
                return invalid(r);
            };
            let ok_len = if opc == op::SEND_MIDDLE {
                n == mtu
            } else {
                n >= 1
            };
            if !ok_len {
                return invalid(r);
            }
            let dst = match r.recv_ranges() {
                Ok(d) => d,
                Err(e) => {
                    r.rq.wire.cur = None;
                    return Outcome::Nak(e);
                }
            };
            if total(&dst) < off + n {
                r.rq.wire.cur = None;
                return Outcome::Nak(r.recv_too_small());
            }
            if let Err(e) = scatter_ranges(&dst, off, pkt.payload) {
                r.rq.wire.cur = None;
                return Outcome::Nak(r.recv_devmem_failed(&e));
            }
            if opc == op::SEND_MIDDLE {
                r.rq.wire.cur = Some(InMsg::Send { off: off + n });
            } else {
                r.rq.wire.cur = None;
                if let Err(nak) = send_done(r, pkt, off + n, from) {
                    return Outcome::Nak(nak);
                }
                r.rq.wire.msn = psn_add(r.rq.wire.msn, 1);
            }
            Outcome::Accepted(1)
        }
        op::WRITE_FIRST | op::WRITE_ONLY | op::WRITE_ONLY_IMM => {
            let Some(reth) = pkt.reth else {
                return Outcome::Dropped;
            };
            if cur.is_some() {
                return invalid(r);
            }
            if opc == op::WRITE_ONLY_IMM && !r.has_recv() {
                return Outcome::Nak(r.rnr());
            }
            let len = reth.len as u64;
            let dst = match r.remote(Access::REMOTE_WRITE, reth.va, reth.rkey, len) {
                Ok(d) => d,
                Err(e) => return Outcome::Nak(r.fatal(e)),
            };
            let ok_len = if opc == op::WRITE_FIRST {
                n == mtu && len > mtu
            } else {
                n == len
            };
            if !ok_len {
                return invalid(r);
            }
            // SAFETY: `dst` checked under `r.g` (held) for `len >= n` bytes.
            if let Err(e) = unsafe { write_range(&dst, 0, pkt.payload) } {
                let nak = remote_devmem_nak(&r.qp.counters, &e);
                return Outcome::Nak(r.fatal(nak));
            }
            if opc == op::WRITE_FIRST {
                r.rq.wire.cur = Some(InMsg::Write {
                    va: reth.va,
                    rkey: reth.rkey,
                    len,
                    off: n,
                });
            } else {
                if opc == op::WRITE_ONLY_IMM {
                    r.recv_done(RespKind::WriteImm, len, pkt.imm, from);
                }
                r.rq.wire.msn = psn_add(r.rq.wire.msn, 1);
            }
            Outcome::Accepted(1)
        }
        op::WRITE_MIDDLE | op::WRITE_LAST | op::WRITE_LAST_IMM => {
            let Some(InMsg::Write { va, rkey, len, off }) = cur else {
                return invalid(r);
            };
            if opc == op::WRITE_LAST_IMM && !r.has_recv() {
                return Outcome::Nak(r.rnr());
            }
            let ok_len = if opc == op::WRITE_MIDDLE {
                n == mtu && off + n < len
            } else {
                n >= 1 && off + n == len
            };
            if !ok_len {
                r.rq.wire.cur = None;
                return invalid(r);
            }
            let dst = match r.remote(Access::REMOTE_WRITE, va.wrapping_add(off), rkey, n) {
                Ok(d) => d,
                Err(e) => {
                    r.rq.wire.cur = None;
                    return Outcome::Nak(r.fatal(e));
                }
            };
            // SAFETY: `dst` checked under `r.g` (held) for exactly `n` bytes.
            if let Err(e) = unsafe { write_range(&dst, 0, pkt.payload) } {
                r.rq.wire.cur = None;
                let nak = remote_devmem_nak(&r.qp.counters, &e);
                return Outcome::Nak(r.fatal(nak));
            }
            if opc == op::WRITE_MIDDLE {
                r.rq.wire.cur = Some(InMsg::Write {
                    va,
                    rkey,
                    len,
                    off: off + n,
                });
            } else {
                if opc == op::WRITE_LAST_IMM {
                    r.recv_done(RespKind::WriteImm, len, pkt.imm, from);
                }
                r.rq.wire.cur = None;
                r.rq.wire.msn = psn_add(r.rq.wire.msn, 1);
            }
            Outcome::Accepted(1)
        }
        op::READ_REQUEST => {
            let Some(reth) = pkt.reth else {
                return Outcome::Dropped;
            };
            if cur.is_some() {
                return invalid(r);
            }
            let len = reth.len as u64;
            let src = match r.remote(Access::REMOTE_READ, reth.va, reth.rkey, len) {
                Ok(s) => s,
                Err(e) => return Outcome::Nak(r.fatal(e)),
            };
            let count = len.div_ceil(mtu).max(1) as u32;
            r.rq.wire.msn = psn_add(r.rq.wire.msn, 1);
            let msn = r.rq.wire.msn;
            match read_responses(&src, pkt.bth.psn, mtu, msn, reply) {
                Ok(()) => {
                    let cap = READ_CACHE.max(reply.port.cfg.window as usize);
                    let w = &mut r.rq.wire;
                    while w.reads.len() >= cap {
                        w.reads.pop_front();
                    }
                    w.reads.push_back(HeldRead {
                        psn: pkt.bth.psn,
                        npkts: count,
                        va: reth.va,
                        rkey: reth.rkey,
                        len,
                    });
                    Outcome::Accepted(count)
                }
                Err((k, e)) => {
                    let nak = remote_devmem_nak(&r.qp.counters, &e);
                    let nak = r.fatal(nak);
                    if k == 0 {
                        Outcome::Nak(nak)
                    } else {
                        // responses before packet k went out: the NAK names packet k
                        reply.aeth(psn_add(pkt.bth.psn, k), nak_syndrome(&nak), msn);
                        Outcome::Answered
                    }
                }
            }
        }
        op::CMP_SWAP | op::FETCH_ADD | op::MASKED_CMP_SWAP | op::MASKED_FETCH_ADD => {
            if cur.is_some() {
                return invalid(r);
            }
            let Some((va, rkey, kind)) = atomic_kind(pkt) else {
                return invalid(r);
            };
            match r.atomic(va, rkey, kind, true) {
                Response::AtomicAck(old) => {
                    let w = &mut r.rq.wire;
                    if w.atomics.len() >= ATOMIC_CACHE {
                        w.atomics.pop_front();
                    }
                    w.atomics.push_back((pkt.bth.psn, old));
                    w.msn = psn_add(w.msn, 1);
                    let msn = w.msn;
                    atomic_ack(reply, pkt.bth.psn, msn, old);
                    Outcome::Accepted(1)
                }
                Response::Ack => Outcome::Accepted(1),
                e => Outcome::Nak(e),
            }
        }
        _ => Outcome::Dropped,
    }
}

/// Scatters a payload at offset `off` of checked receive ranges (`off + len` fits).
fn scatter_ranges(dst: &[MemRange], off: u64, bytes: &[u8]) -> Result<(), DeviceMemoryError> {
    let n = bytes.len() as u64;
    let mut pos = 0u64;
    for r in dst {
        let (a, e) = (off.max(pos), (off + n).min(pos + r.len));
        if a < e {
            // SAFETY: the ranges were checked under the responder's guard, still held by the
            // caller; `a - pos .. e - pos` lies inside range `r`.
            unsafe { write_range(r, a - pos, &bytes[(a - off) as usize..(e - off) as usize])? };
        }
        pos += r.len;
        if pos >= off + n {
            break;
        }
    }
    Ok(())
}

fn atomic_kind(pkt: &Packet<'_>) -> Option<(u64, u32, AtomicKind)> {
    if let Some(a) = pkt.atomic {
        let kind = if pkt.bth.opcode == op::CMP_SWAP {
            AtomicKind::CompareSwap {
                compare: a.compare,
                swap: a.swap_add,
            }
        } else {
            AtomicKind::FetchAdd { add: a.swap_add }
        };
        return Some((a.va, a.rkey, kind));
    }
    let m = pkt.masked?;
    let size = match m.size {
        4 => AtomicSize::B4,
        8 => AtomicSize::B8,
        _ => return None,
    };
    let kind = if pkt.bth.opcode == op::MASKED_CMP_SWAP {
        AtomicKind::MaskedCompareSwap {
            size,
            compare: m.compare_boundary,
            compare_mask: m.compare_mask,
            swap: m.swap_add,
            swap_mask: m.swap_mask,
        }
    } else {
        AtomicKind::MaskedFetchAdd {
            size,
            add: m.swap_add,
            field_boundary: m.compare_boundary,
        }
    };
    Some((m.va, m.rkey, kind))
}

fn atomic_ack(reply: &mut Reply<'_>, psn: u32, msn: u32, old: u64) {
    let p = Packet {
        bth: reply.bth(op::ATOMIC_ACK, psn),
        aeth: Some(Aeth {
            syndrome: aeth::ACK,
            msn,
        }),
        atomic_ack: Some(old),
        ..Packet::default()
    };
    reply.send(&p);
}

/// Sends the responses of a READ of checked range `src`, PSNs from `psn`. When reading the
/// source (device memory) fails, stops before packet `k` and returns it with the error.
fn read_responses(
    src: &MemRange,
    psn: u32,
    mtu: u64,
    msn: u32,
    reply: &mut Reply<'_>,
) -> Result<(), (u32, DeviceMemoryError)> {
    let count = src.len.div_ceil(mtu).max(1);
    for k in 0..count {
        let off = k * mtu;
        let n = mtu.min(src.len - off.min(src.len));
        let opc = match (count == 1, k == 0, k + 1 == count) {
            (true, _, _) => op::READ_RESPONSE_ONLY,
            (false, true, _) => op::READ_RESPONSE_FIRST,
            (false, false, true) => op::READ_RESPONSE_LAST,
            (false, false, false) => op::READ_RESPONSE_MIDDLE,
        };
        let p = Packet {
            bth: reply.bth(opc, psn_add(psn, k as u32)),
            aeth: (opc != op::READ_RESPONSE_MIDDLE).then_some(Aeth {
                syndrome: aeth::ACK,
                msn,
            }),
            ..Packet::default()
        };
        // built in place at the end of the batch (alone under fault injection: TxBatch::slot)
        let (start, id) = reply.batch.slot(!reply.port.is_faulty());
        let buf = reply.batch.buf();
        if packet::encode_headers(&p, n as usize, buf).is_err() {
            return Ok(());
        }
        // SAFETY: `src` was checked under the responder's guard, still held by the caller;
        // `off + n <= src.len`.
        if let Err(e) = unsafe { append_range(buf, src, off, n) } {
            reply.batch.cut(start);
            return Err((k as u32, e));
        }
        packet::finish_at(&reply.flow, id, start, n as usize, buf);
        reply
            .port
            .send_built(reply.batch, start, reply.to, &reply.flow);
    }
    Ok(())
}

/// A request with a PSN the responder already passed: answered, never applied again.
/// Returns false for a duplicate READ that matches no READ still held (dropped unanswered,
/// nothing changed).
fn duplicate(r: &mut Resp<'_>, pkt: &Packet<'_>, reply: &mut Reply<'_>) -> bool {
    let msn = r.rq.wire.msn;
    match pkt.bth.opcode {
        op::READ_REQUEST => {
            // A READ is re-executed only for the part of a READ still held that it asks for
            // again (a retry from one of its response packets, VA and length adjusted).
            let Some(reth) = pkt.reth else { return false };
            let mtu = r.rq.wire.mtu as u64;
            let held = r.rq.wire.reads.iter().any(|h| {
                psn_diff(r.rq.wire.epsn, psn_add(h.psn, h.npkts)) <= MAX_OUTSTANDING_PSNS as i32
                    && h.covers(pkt.bth.psn, &reth, mtu)
            });
            if !held {
                return false;
            }
            match r.remote(Access::REMOTE_READ, reth.va, reth.rkey, reth.len as u64) {
                Ok(src) => {
                    if let Err((k, e)) = read_responses(&src, pkt.bth.psn, mtu, msn, reply) {
                        let nak = remote_devmem_nak(&r.qp.counters, &e);
                        let nak = r.fatal(nak);
                        reply.aeth(psn_add(pkt.bth.psn, k), nak_syndrome(&nak), msn);
                    }
                }
                Err(e) => {
                    let e = r.fatal(e);
                    reply.aeth(pkt.bth.psn, nak_syndrome(&e), msn);
                }
            }
        }
        op::CMP_SWAP | op::FETCH_ADD | op::MASKED_CMP_SWAP | op::MASKED_FETCH_ADD => {
            let hit =
                r.rq.wire
                    .atomics
                    .iter()
                    .find(|(p, _)| *p == pkt.bth.psn)
                    .map(|&(_, v)| v);
            if let Some(old) = hit {
                atomic_ack(reply, pkt.bth.psn, msn, old);
            }
        }
        _ => {
            if pkt.bth.ack_req {
                // Also while a gap is open with packets held behind it: the gap was NAKed or
                // reported when it opened, and the responder's timer names it again; a NAK
                // here would make the requester resend it once more for every redundant
                // resend that arrives, each drawing the next.
                let w = &r.rq.wire;
                reply.aeth(psn_add(w.epsn, MASK24), aeth::ACK, msn);
            }
        }
    }
    true
}

// ---------------------------------------------------------------------------- receive

/// Takes one received datagram: checks it (size, QP, ICRC, format) and hands it to the
/// responder or requester side of its QP. Never panics on any input; every drop is counted.
pub(crate) fn receive(
    dev: &Shared,
    port: &Port,
    d: &[u8],
    (from, id_hint, run_bth): (SocketAddr, u16, &[u8]),
    dport: u16,
    scratch: &mut Vec<u8>,
    batch: &mut TxBatch,
) {
    let wc = &dev.counters.wire;
    Counters::add(&wc.rx_packets, 1);
    Counters::add(&wc.rx_bytes, d.len() as u64);
    let SocketAddr::V4(from4) = from else {
        Counters::add(&wc.rx_malformed, 1);
        return;
    };
    if d.len() < BTH_LEN + ICRC_LEN || d.len() > packet::MAX_DATAGRAM {
        port.capture_rx(
            &Flow {
                src: *from4.ip(),
                dst: port.ip,
                sport: from.port(),
                dport,
            },
            d,
            id_hint,
        );
        Counters::add(&wc.rx_malformed, 1);
        return;
    }
    let bth = Bth::from_bytes(d[..BTH_LEN].try_into().unwrap_or(&[0; BTH_LEN]));
    let qp = dev.qp(bth.dest_qp);
    let remote = qp.as_ref().and_then(|q| q.wire_remote());
    let flow = Flow {
        src: remote.map_or(*from4.ip(), |(ip, _)| ip),
        dst: port.ip,
        sport: from.port(),
        dport,
    };
    port.capture_rx(&flow, d, id_hint);
    let (Some(qp), Some((remote_ip, remote_qpn))) = (qp, remote) else {
        Counters::add(&wc.rx_unknown_qp, 1);
        return;
    };
    // An RC QP takes packets from its connected peer only (rxe's check_addr): the source
    // address must be the peer GID's. The source port is entropy and is not checked.
    if *from4.ip() != remote_ip {
        Counters::add(&wc.rx_wrong_source, 1);
        return;
    }
    // The IPv4 identification is covered but not visible here: any a soft NIC's segmented
    // sends produce is accepted (see `packet::icrc_ip_id`); others where a raw socket shows
    // the real one (`ip_ids`): the run's first packet's, or that plus the datagram's place in
    // the run (a sender numbering its packets).
    if packet::icrc_ip_id(&flow, d, id_hint).is_none() {
        let real = port.real_ip_id(flow.src, flow.sport, flow.dport, run_bth);
        let fits = real.is_some_and(|id| {
            packet::icrc_is_for_id(&flow, d, id)
                || packet::icrc_is_for_id(&flow, d, id.wrapping_add(id_hint))
        });
        if !fits {
            Counters::add(&wc.rx_bad_icrc, 1);
            return;
        }
    }
    let pkt = match packet::parse(d) {
        Ok(p) if p.bth.pkey & 0x7fff == 0x7fff => p,
        _ => {
            Counters::add(&wc.rx_malformed, 1);
            return;
        }
    };
    let state = qp.state();
    if packet::is_request(pkt.bth.opcode) {
        if !matches!(state, QpState::Rtr | QpState::Rts) {
            Counters::add(&wc.rx_unknown_qp, 1);
            return;
        }
        // Answers go to the connected peer's address (its peer-table entry, else its GID's
        // address at the default port, as the requester's route), from the bound port; never
        // to the source of the request, which anyone may forge.
        let to = qp.answer_addr(|| match dev.peer_addr(&Gid::from_ipv4(remote_ip)) {
            Some(SocketAddr::V4(a)) => a,
            _ => std::net::SocketAddrV4::new(remote_ip, port.cfg.default_port),
        });
        let mut reply = Reply {
            port,
            to: SocketAddr::V4(to),
            flow: Flow {
                src: port.ip,
                dst: flow.src,
                sport: port.local.port(),
                dport: to.port(),
            },
            dest_qp: remote_qpn,
            buf: scratch,
            batch,
        };
        on_request(dev, &qp, &pkt, d, from.port(), &mut reply);
    } else {
        on_response(dev, &qp, &pkt);
    }
}

// ---------------------------------------------------------------------------- I/O thread

/// The I/O thread: receives datagrams until the device shuts down.
pub(crate) fn run(dev: Arc<Shared>, port: Arc<Port>) {
    // Large enough for any UDP datagram and any coalesced run, so an oversized datagram is
    // seen whole (and dropped as such) rather than silently truncated into one that parses.
    let mut buf = vec![0u8; 1 << 17];
    let mut scratch = Vec::with_capacity(MAX_DATAGRAM + ICRC_LEN);
    let mut batch = TxBatch::default();
    let mut fds = port.pollfds();
    let mut ready = vec![false; fds.len()];
    let mut busy = false;
    while !dev.shutdown.load(Ordering::Acquire) {
        if !socket::wait_readable(&mut fds, &mut ready, busy, port.recv_timeout()) {
            busy = false;
            port.flush_held();
            continue;
        }
        busy = true;
        for (i, _) in ready.iter().enumerate().filter(|(_, r)| **r) {
            let dport = port.sock_port(i);
            for _ in 0..socket::RX_BURST {
                match port.recv(i, &mut buf) {
                    Ok(socket::Received {
                        len: n,
                        from,
                        seg,
                        truncated,
                        not_plain,
                    }) => {
                        if dev.shutdown.load(Ordering::Acquire) {
                            return;
                        }
                        if truncated || not_plain {
                            Counters::add(&dev.counters.wire.rx_packets, 1);
                            let c = if truncated {
                                &dev.counters.wire.rx_malformed
                            } else {
                                &dev.counters.wire.rx_not_plain_ip
                            };
                            Counters::add(c, 1);
                            continue;
                        }
                        let data = &buf[..n];
                        match seg {
                            Some(s) if s > 0 && n > s => {
                                // a run's n-th datagram was most likely a segmented send's
                                // n-th segment: its identification (the ICRC's hint)
                                let run_bth = &data[..BTH_LEN.min(data.len())];
                                for (k, d) in data.chunks(s).enumerate() {
                                    receive(
                                        &dev,
                                        &port,
                                        d,
                                        (from, k as u16, run_bth),
                                        dport,
                                        &mut scratch,
                                        &mut batch,
                                    );
                                }
                            }
                            _ => receive(
                                &dev,
                                &port,
                                data,
                                (from, 0, &data[..BTH_LEN.min(data.len())]),
                                dport,
                                &mut scratch,
                                &mut batch,
                            ),
                        }
                        port.flush(&mut batch);
                    }
                    // drained (WouldBlock), or an ICMP error reported on the socket and the
                    // like: on to the next socket
                    Err(_) => break,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_arithmetic_wraps_at_24_bits() {
        assert_eq!(psn_add(0xff_ffff, 1), 0);
        assert_eq!(psn_add(0xff_fff0, 0x20), 0x10);
        assert_eq!(psn_diff(0x10, 0xff_fff0), 0x20);
        assert_eq!(psn_diff(0xff_fff0, 0x10), -0x20);
        assert_eq!(psn_diff(5, 5), 0);
        // half the space ahead is "after", the other half "before"
        assert_eq!(psn_diff(0x7f_ffff, 0), 0x7f_ffff);
        assert_eq!(psn_diff(0x80_0000, 0), -0x80_0000);
        assert_eq!(psn_add(MASK24, MASK24), MASK24 - 1);
    }

    #[test]
    fn nak_syndromes() {
        assert_eq!(nak_syndrome(&Response::Rnr(14)), 0x2e);
        assert_eq!(
            nak_syndrome(&Response::Nak(Syndrome::RemoteAccess, 0)),
            aeth::NAK_ACCESS
        );
        assert_eq!(
            nak_syndrome(&Response::Nak(Syndrome::RemoteInvalReq, 0)),
            aeth::NAK_INVALID
        );
        assert_eq!(
            nak_syndrome(&Response::Nak(Syndrome::RemoteOp, 0)),
            aeth::NAK_OPERATIONAL
        );
    }
}
