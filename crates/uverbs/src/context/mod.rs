//! One opened device file (a uverbs context): its objects, its UAR pages, and the commands the
//! kernel's uverbs core and mlx5_ib driver would answer for it. The object model, the checks
//! and the errnos follow the kernel's: handles per context, objects in use cannot be destroyed
//! (EBUSY), unknown handles are EINVAL, bad user pointers EFAULT, unsupported features
//! EOPNOTSUPP.
//!
//! The commands are split by object family, one file each: `device.rs` (the context itself and
//! the device queries), `pd_mr.rs` (PDs, MRs, MWs), `cq.rs` (completion channels and CQs),
//! `qp.rs`, `srq.rs`, `xrc.rs` (XRC domains) and `ah.rs`; `uar.rs` holds the UAR pages. This
//! file holds the [`Context`], the object tables, the helpers every family uses, and the
//! dispatch table ([`Context::command`], [`Context::ex_command`]): command number to handler. A
//! new family of commands gets a file of its own and its arms in that table.

mod ah;
mod clock;
mod cq;
mod device;
mod devx;
mod pd_mr;
mod qp;
mod srq;
pub mod uar;
mod xrc;
mod xrc_target;

pub use cq::{Arm, CqObj};
pub use uar::{DynUar, Uars};

use ah::AhObj;
use pd_mr::{MrObj, MwObj, PdObj};
use qp::QpObj;
use srq::SrqObj;
use xrc::XrcdObj;

use crate::abi::{self, access};
use crate::device::EmuDevice;
use crate::events::EventQueue;
use crate::uaccess::{check_mapped, copy_from_user, copy_to_user, Errno};
use bytemuck::Pod;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use verbs::DmaBuf;

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
    // provider frees a ring or doorbell record only after the destroy command, as it must on a
    // real kernel, which pins the pages; that command returns only after the soft NIC's
    // destroy_qp / destroy_cq (which fence every device thread) and the event watcher's
    // retirement of the CQ. Nothing here makes a Rust reference into it; every access goes
    // through the DmaBuf's raw pointers and atomics.
    Ok(unsafe { DmaBuf::from_external(p, len, Box::new(())) })
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
    xrcds: HashMap<u32, XrcdObj>,
    /// Completion channels created through this context, by fd.
    channels: HashMap<RawFd, Arc<EventQueue>>,
    /// QPs per BlueFlame register (non-fast-path numbering; static UARs).
    bfreg_use: Vec<u32>,
    low_latency: u32,
    /// Whether the context was opened for DEVX (`MLX5_IB_ALLOC_UCTX_DEVX`).
    devx: bool,
    /// Dynamic-UAR mode: no static pages; UARs come from the UAR ioctl.
    dynamic_uars: bool,
    /// UAR pages allocated with the UAR ioctl, by handle.
    dyn_uars: HashMap<u32, DynUar>,
    /// The last page id and mmap entry handed out.
    last_page_id: u32,
    last_entry: u32,
    /// DEVX umems and objects, by handle.
    umems: HashMap<u32, devx::Umem>,
    devx_objs: HashMap<u32, devx::DevxObj>,
    last_umem_id: u32,
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
    clock: Mutex<Option<clock::ClockPage>>,
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
    /// Writes as much of the core response as the caller has room for (the extended commands'
    /// rule: a shorter response is not an error).
    fn reply_prefix<T: Pod>(&self, v: &T) -> Result<(), Errno> {
        let b = bytemuck::bytes_of(v);
        copy_to_user(self.resp.0, &b[..b.len().min(self.resp.1)])
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

fn ib_access(flags: u32) -> Result<verbs::Access, Errno> {
    use verbs::Access as A;
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
            clock: Mutex::new(None),
        }
    }

    fn soft(&self) -> Result<Arc<softnic::Device>, Errno> {
        self.soft.lock().clone().ok_or(Errno::EINVAL)
    }

    /// How many objects of each kind the context holds, by the kernel's resource names (what
    /// `rdma resource` counts).
    pub fn resource_counts(&self) -> [(&'static str, u64); 5] {
        let o = self.objs.lock();
        [
            ("pd", o.pds.len() as u64),
            ("cq", o.cqs.len() as u64),
            ("qp", o.qps.len() as u64),
            ("mr", o.mrs.len() as u64),
            ("srq", o.srqs.len() as u64),
        ]
    }

    /// The device's view of UAR page `page_id` (a CQ's or QP's `uar_page`): a static page
    /// (ids 1..=n) or one allocated with the UAR ioctl.
    fn uar_page(&self, o: &Objects, page_id: u32) -> Option<(Arc<DmaBuf>, bool)> {
        if let Some(u) = o.dyn_uars.values().find(|u| u.page_id == page_id) {
            return Some((u.page(), u.bf));
        }
        let uars = self.uars.lock();
        let i = page_id.checked_sub(1)? as usize;
        uars.as_ref()?.pages.get(i).map(|p| (p.buf.clone(), true))
    }

    /// `mmap` of the device file at page offset `pgoff`: a static UAR page (legacy commands
    /// 0, 2 and 3), a page allocated with the UAR ioctl, or the clock-info page (command 7).
    pub fn map_uar(
        &self,
        pgoff: u64,
        addr: usize,
        len: usize,
        prot: i32,
        flags: i32,
    ) -> Result<*mut libc::c_void, Errno> {
        let o = self.objs.lock();
        if let Some(entry) = uar::dyn_mmap_entry(pgoff) {
            let u = o
                .dyn_uars
                .values()
                .find(|u| u.entry == entry)
                .ok_or(Errno::EINVAL)?;
            return u.map(addr, len, prot, flags);
        }
        let (cmd, index) = (pgoff >> 8, pgoff & 0xff);
        if (cmd, index) == (clock::MMAP_CMD, clock::V1) {
            return self
                .clock
                .lock()
                .as_ref()
                .ok_or(Errno::EINVAL)?
                .map(addr, len, prot, flags);
        }
        // MLX5_IB_MMAP_REGULAR_PAGE 0, WC_PAGE 2, NC_PAGE 3; none in dynamic-UAR mode
        if !matches!(cmd, 0 | 2 | 3) || o.dynamic_uars {
            crate::complain(format_args!(
                "mmap command {cmd} of the device file is not served (EINVAL)"
            ));
            return Err(Errno::EINVAL);
        }
        let uars = self.uars.lock();
        uars.as_ref()
            .ok_or(Errno::EINVAL)?
            .map(addr, len, prot, flags, index as usize)
    }

    /// Runs one legacy command.
    pub fn command(&self, cmd: u32, io: &Io<'_>) -> Result<Created, Errno> {
        use abi::cmd as c;
        if cmd != c::GET_CONTEXT && self.soft.lock().is_none() {
            return Err(Errno::EINVAL);
        }
        match cmd {
            c::GET_CONTEXT => self.get_context(io),
            c::QUERY_DEVICE => self.query_device(io),
            c::QUERY_PORT => self.query_port(io),
            c::ALLOC_PD => self.alloc_pd(io),
            c::DEALLOC_PD => self.dealloc_pd(io),
            c::REG_MR => self.reg_mr(io),
            c::REREG_MR => self.rereg_mr(io),
            c::DEREG_MR => self.dereg_mr(io),
            c::ALLOC_MW => self.alloc_mw(io),
            c::DEALLOC_MW => self.dealloc_mw(io),
            c::CREATE_COMP_CHANNEL => self.create_comp_channel(io),
            c::CREATE_CQ => self.legacy_create_cq(io),
            c::DESTROY_CQ => self.destroy_cq(io),
            c::RESIZE_CQ => self.resize_cq(io),
            c::CREATE_SRQ => self.create_srq(io),
            c::MODIFY_SRQ => self.modify_srq(io),
            c::QUERY_SRQ => self.query_srq(io),
            c::DESTROY_SRQ => self.destroy_srq(io),
            c::OPEN_XRCD => self.open_xrcd(io),
            c::CLOSE_XRCD => self.close_xrcd(io),
            c::CREATE_XSRQ => self.create_xsrq(io),
            c::OPEN_QP => self.open_qp(io),
            c::CREATE_QP => self.legacy_create_qp(io),
            c::MODIFY_QP => self.legacy_modify_qp(io),
            c::QUERY_QP => self.query_qp(io),
            c::DESTROY_QP => self.destroy_qp(io),
            c::ATTACH_MCAST => self.attach_mcast(io, true),
            c::DETACH_MCAST => self.attach_mcast(io, false),
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
            x::CREATE_CQ => self.ex_create_cq(io),
            x::CREATE_QP => self.ex_create_qp(io),
            x::MODIFY_QP => self.ex_modify_qp(io),
            _ => Err(unsupported(abi::ex_cmd_name(cmd))),
        }
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

    /// Destroys everything (the device file was closed), QPs first, as the kernel does.
    pub fn teardown(&self) {
        let Some(soft) = self.soft.lock().clone() else {
            return;
        };
        let mut o = self.objs.lock();
        for (_, x) in o.devx_objs.drain() {
            x.destroy(&soft);
        }
        for (_, q) in o.qps.drain() {
            // an XRC target goes with its last handle, in any context (`xrc_target::TgtShare`)
            if q.tgt.is_none() {
                soft.destroy_qp(&q.soft);
            }
        }
        for (_, c) in o.cqs.drain() {
            let _ = soft.destroy_cq(&c.soft);
            c.retire();
        }
        for (_, s) in o.srqs.drain() {
            let _ = soft.destroy_srq(&s.soft);
        }
        o.xrcds.clear();
        for (_, m) in o.mws.drain() {
            let _ = soft.dealloc_mw(m.key);
        }
        for (_, m) in o.mrs.drain() {
            let _ = soft.dereg(m.key);
        }
        o.pds.clear();
        o.ahs.clear();
        o.umems.clear();
        o.dyn_uars.clear();
        o.channels.clear();
    }
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
