//! The requester side of RC over the wire: a QP's WQEs become messages with PSN ranges
//! ([`enqueue`]), are segmented to the path MTU and sent within the window ([`pump`]); ACKs,
//! NAKs, gap reports, READ responses and atomic ACKs move the window ([`on_response`]); the
//! engine's [`tick`] runs the timers (the IBTA ACK timer, the tail loss probe); messages
//! complete in WQE order ([`complete_front`]).
//!
//! Locking: the requester state lives in the QP's SQ state ([`ReqWire`]), touched under the SQ
//! lock (the engine holds it while it runs WQEs; the I/O thread takes it for responses).

use crate::completion::{flush_cqe, push_cqe_delayed};
use crate::counters::{Counters, WireCounters};
use crate::mem::{read_range, write_range, Access, MemRange, MrGuard};
use crate::net::packet::{
    self, aeth, opcode as op, AtomicEth, Bth, Class, Flow, MaskedAtomicEth, Packet, Reth,
    DEFAULT_PKEY, MASK24,
};
use crate::outcome::{local_devmem_err, local_err, rnr_delay, vendor, Done, Fail, Stall};
use crate::qp::{Qp, QpState, SqState};
use crate::rc_state::{
    psn_add, psn_diff, Acked, GapReport, OutMsg, OutOp, ReqWire, Src, SrcSeg, FAST_RTO_MAX,
    MAX_OUTSTANDING_PSNS, MAX_WINDOW,
};
use crate::shared::Shared;
use crate::DeviceMemoryError;
use crate::Gid;
use prm::cqe::{Cqe64, ErrorCqe};
use prm::parse::{sge_of, AtomicKind, LocalSeg, ParsedLocal, ParsedOp, ParsedWqe};
use prm::wqe::{Fence, Sge};
use prm::Syndrome;
use smallvec::SmallVec;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

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
        xrc_srqn: None,
    });
}

fn src_of(l: &ParsedLocal<'_>) -> Src {
    match l {
        ParsedLocal::Sges(list) => Src::Sges(list.iter().map(sge_of).collect()),
        ParsedLocal::Inline(b) => Src::Inline(b.to_vec()),
        ParsedLocal::Mixed(_) => Src::Mixed(
            l.segments()
                .map(|s| match s {
                    LocalSeg::Inline(b) => SrcSeg::Inline(b.to_vec()),
                    LocalSeg::Sge(s) => SrcSeg::Sge(s),
                })
                .collect(),
        ),
    }
}

/// Hands a WQE that passed the local checks to the wire.
pub(crate) fn enqueue(
    dev: &Shared,
    qp: &Qp,
    sq: &mut SqState,
    wqe: &ParsedWqe<'_>,
    staged: Option<Vec<u8>>,
) -> Result<Done, Fail> {
    let src_of = |l: &ParsedLocal<'_>| match staged {
        Some(bytes) => Src::Staged {
            src: Box::new(src_of(l)),
            bytes,
        },
        None => src_of(l),
    };
    let (delay, xrc_srqn) = (sq.delay, sq.xrc_srqn);
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
        ParsedOp::Nop | ParsedOp::Wait { .. } | ParsedOp::Dump { .. } | ParsedOp::Umr(_) => {
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
        xrc_srqn: xrc_srqn.filter(|_| w.class == Class::Xrc),
    });
    pump(dev, qp, w, Instant::now());
    if w.class == Class::Uc {
        complete_front(dev, qp, w, delay);
    }
    Ok(Done::Queued)
}

/// One piece of a message's source within a packet: inline bytes, or `n` bytes at offset
/// `off` of a gather entry.
enum Piece<'a> {
    Inline(&'a [u8]),
    Sge(&'a Sge, u64, u64),
}

/// Walks the pieces of `src` that hold bytes `off..off + n` of the message, in order.
fn walk<'a>(
    src: &'a Src,
    off: u64,
    n: u64,
    f: &mut dyn FnMut(Piece<'a>) -> Result<(), Fail>,
) -> Result<(), Fail> {
    let end = off + n;
    let mut pos = 0u64;
    let mut seg = |len: u64, piece: &dyn Fn(u64, u64) -> Piece<'a>| -> Result<bool, Fail> {
        let (a, e) = (off.max(pos), end.min(pos + len));
        if a < e {
            f(piece(a - pos, e - a))?;
        }
        pos += len;
        Ok(pos >= end)
    };
    match src {
        Src::Inline(b) => {
            let piece = b
                .get(off as usize..end as usize)
                .ok_or((Syndrome::LocalLength, vendor::TOO_LONG))?;
            f(Piece::Inline(piece))?;
        }
        Src::Mixed(segs) => {
            for s in segs {
                let done = match s {
                    SrcSeg::Inline(b) => seg(b.len() as u64, &|a, k| {
                        Piece::Inline(&b[a as usize..(a + k) as usize])
                    })?,
                    SrcSeg::Sge(s) => seg(s.len as u64, &|a, k| Piece::Sge(s, a, k))?,
                };
                if done {
                    break;
                }
            }
        }
        Src::Sges(list) => {
            for s in list {
                if seg(s.len as u64, &|a, k| Piece::Sge(s, a, k))? {
                    break;
                }
            }
        }
        Src::Staged { src, .. } => walk(src, off, n, f)?,
    }
    Ok(())
}

/// Copies `n` bytes at offset `off` of a message's source into `out`. A staged source's keys
/// are checked for those bytes as a source in memory would be; the bytes come from the stage.
fn gather(
    c: &Counters,
    g: &MrGuard<'_>,
    pd: crate::PdId,
    src: &Src,
    off: u64,
    n: u64,
    out: &mut Vec<u8>,
) -> Result<(), Fail> {
    if let Src::Staged { src, bytes } = src {
        walk(src, off, n, &mut |p| match p {
            Piece::Inline(_) => Ok(()),
            Piece::Sge(s, a, k) => check_sge(g, pd, s, a, k),
        })?;
        let piece = bytes
            .get(off as usize..(off + n) as usize)
            .ok_or((Syndrome::LocalLength, vendor::TOO_LONG))?;
        out.extend_from_slice(piece);
        return Ok(());
    }
    walk(src, off, n, &mut |p| match p {
        Piece::Inline(b) => {
            out.extend_from_slice(b);
            Ok(())
        }
        Piece::Sge(s, a, k) => append_sge(c, g, pd, s, a, k, out),
    })
}

/// Appends `n` bytes at offset `off` of a checked range (host or device memory). On a
/// device-memory failure `out` keeps its length.
///
/// # Safety
/// `r` must have been checked under an `MrGuard` the caller still holds, and
/// `off + n <= r.len`.
pub(super) unsafe fn append_range(
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
            let mut ranges: SmallVec<[MemRange; 2]> = SmallVec::new();
            g.resolve(
                pd,
                Access::LOCAL_WRITE,
                s.lkey.0,
                s.addr + (a - pos),
                e - a,
                &mut ranges,
            )
            .map_err(local_err)?;
            let mut at = (a - off) as usize;
            for r in &ranges {
                let end = at + r.len as usize;
                // SAFETY: `r` checked under `g` (held by the caller); the pieces add up to
                // exactly `e - a` bytes.
                unsafe { write_range(r, 0, &bytes[at..end]) }
                    .map_err(|e| local_devmem_err(c, &e))?;
                at = end;
            }
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
    let (flow, dc, class) = (w.flow, w.dc, w.class);
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
    let mut pkt = Packet {
        class,
        dceth: dc,
        xrceth: m.xrc_srqn,
        ..Packet::default()
    };
    let mut next = psn_add(p, 1);
    let built: Result<(), Fail> = match &m.op {
        OutOp::Write { .. } | OutOp::Send { .. } => {
            let off = k as u64 * mtu;
            let n = mtu.min(m.len.saturating_sub(off));
            let first = k == 0;
            let last = k + 1 >= m.npkts;
            let (opc, src) = data_opcode(m, first, last, &mut pkt);
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
            bth.opcode = atomic_header(*kind, *raddr, *rkey, &mut pkt);
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

/// The opcode of a WRITE's or SEND's packet at its `first` and `last` position, its RETH,
/// immediate and IETH put in `pkt`, and where its payload comes from.
fn data_opcode<'m>(m: &'m OutMsg, first: bool, last: bool, pkt: &mut Packet<'_>) -> (u8, &'m Src) {
    match &m.op {
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
        _ => unreachable!("build passes WRITEs and SENDs only"),
    }
}

/// The header of an atomic request: its AtomicETH or masked AtomicETH put in `pkt`, and its
/// opcode.
fn atomic_header(kind: AtomicKind, raddr: u64, rkey: u32, pkt: &mut Packet<'_>) -> u8 {
    match kind {
        AtomicKind::FetchAdd { add } => {
            pkt.atomic = Some(AtomicEth {
                va: raddr,
                rkey,
                swap_add: add,
                compare: 0,
            });
            op::FETCH_ADD
        }
        AtomicKind::CompareSwap { compare, swap } => {
            pkt.atomic = Some(AtomicEth {
                va: raddr,
                rkey,
                swap_add: swap,
                compare,
            });
            op::CMP_SWAP
        }
        AtomicKind::MaskedFetchAdd {
            size,
            add,
            field_boundary,
        } => {
            pkt.masked = Some(MaskedAtomicEth {
                va: raddr,
                rkey,
                size: size.bytes() as u8,
                swap_add: add,
                compare_boundary: field_boundary,
                swap_mask: 0,
                compare_mask: 0,
            });
            op::MASKED_FETCH_ADD
        }
        AtomicKind::MaskedCompareSwap {
            size,
            compare,
            compare_mask,
            swap,
            swap_mask,
        } => {
            pkt.masked = Some(MaskedAtomicEth {
                va: raddr,
                rkey,
                size: size.bytes() as u8,
                swap_add: swap,
                compare_boundary: compare,
                swap_mask,
                compare_mask,
            });
            op::MASKED_CMP_SWAP
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
    if w.class == Class::Uc {
        // UC: nothing answers; what has left is done
        w.una = w.send_psn;
        w.deadline = None;
        w.fast_deadline = None;
        return sent > 0;
    }
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
    if w.class == Class::Uc {
        complete_front(dev, qp, w, delay);
    }
    (sent, !w.msgs.is_empty())
}

/// Handles a response (ACK/NAK, READ response, atomic ACK) for requester QP `qp`.
pub(super) fn on_response(dev: &Shared, qp: &Qp, pkt: &Packet<'_>) {
    let now = Instant::now();
    let Some(mut sq) = qp.lock_sq_live() else {
        Counters::add(&dev.counters.wire.rx_unknown_qp, 1);
        return;
    };
    let delay = sq.delay;
    let Some(w) = sq.wire.as_mut() else {
        Counters::add(&dev.counters.wire.rx_unexpected, 1);
        return;
    };
    if qp.state() != QpState::Rts {
        Counters::add(&dev.counters.wire.rx_unknown_qp, 1);
        return;
    }
    let g = qp.mrs.read();
    let after = match pkt.bth.opcode {
        op::ACK => on_ack(&dev.counters.wire, w, pkt, now),
        op::READ_RESPONSE_FIRST
        | op::READ_RESPONSE_MIDDLE
        | op::READ_RESPONSE_LAST
        | op::READ_RESPONSE_ONLY => {
            on_read_response(dev, qp, &g, w, pkt, now);
            After::Complete
        }
        op::ATOMIC_ACK => {
            on_atomic_ack(dev, qp, &g, w, pkt, now);
            After::Complete
        }
        _ => {
            Counters::add(&dev.counters.wire.rx_unexpected, 1);
            After::Complete
        }
    };
    drop(g);
    match after {
        After::Stop => {}
        After::Pump => {
            pump(dev, qp, w, now);
        }
        After::Complete => {
            complete_front(dev, qp, w, delay);
            pump(dev, qp, w, now);
        }
    }
}

/// What [`on_response`] does after a response was taken.
enum After {
    /// Nothing more (the response acknowledged nothing it could).
    Stop,
    /// Send what the window now allows.
    Pump,
    /// Complete what was acknowledged, then send what the window allows.
    Complete,
}

/// An ACK, a NAK or a gap report: acknowledges what it covers and acts on the NAK; what the
/// caller does next.
fn on_ack(wc: &WireCounters<AtomicU64>, w: &mut ReqWire, pkt: &Packet<'_>, now: Instant) -> After {
    let p = pkt.bth.psn;
    let s = pkt.aeth.map_or(0, |a| a.syndrome);
    if s == aeth::GAP_REPORT {
        // Only a peer that agreed on selective repeat sends it; it acknowledges nothing (the
        // NAK code is reserved by IBTA: a real NIC never sends it).
        let n = pkt.aeth.map_or(0, |a| a.msn);
        let c = match w.selective.then(|| w.resend_gap(p, n, now)) {
            Some(GapReport::Acted) => &wc.sr_gap_reports_received,
            Some(GapReport::Ignored) => &wc.sr_gap_reports_ignored,
            Some(GapReport::NotInFlight) | None => &wc.rx_unexpected,
        };
        Counters::add(c, 1);
        return After::Pump;
    }
    match s >> 5 {
        0 => match w.ack_to(psn_add(p, 1), now) {
            Acked::Bogus => {
                // acknowledges PSNs never sent
                Counters::add(&wc.rx_unexpected, 1);
                return After::Stop;
            }
            Acked::Implicit => w.go_back_once(now),
            Acked::Ok => {}
        },
        1 | 3 => match w.ack_to(p, now) {
            Acked::Bogus => {
                Counters::add(&wc.rx_unexpected, 1);
                return After::Stop;
            }
            Acked::Implicit => w.go_back_once(now),
            Acked::Ok if w.una != p => Counters::add(&wc.rx_unexpected, 1),
            Acked::Ok if s >> 5 == 1 => on_rnr_nak(wc, w, p, s, now),
            Acked::Ok => on_nak(wc, w, p, s, now),
        },
        _ => Counters::add(&wc.rx_unexpected, 1),
    }
    After::Complete
}

/// An RNR NAK at the oldest PSN not acknowledged: waits the delay it names before resending
/// from there, or fails the message once its RNR retries are spent.
fn on_rnr_nak(wc: &WireCounters<AtomicU64>, w: &mut ReqWire, p: u32, s: u8, now: Instant) {
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

/// A sequence NAK (resend) or an error NAK (the message at `p` fails with the syndrome it
/// names) at the oldest PSN not acknowledged.
fn on_nak(wc: &WireCounters<AtomicU64>, w: &mut ReqWire, p: u32, s: u8, now: Instant) {
    match s {
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
                matches!(m.op, OutOp::Send { .. } | OutOp::Write { imm: Some(_), .. })
            });
            let why = if recv {
                vendor::RECV_BUFFER
            } else {
                vendor::INVALID_REQUEST
            };
            w.fail_at(p, (Syndrome::RemoteInvalReq, why));
        }
        aeth::NAK_ACCESS => w.fail_at(p, (Syndrome::RemoteAccess, vendor::REMOTE_KEY)),
        aeth::NAK_OPERATIONAL => {
            // The NAK carries no cause: a SEND's is its receive buffer (key or device memory),
            // any other request's the responder's device memory, the only operational error
            // it can meet.
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
    }
}

/// A READ response: checked against the READ in flight it answers, and taken if it is the next
/// packet expected.
fn on_read_response(
    dev: &Shared,
    qp: &Qp,
    g: &MrGuard<'_>,
    w: &mut ReqWire,
    pkt: &Packet<'_>,
    now: Instant,
) {
    let p = pkt.bth.psn;
    let wc = &dev.counters.wire;
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
            Acked::Ok => take_read_response(dev, qp, g, w, i, pkt, now),
        }
    }
}

/// The expected READ response packet `p` of message `i`: its opcode and length checked for its
/// place in the READ, its payload scattered to the READ's local segments.
fn take_read_response(
    dev: &Shared,
    qp: &Qp,
    g: &MrGuard<'_>,
    w: &mut ReqWire,
    i: usize,
    pkt: &Packet<'_>,
    now: Instant,
) {
    let p = pkt.bth.psn;
    let mtu = w.mtu as u64;
    let m = &mut w.msgs[i];
    let k = psn_diff(p, m.psn) as u32;
    let off = k as u64 * mtu;
    let last = k + 1 == m.npkts;
    // A READ retried from packet k is a new request for the rest: its responses start again
    // with FIRST (or ONLY).
    let o = pkt.bth.opcode;
    let op_ok = match (k == 0, last) {
        (_, true) => o == op::READ_RESPONSE_LAST || o == op::READ_RESPONSE_ONLY,
        (true, false) => o == op::READ_RESPONSE_FIRST,
        (false, false) => o == op::READ_RESPONSE_MIDDLE || o == op::READ_RESPONSE_FIRST,
    };
    let op_ok = op_ok && (o != op::READ_RESPONSE_LAST || k > 0);
    let want_len = if last { m.len.saturating_sub(off) } else { mtu };
    if !op_ok || pkt.payload.len() as u64 != want_len {
        m.fail = Some((Syndrome::BadResp, vendor::BAD_RESPONSE));
        w.halted = true;
    } else if let OutOp::Read { dst, .. } = &m.op {
        match scatter(&dev.counters, g, qp.pd, dst, off, pkt.payload) {
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

/// An atomic ACK: checked against the atomic in flight it answers, and taken if it is the
/// next one expected.
fn on_atomic_ack(
    dev: &Shared,
    qp: &Qp,
    g: &MrGuard<'_>,
    w: &mut ReqWire,
    pkt: &Packet<'_>,
    now: Instant,
) {
    let p = pkt.bth.psn;
    let wc = &dev.counters.wire;
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
            Acked::Ok => take_atomic_result(dev, qp, g, w, i, pkt, now),
        }
    }
}

/// The expected atomic ACK of message `i`: the original value it carries written to the
/// atomic's local result segment.
fn take_atomic_result(
    dev: &Shared,
    qp: &Qp,
    g: &MrGuard<'_>,
    w: &mut ReqWire,
    i: usize,
    pkt: &Packet<'_>,
    now: Instant,
) {
    let p = pkt.bth.psn;
    let m = &mut w.msgs[i];
    if let OutOp::Atomic { kind, result, .. } = &m.op {
        let old = pkt.atomic_ack.unwrap_or(0);
        let n = kind.size() as usize;
        let bytes = crate::responder::atomic_result_bytes(old, kind.size());
        let v = &bytes[..n];
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

/// Appends bytes `off..off + n` of the local segment `s` (checked under `g`: through an
/// indirect mkey, piece by piece) to `out`.
/// The checked ranges of `n` bytes at offset `off` of a gather entry.
fn resolve_sge(
    g: &MrGuard<'_>,
    pd: crate::PdId,
    s: &Sge,
    off: u64,
    n: u64,
) -> Result<SmallVec<[MemRange; 2]>, Fail> {
    let mut ranges = SmallVec::new();
    g.resolve(pd, Access::NONE, s.lkey.0, s.addr + off, n, &mut ranges)
        .map_err(local_err)?;
    Ok(ranges)
}

/// Checks `n` bytes at offset `off` of a gather entry as [`append_sge`] would, copying
/// nothing.
fn check_sge(g: &MrGuard<'_>, pd: crate::PdId, s: &Sge, off: u64, n: u64) -> Result<(), Fail> {
    resolve_sge(g, pd, s, off, n).map(drop)
}

fn append_sge(
    c: &Counters,
    g: &MrGuard<'_>,
    pd: crate::PdId,
    s: &Sge,
    off: u64,
    n: u64,
    out: &mut Vec<u8>,
) -> Result<(), Fail> {
    for r in &resolve_sge(g, pd, s, off, n)? {
        // SAFETY: `r` was checked under `g`, which the caller still holds.
        unsafe { append_range(out, r, 0, r.len) }.map_err(|e| local_devmem_err(c, &e))?;
    }
    Ok(())
}
