//! The responder side of RC over the wire: requests in sequence run through the checks shared
//! with the in-process path ([`crate::responder::Resp`]), duplicates are answered without
//! running twice, requests ahead of the expected PSN are NAKed (go-back-N) or held until
//! vouched for (selective repeat), and the engine's [`responder_tick`] names a gap again.
//! Answers go to the connected peer ([`Reply`]).
//!
//! Locking: the responder state lives in the QP's RQ state ([`crate::rc_state::RespWire`]),
//! touched under the RQ lock; the requester's is never taken here.

use super::requester::append_range;
use crate::counters::Counters;
use crate::mem::{total, write_range, Access, MemRange};
use crate::net::packet::{self, aeth, opcode as op, Aeth, Bth, Flow, Packet, DEFAULT_PKEY, MASK24};
use crate::net::socket::{Port, TxBatch};
use crate::outcome::vendor;
use crate::qp::Qp;
use crate::rc_state::{
    psn_add, psn_diff, same_request, HeldRead, Hold, InMsg, MAX_OUTSTANDING_PSNS, MAX_WINDOW,
};
use crate::responder::{remote_devmem_nak, Resp, Response};
use crate::shared::Shared;
use crate::DeviceMemoryError;
use prm::cqe::RespKind;
use prm::parse::AtomicKind;
use prm::wqe::AtomicSize;
use prm::Syndrome;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Atomic results a responder remembers for duplicate atomics.
const ATOMIC_CACHE: usize = 64;

/// READ requests a responder holds for duplicates at least (more when its port's window is
/// larger: a requester has at most a window of READs outstanding).
const READ_CACHE: usize = 1024;

/// Sends the responder's packets back to the requester.
pub(super) struct Reply<'a> {
    pub(super) port: &'a Port,
    pub(super) to: SocketAddr,
    pub(super) flow: Flow,
    pub(super) dest_qp: u32,
    /// The class of the answers: DC opcodes for a DC target's; none at all for UC (which
    /// answers nothing).
    pub(super) class: packet::Class,
    pub(super) buf: &'a mut Vec<u8>,
    pub(super) batch: &'a mut TxBatch,
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
        if self.class == packet::Class::Uc {
            return;
        }
        // Whatever the responder says acknowledges what came before: the payloads it left
        // queued in device memory land first. A queued write that failed sends nothing
        // (the memory now fails every access, so the message's next packet is NAKed).
        if let Err(e) = crate::mem::settle_queued() {
            tracing::warn!(error = %e, "queued device-memory writes failed: reply dropped");
            return;
        }
        let p = Packet {
            class: self.class,
            ..*p
        };
        if packet::encode(&p, &self.flow, self.buf).is_ok() {
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
pub(super) fn on_request(
    dev: &Shared,
    qp: &Qp,
    pkt: &Packet<'_>,
    raw: &[u8],
    sport: u16,
    reply: &mut Reply<'_>,
) {
    let Some(mut r) = Resp::lock(qp) else {
        // destroyed since it was looked up: as a packet for no QP
        Counters::add(&dev.counters.wire.rx_unknown_qp, 1);
        return;
    };
    // The answer (ACK or NAK) leaves before the receive completions the request made are
    // visible, as a NIC's does within nanoseconds: here a thread can be descheduled between
    // the two, and a program that answers its completion (a ping-pong) would otherwise send
    // its own request ahead of this ACK, which no peer expects. (A plain ACK the wire I/O
    // thread holds back, `Port::flush_or_hold`, is queued to leave ahead of the device's next
    // packet, that answer included; not when the completion wakes a program that waits for
    // its event: its answer comes late, and the peer, perhaps waiting for events too, takes
    // the ACK's completion best on its own.)
    r.defer_recv_cqes();
    request(dev, qp, &mut r, pkt, raw, sport, reply);
    if r.has_deferred() {
        if qp.recv_cq.wakes_watcher() {
            reply.port.flush(reply.batch);
        } else {
            reply.port.flush_or_hold(reply.batch);
        }
        r.write_deferred();
    }
}

fn request(
    dev: &Shared,
    qp: &Qp,
    r: &mut Resp<'_>,
    pkt: &Packet<'_>,
    raw: &[u8],
    sport: u16,
    reply: &mut Reply<'_>,
) {
    let wc = &dev.counters.wire;
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
    if qp.is_uc() {
        uc_request(wc, r, pkt, from, reply);
        return;
    }
    r.rq.wire.reply_to = Some((reply.to, reply.flow, reply.dest_qp));
    if d > 0 {
        ahead(dev, qp, r, pkt, raw, sport, reply);
        return;
    }
    if d < 0 {
        if duplicate(r, pkt, reply) {
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
    let Some(ack) = in_sequence(wc, r, pkt, from, reply) else {
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
    run_held(wc, qp, r, from, reply);
}

/// A UC request packet: no ACK, no NAK, no duplicate handling. In sequence it runs as RC's
/// does; a packet after a lost one ends the message in progress, and only a first or only
/// packet starts the next (IBTA's UC responder); a message the responder cannot take (no
/// receive posted, a bad key) is dropped with what follows of it.
fn uc_request(
    wc: &crate::counters::WireCounters<std::sync::atomic::AtomicU64>,
    r: &mut Resp<'_>,
    pkt: &Packet<'_>,
    from: u32,
    reply: &mut Reply<'_>,
) {
    let psn = pkt.bth.psn;
    let starts = matches!(
        pkt.bth.opcode,
        op::SEND_FIRST
            | op::SEND_ONLY
            | op::SEND_ONLY_IMM
            | op::WRITE_FIRST
            | op::WRITE_ONLY
            | op::WRITE_ONLY_IMM
    );
    if psn != r.rq.wire.epsn {
        r.rq.wire.cur = None;
        if !starts {
            Counters::add(&wc.uc_dropped, 1);
            return;
        }
        r.rq.wire.epsn = psn;
    }
    match new_request(r, pkt, from, reply) {
        Outcome::Accepted(n) => r.rq.wire.epsn = psn_add(psn, n),
        _ => {
            Counters::add(&wc.uc_dropped, 1);
            r.rq.wire.cur = None;
            r.rq.wire.epsn = psn_add(psn, 1);
        }
    }
}

/// A request ahead of the expected PSN. With selective repeat, from the requester's flow
/// and inside the hold window: held ([`crate::rc_state::RespWire::hold`]), the gaps it shows
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
    let own_flow = w.sport.is_none_or(|s| s == sport);
    if !in_window || (w.selective && !own_flow) {
        // farther ahead than any requester sends, or (selective repeat) not from the
        // requester's flow: forged, stale or broken
        Counters::add(&wc.out_of_window, 1);
    }
    if w.selective && in_window && own_flow {
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
    // One NAK per gap (IBTA, rxe). Once NAKed, a go-back-N packet out of sequence but not
    // past the highest one seen since is a retransmission: the requester went back and the
    // expected packet is still missing (its retransmission was lost too): NAK again. A packet
    // that no requester of this QP could have sent (outside the window; with selective
    // repeat, not held) neither repeats the NAK nor counts as the highest seen.
    let tracked = in_window && !w.selective;
    let again = tracked && w.nak_sent && psn_diff(psn, w.oos_hi) <= 0;
    if !w.nak_sent || again {
        w.nak_sent = true;
        w.oos_hi = if tracked { psn } else { w.epsn };
        seq_nak(wc, w, reply);
    } else if tracked && psn_diff(psn, w.oos_hi) > 0 {
        w.oos_hi = psn;
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
    w: &mut crate::rc_state::RespWire,
    reply: &mut Reply<'_>,
) {
    w.naked(Instant::now());
    Counters::add(&wc.seq_naks_sent, 1);
    reply.aeth(w.epsn, aeth::NAK_SEQ, w.msn);
}

/// Selective repeat: names a gap again that stayed unfilled for a while
/// ([`crate::rc_state::RespWire::renak_wait`], doubled at each try) with packets held behind it,
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
    let Some(mut rq) = qp.lock_rq_live() else {
        return false;
    };
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
            class: qp.wire_class(),
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

/// Runs a request packet with the expected PSN, each kind of request by its own step.
fn new_request(r: &mut Resp<'_>, pkt: &Packet<'_>, from: u32, reply: &mut Reply<'_>) -> Outcome {
    // an XRC target's request names its XRC SRQ (XRCETH): checked before anything runs
    if let Err(nak) = r.xrc_target(pkt.xrceth) {
        return Outcome::Nak(nak);
    }
    match pkt.bth.opcode {
        op::SEND_FIRST | op::SEND_ONLY | op::SEND_ONLY_IMM | op::SEND_ONLY_INV => {
            send_first(r, pkt, from)
        }
        op::SEND_MIDDLE | op::SEND_LAST | op::SEND_LAST_IMM | op::SEND_LAST_INV => {
            send_next(r, pkt, from)
        }
        op::WRITE_FIRST | op::WRITE_ONLY | op::WRITE_ONLY_IMM => write_first(r, pkt, from),
        op::WRITE_MIDDLE | op::WRITE_LAST | op::WRITE_LAST_IMM => write_next(r, pkt, from),
        op::READ_REQUEST => read_request(r, pkt, reply),
        op::CMP_SWAP | op::FETCH_ADD | op::MASKED_CMP_SWAP | op::MASKED_FETCH_ADD => {
            atomic_request(r, pkt, reply)
        }
        _ => Outcome::Dropped,
    }
}

/// A SEND's first or only packet: scattered to the receive at the head of the RQ (an only
/// packet completes it).
fn send_first(r: &mut Resp<'_>, pkt: &Packet<'_>, from: u32) -> Outcome {
    let opc = pkt.bth.opcode;
    let mtu = r.rq.wire.mtu as u64;
    let n = pkt.payload.len() as u64;
    let cur = r.rq.wire.cur;
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

/// A later packet of the SEND in progress: its payload scattered after what came before.
fn send_next(r: &mut Resp<'_>, pkt: &Packet<'_>, from: u32) -> Outcome {
    let opc = pkt.bth.opcode;
    let mtu = r.rq.wire.mtu as u64;
    let n = pkt.payload.len() as u64;
    let cur = r.rq.wire.cur;
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

/// A WRITE's first or only packet: the RETH's range checked, the payload written there.
fn write_first(r: &mut Resp<'_>, pkt: &Packet<'_>, from: u32) -> Outcome {
    let opc = pkt.bth.opcode;
    let mtu = r.rq.wire.mtu as u64;
    let n = pkt.payload.len() as u64;
    let cur = r.rq.wire.cur;
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
    if let Err(e) = unsafe { place(&dst, 0, pkt) } {
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

/// Writes a WRITE packet's payload at offset `off` of `dst`. Every packet is queued in device
/// memory (the driver copies the packets of a message that land one after the other as one);
/// a first or middle packet that asks for no ACK stays queued (waited for only when something
/// is said about it: see [`Reply::send`]), the last packet, or one that asks for an ACK, is
/// waited for at once, with everything queued before it.
///
/// # Safety
/// As for [`write_range`].
unsafe fn place(dst: &MemRange, off: u64, pkt: &Packet<'_>) -> Result<(), DeviceMemoryError> {
    let middle = matches!(pkt.bth.opcode, op::WRITE_FIRST | op::WRITE_MIDDLE);
    // SAFETY: per the contract.
    unsafe { crate::mem::write_range_queued(dst, off, pkt.payload) }?;
    match &dst.dev {
        Some(m) if !middle || pkt.bth.ack_req => m.settle(),
        _ => Ok(()),
    }
}

/// A later packet of the WRITE in progress: written after what came before.
fn write_next(r: &mut Resp<'_>, pkt: &Packet<'_>, from: u32) -> Outcome {
    let opc = pkt.bth.opcode;
    let mtu = r.rq.wire.mtu as u64;
    let n = pkt.payload.len() as u64;
    let cur = r.rq.wire.cur;
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
    if let Err(e) = unsafe { place(&dst, 0, pkt) } {
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

/// A READ request: its responses sent, and the READ held for a duplicate to be served again.
fn read_request(r: &mut Resp<'_>, pkt: &Packet<'_>, reply: &mut Reply<'_>) -> Outcome {
    let mtu = r.rq.wire.mtu as u64;
    let cur = r.rq.wire.cur;
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

/// An atomic request: executed, the value it read cached for a duplicate and sent back.
fn atomic_request(r: &mut Resp<'_>, pkt: &Packet<'_>, reply: &mut Reply<'_>) -> Outcome {
    let cur = r.rq.wire.cur;
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
            class: reply.class,
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

#[cfg(test)]
mod tests {
    use super::*;

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
