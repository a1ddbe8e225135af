//! The soft NIC: a software mlx5 RC device that executes real WQE bytes and writes real CQEs.
//!
//! A [`Device`] owns protection domains, memory regions ([`mem`]), completion queues ([`cq`])
//! and RC queue pairs ([`qp`]), and runs an engine thread ([`engine`]) that notices doorbells,
//! reads WQEs from the SQ ring as a ConnectX would, checks them (the always-on sanitizer), moves
//! the bytes and writes CQEs. Devices in one process find each other by GID and connect their
//! QPs in loopback. [`initiator`] is a CPU client that drives a QP through its rings and
//! doorbells exactly as a GPU kernel does.
//!
//! Faithfulness is the point: every malformed WQE, bad key, range or right, missing receive and
//! bad doorbell becomes the error CQE a ConnectX would write, and the QP goes to ERR.
//!
//! Across processes and hosts, devices opened with a [`WireConfig`] speak RoCEv2 over UDP with
//! RC reliability ([`wire`], over the datagrams and the UDP port of [`net`]); [`pcap`] captures
//! what they send.
//!
//! Memory regions and rings may live in device (GPU) memory: the engine reaches them through a
//! [`DeviceMemory`] trait object supplied at registration ([`devmem`]), so this crate needs no
//! CUDA.

pub use verbs::buffer;
pub mod clock;
pub mod counters;
pub mod cq;
pub use verbs::devmem;
pub mod event;
pub mod mem;
pub mod net;
pub use net::pcap;
pub mod qp;
mod rc_state;
mod readahead;
pub mod sched;
mod shared;
pub mod srq;
mod staged;

mod completion;
mod dc;
mod device;
pub mod engine;
mod gather;
mod group;
pub mod gsi;
pub mod mcast;
pub mod outcome;
pub mod responder;
pub mod ud;
pub mod wire;

pub mod bench;
pub mod initiator;

pub use buffer::DmaBuf;
pub use counters::{CounterSnapshot, WireCounters};
pub use cq::{Cq, CqConfig, CqInit, CqMode, CqeSize};
pub use device::{Device, DeviceConfig};
pub use devmem::{DeviceMemory, DeviceMemoryError, SimDeviceMemory};
pub use event::{AsyncEvent, EventHandler};
pub use initiator::SoftQpInitiator;
pub use mem::{Access, IndirectConfig, MemKind, MrInfo, MwInfo, MwType, PdId};
pub use net::{Capture, WireConfig, WireError, WireFaults};
pub use qp::{
    DctConfig, DoorbellMode, Fault, Modify, Qp, QpConfig, QpState, RtrAttr, RtsAttr, Transport,
};
pub use srq::{Srq, SrqConfig, XrcSrqConfig, Xrcd};

pub use verbs::Gid;

/// Errors of the soft NIC's control path.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A parameter is out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// A QP state transition that the RC state machine does not allow.
    #[error("illegal QP transition {from:?} -> {to:?}")]
    IllegalTransition {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// A GID already used by another device in this process.
    #[error("GID {0} is already in use by another soft device")]
    GidInUse(Gid),
    /// No memory region with that key.
    #[error("no memory region with key {0:#x}")]
    NoSuchMr(u32),
    /// No memory window with that key.
    #[error("no memory window with key {0:#x}")]
    NoSuchMw(u32),
    /// The object is still in use.
    #[error("{0} is still in use")]
    Busy(&'static str),
    /// The engine thread could not be started.
    #[error("could not start the engine thread: {0}")]
    Spawn(#[from] std::io::Error),
    /// The wire port could not be set up, or the device has none.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// Device memory (a ring in GPU memory) failed while the device set it up.
    #[error(transparent)]
    DeviceMemory(#[from] DeviceMemoryError),
}
