//! The responder: every check an RC responder makes on a request (QP access flags, rkey, PD,
//! range and right, receive WQE and its scatter list, atomic alignment) and the execution of
//! the request against registered memory, with the receive completions and affiliated
//! events a ConnectX responder produces. The in-process path ([`respond`], a function call
//! from the requester's engine) and the wire transport's responder use the same [`Resp`], so
//! both give the same outcomes.

use crate::completion::count_cq_error;
use crate::counters::Counters;
use crate::event::AsyncEvent;
use crate::mem::{copy_ranges, total, Access, CopyError, MemRange, MrGuard};
use crate::outcome::vendor;
use crate::qp::{Qp, QpState, RqState, Transport};
use crate::srq::Srq;
use parking_lot::MutexGuard;
use prm::cqe::{Cqe64, ErrorCqe, RespKind};
use prm::parse::{sge_of, AtomicKind};
use prm::wqe::DataSeg;
use prm::Syndrome;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// What a request asks of the responder.
pub(crate) enum Request<'a> {
    Write {
        raddr: u64,
        rkey: u32,
        src: &'a [MemRange],
        len: u64,
        imm: Option<u32>,
        /// When given (a WRITE without immediate), a copy whose ranges all lie in one device
        /// memory may be left queued ([`crate::mem::copy_ranges_queued`]); see [`QueuedCopy`].
        queue: Option<&'a mut QueuedCopy>,
    },
    Send {
        src: &'a [MemRange],
        len: u64,
        imm: Option<u32>,
        /// SEND_WITH_INV: the rkey to invalidate.
        invalidate: Option<u32>,
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

/// An in-process WRITE that may leave its copy queued, behind the WRITEs before it on the same
/// QP whose copies are still queued (the engine's batch).
pub(crate) struct QueuedCopy {
    /// The memories holding those earlier copies: settled before this WRITE's bytes move any
    /// other way (a host destination, another memory), so that they land first, as a NIC
    /// places the WRITEs of a QP in order.
    pub pending: smallvec::SmallVec<[Arc<dyn crate::DeviceMemory>; 1]>,
    /// The memory this WRITE's copy was left queued in, if it was: the caller settles it
    /// before anything reports the WRITE done.
    pub into: Option<Arc<dyn crate::DeviceMemory>>,
    /// A settle of `pending` that failed here: the earlier WRITEs did not all land.
    pub failed: Option<crate::DeviceMemoryError>,
}

impl QueuedCopy {
    /// Settles the memories of the earlier queued copies (each, after a failure too).
    fn settle_pending(&mut self) {
        for m in &self.pending {
            if let Err(e) = m.settle() {
                self.failed.get_or_insert(e);
            }
        }
    }
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
    /// No answer: the peer QP was destroyed while the request was on its way (in-process
    /// only); the requester's transport timer runs as for a peer that is not there.
    Vanished,
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
    /// Receive CQEs held back until [`Resp::write_deferred`] (the wire responder: its answer
    /// leaves first); `None`: written at once.
    deferred: Option<Vec<(Cqe64, bool)>>,
}

impl<'a> Resp<'a> {
    /// Takes the QP's receive state and its memory table; `None` when the QP was destroyed
    /// (its rings and CQ may be gone).
    pub fn lock(qp: &'a Qp) -> Option<Self> {
        let rq = qp.lock_rq_live()?;
        let g = qp.mrs.read();
        Some(Self {
            qp,
            rq,
            g,
            reported: false,
            deferred: None,
        })
    }

    /// Holds this request's receive CQEs back until [`Resp::write_deferred`].
    pub fn defer_recv_cqes(&mut self) {
        self.deferred = Some(Vec::new());
    }

    /// Whether receive CQEs wait to be written.
    pub fn has_deferred(&self) -> bool {
        self.deferred.as_ref().is_some_and(|d| !d.is_empty())
    }

    /// Writes the receive CQEs held back, in order (the receive state is still locked, so no
    /// other receive completion of the QP comes between).
    pub fn write_deferred(&mut self) {
        for (cqe, success) in self.deferred.take().unwrap_or_default() {
            self.push_recv_cqe(cqe, success);
        }
    }

    /// Writes (or holds back) a receive CQE. A CQ that refuses a successful completion makes
    /// the QP fatal; an error completion (the QP is going to ERR anyway) is counted as written.
    fn push_recv_cqe(&mut self, cqe: Cqe64, success: bool) {
        if let Some(d) = &mut self.deferred {
            d.push((cqe, success));
            return;
        }
        let qp = self.qp;
        let cq = match self.rq.xrc_srq.as_ref().and_then(|s| s.xrc_cq()) {
            Some(cq) => cq.clone(),
            None => qp.recv_cq.clone(),
        };
        match cq.push(cqe, None) {
            Ok(()) => Counters::add(&qp.counters.cqes, 1),
            Err(e) => {
                count_cq_error(&qp.counters, e);
                if success {
                    qp.fatal(AsyncEvent::QpFatal);
                } else {
                    Counters::add(&qp.counters.cqes, 1);
                }
            }
        }
    }

    /// A remote access: the QP's access flags, then key, PD, range and right of the region
    /// (none of these for zero bytes). Not fatal by itself (see [`Resp::fatal`]).
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
        if len == 0 {
            // IBTA C9-88: a zero-length RDMA READ or WRITE is not checked against its R_Key
            // or address (rxe and ConnectX accept any; UCX sends rkey 0, VA 0). The QP's
            // access flags still are.
            return Ok(MemRange::empty());
        }
        self.g
            .check_remote(self.pd(), self.qp.qpn, need, rkey, raddr, len)
            .map_err(|_| Response::Nak(Syndrome::RemoteAccess, vendor::REMOTE_KEY))
    }

    /// Error classes that put the responder in ERR (as an RC responder does on NAK-invalid
    /// request, remote access and remote operational errors).
    /// A failure no receive completion reported raises the affiliated event a ConnectX
    /// responder raises: QP_REQ_ERR for an invalid request, QP_ACCESS_ERR for a remote access
    /// violation, QP_FATAL otherwise.
    /// A DC target is not affected: it serves every other initiator on (the NAK ends only
    /// the initiator's message, as on a ConnectX). Nor is a UC QP by a request it drops (UC
    /// answers nothing: the message is lost), only by a receive it failed.
    pub fn fatal(&self, r: Response) -> Response {
        if self.qp.dct_key().is_some() || (self.qp.is_uc() && !self.reported) {
            return r;
        }
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

    /// The SRQ this request's receive comes from: the QP's, or the XRC SRQ an XRC target's
    /// request named ([`Resp::xrc_target`]).
    fn srq(&self) -> Option<Arc<Srq>> {
        self.qp.srq.as_ref().or(self.rq.xrc_srq.as_ref()).cloned()
    }

    /// The PD the request's memory accesses are checked against: an XRC target's is the one
    /// of the XRC SRQ the request names (IBTA XRC), every other QP's its own.
    fn pd(&self) -> crate::PdId {
        match &self.rq.xrc_srq {
            Some(s) => s.pd(),
            None => self.qp.pd,
        }
    }

    /// An XRC target's request names XRC SRQ `srqn` (its XRCETH, or the initiator's XRC
    /// segment in process): it must be an XRC SRQ of the target's domain, and stay the same
    /// within a message. Otherwise NAK invalid request (REMOTE_INVAL_REQ at the initiator),
    /// fatal for the target. Nothing for other QPs.
    pub fn xrc_target(&mut self, srqn: Option<u32>) -> Result<(), Response> {
        if self.qp.transport != Transport::XrcTgt {
            return Ok(());
        }
        let found = srqn.and_then(|n| self.qp.xrcd.as_ref()?.srq(n));
        let switched = |s: &Arc<Srq>, rq: &RqState| {
            rq.srq_wqe.is_some() && rq.xrc_srq.as_ref().is_some_and(|o| !Arc::ptr_eq(o, s))
        };
        match found {
            Some(s) if !switched(&s, &self.rq) => {
                self.rq.xrc_srq = Some(s);
                Ok(())
            }
            _ => {
                Counters::add(&self.qp.counters.xrc_bad_srq, 1);
                tracing::debug!(
                    qpn = self.qp.qpn,
                    ?srqn,
                    "XRC request names no SRQ of the domain"
                );
                Err(self.fatal(Response::Nak(
                    Syndrome::RemoteInvalReq,
                    vendor::INVALID_REQUEST,
                )))
            }
        }
    }

    /// Whether a receive WQE is posted. A QP on an SRQ takes the SRQ's next WQE here and
    /// holds it for the message (other QPs of the SRQ cannot take it meanwhile).
    pub fn has_recv(&mut self) -> bool {
        match &self.srq() {
            Some(s) => {
                if self.rq.srq_wqe.is_none() {
                    self.rq.srq_wqe = s.take();
                }
                self.rq.srq_wqe.is_some()
            }
            None => self.qp.rq_wqes != 0 && self.rq.ci as u16 != self.qp.rq_head(self.rq.ci as u16),
        }
    }

    /// The `wqe_counter` of the receive at the head: the RQ's counter, or the index of the
    /// SRQ WQE held.
    fn recv_counter(&self) -> u16 {
        match (
            self.qp.srq.is_some() || self.rq.xrc_srq.is_some(),
            self.rq.srq_wqe,
        ) {
            (true, Some(i)) => i,
            _ => self.rq.ci as u16,
        }
    }

    /// Moves past the receive just completed.
    fn recv_advance(&mut self) {
        if self.qp.srq.is_some() || self.rq.xrc_srq.is_some() {
            self.rq.srq_wqe = None;
        } else {
            self.rq.ci = self.rq.ci.wrapping_add(1);
        }
    }

    /// SEND_WITH_INV: invalidates `rkey`, a type 2 memory window bound to this QP or an
    /// indirect mkey created for remote invalidation. A key it cannot invalidate completes the
    /// receive with LOCAL_PROT (vendor syndrome [`vendor::MEMORY_WINDOW`] or [`vendor::UMR`])
    /// and NAKs invalid request (fatal).
    pub fn invalidate(&mut self, rkey: u32) -> Result<(), Response> {
        let (pd, qpn) = (self.pd(), self.qp.qpn);
        let done = if self.g.is_indirect(rkey) {
            self.g
                .invalidate_indirect(pd, qpn, rkey)
                .map_err(|e| (e.to_string(), vendor::UMR))
        } else {
            self.g
                .invalidate(pd, qpn, rkey)
                .map(|_| ())
                .map_err(|e| (e.to_string(), vendor::MEMORY_WINDOW))
        };
        match done {
            Ok(()) => Ok(()),
            Err((e, why)) => {
                tracing::debug!(qpn = self.qp.qpn, error = %e, "SEND_WITH_INV refused");
                self.recv_error(Syndrome::LocalProt, why);
                Err(self.fatal(Response::Nak(Syndrome::RemoteInvalReq, why)))
            }
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
        let srq = self.srq();
        let (ring, off, nsge, pd) = match &srq {
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
        let mut dst: SmallVec<[MemRange; 4]> = SmallVec::new();
        let checked = segs.iter().try_for_each(|d| {
            let s = sge_of(d);
            self.g.resolve(
                pd,
                Access::LOCAL_WRITE,
                s.lkey.0,
                s.addr,
                s.len as u64,
                &mut dst,
            )
        });
        checked.map(|()| dst).map_err(|_| {
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
        let qpn = self.qp.qpn;
        self.recv_complete(|counter| {
            Cqe64::responder(kind, qpn, from, counter, len as u32, imm, 0)
        });
    }

    /// Completes the receive WQE at the head successfully with the CQE `cqe` makes of its
    /// `wqe_counter`.
    pub fn recv_complete(&mut self, cqe: impl FnOnce(u16) -> Cqe64) {
        if self.srq().is_some() && !self.has_recv() {
            // only after has_recv said yes, which holds the WQE: not reached
            return;
        }
        let counter = self.recv_counter();
        let cqe = cqe(counter);
        self.recv_advance();
        let cqe = self.stamp(cqe);
        self.push_recv_cqe(cqe, true);
    }

    /// Puts the user index into a receive CQE: an XRC SRQ's (its number when it has none), as
    /// libmlx5 finds an XRC SRQ's completions by it, else the QP's.
    fn stamp(&self, mut cqe: Cqe64) -> Cqe64 {
        match self
            .rq
            .xrc_srq
            .as_ref()
            .and_then(|s| s.xrc.as_ref().map(|x| (s, x)))
        {
            Some((s, x)) => {
                cqe.srqn_uidx = prm::Be32::new(x.user_index.unwrap_or(s.srqn()));
                cqe
            }
            None => self.qp.stamp(cqe),
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
        let cqe = self.stamp(Cqe64::error(&e, 0));
        self.push_recv_cqe(cqe, false);
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
pub(crate) fn respond(
    peer: &Qp,
    from: u32,
    xrc: Option<u32>,
    req: Request<'_>,
    move_data: bool,
) -> Response {
    // a DC target's own RQ state is swapped with an initiator's while the wire runs a request
    // (`wire::dct`): an in-process request waits for it to be back
    let _dc = peer.dct_key().map(|_| peer.dc_conns.lock());
    let Some(mut r) = Resp::lock(peer) else {
        return Response::Vanished;
    };
    if let Err(nak) = r.xrc_target(xrc) {
        return nak;
    }
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
            queue,
        } => {
            let dst = match r.remote(Access::REMOTE_WRITE, raddr, rkey, len) {
                Ok(d) => d,
                Err(e) => return r.fatal(e),
            };
            let mut queue = queue;
            let queued = match queue.as_deref_mut() {
                Some(q) if move_data && imm.is_none() => {
                    q.into = crate::mem::copy_ranges_queued(std::slice::from_ref(&dst), src);
                    q.into.is_some()
                }
                _ => false,
            };
            if move_data && !queued {
                if let Some(q) = queue {
                    q.settle_pending();
                }
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
        Request::Send {
            src,
            len,
            imm,
            invalidate,
        } => {
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
            if let Some(rkey) = invalidate {
                if let Err(nak) = r.invalidate(rkey) {
                    return nak;
                }
                r.recv_done(RespKind::SendInv, len, Some(rkey), from);
                return Response::Ack;
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

/// The bytes of an atomic's original value as the requester's result segment receives them
/// (the first `size` of them): an 8-byte value host-endian (the 8-byte atomic response mode
/// the emulated device reports, `atomic_req_8B_endianness_mode` 1, which libmlx5 selects), a
/// 4-byte one (masked atomics only) big-endian, as a ConnectX writes it (NVSHMEM's IBGDA swaps
/// a 4-byte fetched value and reads an 8-byte one as it is). Target memory holds host-endian
/// values in both cases.
pub(crate) fn atomic_result_bytes(old: u64, size: u32) -> [u8; 8] {
    let mut b = old.to_ne_bytes();
    if size == 4 {
        b[..4].copy_from_slice(&(old as u32).to_be_bytes());
    }
    b
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

/// The responder's answer when its own device memory failed (WRITE target, READ source, atomic
/// target, receive buffer or receive WQE): NAK remote operational error (REMOTE_OP at the
/// requester), fatal for the responder.
pub(crate) fn remote_devmem_nak(c: &Counters, e: &crate::DeviceMemoryError) -> Response {
    tracing::warn!(error = %e, "device memory failed (responder)");
    Counters::add(&c.devmem_errors, 1);
    Response::Nak(Syndrome::RemoteOp, vendor::DEVICE_MEMORY)
}
