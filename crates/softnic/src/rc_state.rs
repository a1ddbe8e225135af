//! The RC transport state of one QP, held in its SQ and RQ state: the requester's messages,
//! PSNs, window, timers and RTT estimate, and the responder's expected PSN, MSN, message in
//! progress and answer caches. Plain state and the arithmetic on it; sending and receiving
//! packets is the RC transport's ([`crate::wire`]). It stands below the QP, which embeds it
//! (`SqState::wire`, `RqState::wire`), and above the datagrams of [`crate::net`]; the
//! behaviour on it stands above the QP, in `wire`. A DC target keeps one responder state per
//! initiator that reached it on the wire ([`DcConns`]).

use crate::net::packet::{Class, Dceth, Flow, Reth, MASK24};
use crate::net::socket::TxBatch;
use crate::outcome::Fail;
use prm::parse::AtomicKind;
use prm::wqe::Sge;
use smallvec::SmallVec;
use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

/// `p + n` in 24-bit PSN space.
pub(crate) fn psn_add(p: u32, n: u32) -> u32 {
    p.wrapping_add(n) & MASK24
}

/// `a - b` in 24-bit PSN space, as a signed distance.
pub(crate) fn psn_diff(a: u32, b: u32) -> i32 {
    ((a.wrapping_sub(b) << 8) as i32) >> 8
}

/// The most PSNs a requester keeps outstanding (well inside the 2^23 half of PSN space in
/// which ordering is defined).
pub(crate) const MAX_OUTSTANDING_PSNS: i64 = 1 << 22;

/// The most PSNs a requester may have in flight ([`crate::WireConfig::window`] is capped
/// there), and so the farthest ahead of the expected PSN a responder holds a request.
pub(crate) const MAX_WINDOW: u32 = 4096;

/// Packets timed at once (`ReqWire::rtt_probes`): a window asks for an ACK about every
/// quarter window, plus one per message end.
const MAX_PROBES: usize = 64;
/// The smallest congestion window (packets).
const MIN_CWND: u32 = 16;
/// Bounds of the early retransmission timer (see [`ReqWire::fast_rto`]).
const FAST_RTO_MIN: Duration = Duration::from_millis(2);
pub(crate) const FAST_RTO_MAX: Duration = Duration::from_millis(20);
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
    /// Inline and pointer segments in WQE order (the inline bytes copied out of the WQE).
    Mixed(Vec<SrcSeg>),
    /// A source with device memory, read when the WQE was taken: each packet still checks
    /// `src`'s keys for its bytes, then takes them from `bytes`.
    Staged {
        /// The source as the WQE named it (never itself `Staged`).
        src: Box<Src>,
        /// The whole message.
        bytes: Vec<u8>,
    },
}

/// One segment of a [`Src::Mixed`].
pub(crate) enum SrcSeg {
    /// Inline bytes.
    Inline(Vec<u8>),
    /// A pointer segment, re-checked whenever a packet is built from it.
    Sge(Sge),
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
    pub(crate) idx: u16,
    pub(crate) opcode: u8,
    pub(crate) signaled: bool,
    pub(crate) solicited: bool,
    pub(crate) op: OutOp,
    pub(crate) len: u64,
    /// First PSN.
    pub(crate) psn: u32,
    /// PSNs it consumes (packets, or READ response packets); 0 for `Local`.
    pub(crate) npkts: u32,
    /// Completes with this error when it reaches the front.
    pub(crate) fail: Option<Fail>,
    /// An XRC initiator's message: the target's XRC SRQ, carried in every packet's XRCETH.
    pub(crate) xrc_srqn: Option<u32>,
}

impl OutMsg {
    pub(crate) fn end(&self) -> u32 {
        psn_add(self.psn, self.npkts)
    }
}

/// The requester side of a QP on the wire.
pub(crate) struct ReqWire {
    pub(crate) to: SocketAddr,
    pub(crate) flow: Flow,
    pub(crate) remote_qpn: u32,
    pub(crate) mtu: u32,
    pub(crate) window: u32,
    pub(crate) timeout: Option<Duration>,
    pub(crate) retry_cnt: u32,
    pub(crate) rnr_retry: u8,
    pub(crate) msgs: VecDeque<OutMsg>,
    /// Next PSN to give a new message.
    pub(crate) next_psn: u32,
    /// Oldest PSN not yet acknowledged (or answered).
    pub(crate) una: u32,
    /// Next PSN to transmit (moved back by go-back-N).
    pub(crate) send_psn: u32,
    /// One past the highest PSN transmitted.
    pub(crate) sent_hi: u32,
    pub(crate) retries: u32,
    pub(crate) rnr_retries: u32,
    /// The IBTA local ACK timeout: its expirations count against `retry_cnt`.
    pub(crate) deadline: Option<Instant>,
    /// The early retransmission timer (RTT-based, never fails the QP).
    pub(crate) fast_deadline: Option<Instant>,
    pub(crate) rnr_until: Option<Instant>,
    /// `una` and time of the last go-back (one per gap and round trip).
    pub(crate) goback: Option<(u32, Instant)>,
    /// Congestion window (packets) and its additive-increase accumulator.
    pub(crate) cwnd: u32,
    pub(crate) cwnd_acc: u32,
    /// Smoothed round-trip time and its mean deviation, and the packets being timed: every
    /// first transmission that asks for an answer (AckReq, a READ), oldest first, with its
    /// send time. Each ACK that moves `una` past some of them gives a sample (the newest it
    /// covers), so the estimate follows the queueing delay as a window fills (one probe at a
    /// time, taken while the queue is still empty, left the early timer far too short).
    pub(crate) srtt: Duration,
    pub(crate) rttvar: Duration,
    pub(crate) rtt_probes: VecDeque<(u32, Instant)>,
    /// The largest recent RTT sample (decaying): the scheduling pauses this machine has.
    pub(crate) rtt_max: Duration,
    /// The early timer's floor, doubled whenever it fired for nothing (decaying).
    pub(crate) rto_floor: Duration,
    /// When the early timer last sent its probe, until `una` moves.
    pub(crate) probed_at: Option<Instant>,
    /// Selective repeat agreed with the peer: a sequence NAK resends the packet it names
    /// alone, a gap report the packets it names (the peer holds what followed them); the
    /// IBTA timer still goes back N.
    pub(crate) selective: bool,
    /// PSNs a sequence NAK or a gap report asked for, to send before anything else.
    pub(crate) resend: VecDeque<u32>,
    /// PSNs queued for such a resend, and when (pruned to those in flight).
    pub(crate) resent: HashMap<u32, Instant>,
    /// A WQE that failed locally is queued: run no more WQEs until it completes.
    pub(crate) blocked: bool,
    /// A queued message failed while being sent: send nothing more.
    pub(crate) halted: bool,
    /// A DC initiator's connection: the DCETH every request carries.
    pub(crate) dc: Option<Dceth>,
    /// The class of its packets (DC for a DC initiator, UC for a UC QP: nothing answers, a
    /// message completes once its last packet has left).
    pub(crate) class: Class,
    /// Packets on their way out; the requester builds them in place (`Port::send_built`).
    pub(crate) batch: TxBatch,
}

impl ReqWire {
    /// A transport for the peer QP `remote_qpn` at `to` (`flow`), starting at PSN `psn`.
    pub(crate) fn new(
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
            dc: None,
            class: Class::Rc,
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

    pub(crate) fn restart_timer(&mut self, now: Instant) {
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
    pub(crate) fn fast_rto(&self) -> Duration {
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
    pub(crate) fn congestion(&mut self) {
        self.cwnd = (self.cwnd / 2).max(MIN_CWND).min(self.window);
        self.cwnd_acc = 0;
    }

    /// Index of the first message whose PSN range ends after `p`.
    pub(crate) fn find(&self, p: u32) -> usize {
        self.msgs.partition_point(|m| psn_diff(m.end(), p) <= 0)
    }

    /// Retransmits from `to` (go-back-N); the rest of the window follows.
    pub(crate) fn go_back(&mut self, to: u32, now: Instant) {
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
    pub(crate) fn probe_tail(&mut self, now: Instant) {
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
    pub(crate) fn go_back_nak(&mut self, now: Instant) {
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
    pub(crate) fn resend_nak(&mut self, now: Instant) {
        // a probe acknowledged after the gap is filled would time the gap, not the path
        self.rtt_probes.clear();
        self.queue_resend(self.una, now);
    }

    /// Selective repeat: a gap report (the responder misses PSNs `[from, from + n)` and holds
    /// the packet at `from + n`) resends each of them that is in flight, unless it was resent
    /// within the last round trip. It acknowledges nothing and cuts no window.
    ///
    /// A real report is drawn by the arrival of the packet behind the gap (or names the
    /// newest packet sent: a responder asking for a copy of a held packet nothing came
    /// after): one that names a packet behind the gap that was never sent is ignored, and so
    /// is one whose PSNs were all resent within the last round trip (each PSN is resent at
    /// most once a round trip, however many reports name it). Not done: ignoring a report
    /// that comes sooner than a round trip after the packet behind the gap left. The RTT
    /// samples time a packet to the ACK that covers it, which waits for a packet asking for
    /// one: real reports came 0.25–2 ms after the packet, while the smallest sample was 1–2
    /// ms, and such a rule ignored up to 187 real reports in 16 MiB at 5% loss and halved
    /// the throughput.
    pub(crate) fn resend_gap(&mut self, from: u32, n: u32, now: Instant) -> GapReport {
        let in_flight = psn_diff(self.sent_hi, self.una).max(0) as u32;
        let k = psn_diff(from, self.una);
        if n == 0 || k < 0 || k as u32 >= in_flight {
            return GapReport::NotInFlight;
        }
        // The packet behind the gap, whose arrival drew the report, was sent (or the report
        // names the newest packet sent: a responder asking for a copy of a held packet that
        // nothing came after).
        if psn_diff(psn_add(from, n), self.sent_hi) > 0 {
            return GapReport::Ignored;
        }
        self.rtt_probes.clear();
        let mut queued = false;
        for i in 0..n.min(in_flight - k as u32) {
            queued |= self.queue_resend(psn_add(from, i), now);
        }
        if queued {
            GapReport::Acted
        } else {
            GapReport::Ignored
        }
    }

    /// Queues PSN `p` for a resend unless it was queued within the last round trip (the
    /// responder names a gap again while more packets arrive behind it; once more a round
    /// trip after the resend means the resend was lost too).
    fn queue_resend(&mut self, p: u32, now: Instant) -> bool {
        let rtt = self.srtt.max(Duration::from_micros(50));
        if self
            .resent
            .get(&p)
            .is_some_and(|t| now.duration_since(*t) < rtt)
        {
            return false;
        }
        if self.resent.len() >= 2 * self.window.max(64) as usize {
            let una = self.una;
            self.resent.retain(|&q, _| psn_diff(q, una) >= 0);
        }
        self.resent.insert(p, now);
        self.resend.push_back(p);
        true
    }

    /// Goes back to `una` for a missing response, once per gap and round trip (the
    /// responses after one loss arrive together).
    pub(crate) fn go_back_once(&mut self, now: Instant) {
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
    pub(crate) fn fail_at(&mut self, p: u32, f: Fail) {
        let i = self.find(p).min(self.msgs.len().saturating_sub(1));
        if let Some(m) = self.msgs.get_mut(i) {
            m.fail.get_or_insert(f);
        }
        self.halted = true;
    }

    /// Acknowledges every PSN before `to`. Stops at a READ or atomic still missing its
    /// responses: those PSNs are acknowledged only by the responses themselves.
    pub(crate) fn ack_to(&mut self, to: u32, now: Instant) -> Acked {
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
    pub(crate) fn probe(&mut self, p: u32, now: Instant) {
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
    pub(crate) fn progress(&mut self, old: u32, now: Instant) {
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

/// What a gap report led to ([`ReqWire::resend_gap`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum GapReport {
    /// Its PSNs in flight were queued for a resend.
    Acted,
    /// It names PSNs in flight, but came too soon to be real or repeats one acted on within
    /// the last round trip.
    Ignored,
    /// It names nothing in flight (stale, or never sent).
    NotInFlight,
}

pub(crate) enum Acked {
    Ok,
    /// A READ or atomic before the acknowledged PSN has no response: go back to it.
    Implicit,
    /// Acknowledges PSNs never sent: ignored.
    Bogus,
}

// ---------------------------------------------------------------------------- responder

/// A multi-packet message in progress at the responder.
#[derive(Clone, Copy, Debug)]
pub(crate) enum InMsg {
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
    pub(crate) epsn: u32,
    pub(crate) msn: u32,
    pub(crate) mtu: u32,
    /// `mtu` has been lowered to the route's (at the first request).
    pub(crate) route_checked: bool,
    pub(crate) nak_sent: bool,
    /// The highest PSN seen out of sequence since the last sequence NAK.
    pub(crate) oos_hi: u32,
    pub(crate) cur: Option<InMsg>,
    pub(crate) atomics: VecDeque<(u32, u64)>,
    /// READs answered and still held: a duplicate READ is served only inside one of them.
    pub(crate) reads: VecDeque<HeldRead>,
    /// Selective repeat agreed with the requester: packets that arrive behind a gap are held
    /// (by PSN, as received) and run in order once the gap is filled.
    pub(crate) selective: bool,
    pub(crate) held: HashMap<u32, Held>,
    /// The highest PSN held and the PSN that follows it (past every PSN a held READ
    /// consumes); meaningful while `held` is not empty.
    pub(crate) held_hi: u32,
    pub(crate) held_next: u32,
    /// The UDP source port of the requester's flow, as of its last request taken in
    /// sequence: a soft NIC sends a QP's requests from one port, and only packets from it
    /// are held.
    pub(crate) sport: Option<u16>,
    /// When the gap's first sequence NAK, and its last one, were sent (selective repeat
    /// names a gap again after [`RespWire::renak_wait`] without it being filled: the NAK, the
    /// resend or the answer to it was lost).
    pub(crate) first_nak: Option<Instant>,
    pub(crate) last_nak: Option<Instant>,
    /// Gap NAKs sent again by the timer since the last progress (each doubles the wait).
    pub(crate) renaks: u32,
    /// The smoothed time from a gap's first NAK to its filling (one repair: a round trip and
    /// the requester's turn).
    pub(crate) repair: Duration,
    /// Where answers go: the connected peer's address (its peer-table entry, or its GID's
    /// address at the default port, as for the requester), the reply flow and the
    /// requester's QPN; decided at the first request.
    pub(crate) reply_to: Option<(SocketAddr, Flow, u32)>,
}

/// A request held behind a gap (selective repeat).
#[derive(Debug)]
pub(crate) struct Held {
    /// The datagram as received.
    pub(crate) raw: Vec<u8>,
    /// PSNs it consumes (a READ's response packets; 1 otherwise).
    pub(crate) npkts: u32,
    /// Something vouches for it (see [`RespWire::hold`]); an untrusted packet does not run.
    pub(crate) trusted: bool,
}

/// Whether two request datagrams carry the same request: the same bytes but for the BTH's
/// AckReq bit and FECN/BECN byte (a resend may ask for an ACK the first copy did not) and the
/// ICRC (it covers the IPv4 identification, which differs between copies).
pub(crate) fn same_request(a: &[u8], b: &[u8]) -> bool {
    const BTH_LEN: usize = crate::net::packet::BTH_LEN;
    const ICRC_LEN: usize = crate::net::packet::ICRC_LEN;
    if a.len() != b.len() || a.len() < BTH_LEN + ICRC_LEN {
        return false;
    }
    let n = a.len() - ICRC_LEN;
    a[..4] == b[..4] && a[5..8] == b[5..8] && a[8] & 0x7f == b[8] & 0x7f && a[9..n] == b[9..n]
}

/// What a request ahead of the expected PSN meets among the held packets.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Hold {
    /// Held; the PSNs missing in front of it that nothing named yet, `(first, count)`.
    New(Option<(u32, u32)>),
    /// A copy of the packet held with that PSN (now trusted: the requester sent it again).
    Copy,
    /// A different packet held with the same PSN: forged or corrupted. Both are dropped.
    Conflict,
}

/// The least time a gap with packets held behind it stays unfilled before the responder names
/// it again. Nothing to a path that loses nothing: without a gap it never fires.
const RENAK_MIN: Duration = Duration::from_micros(500);

/// The least time a run of held packets at the expected PSN waits to be vouched for before
/// the responder asks for a copy ([`RespWire::copy_wait`]).
const COPY_WAIT_MIN: Duration = Duration::from_micros(100);

/// A READ request a responder answered, held so that a duplicate of it (a retry from any of
/// its response packets) can be served again.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeldRead {
    pub(crate) psn: u32,
    /// Response packets (PSNs) it consumed.
    pub(crate) npkts: u32,
    pub(crate) va: u64,
    pub(crate) rkey: u32,
    pub(crate) len: u64,
}

impl HeldRead {
    /// Whether a duplicate READ (`psn`, `reth`) asks for a part of this one: its PSN inside
    /// this READ's PSN window, the same rkey, its range inside this one's, and its responses
    /// inside the window too.
    pub(crate) fn covers(&self, psn: u32, reth: &Reth, mtu: u64) -> bool {
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
    pub(crate) fn renak_wait(&self) -> Duration {
        (self.repair * 3).max(RENAK_MIN)
    }

    /// How long a run of held packets at the expected PSN waits to be vouched for before the
    /// responder asks for a copy of its newest packet: while packets flow the next one vouches
    /// within microseconds; when none comes the requester has stopped (its window full, or
    /// nothing more to send). Half a repair, at least [`COPY_WAIT_MIN`].
    pub(crate) fn copy_wait(&self) -> Duration {
        (self.repair / 2).max(COPY_WAIT_MIN)
    }

    /// A sequence NAK for the current gap is being sent.
    pub(crate) fn naked(&mut self, now: Instant) {
        self.first_nak.get_or_insert(now);
        self.last_nak = Some(now);
    }

    /// The gap was filled: its repair time joins the estimate.
    pub(crate) fn filled(&mut self, now: Instant) {
        if let Some(t) = self.first_nak.take() {
            let sample = now.duration_since(t);
            self.repair = if self.repair.is_zero() {
                sample
            } else {
                (self.repair * 7 + sample) / 8
            };
        }
    }

    /// The first PSN from the expected one on that is not held: the end of the run of held
    /// packets that starts at the expected PSN (the expected PSN itself while it is missing).
    pub(crate) fn frontier(&self) -> u32 {
        let mut p = self.epsn;
        while let Some(h) = self.held.get(&p) {
            p = psn_add(p, h.npkts.max(1));
        }
        p
    }

    /// The first PSN of the newest packet of the run of held packets at the expected PSN.
    pub(crate) fn run_last(&self) -> u32 {
        let (mut p, mut last) = (self.epsn, self.epsn);
        while let Some(h) = self.held.get(&p) {
            last = p;
            p = psn_add(p, h.npkts.max(1));
        }
        last
    }

    /// Whether the packet held at the expected PSN waits to be vouched for: its gap is
    /// filled, but nothing has vouched for it yet.
    pub(crate) fn unconfirmed(&self) -> bool {
        self.held.get(&self.epsn).is_some_and(|h| !h.trusted)
    }

    /// Holds request `raw` (PSN `psn`, ahead of the expected one and inside the hold window;
    /// it consumes `npkts` PSNs).
    ///
    /// Forgery is what this guards against: a packet held ahead runs later in place of the
    /// real one, which then counts as a duplicate. So a held packet runs only when something
    /// vouches for it:
    /// - a copy of it (the requester sent it again: [`Hold::Copy`]); a different packet with
    ///   the PSN of a held one is a forgery or a corruption, and both are dropped
    ///   ([`Hold::Conflict`]; the requester resends that PSN);
    /// - its arrival at the frontier ([`RespWire::frontier`]) while the expected packet is
    ///   held: that exact PSN is as hard to guess as the expected one;
    /// - a request that arrives at or past the frontier while the run of held packets at the
    ///   expected PSN waits: the requester sent everything before it first, so a forged
    ///   packet in that run would have met its real twin (a conflict) before.
    ///
    /// A packet that opens or sits behind a gap is held untrusted; once its gap is filled it
    /// waits for one of the above. What this leaves to a blind forger is a packet in a hole
    /// whose real packet was lost (or reordered) too.
    pub(crate) fn hold(&mut self, psn: u32, npkts: u32, raw: &[u8]) -> Hold {
        // the run at the expected PSN that waits, if any, and its end
        let end = self.unconfirmed().then(|| self.frontier());
        let vouches = end.is_some_and(|e| psn_diff(psn, e) >= 0);
        let out = if let Some(h) = self.held.get_mut(&psn) {
            if !same_request(&h.raw, raw) {
                self.held.remove(&psn);
                return Hold::Conflict;
            }
            h.trusted = true;
            // The requester sent it again, so the held copy is real, and it arrived after
            // the real packets before it: any of them forged would have met its real twin.
            for (_, h) in self.held.iter_mut().filter(|(&q, _)| psn_diff(q, psn) < 0) {
                h.trusted = true;
            }
            Hold::Copy
        } else {
            let from = if self.held.is_empty() {
                psn_add(self.epsn, 1)
            } else if psn_diff(psn, self.held_hi) > 0 {
                self.held_next
            } else {
                psn // inside what is held: nothing new is missing
            };
            if self.held.is_empty() || psn_diff(psn, self.held_hi) > 0 {
                self.held_hi = psn;
                self.held_next = psn_add(psn, npkts.max(1));
            }
            self.held.insert(
                psn,
                Held {
                    raw: raw.to_vec(),
                    npkts,
                    trusted: end == Some(psn),
                },
            );
            let missing = psn_diff(psn, from);
            Hold::New((missing > 0).then_some((from, missing as u32)))
        };
        if let (true, Some(end)) = (vouches, end) {
            let mut p = self.epsn;
            while p != end {
                let Some(h) = self.held.get_mut(&p) else {
                    break;
                };
                h.trusted = true;
                p = psn_add(p, h.npkts.max(1));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    /// A request datagram of 20 bytes: PSN `psn`, payload byte `fill`.
    fn req(psn: u32, fill: u8) -> Vec<u8> {
        let mut v = vec![fill; 20];
        v[8..12].copy_from_slice(&psn.to_be_bytes());
        v
    }

    fn trusted(w: &RespWire, psn: u32) -> Option<bool> {
        w.held.get(&psn).map(|h| h.trusted)
    }

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
    fn held_packets_name_what_is_missing_in_front_of_them() {
        let mut w = RespWire::new(10, 4096, true);
        // The first gap: the sequence NAK names 10, the report the rest of it.
        assert_eq!(w.hold(11, 1, &req(11, 1)), Hold::New(None));
        let mut w2 = RespWire::new(10, 4096, true);
        assert_eq!(w2.hold(13, 1, &req(13, 1)), Hold::New(Some((11, 2))));
        // Behind what is held: a new gap each time a packet skips PSNs.
        assert_eq!(w.hold(12, 1, &req(12, 1)), Hold::New(None));
        assert_eq!(w.hold(16, 1, &req(16, 1)), Hold::New(Some((13, 3))));
        assert_eq!(w.hold(17, 1, &req(17, 1)), Hold::New(None));
        // Inside what is held (a resend, or reordered): nothing new is missing.
        assert_eq!(w.hold(14, 1, &req(14, 1)), Hold::New(None));
        assert_eq!(w.hold(16, 1, &req(16, 1)), Hold::Copy);
        assert_eq!(w.held.len(), 5);
        assert_eq!(w.held_hi, 17);
        // A held READ consumes its PSNs: the next request follows them.
        assert_eq!(w.hold(18, 4, &req(18, 1)), Hold::New(None));
        assert_eq!(w.hold(22, 1, &req(22, 1)), Hold::New(None));
        assert_eq!(w.hold(24, 1, &req(24, 1)), Hold::New(Some((23, 1))));
        // PSNs wrap at 24 bits.
        let mut w3 = RespWire::new(MASK24, 4096, true);
        assert_eq!(w3.hold(2, 1, &req(2, 1)), Hold::New(Some((0, 2))));
    }

    #[test]
    fn held_packets_run_only_when_vouched_for() {
        // A loss at 10: 11..=14 arrive and are held, none trusted (each sits behind a gap).
        let mut w = RespWire::new(10, 4096, true);
        for p in 11..=14 {
            w.hold(p, 1, &req(p, 1));
        }
        assert!((11..=14).all(|p| trusted(&w, p) == Some(false)));
        assert_eq!(w.frontier(), 10);
        // The resend of 10 ran: 11 waits, the run 11..=14 ends at 15.
        w.epsn = 11;
        assert!(w.unconfirmed());
        assert_eq!(w.frontier(), 15);
        // 15 arrives: at the frontier, so trusted itself, and it vouches for 11..=14.
        assert_eq!(w.hold(15, 1, &req(15, 1)), Hold::New(None));
        assert!((11..=15).all(|p| trusted(&w, p) == Some(true)));
        assert!(!w.unconfirmed());

        // A packet past the frontier vouches for the run too, but not for itself.
        let mut w = RespWire::new(10, 4096, true);
        for p in [11, 12, 20] {
            w.hold(p, 1, &req(p, 1));
        }
        w.epsn = 11;
        assert_eq!(w.hold(25, 1, &req(25, 1)), Hold::New(Some((21, 4))));
        assert_eq!(trusted(&w, 11), Some(true));
        assert_eq!(trusted(&w, 12), Some(true));
        assert_eq!(trusted(&w, 20), Some(false));
        assert_eq!(trusted(&w, 25), Some(false));

        // A copy of a held packet makes it trusted, and every held packet before it (the
        // requester sent them first): the requester's resend of its newest packet vouches for
        // a whole run, holes and all.
        let mut w = RespWire::new(10, 4096, true);
        for p in [11, 13, 14, 16] {
            w.hold(p, 1, &req(p, 1));
        }
        assert_eq!(w.hold(12, 1, &req(12, 1)), Hold::New(None));
        w.epsn = 11;
        assert_eq!(trusted(&w, 11), Some(false));
        assert_eq!(w.hold(14, 1, &req(14, 1)), Hold::Copy);
        assert!((11..=14).all(|p| trusted(&w, p) == Some(true)));
        assert_eq!(trusted(&w, 16), Some(false));
        let mut w = RespWire::new(10, 4096, true);
        w.hold(11, 1, &req(11, 1));
        w.epsn = 11;
        assert_eq!(w.run_last(), 11);
        // the copy may ask for an ACK and carries another ICRC: still the same request
        let mut copy = req(11, 1);
        copy[8] |= 0x80;
        copy[19] ^= 0xff;
        assert_eq!(w.hold(11, 1, &copy), Hold::Copy);
        assert_eq!(trusted(&w, 11), Some(true));
    }

    #[test]
    fn a_forged_run_never_vouches_for_itself() {
        // A forger's run 40..=45 lands ahead of a stream with nothing lost.
        let mut w = RespWire::new(10, 4096, true);
        for p in 40..=45 {
            w.hold(p, 1, &req(p, 0xee));
        }
        assert!((40..=45).all(|p| trusted(&w, p) == Some(false)));
        // The real stream runs in sequence up to 39: 40 waits.
        w.epsn = 40;
        assert!(w.unconfirmed());
        // The real 41 (40 is handled in sequence) meets its forged twin: both dropped.
        assert_eq!(w.hold(41, 1, &req(41, 1)), Hold::Conflict);
        assert!(!w.held.contains_key(&41));
        // The forged 40 still waits: nothing real vouched for it (41 was a conflict).
        assert_eq!(trusted(&w, 40), Some(false));
        // A different packet with a held PSN is a conflict however it differs.
        let mut other = req(43, 0xee);
        other[15] = 0;
        assert_eq!(w.hold(43, 1, &other), Hold::Conflict);
    }

    #[test]
    fn copies_are_the_same_request_but_for_ackreq_ecn_and_icrc() {
        let a = req(5, 3);
        let mut b = a.clone();
        b[4] = 0xc0; // FECN, BECN
        b[8] |= 0x80; // AckReq
        b[16..].copy_from_slice(&[1, 2, 3, 4]); // ICRC
        assert!(same_request(&a, &b));
        for i in [0, 5, 9, 12, 15] {
            let mut c = a.clone();
            c[i] ^= 1;
            assert!(!same_request(&a, &c), "byte {i}");
        }
        assert!(!same_request(&a, &a[..19]));
        assert!(!same_request(&a[..10], &a[..10]));
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
        use GapReport::*;
        assert_eq!(w.resend_gap(150, 3, now), Acted);
        assert_eq!(Vec::from(w.resend.clone()), vec![150, 151, 152]);
        // The same report again within a round trip (a copy, or the gap named again before
        // the resends arrived): nothing more.
        assert_eq!(w.resend_gap(150, 3, now), Ignored);
        assert_eq!(w.resend.len(), 3);
        // A round trip later the resends were lost too: again.
        assert_eq!(w.resend_gap(151, 1, now + Duration::from_millis(11)), Acted);
        assert_eq!(w.resend.back(), Some(&151));
        // Clipped to what is in flight; the packet behind the gap must have been sent.
        assert_eq!(w.resend_gap(197, 2, now), Acted);
        assert_eq!(w.resend.back(), Some(&198));
        assert_eq!(w.resend.len(), 6);
        // The newest packet sent may be named (a responder asking for a copy of it), but
        // nothing past it.
        assert_eq!(w.resend_gap(199, 1, now), Acted);
        assert_eq!(w.resend.back(), Some(&199));
        assert_eq!(w.resend_gap(197, 5, now), Ignored);
        assert_eq!(w.resend_gap(100, 10, now), Acted);
        assert_eq!(w.resend.len(), 17);
        // Stale or never sent: nothing.
        assert_eq!(w.resend_gap(90, 5, now), NotInFlight);
        assert_eq!(w.resend_gap(200, 1, now), NotInFlight);
        assert_eq!(w.resend_gap(120, 0, now), NotInFlight);
        assert_eq!(w.resend.len(), 17);
        // A go-back resends everything from una anyway.
        w.go_back(100, now);
        assert!(w.resend.is_empty());
    }
}

/// The most initiators a DC target keeps responder state for; the oldest connection is
/// forgotten beyond (its initiator's next request starts it again, or it times out).
pub(crate) const MAX_DC_CONNS: usize = 4096;

/// A DC target's responder state for one initiator: as an RC QP's RQ state on the wire (the
/// expected PSN, MSN, message in progress, answer caches, and the SRQ WQE a SEND in progress
/// holds), for the initiator's current connection.
pub(crate) struct DcConn {
    pub(crate) generation: u32,
    pub(crate) wire: RespWire,
    pub(crate) srq_wqe: Option<u16>,
}

/// A DC target's connections, by initiator (source address, initiator QPN).
#[derive(Default)]
pub(crate) struct DcConns {
    conns: HashMap<(Ipv4Addr, u32), DcConn>,
    order: VecDeque<(Ipv4Addr, u32)>,
}

impl DcConns {
    /// The state of the connection a request's DCETH names: a new one when the initiator
    /// moved on (a later generation: it starts at the DCETH's start PSN), `None` for a request
    /// of an earlier connection (dropped, as a stale duplicate).
    pub(crate) fn conn(&mut self, from: Ipv4Addr, e: &Dceth, mtu: u32) -> Option<&mut DcConn> {
        let id = (from, e.dci);
        let fresh = || DcConn {
            generation: e.generation,
            wire: RespWire::new(e.start_psn, mtu, false),
            srq_wqe: None,
        };
        match self
            .conns
            .get(&id)
            .map(|c| e.generation.wrapping_sub(c.generation) as i32)
        {
            Some(0) => {}
            Some(d) if d < 0 => return None,
            Some(_) => {
                self.conns.insert(id, fresh());
            }
            None => {
                if self.order.len() >= MAX_DC_CONNS {
                    if let Some(old) = self.order.pop_front() {
                        self.conns.remove(&old);
                    }
                }
                self.order.push_back(id);
                self.conns.insert(id, fresh());
            }
        }
        self.conns.get_mut(&id)
    }

    /// Forgets every connection (the target was reset or destroyed).
    pub(crate) fn clear(&mut self) {
        self.conns.clear();
        self.order.clear();
    }
}
