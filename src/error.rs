//! The host API's error type.

/// Errors of the gpuverbs host API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No device with this name.
    #[error("no RDMA device named {0:?} (soft NIC names: soft, softnic, softnic<N>)")]
    NoSuchDevice(String),
    /// The soft NIC refused a control-path operation.
    #[error(transparent)]
    Soft(#[from] crate::soft::Error),
    /// CUDA failed (or is absent) where the operation needs it.
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
    /// An rdma-core call failed (the ConnectX backend).
    #[error(
        "{call} failed: {}{}",
        std::io::Error::from_raw_os_error(*errno),
        if detail.is_empty() { String::new() } else { format!(" ({detail})") }
    )]
    Verbs {
        /// The call.
        call: &'static str,
        /// Its errno.
        errno: i32,
        /// What it was asked to do.
        detail: String,
    },
    /// A parameter is out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The device cannot do this (the reason says which device and what).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The object is still used by in-flight work or by other objects.
    #[error("{0} is still in use")]
    Busy(&'static str),
    /// Host memory of this size cannot be allocated.
    #[error("cannot allocate a host buffer of {len} bytes: {reason}")]
    HostAlloc {
        /// Bytes asked for.
        len: usize,
        /// Why not.
        reason: &'static str,
    },
    /// A bounded wait ended with WQEs still in flight ([`crate::Mr::deregister`]): which QPs,
    /// how much.
    #[error(transparent)]
    InFlight(crate::memory::InFlight),
    /// [`crate::Qp::recover`] ran out of time (or the CQ overran) before the device had
    /// completed every WQE of the QP; the QP stays in ERR.
    #[error(
        "QP {qpn:#x} not drained after {waited:?}: {send_blocks} send blocks and {receives} \
         receives not completed{}",
        if *overrun { " (a CQ overran: its completions are lost)" } else { "" }
    )]
    Drain {
        /// The QP.
        qpn: u32,
        /// How long it waited.
        waited: std::time::Duration,
        /// Send-queue blocks the device had not completed.
        send_blocks: u32,
        /// Receive WQEs the device had not completed.
        receives: u32,
        /// Whether a CQ of the QP overran.
        overrun: bool,
    },
    /// A kernel's device-API headers lay the descriptor out differently from this library
    /// ([`crate::gpu::Gpu::export_qp_for`]).
    #[error(
        "the kernel's gpuverbs headers have descriptor version {header:#010x}, this library \
         writes {library:#010x}: build the kernel against this library's headers \
         (kernels/include, or gpuverbs.include_dir() in Python)"
    )]
    DescVersion {
        /// `GPUVERBS_DESC_VERSION` of the kernel's headers.
        header: u32,
        /// [`crate::export::DESC_VERSION`].
        library: u32,
    },
    /// The QP's send queue already has a poster (one at a time: a CPU initiator, a GPU export
    /// or the CPU proxy; a GPU export and its proxy together).
    #[error("the QP already has a poster ({held}), so {wanted} cannot post to it: drop it first")]
    PosterBusy {
        /// Who holds the QP.
        held: crate::queue::Poster,
        /// Who was refused.
        wanted: crate::queue::Poster,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verbs_error_names_its_detail_only_when_there_is_one() {
        let e = Error::Verbs {
            call: "ibv_get_device_list",
            errno: 38,
            detail: String::new(),
        };
        let s = e.to_string();
        assert!(s.starts_with("ibv_get_device_list failed: "), "{s}");
        assert!(!s.ends_with("()"), "{s}");
        let e = Error::Verbs {
            call: "ibv_reg_mr",
            errno: 12,
            detail: "4096 bytes".into(),
        };
        assert!(e.to_string().ends_with(" (4096 bytes)"), "{e}");
    }
}
