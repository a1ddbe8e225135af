//! gpuverbs: GPU-initiated RDMA for CUDA kernels (mlx5 work queues driven from the GPU), with a
//! software mlx5 NIC.
//!
//! The modules follow the control path:
//! - [`device`]: pick and open a device ([`Context`]), soft NIC or ConnectX, with the reason.
//! - [`memory`]: protection domains, host buffers, memory regions.
//! - [`queue`]: completion queues and RC queue pairs, doorbell modes, connection.
//! - [`export`]: the QP descriptor kernels drive (one layout shared with the CUDA headers).
//! - [`gpu`]: a CUDA device with the kernels loaded; mapping and export into it.
//! - [`cuda`], [`fatbin`]: the embedded kernels and the run-time-loaded CUDA driver.

pub mod cuda;
pub mod device;
mod error;
pub mod export;
pub mod fatbin;
pub mod gpu;
pub mod memory;
pub mod queue;

pub use device::{Context, DeviceRequest, Selection};
pub use error::Error;
pub use memory::{Access, HostBuffer, Mr, Pd};
pub use queue::{
    ConnectOptions, Cq, CqOptions, DoorbellMode, Qp, QpOptions, RemoteQp, RingPlacement,
};
