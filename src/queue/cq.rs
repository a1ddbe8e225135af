//! Completion queues: their options, the device's CQ behind each, and their creation.

use super::ring::{needs_gpu, placement_of, RingPlacement};
use crate::backend::context::{Backend, Context};
use crate::gpu::Gpu;
use crate::Error;
use std::sync::Arc;
use verbs::{CqInit, CqMode, DmaBuf};

/// Parameters of a CQ.
#[derive(Clone, Copy, Debug)]
pub struct CqOptions {
    /// Entries (power of two).
    pub depth: u32,
    /// Ring placement.
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
            placement: RingPlacement::HostMapped,
            mode: CqMode::OverrunDetect,
            init: CqInit::Invalid,
        }
    }
}

/// A completion queue.
#[derive(Clone, Debug)]
pub struct Cq {
    pub(crate) ctx: Context,
    pub(crate) dev: CqDev,
}

/// The device's CQ.
#[derive(Clone)]
pub(crate) enum CqDev {
    Soft(Arc<softnic::Cq>),
    Mlx5(Arc<crate::backend::mlx5::Cq>),
}

impl std::fmt::Debug for CqDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Soft(c) => write!(f, "soft CQ {:#x}", c.cqn()),
            Self::Mlx5(c) => write!(f, "mlx5 CQ {:#x}", c.cqn),
        }
    }
}

impl Cq {
    /// The context that owns it.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
    /// Number of entries.
    pub fn depth(&self) -> u32 {
        match &self.dev {
            CqDev::Soft(c) => c.ncqe(),
            CqDev::Mlx5(c) => c.ncqe,
        }
    }
    /// The consumer index its doorbell record holds (24 bits): the CQEs its poster took.
    pub(crate) fn consumer_index(&self) -> u32 {
        use std::sync::atomic::Ordering::Acquire;
        match &self.dev {
            CqDev::Mlx5(c) => c.dbrec.word(0) & 0xff_ffff,
            CqDev::Soft(c) => u32::from_be(c.dbrec().atomic_u32(0).load(Acquire)) & 0xff_ffff,
        }
    }
    /// CQ number.
    pub fn cqn(&self) -> u32 {
        match &self.dev {
            CqDev::Soft(c) => c.cqn(),
            CqDev::Mlx5(c) => c.cqn,
        }
    }
    /// The soft NIC's CQ (rings, doorbell record, overrun state): soft backend only.
    pub fn soft(&self) -> Option<&Arc<softnic::Cq>> {
        match &self.dev {
            CqDev::Soft(c) => Some(c),
            CqDev::Mlx5(_) => None,
        }
    }
    /// Where its CQE ring lives.
    pub fn placement(&self) -> RingPlacement {
        match &self.dev {
            CqDev::Soft(c) => placement_of(c.ring()),
            CqDev::Mlx5(c) => placement_of(&c.ring),
        }
    }
    /// The CQ's geometry, as its backend made it.
    pub(crate) fn geometry(&self) -> crate::backend::geometry::CqGeometry<'_> {
        match &self.dev {
            CqDev::Soft(c) => crate::backend::soft::cq_geometry(c),
            CqDev::Mlx5(c) => c.geometry(),
        }
    }
}

impl Context {
    /// Creates a completion queue with its ring in host memory
    /// ([`RingPlacement::Gpu`] needs [`Context::create_cq_on`]).
    pub fn create_cq(&self, o: CqOptions) -> Result<Cq, Error> {
        needs_gpu(o.placement, "Context::create_cq_on")?;
        self.create_cq_with(o, None, None)
    }

    /// Creates a completion queue whose ring is placed as `o.placement` says: in `gpu`'s
    /// memory for [`RingPlacement::Gpu`] (its CQ doorbell record stays in host memory). On the
    /// mlx5 backend such a CQ is made with DEVX, its ring registered as a umem (a dma-buf of
    /// the GPU pages first, else the GPU address).
    pub fn create_cq_on(&self, gpu: &Arc<Gpu>, o: CqOptions) -> Result<Cq, Error> {
        let ring = match o.placement {
            RingPlacement::HostMapped => None,
            RingPlacement::Gpu => {
                let bytes = (o.depth as usize).saturating_mul(prm::CQE_SIZE);
                Some(gpu.ring_buffer(bytes)?)
            }
        };
        self.create_cq_with(o, ring, Some(gpu))
    }

    pub(super) fn create_cq_with(
        &self,
        o: CqOptions,
        ring: Option<DmaBuf>,
        gpu: Option<&Arc<Gpu>>,
    ) -> Result<Cq, Error> {
        if !o.depth.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "CQ depth {} is not a power of two",
                o.depth
            )));
        }
        let dev = match &self.inner.backend {
            Backend::Soft(d) => CqDev::Soft(d.create_cq(softnic::CqConfig {
                ncqe: o.depth,
                mode: o.mode,
                init: o.init,
                ring,
                dbrec: None,
                cqe_size: Default::default(),
            })?),
            Backend::Mlx5(d) => {
                // The provider's CQs detect overrun, start with op_own 0xF0 and live in host
                // memory; anything else is made with DEVX (as is everything when
                // GPUVERBS_MLX5_DEVX=1 asks for it).
                let provider = ring.is_none()
                    && o.mode == CqMode::OverrunDetect
                    && o.init == CqInit::Invalid
                    && !crate::backend::mlx5::devx_always();
                if provider {
                    let cq = d.create_cq(o.depth)?;
                    if cq.ncqe != o.depth {
                        return Err(Error::Unsupported(format!(
                            "the provider made a CQ of {} entries for {}",
                            cq.ncqe, o.depth
                        )));
                    }
                    CqDev::Mlx5(cq)
                } else {
                    let bytes = (o.depth as usize).saturating_mul(prm::CQE_SIZE);
                    let ring = ring.unwrap_or_else(|| DmaBuf::alloc(bytes));
                    softnic::cq::prefill(&ring, o.depth as usize, o.init)?;
                    let gpu = gpu.filter(|_| !ring.is_host());
                    let dmabuf = gpu.map(|g| {
                        g.dmabuf(ring.addr(), bytes as u64)
                            .map_err(|e| e.to_string())
                    });
                    // beside a ring in GPU memory, its doorbell record is GPU memory too (its
                    // consumer, a kernel, writes it)
                    let rec = match gpu {
                        Some(g) => g.ring_buffer(8)?,
                        None => DmaBuf::alloc(64),
                    };
                    CqDev::Mlx5(crate::backend::mlx5::Cq::devx(
                        d, o.depth, o.mode, ring, dmabuf, rec,
                    )?)
                }
            }
        };
        Ok(Cq {
            ctx: self.clone(),
            dev,
        })
    }
}
