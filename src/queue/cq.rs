//! Completion queues: their options, the device's CQ behind each, and their creation.

use super::ring::{placement_of, resolve, RingPlacement};
use crate::backend::context::Context;
use crate::backend::seam::{CqOps, CqSpec, GpuRings};
use crate::gpu::Gpu;
use crate::Error;
use std::sync::Arc;
use verbs::{CqInit, CqMode};

/// Parameters of a CQ.
#[derive(Clone, Copy, Debug)]
pub struct CqOptions {
    /// Entries (power of two).
    pub depth: u32,
    /// Ring placement ([`RingPlacement::Auto`] by default).
    pub placement: RingPlacement,
    /// Consumer-index mode. The default, [`CqMode::OverrunDetect`], never loses a completion
    /// silently: the device reads the consumer index from the CQ doorbell record (the CPU
    /// initiator and the device API keep it current), and a CQE that would overwrite one not
    /// yet taken puts the CQ in error and the QP that produced it in ERR; the CPU initiator's
    /// `wait_send` / `wait_recv` then return `InitiatorError::CqOverrun` once the CQEs in the
    /// ring are taken. [`CqMode::OverrunIgnore`] (the device never reads the consumer index;
    /// a slow consumer is overwritten) is for GPU stacks that ask for it.
    pub mode: CqMode,
    /// Initial fill.
    pub init: CqInit,
}

impl Default for CqOptions {
    fn default() -> Self {
        Self {
            depth: 256,
            placement: RingPlacement::Auto,
            mode: CqMode::OverrunDetect,
            init: CqInit::Invalid,
        }
    }
}

/// A completion queue.
#[derive(Clone, Debug)]
pub struct Cq {
    pub(crate) ctx: Context,
    pub(crate) dev: Arc<dyn CqOps>,
    /// Why its ring is where it is.
    placement_reason: Arc<str>,
}

impl Cq {
    /// The context that owns it.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
    /// Number of entries.
    pub fn depth(&self) -> u32 {
        self.dev.depth()
    }
    /// The consumer index its doorbell record holds (24 bits): the CQEs its poster took.
    pub(crate) fn consumer_index(&self) -> u32 {
        self.dev.geometry().dbrec.word(0) & 0xff_ffff
    }
    /// CQ number.
    pub fn cqn(&self) -> u32 {
        self.dev.cqn()
    }
    /// The soft NIC's CQ (rings, doorbell record, overrun state): soft backend only.
    pub fn soft(&self) -> Option<&Arc<crate::soft::raw::Cq>> {
        crate::backend::soft::cq_of(&*self.dev)
    }
    /// Where its CQE ring lives (never `Auto`: what it became).
    pub fn placement(&self) -> RingPlacement {
        placement_of(self.dev.geometry().ring)
    }
    /// Why its ring is there ("requested", or what `RingPlacement::Auto` chose and why).
    pub fn placement_reason(&self) -> &str {
        &self.placement_reason
    }
    /// The CQ's geometry, as its backend made it.
    pub(crate) fn geometry(&self) -> crate::backend::geometry::CqGeometry<'_> {
        self.dev.geometry()
    }
}

impl Context {
    /// Creates a completion queue with its ring in host memory
    /// ([`RingPlacement::Gpu`] needs [`Context::create_cq_on`]).
    pub fn create_cq(&self, o: CqOptions) -> Result<Cq, Error> {
        self.create_cq_with(o, None)
    }

    /// Creates a completion queue for a queue that `gpu`'s kernels drive, its ring placed as
    /// `o.placement` says: in `gpu`'s memory for [`RingPlacement::Gpu`], and for
    /// [`RingPlacement::Auto`] where the device wants it (its CQ doorbell record stays in host
    /// memory). On the mlx5 backend such a CQ is made with DEVX, its ring registered as a umem
    /// (a dma-buf of the GPU pages first, else the GPU address).
    pub fn create_cq_on(&self, gpu: &Arc<Gpu>, o: CqOptions) -> Result<Cq, Error> {
        self.create_cq_with(o, Some(gpu as &dyn GpuRings))
    }

    /// Creates a CQ for `gpu`'s kernels (`None`: no GPU given), its ring placed as asked.
    pub(super) fn create_cq_with(
        &self,
        o: CqOptions,
        gpu: Option<&dyn GpuRings>,
    ) -> Result<Cq, Error> {
        if !o.depth.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "CQ depth {} is not a power of two",
                o.depth
            )));
        }
        let device = &*self.inner.device;
        let (gpu, reason) = resolve(o.placement, gpu, device, "Context::create_cq_on")?;
        let dev = device.create_cq(&CqSpec {
            depth: o.depth,
            mode: o.mode,
            init: o.init,
            gpu,
        })?;
        Ok(Cq {
            ctx: self.clone(),
            dev,
            placement_reason: reason.into(),
        })
    }
}
