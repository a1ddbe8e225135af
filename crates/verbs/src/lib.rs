//! The vocabulary every gpuverbs device and the host API share, below any one device: access
//! rights ([`Access`]), device-visible buffers in host or device memory ([`DmaBuf`],
//! [`DeviceMemory`]), the modes of completion queues ([`cq`]), QP states and their transitions
//! ([`qp`]), and the CPU initiator that drives any mlx5-format queue through its geometry
//! ([`initiator`]). Formats come from `prm` below it; the soft NIC and the ConnectX backend
//! build on it, and it names neither.

pub mod access;
pub mod buffer;
pub mod cq;
pub mod devmem;
pub mod initiator;
pub mod qp;

pub use access::Access;
pub use buffer::DmaBuf;
pub use cq::{CqInit, CqMode, CqeSize};
pub use devmem::{DeviceMemory, DeviceMemoryError, SimDeviceMemory};
pub use qp::QpState;
