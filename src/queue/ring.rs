//! Where a queue's rings live ([`RingPlacement`]).

use crate::Error;
use verbs::DmaBuf;

/// Where a queue's rings live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RingPlacement {
    /// Host memory, mapped into the GPU when a kernel drives the queue.
    #[default]
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

/// `create_cq` / `create_qp` have no GPU to put rings in.
pub(super) fn needs_gpu(p: RingPlacement, what: &str) -> Result<(), Error> {
    match p {
        RingPlacement::HostMapped => Ok(()),
        RingPlacement::Gpu => Err(Error::Unsupported(format!(
            "rings in GPU memory need the GPU: use {what}(&gpu, options)"
        ))),
    }
}
