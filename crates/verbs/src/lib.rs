//! The vocabulary every gpuverbs device and the host API share, below any one device: access
//! rights ([`Access`]) and where memory lives ([`MemKind`]), port GIDs ([`Gid`]),
//! device-visible buffers in host or device memory ([`DmaBuf`], [`DeviceMemory`]), doorbell
//! modes ([`DoorbellMode`]), the modes of completion queues ([`cq`]), QP states and their transitions
//! ([`qp`]), and the CPU initiator that drives any mlx5-format queue through its geometry
//! ([`initiator`]). Formats come from `prm` below it; the soft NIC and the ConnectX backend
//! build on it, and it names neither.

pub mod access;
pub mod buffer;
pub mod cq;
pub mod devmem;
pub mod doorbell;
pub mod gid;
pub mod initiator;
pub mod qp;

pub use access::{Access, MemKind};
pub use buffer::DmaBuf;
pub use cq::{CqInit, CqMode, CqeSize};
pub use devmem::{DeviceMemory, DeviceMemoryError, SimDeviceMemory};
pub use doorbell::DoorbellMode;
pub use gid::Gid;
pub use qp::{Modify, QpState, RtrAttr, RtsAttr};
