//! The seam every backend implements, as rdma-core's providers fill an ops table: the device
//! ([`DeviceOps`]: PDs, CQs, what the port is), its PDs ([`PdOps`]: registrations, QPs), CQs
//! ([`CqOps`]), QPs ([`QpOps`]: state transitions, the device's progress) and DC targets
//! ([`DctOps`]). Everything a
//! layer above does with a queue besides these calls (export into a GPU, the CPU proxy, the CPU
//! initiator, a queue's state) is written once over the queue's [geometry](super::geometry).
//! Adding a NIC or a transport is one more implementation of these traits in a room of its own.

use super::geometry::{CqGeometry, QpGeometry};
use super::ConnectOptions;
use crate::Error;
use std::any::Any;
use std::fmt;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use verbs::{Access, CqInit, CqMode, DeviceMemory, DmaBuf, DoorbellMode, Gid, Modify, QpState};

/// A GPU whose memory a backend may place rings in (the host API's `Gpu` is one).
pub(crate) trait GpuRings {
    /// `len` bytes of the GPU's memory for a ring, device-visible; freed with the buffer.
    fn ring_buffer(&self, len: usize) -> Result<DmaBuf, Error>;
    /// A dma-buf of the GPU pages around `addr..addr+len` and the offset of `addr` in it, or
    /// why there is none.
    fn dmabuf(&self, addr: u64, len: u64) -> Result<(OwnedFd, u64), String>;
    /// The GPU's memory as a software device reaches it (CUDA copies).
    fn memory(&self) -> Arc<dyn DeviceMemory>;
}

/// The device behind a context.
pub(crate) trait DeviceOps: Send + Sync {
    /// The port's RoCE v2 GID.
    fn gid(&self) -> Gid;
    /// Its index in the port's GID table.
    fn gid_index(&self) -> u8;
    /// The path MTU the port offers (bytes).
    fn mtu(&self) -> u32;
    /// The UDP address a software device sends and receives RoCE v2 on, `None` for a NIC.
    fn wire_addr(&self) -> Option<SocketAddr>;
    /// The doorbell mode of a QP whose options leave it to the device, and why, given where
    /// its rings are (`rings_on_gpu`: GPU memory, as `rings_for_kernels` or the user put them).
    fn auto_doorbell(&self, rings_on_gpu: bool) -> (DoorbellMode, &'static str);
    /// Whether the device wants the rings of a queue that kernels drive in GPU memory, and why
    /// (what `RingPlacement::Auto` becomes when a GPU is given).
    fn rings_for_kernels(&self) -> (bool, &'static str);
    /// A protection domain.
    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>, Error>;
    /// A CQ as `spec` asks (depth already checked to be a power of two).
    fn create_cq(&self, spec: &CqSpec<'_>) -> Result<Arc<dyn CqOps>, Error>;
    /// The backend's own device object (what the soft backend's controls downcast).
    fn as_any(&self) -> &dyn Any;
}

/// What a CQ is asked to be.
pub(crate) struct CqSpec<'a> {
    pub depth: u32,
    pub mode: CqMode,
    pub init: CqInit,
    /// The GPU whose memory holds the ring, `None` for host memory.
    pub gpu: Option<&'a dyn GpuRings>,
}

/// What a QP is asked to be.
pub(crate) struct QpSpec<'a> {
    pub sq_blocks: u32,
    pub rq_wqes: u32,
    pub max_recv_sge: u32,
    pub max_inline: u32,
    /// Resolved (never `Auto`).
    pub doorbell: DoorbellMode,
    /// The GPU whose memory holds the SQ and RQ rings, `None` for host memory.
    pub gpu: Option<&'a dyn GpuRings>,
    /// Cross-channel master (`cd_master`): the QP may post WAIT WQEs on other QPs' CQs.
    pub cross_channel: bool,
}

impl QpSpec<'_> {
    /// Bytes per receive WQE: a power of two of 16-byte data segments, as the device reads
    /// them.
    pub(crate) fn rq_stride(&self) -> u32 {
        (self.max_recv_sge.clamp(1, 32) * 16).next_power_of_two()
    }
}

/// A registration a PD made: its keys, how GPU memory was reached, and the device's region,
/// deregistered when `handle` drops.
pub(crate) struct Registration {
    pub lkey: u32,
    pub rkey: u32,
    pub gpu_path: Option<super::GpuRegPath>,
    pub handle: Box<dyn Any + Send + Sync>,
}

/// A protection domain of a device.
pub(crate) trait PdOps: Send + Sync + fmt::Debug {
    /// Registers host memory.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid host memory until the registration's handle drops.
    unsafe fn reg_host(&self, addr: u64, len: u64, access: Access) -> Result<Registration, Error>;
    /// Registers `dptr..dptr+len` of `gpu`'s memory (which the caller keeps allocated while
    /// the registration lives).
    fn reg_gpu(
        &self,
        gpu: &dyn GpuRings,
        dptr: u64,
        len: u64,
        access: Access,
    ) -> Result<Registration, Error>;
    /// Registers device memory reached through `mem` (a software device's).
    fn reg_device_memory(
        &self,
        mem: Arc<dyn DeviceMemory>,
        dptr: u64,
        len: u64,
        access: Access,
    ) -> Result<Registration, Error>;
    /// An RC QP in RESET on CQs of the same device (else `Error::InvalidArgument`).
    fn create_qp(
        &self,
        spec: &QpSpec<'_>,
        send_cq: &Arc<dyn CqOps>,
        recv_cq: &Arc<dyn CqOps>,
    ) -> Result<Arc<dyn QpOps>, Error>;
    /// A DC initiator in RESET on `send_cq` (no receive side: `spec.rq_wqes` is 0).
    fn create_dci(
        &self,
        spec: &QpSpec<'_>,
        send_cq: &Arc<dyn CqOps>,
    ) -> Result<Arc<dyn QpOps>, Error>;
    /// A DC target, active, taking requests that present `t.key`.
    fn create_dct(&self, t: &DctSpec<'_>) -> Result<Arc<dyn DctOps>, Error>;
}

/// What a DC target is asked to be.
pub(crate) struct DctSpec<'a> {
    /// Where its receive completions go.
    pub cq: &'a Arc<dyn CqOps>,
    /// The DC access key initiators must present.
    pub key: u64,
    /// The remote rights initiators get.
    pub access: Access,
    /// Path MTU (bytes).
    pub mtu: u32,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
}

/// A DC target of a device.
pub(crate) trait DctOps: Send + Sync + fmt::Debug {
    /// Its number (DCTN), what initiators name.
    fn number(&self) -> u32;
    /// Its state (RTR while it serves).
    fn state(&self) -> QpState;
    /// Destroys the device's target now.
    fn destroy(&self);
}

/// A completion queue of a device.
pub(crate) trait CqOps: Send + Sync + fmt::Debug {
    fn cqn(&self) -> u32;
    fn depth(&self) -> u32;
    /// Its ring and doorbell record.
    fn geometry(&self) -> CqGeometry<'_>;
    /// The backend's own CQ (to check a QP's CQs are the device's; the soft controls).
    fn as_any(&self) -> &dyn Any;
}

/// The peer a QP connects to.
pub(crate) struct Remote<'a> {
    pub gid: Gid,
    pub qpn: u32,
    pub psn: u32,
    /// The path MTU both ends agree on.
    pub mtu: u32,
    /// The UDP address a software device's peer listens on, when its endpoint names one.
    pub udp: Option<SocketAddr>,
    /// Both ends hold packets behind a gap and resend selectively.
    pub selective_repeat: bool,
    /// How the peer is shown in errors.
    pub shown: &'a dyn fmt::Display,
}

/// What a device shows of a QP's progress (a software device shows it; a NIC's is inside it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Progress {
    /// SQ blocks the device has taken (its SQ consumer index).
    pub sq_consumed: u16,
    /// SQ blocks whose WQEs are finished (answered), at or behind `sq_consumed`.
    pub sq_finished: u16,
    /// Receive WQEs consumed.
    pub rq_consumed: u32,
}

/// A queue pair of a device.
pub(crate) trait QpOps: Send + Sync + fmt::Debug {
    fn qpn(&self) -> u32;
    /// Its state (ERR when the device cannot say).
    fn state(&self) -> QpState;
    /// RESET → INIT → RTR → RTS towards `remote`, with `psn` as the first PSN sent.
    fn connect(&self, remote: &Remote<'_>, psn: u32, o: &ConnectOptions) -> Result<(), Error>;
    /// A raw transition (a NIC may take only those without attributes: RESET, ERR).
    fn modify(&self, m: Modify) -> Result<(), Error>;
    /// A DC initiator: RESET → INIT → RTR → RTS at path MTU `mtu`, with `psn` as the first
    /// PSN (its targets are named per WQE); `Error::InvalidArgument` for any other QP.
    fn ready_dc(&self, mtu: u32, psn: u32, o: &ConnectOptions) -> Result<(), Error>;
    /// Makes a DC target whose software device listens on `udp` reachable from this initiator
    /// (a NIC routes by GID itself: nothing to do).
    fn reach(&self, gid: Gid, udp: SocketAddr, shown: &dyn fmt::Display) -> Result<(), Error>;
    /// Its rings, doorbell record and register (and its CPU-proxy word where the device keeps
    /// one).
    fn geometry(&self) -> QpGeometry<'_>;
    /// The device's progress, `None` where it does not show it.
    fn progress(&self) -> Option<Progress>;
    /// Still the device's QP (not destroyed).
    fn is_live(&self) -> bool;
    /// Destroys the device's QP now (a NIC's goes when the last holder of it lets go).
    fn destroy(&self);
    /// The backend's own QP (the soft controls).
    fn as_any(&self) -> &dyn Any;
}
