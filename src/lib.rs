//! gpuverbs: GPU-initiated RDMA for CUDA kernels (mlx5 work queues driven from the GPU), with a
//! software mlx5 NIC.
//!
//! The modules follow the control path:
//! - [`device`]: pick and open a device ([`Context`]), soft NIC or ConnectX, with the reason.
//! - [`memory`]: protection domains, host buffers, memory regions, their generations and
//!   deregistration once the work in flight is done.
//! - [`regcache`]: the registration cache of a PD.
//! - [`queue`]: completion queues and RC queue pairs, doorbell modes, connection.
//! - [`endpoint`], [`bootstrap`]: what peers exchange, and the TCP rendezvous that carries it.
//! - [`export`]: the QP descriptor kernels drive (one layout shared with the CUDA headers).
//! - [`gpu`]: a CUDA device with the kernels loaded; mapping and export into it.
//! - [`proxy`]: the CPU proxy that rings doorbells for kernels that cannot.
//! - [`cuda`], [`fatbin`]: the embedded kernels and the run-time-loaded CUDA driver.

pub mod bootstrap;
pub mod cuda;
pub mod device;
pub mod endpoint;
mod error;
pub mod export;
pub mod fatbin;
pub mod gpu;
pub mod memory;
mod mlx5;
pub mod proxy;
pub mod queue;
pub mod regcache;

/// What CPU code posts and reads back: work requests in the mlx5 format (the same bytes a kernel
/// writes), completions, keys, and the CPU initiator that drives a QP's rings
/// ([`Qp::cpu_initiator`]). One set of types for both backends.
pub mod post {
    pub use prm::cqe::RespKind;
    pub use prm::wqe::AtomicSize;
    pub use prm::{Completion, CtrlFlags, ErrorCqe, Fence, Lkey, Local, Op, RemoteAddr, Rkey, Sge};
    pub use prm::{Opcode, Syndrome};
    pub use softnic::initiator::{Initiator as CpuInitiator, InitiatorError, RingMode};
}

/// Soft-NIC-only controls, for the soft backend ([`Context::soft_device`] returns its device):
/// opening one with explicit settings ([`Context::open_soft`]), fault injection, engine and
/// wire counters, packet capture. Nothing here applies to a ConnectX.
pub mod soft {
    pub use softnic::{
        Capture, CounterSnapshot, Device, DeviceConfig, Error, Fault, Gid, WireConfig,
        WireCounters, WireFaults,
    };
}

pub use device::{Context, DeviceRequest, Selection};
pub use endpoint::{Endpoint, RemoteMemory};
pub use error::Error;
pub use memory::{Access, DeregisterError, HostBuffer, InFlight, Mr, Pd, QpInFlight};
pub use mlx5::GpuRegPath;
pub use queue::{
    ConnectOptions, Cq, CqOptions, DoorbellMode, Modify, Qp, QpOptions, RingPlacement,
};
pub use regcache::{CachedMr, RegCache, RegCacheConfig, RegCacheStats};

/// The walk-through in `docs/host-api.md`, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../docs/host-api.md")]
struct HostApiWalkThrough;
