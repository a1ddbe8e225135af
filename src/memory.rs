//! Protection domains, host buffers and memory regions.
//!
//! Regions hold their PD (and so the device) alive; a region keeps its buffer alive, and its
//! drop deregisters it, waiting for any device copy in flight (the device never touches freed
//! memory). Access rights default to the minimum: local write only; remote rights only when
//! asked.
//!
//! Regions may be host memory ([`Pd::register`]) or GPU memory ([`Pd::register_device_mem`],
//! [`Pd::register_gpu`]); the soft NIC moves the bytes of GPU regions with CUDA copies
//! ([`crate::gpu::Gpu::device_memory`]); an rdma-core device gets them through a dma-buf of
//! the GPU pages, else through the GPU address (nvidia-peermem) ([`Mr::gpu_path`]).
//!
//! # Lifetimes
//!
//! Every registration has a *generation* ([`Mr::generation`]), a process-wide serial number
//! that a [`crate::RemoteMemory`] made with [`crate::RemoteMemory::export_mr`] carries to the
//! peer: the same memory registered again has a new generation and a new rkey, and a peer that
//! still uses the old descriptor gets a REMOTE_ACCESS error completion (the old key is a bad
//! key), never the new region.
//!
//! A region cannot be freed under work in flight: it keeps its memory alive until it is
//! deregistered, and the device checks the key on every access, so a WQE that names a region
//! already gone completes with an error CQE instead of touching freed memory. To end a region
//! only once the WQEs posted before are done, call [`Mr::deregister`]: it waits, at most its
//! timeout, until every QP of the PD has executed the WQEs posted before the call, and otherwise
//! gives the region back in a [`DeregisterError`] that names the QPs still busy. A plain drop
//! waits too, at most 100 ms, then deregisters all the same, logging a warning that names the
//! QPs still busy (on the mlx5 backend, where the device's progress is not visible, it cannot
//! wait and deregisters at once).

use crate::device::{Backend, Context};
use crate::gpu::DeviceMem;
use crate::queue::QpState;
use crate::regcache::RegCache;
use crate::Error;
use softnic::devmem::DeviceMemory;
use softnic::DmaBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

pub use softnic::{Access, MemKind};

/// A protection domain. Clones share it (and its registration cache, [`Pd::reg_cache`]).
#[derive(Clone)]
pub struct Pd {
    pub(crate) ctx: Context,
    pub(crate) dev: PdDev,
    /// The QPs of this PD (what [`Mr::deregister`] waits for).
    pub(crate) qps: Arc<PdQps>,
    /// The registration cache ([`Pd::register_cached`]).
    pub(crate) cache: RegCache,
}

/// The QPs created in a PD, as the device holds them (weakly: a destroyed QP drops out).
#[derive(Default)]
pub(crate) struct PdQps(Mutex<Vec<TrackedQp>>);

/// One QP of a PD.
#[derive(Clone)]
pub(crate) enum TrackedQp {
    Soft(Weak<softnic::Qp>),
    Mlx5(Weak<crate::mlx5::Qp>),
}

impl PdQps {
    /// Records a new QP of the PD (and forgets the ones gone).
    pub(crate) fn add(&self, qp: TrackedQp) {
        let mut v = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        v.retain(|q| match q {
            TrackedQp::Soft(w) => w.strong_count() > 0,
            TrackedQp::Mlx5(w) => w.strong_count() > 0,
        });
        v.push(qp);
    }

    fn list(&self) -> Vec<TrackedQp> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// What a region holds of its PD: the device, the PD's device object and its QPs (not the
/// registration cache, which holds regions itself).
#[derive(Clone)]
pub(crate) struct RegionPd {
    pub(crate) ctx: Context,
    #[allow(dead_code)]
    pub(crate) dev: PdDev,
    pub(crate) qps: Arc<PdQps>,
}

/// The device's PD.
#[derive(Clone)]
pub(crate) enum PdDev {
    Soft(softnic::PdId),
    Mlx5(Arc<crate::mlx5::Pd>),
}

impl std::fmt::Debug for Pd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.dev {
            PdDev::Soft(id) => write!(f, "Pd({:?}, {id:?})", self.ctx),
            PdDev::Mlx5(_) => write!(f, "Pd({:?})", self.ctx),
        }
    }
}

impl Context {
    /// Allocates a protection domain.
    ///
    /// # Panics
    /// When [`Context::try_alloc_pd`] fails (only an rdma-core device can refuse), with the
    /// device's error.
    pub fn alloc_pd(&self) -> Pd {
        match self.try_alloc_pd() {
            Ok(pd) => pd,
            Err(e) => panic!("Context::alloc_pd: {e}"),
        }
    }

    /// Allocates a protection domain, or the device's error.
    pub fn try_alloc_pd(&self) -> Result<Pd, Error> {
        let dev = match &self.inner.backend {
            Backend::Soft(d) => PdDev::Soft(d.alloc_pd()),
            Backend::Mlx5(d) => PdDev::Mlx5(d.alloc_pd()?),
        };
        Ok(Pd {
            ctx: self.clone(),
            dev,
            qps: Arc::default(),
            cache: RegCache::default(),
        })
    }
}

/// Page-aligned host memory that the device (and, once mapped, a GPU) can address.
///
/// Its length is what was asked for; the allocation behind it is rounded up to whole pages
/// (at least one), so no two buffers share a page (each can be pinned or mapped on its own).
#[derive(Clone, Debug)]
pub struct HostBuffer {
    pub(crate) buf: Arc<DmaBuf>,
    len: usize,
    /// The allocation's serial number ([`HostBuffer::allocation_id`]).
    serial: u64,
}

/// Serial numbers of host allocations (0 is never used).
static NEXT_ALLOCATION: AtomicU64 = AtomicU64::new(1);

/// A page-aligned, zeroed host allocation, freed when the buffer that wraps it is dropped.
struct PageAlloc {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the allocation is plain host memory owned by this value; it is only freed in `drop`
// and every access goes through the `DmaBuf` that wraps it.
unsafe impl Send for PageAlloc {}
// SAFETY: as above; `&PageAlloc` gives no access to the memory.
unsafe impl Sync for PageAlloc {}

impl Drop for PageAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `HostBuffer::try_new` with exactly this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes (`len()` is `len`; 0 is an empty buffer).
    ///
    /// # Panics
    /// When the allocator cannot serve `len` bytes (see [`HostBuffer::try_new`]), with a
    /// message that says so.
    pub fn new(len: usize) -> Self {
        match Self::try_new(len) {
            Ok(b) => b,
            Err(e) => panic!("HostBuffer::new({len}): {e}"),
        }
    }

    /// Allocates `len` zeroed bytes, or [`Error::HostAlloc`] when `len` rounded up to whole
    /// pages does not fit in the address space or the allocator has no memory for it.
    pub fn try_new(len: usize) -> Result<Self, Error> {
        use softnic::buffer::PAGE;
        let refuse = |reason| Error::HostAlloc { len, reason };
        let bytes = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .ok_or_else(|| refuse("larger than the address space"))?;
        let layout = std::alloc::Layout::from_size_align(bytes, PAGE)
            .map_err(|_| refuse("larger than the largest allocation (isize::MAX bytes)"))?;
        // SAFETY: the layout has a non-zero size (at least one page).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(nn) = std::ptr::NonNull::new(ptr) else {
            return Err(refuse("the allocator has no memory for it"));
        };
        let owner = PageAlloc { ptr, layout };
        // SAFETY: `ptr..ptr+bytes` is a fresh, page-aligned, zeroed allocation owned by
        // `owner`, which the buffer keeps until it is dropped; nothing else refers to it.
        let buf = unsafe { DmaBuf::from_external(nn, bytes, Box::new(owner)) };
        Ok(Self::wrap(buf, len))
    }

    fn wrap(buf: DmaBuf, len: usize) -> Self {
        Self {
            buf: Arc::new(buf),
            len,
            serial: NEXT_ALLOCATION.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A new buffer over the memory of `other` (same address, a new allocation identity),
    /// which it keeps alive: what an allocator that hands freed memory out again does.
    #[cfg(test)]
    pub(crate) fn alias_of(other: &HostBuffer) -> Self {
        let nn = std::ptr::NonNull::new(other.addr() as *mut u8).expect("a live buffer");
        // SAFETY: `other`'s whole allocation (page-aligned, `other.buf.len()` bytes), kept
        // alive by the owner; the new buffer gives the same raw access `other` gives.
        let buf = unsafe { DmaBuf::from_external(nn, other.buf.len(), Box::new(other.clone())) };
        Self::wrap(buf, other.len)
    }

    /// The identity of the allocation behind this buffer: a serial number unique within the
    /// process and never reused, shared by the buffer's clones. A buffer allocated after
    /// another was freed has a new identity even when it gets the same address (the
    /// registration cache keys on it, [`Pd::register_cached`]).
    pub fn allocation_id(&self) -> u64 {
        self.serial
    }

    /// Host address of the first byte.
    pub fn addr(&self) -> u64 {
        self.buf.addr()
    }
    /// Length in bytes (what was asked for).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    fn check(&self, what: &str, off: usize, n: usize) {
        assert!(
            off.checked_add(n).is_some_and(|e| e <= self.len),
            "HostBuffer::{what}: {off}+{n} is beyond its {} bytes",
            self.len
        );
    }
    /// Copies bytes out.
    ///
    /// # Panics
    /// When `off + dst.len()` is beyond `len()`.
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        self.check("read", off, dst.len());
        self.buf.read(off, dst)
    }
    /// Copies bytes in.
    ///
    /// # Panics
    /// When `off + src.len()` is beyond `len()`.
    pub fn write(&self, off: usize, src: &[u8]) {
        self.check("write", off, src.len());
        self.buf.write(off, src)
    }
    /// Fills a range with one byte.
    ///
    /// # Panics
    /// When `off + n` is beyond `len()`.
    pub fn fill(&self, off: usize, n: usize, byte: u8) {
        self.check("fill", off, n);
        self.buf.fill(off, n, byte)
    }
    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.read(0, &mut v);
        v
    }
    /// The 8-byte word at `off` as an atomic (for signal words).
    ///
    /// # Panics
    /// When the word is beyond `len()` or `off` is not 8-byte aligned.
    pub fn atomic_u64(&self, off: usize) -> &std::sync::atomic::AtomicU64 {
        self.check("atomic_u64", off, 8);
        self.buf.atomic_u64(off)
    }
}

/// What a region keeps alive.
#[derive(Debug)]
pub(crate) enum Keep {
    /// Nothing: the caller keeps the memory valid.
    Nothing,
    Host(#[allow(dead_code)] HostBuffer),
    Device(#[allow(dead_code)] DeviceMem),
}

/// A registered memory region.
///
/// Dropping it waits (at most 100 ms, where the device shows its progress) for the WQEs posted
/// before, then deregisters it, with a warning if some are still in flight; [`Mr::deregister`]
/// waits as long as asked and gives the region back instead.
pub struct Mr {
    pd: RegionPd,
    /// Range, rights and kind; `key` is the lkey.
    info: softnic::MrInfo,
    rkey: u32,
    /// How GPU memory was registered on an rdma-core device.
    gpu_path: Option<crate::mlx5::GpuRegPath>,
    /// This registration's serial number ([`Mr::generation`]).
    generation: u32,
    /// Set when the region's drop need not look for work in flight (already waited for).
    quiet: bool,
    /// The rdma-core registration (deregistered on drop), on the mlx5 backend.
    _mlx5: Option<MlxMr>,
    _keep: Keep,
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("ctx", &self.pd.ctx)
            .field("info", &self.info)
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .field("generation", &self.generation)
            .field("keep", &self._keep)
            .finish()
    }
}

/// Registration serial numbers ([`Mr::generation`]; 0 is never used: it means "unknown" in a
/// [`crate::RemoteMemory`]).
static NEXT_GENERATION: AtomicU32 = AtomicU32::new(1);

fn next_generation() -> u32 {
    loop {
        let g = NEXT_GENERATION.fetch_add(1, Ordering::Relaxed);
        if g != 0 {
            return g;
        }
    }
}

/// An rdma-core region owner (opaque in Debug output).
struct MlxMr(#[allow(dead_code)] crate::mlx5::Mr);

impl std::fmt::Debug for MlxMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("mlx5 MR")
    }
}

impl Mr {
    /// The local key.
    pub fn lkey(&self) -> prm::Lkey {
        prm::Lkey(self.info.key)
    }
    /// The remote key (a capability: hand it out only on purpose).
    pub fn rkey(&self) -> prm::Rkey {
        prm::Rkey(self.rkey)
    }
    /// First byte.
    pub fn addr(&self) -> u64 {
        self.info.addr
    }
    /// Length.
    pub fn len(&self) -> u64 {
        self.info.len
    }
    /// Whether empty (never).
    pub fn is_empty(&self) -> bool {
        self.info.len == 0
    }
    /// Rights.
    pub fn access(&self) -> Access {
        self.info.access
    }
    /// Where its bytes live: host memory or GPU memory.
    pub fn kind(&self) -> MemKind {
        self.info.kind
    }
    /// For GPU memory on an rdma-core device: whether it was registered through a dma-buf or
    /// through nvidia-peermem (`None` elsewhere).
    pub fn gpu_path(&self) -> Option<crate::mlx5::GpuRegPath> {
        self.gpu_path
    }
    /// An SGE over `off..off+len` of this region.
    pub fn sge(&self, off: u64, len: u32) -> prm::Sge {
        prm::Sge {
            addr: self.info.addr + off,
            len,
            lkey: self.lkey(),
        }
    }
    /// The remote address of `off` in this region, with its rkey.
    pub fn remote(&self, off: u64) -> prm::RemoteAddr {
        prm::RemoteAddr {
            addr: self.info.addr + off,
            rkey: self.rkey(),
        }
    }
    /// This registration's generation: a serial number, unique within the process (never 0),
    /// that no other registration has, not even one of the same memory. A
    /// [`crate::RemoteMemory`] made by [`crate::RemoteMemory::export_mr`] carries it, so a
    /// peer can tell a descriptor of this registration from one of an earlier registration of
    /// the same address (whose rkey is dead).
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Deregisters the region once the WQEs posted before this call are done: waits, at most
    /// `timeout`, until every QP of the region's PD has executed (or flushed, or dropped by a
    /// reset) the send WQEs rung before the call — by a CPU initiator, a kernel through an
    /// exported descriptor, or the CPU proxy — then deregisters and returns `Ok`.
    ///
    /// When the wait ends with WQEs still in flight, nothing is deregistered: the region comes
    /// back inside the [`DeregisterError`] ([`DeregisterError::into_mr`]), with the QPs still
    /// busy ([`InFlight`]); drop it to deregister anyway (the WQEs that use it then complete
    /// with error CQEs), or keep it and try again. Converting the error into [`Error`]
    /// (`?`) drops the region.
    ///
    /// What it watches is the device's SQ consumer index against the producer index rung (or
    /// published to the CPU proxy) at the call; WQEs posted after the call are not waited for.
    /// A destroyed QP has nothing in flight, nor one moved to RESET (which drops its WQEs);
    /// WQEs posted to a QP below RTS wait until it reaches RTS (so the wait runs out unless
    /// something moves it there, or resets it). On the mlx5
    /// backend the device's SQ progress cannot be observed: a QP of the PD that is not in
    /// RESET is reported at once ([`QpInFlight::blocks`] is `None`) without waiting. Over the
    /// soft NIC's wire (a peer in another process) a WQE counts once its answer (ACK, READ
    /// response, atomic ACK) has arrived.
    pub fn deregister(mut self, timeout: Duration) -> Result<(), DeregisterError> {
        match self.wait_idle(timeout) {
            Ok(()) => {
                self.quiet = true;
                Ok(())
            }
            Err(report) => Err(DeregisterError {
                mr: Box::new(self),
                report,
            }),
        }
    }

    /// Waits, at most `timeout`, until every QP of the region's PD has executed the send WQEs
    /// rung before the call ([`Mr::deregister`] says what counts); returns at once what is in
    /// flight when only unobservable (mlx5) QPs are left.
    pub(crate) fn wait_idle(&self, timeout: Duration) -> Result<(), InFlight> {
        self.wait_for(timeout, true)
    }

    /// Waits, at most `timeout`, until the QPs of the PD have executed the WQEs posted before
    /// the call; `unobservable`: also report (at once) the QPs whose progress the device does
    /// not show (mlx5).
    fn wait_for(&self, timeout: Duration, unobservable: bool) -> Result<(), InFlight> {
        let start = Instant::now();
        let mut watch = SqWatch::new(&self.pd.ctx, &self.pd.qps, unobservable);
        let mut pause = Duration::from_micros(1);
        loop {
            watch.poll();
            if watch.pending.is_empty() {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout || watch.pending.iter().all(|p| p.blocks.is_none()) {
                return Err(InFlight {
                    lkey: self.info.key,
                    waited,
                    qps: watch.report(),
                });
            }
            std::thread::sleep(pause.min(timeout - waited));
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Marks the region as already waited for (its drop logs nothing).
    pub(crate) fn set_quiet(&mut self) {
        self.quiet = true;
    }
}

/// A QP that still had WQEs in flight when a bounded wait for them ended
/// ([`Mr::deregister`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpInFlight {
    /// The QP number.
    pub qpn: u32,
    /// Its state when the wait ended.
    pub state: QpState,
    /// SQ blocks (64 bytes) of the WQEs posted before the wait that the device had not yet
    /// executed; `None` where the device cannot say (the mlx5 backend).
    pub blocks: Option<u32>,
}

impl std::fmt::Display for QpInFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QP {:#x} ({:?}): ", self.qpn, self.state)?;
        match self.blocks {
            Some(n) => write!(f, "{n} SQ block(s) not executed")?,
            None => f.write_str("SQ progress not observable on the mlx5 backend")?,
        }
        if matches!(self.state, QpState::Init | QpState::Rtr) {
            f.write_str(", waiting for RTS")?;
        }
        Ok(())
    }
}

/// What was still in flight when a bounded wait ended.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "memory region with lkey {lkey:#x} still has WQEs in flight after {waited:?}: {}",
    qps.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
)]
pub struct InFlight {
    /// The region's lkey.
    pub lkey: u32,
    /// How long the wait ran.
    pub waited: Duration,
    /// The QPs of the PD that still had WQEs posted before the wait in flight.
    pub qps: Vec<QpInFlight>,
}

/// [`Mr::deregister`] ran out of time: the region, not deregistered, and what was in flight.
#[derive(Debug, thiserror::Error)]
#[error("{report}")]
pub struct DeregisterError {
    mr: Box<Mr>,
    report: InFlight,
}

impl DeregisterError {
    /// What was still in flight.
    pub fn report(&self) -> &InFlight {
        &self.report
    }
    /// The region, still registered (drop it to deregister anyway, or try again).
    pub fn into_mr(self) -> Mr {
        *self.mr
    }
    /// Both.
    pub fn into_parts(self) -> (Mr, InFlight) {
        (*self.mr, self.report)
    }
}

impl From<DeregisterError> for Error {
    /// The report; the region is dropped (deregistered at once).
    fn from(e: DeregisterError) -> Self {
        let (mut mr, report) = e.into_parts();
        mr.quiet = true;
        drop(mr);
        Error::InFlight(report)
    }
}

/// One QP whose WQEs posted before a wait are watched.
struct Watched {
    qp: TrackedQp,
    qpn: u32,
    state: QpState,
    /// Blocks still to execute (`None`: not observable).
    blocks: Option<u32>,
    /// The consumer index last seen.
    ci: u16,
}

/// The QPs of a PD with WQEs in flight, watched until the device has executed them.
struct SqWatch {
    dev: Option<Arc<softnic::Device>>,
    pending: Vec<Watched>,
}

/// A live soft QP's consumer index and how many blocks rung (or published to the CPU proxy)
/// it has not executed yet; `None` for a QP that is gone (destroyed: it runs nothing more).
fn soft_progress(dev: &softnic::Device, q: &Arc<softnic::Qp>) -> Option<(u16, u32)> {
    if !dev.qp(q.qpn()).is_some_and(|d| Arc::ptr_eq(&d, q)) {
        return None;
    }
    // The finished index first: WQEs it passes meanwhile only make the wait longer. (WQEs on
    // the wire count until their answers arrive.)
    let ci = q.sq_finished();
    let pi = crate::queue::sq_producer(q) as u16;
    let ahead = u32::from(pi.wrapping_sub(ci));
    // More than a ring ahead: not a producer the device will run (a record from before a
    // reset, or garbage), so nothing in flight.
    Some((ci, if ahead > q.sq_blocks() { 0 } else { ahead }))
}

impl SqWatch {
    /// The QPs of `qps` with send WQEs rung (or published to the CPU proxy) and not yet
    /// executed, now (in any state: WQEs posted in RESET, INIT or RTR run once the QP reaches
    /// RTS); with `unobservable`, also every mlx5 QP not in RESET (whose progress the device
    /// does not show).
    fn new(ctx: &Context, qps: &PdQps, unobservable: bool) -> Self {
        let dev = ctx.soft_device().cloned();
        let mut pending = Vec::new();
        for t in qps.list() {
            match &t {
                TrackedQp::Soft(w) => {
                    let (Some(q), Some(d)) = (w.upgrade(), dev.as_ref()) else {
                        continue;
                    };
                    let Some((ci, ahead)) = soft_progress(d, &q) else {
                        continue;
                    };
                    if ahead > 0 {
                        pending.push(Watched {
                            qpn: q.qpn(),
                            qp: t.clone(),
                            state: q.state(),
                            blocks: Some(ahead),
                            ci,
                        });
                    }
                }
                TrackedQp::Mlx5(w) => {
                    let Some(q) = w.upgrade().filter(|_| unobservable) else {
                        continue;
                    };
                    let state = mlx5_state(&q);
                    if state == QpState::Reset {
                        continue;
                    }
                    pending.push(Watched {
                        qpn: q.qpn,
                        qp: t.clone(),
                        state,
                        blocks: None,
                        ci: 0,
                    });
                }
            }
        }
        Self { dev, pending }
    }

    /// Takes the device's progress into account; drops the QPs that are done: destroyed, or
    /// whose consumer index has moved past the WQEs watched, or that have nothing rung left
    /// to execute (everything before is executed, or was dropped by a reset).
    fn poll(&mut self) {
        let dev = self.dev.clone();
        self.pending.retain_mut(|p| match &p.qp {
            TrackedQp::Soft(w) => {
                let (Some(q), Some(d)) = (w.upgrade(), dev.as_ref()) else {
                    return false;
                };
                let Some((ci, ahead)) = soft_progress(d, &q) else {
                    return false;
                };
                p.state = q.state();
                let done = u32::from(ci.wrapping_sub(p.ci));
                p.ci = ci;
                let left = p.blocks.unwrap_or(0).saturating_sub(done).min(ahead);
                p.blocks = Some(left);
                left > 0
            }
            TrackedQp::Mlx5(w) => {
                let Some(q) = w.upgrade() else { return false };
                p.state = mlx5_state(&q);
                p.state != QpState::Reset
            }
        });
    }

    fn report(&self) -> Vec<QpInFlight> {
        self.pending
            .iter()
            .map(|p| QpInFlight {
                qpn: p.qpn,
                state: p.state,
                blocks: p.blocks,
            })
            .collect()
    }
}

/// An mlx5 QP's state (ERR when the query fails).
fn mlx5_state(q: &crate::mlx5::Qp) -> QpState {
    match q.state() {
        Ok(0) => QpState::Reset,
        Ok(1) => QpState::Init,
        Ok(2) => QpState::Rtr,
        Ok(3) => QpState::Rts,
        _ => QpState::Err,
    }
}

impl Pd {
    /// Registers a host buffer with local write access only.
    pub fn register(&self, buf: &HostBuffer) -> Result<Mr, Error> {
        self.register_with(buf, Access::LOCAL_WRITE)
    }

    /// Registers a host buffer with the given rights.
    pub fn register_with(&self, buf: &HostBuffer, access: Access) -> Result<Mr, Error> {
        self.register_host_range(buf, 0, buf.len() as u64, access)
    }

    /// Registers `off..off+len` of a host buffer (inside its allocation, which is whole
    /// pages) with the given rights; the region keeps the buffer alive.
    pub(crate) fn register_host_range(
        &self,
        buf: &HostBuffer,
        off: u64,
        len: u64,
        access: Access,
    ) -> Result<Mr, Error> {
        if off
            .checked_add(len)
            .is_none_or(|e| e > buf.buf.len() as u64)
        {
            return Err(Error::InvalidArgument(format!(
                "{off}+{len} is beyond the buffer's {} bytes",
                buf.buf.len()
            )));
        }
        // SAFETY: the range lies in the buffer's allocation, and the region keeps a clone of
        // the buffer, so the memory outlives the registration (which ends in `Mr::drop`).
        let mut mr = unsafe { self.register_raw(buf.addr() + off, len, access)? };
        mr._keep = Keep::Host(buf.clone());
        Ok(mr)
    }

    /// Registers raw host memory.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid host memory until the returned region is dropped.
    pub unsafe fn register_raw(&self, addr: u64, len: u64, access: Access) -> Result<Mr, Error> {
        let (info, rkey, mlx5) = match (&self.ctx.inner.backend, &self.dev) {
            (Backend::Soft(d), PdDev::Soft(id)) => {
                // SAFETY: forwarded contract.
                let info = unsafe { d.reg_host(*id, addr, len, access)? };
                (info, info.key, None)
            }
            (Backend::Mlx5(_), PdDev::Mlx5(pd)) => {
                if len == 0 {
                    return Err(Error::InvalidArgument("an empty memory region".into()));
                }
                // SAFETY: forwarded contract.
                let mr = unsafe { pd.reg_host(addr, len, access)? };
                let info = softnic::MrInfo {
                    key: mr.lkey,
                    pd: softnic::PdId(0),
                    addr,
                    len,
                    access,
                    kind: MemKind::Host,
                };
                (info, mr.rkey, Some(MlxMr(mr)))
            }
            _ => unreachable!("a PD belongs to its context's backend"),
        };
        Ok(self.new_mr(info, rkey, mlx5, Keep::Nothing))
    }

    /// A region of this PD, with a new generation.
    fn new_mr(&self, info: softnic::MrInfo, rkey: u32, mlx5: Option<MlxMr>, keep: Keep) -> Mr {
        Mr {
            pd: RegionPd {
                ctx: self.ctx.clone(),
                dev: self.dev.clone(),
                qps: self.qps.clone(),
            },
            info,
            rkey,
            gpu_path: None,
            generation: next_generation(),
            quiet: false,
            _mlx5: mlx5,
            _keep: keep,
        }
    }

    /// Registers GPU memory: `dptr..dptr+len` must lie in one device-memory allocation
    /// (`cuMemAlloc`, [`crate::gpu::Gpu::alloc`]) of a [`crate::gpu::Gpu`] open in this
    /// process, which the caller keeps allocated while the region exists
    /// ([`Pd::register_device_mem`] keeps it for you). The device reads and writes the region
    /// only through that GPU's CUDA copies ([`crate::gpu::Gpu::device_memory`]), never with
    /// host loads and stores; if the memory is freed under the region, transfers fail with
    /// error CQEs (or land in whatever GPU memory reuses the addresses).
    ///
    /// Errors: `Error::Unsupported` when no `Gpu` is open, `Error::InvalidArgument` when the
    /// range is not device memory of an open one, the device's checks (empty range, remote
    /// write or atomic without local write).
    pub fn register_gpu(&self, dptr: u64, len: u64, access: Access) -> Result<Mr, Error> {
        let gpu = crate::gpu::owner_of(dptr, len)?;
        self.register_on_gpu(&gpu, dptr, len, access, Keep::Nothing)
    }

    /// Registers all of `mem` (GPU memory); the region keeps it allocated.
    pub fn register_device_mem(&self, mem: &DeviceMem, access: Access) -> Result<Mr, Error> {
        let keep = Keep::Device(mem.clone());
        self.register_on_gpu(mem.gpu(), mem.ptr(), mem.len() as u64, access, keep)
    }

    /// Registers GPU memory of `gpu`: on the soft NIC through the GPU's copies; on an
    /// rdma-core device through a dma-buf of its pages (`ibv_reg_dmabuf_mr`), else the GPU
    /// address itself (`ibv_reg_mr`, nvidia-peermem).
    pub(crate) fn register_on_gpu(
        &self,
        gpu: &crate::gpu::Gpu,
        dptr: u64,
        len: u64,
        access: Access,
        keep: Keep,
    ) -> Result<Mr, Error> {
        let PdDev::Mlx5(pd) = &self.dev else {
            return self.register_device(gpu.device_memory(), dptr, len, access, keep);
        };
        if len == 0 {
            return Err(Error::InvalidArgument("an empty memory region".into()));
        }
        let dmabuf = gpu.dmabuf(dptr, len).map_err(|e| e.to_string());
        let (mr, path) = pd.reg_gpu(dptr, len, access, dmabuf)?;
        let info = softnic::MrInfo {
            key: mr.lkey,
            pd: softnic::PdId(0),
            addr: dptr,
            len,
            access,
            kind: MemKind::Device,
        };
        let rkey = mr.rkey;
        let mut region = self.new_mr(info, rkey, Some(MlxMr(mr)), keep);
        region.gpu_path = Some(path);
        Ok(region)
    }

    /// Registers device memory reached through `mem` (the soft NIC only).
    pub(crate) fn register_device(
        &self,
        mem: Arc<dyn DeviceMemory>,
        dptr: u64,
        len: u64,
        access: Access,
        keep: Keep,
    ) -> Result<Mr, Error> {
        let info = match (&self.ctx.inner.backend, &self.dev) {
            (Backend::Soft(d), PdDev::Soft(id)) => d.reg_device(*id, dptr, len, access, mem)?,
            _ => {
                return Err(Error::Unsupported(
                    "a DeviceMemory region on an rdma-core device (register GPU memory with \
                     Pd::register_gpu or Pd::register_device_mem)"
                        .into(),
                ))
            }
        };
        Ok(self.new_mr(info, info.key, None, keep))
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

/// How long dropping a region waits for the WQEs posted before it (on a device that shows its
/// progress) before it deregisters all the same.
const DROP_WAIT: Duration = Duration::from_millis(100);

impl Drop for Mr {
    fn drop(&mut self) {
        if !self.quiet {
            // a bounded wait for the WQEs posted before (where the device shows its progress),
            // then a report of what is still in flight
            if let Err(busy) = self.wait_for(DROP_WAIT, false) {
                let qps: Vec<String> = busy.qps.iter().map(ToString::to_string).collect();
                tracing::warn!(
                    lkey = self.info.key,
                    waited = ?busy.waited,
                    in_flight = %qps.join("; "),
                    "memory region dropped while QPs of its PD still have WQEs in flight: \
                     those that use it complete with error CQEs (Mr::deregister waits longer \
                     and gives the region back)"
                );
            }
        }
        match &self.pd.ctx.inner.backend {
            Backend::Soft(d) => {
                if let Err(e) = d.dereg(self.info.key) {
                    tracing::warn!(key = self.info.key, error = %e, "deregistration failed");
                }
            }
            // the rdma-core registration ends when `mlx5` drops
            Backend::Mlx5(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ConnectOptions, CqOptions, DeviceRequest, QpOptions};
    use prm::wqe::{CtrlFlags, Local, Op};
    use softnic::initiator::RingMode;
    use softnic::SimDeviceMemory;
    use std::time::Duration;

    const T: Duration = Duration::from_secs(10);
    const RIGHTS: Access = Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0);

    /// Two soft NICs of this process, a PD and a QP on each (in RESET: `connect` them).
    struct Two {
        a: Context,
        pa: Pd,
        pb: Pd,
        qa: crate::Qp,
        qb: crate::Qp,
    }

    fn two() -> Two {
        let (a, b) = (
            Context::open(DeviceRequest::Soft).unwrap(),
            Context::open(DeviceRequest::Soft).unwrap(),
        );
        let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
        let (ca, cb) = (
            a.create_cq(CqOptions::default()).unwrap(),
            b.create_cq(CqOptions::default()).unwrap(),
        );
        let qa = pa.create_qp(QpOptions::new(&ca, &ca)).unwrap();
        let qb = pb.create_qp(QpOptions::new(&cb, &cb)).unwrap();
        Two { a, pa, pb, qa, qb }
    }

    impl Two {
        fn connect(&self) {
            let o = ConnectOptions {
                access: Access::REMOTE_WRITE,
                ..Default::default()
            };
            self.qa.connect(&self.qb.endpoint(), o).unwrap();
            self.qb.connect(&self.qa.endpoint(), o).unwrap();
        }
        /// Whether key `k` is a live region of side A's device.
        fn a_has(&self, k: prm::Lkey) -> bool {
            self.a.soft_device().unwrap().mr(k.0).is_some()
        }
    }

    /// A signaled WRITE of `len` bytes of `src` to `dst`, posted and rung.
    fn write(ini: &mut softnic::initiator::Initiator, src: prm::Sge, dst: prm::RemoteAddr) {
        let op = Op::Write {
            remote: dst,
            local: Local::Sges(&[src]),
            imm: None,
        };
        ini.post_and_ring(&op, CtrlFlags::SIGNALED).unwrap();
    }

    fn syndrome(c: &prm::Completion) -> Option<prm::Syndrome> {
        match c {
            prm::Completion::Error(e) => e.syndrome(),
            _ => None,
        }
    }

    #[test]
    fn a_region_registered_again_has_a_new_generation_and_rkey_and_the_old_descriptor_fails() {
        let t = two();
        t.connect();
        let dst = HostBuffer::new(4096);
        let old = t.pb.register_with(&dst, RIGHTS).unwrap();
        // what the peer holds: the descriptor, through its wire form
        let stale =
            crate::RemoteMemory::from_bytes(&crate::RemoteMemory::export_mr(&old).to_bytes())
                .unwrap();
        assert_eq!(
            (stale.addr(), stale.len(), stale.rkey(), stale.generation()),
            (old.addr(), old.len(), old.rkey().0, old.generation())
        );
        assert_ne!(stale.generation(), 0);
        old.deregister(T).unwrap();
        let new = t.pb.register_with(&dst, RIGHTS).unwrap();
        assert_eq!(
            new.addr(),
            stale.addr(),
            "the same memory, at the same address"
        );
        assert_ne!(new.generation(), stale.generation());
        assert_ne!(new.rkey().0, stale.rkey());
        let fresh = crate::RemoteMemory::export_mr(&new);
        assert_eq!(fresh.generation(), new.generation());

        let src = HostBuffer::new(4096);
        let smr = t.pa.register(&src).unwrap();
        let mut ini = t.qa.cpu_initiator(RingMode::Doca);
        src.write(0, b"fresh");
        let to = |m: &crate::RemoteMemory| prm::RemoteAddr {
            addr: m.addr(),
            rkey: prm::Rkey(m.rkey()),
        };
        write(&mut ini, smr.sge(0, 5), to(&fresh));
        let done = ini.wait_send(T).unwrap();
        assert!(matches!(done, prm::Completion::Req { .. }), "{done:?}");
        assert_eq!(&dst.to_vec()[..5], b"fresh");
        // the old descriptor names a dead key: REMOTE_ACCESS, and the bytes stay
        src.write(0, b"stale");
        write(&mut ini, smr.sge(0, 5), to(&stale));
        let failed = ini.wait_send(T).unwrap();
        assert_eq!(
            syndrome(&failed),
            Some(prm::Syndrome::RemoteAccess),
            "{failed:?}"
        );
        assert_eq!(&dst.to_vec()[..5], b"fresh");
    }

    #[test]
    fn deregister_waits_for_the_wqes_posted_before_and_gives_the_region_back_on_timeout() {
        let t = two();
        let (src, dst) = (HostBuffer::new(4096), HostBuffer::new(4096));
        src.fill(0, 64, 0x5a);
        let smr = t.pa.register(&src).unwrap();
        let dmr = t.pb.register_with(&dst, RIGHTS).unwrap();
        // Posted below RTS: accepted, and it waits for RTS.
        let mut ini = t.qa.cpu_initiator(RingMode::RdmaCore);
        write(&mut ini, smr.sge(0, 64), dmr.remote(0));
        let lkey = smr.lkey();
        let err = smr.deregister(Duration::ZERO).unwrap_err();
        assert_eq!(
            err.report().qps,
            vec![QpInFlight {
                qpn: t.qa.qpn(),
                state: QpState::Reset,
                blocks: Some(1),
            }]
        );
        assert_eq!(err.report().lkey, lkey.0);
        assert!(
            err.to_string().contains("still has WQEs in flight"),
            "{err}"
        );
        let smr = err.into_mr();
        assert!(t.a_has(lkey), "a region that timed out stays registered");
        // Nothing of B's PD is in flight: a region there goes at once.
        let other = t.pb.register(&HostBuffer::new(64)).unwrap();
        other.deregister(Duration::ZERO).unwrap();
        let waiter = std::thread::spawn(move || smr.deregister(Duration::from_secs(60)));
        t.connect();
        // The WQE ran with the region still registered: the wait held it.
        let c = ini.wait_send(T).unwrap();
        assert!(matches!(c, prm::Completion::Req { .. }), "{c:?}");
        waiter.join().unwrap().unwrap();
        assert!(!t.a_has(lkey), "deregistered once the WQE was done");
        assert_eq!(dst.to_vec()[..64], [0x5a; 64]);
    }

    #[test]
    fn deregister_waits_for_every_wqe_posted_before() {
        let t = two();
        let (src, dst) = (HostBuffer::new(4096), HostBuffer::new(4096));
        src.fill(0, 64, 0x5a);
        let smr = t.pa.register(&src).unwrap();
        let dmr = t.pb.register_with(&dst, RIGHTS).unwrap();
        let mut ini = t.qa.cpu_initiator(RingMode::Doca);
        write(&mut ini, smr.sge(0, 64), dmr.remote(0));
        write(&mut ini, smr.sge(0, 32), dmr.remote(64));
        let lkey = smr.lkey();
        let waiter = std::thread::spawn(move || smr.deregister(Duration::from_secs(60)));
        t.connect();
        // Both WQEs ran with the region still registered: the wait held it.
        for _ in 0..2 {
            let c = ini.wait_send(T).unwrap();
            assert!(matches!(c, prm::Completion::Req { .. }), "{c:?}");
        }
        waiter.join().unwrap().unwrap();
        assert!(!t.a_has(lkey));
        assert_eq!(dst.to_vec()[..96], [0x5a; 96]);
    }

    #[test]
    fn a_reset_or_destroyed_qp_has_nothing_in_flight() {
        let t = two();
        let (src, dst) = (HostBuffer::new(4096), HostBuffer::new(4096));
        let dmr = t.pb.register_with(&dst, RIGHTS).unwrap();
        let smr = t.pa.register(&src).unwrap();
        let mut ini = t.qa.cpu_initiator(RingMode::RdmaCore);
        write(&mut ini, smr.sge(0, 8), dmr.remote(0));
        let smr = smr.deregister(Duration::ZERO).unwrap_err().into_mr();
        let waiter = std::thread::spawn(move || smr.deregister(Duration::from_secs(60)));
        // RESET drops what was posted
        t.qa.modify(softnic::Modify::Reset).unwrap();
        waiter.join().unwrap().unwrap();

        let smr = t.pa.register(&src).unwrap();
        drop(ini);
        let mut ini = t.qa.cpu_initiator(RingMode::RdmaCore);
        write(&mut ini, smr.sge(0, 8), dmr.remote(0));
        let smr = smr.deregister(Duration::ZERO).unwrap_err().into_mr();
        // a destroyed QP runs nothing more (the initiator still holds the device QP)
        let Two { qa, .. } = t;
        drop(qa);
        smr.deregister(Duration::ZERO).unwrap();
        drop(ini);
    }

    #[test]
    fn a_region_dropped_under_work_in_flight_fails_the_wqe_not_the_memory() {
        let t = two();
        let (src, dst) = (HostBuffer::new(4096), HostBuffer::new(4096));
        src.fill(0, 64, 1);
        let smr = t.pa.register(&src).unwrap();
        let dmr = t.pb.register_with(&dst, RIGHTS).unwrap();
        let mut ini = t.qa.cpu_initiator(RingMode::RdmaCore);
        write(&mut ini, smr.sge(0, 64), dmr.remote(0));
        let lkey = smr.lkey();
        drop(smr); // logs a warning: the QP has a WQE in flight
        assert!(!t.a_has(lkey));
        t.connect();
        let c = ini.wait_send(T).unwrap();
        assert_eq!(syndrome(&c), Some(prm::Syndrome::LocalProt), "{c:?}");
        assert_eq!(dst.to_vec()[..64], [0; 64]);
        // and into the crate's error, the report survives (the region is dropped)
        let again = t.pa.register(&src).unwrap();
        let mut ini2 = {
            drop(ini);
            t.qa.modify(softnic::Modify::Reset).unwrap();
            t.qa.cpu_initiator(RingMode::RdmaCore)
        };
        write(&mut ini2, again.sge(0, 8), dmr.remote(0));
        let lkey = again.lkey();
        let e = Error::from(again.deregister(Duration::ZERO).unwrap_err());
        assert!(matches!(&e, Error::InFlight(r) if r.lkey == lkey.0), "{e}");
        assert!(!t.a_has(lkey));
    }

    #[test]
    fn device_memory_regions_through_the_host_api() {
        let (a, b) = (
            Context::open(DeviceRequest::Soft).unwrap(),
            Context::open(DeviceRequest::Soft).unwrap(),
        );
        let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
        let (ca, cb) = (
            a.create_cq(CqOptions::default()).unwrap(),
            b.create_cq(CqOptions::default()).unwrap(),
        );
        let qa = pa.create_qp(QpOptions::new(&ca, &ca)).unwrap();
        let qb = pb.create_qp(QpOptions::new(&cb, &cb)).unwrap();
        let conn = ConnectOptions {
            access: Access::REMOTE_WRITE | Access::REMOTE_READ,
            ..Default::default()
        };
        qa.connect(&qb.endpoint(), conn).unwrap();
        qb.connect(&qa.endpoint(), conn).unwrap();
        let gpu = SimDeviceMemory::new(1 << 16);
        let rights = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let target = pb
            .register_device(gpu.clone(), gpu.base(), 4096, rights, Keep::Nothing)
            .unwrap();
        assert_eq!(target.kind(), MemKind::Device);
        let src = HostBuffer::new(4096);
        src.write(0, b"to the GPU");
        let src_mr = pa.register(&src).unwrap();
        assert_eq!(src_mr.kind(), MemKind::Host);
        let mut ini = qa.cpu_initiator(RingMode::Doca);
        let w = Op::Write {
            remote: target.remote(100),
            local: Local::Sges(&[src_mr.sge(0, 10)]),
            imm: None,
        };
        ini.post_and_ring(&w, CtrlFlags::SIGNALED).unwrap();
        let done = ini.wait_send(Duration::from_secs(10)).unwrap();
        assert!(matches!(done, prm::Completion::Req { .. }), "{done:?}");
        assert_eq!(gpu.peek(gpu.base() + 100, 10), b"to the GPU");
        assert!(gpu.counts().writes >= 1);
        // without an open Gpu, a raw device pointer has nothing to reach it
        assert!(matches!(
            pb.register_gpu(gpu.base(), 64, Access::LOCAL_WRITE),
            Err(Error::Unsupported(_))
        ));
    }
}
