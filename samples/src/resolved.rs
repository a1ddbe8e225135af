//! What a run resolved to: its device, GPU and initiator ([`Env`]). [`crate::env`] fills it in;
//! the report ([`crate::report`]) and the harnesses read it. It sits below both, so that the
//! harness's modules import one way (`env` → `peer` → `report` → `resolved`).

use crate::args::Initiator;
use gpuverbs::gpu::Gpu;
use gpuverbs::Context;
use std::sync::Arc;

/// The device, the GPU and the initiator of a run, as resolved.
pub struct Env {
    /// The device (both sides of a loopback run share it).
    pub ctx: Context,
    /// The GPU, when one is used.
    pub gpu: Option<Arc<Gpu>>,
    /// What the header says about the GPU.
    pub gpu_line: String,
    /// Who posts.
    pub initiator: Initiator,
    /// Why that initiator.
    pub initiator_why: String,
}
