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
//! - [`export`]: exporting a QP into a GPU, and the descriptor kernels drive (one layout shared
//!   with the CUDA headers).
//! - [`gpu`]: a CUDA device with the kernels loaded; mapping and device memory.
//! - [`proxy`]: the CPU proxy that rings doorbells for kernels that cannot.
//! - [`cuda`], [`fatbin`]: the embedded kernels and the run-time-loaded CUDA driver.
//!
//! The modules stand in layers, and a lower layer never names a higher one
//! (`tests/layering.rs`; `docs/architecture.md`).

mod backend;
pub mod bootstrap;
pub mod cuda;
mod desc;
pub mod device;
pub mod endpoint;
mod error;
pub mod export;
pub mod fatbin;
pub mod gpu;
pub mod memory;
pub mod proxy;
pub mod queue;
pub mod regcache;
#[cfg(test)]
mod testing;

pub mod post;
pub use backend::soft::controls as soft;

pub use backend::GpuRegPath;
pub use device::{Context, DeviceRequest, Selection};
pub use endpoint::{Endpoint, RemoteMemory};
pub use error::Error;
pub use memory::{Access, DeregisterError, HostBuffer, InFlight, Mr, Pd, QpInFlight};
pub use queue::{
    ConnectOptions, Cq, CqOptions, DcTarget, Dct, DctOptions, DoorbellMode, Drained, Modify, Qp,
    QpOptions, QpState, RingPlacement,
};
pub use regcache::{CachedMr, RegCache, RegCacheConfig, RegCacheStats};

/// The walk-through in `docs/host-api.md`, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../docs/host-api.md")]
struct HostApiWalkThrough;

/// README.md's host program, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;
