//! The initiator of this process behind one call ([`Engine`]: the CPU's initiators or the GPU's
//! kernel).

use super::cpu::{run_cpu, Poster};
use super::gpu::GpuLat;
use super::report::Ran;
use super::side::{Side, Target};
use crate::bw::Verb;
use crate::CommonArgs;
use anyhow::Result;
use gpuverbs::post::CpuInitiator;
use std::time::Duration;

pub(super) enum Engine {
    /// One initiator per entry of `sides`.
    Cpu(Vec<CpuInitiator>),
    Gpu(Box<GpuLat>),
}

impl Engine {
    /// Runs `total` round trips (with `duration`: `total` of warm-up, then as many as the
    /// duration takes).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &mut self,
        sides: &[Side],
        ids: &[usize],
        targets: &[Target],
        verb: Verb,
        size: u64,
        total: u32,
        duration: Option<Duration>,
        signal: bool,
        inline: bool,
        a: &CommonArgs,
    ) -> Result<Ran> {
        match self {
            Engine::Cpu(inis) => {
                let mut posters: Vec<Poster<'_>> = inis
                    .iter_mut()
                    .zip(sides)
                    .zip(targets)
                    .map(|((ini, side), to)| Poster::new(ini, side, to))
                    .collect::<Result<_>>()?;
                run_cpu(
                    &mut posters,
                    ids,
                    verb,
                    size,
                    total,
                    duration,
                    signal,
                    inline,
                    a,
                )
            }
            Engine::Gpu(g) => g.run(
                sides, ids, targets, size, total, duration, signal, inline, a,
            ),
        }
    }
}
