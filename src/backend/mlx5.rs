//! The ConnectX backend: the same host API over rdma-core's libibverbs and the mlx5 direct-verbs
//! interface (`mlx5dv_create_cq`, `mlx5dv_create_qp`, `mlx5dv_init_obj`), loaded at run time
//! through `rdma-core-sys`.
//!
//! Every object here is a thin owner of an rdma-core object: creation checks the result and
//! reports the call and errno ([`Error::Verbs`]), drop destroys it, and the rings, doorbell
//! records and BlueFlame register that `mlx5dv_init_obj` reveals are handed to the shared code
//! above as plain memory ranges (the CPU initiator, GPU export and proxy do not know which
//! backend made them). CQs are 64-byte-CQE CQs; QPs are RC with scatter-to-CQE disabled (so a
//! GPU poller never finds data inside a CQE). Rings are the provider's, in host memory.
//!
//! Run here every day on the emulated device (`gpuverbs emu`: the real libibverbs and libmlx5
//! over the soft NIC); not run on ConnectX hardware.

use crate::Error;
use rdma_core_sys as sys;
use std::ffi::CStr;
use std::sync::Arc;

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn verbs_err(call: &'static str, errno: i32, detail: String) -> Error {
    Error::Verbs {
        call,
        errno,
        detail,
    }
}

/// The loaded libraries.
struct Libs {
    verbs: &'static sys::IbVerbs,
    dv: &'static sys::Mlx5Dv,
}

fn libs() -> Result<Libs, Error> {
    let load = |e: sys::LoadError| Error::Unsupported(format!("rdma-core: {e}"));
    Ok(Libs {
        verbs: sys::verbs().map_err(load)?,
        dv: sys::mlx5dv().map_err(load)?,
    })
}

/// The RoCE v2 GID index of a port: the first RoCE v2 GID whose address is IPv4-mapped (what
/// perftest's `-x` selects by hand), else the first RoCE v2 one. `None` on InfiniBand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GidChoice {
    pub index: u8,
    pub gid: [u8; 16],
}

/// Picks the GID: entries `(index, gid, is RoCE v2)`.
pub(crate) fn choose_gid(entries: &[(u8, [u8; 16], bool)]) -> Option<GidChoice> {
    let v4 = |g: &[u8; 16]| g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff;
    let pick = |want_v4: bool| {
        entries
            .iter()
            .find(|(_, g, v2)| *v2 && g.iter().any(|&b| b != 0) && (!want_v4 || v4(g)))
            .map(|&(index, gid, _)| GidChoice { index, gid })
    };
    pick(true).or_else(|| pick(false))
}

/// An open rdma-core device (one port used: 1).
pub(crate) struct Device {
    libs: Libs,
    ctx: *mut sys::ibv_context,
    pub name: String,
    pub port: u8,
    pub gid: GidChoice,
    /// Active MTU in bytes.
    pub mtu: u32,
    pub max_rd_atomic: u8,
}

// SAFETY: an ibv_context may be used from any thread (libibverbs locks what it shares); the
// pointer is owned by this value and closed once, in drop.
unsafe impl Send for Device {}
// SAFETY: as above: every call through `&Device` is a thread-safe verbs call.
unsafe impl Sync for Device {}

/// The rdma-core devices listed, by name.
pub(crate) fn device_names() -> Result<Vec<String>, Error> {
    let l = libs()?;
    let mut n = 0i32;
    // SAFETY: writes the count through a valid pointer; returns a NULL-terminated array that
    // is freed below.
    let list = unsafe { (l.verbs.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        return Err(verbs_err("ibv_get_device_list", errno(), String::new()));
    }
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: i < n entries of the list; each is a live device.
        let p = unsafe { (l.verbs.ibv_get_device_name)(*list.add(i)) };
        if !p.is_null() {
            // SAFETY: a NUL-terminated name owned by the device.
            names.push(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
        }
    }
    // SAFETY: the list from ibv_get_device_list, freed once.
    unsafe { (l.verbs.ibv_free_device_list)(list) };
    Ok(names)
}

fn mtu_bytes(m: sys::ibv_mtu) -> u32 {
    match m {
        1..=5 => 128 << m,
        _ => 1024,
    }
}

fn mtu_enum(bytes: u32) -> sys::ibv_mtu {
    match bytes {
        0..=256 => 1,
        257..=512 => 2,
        513..=1024 => 3,
        1025..=2048 => 4,
        _ => 5,
    }
}

impl Device {
    /// Opens device `name`, port 1, and picks its RoCE v2 GID.
    pub(crate) fn open(name: &str) -> Result<Arc<Self>, Error> {
        let libs = libs()?;
        let v = libs.verbs;
        let mut n = 0i32;
        // SAFETY: as in device_names.
        let list = unsafe { (v.ibv_get_device_list)(&mut n) };
        if list.is_null() {
            return Err(verbs_err("ibv_get_device_list", errno(), String::new()));
        }
        let mut ctx = std::ptr::null_mut();
        let mut open_errno = 0;
        for i in 0..n.max(0) as usize {
            // SAFETY: i < n live devices.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a live device's NUL-terminated name.
            let dn = unsafe { CStr::from_ptr((v.ibv_get_device_name)(dev)) };
            if dn.to_bytes() == name.as_bytes() {
                // SAFETY: opens a live device of the list (before the list is freed).
                ctx = unsafe { (v.ibv_open_device)(dev) };
                open_errno = errno();
                break;
            }
        }
        // SAFETY: freed once; the context stays valid after the list is freed.
        unsafe { (v.ibv_free_device_list)(list) };
        if ctx.is_null() {
            return Err(if open_errno == 0 {
                Error::NoSuchDevice(name.to_string())
            } else {
                verbs_err("ibv_open_device", open_errno, name.to_string())
            });
        }
        let mut dev = Self {
            libs,
            ctx,
            name: name.to_string(),
            port: 1,
            gid: GidChoice {
                index: 0,
                gid: [0; 16],
            },
            mtu: 1024,
            max_rd_atomic: 1,
        };
        // SAFETY: `dv.mlx5dv_is_supported` takes the context's device; refuses non-mlx5.
        if !unsafe { (dev.libs.dv.mlx5dv_is_supported)((*ctx).device) } {
            return Err(Error::Unsupported(format!(
                "{name} is not an mlx5 (ConnectX) device"
            )));
        }
        // SAFETY: a zeroed port_attr is valid; query_port fills it.
        let mut pa: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, writable attr.
        let rc = unsafe { v.query_port(ctx, dev.port, &mut pa) };
        if rc != 0 {
            return Err(verbs_err("ibv_query_port", rc, format!("{name} port 1")));
        }
        if pa.state != sys::IBV_PORT_ACTIVE {
            return Err(Error::Unsupported(format!(
                "{name} port 1 is not ACTIVE (state {})",
                pa.state
            )));
        }
        if pa.link_layer as u32 != sys::IBV_LINK_LAYER_ETHERNET {
            return Err(Error::Unsupported(format!(
                "{name} port 1 is InfiniBand (LID addressing); this backend speaks RoCE"
            )));
        }
        dev.mtu = mtu_bytes(pa.active_mtu);
        let mut entries = Vec::new();
        for i in 0..pa.gid_tbl_len.clamp(0, 256) as u32 {
            // SAFETY: zeroed gid entry is valid plain data.
            let mut e: sys::ibv_gid_entry = unsafe { std::mem::zeroed() };
            let rc = match v._ibv_query_gid_ex {
                // SAFETY: live context, writable entry of the size given.
                Some(f) => unsafe {
                    f(
                        ctx,
                        1,
                        i,
                        &mut e,
                        0,
                        std::mem::size_of::<sys::ibv_gid_entry>(),
                    )
                },
                None => -1,
            };
            if rc == 0 {
                // SAFETY: reading the raw bytes of the union is always valid.
                let raw = unsafe { e.gid.raw };
                entries.push((i as u8, raw, e.gid_type == sys::IBV_GID_TYPE_ROCE_V2));
            }
        }
        dev.gid = choose_gid(&entries)
            .ok_or_else(|| Error::Unsupported(format!("{name} port 1 has no RoCE v2 GID")))?;
        // SAFETY: zeroed device attr is valid; query fills it.
        let mut da: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, writable attr.
        let rc = unsafe { (v.ibv_query_device)(ctx, &mut da) };
        if rc != 0 {
            return Err(verbs_err("ibv_query_device", rc, name.to_string()));
        }
        dev.max_rd_atomic = da.max_qp_rd_atom.clamp(1, 16) as u8;
        tracing::debug!(
            device = name,
            gid_index = dev.gid.index,
            mtu = dev.mtu,
            "mlx5 device opened"
        );
        Ok(Arc::new(dev))
    }

    /// Allocates a PD.
    pub(crate) fn alloc_pd(self: &Arc<Self>) -> Result<Arc<Pd>, Error> {
        // SAFETY: live context.
        let pd = unsafe { (self.libs.verbs.ibv_alloc_pd)(self.ctx) };
        if pd.is_null() {
            return Err(verbs_err("ibv_alloc_pd", errno(), self.name.clone()));
        }
        Ok(Arc::new(Pd {
            dev: self.clone(),
            pd,
        }))
    }

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
            cq,
            ring: out.buf.cast(),
            ncqe: out.cqe_cnt,
            dbrec: out.dbrec.cast(),
            cqn: out.cqn,
        }))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every child object holds an Arc of the device, so none is alive; closed once.
        unsafe { (self.libs.verbs.ibv_close_device)(self.ctx) };
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pub dev: Arc<Device>,
    pd: *mut sys::ibv_pd,
}

// SAFETY: a PD pointer is used only in verbs calls, which are thread-safe.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: children hold an Arc of the PD; deallocated once.
        let rc = unsafe { (self.dev.libs.verbs.ibv_dealloc_pd)(self.pd) };
        if rc != 0 {
            tracing::warn!(errno = rc, "ibv_dealloc_pd failed");
        }
    }
}

/// The verbs access flags of a host-API access set.
fn ibv_access(a: softnic::Access) -> u32 {
    let mut f = 0;
    for (bit, flag) in [
        (softnic::Access::LOCAL_WRITE, sys::IBV_ACCESS_LOCAL_WRITE),
        (softnic::Access::REMOTE_WRITE, sys::IBV_ACCESS_REMOTE_WRITE),
        (softnic::Access::REMOTE_READ, sys::IBV_ACCESS_REMOTE_READ),
        (
            softnic::Access::REMOTE_ATOMIC,
            sys::IBV_ACCESS_REMOTE_ATOMIC,
        ),
    ] {
        if a.contains(bit) {
            f |= flag;
        }
    }
    f
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
        access: softnic::Access,
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
        access: softnic::Access,
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
        // SAFETY: zeroed attrs are valid plain data.
        let mut a: sys::ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
        a.send_cq = scq.cq;
        a.recv_cq = rcq.cq;
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
        let v = self.dev.libs.verbs;
        // SAFETY: live context, CQs and PD; attrs filled above.
        let qp = unsafe { (self.dev.libs.dv.mlx5dv_create_qp)(self.dev.ctx, &mut a, &mut dv) };
        if qp.is_null() {
            return Err(verbs_err(
                "mlx5dv_create_qp",
                errno(),
                format!("RC, {max_send_wr} send WRs, {max_recv_wr} receive WRs"),
            ));
        }
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
        Ok(Arc::new(Qp {
            pd: self.clone(),
            _cqs: (scq.clone(), rcq.clone()),
            qp,
            qpn,
            sq_buf: out.sq.buf.cast(),
            sq_blocks: out.sq.wqe_cnt,
            rq_buf: out.rq.buf.cast(),
            rq_wqes: out.rq.wqe_cnt,
            rq_stride: out.rq.stride,
            dbrec: out.dbrec.cast(),
            bf_reg: out.bf.reg.cast(),
            max_inline: a.cap.max_inline_data,
        }))
    }
}

/// A memory region.
/// How GPU memory was registered on an rdma-core device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuRegPath {
    /// `ibv_reg_dmabuf_mr` with a dma-buf of the GPU pages.
    DmaBuf,
    /// `ibv_reg_mr` on the GPU address (nvidia-peermem).
    PeerMem,
}

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

/// A CQ and where its ring lives.
pub(crate) struct Cq {
    dev: Arc<Device>,
    cq: *mut sys::ibv_cq,
    pub ring: *mut u8,
    pub ncqe: u32,
    pub dbrec: *mut u8,
    pub cqn: u32,
}

// SAFETY: the pointers are the provider's CQ and its memory, owned by this value until drop.
unsafe impl Send for Cq {}
// SAFETY: as above; the memory is accessed through atomics and raw copies by its one poller.
unsafe impl Sync for Cq {}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: QPs using it hold an Arc of it, so none is alive; destroyed once.
        let rc = unsafe { (self.dev.libs.verbs.ibv_destroy_cq)(self.cq) };
        if rc != 0 {
            tracing::warn!(errno = rc, "ibv_destroy_cq failed");
        }
    }
}

/// An RC QP and where its rings, doorbell record and BlueFlame register live.
pub(crate) struct Qp {
    pd: Arc<Pd>,
    _cqs: (Arc<Cq>, Arc<Cq>),
    qp: *mut sys::ibv_qp,
    pub qpn: u32,
    pub sq_buf: *mut u8,
    pub sq_blocks: u32,
    pub rq_buf: *mut u8,
    pub rq_wqes: u32,
    pub rq_stride: u32,
    pub dbrec: *mut u8,
    pub bf_reg: *mut u8,
    pub max_inline: u32,
}

// SAFETY: the provider's QP and its memory, owned by this value until drop; modify calls are
// thread-safe verbs calls; the rings are used by one poster at a time (the host API's claim).
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

/// What RTR needs to know of the peer.
pub(crate) struct Remote {
    pub gid: [u8; 16],
    pub qpn: u32,
    pub psn: u32,
    pub mtu: u32,
}

impl Qp {
    fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: u32,
        what: &'static str,
    ) -> Result<(), Error> {
        // SAFETY: live QP, attr filled by the caller for `mask`.
        let rc = unsafe { (self.pd.dev.libs.verbs.ibv_modify_qp)(self.qp, attr, mask as i32) };
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
        access: softnic::Access,
        r: &Remote,
        sq_psn: u32,
        o: &super::ConnectOptions,
    ) -> Result<(), Error> {
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
        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_RTS;
        a.sq_psn = sq_psn & 0xff_ffff;
        a.timeout = o.timeout;
        a.retry_cnt = o.retry_cnt;
        a.rnr_retry = o.rnr_retry;
        a.max_rd_atomic = dev.max_rd_atomic;
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
        // SAFETY: zeroed attr is valid plain data.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = state;
        self.modify(&mut a, sys::IBV_QP_STATE, "RESET/ERR")
    }

    /// The QP's state as the device reports it (QUERY_QP).
    pub(crate) fn state(&self) -> Result<sys::ibv_qp_state, Error> {
        // SAFETY: zeroed attrs are valid plain data.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut ia: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live QP, writable attrs.
        let rc = unsafe {
            (self.pd.dev.libs.verbs.ibv_query_qp)(
                self.qp,
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
        // SAFETY: created in create_qp, destroyed once; its CQs and PD outlive it (held).
        let rc = unsafe { (self.pd.dev.libs.verbs.ibv_destroy_qp)(self.qp) };
        if rc != 0 {
            tracing::warn!(errno = rc, "ibv_destroy_qp failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_choice_prefers_ipv4_mapped_roce_v2() {
        let mut v4 = [0u8; 16];
        v4[10] = 0xff;
        v4[11] = 0xff;
        v4[12..].copy_from_slice(&[10, 0, 0, 1]);
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        ll[15] = 1;
        let table = [(0, ll, false), (1, ll, true), (2, v4, false), (3, v4, true)];
        assert_eq!(choose_gid(&table), Some(GidChoice { index: 3, gid: v4 }));
        assert_eq!(
            choose_gid(&[(0, ll, false), (1, ll, true)]),
            Some(GidChoice { index: 1, gid: ll })
        );
        assert_eq!(choose_gid(&[(0, ll, false), (2, [0; 16], true)]), None);
        assert_eq!(mtu_enum(4096), 5);
        assert_eq!(mtu_bytes(3), 1024);
    }
}
