//! gpuverbs: GPU-initiated RDMA for CUDA kernels (mlx5 work queues driven from the GPU), with a
//! software mlx5 NIC.
//!
//! - [`cuda`]: the CUDA kernels embedded at build time, the run-time-loaded CUDA driver, and the
//!   pipeline self-test ([`cuda::pipeline_check`]).
//! - [`fatbin`]: a reader for CUDA fatbin containers (which SASS / PTX targets a fatbin carries).

pub mod cuda;
pub mod fatbin;
