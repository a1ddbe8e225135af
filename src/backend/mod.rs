//! The device backends behind one seam. This file holds what every backend shares (how a
//! device is asked for, what was chosen, how a QP connects); [`seam`] is the ops table each
//! backend implements and [`geometry`] the queues' layout it hands up; below them, one room per
//! device kind: [`soft`] (the soft NIC) and [`mlx5`] (a ConnectX through rdma-core: the
//! provider's objects and its DEVX ones); on top, [`context`]: the open device, chosen among
//! the rooms, behind a [`seam::DeviceOps`] that everything above (memory, queues, export,
//! proxy) calls without knowing which room made it.
//!
//! Backends: the soft NIC (always available) and a ConnectX through rdma-core's libibverbs and
//! libmlx5 (run here on the emulated device of `gpuverbs emu`). A soft NIC reaches QPs of soft
//! NICs in other processes and on other hosts when it has a *wire port* (RoCEv2 over UDP,
//! `docs/wire.md`): [`soft::SOFTNIC_ADDR_ENV`], [`context::Context::open_wire`], or
//! [`context::Context::open_soft`] with `wire: Some(..)`. Its endpoints then carry the UDP port
//! (`Endpoint::udp_port`), and `Qp::connect` fills the device's peer table from the peer's
//! endpoint ([`context::Context::wire_addr`], `docs/host-api.md`).
//!
//! A room never names another room, nor anything above the backends.

pub(crate) mod context;
pub(crate) mod geometry;
pub(crate) mod mlx5;
pub(crate) mod seam;
pub(crate) mod soft;

use verbs::Access;

/// Environment variable that overrides device selection: `soft`/`softnic` (or a soft device
/// name such as `softnic0`), or an rdma-core device name such as `mlx5_0`.
pub const DEVICE_ENV: &str = "GPUVERBS_DEVICE";

/// Which kind of device backs a context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The in-process software mlx5 device.
    Soft,
    /// An mlx5 (ConnectX) device through rdma-core.
    Mlx5,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Soft => "soft NIC",
            Self::Mlx5 => "mlx5",
        })
    }
}

/// What was chosen, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Backend kind.
    pub kind: BackendKind,
    /// Device name.
    pub name: String,
    /// Why this device.
    pub reason: String,
}

impl std::fmt::Display for Selection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} ({})", self.kind, self.name, self.reason)
    }
}

/// How to pick a device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DeviceRequest {
    /// The best available (a ConnectX when rdma-core lists one and the backend exists, else the
    /// soft NIC); [`DEVICE_ENV`] overrides.
    #[default]
    Auto,
    /// A soft NIC.
    Soft,
    /// A device by name (`softnic*` or an rdma-core name).
    Named(String),
}

/// How GPU memory was registered on an rdma-core device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuRegPath {
    /// `ibv_reg_dmabuf_mr` with a dma-buf of the GPU pages.
    DmaBuf,
    /// `ibv_reg_mr` on the GPU address (nvidia-peermem).
    PeerMem,
}

/// How a QP connects to its peer.
#[derive(Clone, Copy, Debug)]
pub struct ConnectOptions {
    /// Rights peers get through this QP (REMOTE_WRITE/READ/ATOMIC); none by default.
    pub access: Access,
    /// Local ACK timeout exponent (4.096 µs · 2^timeout).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            access: Access::NONE,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
        }
    }
}
