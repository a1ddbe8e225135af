//! The CPU initiator of the latency tests: one host thread drives this process's sides in turn
//! ([`Poster`], [`run_cpu`]) and times each round trip with the monotonic clock.

use super::report::Ran;
use super::side::{pad, tail_len, tail_of_word, tail_value, Side, Target};
use crate::bw::{atomic_value, AtomicOp, Verb};
use crate::{CommonArgs, Payload};
use anyhow::{bail, Context as _, Result};
use gpuverbs::post::{Completion, CpuInitiator, CtrlFlags, InitiatorError, Local, Op, RemoteAddr};
use gpuverbs::HostBuffer;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// One side driven by the CPU: its initiator, its buffers, and where its messages go.
pub(super) struct Poster<'a> {
    pub(super) ini: &'a mut CpuInitiator,
    pub(super) side: &'a Side,
    pub(super) to: &'a Target,
    /// The side's receive buffer and signal word, which the CPU polls with host atomics.
    pub(super) recv: &'a HostBuffer,
    pub(super) sig: &'a HostBuffer,
}

impl<'a> Poster<'a> {
    pub(super) fn new(ini: &'a mut CpuInitiator, side: &'a Side, to: &'a Target) -> Result<Self> {
        // check_placement keeps GPU memory from the CPU initiator.
        let host = |p: &'a Payload| {
            p.host()
                .context("the CPU initiator polls host memory only (--mem host)")
        };
        Ok(Self {
            ini,
            side,
            to,
            recv: host(&side.recv)?,
            sig: host(&side.sig)?,
        })
    }
}

/// Takes the send completions there are; an error completion ends the run.
pub(super) fn reap(ini: &mut CpuInitiator) -> Result<()> {
    while let Some(c) = ini.poll_send() {
        match c {
            Completion::Req { .. } => {}
            Completion::Error(e) => bail!("a completion carries an error: {e}"),
            other => bail!("unexpected completion on the send CQ: {other:?}"),
        }
    }
    Ok(())
}

/// What every round trip of a size shares: the sides' numbers, the verb, the size and where
/// its payload and tail lie, the count (and duration), the options, and the waits.
struct Trip<'a> {
    /// The side number of each poster.
    ids: &'a [usize],
    verb: Verb,
    size: u64,
    total: u32,
    duration: Option<Duration>,
    signal: bool,
    inline: bool,
    cq_mod: u32,
    /// The payload's offset in its buffers ([`pad`]).
    p: u64,
    /// Bytes of the tail that carries the iteration number.
    tl: usize,
    /// The receive buffer's last word, which holds the tail.
    word_off: usize,
    wait: Duration,
    /// Polls after which a wait gives the CPU away.
    yield_after: u32,
    /// READ and atomics: side B's NIC answers.
    one_sided: bool,
}

/// What the round trips of a size did: side A's round trips (counted runs), what each side
/// sent, and with -D when the timed part began and ended, its round trips and the last one's
/// end.
struct Trips {
    rtt: Vec<u64>,
    sent: [u64; 2],
    timed_from: Option<(Instant, Instant)>,
    timed: u64,
    last: Instant,
}

/// The CPU initiator: `posters` are the sides of this process (numbers `ids`: both in loopback,
/// driven in turn by one thread; one across processes). Side A sends iteration k and waits for
/// the answer; side B waits for it and answers. With `duration` (-D) the `total` iterations
/// are the warm-up and a timed part follows until the duration has passed on this process's
/// clock (the waits for the peer end there). `inline`: the payload travels inside the WQE
/// (`-I`), copied from the source buffer.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_cpu(
    posters: &mut [Poster<'_>],
    ids: &[usize],
    verb: Verb,
    size: u64,
    total: u32,
    duration: Option<Duration>,
    signal: bool,
    inline: bool,
    a: &CommonArgs,
) -> Result<Ran> {
    let mut inline_bytes = vec![0u8; if inline { size as usize } else { 0 }];
    let p = pad(size);
    let trip = Trip {
        ids,
        verb,
        size,
        total,
        duration,
        signal,
        inline,
        cq_mod: a.cq_mod,
        p,
        tl: tail_len(size),
        word_off: (p + size - 8) as usize,
        wait: a.wait(),
        // Across processes the waits give the CPU away after a short spin: the peer's packets
        // are handled by this process's device threads, which need a core (a 2-core machine
        // runs six busy threads here).
        yield_after: if a.loopback { u32::MAX } else { 64 },
        one_sided: matches!(verb, Verb::Read | Verb::Atomic(_)),
    };
    // Where side A is among the posters (it times the round trips).
    let a_at = ids.iter().position(|&i| i == 0);

    // SEND: each side's first receive, before anything is sent.
    if verb == Verb::Send {
        for pst in posters.iter_mut() {
            pst.ini
                .post_recv(&[pst.side.recv_mr.sge(p, size as u32)])
                .context("post a receive")?;
        }
    }
    let t = trip.round_trips(posters, &mut inline_bytes)?;
    // After a duration the last WQEs may be unsignaled: a signaled NOP retires them.
    if duration.is_some() {
        for p in posters.iter_mut().filter(|p| p.ini.outstanding() > 0) {
            p.ini
                .post(&Op::Nop, CtrlFlags::SIGNALED)
                .context("post the closing NOP")?;
            p.ini.ring();
        }
    }
    trip.drain(posters)?;
    let mut by_side = [None; 2];
    for &i in ids {
        by_side[i] = Some(t.sent[i]);
    }
    Ok(Ran {
        rtt: a_at.filter(|_| duration.is_none()).map(|_| t.rtt),
        sent: by_side,
        timed: t
            .timed_from
            .filter(|_| a_at.is_some())
            .map(|(from, _)| (t.timed, t.last.duration_since(from).as_nanos() as u64)),
    })
}

impl Trip<'_> {
    /// The round trips: `total` iterations (the warm-up with -D, then until the duration has
    /// passed); side A sends, side B waits and answers, side A waits for the answer (a READ's
    /// or atomic's completion).
    fn round_trips(&self, posters: &mut [Poster<'_>], inline_bytes: &mut [u8]) -> Result<Trips> {
        let at = |side: usize| self.ids.iter().position(|&i| i == side);
        let (a_at, b_at) = (at(0), at(1));
        let mut rtt = Vec::with_capacity(self.total as usize);
        let mut sent = [0u64; 2];
        // With -D: when the timed part began and ends, its round trips, the last one's end.
        let mut timed_from: Option<(Instant, Instant)> = None;
        let (mut timed, mut last) = (0u64, Instant::now());
        for k in 0.. {
            if k == self.total as u64 {
                let Some(d) = self.duration else { break };
                let now = Instant::now();
                timed_from = Some((now, now + d));
                last = now;
            }
            let deadline = timed_from.map(|(_, end)| end);
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            let k1 = k + 1;
            let t0 = Instant::now();
            if let Some(ia) = a_at {
                self.send(posters, ia, k1, inline_bytes)?;
                sent[0] += 1;
            }
            if let Some(ib) = b_at.filter(|_| !self.one_sided) {
                if !self.arrived(posters, ib, k1, deadline)? {
                    break;
                }
                self.send(posters, ib, k1, inline_bytes)?;
                sent[1] += 1;
            }
            if let Some(ia) = a_at {
                // A READ's or atomic's completion does not wait for the peer's program.
                if !self.arrived(posters, ia, k1, deadline.filter(|_| !self.one_sided))? {
                    break;
                }
                if timed_from.is_some() {
                    timed += 1;
                    last = Instant::now();
                } else {
                    rtt.push(t0.elapsed().as_nanos() as u64);
                }
            }
            if k % 64 == 63 {
                for p in posters.iter_mut() {
                    reap(p.ini)?;
                }
            }
        }
        Ok(Trips {
            rtt,
            sent,
            timed_from,
            timed,
            last,
        })
    }

    /// Posts the payload of poster `i` for iteration number k1 (READ, atomics: side A's READ
    /// or atomic of iteration k1 - 1).
    fn send(
        &self,
        posters: &mut [Poster<'_>],
        i: usize,
        k1: u64,
        inline_bytes: &mut [u8],
    ) -> Result<()> {
        let (verb, size, p, tl) = (self.verb, self.size, self.p, self.tl);
        let Poster {
            ini, side: s, to, ..
        } = &mut posters[i];
        if !self.one_sided {
            s.src
                .write((p + size) as usize - tl, &k1.to_le_bytes()[..tl])?;
        }
        // One CQE per --cq-mod iterations, and for the last of a counted run (so that every
        // WQE completes; after a duration a signaled NOP follows); READ and atomics: every one
        // (the initiator waits for it).
        let sig = self.one_sided || k1 % self.cq_mod as u64 == 0 || k1 == self.total as u64;
        let flags = |on: bool| {
            if on {
                CtrlFlags::SIGNALED
            } else {
                CtrlFlags::default()
            }
        };
        let sge = [s.src_mr.sge(p, size as u32)];
        let rsge = [s.recv_mr.sge(p, size as u32)];
        let local = if self.inline {
            s.src.read(p as usize, inline_bytes)?;
            Local::Inline(inline_bytes)
        } else {
            Local::Sges(&sge)
        };
        let write = Op::Write {
            remote: RemoteAddr {
                addr: to.recv.addr + p,
                rkey: to.recv.rkey,
            },
            local,
            imm: None,
        };
        let add = Op::FetchAdd {
            remote: to.sig,
            add: 1,
            result: s.result_mr.sge(0, 8),
        };
        let k = k1 - 1;
        let other = match verb {
            Verb::Send => Op::Send { local, imm: None },
            Verb::Read => Op::Read {
                remote: RemoteAddr {
                    addr: to.src.addr + p,
                    rkey: to.src.rkey,
                },
                local: &rsge,
            },
            Verb::Atomic(AtomicOp::FetchAdd) => Op::FetchAdd {
                remote: to.sig,
                add: 1,
                result: s.fetch_mr.sge(0, 8),
            },
            Verb::Atomic(AtomicOp::CmpSwap) => Op::CompareSwap {
                remote: to.sig,
                compare: atomic_value(0, k),
                swap: atomic_value(0, k + 1),
                result: s.fetch_mr.sge(0, 8),
            },
            Verb::Write => Op::Nop,
        };
        let ops: &[(&Op<'_>, CtrlFlags)] = match verb {
            Verb::Write if self.signal => &[(&write, flags(false)), (&add, flags(sig))],
            Verb::Write => &[(&write, flags(sig))],
            _ => &[(&other, flags(sig))],
        };
        self.post(ini, ops)
    }

    /// Posts `ops` (reaping completions while the SQ is full, for at most the wait) and rings
    /// the doorbell once.
    fn post(&self, ini: &mut CpuInitiator, ops: &[(&Op<'_>, CtrlFlags)]) -> Result<()> {
        let wait = self.wait;
        let start = Instant::now();
        for (op, f) in ops {
            loop {
                match ini.post(op, *f) {
                    Ok(_) => break,
                    Err(InitiatorError::SqFull { .. }) => {
                        reap(ini)?;
                        if start.elapsed() > wait {
                            bail!("the send queue stayed full for {wait:?}");
                        }
                    }
                    Err(e) => {
                        return Err(e).with_context(|| format!("post a {}", self.verb.title()))
                    }
                }
            }
        }
        ini.ring();
        Ok(())
    }

    /// Waits until poster `i`'s side has received iteration number k1: false when `deadline`
    /// (the duration's end) passed first.
    fn arrived(
        &self,
        posters: &mut [Poster<'_>],
        i: usize,
        k1: u64,
        deadline: Option<Instant>,
    ) -> Result<bool> {
        let (me, wait) = (self.ids[i], self.wait);
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let s = &mut posters[i];
            if self.done(s, me, k1)? {
                if let (Verb::Atomic(op), Some(f)) = (self.verb, s.side.fetch.host()) {
                    let got = f.atomic_u64(0).load(Ordering::Acquire);
                    let want = atomic_value(0, k1 - 1);
                    if got != want {
                        bail!(
                            "side A's {} {} fetched {got:#018x}, expected {want:#018x}",
                            op.name(),
                            k1 - 1
                        );
                    }
                }
                return Ok(true);
            }
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 {
                for p in posters.iter_mut() {
                    reap(p.ini)?;
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(false);
                }
                if start.elapsed() > wait {
                    bail!(
                        "side {} waited {wait:?} for iteration {k1}: nothing arrived",
                        ["A", "B"][me]
                    );
                }
            }
            if spins >= self.yield_after {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Whether poster `s` (side `me`) has iteration number k1: WRITE's tail or signal word,
    /// SEND's receive completion (the next receive posted), a READ's or atomic's completion.
    fn done(&self, s: &mut Poster<'_>, me: usize, k1: u64) -> Result<bool> {
        let (size, p, tl) = (self.size, self.p, self.tl);
        Ok(match self.verb {
            Verb::Write if self.signal => s.sig.atomic_u64(0).load(Ordering::Acquire) >= k1,
            Verb::Write => {
                let w = s.recv.atomic_u64(self.word_off).load(Ordering::Acquire);
                tail_of_word(w, tl) == tail_value(k1, tl)
            }
            Verb::Send => match s.ini.poll_recv() {
                None => false,
                Some(Completion::Resp { byte_cnt, .. }) if byte_cnt as u64 == size => {
                    // The next message's receive (none after the last of a counted run).
                    if self.duration.is_some() || k1 < self.total as u64 {
                        s.ini
                            .post_recv(&[s.side.recv_mr.sge(p, size as u32)])
                            .context("post a receive")?;
                    }
                    true
                }
                Some(Completion::Resp { byte_cnt, .. }) => bail!(
                    "side {}: receive {k1} took {byte_cnt} B, the message has {size}",
                    ["A", "B"][me]
                ),
                Some(Completion::Error(e)) => {
                    bail!("a receive completion carries an error: {e}")
                }
                Some(other) => bail!("unexpected completion on the receive CQ: {other:?}"),
            },
            // The READ's or atomic's completion (every one asks for a CQE).
            Verb::Read | Verb::Atomic(_) => {
                reap(s.ini)?;
                s.ini.outstanding() == 0
            }
        })
    }

    /// Drain: every WQE done (and any error reported) before the buffers are checked; the
    /// last WQE of each side asked for a CQE, which retires every earlier one.
    fn drain(&self, posters: &mut [Poster<'_>]) -> Result<()> {
        let wait = self.wait;
        for (i, p) in posters.iter_mut().enumerate() {
            let start = Instant::now();
            while p.ini.outstanding() > 0 {
                reap(p.ini)?;
                if start.elapsed() > wait {
                    bail!(
                        "side {}: {} SQ blocks still uncompleted after {wait:?}",
                        ["A", "B"][self.ids[i]],
                        p.ini.outstanding()
                    );
                }
                std::hint::spin_loop();
            }
        }
        Ok(())
    }
}
