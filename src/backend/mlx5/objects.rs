//! The rdma-core objects: CQs and QPs (the provider's or DEVX ones), memory regions, doorbell
//! records, each a thin owner that destroys its object on drop.

use super::devx;
use crate::Error;
use rdma_core_sys as sys;
use std::ptr::NonNull;
use std::sync::Arc;
use verbs::DmaBuf;

/// Setting this variable to `1` makes the mlx5 backend create every CQ and QP with DEVX (on
/// host memory unless a GPU placement asks otherwise), not only those the provider cannot make:
/// how the host-API suites run a third time on DEVX objects.
pub const DEVX_ENV: &str = "GPUVERBS_MLX5_DEVX";

/// Whether [`DEVX_ENV`] asks for DEVX objects everywhere (read once).
pub(crate) fn devx_always() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var(DEVX_ENV).is_ok_and(|v| v == "1"))
}

use super::super::GpuRegPath;
use super::device::{errno, ibv_access, mtu_enum, verbs_err};
pub(crate) use super::device::{Device, Pd, Remote};

impl Device {
    /// Creates a CQ of at least `depth` 64-byte CQEs.
    pub(crate) fn create_cq(self: &Arc<Self>, depth: u32) -> Result<Arc<Cq>, Error> {
        // SAFETY: zeroed attrs are valid plain data.
        let mut attr: sys::ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
        // mlx5 rounds cqe + 1 up to a power of two: asking depth - 1 gives depth entries
        attr.cqe = depth.saturating_sub(1).max(1);
        // SAFETY: as above.
        let mut dv: sys::mlx5dv_cq_init_attr = unsafe { std::mem::zeroed() };
        dv.comp_mask = sys::MLX5DV_CQ_INIT_ATTR_MASK_CQE_SIZE as u64;
        dv.cqe_size = 64;
        // SAFETY: live context and attrs.
        let cqx = unsafe { (self.libs.dv.mlx5dv_create_cq)(self.ctx, &mut attr, &mut dv) };
        if cqx.is_null() {
            return Err(verbs_err(
                "mlx5dv_create_cq",
                errno(),
                format!("{depth} CQEs"),
            ));
        }
        // ibv_cq_ex begins with the ibv_cq fields (verbs.h ibv_cq_ex_to_cq is this cast).
        let cq = cqx.cast::<sys::ibv_cq>();
        let mut out: sys::mlx5dv_cq = unsafe { std::mem::zeroed() };
        // SAFETY: zeroed obj, then the CQ in and our out struct.
        let mut obj: sys::mlx5dv_obj = unsafe { std::mem::zeroed() };
        obj.cq.in_ = cq;
        obj.cq.out = &mut out;
        // SAFETY: the obj names a live CQ of this provider and a writable out struct.
        let rc = unsafe { (self.libs.dv.mlx5dv_init_obj)(&mut obj, sys::MLX5DV_OBJ_CQ as u64) };
        if rc != 0 {
            // SAFETY: destroys the CQ just created.
            unsafe { (self.libs.verbs.ibv_destroy_cq)(cq) };
            return Err(verbs_err("mlx5dv_init_obj(CQ)", rc, String::new()));
        }
        if out.cqe_size != 64 || !out.cqe_cnt.is_power_of_two() {
            // SAFETY: as above.
            unsafe { (self.libs.verbs.ibv_destroy_cq)(cq) };
            return Err(Error::Unsupported(format!(
                "CQ of {} CQEs of {} bytes (64-byte CQEs expected)",
                out.cqe_cnt, out.cqe_size
            )));
        }
        Ok(Arc::new(Cq {
            dev: self.clone(),
            owner: CqOwner::Verbs(cq),
            // SAFETY: the provider's ring of cqe_cnt 64-byte CQEs, live until the CQ is
            // destroyed (which drops this buffer first: it is a field of the same value).
            ring: unsafe { external(out.buf, out.cqe_cnt as usize * prm::CQE_SIZE)? },
            ncqe: out.cqe_cnt,
            dbrec: Rec::Host(out.dbrec.cast()),
            cqn: out.cqn,
            mode: verbs::CqMode::OverrunDetect,
        }))
    }
}

impl Pd {
    /// Registers host memory.
    ///
    /// # Safety
    /// `addr..addr+len` must stay mapped while the region lives.
    pub(crate) unsafe fn reg_host(
        self: &Arc<Self>,
        addr: u64,
        len: u64,
        access: verbs::Access,
    ) -> Result<Mr, Error> {
        let flags = ibv_access(access);
        // SAFETY: live PD; the caller keeps the range mapped.
        let mr = unsafe {
            self.dev
                .libs
                .verbs
                .reg_mr(self.pd, addr as *mut _, len as usize, flags)
        };
        if mr.is_null() {
            return Err(verbs_err(
                "ibv_reg_mr",
                errno(),
                format!("{addr:#x}+{len}, access {flags:#x} (check the memlock limit: ulimit -l)"),
            ));
        }
        Ok(self.wrap(mr))
    }

    /// Registers GPU memory `dptr..dptr+len`: through a dma-buf (`dmabuf`: the fd of the GPU
    /// pages around the range and the offset of `dptr` in it) with `ibv_reg_dmabuf_mr` when one
    /// is given, else (or when that fails) with `ibv_reg_mr` on the GPU address, which a kernel
    /// with nvidia-peermem resolves. Returns the region and the path that took it; when both
    /// fail, an error naming both attempts and their errno.
    pub(crate) fn reg_gpu(
        self: &Arc<Self>,
        dptr: u64,
        len: u64,
        access: verbs::Access,
        dmabuf: Result<(std::os::fd::OwnedFd, u64), String>,
    ) -> Result<(Mr, GpuRegPath), Error> {
        use std::os::fd::AsRawFd;
        let flags = ibv_access(access);
        let verbs = self.dev.libs.verbs;
        let first = match (&dmabuf, verbs.ibv_reg_dmabuf_mr) {
            (Ok((fd, offset)), Some(reg)) => {
                // SAFETY: live PD; the fd is a dma-buf of GPU pages covering the range (the
                // kernel takes its own reference; ours closes when `dmabuf` drops).
                let mr = unsafe {
                    reg(
                        self.pd,
                        *offset,
                        len as usize,
                        dptr,
                        fd.as_raw_fd(),
                        flags as i32,
                    )
                };
                if !mr.is_null() {
                    return Ok((self.wrap(mr), GpuRegPath::DmaBuf));
                }
                format!(
                    "ibv_reg_dmabuf_mr: {}",
                    std::io::Error::from_raw_os_error(errno())
                )
            }
            (Ok(_), None) => "ibv_reg_dmabuf_mr: not in this libibverbs".to_string(),
            (Err(e), _) => format!("no dma-buf ({e})"),
        };
        // SAFETY: live PD; ibv_reg_mr on a GPU address is resolved by the kernel (peermem) or
        // refused; user space never touches the range.
        let mr = unsafe { verbs.reg_mr(self.pd, dptr as *mut _, len as usize, flags) };
        if mr.is_null() {
            return Err(verbs_err(
                "ibv_reg_mr",
                errno(),
                format!(
                    "GPU memory {dptr:#x}+{len}, access {flags:#x}: the GPU address (the \
                     nvidia-peermem path) after {first}"
                ),
            ));
        }
        tracing::debug!(dptr, len, dmabuf = %first, "GPU memory registered through peermem");
        Ok((self.wrap(mr), GpuRegPath::PeerMem))
    }

    /// Takes ownership of a region rdma-core returned.
    fn wrap(self: &Arc<Self>, mr: *mut sys::ibv_mr) -> Mr {
        // SAFETY: a live MR returned just now.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Mr {
            pd: self.clone(),
            mr,
            lkey,
            rkey,
        }
    }

    /// Creates an RC QP (RESET) with scatter-to-CQE disabled.
    pub(crate) fn create_qp(
        self: &Arc<Self>,
        scq: &Arc<Cq>,
        rcq: &Arc<Cq>,
        max_send_wr: u32,
        max_recv_wr: u32,
        max_recv_sge: u32,
        max_inline: u32,
    ) -> Result<Arc<Qp>, Error> {
        let (CqOwner::Verbs(send_cq), CqOwner::Verbs(recv_cq)) = (&scq.owner, &rcq.owner) else {
            return Err(Error::InvalidArgument(
                "a provider QP needs provider CQs (a QP on DEVX CQs is made with DEVX)".into(),
            ));
        };
        // SAFETY: zeroed attrs are valid plain data.
        let mut a: sys::ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
        a.send_cq = *send_cq;
        a.recv_cq = *recv_cq;
        a.qp_type = sys::IBV_QPT_RC;
        a.cap.max_send_wr = max_send_wr.max(1);
        a.cap.max_recv_wr = max_recv_wr;
        a.cap.max_send_sge = 1;
        a.cap.max_recv_sge = max_recv_sge.max(1);
        a.cap.max_inline_data = max_inline;
        a.comp_mask = sys::IBV_QP_INIT_ATTR_PD;
        a.pd = self.pd;
        // SAFETY: as above.
        let mut dv: sys::mlx5dv_qp_init_attr = unsafe { std::mem::zeroed() };
        dv.comp_mask = sys::MLX5DV_QP_INIT_ATTR_MASK_QP_CREATE_FLAGS as u64;
        dv.create_flags = sys::MLX5DV_QP_CREATE_DISABLE_SCATTER_TO_CQE;
        // SAFETY: live context, CQs and PD; attrs filled above.
        let qp = unsafe { (self.dev.libs.dv.mlx5dv_create_qp)(self.dev.ctx, &mut a, &mut dv) };
        if qp.is_null() {
            return Err(verbs_err(
                "mlx5dv_create_qp",
                errno(),
                format!("RC, {max_send_wr} send WRs, {max_recv_wr} receive WRs"),
            ));
        }
        self.adopt(qp, scq, rcq, a.cap.max_inline_data)
    }

    /// Takes a QP the provider just made (destroyed here on failure): its rings and doorbell
    /// record as `mlx5dv_init_obj` shows them, checked to be the geometry the host API drives.
    pub(super) fn adopt(
        self: &Arc<Self>,
        qp: *mut sys::ibv_qp,
        scq: &Arc<Cq>,
        rcq: &Arc<Cq>,
        max_inline: u32,
    ) -> Result<Arc<Qp>, Error> {
        let v = self.dev.libs.verbs;
        // SAFETY: zeroed out struct, then init_obj fills it for the live QP.
        let mut out: sys::mlx5dv_qp = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut obj: sys::mlx5dv_obj = unsafe { std::mem::zeroed() };
        obj.qp.in_ = qp;
        obj.qp.out = &mut out;
        // SAFETY: a live QP of this provider and a writable out struct.
        let rc = unsafe { (self.dev.libs.dv.mlx5dv_init_obj)(&mut obj, sys::MLX5DV_OBJ_QP as u64) };
        let bad = rc != 0
            || out.sq.stride != 64
            || !out.sq.wqe_cnt.is_power_of_two()
            || (out.rq.wqe_cnt != 0 && !out.rq.wqe_cnt.is_power_of_two())
            || out.bf.reg.is_null()
            || !(out.bf.size == 0 || out.bf.size as usize == prm::doorbell::BF_HALF_SIZE);
        if bad {
            // SAFETY: destroys the QP just created.
            unsafe { (v.ibv_destroy_qp)(qp) };
            return Err(if rc != 0 {
                verbs_err("mlx5dv_init_obj(QP)", rc, String::new())
            } else {
                Error::Unsupported(format!(
                    "QP geometry: SQ {} x {} B, RQ {} x {} B, BlueFlame halves of {} B",
                    out.sq.wqe_cnt, out.sq.stride, out.rq.wqe_cnt, out.rq.stride, out.bf.size
                ))
            });
        }
        // SAFETY: the live QP's number.
        let qpn = unsafe { (*qp).qp_num };
        // SAFETY: the provider's rings, live until the QP is destroyed (in this value's drop,
        // after which its fields, these buffers among them, go).
        let rings = unsafe {
            let sq = external(out.sq.buf, out.sq.wqe_cnt as usize * prm::WQEBB);
            let rq = match out.rq.wqe_cnt {
                0 => Ok(None),
                n => external(out.rq.buf, (n * out.rq.stride) as usize).map(Some),
            };
            sq.and_then(|sq| rq.map(|rq| (sq, rq)))
        };
        let (sq, rq) = match rings {
            Ok(r) => r,
            Err(e) => {
                // SAFETY: destroys the QP just created.
                unsafe { (v.ibv_destroy_qp)(qp) };
                return Err(e);
            }
        };
        Ok(Arc::new(Qp {
            pd: self.clone(),
            _cqs: (scq.clone(), rcq.clone()),
            owner: QpOwner::Verbs(qp),
            qpn,
            sq,
            sq_blocks: out.sq.wqe_cnt,
            rq,
            rq_wqes: out.rq.wqe_cnt,
            rq_stride: out.rq.stride,
            dbrec: Rec::Host(out.dbrec.cast()),
            bf_reg: out.bf.reg.cast(),
            max_inline,
            _wq: None,
        }))
    }

    /// An RC QP made with DEVX on `wq` (the RQ — `rq_wqes` WQEs of `rq_stride` bytes — then the
    /// SQ of `sq_blocks` blocks; host or GPU memory), reporting to `scq` / `rcq` (provider or
    /// DEVX CQs), its doorbell record in `rec` (8 bytes of host or GPU memory), doorbells on the
    /// device's non-cached UAR page or (`bf`) a BlueFlame page of its own.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create_devx_qp(
        self: &Arc<Self>,
        scq: &Arc<Cq>,
        rcq: &Arc<Cq>,
        sq_blocks: u32,
        rq_wqes: u32,
        rq_stride: u32,
        wq: DmaBuf,
        dmabuf: Option<Result<(std::os::fd::OwnedFd, u64), String>>,
        rec: DmaBuf,
        (doorbell, dci, cd_master): (verbs::DoorbellMode, bool, bool),
    ) -> Result<Arc<Qp>, Error> {
        let no_dbr = doorbell == verbs::DoorbellMode::NoDbr;
        if no_dbr && !self.dev.no_dbr_ext() {
            return Err(Error::Unsupported(format!(
                "{}: a QP without a send doorbell record (DoorbellMode::NoDbr): the device's \
                 QUERY_HCA_CAP cap2 does not report send_dbr_mode_no_dbr_ext (a ConnectX-8 \
                 does)",
                self.dev.name
            )));
        }
        let rq_bytes = (rq_wqes * rq_stride) as usize;
        let sq_bytes = sq_blocks as usize * prm::WQEBB;
        if wq.len() < rq_bytes + sq_bytes || sq_blocks == 0 {
            return Err(Error::InvalidArgument(format!(
                "a WQ buffer of {} bytes for an RQ of {rq_bytes} and an SQ of {sq_bytes}",
                wq.len()
            )));
        }
        let rings = devx::QpRings {
            wq: &wq,
            dmabuf,
            sq_blocks,
            rq_wqes,
            rq_stride,
            dbrec: &rec,
            dci,
            cd_master,
            no_dbr,
        };
        let bf = doorbell.is_blueflame();
        let (obj, qpn, reg) = self.devx_qp_object(scq.cqn, rcq.cqn, rings, bf)?;
        // SAFETY (both views): parts of `wq`, which this QP keeps (its `_wq` field, dropped
        // after the views).
        let sq = unsafe { view(&wq, rq_bytes, sq_bytes) };
        let rq = (rq_bytes > 0).then(|| unsafe { view(&wq, 0, rq_bytes) });
        Ok(Arc::new(Qp {
            pd: self.clone(),
            _cqs: (scq.clone(), rcq.clone()),
            owner: QpOwner::Devx(obj),
            qpn,
            sq,
            sq_blocks,
            rq,
            rq_wqes,
            rq_stride,
            dbrec: Rec::Buf(rec),
            bf_reg: reg,
            max_inline: prm::wqe::MAX_INLINE_SEND as u32,
            _wq: Some(wq),
        }))
    }
}

/// A memory region.
pub(crate) struct Mr {
    pd: Arc<Pd>,
    mr: *mut sys::ibv_mr,
    pub lkey: u32,
    pub rkey: u32,
}

// SAFETY: an MR pointer is used only in the deregistration call.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in reg_host, deregistered once.
        let rc = unsafe { (self.pd.dev.libs.verbs.ibv_dereg_mr)(self.mr) };
        if rc != 0 {
            tracing::warn!(errno = rc, "ibv_dereg_mr failed");
        }
    }
}

/// Host memory the provider owns, as a buffer.
///
/// # Safety
/// `ptr..ptr+len` must stay mapped while the buffer lives.
unsafe fn external(ptr: *mut std::ffi::c_void, len: usize) -> Result<DmaBuf, Error> {
    let p = NonNull::new(ptr.cast::<u8>())
        .ok_or_else(|| Error::Unsupported("the provider gave a ring at address 0".into()))?;
    // SAFETY: the caller's promise; the buffer never frees it.
    Ok(unsafe { DmaBuf::from_external(p, len, Box::new(())) })
}

/// A doorbell record: the provider's (host memory it allocated), or one of a DEVX object's own
/// (host memory, or GPU memory when the rings are there and no CPU writes it).
pub(crate) enum Rec {
    Host(*mut u8),
    Buf(DmaBuf),
}

impl Rec {
    /// The record's host address, when it is host memory (the CPU initiator and the CPU
    /// proxy write it with host stores).
    pub(crate) fn host(&self) -> Option<*mut u8> {
        match self {
            Self::Host(p) => Some(*p),
            Self::Buf(b) if b.is_host() => Some(b.as_ptr()),
            Self::Buf(_) => None,
        }
    }

    /// Where the record lives.
    pub(crate) fn place(&self) -> super::super::geometry::Place<'_> {
        match self {
            Self::Host(p) => super::super::geometry::Place::Host(*p),
            Self::Buf(b) => super::super::geometry::Place::Buf(b, 0),
        }
    }

    /// Writes zeros into both words.
    fn clear(&self) {
        match self {
            Self::Buf(b) if !b.is_host() => {
                let _ = b.try_write(0, &[0; 8]);
            }
            _ => {
                if let Some(p) = self.host() {
                    // SAFETY: as in `word`.
                    let w = unsafe { &*(p as *const [std::sync::atomic::AtomicU32; 2]) };
                    for x in w {
                        x.store(0, std::sync::atomic::Ordering::Release);
                    }
                }
            }
        }
    }
}

/// Who made a CQ.
enum CqOwner {
    /// The provider (`mlx5dv_create_cq`).
    Verbs(*mut sys::ibv_cq),
    /// DEVX, on a ring of the host API's: the object (dropped before the ring and record).
    Devx { _obj: devx::Obj },
}

/// A CQ and where its ring lives.
pub(crate) struct Cq {
    dev: Arc<Device>,
    owner: CqOwner,
    /// The CQE ring: the provider's (host memory), or the host API's (host or GPU memory).
    pub ring: DmaBuf,
    pub ncqe: u32,
    /// The CQ doorbell record (freed after `owner`: after the object).
    pub dbrec: Rec,
    pub cqn: u32,
    pub mode: verbs::CqMode,
}

impl Cq {
    /// Its geometry (an rdma-core CQ never writes over a CQE its consumer has not taken).
    pub(crate) fn geometry(self: &Arc<Self>) -> super::super::geometry::CqGeometry<'_> {
        super::super::geometry::CqGeometry {
            ring: &self.ring,
            ncqe: self.ncqe,
            dbrec: self.dbrec.place(),
            collapsed: self.mode == verbs::CqMode::Collapsed,
            never_overwrites: true,
            keep: self.clone(),
        }
    }

    /// Whether it was made with DEVX.
    /// The provider's CQ, `None` for one made with DEVX.
    pub(super) fn verbs_cq(&self) -> Option<*mut sys::ibv_cq> {
        match self.owner {
            CqOwner::Verbs(c) => Some(c),
            CqOwner::Devx { .. } => None,
        }
    }

    pub(crate) fn is_devx(&self) -> bool {
        matches!(self.owner, CqOwner::Devx { .. })
    }

    /// A CQ made with DEVX on `ring` (`ncqe` 64-byte CQEs, host or GPU memory, already filled
    /// as the consumer wants it): collapsed, overrun-ignore or overrun-detect; its doorbell
    /// record in `rec` (8 bytes of host memory, or of GPU memory beside a GPU ring).
    pub(crate) fn devx(
        dev: &Arc<Device>,
        ncqe: u32,
        mode: verbs::CqMode,
        ring: DmaBuf,
        dmabuf: Option<Result<(std::os::fd::OwnedFd, u64), String>>,
        rec: DmaBuf,
    ) -> Result<Arc<Self>, Error> {
        let (obj, cqn) = dev.create_devx_cq(ncqe, mode, &ring, dmabuf, &rec)?;
        Ok(Arc::new(Self {
            dev: dev.clone(),
            owner: CqOwner::Devx { _obj: obj },
            ring,
            ncqe,
            dbrec: Rec::Buf(rec),
            cqn,
            mode,
        }))
    }
}

// SAFETY: the pointers are the provider's CQ and its memory, owned by this value until drop.
unsafe impl Send for Cq {}
// SAFETY: as above; the memory is accessed through atomics and raw copies by its one poller.
unsafe impl Sync for Cq {}

impl Drop for Cq {
    fn drop(&mut self) {
        if let CqOwner::Verbs(cq) = self.owner {
            // SAFETY: QPs using it hold an Arc of it, so none is alive; destroyed once.
            let rc = unsafe { (self.dev.libs.verbs.ibv_destroy_cq)(cq) };
            if rc != 0 {
                tracing::warn!(errno = rc, "ibv_destroy_cq failed");
            }
        }
        // a DEVX CQ's object goes with its owner field, before its ring and record
    }
}

/// `len` bytes at `off` of `buf`, without ownership.
///
/// # Safety
/// The view must not outlive `buf`.
unsafe fn view(buf: &DmaBuf, off: usize, len: usize) -> DmaBuf {
    match buf.device_memory() {
        Some(m) => DmaBuf::from_device(buf.addr() + off as u64, len, m.clone(), Box::new(())),
        // SAFETY: inside `buf` (host memory), which the caller keeps alive longer.
        None => unsafe {
            DmaBuf::from_external(
                NonNull::new(buf.as_ptr().add(off)).expect("inside a live buffer"),
                len,
                Box::new(()),
            )
        },
    }
}

/// Who made a QP.
enum QpOwner {
    /// The provider (`mlx5dv_create_qp`).
    Verbs(*mut sys::ibv_qp),
    /// DEVX, on rings of the host API's.
    Devx(devx::Obj),
}

/// An RC QP and where its rings, doorbell record and BlueFlame register live.
pub(crate) struct Qp {
    pd: Arc<Pd>,
    _cqs: (Arc<Cq>, Arc<Cq>),
    owner: QpOwner,
    pub qpn: u32,
    /// The SQ ring (host memory, or GPU memory for a DEVX QP on it).
    pub sq: DmaBuf,
    pub sq_blocks: u32,
    /// The RQ ring, when there is one.
    pub rq: Option<DmaBuf>,
    pub rq_wqes: u32,
    pub rq_stride: u32,
    /// The doorbell record.
    pub dbrec: Rec,
    /// The doorbell (BlueFlame) register on the UAR page.
    pub bf_reg: *mut u8,
    pub max_inline: u32,
    /// A DEVX QP's WQ buffer (RQ then SQ; `sq` and `rq` are views of it), freed after the
    /// object (`owner`) and the views.
    _wq: Option<DmaBuf>,
}

// SAFETY: the provider's QP and its memory, owned by this value until drop; modify calls are
// thread-safe verbs calls; the rings are used by one poster at a time (the host API's claim).
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    /// Its geometry: the provider's (or a DEVX object's) rings and doorbell record, and the
    /// BlueFlame register on its UAR page (real MMIO on a ConnectX). The CPU-proxy word is the
    /// host API's, added above.
    pub(crate) fn geometry(self: &Arc<Self>) -> super::super::geometry::QpGeometry<'_> {
        super::super::geometry::QpGeometry {
            qpn: self.qpn,
            sq: &self.sq,
            sq_blocks: self.sq_blocks,
            rq: self.rq.as_ref(),
            rq_wqes: self.rq_wqes,
            rq_stride: self.rq_stride,
            max_inline: self.max_inline,
            dbrec: self.dbrec.place(),
            db_reg: super::super::geometry::Place::Host(self.bf_reg),
            db_reg_io: true,
            proxy_word: None,
            kick: None,
            poster_hooks: None,
            keep: self.clone(),
        }
    }

    /// Its protection domain.
    pub(super) fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// Its DEVX object, when DEVX made it.
    pub(super) fn devx_obj(&self) -> Option<&devx::Obj> {
        match &self.owner {
            QpOwner::Devx(obj) => Some(obj),
            QpOwner::Verbs(_) => None,
        }
    }

    fn verbs_qp(&self) -> *mut sys::ibv_qp {
        match self.owner {
            QpOwner::Verbs(q) => q,
            QpOwner::Devx(_) => std::ptr::null_mut(),
        }
    }

    pub(super) fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: u32,
        what: &'static str,
    ) -> Result<(), Error> {
        // SAFETY: live QP (a provider QP: the callers dispatch DEVX QPs before), attr filled
        // by the caller for `mask`.
        let rc =
            unsafe { (self.pd.dev.libs.verbs.ibv_modify_qp)(self.verbs_qp(), attr, mask as i32) };
        if rc != 0 {
            return Err(verbs_err(
                "ibv_modify_qp",
                rc,
                format!("QP {:#x} to {what}", self.qpn),
            ));
        }
        Ok(())
    }

    /// RESET → INIT → RTR → RTS towards `r`.
    pub(crate) fn connect(
        &self,
        access: verbs::Access,
        r: &Remote,
        sq_psn: u32,
        o: &super::super::ConnectOptions,
    ) -> Result<(), Error> {
        if let QpOwner::Devx(obj) = &self.owner {
            return self.pd.connect_devx(obj, self.qpn, access, r, sq_psn, o);
        }
        let dev = &self.pd.dev;
        // SAFETY: zeroed attr is valid plain data.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_INIT;
        a.port_num = dev.port;
        a.pkey_index = 0;
        a.qp_access_flags = ibv_access(access);
        self.modify(
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_PKEY_INDEX
                | sys::IBV_QP_PORT
                | sys::IBV_QP_ACCESS_FLAGS,
            "INIT",
        )?;
        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_RTR;
        a.path_mtu = mtu_enum(r.mtu.min(dev.mtu));
        a.dest_qp_num = r.qpn;
        a.rq_psn = r.psn & 0xff_ffff;
        a.max_dest_rd_atomic = dev.max_rd_atomic;
        a.min_rnr_timer = o.min_rnr_timer;
        a.ah_attr.is_global = 1;
        a.ah_attr.port_num = dev.port;
        a.ah_attr.grh.dgid.raw = r.gid;
        a.ah_attr.grh.sgid_index = dev.gid.index;
        a.ah_attr.grh.hop_limit = 64;
        self.modify(
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_AV
                | sys::IBV_QP_PATH_MTU
                | sys::IBV_QP_DEST_QPN
                | sys::IBV_QP_RQ_PSN
                | sys::IBV_QP_MAX_DEST_RD_ATOMIC
                | sys::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;
        self.to_rts(sq_psn, o)
    }

    /// RTR → RTS: timeout, retry counts, first PSN `sq_psn`, the device's outstanding reads.
    pub(super) fn to_rts(
        &self,
        sq_psn: u32,
        o: &super::super::ConnectOptions,
    ) -> Result<(), Error> {
        // SAFETY: zeroed attr is valid plain data.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_RTS;
        a.sq_psn = sq_psn & 0xff_ffff;
        a.timeout = o.timeout;
        a.retry_cnt = o.retry_cnt;
        a.rnr_retry = o.rnr_retry;
        a.max_rd_atomic = self.pd.dev.max_rd_atomic;
        self.modify(
            &mut a,
            sys::IBV_QP_STATE
                | sys::IBV_QP_TIMEOUT
                | sys::IBV_QP_RETRY_CNT
                | sys::IBV_QP_RNR_RETRY
                | sys::IBV_QP_SQ_PSN
                | sys::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    /// Moves the QP to a state without attributes (RESET or ERR).
    pub(crate) fn to_state(&self, state: sys::ibv_qp_state) -> Result<(), Error> {
        if let QpOwner::Devx(obj) = &self.owner {
            let reset = state == sys::IBV_QPS_RESET;
            obj.qp_to(self.qpn, reset)?;
            if reset {
                // The doorbell record is ours: cleared with the device's indices, as libmlx5
                // clears a provider QP's at RESET (the next poster starts at 0).
                self.dbrec.clear();
            }
            return Ok(());
        }
        // SAFETY: zeroed attr is valid plain data.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = state;
        self.modify(&mut a, sys::IBV_QP_STATE, "RESET/ERR")
    }

    /// The QP's state as the device reports it (QUERY_QP).
    pub(crate) fn state(&self) -> Result<sys::ibv_qp_state, Error> {
        if let QpOwner::Devx(obj) = &self.owner {
            // the PRM's QP states number as verbs' (RST 0 .. ERR 6)
            return Ok(sys::ibv_qp_state::from(obj.qp_state(self.qpn)?));
        }
        // SAFETY: zeroed attrs are valid plain data.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut ia: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live QP, writable attrs.
        let rc = unsafe {
            (self.pd.dev.libs.verbs.ibv_query_qp)(
                self.verbs_qp(),
                &mut a,
                sys::IBV_QP_STATE as i32,
                &mut ia,
            )
        };
        if rc != 0 {
            return Err(verbs_err("ibv_query_qp", rc, format!("QP {:#x}", self.qpn)));
        }
        Ok(a.qp_state)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        if let QpOwner::Verbs(qp) = self.owner {
            // SAFETY: created in create_qp, destroyed once; its CQs and PD outlive it (held).
            let rc = unsafe { (self.pd.dev.libs.verbs.ibv_destroy_qp)(qp) };
            if rc != 0 {
                tracing::warn!(errno = rc, "ibv_destroy_qp failed");
            }
        }
        // a DEVX QP's object goes with its owner field, before its rings and record
    }
}
