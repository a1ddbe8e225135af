//! One opened device file (a uverbs context): its objects, its UAR pages, and the commands the
//! kernel's uverbs core and mlx5_ib driver would answer for it. The object model, the checks
//! and the errnos follow the kernel's: handles per context, objects in use cannot be destroyed
//! (EBUSY), unknown handles are EINVAL, bad user pointers EFAULT, unsupported features
//! EOPNOTSUPP.

use crate::abi::{self, access, qp_attr};
use crate::device::{EmuDevice, MAX_CQE, MAX_QP_WR, MAX_RD_ATOM, MAX_SGE, MAX_SRQ_SGE};
use crate::events::EventQueue;
use crate::peermem;
use crate::uaccess::{check_mapped, copy_from_user, copy_to_user, Errno};
use bytemuck::Pod;
use parking_lot::Mutex;
use prm::doorbell::{BF_OFFSET, UAR_PAGE_SIZE};
use softnic::buffer::DmaBuf;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// BlueFlame register size the context reports (two 256-byte halves).
pub const BF_REG_SIZE: u32 = 512;
/// Non-fast-path BlueFlame registers per UAR page (`MLX5_NON_FP_BFREGS_PER_UAR`).
const BFREGS_PER_UAR: u32 = 2;
/// BlueFlame register slots per UAR page in libmlx5's numbering (`NUM_BFREGS_PER_UAR`).
const GROSS_BFREGS_PER_UAR: u32 = 4;
/// Most BlueFlame registers a context may ask for.
const MAX_BFREGS: u32 = 512;
/// `MLX5_CQ_DOORBELL`: offset of the CQ arm doorbell in UAR page 0.
pub const CQ_DOORBELL: usize = 0x20;

/// An application memory range the device works on, wrapped for the soft NIC. The memory is
/// the application's (the provider allocated it and frees it after destroying the object).
fn user_buf(addr: u64, len: usize) -> Result<DmaBuf, Errno> {
    if addr % 8 != 0 {
        return Err(Errno::EINVAL);
    }
    check_mapped(addr, len as u64)?;
    let p = NonNull::new(addr as *mut u8).ok_or(Errno::EFAULT)?;
    // SAFETY: the range is mapped (checked above) and stays so while the object lives: the
    // provider frees a ring or doorbell record only after the destroy command that drops this
    // buffer, as it must on a real kernel, which pins the pages. Nothing here makes a Rust
    // reference into it; every access goes through the DmaBuf's raw pointers and atomics.
    Ok(unsafe { DmaBuf::from_external(p, len, Box::new(())) })
}

/// A UAR page shared by the application's mapping and the soft NIC's.
struct UarPage {
    buf: Arc<DmaBuf>,
}

/// The memory behind a context's UAR pages: one memfd, mapped once for the device; the
/// application maps the same pages with `mmap` on the device fd.
pub struct Uars {
    memfd: RawFd,
    pages: Vec<UarPage>,
}

impl Uars {
    fn new(n: usize) -> Result<Self, Errno> {
        let os = || {
            Errno(
                std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::ENOMEM),
            )
        };
        // SAFETY: plain system call with a static NUL-terminated name; the result is checked.
        let memfd = unsafe { libc::memfd_create(c"gpuverbs-uar".as_ptr(), libc::MFD_CLOEXEC) };
        if memfd < 0 {
            return Err(os());
        }
        let len = n * UAR_PAGE_SIZE;
        // SAFETY: resizes the memfd we just created.
        if unsafe { libc::ftruncate(memfd, len as libc::off_t) } != 0 {
            let e = os();
            // SAFETY: closes our own fd.
            unsafe { libc::syscall(libc::SYS_close, memfd) };
            return Err(e);
        }
        let mut pages = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: maps page i of our memfd, shared, read-write; the result is checked.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    UAR_PAGE_SIZE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    memfd,
                    (i * UAR_PAGE_SIZE) as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                let e = os();
                // SAFETY: closes our own fd (mappings made so far go with `pages`).
                unsafe { libc::syscall(libc::SYS_close, memfd) };
                return Err(e);
            }
            struct Unmap(usize);
            impl Drop for Unmap {
                fn drop(&mut self) {
                    // SAFETY: unmaps the one page this owner mapped.
                    unsafe { libc::munmap(self.0 as *mut libc::c_void, UAR_PAGE_SIZE) };
                }
            }
            let ptr = NonNull::new(p.cast::<u8>()).ok_or(Errno::ENOMEM)?;
            // SAFETY: a fresh page-aligned shared mapping of 4 KiB, alive until `Unmap` drops
            // with the buffer; only raw-pointer and atomic access.
            let buf =
                unsafe { DmaBuf::from_external(ptr, UAR_PAGE_SIZE, Box::new(Unmap(p as usize))) };
            pages.push(UarPage { buf: Arc::new(buf) });
        }
        Ok(Self { memfd, pages })
    }

    /// Maps UAR page `index` for the application (the device fd's `mmap`).
    pub fn map(
        &self,
        addr: usize,
        len: usize,
        prot: i32,
        flags: i32,
        index: usize,
    ) -> Result<*mut libc::c_void, Errno> {
        if index >= self.pages.len() || len != UAR_PAGE_SIZE || flags & libc::MAP_SHARED == 0 {
            return Err(Errno::EINVAL);
        }
        // SAFETY: maps one page of our memfd where the application asked; the kernel checks
        // `addr`/`flags` exactly as for any mmap.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len,
                prot,
                flags,
                self.memfd,
                (index * UAR_PAGE_SIZE) as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Errno(
                std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::ENOMEM),
            ));
        }
        Ok(p)
    }

    /// The device's view of page 0 (the CQ arm doorbell lives there).
    pub fn page0(&self) -> Option<Arc<DmaBuf>> {
        self.pages.first().map(|p| p.buf.clone())
    }
}

impl Drop for Uars {
    fn drop(&mut self) {
        // SAFETY: closes the memfd this context owns.
        unsafe { libc::syscall(libc::SYS_close, self.memfd) };
    }
}

/// Arming state of a CQ, as its doorbells left it.
#[derive(Default)]
pub struct Arm {
    pub armed: bool,
    pub ci: u32,
    /// The last arm word seen in the CQ's doorbell record.
    pub last_word: u32,
}

/// A CQ.
pub struct CqObj {
    pub soft: Arc<softnic::Cq>,
    pub user_handle: u64,
    pub channel: Option<Arc<EventQueue>>,
    pub comp_reported: Arc<AtomicU32>,
    /// Async events read for this CQ (DESTROY_CQ's `async_events_reported`).
    pub async_reported: Arc<AtomicU32>,
    /// The CQ doorbell record (consumer index, arm word), the application's.
    pub dbrec: DmaBuf,
    pub arm: Mutex<Arm>,
    /// An identity for events (unique per process).
    pub key: u64,
}

struct PdObj {
    id: softnic::PdId,
}

struct MrObj {
    key: u32,
    pd: u32,
}

struct MwObj {
    /// The key the window was allocated with (binds change its low byte).
    key: u32,
    pd: u32,
}

/// What QUERY_QP reports back: the attributes last set.
#[derive(Clone, Copy, Default)]
struct QpAttrs {
    state: u8,
    access: u32,
    pkey_index: u16,
    port: u8,
    dest: abi::QpDest,
    path_mtu: u8,
    dest_qpn: u32,
    rq_psn: u32,
    sq_psn: u32,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    min_rnr_timer: u8,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
}

struct QpObj {
    soft: Arc<softnic::Qp>,
    pd: u32,
    srq: Option<u32>,
    key: u64,
    async_reported: Arc<AtomicU32>,
    send_cq: u32,
    recv_cq: u32,
    caps: abi::CreateQpResp,
    sq_sig_all: u8,
    attrs: QpAttrs,
    bfreg: u32,
}

struct AhObj {
    pd: u32,
}

struct SrqObj {
    soft: Arc<softnic::Srq>,
    pd: u32,
    key: u64,
    async_reported: Arc<AtomicU32>,
}

/// Everything a context owns.
#[derive(Default)]
struct Objects {
    next: u32,
    pds: HashMap<u32, PdObj>,
    mrs: HashMap<u32, MrObj>,
    mws: HashMap<u32, MwObj>,
    cqs: HashMap<u32, Arc<CqObj>>,
    qps: HashMap<u32, QpObj>,
    ahs: HashMap<u32, AhObj>,
    srqs: HashMap<u32, SrqObj>,
    /// Completion channels created through this context, by fd.
    channels: HashMap<RawFd, Arc<EventQueue>>,
    /// QPs per BlueFlame register (non-fast-path numbering).
    bfreg_use: Vec<u32>,
    low_latency: u32,
}

impl Objects {
    fn handle(&mut self) -> u32 {
        self.next += 1;
        self.next
    }
}

/// A new object the caller must register with the emulation (fd tables, event watcher).
pub enum Created {
    Nothing,
    Channel(Arc<EventQueue>),
    Cq(Arc<CqObj>),
}

/// One device file's context.
pub struct Context {
    pub dev: &'static EmuDevice,
    soft: Mutex<Option<Arc<softnic::Device>>>,
    objs: Mutex<Objects>,
    pub uars: Mutex<Option<Uars>>,
    pub async_q: Mutex<Option<Arc<EventQueue>>>,
    cqe_version: Mutex<u8>,
}

/// Where a command's input and output live.
pub struct Io<'a> {
    /// The core command (after the headers).
    pub core: &'a [u8],
    /// The driver (udata) input.
    pub udata: &'a [u8],
    /// Where the core response goes, and how many bytes of it the caller gave room for.
    pub resp: (u64, usize),
    /// Where the driver response goes, and its room.
    pub uresp: (u64, usize),
}

impl Io<'_> {
    fn core<T: Pod>(&self) -> Result<T, Errno> {
        read_prefix(self.core)
    }
    fn udata<T: Pod>(&self) -> Result<T, Errno> {
        read_prefix(self.udata)
    }
    /// Writes the core response: `ENOSPC` when the caller gave less room than it needs.
    fn reply<T: Pod>(&self, v: &T) -> Result<(), Errno> {
        let b = bytemuck::bytes_of(v);
        if self.resp.1 < b.len() {
            return Err(Errno::ENOSPC);
        }
        copy_to_user(self.resp.0, b)
    }
    /// Writes as much of the driver response as the caller has room for (the rest of its
    /// room is zeroed), as `ib_copy_to_udata` with the kernel's `min()` does.
    fn ureply<T: Pod>(&self, v: &T) -> Result<(), Errno> {
        let b = bytemuck::bytes_of(v);
        let n = b.len().min(self.uresp.1);
        copy_to_user(self.uresp.0, &b[..n])?;
        if self.uresp.1 > n {
            copy_to_user(self.uresp.0 + n as u64, &vec![0u8; self.uresp.1 - n])?;
        }
        Ok(())
    }
}

/// The prefix of a struct that `bytes` holds; fields beyond it are zero. Extra bytes past the
/// struct must be zero (the kernel's rule for newer user space: EOPNOTSUPP otherwise).
fn read_prefix<T: Pod>(bytes: &[u8]) -> Result<T, Errno> {
    let mut v = T::zeroed();
    let dst = bytemuck::bytes_of_mut(&mut v);
    let n = dst.len().min(bytes.len());
    dst[..n].copy_from_slice(&bytes[..n]);
    if bytes[n..].iter().any(|&b| b != 0) {
        return Err(Errno::EOPNOTSUPP);
    }
    Ok(v)
}

fn ib_access(flags: u32) -> Result<softnic::Access, Errno> {
    use softnic::Access as A;
    let known = access::LOCAL_WRITE
        | access::REMOTE_WRITE
        | access::REMOTE_READ
        | access::REMOTE_ATOMIC
        | access::MW_BIND
        | access::ZERO_BASED
        | access::ON_DEMAND
        | access::HUGETLB
        | access::OPTIONAL;
    if flags & !known != 0 {
        return Err(Errno::EINVAL);
    }
    let mut a = A::NONE;
    for (bit, right) in [
        (access::LOCAL_WRITE, A::LOCAL_WRITE),
        (access::REMOTE_WRITE, A::REMOTE_WRITE),
        (access::REMOTE_READ, A::REMOTE_READ),
        (access::REMOTE_ATOMIC, A::REMOTE_ATOMIC),
        (access::MW_BIND, A::MW_BIND),
    ] {
        if flags & bit != 0 {
            a = a | right;
        }
    }
    Ok(a)
}

/// `v` when it is at most `max` (a QP attribute in range), else EINVAL.
fn at_most(v: u8, max: u8) -> Result<u8, Errno> {
    if v > max {
        return Err(Errno::EINVAL);
    }
    Ok(v)
}

fn mtu_bytes(m: u8) -> Option<u32> {
    (1..=5).contains(&m).then(|| 128u32 << m)
}

impl Context {
    /// A context on `dev` (GET_CONTEXT not yet issued).
    pub fn new(dev: &'static EmuDevice) -> Self {
        Self {
            dev,
            soft: Mutex::new(None),
            objs: Mutex::new(Objects::default()),
            uars: Mutex::new(None),
            async_q: Mutex::new(None),
            cqe_version: Mutex::new(0),
        }
    }

    fn soft(&self) -> Result<Arc<softnic::Device>, Errno> {
        self.soft.lock().clone().ok_or(Errno::EINVAL)
    }

    /// Runs one legacy command.
    pub fn command(&self, cmd: u32, io: &Io<'_>) -> Result<Created, Errno> {
        use abi::cmd as c;
        if cmd != c::GET_CONTEXT && self.soft.lock().is_none() {
            return Err(Errno::EINVAL);
        }
        match cmd {
            c::GET_CONTEXT => self.get_context(io),
            c::QUERY_DEVICE => io.reply(&self.dev.attr()).map(|_| Created::Nothing),
            c::QUERY_PORT => self.query_port(io),
            c::ALLOC_PD => self.alloc_pd(io),
            c::DEALLOC_PD => self.dealloc_pd(io),
            c::REG_MR => self.reg_mr(io),
            c::REREG_MR => self.rereg_mr(io),
            c::DEREG_MR => self.dereg_mr(io),
            c::ALLOC_MW => self.alloc_mw(io),
            c::DEALLOC_MW => self.dealloc_mw(io),
            c::CREATE_COMP_CHANNEL => self.create_comp_channel(io),
            c::CREATE_CQ => {
                let r: abi::CreateCq = io.core()?;
                self.create_cq(
                    io,
                    r.user_handle,
                    r.cqe,
                    r.comp_vector,
                    r.comp_channel,
                    false,
                )
            }
            c::DESTROY_CQ => self.destroy_cq(io),
            c::RESIZE_CQ => self.resize_cq(io),
            c::CREATE_SRQ => self.create_srq(io),
            c::MODIFY_SRQ => self.modify_srq(io),
            c::QUERY_SRQ => self.query_srq(io),
            c::DESTROY_SRQ => self.destroy_srq(io),
            c::CREATE_QP => {
                let r: abi::CreateQp = io.core()?;
                let ex = abi::ExCreateQp {
                    user_handle: r.user_handle,
                    pd_handle: r.pd_handle,
                    send_cq_handle: r.send_cq_handle,
                    recv_cq_handle: r.recv_cq_handle,
                    srq_handle: r.srq_handle,
                    max_send_wr: r.max_send_wr,
                    max_recv_wr: r.max_recv_wr,
                    max_send_sge: r.max_send_sge,
                    max_recv_sge: r.max_recv_sge,
                    max_inline_data: r.max_inline_data,
                    sq_sig_all: r.sq_sig_all,
                    qp_type: r.qp_type,
                    is_srq: r.is_srq,
                    ..Default::default()
                };
                self.create_qp(io, &ex, false)
            }
            c::MODIFY_QP => {
                let r: abi::ModifyQp = io.core()?;
                self.modify_qp(&r).map(|_| Created::Nothing)
            }
            c::QUERY_QP => self.query_qp(io),
            c::DESTROY_QP => self.destroy_qp(io),
            c::CREATE_AH => self.create_ah(io),
            c::DESTROY_AH => self.destroy_ah(io),
            _ => Err(unsupported(abi::cmd_name(cmd))),
        }
    }

    /// Runs one extended command.
    pub fn ex_command(&self, cmd: u32, io: &Io<'_>) -> Result<Created, Errno> {
        use abi::ex_cmd as x;
        if self.soft.lock().is_none() {
            return Err(Errno::EINVAL);
        }
        match cmd {
            x::QUERY_DEVICE => self.ex_query_device(io),
            x::CREATE_CQ => {
                let r: abi::ExCreateCq = io.core()?;
                if r.comp_mask != 0 || r.flags & !1 != 0 {
                    // only IB_UVERBS_CQ_FLAGS_TIMESTAMP_COMPLETION is known, and not served
                    return Err(Errno::EOPNOTSUPP);
                }
                if r.flags != 0 {
                    return Err(unsupported("EX_CREATE_CQ with completion timestamps"));
                }
                self.create_cq(
                    io,
                    r.user_handle,
                    r.cqe,
                    r.comp_vector,
                    r.comp_channel,
                    true,
                )
            }
            x::CREATE_QP => {
                let r: abi::ExCreateQp = io.core()?;
                if r.comp_mask != 0 || r.create_flags != 0 {
                    return Err(unsupported("EX_CREATE_QP with create flags or RSS"));
                }
                self.create_qp(io, &r, true)
            }
            x::MODIFY_QP => {
                let r: abi::ExModifyQp = io.core()?;
                if r.base.attr_mask & qp_attr::RATE_LIMIT != 0 {
                    return Err(unsupported("EX_MODIFY_QP rate limit"));
                }
                self.modify_qp(&r.base)?;
                io.reply(&abi::ExModifyQpResp {
                    comp_mask: 0,
                    response_length: 8,
                })
                .or(Ok(()))
                .map(|_: ()| Created::Nothing)
            }
            _ => Err(unsupported(abi::ex_cmd_name(cmd))),
        }
    }

    fn get_context(&self, io: &Io<'_>) -> Result<Created, Errno> {
        if self.soft.lock().is_some() {
            return Err(Errno::EINVAL);
        }
        let req: abi::Mlx5AllocUcontextReq = io.udata()?;
        if req.flags & !1 != 0 {
            return Err(Errno::EINVAL);
        }
        if req.flags & 1 != 0 {
            // MLX5_IB_ALLOC_UCTX_DEVX: DEVX is an ioctl-only interface this kernel lacks;
            // the provider retries without it.
            return Err(Errno::EOPNOTSUPP);
        }
        let total = req
            .total_num_bfregs
            .max(BFREGS_PER_UAR)
            .next_multiple_of(BFREGS_PER_UAR);
        if total > MAX_BFREGS || req.num_low_latency_bfregs > total - 1 {
            return Err(Errno::EINVAL);
        }
        let soft = self.dev.soft()?;
        let uars = Uars::new((total / BFREGS_PER_UAR) as usize)?;
        let async_q = EventQueue::new(16)?;
        let cqe_version = req.max_cqe_version.min(1);
        let resp = abi::GetContextResp {
            async_fd: async_q.fd() as u32,
            num_comp_vectors: 1,
        };
        io.reply(&resp)?;
        io.ureply(&abi::Mlx5AllocUcontextResp {
            qp_tab_size: 1 << 18,
            bf_reg_size: BF_REG_SIZE,
            tot_bfregs: total,
            cache_line_size: 64,
            max_sq_desc_sz: 512,
            max_rq_desc_sz: 512,
            max_send_wqebb: MAX_QP_WR,
            max_recv_wr: MAX_QP_WR,
            max_srq_recv_wr: MAX_QP_WR,
            num_ports: 1,
            flow_action_flags: 0,
            comp_mask: 0,
            response_length: std::mem::size_of::<abi::Mlx5AllocUcontextResp>() as u32,
            cqe_version,
            // QUERY_DEVICE and CREATE_AH carry driver data
            cmds_supp_uhw: 0x3,
            eth_min_inline: 0,
            clock_info_versions: 0,
            hca_core_clock_offset: 0,
            log_uar_size: 12,
            num_uars_per_page: 1,
            num_dyn_bfregs: 0,
            dump_fill_mkey: 0,
        })?;
        {
            let mut o = self.objs.lock();
            o.bfreg_use = vec![0; total as usize];
            o.low_latency = req.num_low_latency_bfregs;
        }
        *self.cqe_version.lock() = cqe_version;
        *self.uars.lock() = Some(uars);
        *self.async_q.lock() = Some(async_q);
        *self.soft.lock() = Some(soft);
        Ok(Created::Nothing)
    }

    fn ex_query_device(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ExQueryDevice = io.core()?;
        if r.comp_mask != 0 || r.reserved != 0 {
            return Err(Errno::EINVAL);
        }
        let base = self.dev.attr();
        let resp = abi::ExQueryDeviceResp {
            base,
            device_cap_flags_ex: base.device_cap_flags as u64,
            response_length: std::mem::size_of::<abi::ExQueryDeviceResp>().min(io.resp.1) as u32,
            max_dm_size: 0,
            ..Default::default()
        };
        let b = bytemuck::bytes_of(&resp);
        let n = b.len().min(io.resp.1);
        if n < std::mem::size_of::<abi::QueryDeviceResp>() + 8 {
            return Err(Errno::ENOSPC);
        }
        copy_to_user(io.resp.0, &b[..n])?;
        io.ureply(&abi::Mlx5QueryDeviceResp {
            comp_mask: 0,
            response_length: 8,
            ..Default::default()
        })?;
        Ok(Created::Nothing)
    }

    fn query_port(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::QueryPort = io.core()?;
        if r.port_num != 1 {
            return Err(Errno::EINVAL);
        }
        io.reply(&self.dev.port())?;
        Ok(Created::Nothing)
    }

    fn alloc_pd(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let id = soft.alloc_pd();
        let h = o.handle();
        io.reply(&abi::AllocPdResp { pd_handle: h })?;
        io.ureply(&abi::Mlx5AllocPdResp { pdn: id.0 })?;
        o.pds.insert(h, PdObj { id });
        Ok(Created::Nothing)
    }

    fn dealloc_pd(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Handle = io.core()?;
        let mut o = self.objs.lock();
        if !o.pds.contains_key(&r.handle) {
            return Err(Errno::EINVAL);
        }
        let used = o.mrs.values().any(|m| m.pd == r.handle)
            || o.mws.values().any(|m| m.pd == r.handle)
            || o.qps.values().any(|q| q.pd == r.handle)
            || o.ahs.values().any(|a| a.pd == r.handle)
            || o.srqs.values().any(|q| q.pd == r.handle);
        if used {
            return Err(Errno::EBUSY);
        }
        o.pds.remove(&r.handle);
        Ok(Created::Nothing)
    }

    fn check_mr(
        start: u64,
        length: u64,
        hca_va: u64,
        flags: u32,
    ) -> Result<softnic::Access, Errno> {
        let a = ib_access(flags)?;
        if (flags & (access::REMOTE_WRITE | access::REMOTE_ATOMIC)) != 0
            && flags & access::LOCAL_WRITE == 0
        {
            return Err(Errno::EINVAL);
        }
        if flags & access::ON_DEMAND != 0 {
            return Err(unsupported("REG_MR with IBV_ACCESS_ON_DEMAND (no ODP)"));
        }
        if flags & access::ZERO_BASED != 0 {
            return Err(Errno::EINVAL);
        }
        if length == 0 || start.checked_add(length).is_none() {
            return Err(Errno::EINVAL);
        }
        if hca_va != start {
            return Err(unsupported("REG_MR with an IOVA other than the address"));
        }
        Ok(a)
    }

    fn reg_mr(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::RegMr = io.core()?;
        let a = Self::check_mr(r.start, r.length, r.hca_va, r.access_flags)?;
        // host memory, else GPU memory resolved as nvidia-peermem would, else EFAULT
        let gpu = match check_mapped(r.start, r.length) {
            Ok(()) => None,
            Err(e) => Some(peermem::resolve(r.start, r.length).ok_or(e)?),
        };
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let pd = o.pds.get(&r.pd_handle).ok_or(Errno::EINVAL)?.id;
        let info = match gpu {
            Some(mem) => soft.reg_device(pd, r.start, r.length, a, mem),
            // SAFETY: the range is mapped (checked); an application that unmaps registered
            // memory before deregistering it breaks the verbs contract (the kernel would keep
            // the pages pinned; here the device's accesses would fault in the application's
            // own process).
            None => unsafe { soft.reg_host(pd, r.start, r.length, a) },
        }
        .map_err(|_| Errno::EINVAL)?;
        let h = o.handle();
        if let Err(e) = io.reply(&abi::RegMrResp {
            mr_handle: h,
            lkey: info.key,
            rkey: info.key,
        }) {
            let _ = soft.dereg(info.key);
            return Err(e);
        }
        o.mrs.insert(
            h,
            MrObj {
                key: info.key,
                pd: r.pd_handle,
            },
        );
        Ok(Created::Nothing)
    }

    /// REG_DMABUF_MR (the ioctl path; `attrs` are the command's attributes, at `uattrs` in the
    /// caller's memory): a region over a dma-buf, as mlx5_ib's `reg_user_mr_dmabuf`. The
    /// emulated kernel cannot map a dma-buf's pages; it checks that the fd is a dma-buf that
    /// holds `offset + length` bytes, and that the range at the IOVA (the address peers and
    /// WQEs name the region by) and the dma-buf's first byte (`iova - offset`) are device
    /// memory of one GPU allocation, whose bytes the soft NIC then moves with CUDA copies
    /// ([`peermem`]). Access flags as REG_MR; a bad PD or a missing attribute: EINVAL; not a
    /// dma-buf: EINVAL; a range it cannot resolve: EFAULT.
    pub fn reg_dmabuf_mr(&self, uattrs: u64, attrs: &[abi::IoctlAttr]) -> Result<(), Errno> {
        use abi::ioctl::reg_dmabuf_mr as id;
        let find = |want: u16| {
            attrs
                .iter()
                .position(|a| a.attr_id == want)
                .ok_or(Errno::EINVAL)
        };
        let inline = |want: u16| -> Result<u64, Errno> {
            let a = attrs[find(want)?];
            if a.len > 8 {
                return Err(Errno::EINVAL);
            }
            Ok(a.data)
        };
        let (pd_h, offset, length, iova) = (
            inline(id::PD_HANDLE)? as u32,
            inline(id::OFFSET)?,
            inline(id::LENGTH)?,
            inline(id::IOVA)?,
        );
        let (fd, flags) = (inline(id::FD)? as i32, inline(id::ACCESS_FLAGS)? as u32);
        let (h_at, lkey_at, rkey_at) = (
            find(id::HANDLE)?,
            find(id::RESP_LKEY)?,
            find(id::RESP_RKEY)?,
        );
        let a = Self::check_mr(iova, length, iova, flags)?;
        let end = offset.checked_add(length).ok_or(Errno::EINVAL)?;
        if !is_dmabuf(fd)? {
            return Err(Errno::EINVAL);
        }
        if dmabuf_size(fd).is_some_and(|size| end > size) {
            return Err(Errno::EINVAL);
        }
        let first = iova.checked_sub(offset).ok_or(Errno::EINVAL)?;
        let mem = peermem::resolve(first, end).ok_or(Errno::EFAULT)?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let pd = o.pds.get(&pd_h).ok_or(Errno::EINVAL)?.id;
        let info = soft
            .reg_device(pd, iova, length, a, mem)
            .map_err(|_| Errno::EINVAL)?;
        let h = o.handle();
        let out = || -> Result<(), Errno> {
            let at = |i: usize| uattrs + 16 * i as u64;
            copy_to_user(
                attrs[lkey_at].data,
                &info.key.to_ne_bytes()[..attrs[lkey_at].len.min(4) as usize],
            )?;
            copy_to_user(
                attrs[rkey_at].data,
                &info.key.to_ne_bytes()[..attrs[rkey_at].len.min(4) as usize],
            )?;
            // the new object's handle goes back in the attribute's data
            copy_to_user(at(h_at) + 8, &u64::from(h).to_ne_bytes())?;
            for i in [h_at, lkey_at, rkey_at] {
                let f = attrs[i].flags | abi::ioctl::ATTR_F_VALID_OUTPUT;
                copy_to_user(at(i) + 4, &f.to_ne_bytes())?;
            }
            Ok(())
        };
        if let Err(e) = out() {
            let _ = soft.dereg(info.key);
            return Err(e);
        }
        o.mrs.insert(
            h,
            MrObj {
                key: info.key,
                pd: pd_h,
            },
        );
        Ok(())
    }

    fn rereg_mr(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ReregMr = io.core()?;
        // IB_MR_REREG_TRANS 1, _PD 2, _ACCESS 4
        if r.flags == 0 || r.flags & !7 != 0 {
            return Err(Errno::EINVAL);
        }
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let mr = o.mrs.get(&r.mr_handle).ok_or(Errno::EINVAL)?;
        let old = soft.mr(mr.key).ok_or(Errno::EINVAL)?;
        let (start, len) = if r.flags & 1 != 0 {
            (r.start, r.length)
        } else {
            (old.addr, old.len)
        };
        let va = if r.flags & 1 != 0 { r.hca_va } else { start };
        let pd_handle = if r.flags & 2 != 0 { r.pd_handle } else { mr.pd };
        let pd = o.pds.get(&pd_handle).ok_or(Errno::EINVAL)?.id;
        if old.kind != softnic::MemKind::Host {
            return Err(unsupported("REREG_MR of GPU memory"));
        }
        let a = if r.flags & 4 != 0 {
            Self::check_mr(start, len, va, r.access_flags)?
        } else {
            Self::check_mr(start, len, va, 0)?;
            old.access
        };
        check_mapped(start, len)?;
        // The key stays (mlx5_ib modifies the mkey in place).
        // SAFETY: as in reg_mr, for the new range.
        let info =
            unsafe { soft.rereg_host(old.key, pd, start, len, a) }.map_err(|_| Errno::EINVAL)?;
        let h = r.mr_handle;
        io.reply(&abi::ReregMrResp {
            lkey: info.key,
            rkey: info.key,
        })?;
        o.mrs.insert(
            h,
            MrObj {
                key: info.key,
                pd: pd_handle,
            },
        );
        Ok(Created::Nothing)
    }

    fn dereg_mr(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Handle = io.core()?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let mr = o.mrs.remove(&r.handle).ok_or(Errno::EINVAL)?;
        soft.dereg(mr.key).map_err(|_| Errno::EINVAL)?;
        Ok(Created::Nothing)
    }

    /// ALLOC_MW as mlx5_ib serves it: type 1 or 2 (else EINVAL), driver data with nothing
    /// set but the KLM count (else EOPNOTSUPP).
    fn alloc_mw(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::AllocMw = io.core()?;
        let req: abi::Mlx5AllocMw = io.udata()?;
        if req.comp_mask != 0 || req.reserved1 != 0 || req.reserved2 != 0 {
            return Err(Errno::EOPNOTSUPP);
        }
        let kind = match r.mw_type {
            1 => softnic::MwType::One,
            2 => softnic::MwType::Two,
            _ => return Err(Errno::EINVAL),
        };
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let pd = o.pds.get(&r.pd_handle).ok_or(Errno::EINVAL)?.id;
        let key = soft.alloc_mw(pd, kind);
        let h = o.handle();
        if let Err(e) = io.reply(&abi::AllocMwResp {
            mw_handle: h,
            rkey: key,
        }) {
            let _ = soft.dealloc_mw(key);
            return Err(e);
        }
        o.mws.insert(
            h,
            MwObj {
                key,
                pd: r.pd_handle,
            },
        );
        Ok(Created::Nothing)
    }

    fn dealloc_mw(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Handle = io.core()?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let mw = o.mws.remove(&r.handle).ok_or(Errno::EINVAL)?;
        soft.dealloc_mw(mw.key).map_err(|_| Errno::EINVAL)?;
        Ok(Created::Nothing)
    }

    fn create_comp_channel(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let q = EventQueue::new(8)?;
        io.reply(&abi::CompChannelResp { fd: q.fd() as u32 })?;
        self.objs.lock().channels.insert(q.fd(), q.clone());
        Ok(Created::Channel(q))
    }

    /// Forgets a completion channel the application closed.
    pub fn close_channel(&self, fd: RawFd) {
        self.objs.lock().channels.remove(&fd);
    }

    fn create_cq(
        &self,
        io: &Io<'_>,
        user_handle: u64,
        cqe: u32,
        comp_vector: u32,
        channel: i32,
        ex: bool,
    ) -> Result<Created, Errno> {
        let u: abi::Mlx5CreateCq = io.udata()?;
        if io.udata.len() < 24 {
            return Err(Errno::EINVAL);
        }
        if cqe == 0 || cqe > MAX_CQE || comp_vector != 0 {
            return Err(Errno::EINVAL);
        }
        if u.cqe_size != 64 {
            return Err(if u.cqe_size == 128 {
                unsupported("128-byte CQEs")
            } else {
                Errno::EINVAL
            });
        }
        if u.cqe_comp_en != 0 || u.flags != 0 {
            return Err(unsupported("CQE compression or CQ creation flags"));
        }
        let ncqe = (cqe + 1).next_power_of_two();
        let ring = user_buf(u.buf_addr, ncqe as usize * 64)?;
        let dbrec = user_buf(u.db_addr, 8)?;
        let arm_view = user_buf(u.db_addr, 8)?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let channel = match channel {
            -1 => None,
            fd => Some(o.channels.get(&fd).cloned().ok_or(Errno::EINVAL)?),
        };
        let scq = soft
            .create_cq(softnic::CqConfig {
                ncqe,
                mode: softnic::CqMode::OverrunDetect,
                init: softnic::CqInit::Invalid,
                ring: Some(ring),
                dbrec: Some(dbrec),
            })
            .map_err(|_| Errno::EINVAL)?;
        let h = o.handle();
        let reply = if ex {
            io.reply(&abi::ExCreateCqResp {
                cq_handle: h,
                cqe: ncqe - 1,
                comp_mask: 0,
                response_length: 16,
            })
        } else {
            io.reply(&abi::CreateCqResp {
                cq_handle: h,
                cqe: ncqe - 1,
            })
        };
        if let Err(e) = reply.and_then(|_| {
            io.ureply(&abi::Mlx5CreateCqResp {
                cqn: scq.cqn(),
                reserved: 0,
            })
        }) {
            let _ = soft.destroy_cq(&scq);
            return Err(e);
        }
        let async_reported: Arc<AtomicU32> = Arc::default();
        let key = crate::next_key();
        scq.set_event_handler(Some(self.event_handler(
            user_handle,
            key,
            async_reported.clone(),
        )));
        let obj = Arc::new(CqObj {
            soft: scq,
            user_handle,
            channel,
            comp_reported: Arc::default(),
            async_reported,
            dbrec: arm_view,
            arm: Mutex::new(Arm::default()),
            key,
        });
        o.cqs.insert(h, obj.clone());
        Ok(Created::Cq(obj))
    }

    fn destroy_cq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Destroy = io.core()?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let cq = o.cqs.get(&r.handle).ok_or(Errno::EINVAL)?.clone();
        if o.qps
            .values()
            .any(|q| q.send_cq == r.handle || q.recv_cq == r.handle)
        {
            return Err(Errno::EBUSY);
        }
        soft.destroy_cq(&cq.soft).map_err(|_| Errno::EBUSY)?;
        o.cqs.remove(&r.handle);
        cq.soft.set_event_handler(None);
        if let Some(ch) = &cq.channel {
            ch.purge(cq.key);
        }
        self.purge_async(cq.key);
        io.reply(&abi::DestroyCqResp {
            comp_events_reported: cq.comp_reported.load(Ordering::Acquire),
            async_events_reported: cq.async_reported.load(Ordering::Acquire),
        })?;
        Ok(Created::Nothing)
    }

    /// Picks a BlueFlame register for a new QP as mlx5_ib does: a dedicated low-latency one
    /// while any is free, else the least used of the shared ones (never register 0, which
    /// the provider uses without BlueFlame). Returns the index in the non-fast-path numbering.
    fn alloc_bfreg(o: &mut Objects) -> u32 {
        let total = o.bfreg_use.len() as u32;
        let first_ll = total - o.low_latency;
        if let Some(i) = (first_ll..total).find(|&i| o.bfreg_use[i as usize] == 0) {
            o.bfreg_use[i as usize] += 1;
            return i;
        }
        let i = (1..first_ll.max(2).min(total))
            .min_by_key(|&i| o.bfreg_use[i as usize])
            .unwrap_or(0);
        o.bfreg_use[i as usize] += 1;
        i
    }

    fn create_qp(&self, io: &Io<'_>, r: &abi::ExCreateQp, ex: bool) -> Result<Created, Errno> {
        const IBV_QPT_RC: u8 = 2;
        let u: abi::Mlx5CreateQp = io.udata()?;
        if io.udata.len() < 32 {
            return Err(Errno::EINVAL);
        }
        if r.qp_type != IBV_QPT_RC {
            return Err(unsupported("QP types other than RC"));
        }
        let srq_handle = (r.is_srq != 0).then_some(r.srq_handle);
        use abi::mlx5_qp_flag as f;
        let known = f::SIGNATURE
            | f::SCATTER_CQE
            | f::BFREG_INDEX
            | f::UAR_PAGE_INDEX
            | f::ALLOW_SCATTER_CQE;
        if u.flags & !known != 0 {
            return Err(unsupported(
                "mlx5 QP creation flags (DCT, DCI, tunnel offloads, ...)",
            ));
        }
        if u.flags & (f::BFREG_INDEX | f::UAR_PAGE_INDEX) != 0 {
            // dynamically allocated UARs come from an ioctl this kernel does not have
            return Err(Errno::EINVAL);
        }
        if r.max_send_wr > MAX_QP_WR
            || r.max_recv_wr > MAX_QP_WR
            || r.max_send_sge > MAX_SGE
            || r.max_recv_sge > MAX_SGE
        {
            return Err(Errno::EINVAL);
        }
        let pow2 = |n: u32| n == 0 || n.is_power_of_two();
        // a QP on an SRQ has no RQ (the provider allocates none)
        let rq_wqe_count = if srq_handle.is_some() {
            0
        } else {
            u.rq_wqe_count
        };
        if !pow2(u.sq_wqe_count)
            || u.sq_wqe_count == 0
            || u.sq_wqe_count > MAX_QP_WR
            || !pow2(rq_wqe_count)
            || rq_wqe_count > MAX_QP_WR
        {
            return Err(Errno::EINVAL);
        }
        let rq_stride = 1u32
            .checked_shl(u.rq_wqe_shift)
            .filter(|&s| (16..=512).contains(&s));
        let rq_stride = match (rq_wqe_count, rq_stride) {
            (0, _) => 16,
            (_, Some(s)) => s,
            (_, None) => return Err(Errno::EINVAL),
        };
        let rq_bytes = rq_wqe_count as usize * rq_stride as usize;
        let sq_bytes = u.sq_wqe_count as usize * prm::WQEBB;
        check_mapped(u.buf_addr, (rq_bytes + sq_bytes) as u64)?;
        let rq_ring = if rq_bytes > 0 {
            Some(user_buf(u.buf_addr, rq_bytes)?)
        } else {
            None
        };
        let sq_ring = user_buf(u.buf_addr + rq_bytes as u64, sq_bytes)?;
        let dbrec = user_buf(u.db_addr, 8)?;
        let soft = self.soft()?;
        let cqe_version = *self.cqe_version.lock();
        let mut o = self.objs.lock();
        let pd = o.pds.get(&r.pd_handle).ok_or(Errno::EINVAL)?.id;
        let scq = o
            .cqs
            .get(&r.send_cq_handle)
            .ok_or(Errno::EINVAL)?
            .soft
            .clone();
        let rcq = o
            .cqs
            .get(&r.recv_cq_handle)
            .ok_or(Errno::EINVAL)?
            .soft
            .clone();
        let srq = match srq_handle {
            Some(h) => Some(o.srqs.get(&h).ok_or(Errno::EINVAL)?.soft.clone()),
            None => None,
        };
        let uars = self.uars.lock();
        let uars = uars.as_ref().ok_or(Errno::EINVAL)?;
        let bfreg = Self::alloc_bfreg(&mut o);
        let page = uars.pages[(bfreg / BFREGS_PER_UAR) as usize].buf.clone();
        let offset = BF_OFFSET + (bfreg % BFREGS_PER_UAR) as usize * BF_REG_SIZE as usize;
        let cfg = softnic::QpConfig {
            pd,
            send_cq: scq,
            recv_cq: rcq,
            sq_blocks: u.sq_wqe_count,
            rq_wqes: rq_wqe_count,
            max_recv_sge: (rq_stride / 16).min(32),
            max_inline: prm::wqe::MAX_INLINE_SEND as u32,
            doorbell: softnic::DoorbellKind::Register,
            sq_ring: Some(sq_ring),
            rq_ring,
            rq_stride: Some(rq_stride),
            dbrec: Some(dbrec),
            uar: Some(softnic::qp::UarRegister { page, offset }),
            user_index: (cqe_version == 1).then_some(u.uidx & 0xff_ffff),
        };
        let created = match &srq {
            Some(s) => soft.create_qp_on_srq(cfg, s),
            None => soft.create_qp(cfg),
        };
        let sqp = match created {
            Ok(q) => q,
            Err(_) => {
                o.bfreg_use[bfreg as usize] -= 1;
                return Err(Errno::EINVAL);
            }
        };
        let h = o.handle();
        let caps = abi::CreateQpResp {
            qp_handle: h,
            qpn: sqp.qpn(),
            max_send_wr: r.max_send_wr,
            max_recv_wr: r.max_recv_wr,
            max_send_sge: r.max_send_sge,
            max_recv_sge: r.max_recv_sge,
            max_inline_data: r.max_inline_data,
            reserved: 0,
        };
        let caps = if srq.is_some() {
            // mlx5_ib: a QP without an RQ reports no receive capacity
            abi::CreateQpResp {
                max_recv_wr: 0,
                max_recv_sge: 0,
                ..caps
            }
        } else {
            caps
        };
        let gross = bfreg / BFREGS_PER_UAR * GROSS_BFREGS_PER_UAR + bfreg % BFREGS_PER_UAR;
        let reply = if ex {
            io.reply(&abi::ExCreateQpResp {
                base: caps,
                comp_mask: 0,
                response_length: 40,
            })
        } else {
            io.reply(&caps)
        };
        if let Err(e) = reply.and_then(|_| {
            io.ureply(&abi::Mlx5CreateQpResp {
                bfreg_index: gross,
                ..Default::default()
            })
        }) {
            soft.destroy_qp(&sqp);
            o.bfreg_use[bfreg as usize] -= 1;
            return Err(e);
        }
        let key = crate::next_key();
        let async_reported: Arc<AtomicU32> = Arc::default();
        sqp.set_event_handler(Some(self.event_handler(
            r.user_handle,
            key,
            async_reported.clone(),
        )));
        o.qps.insert(
            h,
            QpObj {
                soft: sqp,
                pd: r.pd_handle,
                srq: srq_handle,
                key,
                async_reported,
                send_cq: r.send_cq_handle,
                recv_cq: r.recv_cq_handle,
                caps,
                sq_sig_all: r.sq_sig_all,
                attrs: QpAttrs::default(),
                bfreg,
            },
        );
        Ok(Created::Nothing)
    }

    fn modify_qp(&self, m: &abi::ModifyQp) -> Result<(), Errno> {
        use qp_attr::*;
        use softnic::QpState as S;
        let mut o = self.objs.lock();
        let q = o.qps.get_mut(&m.qp_handle).ok_or(Errno::EINVAL)?;
        let cur = match q.soft.state() {
            S::Reset => 0u8,
            S::Init => 1,
            S::Rtr => 2,
            S::Rts => 3,
            S::Err => 6,
        };
        if m.attr_mask & CUR_STATE != 0 && m.cur_qp_state != cur {
            return Err(Errno::EINVAL);
        }
        let new = if m.attr_mask & STATE != 0 {
            m.qp_state
        } else {
            cur
        };
        // ib_modify_qp_is_ok for RC: (required, optional) attributes per transition
        let (req, opt) = match (cur, new) {
            (_, 0) | (_, 6) => (0, 0),
            (0, 1) => (PKEY_INDEX | PORT | ACCESS_FLAGS, 0),
            (1, 1) => (0, PKEY_INDEX | PORT | ACCESS_FLAGS),
            (1, 2) => (
                AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER,
                ALT_PATH | ACCESS_FLAGS | PKEY_INDEX,
            ),
            (2, 3) => (
                TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC,
                CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE,
            ),
            (3, 3) => (
                0,
                CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE | MIN_RNR_TIMER,
            ),
            _ => return Err(Errno::EINVAL),
        };
        let given = m.attr_mask & !STATE;
        if given & req != req || given & !(req | opt | CUR_STATE) != 0 {
            return Err(Errno::EINVAL);
        }
        if given & ALT_PATH != 0 || given & PATH_MIG_STATE != 0 {
            return Err(unsupported("alternate paths (APM)"));
        }
        let mut a = q.attrs;
        if given & PORT != 0 {
            if m.port_num != 1 {
                return Err(Errno::EINVAL);
            }
            a.port = 1;
        }
        if given & PKEY_INDEX != 0 {
            if m.pkey_index != 0 {
                return Err(Errno::EINVAL);
            }
            a.pkey_index = 0;
        }
        if given & ACCESS_FLAGS != 0 {
            if m.qp_access_flags
                & !(access::LOCAL_WRITE
                    | access::REMOTE_WRITE
                    | access::REMOTE_READ
                    | access::REMOTE_ATOMIC
                    | access::MW_BIND)
                != 0
            {
                return Err(Errno::EINVAL);
            }
            a.access = m.qp_access_flags;
        }
        if given & AV != 0 {
            // RoCE needs a GRH; the destination GID must be an address the wire can reach
            if m.dest.is_global == 0 || m.dest.sgid_index != 0 {
                return Err(Errno::EINVAL);
            }
            if softnic::Gid(m.dest.dgid).to_ipv4().is_none() {
                return Err(unsupported(
                    "destination GIDs that are not IPv4-mapped (RoCE v2 over IPv4 only)",
                ));
            }
            a.dest = m.dest;
        }
        if given & PATH_MTU != 0 {
            mtu_bytes(m.path_mtu).ok_or(Errno::EINVAL)?;
            a.path_mtu = m.path_mtu;
        }
        if given & DEST_QPN != 0 {
            if m.dest_qp_num > 0xff_ffff {
                return Err(Errno::EINVAL);
            }
            a.dest_qpn = m.dest_qp_num;
        }
        if given & RQ_PSN != 0 {
            a.rq_psn = m.rq_psn & 0xff_ffff;
        }
        if given & SQ_PSN != 0 {
            a.sq_psn = m.sq_psn & 0xff_ffff;
        }
        if given & MAX_DEST_RD_ATOMIC != 0 {
            a.max_dest_rd_atomic = at_most(m.max_dest_rd_atomic, MAX_RD_ATOM as u8)?;
        }
        if given & MAX_QP_RD_ATOMIC != 0 {
            a.max_rd_atomic = at_most(m.max_rd_atomic, MAX_RD_ATOM as u8)?;
        }
        if given & MIN_RNR_TIMER != 0 {
            a.min_rnr_timer = at_most(m.min_rnr_timer, 31)?;
        }
        if given & TIMEOUT != 0 {
            a.timeout = at_most(m.timeout, 31)?;
        }
        if given & RETRY_CNT != 0 {
            a.retry_cnt = at_most(m.retry_cnt, 7)?;
        }
        if given & RNR_RETRY != 0 {
            a.rnr_retry = at_most(m.rnr_retry, 7)?;
        }
        let rights = ib_access(
            a.access & (access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC),
        )?;
        let step = match (cur, new) {
            (_, 0) => Some(softnic::Modify::Reset),
            (_, 6) => Some(softnic::Modify::Err),
            (_, 1) => Some(softnic::Modify::Init { access: rights }),
            (1, 2) => Some(softnic::Modify::Rtr(softnic::RtrAttr {
                remote_gid: softnic::Gid(a.dest.dgid),
                remote_qpn: a.dest_qpn,
                rq_psn: a.rq_psn,
                mtu: mtu_bytes(a.path_mtu).ok_or(Errno::EINVAL)?,
                min_rnr_timer: a.min_rnr_timer,
                selective_repeat: false,
            })),
            (_, 3) => Some(softnic::Modify::Rts(softnic::RtsAttr {
                sq_psn: a.sq_psn,
                timeout: a.timeout,
                retry_cnt: a.retry_cnt,
                rnr_retry: a.rnr_retry,
            })),
            _ => None,
        };
        if let Some(s) = step {
            if matches!(s, softnic::Modify::Reset) {
                // RESET returns only once the device is done with the QP (libmlx5 then
                // removes the QP's CQEs from its CQs): the flush of an errored QP completes first
                self.soft()?.drain_errored(&q.soft);
            }
            q.soft.modify(s).map_err(|_| Errno::EINVAL)?;
        }
        if new == 0 {
            a = QpAttrs::default();
        }
        a.state = new;
        q.attrs = a;
        Ok(())
    }

    fn query_qp(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::QueryQp = io.core()?;
        let o = self.objs.lock();
        let q = o.qps.get(&r.qp_handle).ok_or(Errno::EINVAL)?;
        let a = q.attrs;
        let state = match q.soft.state() {
            softnic::QpState::Reset => 0,
            softnic::QpState::Init => 1,
            softnic::QpState::Rtr => 2,
            softnic::QpState::Rts => 3,
            softnic::QpState::Err => 6,
        };
        io.reply(&abi::QueryQpResp {
            dest: a.dest,
            max_send_wr: q.caps.max_send_wr,
            max_recv_wr: q.caps.max_recv_wr,
            max_send_sge: q.caps.max_send_sge,
            max_recv_sge: q.caps.max_recv_sge,
            max_inline_data: q.caps.max_inline_data,
            rq_psn: a.rq_psn,
            sq_psn: a.sq_psn,
            dest_qp_num: a.dest_qpn,
            qp_access_flags: a.access,
            pkey_index: a.pkey_index,
            qp_state: state,
            cur_qp_state: state,
            path_mtu: a.path_mtu,
            path_mig_state: 2, // IB_MIG_ARMED as mlx5 reports
            max_rd_atomic: a.max_rd_atomic,
            max_dest_rd_atomic: a.max_dest_rd_atomic,
            min_rnr_timer: a.min_rnr_timer,
            port_num: a.port,
            timeout: a.timeout,
            retry_cnt: a.retry_cnt,
            rnr_retry: a.rnr_retry,
            sq_sig_all: q.sq_sig_all,
            ..Default::default()
        })?;
        Ok(Created::Nothing)
    }

    fn destroy_qp(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Destroy = io.core()?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let q = o.qps.remove(&r.handle).ok_or(Errno::EINVAL)?;
        soft.destroy_qp(&q.soft);
        q.soft.set_event_handler(None);
        o.bfreg_use[q.bfreg as usize] -= 1;
        self.purge_async(q.key);
        io.reply(&abi::DestroyQpResp {
            events_reported: q.async_reported.load(Ordering::Acquire),
        })?;
        Ok(Created::Nothing)
    }

    fn create_ah(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::CreateAh = io.core()?;
        let mut o = self.objs.lock();
        if !o.pds.contains_key(&r.pd_handle) {
            return Err(Errno::EINVAL);
        }
        if r.attr.port_num != 1 || r.attr.is_global == 0 || r.attr.sgid_index != 0 {
            return Err(Errno::EINVAL);
        }
        let h = o.handle();
        io.reply(&abi::CreateAhResp { ah_handle: h })?;
        // the destination MAC of an IPv4-mapped GID on this emulated Ethernet
        let g = r.attr.dgid;
        io.ureply(&abi::Mlx5CreateAhResp {
            response_length: 16,
            dmac: [0x02, 0x00, g[12], g[13], g[14], g[15]],
            reserved: [0; 6],
        })?;
        o.ahs.insert(h, AhObj { pd: r.pd_handle });
        Ok(Created::Nothing)
    }

    fn destroy_ah(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Handle = io.core()?;
        self.objs
            .lock()
            .ahs
            .remove(&r.handle)
            .ok_or(Errno::EINVAL)?;
        Ok(Created::Nothing)
    }

    /// The handler that turns a soft-NIC object's events into `ib_uverbs_async_event_desc`s
    /// for `element` (the object's user handle) on this context's async event file.
    fn event_handler(
        &self,
        element: u64,
        key: u64,
        counter: Arc<AtomicU32>,
    ) -> softnic::EventHandler {
        let q = self.async_q.lock().as_ref().map(Arc::downgrade);
        Arc::new(move |e: softnic::AsyncEvent| {
            use abi::event as ev;
            use softnic::AsyncEvent as A;
            let Some(q) = q.as_ref().and_then(|q| q.upgrade()) else {
                return;
            };
            let event_type = match e {
                A::CqError => ev::CQ_ERR,
                A::QpFatal => ev::QP_FATAL,
                A::QpRequestError => ev::QP_REQ_ERR,
                A::QpAccessError => ev::QP_ACCESS_ERR,
                A::LastWqeReached => ev::QP_LAST_WQE_REACHED,
                A::SrqLimitReached => ev::SRQ_LIMIT_REACHED,
            };
            let desc = abi::AsyncEvent {
                element,
                event_type,
                reserved: 0,
            };
            q.push(bytemuck::bytes_of(&desc), key, Some(counter.clone()));
        })
    }

    /// Drops the unread async events of a destroyed object.
    fn purge_async(&self, key: u64) {
        if let Some(q) = self.async_q.lock().as_ref() {
            q.purge(key);
        }
    }

    fn resize_cq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ResizeCq = io.core()?;
        let u: abi::Mlx5ResizeCq = io.udata()?;
        if io.udata.len() < std::mem::size_of::<abi::Mlx5ResizeCq>() {
            return Err(Errno::EINVAL);
        }
        if u.reserved0 != 0 || u.reserved1 != 0 {
            return Err(Errno::EINVAL);
        }
        if u.cqe_size != 64 {
            return Err(if u.cqe_size == 128 {
                unsupported("128-byte CQEs")
            } else {
                Errno::EINVAL
            });
        }
        if r.cqe < 1 || r.cqe > MAX_CQE {
            return Err(Errno::EINVAL);
        }
        let cq = self
            .objs
            .lock()
            .cqs
            .get(&r.cq_handle)
            .cloned()
            .ok_or(Errno::EINVAL)?;
        let ncqe = (r.cqe + 1).next_power_of_two();
        if ncqe != cq.soft.ncqe() {
            let ring = user_buf(u.buf_addr, ncqe as usize * 64)?;
            cq.soft.resize(ncqe, ring).map_err(|_| Errno::EINVAL)?;
        }
        io.reply(&abi::ResizeCqResp {
            cqe: cq.soft.ncqe() - 1,
            reserved: 0,
        })?;
        Ok(Created::Nothing)
    }

    fn create_srq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::CreateSrq = io.core()?;
        let u: abi::Mlx5CreateSrq = io.udata()?;
        if io.udata.len() < 24 {
            return Err(Errno::EINVAL);
        }
        // MLX5_SRQ_FLAG_SIGNATURE is the only flag
        if u.flags & !1 != 0 || u.reserved0 != 0 || u.reserved1 != 0 {
            return Err(Errno::EINVAL);
        }
        let cqe_version = *self.cqe_version.lock();
        if (cqe_version == 0 && u.uidx != 0) || u.uidx > 0xff_ffff {
            return Err(Errno::EINVAL);
        }
        if r.max_wr >= MAX_QP_WR || r.max_sge > MAX_SRQ_SGE {
            return Err(Errno::EINVAL);
        }
        let wqes = (r.max_wr + 1).next_power_of_two().max(2);
        let stride = (16 + 16 * r.max_sge).max(32).next_power_of_two();
        if r.srq_limit >= wqes {
            return Err(Errno::EINVAL);
        }
        let ring = user_buf(u.buf_addr, (wqes * stride) as usize)?;
        let dbrec = user_buf(u.db_addr, 8)?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let pd = o.pds.get(&r.pd_handle).ok_or(Errno::EINVAL)?.id;
        let srq = soft
            .create_srq(softnic::SrqConfig {
                pd,
                wqes,
                stride,
                ring: Some(ring),
                dbrec: Some(dbrec),
                limit: r.srq_limit,
            })
            .map_err(|_| Errno::EINVAL)?;
        let h = o.handle();
        let reply = io
            .reply(&abi::CreateSrqResp {
                srq_handle: h,
                max_wr: wqes - 1,
                max_sge: srq.max_sge(),
                srqn: srq.srqn(),
            })
            .and_then(|_| {
                io.ureply(&abi::Mlx5CreateSrqResp {
                    srqn: srq.srqn(),
                    reserved: 0,
                })
            });
        if let Err(e) = reply {
            let _ = soft.destroy_srq(&srq);
            return Err(e);
        }
        let key = crate::next_key();
        let async_reported: Arc<AtomicU32> = Arc::default();
        srq.set_event_handler(Some(self.event_handler(
            r.user_handle,
            key,
            async_reported.clone(),
        )));
        o.srqs.insert(
            h,
            SrqObj {
                soft: srq,
                pd: r.pd_handle,
                key,
                async_reported,
            },
        );
        Ok(Created::Nothing)
    }

    fn modify_srq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ModifySrq = io.core()?;
        let o = self.objs.lock();
        let s = o.srqs.get(&r.srq_handle).ok_or(Errno::EINVAL)?;
        use abi::srq_attr::*;
        // mlx5_ib cannot resize an SRQ
        if r.attr_mask & !(MAX_WR | LIMIT) != 0 || r.attr_mask & MAX_WR != 0 {
            return Err(Errno::EINVAL);
        }
        if r.attr_mask & LIMIT != 0 {
            s.soft.set_limit(r.srq_limit).map_err(|_| Errno::EINVAL)?;
        }
        Ok(Created::Nothing)
    }

    fn query_srq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::QuerySrq = io.core()?;
        let o = self.objs.lock();
        let s = o.srqs.get(&r.srq_handle).ok_or(Errno::EINVAL)?;
        io.reply(&abi::QuerySrqResp {
            max_wr: s.soft.wqes() - 1,
            max_sge: s.soft.max_sge(),
            srq_limit: s.soft.limit(),
            reserved: 0,
        })?;
        Ok(Created::Nothing)
    }

    fn destroy_srq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Destroy = io.core()?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        if !o.srqs.contains_key(&r.handle) {
            return Err(Errno::EINVAL);
        }
        if o.qps.values().any(|q| q.srq == Some(r.handle)) {
            return Err(Errno::EBUSY);
        }
        let s = o.srqs.remove(&r.handle).ok_or(Errno::EINVAL)?;
        soft.destroy_srq(&s.soft).map_err(|_| Errno::EBUSY)?;
        self.purge_async(s.key);
        io.reply(&abi::DestroyQpResp {
            events_reported: s.async_reported.load(Ordering::Acquire),
        })?;
        Ok(Created::Nothing)
    }

    /// Destroys everything (the device file was closed), QPs first, as the kernel does.
    pub fn teardown(&self) {
        let Some(soft) = self.soft.lock().clone() else {
            return;
        };
        let mut o = self.objs.lock();
        for (_, q) in o.qps.drain() {
            soft.destroy_qp(&q.soft);
        }
        for (_, c) in o.cqs.drain() {
            let _ = soft.destroy_cq(&c.soft);
        }
        for (_, s) in o.srqs.drain() {
            let _ = soft.destroy_srq(&s.soft);
        }
        for (_, m) in o.mws.drain() {
            let _ = soft.dealloc_mw(m.key);
        }
        for (_, m) in o.mrs.drain() {
            let _ = soft.dereg(m.key);
        }
        o.pds.clear();
        o.ahs.clear();
        o.channels.clear();
    }
}

/// Whether `fd` is a dma-buf (what `/proc/self/fd` names it: `/dmabuf:...` or
/// `anon_inode:dmabuf`); EBADF when it is no open fd.
fn is_dmabuf(fd: RawFd) -> Result<bool, Errno> {
    let target = std::fs::read_link(format!("/proc/self/fd/{fd}")).map_err(|_| Errno::EBADF)?;
    let t = target.to_string_lossy();
    Ok(t.starts_with("/dmabuf:") || t.starts_with("anon_inode:dmabuf"))
}

/// A dma-buf's size (dma-bufs answer `lseek(fd, 0, SEEK_END)` with it), `None` when it does not
/// say. The file position is left at 0, where it was.
fn dmabuf_size(fd: RawFd) -> Option<u64> {
    // SAFETY: lseek on an fd has no memory effects; a dma-buf's position carries no state.
    let end = unsafe { libc::lseek(fd, 0, libc::SEEK_END) };
    // SAFETY: as above.
    unsafe { libc::lseek(fd, 0, libc::SEEK_SET) };
    u64::try_from(end).ok()
}

/// The errno for a command or feature the emulation does not serve, with one line on stderr
/// naming it.
pub fn unsupported(what: &str) -> Errno {
    crate::complain(format_args!(
        "{what} is not supported by the emulated device (EOPNOTSUPP)"
    ));
    Errno::EOPNOTSUPP
}

/// Reads the bytes of a `write()` command from the application.
pub fn read_command(buf: u64, len: usize) -> Result<Vec<u8>, Errno> {
    if len > 1 << 16 {
        return Err(Errno::EINVAL);
    }
    let mut v = vec![0u8; len];
    copy_from_user(buf, &mut v)?;
    Ok(v)
}
