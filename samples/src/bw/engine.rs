//! The initiator of this process behind one call ([`Engine`]: the CPU's flows or the GPU's
//! kernels), the inline WQEs it posted, and [`drive`], which runs it alongside SEND's receivers
//! and the steps both processes take.

use super::cpu::{receive_all, run_cpu, CpuOpts, Flow, Receiver};
use super::gpu::GpuEngine;
use super::plan::{Job, Keys, Plan};
use super::report::Timing;
use crate::{step, CommonArgs, Peer};
use anyhow::{Context as _, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub(super) enum Engine {
    Cpu(Vec<Flow>, CpuOpts),
    Gpu(Box<GpuEngine>),
}

impl Engine {
    /// Runs `iters` iterations of the jobs `ids` (those this process drives; the flows,
    /// exported QPs, keys and `qpns` are in that order); `timed`: the timed run (with -D it
    /// lasts the duration).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &mut self,
        p: &Plan,
        jobs: &[Job],
        ids: &[usize],
        keys: &Keys,
        iters: u32,
        a: &CommonArgs,
        qpns: &[u32],
        timed: bool,
    ) -> Result<Timing> {
        match self {
            Engine::Cpu(flows, o) => {
                let deadline = o.duration.filter(|_| timed);
                run_cpu(flows, o, deadline, p, ids, keys, iters, a)
            }
            Engine::Gpu(g) => {
                let duration = g.duration.filter(|_| timed);
                g.run(p, jobs, ids, keys, iters, duration, a, qpns)
            }
        }
    }
}

/// Runs `run` (the posting of this process's jobs); with SEND, this process's receivers first
/// post their receives (and both processes take the step "posted", so that no SEND starts
/// before its receives are there), then take `n` messages each on a thread of their own while
/// `run` posts. With `sent` (SEND, -D: `n` is not known before) the receivers repost until
/// the run is over, then both processes take the step "sent", which gives the receivers the
/// count the sender posted per job (`sent` of its run's outcome) to take.
#[allow(clippy::too_many_arguments)]
pub(super) fn drive<T>(
    receivers: &mut [Receiver],
    p: &Plan,
    n: u32,
    wait: Duration,
    peer: &mut Option<Peer>,
    send: bool,
    sent: Option<fn(&T) -> Option<u32>>,
    run: impl FnOnce() -> Result<T>,
) -> Result<T> {
    if send {
        let posted = receivers.iter_mut().try_for_each(|r| r.start(p, n));
        step(peer, "posted", posted)?;
    }
    // The sender's count, when the run was one of a duration (both sides take the step).
    let count = |peer: &mut Option<Peer>, r: &Result<T>| -> Result<Option<u32>> {
        let Some(sent) = sent else { return Ok(None) };
        let mine = match r {
            Ok(t) => Ok(sent(t)),
            Err(e) => Err(anyhow::anyhow!("{}", crate::error_text(e))),
        };
        let own = mine.as_ref().ok().copied().flatten();
        let theirs = step(peer, "sent", mine)?.flatten();
        own.or(theirs)
            .map(Some)
            .context("neither side says how many messages it sent")
    };
    if receivers.is_empty() {
        let r = run();
        count(peer, &r)?;
        return r;
    }
    let target = AtomicU64::new(n.into());
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        let h = sc.spawn(|| receive_all(receivers, p, &target, wait, &stop));
        let r = run();
        let counted = count(peer, &r);
        match counted {
            Ok(Some(c)) => target.store(c.into(), Ordering::Release),
            Ok(None) => {}
            Err(_) => stop.store(true, Ordering::Release),
        }
        let got = h
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the receiving thread panicked")));
        let out = r?;
        counted?;
        got?;
        Ok(out)
    })
}

/// The WQEs this side's initiator posted inline in the last run (`null` for a side that only
/// receives).
pub(super) fn own_inline(engine: &Option<Engine>) -> Option<u64> {
    match engine {
        Some(Engine::Cpu(flows, _)) => Some(flows.iter().map(|f| f.inlined).sum()),
        Some(Engine::Gpu(g)) => Some(g.inlined),
        None => None,
    }
}
