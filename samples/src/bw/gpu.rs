//! The GPU initiator of the bandwidth tests: [`GpuEngine`] launches `gv_sample_put_bw` (WRITE) or
//! `gv_sample_verb_bw` (READ, SEND, atomics) and reads back their status and timing.

use super::args::Scope;
use super::plan::{Job, Keys, Plan};
use super::report::Timing;
use super::verb::Verb;
use crate::{arg, upload, BwJob, CommonArgs, Exports, GpuStatus};
use anyhow::{Context as _, Result};
use gpuverbs::gpu::Gpu;
use std::sync::Arc;
use std::time::Duration;

pub(super) struct GpuEngine {
    pub(super) gpu: Arc<Gpu>,
    pub(super) exports: Exports,
    pub(super) status: GpuStatus,
    pub(super) times: gpuverbs::gpu::DeviceMem,
    /// The duration control words of a timed run with -D (`samples::duration_ctl`).
    pub(super) ctl: gpuverbs::gpu::DeviceMem,
    pub(super) ctas: u32,
    pub(super) threads: u32,
    pub(super) scope: Scope,
    pub(super) batch: u32,
    pub(super) sig_calls: u32,
    pub(super) verb: Verb,
    pub(super) outs: u32,
    /// Messages of at most this many bytes go inline (`-I`), copied from `src_dev`.
    pub(super) inline_size: u32,
    /// Per flow: its source slot 0 as the GPU sees it (WRITE and SEND; 0 otherwise).
    pub(super) src_dev: Vec<u64>,
    /// The timed runs' duration (`-D`).
    pub(super) duration: Option<Duration>,
    /// WQEs posted inline, in the last run.
    pub(super) inlined: u64,
}

impl GpuEngine {
    /// READ, SEND, atomics: `gv_sample_verb_bw`, one CTA per job: one thread, or at warp scope
    /// (READ and atomics) one warp.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_verb(
        &mut self,
        dev_jobs: &gpuverbs::gpu::DeviceMem,
        p: &Plan,
        njobs: usize,
        iters: u32,
        inline: bool,
        duration: Option<Duration>,
        a: &CommonArgs,
        qpns: &[u32],
    ) -> Result<Timing> {
        let mut jobs_ptr = dev_jobs.ptr();
        let mut njobs_ = njobs as u32;
        let mut verb = self.verb.code();
        let mut size = p.size as u32;
        let mut iters_ = iters;
        let mut sig_calls = self.sig_calls;
        let mut outs = self.outs;
        let mut inl = u32::from(inline);
        let (mut ctl, mut duration_ns) = self.arm(duration)?;
        let mut budget = a.wait().as_nanos() as u64;
        let mut out = self.status.ptr();
        let mut times = self.times.ptr();
        let mut params = [
            arg(&mut jobs_ptr),
            arg(&mut njobs_),
            arg(&mut verb),
            arg(&mut size),
            arg(&mut iters_),
            arg(&mut sig_calls),
            arg(&mut outs),
            arg(&mut inl),
            arg(&mut ctl),
            arg(&mut duration_ns),
            arg(&mut budget),
            arg(&mut out),
            arg(&mut times),
        ];
        // SAFETY: the parameters match gv_sample_verb_bw's signature; the job array, the
        // status words, the duration words and the times (16 bytes per CTA, one CTA per job)
        // are live GPU memory for the whole launch; the descriptors are exported QPs kept alive
        // by `self.exports`; the NIC addresses in the jobs are checked by the device against
        // the registered regions, and an inline SEND's source (`src_dev`) is the sender's
        // source buffer (mapped host memory or GPU memory), which outlives the engine.
        let total = unsafe {
            self.gpu.launch_timed(
                "gv_sample_verb_bw",
                (njobs as u32, 1, 1),
                (if self.scope == Scope::Warp { 32 } else { 1 }, 1, 1),
                0,
                &mut params,
            )
        }
        .context("launch gv_sample_verb_bw")?;
        self.status
            .check("gv_sample_verb_bw", |j| qpns.get(j).copied().unwrap_or(0))?;
        let iters = self.ran(duration, iters)?;
        self.inlined = if inline {
            u64::from(iters) * njobs as u64
        } else {
            0
        };
        let peak = self.peak_rate(njobs as u32, iters as f64 * njobs as f64)?;
        Ok(Timing {
            total,
            peak_rate: peak,
            iters,
        })
    }

    /// The duration words' pointer (cleared) and the duration in ns, for a run of `duration`;
    /// a null pointer for a counted run.
    pub(super) fn arm(&self, duration: Option<Duration>) -> Result<(u64, u64)> {
        let Some(d) = duration else {
            return Ok((0, 0));
        };
        self.ctl.write(0, &[0u8; 16])?;
        Ok((self.ctl.ptr(), d.as_nanos() as u64))
    }

    /// The iterations every job ran: `iters`, or after a run of a duration one more than the
    /// highest iteration index started (the low 63 bits of the first duration word).
    pub(super) fn ran(&self, duration: Option<Duration>, iters: u32) -> Result<u32> {
        if duration.is_none() {
            return Ok(iters);
        }
        let mut w = [0u8; 8];
        self.ctl.read(0, &mut w)?;
        let highest = u64::from_ne_bytes(w) & !(1 << 63);
        u32::try_from(highest + 1).context("the duration's iteration count")
    }

    /// The message rate over the kernel's own span: first CTA start to last CTA end.
    pub(super) fn peak_rate(&self, ctas: u32, msgs: f64) -> Result<Option<f64>> {
        let mut raw = vec![0u8; 16 * ctas as usize];
        self.times.read(0, &mut raw)?;
        let t: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let first = t.iter().step_by(2).min().copied().unwrap_or(0);
        let last = t.iter().skip(1).step_by(2).max().copied().unwrap_or(0);
        let span = last.saturating_sub(first);
        Ok((span > 0).then(|| msgs / (span as f64 / 1e9)))
    }

    /// Runs `iters` iterations of the jobs `ids` (or, with `duration`, as many as it takes).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &mut self,
        p: &Plan,
        jobs: &[Job],
        ids: &[usize],
        keys: &Keys,
        iters: u32,
        duration: Option<Duration>,
        a: &CommonArgs,
        qpns: &[u32],
    ) -> Result<Timing> {
        let inline = self.verb.has_inline() && p.size <= u64::from(self.inline_size);
        let descs: Vec<BwJob> = ids
            .iter()
            .enumerate()
            .map(|(i, &j)| BwJob {
                qp: self.exports.qps[i].ptr(),
                lbase: match self.verb {
                    Verb::Write | Verb::Send => keys.lbase[i],
                    Verb::Read | Verb::Atomic(_) => keys.lbase[i] + p.dst_off[j],
                },
                rbase: match self.verb {
                    Verb::Write => keys.rbase[i] + p.dst_off[j],
                    Verb::Send => 0,
                    Verb::Read => keys.rbase[i],
                    Verb::Atomic(_) => keys.rbase[i] + 8 * j as u64,
                },
                lkey: keys.lkey[i],
                rkey: keys.rkey[i],
                workers: jobs[j].workers,
                dst_slots: p.dst_slots[j],
                src_slots: p.src_slots,
                src_shift: j as u32,
                src_dev: self.src_dev[i],
            })
            .collect();
        let dev_jobs = upload(&self.gpu, &descs)?;
        self.status.reset()?;
        if self.verb != Verb::Write {
            return self.run_verb(&dev_jobs, p, ids.len(), iters, inline, duration, a, qpns);
        }
        let mut jobs_ptr = dev_jobs.ptr();
        let mut njobs = ids.len() as u32;
        let mut size = p.size as u32;
        let mut iters_ = iters;
        let mut scope = self.scope.code();
        let mut batch = self.batch;
        let mut sig_calls = self.sig_calls;
        let mut inl = u32::from(inline);
        let (mut ctl, mut duration_ns) = self.arm(duration)?;
        let mut budget = a.wait().as_nanos() as u64;
        let mut out = self.status.ptr();
        let mut times = self.times.ptr();
        let mut params = [
            arg(&mut jobs_ptr),
            arg(&mut njobs),
            arg(&mut size),
            arg(&mut iters_),
            arg(&mut scope),
            arg(&mut batch),
            arg(&mut sig_calls),
            arg(&mut inl),
            arg(&mut ctl),
            arg(&mut duration_ns),
            arg(&mut budget),
            arg(&mut out),
            arg(&mut times),
        ];
        // SAFETY: the parameters match gv_sample_put_bw's signature; the job array, the status
        // words, the duration words and the times are live GPU memory for the whole launch;
        // the descriptors are exported QPs kept alive by `self.exports`; the NIC addresses in
        // the jobs are checked by the device against the registered regions, and an inline
        // WRITE's source (`src_dev`) is the sender's source buffer (mapped host memory or GPU
        // memory), which outlives the engine.
        let total = unsafe {
            self.gpu.launch_timed(
                "gv_sample_put_bw",
                (self.ctas, 1, 1),
                (self.threads, 1, 1),
                0,
                &mut params,
            )
        }
        .context("launch gv_sample_put_bw")?;
        self.status
            .check("gv_sample_put_bw", |j| qpns.get(j).copied().unwrap_or(0))?;
        let iters = self.ran(duration, iters)?;
        self.inlined = if inline {
            u64::from(iters) * ids.len() as u64
        } else {
            0
        };
        let msgs = iters as f64 * ids.len() as f64;
        Ok(Timing {
            total,
            peak_rate: self.peak_rate(self.ctas, msgs)?,
            iters,
        })
    }
}
