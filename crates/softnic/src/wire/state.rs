//! The RC transport state of one QP, held in its SQ and RQ state: the requester's messages,
//! PSNs, window, timers and RTT estimate, and the responder's expected PSN, MSN, message in
//! progress and answer caches. Plain state and the arithmetic on it; sending and receiving
//! packets is [`super::transport`]'s.

use super::packet::{Flow, Reth, MASK24};
use super::socket::TxBatch;
use crate::outcome::Fail;
use prm::parse::AtomicKind;
use prm::wqe::Sge;
use smallvec::SmallVec;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// `p + n` in 24-bit PSN space.
pub(crate) fn psn_add(p: u32, n: u32) -> u32 {
    p.wrapping_add(n) & MASK24
}

/// `a - b` in 24-bit PSN space, as a signed distance.
pub(crate) fn psn_diff(a: u32, b: u32) -> i32 {
    ((a.wrapping_sub(b) << 8) as i32) >> 8
}

/// Packets timed at once (`ReqWire::rtt_probes`): a window asks for an ACK about every
/// quarter window, plus one per message end.
const MAX_PROBES: usize = 64;
/// The smallest congestion window (packets).
const MIN_CWND: u32 = 16;
/// Bounds of the early retransmission timer (see [`ReqWire::fast_rto`]).
const FAST_RTO_MIN: Duration = Duration::from_millis(2);
pub(super) const FAST_RTO_MAX: Duration = Duration::from_millis(20);
/// The early timer's floor with selective repeat, where it only covers a lost tail (a lost
/// packet with packets behind it is NAKed, and NAKed again by the responder's timer).
const FAST_RTO_MIN_SELECTIVE: Duration = Duration::from_millis(10);
const FAST_RTO_MAX_SELECTIVE: Duration = Duration::from_millis(40);

// ---------------------------------------------------------------------------- requester

/// Where the local bytes of a WRITE or SEND come from.
pub(crate) enum Src {
    /// A gather list, re-checked whenever a packet is built from it.
    Sges(SmallVec<[Sge; 4]>),
    /// Inline bytes, copied out of the WQE.
    Inline(Vec<u8>),
}

/// What a message on the wire does.
pub(crate) enum OutOp {
    Write {
        raddr: u64,
        rkey: u32,
        imm: Option<u32>,
        src: Src,
    },
    Send {
        imm: Option<u32>,
        /// SEND_WITH_INV: the rkey the responder invalidates.
        invalidate: Option<u32>,
        src: Src,
    },
    Read {
        raddr: u64,
        rkey: u32,
        dst: SmallVec<[Sge; 4]>,
    },
    Atomic {
        raddr: u64,
        rkey: u32,
        kind: AtomicKind,
        result: Sge,
    },
    /// A WQE that needs no packet (NOP, WAIT) or failed locally, queued behind WQEs on the
    /// wire to complete in order.
    Local { byte_cnt: u32 },
}

/// One WQE on its way through the requester transport.
pub(crate) struct OutMsg {
    pub(super) idx: u16,
    pub(super) opcode: u8,
    pub(super) signaled: bool,
    pub(super) solicited: bool,
    pub(super) op: OutOp,
    pub(super) len: u64,
    /// First PSN.
    pub(super) psn: u32,
    /// PSNs it consumes (packets, or READ response packets); 0 for `Local`.
    pub(super) npkts: u32,
    /// Completes with this error when it reaches the front.
    pub(super) fail: Option<Fail>,
}

impl OutMsg {
    pub(super) fn end(&self) -> u32 {
        psn_add(self.psn, self.npkts)
    }
}

/// The requester side of a QP on the wire.
pub(crate) struct ReqWire {
    pub(super) to: SocketAddr,
    pub(super) flow: Flow,
    pub(super) remote_qpn: u32,
    pub(super) mtu: u32,
    pub(super) window: u32,
    pub(super) timeout: Option<Duration>,
    pub(super) retry_cnt: u32,
    pub(super) rnr_retry: u8,
    pub(crate) msgs: VecDeque<OutMsg>,
    /// Next PSN to give a new message.
    pub(super) next_psn: u32,
    /// Oldest PSN not yet acknowledged (or answered).
    pub(super) una: u32,
    /// Next PSN to transmit (moved back by go-back-N).
    pub(super) send_psn: u32,
    /// One past the highest PSN transmitted.
    pub(super) sent_hi: u32,
    pub(super) retries: u32,
    pub(super) rnr_retries: u32,
    /// The IBTA local ACK timeout: its expirations count against `retry_cnt`.
    pub(super) deadline: Option<Instant>,
    /// The early retransmission timer (RTT-based, never fails the QP).
    pub(super) fast_deadline: Option<Instant>,
    pub(super) rnr_until: Option<Instant>,
    /// `una` and time of the last go-back (one per gap and round trip).
    pub(super) goback: Option<(u32, Instant)>,
    /// Congestion window (packets) and its additive-increase accumulator.
    pub(super) cwnd: u32,
    pub(super) cwnd_acc: u32,
    /// Smoothed round-trip time and its mean deviation, and the packets being timed: every
    /// first transmission that asks for an answer (AckReq, a READ), oldest first, with its
    /// send time. Each ACK that moves `una` past some of them gives a sample (the newest it
    /// covers), so the estimate follows the queueing delay as a window fills (one probe at a
    /// time, taken while the queue is still empty, left the early timer far too short).
    pub(super) srtt: Duration,
    pub(super) rttvar: Duration,
    pub(super) rtt_probes: VecDeque<(u32, Instant)>,
    /// The largest recent RTT sample (decaying): the scheduling pauses this machine has.
    pub(super) rtt_max: Duration,
    /// The early timer's floor, doubled whenever it fired for nothing (decaying).
    pub(super) rto_floor: Duration,
    /// When the early timer last sent its probe, until `una` moves.
    pub(super) probed_at: Option<Instant>,
    /// Selective repeat agreed with the peer: a sequence NAK resends the packet it names
    /// alone, a gap report the packets it names (the peer holds what followed them); the
    /// IBTA timer still goes back N.
    pub(super) selective: bool,
    /// PSNs a sequence NAK or a gap report asked for, to send before anything else.
    pub(super) resend: VecDeque<u32>,
    /// PSNs queued for such a resend, and when (pruned to those in flight).
    pub(super) resent: HashMap<u32, Instant>,
    /// A WQE that failed locally is queued: run no more WQEs until it completes.
    pub(crate) blocked: bool,
    /// A queued message failed while being sent: send nothing more.
    pub(super) halted: bool,
    /// Packets on their way out; the requester builds them in place (`Port::send_built`).
    pub(super) batch: TxBatch,
}

impl ReqWire {
    /// A transport for the peer QP `remote_qpn` at `to` (`flow`), starting at PSN `psn`.
    pub(super) fn new(
        to: SocketAddr,
        flow: Flow,
        remote_qpn: u32,
        mtu: u32,
        window: u32,
        psn: u32,
    ) -> Self {
        Self {
            to,
            flow,
            remote_qpn,
            mtu,
            window,
            timeout: None,
            retry_cnt: 0,
            rnr_retry: 0,
            msgs: VecDeque::new(),
            next_psn: psn,
            una: psn,
            send_psn: psn,
            sent_hi: psn,
            retries: 0,
            rnr_retries: 0,
            deadline: None,
            fast_deadline: None,
            rnr_until: None,
            goback: None,
            cwnd: window,
            cwnd_acc: 0,
            srtt: Duration::ZERO,
            rttvar: Duration::ZERO,
            rtt_probes: VecDeque::new(),
            rtt_max: Duration::ZERO,
            rto_floor: Duration::ZERO,
            probed_at: None,
            selective: false,
            resend: VecDeque::new(),
            resent: HashMap::new(),
            blocked: false,
            halted: false,
            batch: TxBatch::default(),
        }
    }

    /// The WQE index of the oldest message not yet completed.
    pub(crate) fn oldest(&self) -> Option<u16> {
        self.msgs.front().map(|m| m.idx)
    }

    /// Takes RTS's local ACK timeout (IBTA encoding), retry count and RNR retry count.
    pub(crate) fn set_rts(&mut self, timeout: u8, retry_cnt: u8, rnr_retry: u8) {
        self.timeout = (timeout != 0).then(|| Duration::from_nanos(4096u64 << timeout));
        self.retry_cnt = retry_cnt as u32;
        self.rnr_retry = rnr_retry;
    }

    pub(super) fn restart_timer(&mut self, now: Instant) {
        let busy = self.una != self.sent_hi;
        self.deadline = if busy {
            self.timeout.map(|t| now + t)
        } else {
            None
        };
        self.fast_deadline = busy.then(|| now + self.fast_rto());
    }

    /// When to retransmit a tail nobody NAKs (or a lost NAK): `srtt + 4 rttvar`, but at least
    /// twice the largest recent RTT sample (which holds the scheduling pauses of a loaded
    /// machine) and the floor that spurious expirations raised; well before the IBTA timeout.
    pub(super) fn fast_rto(&self) -> Duration {
        let t = if self.srtt.is_zero() {
            FAST_RTO_MAX // no sample yet
        } else if self.selective {
            // behind the responder's renewed NAKs and the resends they draw (a few round
            // trips): only a lost tail is left to this timer
            (self.srtt * 8)
                .max(self.srtt + self.rttvar * 4)
                .max(self.rtt_max * 2)
                .max(self.rto_floor)
                .clamp(FAST_RTO_MIN_SELECTIVE, FAST_RTO_MAX_SELECTIVE)
        } else {
            (self.srtt + self.rttvar * 4)
                .max(self.rtt_max * 2)
                .max(self.rto_floor)
                .clamp(FAST_RTO_MIN, FAST_RTO_MAX)
        };
        match self.timeout {
            Some(ib) => t.min(ib / 2),
            None => t,
        }
    }

    /// A loss was detected: halve the congestion window.
    pub(super) fn congestion(&mut self) {
        self.cwnd = (self.cwnd / 2).max(MIN_CWND).min(self.window);
        self.cwnd_acc = 0;
    }

    /// Index of the first message whose PSN range ends after `p`.
    pub(super) fn find(&self, p: u32) -> usize {
        self.msgs.partition_point(|m| psn_diff(m.end(), p) <= 0)
    }

    /// Retransmits from `to` (go-back-N); the rest of the window follows.
    pub(super) fn go_back(&mut self, to: u32, now: Instant) {
        self.send_psn = to;
        self.resend.clear();
        self.goback = Some((to, now));
        self.rtt_probes.clear();
        // Halve the window: going back N resends it. With selective repeat only the IBTA timer
        // goes back (NAKs resend one packet and cut nothing), and when it fires the path lost
        // more than single packets (a receiver's socket overflowing, say): cut too.
        self.congestion();
    }

    /// The early timer fired: resend the newest packet in flight, alone and asking for an ACK
    /// (a tail loss probe, as TCP's). A responder that has it already answers the duplicate
    /// with an ACK of all it holds, which is all a pause of either side costs (one packet, not
    /// a window); one that misses packets before it answers with a sequence NAK or a gap
    /// report, which resends them. Nothing goes back and no window is cut: a timer that fires
    /// for a pause says nothing about the path, and a window resent after a pause arrives as
    /// duplicates. Going back N is left to the IBTA timer.
    pub(super) fn probe_tail(&mut self, now: Instant) {
        self.fast_deadline = None;
        if self.una == self.sent_hi {
            return;
        }
        // sent_hi - 1: the newest PSN sent
        let newest = psn_add(self.sent_hi, MASK24);
        // queued even when a NAK or gap report resent it within the last round trip
        self.resent.insert(newest, now);
        self.resend.retain(|&p| p != newest);
        self.resend.push_front(newest);
        self.rtt_probes.clear();
        self.probed_at = Some(now);
    }

    /// Goes back to `una` for a sequence NAK. The responder NAKs a gap once, and again only
    /// when the retransmission was lost too (a round trip later), so every NAK is acted on,
    /// but for a copy of one just taken (duplicated on the way).
    pub(super) fn go_back_nak(&mut self, now: Instant) {
        let una = self.una;
        let copy = matches!(self.goback, Some((p, t)) if p == una && now.duration_since(t) < self.srtt / 4);
        if !copy {
            self.go_back(una, now);
        }
    }

    /// Selective repeat: resends `una` alone for a sequence NAK, unless it was resent within
    /// the last round trip (the responder names a gap again while more packets arrive behind
    /// it; one NAK a round trip after the resend means the resend was lost too). No window
    /// cut: a lost packet is not a congested path (ConnectX reacts to congestion
    /// notifications, not to loss).
    pub(super) fn resend_nak(&mut self, now: Instant) {
        // a probe acknowledged after the gap is filled would time the gap, not the path
        self.rtt_probes.clear();
        self.queue_resend(self.una, now);
    }

    /// Selective repeat: a gap report (the responder misses PSNs `[from, from + n)` and holds
    /// packets behind them) resends each of them that is in flight, unless it was resent
    /// within the last round trip. It acknowledges nothing and cuts no window. False when it
    /// names no PSN in flight (stale, or never sent).
    pub(super) fn resend_gap(&mut self, from: u32, n: u32, now: Instant) -> bool {
        let in_flight = psn_diff(self.sent_hi, self.una).max(0) as u32;
        let k = psn_diff(from, self.una);
        if n == 0 || k < 0 || k as u32 >= in_flight {
            return false;
        }
        self.rtt_probes.clear();
        for i in 0..n.min(in_flight - k as u32) {
            self.queue_resend(psn_add(from, i), now);
        }
        true
    }

    /// Queues PSN `p` for a resend unless it was queued within the last round trip (the
    /// responder names a gap again while more packets arrive behind it; once more a round
    /// trip after the resend means the resend was lost too).
    fn queue_resend(&mut self, p: u32, now: Instant) {
        let rtt = self.srtt.max(Duration::from_micros(50));
        if self
            .resent
            .get(&p)
            .is_some_and(|t| now.duration_since(*t) < rtt)
        {
            return;
        }
        if self.resent.len() >= 2 * self.window.max(64) as usize {
            let una = self.una;
            self.resent.retain(|&q, _| psn_diff(q, una) >= 0);
        }
        self.resent.insert(p, now);
        self.resend.push_back(p);
    }

    /// Goes back to `una` for a missing response, once per gap and round trip (the
    /// responses after one loss arrive together).
    pub(super) fn go_back_once(&mut self, now: Instant) {
        let una = self.una;
        let again = match self.goback {
            Some((p, t)) => p != una || now.duration_since(t) > self.srtt * 2,
            None => true,
        };
        if again {
            self.go_back(una, now);
        }
    }

    /// Fails the message holding PSN `p` (or the first unfinished one).
    pub(super) fn fail_at(&mut self, p: u32, f: Fail) {
        let i = self.find(p).min(self.msgs.len().saturating_sub(1));
        if let Some(m) = self.msgs.get_mut(i) {
            m.fail.get_or_insert(f);
        }
        self.halted = true;
    }

    /// Acknowledges every PSN before `to`. Stops at a READ or atomic still missing its
    /// responses: those PSNs are acknowledged only by the responses themselves.
    pub(super) fn ack_to(&mut self, to: u32, now: Instant) -> Acked {
        if psn_diff(to, self.una) <= 0 {
            return Acked::Ok;
        }
        if psn_diff(to, self.sent_hi) > 0 {
            return Acked::Bogus;
        }
        let old = self.una;
        let mut out = Acked::Ok;
        for m in self.msgs.iter().skip(self.find(self.una)) {
            if m.npkts == 0 {
                continue;
            }
            if psn_diff(m.psn, to) >= 0 {
                break;
            }
            match m.op {
                OutOp::Write { .. } | OutOp::Send { .. } => {
                    let end = m.end();
                    self.una = if psn_diff(to, end) < 0 { to } else { end };
                    if self.una != end {
                        break;
                    }
                }
                _ => {
                    out = Acked::Implicit;
                    break;
                }
            }
        }
        if self.una != old {
            self.progress(old, now);
        }
        out
    }

    /// Times the first transmission of `p`, which asks for an answer (see `rtt_probes`).
    pub(super) fn probe(&mut self, p: u32, now: Instant) {
        if self
            .rtt_probes
            .back()
            .is_some_and(|&(q, _)| psn_diff(p, q) <= 0)
        {
            return; // not after the newest probe: a resend, or sent again after going back
        }
        if self.rtt_probes.len() >= MAX_PROBES {
            self.rtt_probes.pop_front();
        }
        self.rtt_probes.push_back((p, now));
    }

    /// `una` moved forward from `old`.
    pub(super) fn progress(&mut self, old: u32, now: Instant) {
        self.retries = 0;
        self.rnr_retries = 0;
        self.goback = None;
        if let Some(t) = self.probed_at.take() {
            if now.duration_since(t) < self.srtt / 2 {
                // Too soon to answer the probe: the first transmissions' ACK was late (this
                // process was paused, the ACK waiting in its socket), the timer fired for
                // nothing. Wait longer.
                self.rto_floor = (self.rto_floor * 2)
                    .max(self.fast_rto() * 2)
                    .min(FAST_RTO_MAX);
            }
        }
        if psn_diff(self.send_psn, self.una) < 0 {
            self.send_psn = self.una;
        }
        let mut newest = None;
        while let Some(&(p, t)) = self.rtt_probes.front() {
            if psn_diff(self.una, p) <= 0 {
                break;
            }
            newest = Some(t);
            self.rtt_probes.pop_front();
        }
        if let Some(t) = newest {
            let sample = now.saturating_duration_since(t);
            self.rtt_max = sample.max(self.rtt_max - self.rtt_max / 32);
            self.rto_floor -= self.rto_floor / 64;
            if self.srtt.is_zero() {
                self.srtt = sample;
                self.rttvar = sample / 2;
            } else {
                let dev = self.srtt.abs_diff(sample);
                self.rttvar = (self.rttvar * 3 + dev) / 4;
                self.srtt = (self.srtt * 7 + sample) / 8;
            }
        }
        // additive increase: about four packets per round trip
        self.cwnd_acc += psn_diff(self.una, old).max(0) as u32;
        let step = (self.cwnd / 4).max(1);
        while self.cwnd_acc >= step && self.cwnd < self.window {
            self.cwnd_acc -= step;
            self.cwnd += 1;
        }
        self.restart_timer(now);
    }
}

pub(super) enum Acked {
    Ok,
    /// A READ or atomic before the acknowledged PSN has no response: go back to it.
    Implicit,
    /// Acknowledges PSNs never sent: ignored.
    Bogus,
}

// ---------------------------------------------------------------------------- responder

/// A multi-packet message in progress at the responder.
#[derive(Clone, Copy, Debug)]
pub(super) enum InMsg {
    Write {
        va: u64,
        rkey: u32,
        len: u64,
        off: u64,
    },
    Send {
        off: u64,
    },
}

/// The responder side of a QP on the wire.
#[derive(Debug, Default)]
pub(crate) struct RespWire {
    pub(super) epsn: u32,
    pub(super) msn: u32,
    pub(super) mtu: u32,
    /// `mtu` has been lowered to the route's (at the first request).
    pub(super) route_checked: bool,
    pub(super) nak_sent: bool,
    /// The highest PSN seen out of sequence since the last sequence NAK.
    pub(super) oos_hi: u32,
    pub(super) cur: Option<InMsg>,
    pub(super) atomics: VecDeque<(u32, u64)>,
    /// READs answered and still held: a duplicate READ is served only inside one of them.
    pub(super) reads: VecDeque<HeldRead>,
    /// Selective repeat agreed with the requester: packets that arrive behind a gap are held
    /// (by PSN, as received) and run in order once the gap is filled.
    pub(super) selective: bool,
    pub(super) held: HashMap<u32, Vec<u8>>,
    /// The highest PSN held (meaningful while `held` is not empty).
    pub(super) held_hi: u32,
    /// When the gap's first sequence NAK, and its last one, were sent (selective repeat
    /// names a gap again after [`RespWire::renak_wait`] without it being filled: the NAK, the
    /// resend or the answer to it was lost).
    pub(super) first_nak: Option<Instant>,
    pub(super) last_nak: Option<Instant>,
    /// The smoothed time from a gap's first NAK to its filling (one repair: a round trip and
    /// the requester's turn).
    pub(super) repair: Duration,
    /// Where answers go: the requester's address, the reply flow and the requester's QPN, as
    /// of the last request.
    pub(super) reply_to: Option<(SocketAddr, Flow, u32)>,
}

/// The least time a gap with packets held behind it stays unfilled before the responder names
/// it again. Nothing to a path that loses nothing: without a gap it never fires.
const RENAK_MIN: Duration = Duration::from_micros(500);

/// A READ request a responder answered, held so that a duplicate of it (a retry from any of
/// its response packets) can be served again.
#[derive(Clone, Copy, Debug)]
pub(super) struct HeldRead {
    pub(super) psn: u32,
    /// Response packets (PSNs) it consumed.
    pub(super) npkts: u32,
    pub(super) va: u64,
    pub(super) rkey: u32,
    pub(super) len: u64,
}

impl HeldRead {
    /// Whether a duplicate READ (`psn`, `reth`) asks for a part of this one: its PSN inside
    /// this READ's PSN window, the same rkey, its range inside this one's, and its responses
    /// inside the window too.
    pub(super) fn covers(&self, psn: u32, reth: &Reth, mtu: u64) -> bool {
        let k = psn_diff(psn, self.psn);
        if k < 0 || k as u32 >= self.npkts || reth.rkey != self.rkey {
            return false;
        }
        let len = reth.len as u64;
        let count = len.div_ceil(mtu.max(1)).max(1);
        let end = self.va.saturating_add(self.len);
        reth.va >= self.va
            && reth.va.checked_add(len).is_some_and(|e| e <= end)
            && k as u64 + count <= self.npkts as u64
    }
}

impl RespWire {
    pub(crate) fn new(rq_psn: u32, mtu: u32, selective: bool) -> Self {
        Self {
            epsn: rq_psn & MASK24,
            mtu,
            selective,
            ..Self::default()
        }
    }

    /// How long a gap may stay unfilled after its last NAK before it is named again: three
    /// repairs as measured, at least [`RENAK_MIN`].
    pub(super) fn renak_wait(&self) -> Duration {
        (self.repair * 3).max(RENAK_MIN)
    }

    /// A sequence NAK for the current gap is being sent.
    pub(super) fn naked(&mut self, now: Instant) {
        self.first_nak.get_or_insert(now);
        self.last_nak = Some(now);
    }

    /// The gap was filled: its repair time joins the estimate.
    pub(super) fn filled(&mut self, now: Instant) {
        if let Some(t) = self.first_nak.take() {
            let sample = now.duration_since(t);
            self.repair = if self.repair.is_zero() {
                sample
            } else {
                (self.repair * 7 + sample) / 8
            };
        }
    }

    /// Holds packet `raw` (PSN `psn`, out of sequence) until its gap is filled, unless `cap`
    /// packets are held already (it is then dropped, as without selective repeat). Returns
    /// the PSNs missing in front of it that nothing named yet, `(first, count)`: behind the
    /// expected PSN (which the sequence NAK names) when nothing was held, else behind the
    /// highest packet held; none when it was not held or falls inside what is held.
    pub(super) fn hold(&mut self, psn: u32, raw: &[u8], cap: usize) -> Option<(u32, u32)> {
        if self.held.len() >= cap || self.held.contains_key(&psn) {
            return None;
        }
        let from = if self.held.is_empty() {
            psn_add(self.epsn, 1)
        } else if psn_diff(psn, self.held_hi) > 0 {
            psn_add(self.held_hi, 1)
        } else {
            psn // inside what is held: nothing new is missing
        };
        if self.held.is_empty() || psn_diff(psn, self.held_hi) > 0 {
            self.held_hi = psn;
        }
        self.held.insert(psn, raw.to_vec());
        let missing = psn_diff(psn, from);
        (missing > 0).then_some((from, missing as u32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn held_packets_name_what_is_missing_in_front_of_them() {
        let mut w = RespWire::new(10, 4096, true);
        // The first gap: the sequence NAK names 10, the report the rest of it.
        assert_eq!(w.hold(11, b"p11", 64), None);
        let mut w2 = RespWire::new(10, 4096, true);
        assert_eq!(w2.hold(13, b"p13", 64), Some((11, 2)));
        // Behind what is held: a new gap each time a packet skips PSNs.
        assert_eq!(w.hold(12, b"p12", 64), None);
        assert_eq!(w.hold(16, b"p16", 64), Some((13, 3)));
        assert_eq!(w.hold(17, b"p17", 64), None);
        // Inside what is held (a resend, or reordered): nothing new is missing.
        assert_eq!(w.hold(14, b"p14", 64), None);
        assert_eq!(w.hold(16, b"dup", 64), None);
        assert_eq!(w.held.len(), 5);
        assert_eq!(w.held_hi, 17);
        // Past the cap: dropped, and nothing reported for it.
        assert_eq!(w.hold(30, b"p30", 5), None);
        assert!(!w.held.contains_key(&30));
        // PSNs wrap at 24 bits.
        let mut w3 = RespWire::new(MASK24, 4096, true);
        assert_eq!(w3.hold(2, b"p2", 64), Some((0, 2)));
    }

    #[test]
    fn a_gap_report_resends_what_is_in_flight_once_a_round_trip() {
        let flow = Flow {
            src: Ipv4Addr::LOCALHOST,
            dst: Ipv4Addr::LOCALHOST,
            sport: 49152,
            dport: 4791,
        };
        let mut w = ReqWire::new("127.0.0.1:4791".parse().unwrap(), flow, 7, 4096, 256, 100);
        w.selective = true;
        w.sent_hi = 200;
        w.srtt = Duration::from_millis(10);
        let now = Instant::now();
        assert!(w.resend_gap(150, 3, now));
        assert_eq!(Vec::from(w.resend.clone()), vec![150, 151, 152]);
        // The same report again within a round trip (a copy, or the gap named again before
        // the resends arrived): nothing more.
        assert!(w.resend_gap(150, 3, now));
        assert_eq!(w.resend.len(), 3);
        // A round trip later the resends were lost too: again.
        assert!(w.resend_gap(151, 1, now + Duration::from_millis(11)));
        assert_eq!(w.resend.back(), Some(&151));
        // Clipped to what is in flight; stale or never sent: nothing.
        assert!(w.resend_gap(199, 10, now));
        assert_eq!(w.resend.back(), Some(&199));
        assert_eq!(w.resend.len(), 5);
        assert!(!w.resend_gap(90, 5, now));
        assert!(!w.resend_gap(200, 1, now));
        assert!(!w.resend_gap(120, 0, now));
        assert_eq!(w.resend.len(), 5);
        // A go-back resends everything from una anyway.
        w.go_back(100, now);
        assert!(w.resend.is_empty());
    }
}
