//! The CPU initiator of the bandwidth tests: one host thread posting every job ([`Flow`],
//! [`run_cpu`]), and SEND's receives, posted and taken by a host thread of the target
//! ([`Receiver`], [`receive_all`]).

use super::plan::{Keys, Plan};
use super::report::Timing;
use super::verb::{atomic_value, AtomicOp, Verb};
use crate::{CommonArgs, Peak};
use anyhow::{bail, Context as _, Result};
use gpuverbs::post::{
    Completion, CpuInitiator, CtrlFlags, InitiatorError, Lkey, Local, Op, RemoteAddr, RingMode,
    Rkey, Sge,
};
use gpuverbs::Qp;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A CPU initiator driving one job.
pub(super) struct Flow {
    pub(super) ini: CpuInitiator,
    pub(super) lkey: Lkey,
    /// Local base: source slot 0 (WRITE, SEND) or the job's destination slot 0 (READ, atomics).
    pub(super) lbase: u64,
    pub(super) rkey: Rkey,
    /// Remote base: the job's destination slot 0 (WRITE), source slot 0 (READ), the job's word
    /// (atomics).
    pub(super) rbase: u64,
    /// The job's number (its atomic values).
    pub(super) job: u64,
    pub(super) slots: u64,
    pub(super) shift: u64,
    pub(super) posted: u32,
    /// Messages whose completion was seen.
    pub(super) completed: u32,
    pub(super) since_sig: u32,
    /// Signaled WQEs in flight: the messages each completes.
    pub(super) pending: VecDeque<u64>,
    /// The source buffer, whose bytes inline WQEs carry (`-I`).
    pub(super) src_buf: Option<gpuverbs::HostBuffer>,
    /// WQEs posted inline, in the last run.
    pub(super) inlined: u64,
}

/// How the CPU initiator posts.
#[derive(Clone, Copy, Debug)]
pub(super) struct CpuOpts {
    /// WQEs per doorbell (`-l`).
    pub(super) post_list: u32,
    /// Messages of at most this many bytes go inline (`-I`).
    pub(super) inline_size: u32,
    /// The timed runs' duration (`-D`).
    pub(super) duration: Option<Duration>,
    /// The verb.
    pub(super) verb: Verb,
    /// Most WQEs in flight per QP (`-o`; 0: no limit but the SQ).
    pub(super) outs: u32,
}

pub(super) fn cpu_flow(q: &Qp, mode: RingMode, src_buf: Option<gpuverbs::HostBuffer>) -> Flow {
    Flow {
        ini: q.cpu_initiator(mode),
        lkey: Lkey(0),
        lbase: 0,
        rkey: Rkey(0),
        rbase: 0,
        job: 0,
        slots: 1,
        shift: 0,
        posted: 0,
        completed: 0,
        since_sig: 0,
        pending: VecDeque::new(),
        src_buf,
        inlined: 0,
    }
}

/// Polls without a completion after which the CPU initiator's loop sleeps on the CQ (in one
/// process: spinning is fastest while the engine has a core of its own, sleeping once it
/// does not).
pub(super) const IDLE_POLLS: u32 = 256;

/// Polls after which the loop sleeps at once when the soft NIC engine of the QP it waits on
/// has not moved meanwhile ([`Initiator::engine_turn`]): the engine is not running, perhaps
/// waiting for this very core, and spinning on would only keep it waiting.
pub(super) const STALL_POLLS: u32 = 16;

/// The CPU initiator: one host thread, round robin over the jobs, `-l` WQEs per doorbell,
/// one CQE per `--cq-mod` WQEs (and for each job's last), messages of at most `-I` bytes
/// inline. With `duration` (-D) it posts until the duration has passed, then every job up to
/// one more than the most any has posted (that last WQE signaled), and says how many.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_cpu(
    flows: &mut [Flow],
    o: &CpuOpts,
    duration: Option<Duration>,
    p: &Plan,
    ids: &[usize],
    keys: &Keys,
    iters: u32,
    a: &CommonArgs,
) -> Result<Timing> {
    let size = p.size;
    let verb = o.verb;
    start_flows(flows, verb, p, ids, keys);
    let inline = verb.has_inline() && size <= o.inline_size as u64;
    let posting = Posting {
        p,
        verb,
        batch: o.post_list,
        outs: o.outs,
        // With a limit on reads in flight, a CQE at least every `outs` WQEs (else the limit
        // waits for a completion nobody asked for).
        sig_every: if o.outs > 0 {
            a.cq_mod.min(o.outs)
        } else {
            a.cq_mod
        },
        inline,
    };
    let mut inline_bytes = vec![0u8; if inline { size as usize } else { 0 }];
    // Without -D every job posts `iters`; with it, the count is set when the duration ends.
    let mut target = duration.is_none().then_some(iters);
    let mut total = iters as u64 * flows.len() as u64;
    let mut peak = Peak::with_capacity((total / a.cq_mod as u64 + 8) as usize);
    let mut done = 0u64;
    let start = Instant::now();
    peak.record(start, 0);
    let mut last_progress = start;
    let mut idle = Idle::default();
    while done < total {
        if target.is_none() && duration.is_some_and(|d| start.elapsed() >= d) {
            // One more for every job, so that each ends with a signaled WQE.
            let t = flows.iter().map(|f| f.posted).max().unwrap_or(0) + 1;
            target = Some(t.min(iters));
            total = t.min(iters) as u64 * flows.len() as u64;
        }
        let before = done;
        let mut posted = false;
        for f in flows.iter_mut() {
            posted |= posting.post(f, target, iters, &mut inline_bytes)?;
            done += take_completions(f)?;
        }
        if done > before {
            last_progress = Instant::now();
            peak.record(last_progress, done);
            idle.polls = 0;
        } else if posted {
            idle.polls = 0;
        } else {
            idle.pass(flows, a.loopback);
        }
        if done == before && last_progress.elapsed() > a.wait() {
            bail!(
                "no completion for {:?} ({done} of {total} {} WQEs completed): the device \
                 stopped answering",
                a.wait(),
                verb.title()
            );
        }
    }
    let total_t = last_progress.duration_since(start);
    let window = (a.cq_mod as u64).max(total / 16);
    Ok(Timing {
        total: total_t,
        peak_rate: peak.best_rate(window),
        iters: target.unwrap_or(iters),
    })
}

/// Sets each flow up for a run of plan `p`: its job's slots, bases and keys, its counters
/// back to zero.
fn start_flows(flows: &mut [Flow], verb: Verb, p: &Plan, ids: &[usize], keys: &Keys) {
    for (i, f) in flows.iter_mut().enumerate() {
        let j = ids[i];
        f.slots = p.dst_slots[j] as u64;
        f.shift = j as u64;
        f.job = j as u64;
        (f.lbase, f.rbase) = match verb {
            Verb::Write => (keys.lbase[i], keys.rbase[i] + p.dst_off[j]),
            Verb::Send => (keys.lbase[i], 0),
            Verb::Read => (keys.lbase[i] + p.dst_off[j], keys.rbase[i]),
            Verb::Atomic(_) => (keys.lbase[i] + p.dst_off[j], keys.rbase[i] + 8 * j as u64),
        };
        f.rkey = Rkey(keys.rkey[i]);
        f.lkey = Lkey(keys.lkey[i]);
        f.posted = 0;
        f.completed = 0;
        f.since_sig = 0;
        f.pending.clear();
        f.inlined = 0;
    }
}

/// How the CPU initiator posts a run's WQEs: the plan and verb, WQEs per doorbell, the most in
/// flight, one CQE per `sig_every`, and whether the messages go inline.
struct Posting<'a> {
    p: &'a Plan,
    verb: Verb,
    batch: u32,
    outs: u32,
    sig_every: u32,
    inline: bool,
}

impl Posting<'_> {
    /// Posts up to a batch of flow `f`'s WQEs (as many as the SQ, `-o` and the count, `target`
    /// or else `iters`, allow) and rings once; whether it posted any.
    fn post(
        &self,
        f: &mut Flow,
        target: Option<u32>,
        iters: u32,
        inline_bytes: &mut [u8],
    ) -> Result<bool> {
        let limit = target.unwrap_or(iters);
        let mut n = 0;
        while n < self.batch
            && f.posted < limit
            && (self.outs == 0 || f.posted - f.completed < self.outs)
        {
            let last = target.is_some_and(|t| f.posted + 1 == t);
            let sig = f.since_sig + 1 >= self.sig_every || last;
            let flags = if sig {
                CtrlFlags::SIGNALED
            } else {
                CtrlFlags::default()
            };
            if !self.post_one(f, flags, inline_bytes)? {
                break;
            }
            f.posted += 1;
            f.since_sig += 1;
            f.inlined += u64::from(self.inline);
            n += 1;
            if sig {
                f.pending.push_back(f.since_sig as u64);
                f.since_sig = 0;
            }
        }
        if n > 0 {
            f.ini.ring();
        }
        Ok(n > 0)
    }

    /// Posts flow `f`'s next WQE (iteration `f.posted`); false when the SQ is full.
    fn post_one(&self, f: &mut Flow, flags: CtrlFlags, inline_bytes: &mut [u8]) -> Result<bool> {
        let (p, verb, size) = (self.p, self.verb, self.p.size);
        let i = f.posted as u64;
        let slot = ((i + f.shift) % p.src_slots as u64) * size;
        let sge = Sge {
            addr: f.lbase + slot,
            len: size as u32,
            lkey: f.lkey,
        };
        // READ's destination slot, an atomic's result slot.
        let dsge = Sge {
            addr: f.lbase + (i % f.slots) * size,
            len: size as u32,
            lkey: f.lkey,
        };
        let local = if self.inline {
            let b = f
                .src_buf
                .as_ref()
                .context("-I: inline WQEs need the source in host memory")?;
            b.read(slot as usize, inline_bytes);
            Local::Inline(inline_bytes)
        } else {
            Local::Sges(std::slice::from_ref(&sge))
        };
        let op = match verb {
            Verb::Write => Op::Write {
                remote: RemoteAddr {
                    addr: f.rbase + (i % f.slots) * size,
                    rkey: f.rkey,
                },
                local,
                imm: None,
            },
            Verb::Send => Op::Send { local, imm: None },
            Verb::Read => Op::Read {
                remote: RemoteAddr {
                    addr: f.rbase + slot,
                    rkey: f.rkey,
                },
                local: std::slice::from_ref(&dsge),
            },
            Verb::Atomic(AtomicOp::FetchAdd) => Op::FetchAdd {
                remote: RemoteAddr {
                    addr: f.rbase,
                    rkey: f.rkey,
                },
                add: 1,
                result: dsge,
            },
            Verb::Atomic(AtomicOp::CmpSwap) => Op::CompareSwap {
                remote: RemoteAddr {
                    addr: f.rbase,
                    rkey: f.rkey,
                },
                compare: atomic_value(f.job, i),
                swap: atomic_value(f.job, i + 1),
                result: dsge,
            },
        };
        match f.ini.post(&op, flags) {
            Ok(_) => Ok(true),
            Err(InitiatorError::SqFull { .. }) => Ok(false),
            Err(e) => Err(e).with_context(|| format!("post an {}", verb.title())),
        }
    }
}

/// Takes flow `f`'s send completions: the messages they complete (an error completion ends
/// the run).
fn take_completions(f: &mut Flow) -> Result<u64> {
    let mut done = 0;
    while let Some(c) = f.ini.poll_send() {
        match c {
            Completion::Req { .. } => {
                let m = f
                    .pending
                    .pop_front()
                    .context("a completion for a WQE that asked for none")?;
                done += m;
                f.completed += m as u32;
            }
            Completion::Error(e) => bail!("a completion carries an error: {e}"),
            other => bail!("unexpected completion on the send CQ: {other:?}"),
        }
    }
    Ok(done)
}

/// The loop's turns without a completion (after which the thread sleeps on the CQ), and the
/// engine turn of the QP waited on when they began.
#[derive(Default)]
struct Idle {
    polls: u32,
    turn: Option<u64>,
}

impl Idle {
    /// A turn that neither posted nor completed anything: gives the core away once a few
    /// polls found nothing (or the engine did not run meanwhile).
    fn pass(&mut self, flows: &[Flow], loopback: bool) {
        self.polls += 1;
        let waited = flows.iter().find(|f| !f.pending.is_empty());
        if self.polls == 1 {
            self.turn = waited.and_then(|f| f.ini.engine_turn());
        }
        let stalled = self.polls > STALL_POLLS
            && self.turn.is_some()
            && waited.and_then(|f| f.ini.engine_turn()) == self.turn;
        // Across processes the completions come from this process's device threads (the
        // wire's ACKs); in one process from the engine, which may share a core with this
        // thread when another process is busy. Either way, once a few polls found
        // nothing (or the engine did not run meanwhile), give the core away until a CQE
        // is written.
        if !loopback || self.polls > IDLE_POLLS || stalled {
            match waited {
                Some(f) => f.ini.idle_until_completion(false, Duration::from_millis(1)),
                None => std::thread::yield_now(),
            }
        }
    }
}

/// SEND: the receives of one job, posted and taken by a host thread of the target's process.
pub(super) struct Receiver {
    pub(super) ini: CpuInitiator,
    /// The job.
    pub(super) job: usize,
    /// The target's destination buffer (the job's slots from its offset on).
    pub(super) base: u64,
    pub(super) lkey: Lkey,
    /// Receives kept posted (`-r`).
    pub(super) depth: u32,
    pub(super) posted: u64,
    pub(super) taken: u64,
}

impl Receiver {
    /// Posts the first receives of a run of `n` messages.
    pub(super) fn start(&mut self, p: &Plan, n: u32) -> Result<()> {
        self.posted = 0;
        self.taken = 0;
        for _ in 0..self.depth.min(n) {
            self.post(p)?;
        }
        Ok(())
    }

    /// Posts receive `posted`, into slot `posted % D` of the job.
    pub(super) fn post(&mut self, p: &Plan) -> Result<()> {
        let d = p.dst_slots[self.job] as u64;
        let addr = self.base + p.dst_off[self.job] + (self.posted % d) * p.size;
        self.ini
            .post_recv(&[Sge {
                addr,
                len: p.size as u32,
                lkey: self.lkey,
            }])
            .context("post a receive")?;
        self.posted += 1;
        Ok(())
    }
}

/// Takes the receive completions of a run of `n` messages per job (each one's byte count
/// checked), posting a receive for each until `n` are posted; fails when nothing arrives for
/// `wait`, or soon after `stop` (the sender failed).
pub(super) fn receive_all(
    rs: &mut [Receiver],
    p: &Plan,
    target: &AtomicU64,
    wait: Duration,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<()> {
    let mut last = Instant::now();
    loop {
        // The messages per job: known before a counted run, set once a timed run of a
        // duration ends (what its sender posted).
        let n = target.load(Ordering::Acquire);
        let mut progress = false;
        let mut all = true;
        for r in rs.iter_mut() {
            while let Some(c) = r.ini.poll_recv() {
                match c {
                    Completion::Resp { byte_cnt, .. } => {
                        if byte_cnt as u64 != p.size {
                            bail!(
                                "job {}: receive {} took {byte_cnt} B, the message has {}",
                                r.job,
                                r.taken,
                                p.size
                            );
                        }
                        r.taken += 1;
                        progress = true;
                        if r.posted < n {
                            r.post(p)?;
                        }
                    }
                    Completion::Error(e) => bail!("a receive completion carries an error: {e}"),
                    other => bail!("unexpected completion on the receive CQ: {other:?}"),
                }
            }
            all &= r.taken >= n;
        }
        if all {
            return Ok(());
        }
        if progress {
            last = Instant::now();
        } else {
            if stop.load(Ordering::Acquire) {
                bail!("the receives stopped: the sender failed");
            }
            if last.elapsed() > wait {
                let got: Vec<u64> = rs.iter().map(|r| r.taken).collect();
                bail!("no receive completion for {wait:?} (received {got:?} of {n} per job)");
            }
            // nothing arrived: sleep until a receive CQE is written (the sender may need
            // this core)
            match rs.iter().find(|r| r.taken < n) {
                Some(r) => r.ini.idle_until_completion(true, Duration::from_millis(1)),
                None => std::thread::yield_now(),
            }
        }
    }
}
