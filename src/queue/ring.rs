//! Where a queue's rings live ([`RingPlacement`]), and how `Auto` is resolved.

use crate::backend::seam::{DeviceOps, GpuRings};
use crate::Error;
use verbs::DmaBuf;

/// Where a queue's rings live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RingPlacement {
    /// Where the device wants a queue that kernels drive: given the GPU
    /// ([`Context::create_cq_on`](crate::Context::create_cq_on),
    /// [`Pd::create_qp_on`](crate::Pd::create_qp_on)), GPU memory on a ConnectX (it reads the
    /// WQEs peer to peer, and the device API orders them at GPU scope) and host memory on the
    /// soft NIC (its engine runs on the CPU); without a GPU, host memory. The queue's
    /// `placement()` says what it became, `placement_reason()` why.
    #[default]
    Auto,
    /// Host memory, mapped into the GPU when a kernel drives the queue.
    HostMapped,
    /// GPU memory (cudaMalloc'ed), for a QP that only kernels drive: the SQ and RQ rings of a
    /// QP, the CQE ring of a CQ. The doorbell record, the doorbell register (UAR) and the CQ
    /// doorbell record stay in host memory, as on hardware (the UAR is NIC BAR space). Needs
    /// the GPU: [`Context::create_cq_on`](crate::Context::create_cq_on), [`Pd::create_qp_on`](crate::Pd::create_qp_on). The CPU initiator cannot
    /// drive such a queue ([`Qp::try_cpu_initiator`](crate::Qp::try_cpu_initiator)).
    Gpu,
}

pub(super) fn placement_of(ring: &DmaBuf) -> RingPlacement {
    if ring.is_host() {
        RingPlacement::HostMapped
    } else {
        RingPlacement::Gpu
    }
}

/// The GPU a queue's rings go to (`None`: host memory) as `p` asks, given `gpu` (the one
/// `create_*_on` was called with) and the device, and why. `what` names the call that takes
/// a GPU, for the error of `Gpu` without one.
pub(super) fn resolve<'a>(
    p: RingPlacement,
    gpu: Option<&'a dyn GpuRings>,
    dev: &dyn DeviceOps,
    what: &str,
) -> Result<(Option<&'a dyn GpuRings>, String), Error> {
    Ok(match (p, gpu) {
        (RingPlacement::HostMapped, _) => (None, "requested".into()),
        (RingPlacement::Gpu, Some(g)) => (Some(g), "requested".into()),
        (RingPlacement::Gpu, None) => {
            return Err(Error::Unsupported(format!(
                "rings in GPU memory need the GPU: use {what}(&gpu, options)"
            )))
        }
        (RingPlacement::Auto, None) => (
            None,
            format!("auto: host memory, no GPU given ({what} places them for a GPU)"),
        ),
        (RingPlacement::Auto, Some(g)) => {
            let (on_gpu, why) = dev.rings_for_kernels();
            (on_gpu.then_some(g), why.to_string())
        }
    })
}
