//! The message-rate and latency measurements: 8-byte writes with the SQ kept full or written
//! whole before one doorbell ([`RateRun`]), and doorbell-to-CQE times ([`latency`]).

use super::args::{Args, Stop};
use super::loopback::{read_u64, value, Loopback, SLOT, STUCK};
use anyhow::{bail, Context, Result};
use gpuverbs::post::{CtrlFlags, Lkey, Local, Op, RemoteAddr, Rkey, Sge};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Result of a message-rate measurement.
pub(super) struct RateResult {
    pub(super) msgs: u64,
    pub(super) secs: f64,
    pub(super) doorbells: u64,
    /// Time the initiator spent writing WQEs and ringing, per message.
    pub(super) post_ns_per_msg: f64,
}

impl RateResult {
    pub(super) fn rate(&self) -> f64 {
        self.msgs as f64 / self.secs
    }
}

/// 8-byte writes: message `n` goes from source slot `n % slots` to destination slot
/// `n % slots`; a slot is reused only after the WQE that used it was retired by a CQE.
pub(super) struct RateRun<'a> {
    pub(super) lb: &'a mut Loopback,
    pub(super) slots: u64,
    pub(super) signal: u64,
    pub(super) inline: bool,
    /// Next message number.
    pub(super) next: u64,
    /// Messages retired by completions.
    pub(super) retired: u64,
    /// Signaled messages not yet completed, oldest first.
    pub(super) signaled: VecDeque<u64>,
    pub(super) post_time: Duration,
}

impl<'a> RateRun<'a> {
    pub(super) fn new(lb: &'a mut Loopback, args: &Args) -> Self {
        Self {
            slots: args.sq_blocks as u64,
            signal: args.signal.max(1) as u64,
            inline: args.inline,
            next: 0,
            retired: 0,
            signaled: VecDeque::new(),
            post_time: Duration::ZERO,
            lb,
        }
    }

    /// Writes message `next` into the SQ (no doorbell).
    pub(super) fn post_one(&mut self, force_signal: bool) -> Result<()> {
        let n = self.next;
        let slot = (n % self.slots) as usize * SLOT;
        let v = value(n);
        let signaled = force_signal || n % self.signal == self.signal - 1;
        let payload = v.to_ne_bytes();
        let remote = RemoteAddr {
            addr: self.lb.dst.addr() + slot as u64,
            rkey: Rkey(self.lb.dst_mr.key),
        };
        let sge = [Sge {
            addr: self.lb.src.addr() + slot as u64,
            len: SLOT as u32,
            lkey: Lkey(self.lb.src_mr.key),
        }];
        let local = if self.inline {
            Local::Inline(&payload)
        } else {
            self.lb.src.write(slot, &payload);
            Local::Sges(&sge)
        };
        let flags = CtrlFlags {
            signaled,
            ..Default::default()
        };
        let idx = self
            .lb
            .ini
            .post(
                &Op::Write {
                    remote,
                    local,
                    imm: None,
                },
                flags,
            )
            .with_context(|| format!("post message {n}"))?;
        debug_assert_eq!(idx, n as u16);
        if signaled {
            self.signaled.push_back(n);
        }
        self.next += 1;
        Ok(())
    }

    /// Handles one completion: it must name the oldest signaled message, whose destination
    /// must hold its value; every message up to it is retired.
    pub(super) fn complete(&mut self, wqe_counter: u16) -> Result<()> {
        let Some(n) = self.signaled.pop_front() else {
            bail!("completion for WQE {wqe_counter} but no signaled WQE outstanding");
        };
        if wqe_counter != n as u16 {
            bail!("completion names WQE {wqe_counter}, expected {}", n as u16);
        }
        let got = read_u64(&self.lb.dst, (n % self.slots) as usize * SLOT);
        if got != value(n) {
            bail!(
                "message {n}: destination slot holds {got:#x}, expected {:#x}",
                value(n)
            );
        }
        self.retired = n + 1;
        Ok(())
    }

    pub(super) fn poll_all(&mut self) -> Result<()> {
        while let Some(w) = self.lb.poll()? {
            self.complete(w)?;
        }
        Ok(())
    }

    /// Posts a signaled last write and waits until everything is retired.
    pub(super) fn drain(&mut self) -> Result<()> {
        if self.retired < self.next || self.next == 0 {
            if self.lb.ini.outstanding() >= self.slots as u32 {
                let w = self.lb.wait()?;
                self.complete(w)?;
            }
            self.post_one(true)?;
            self.lb.ini.ring();
        }
        while self.retired < self.next {
            let w = self.lb.wait()?;
            self.complete(w)?;
        }
        Ok(())
    }

    /// Every destination slot holds the last value written to it.
    pub(super) fn check_all_slots(&self) -> Result<()> {
        let first = self.next.saturating_sub(self.slots);
        for n in first..self.next {
            let got = read_u64(&self.lb.dst, (n % self.slots) as usize * SLOT);
            if got != value(n) {
                bail!(
                    "final check: message {n}'s slot holds {got:#x}, expected {:#x}",
                    value(n)
                );
            }
        }
        Ok(())
    }

    /// One signaled write, rung alone; returns the time from the doorbell to its CQE.
    pub(super) fn one(&mut self) -> Result<Duration> {
        self.post_one(true)?;
        let t = Instant::now();
        self.lb.ini.ring();
        let w = self.lb.wait()?;
        let took = t.elapsed();
        self.complete(w)?;
        Ok(took)
    }

    /// Keeps the SQ full for `stop`: poll, then post batches of `batch` and ring.
    pub(super) fn steady(&mut self, batch: u32, stop: Stop) -> Result<RateResult> {
        let start = Instant::now();
        let first = self.retired;
        let doorbells0 = self.lb.counters().doorbells_seen;
        let post0 = self.post_time;
        let mut last_progress = Instant::now();
        let mut loops = 0u32;
        loop {
            let before = self.retired;
            self.poll_all()?;
            if self.retired != before {
                last_progress = Instant::now();
            }
            let free = self.slots as u32 - self.lb.ini.outstanding();
            if free >= batch {
                let t = Instant::now();
                for _ in 0..batch {
                    self.post_one(false)?;
                }
                self.lb.ini.ring();
                self.post_time += t.elapsed();
            } else {
                std::hint::spin_loop();
                loops = loops.wrapping_add(1);
                if loops % 4096 == 0 && last_progress.elapsed() > STUCK {
                    bail!(
                        "no progress for {STUCK:?} (QP {:?}); counters A: {:?}",
                        self.lb.qa.state(),
                        self.lb.counters()
                    );
                }
            }
            if stop.done(start, self.retired - first) {
                break;
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let msgs = self.retired - first;
        Ok(RateResult {
            msgs,
            secs,
            doorbells: self.lb.counters().doorbells_seen - doorbells0,
            post_ns_per_msg: (self.post_time - post0).as_nanos() as f64 / msgs.max(1) as f64,
        })
    }

    /// Fills the whole SQ, then rings once and times until the last completion; repeats.
    pub(super) fn bursts(&mut self, stop: Stop) -> Result<RateResult> {
        let start = Instant::now();
        let doorbells0 = self.lb.counters().doorbells_seen;
        let (mut msgs, mut timed, mut post) = (0u64, Duration::ZERO, Duration::ZERO);
        while !stop.done(start, msgs) {
            self.drain()?;
            let t = Instant::now();
            for i in 0..self.slots {
                self.post_one(i == self.slots - 1)?;
            }
            post += t.elapsed();
            let t = Instant::now();
            self.lb.ini.ring();
            while self.retired < self.next {
                let w = self.lb.wait()?;
                self.complete(w)?;
            }
            timed += t.elapsed();
            msgs += self.slots;
        }
        Ok(RateResult {
            msgs,
            secs: timed.as_secs_f64(),
            doorbells: self.lb.counters().doorbells_seen - doorbells0,
            post_ns_per_msg: post.as_nanos() as f64 / msgs.max(1) as f64,
        })
    }
}

/// Doorbell-to-CQE times (µs, sorted) of single 8-byte writes, each after `gap` (plus up to
/// 0.5 ms of jitter) of idleness, so that with a gap the engine has gone to sleep.
pub(super) fn latency(
    lb: &mut Loopback,
    args: &Args,
    gap: Duration,
    samples: usize,
) -> Result<Vec<f64>> {
    const WARM: usize = 10;
    let mut run = RateRun::new(lb, args);
    let mut us = Vec::with_capacity(samples);
    for i in 0..samples + WARM {
        if !gap.is_zero() {
            std::thread::sleep(gap + Duration::from_micros((i as u64 * 7919) % 500));
        }
        let took = run.one()?;
        if i >= WARM {
            us.push(took.as_secs_f64() * 1e6);
        }
    }
    run.check_all_slots()?;
    us.sort_by(|a, b| a.total_cmp(b));
    Ok(us)
}

pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}
