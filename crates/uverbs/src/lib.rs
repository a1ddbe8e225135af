//! The soft NIC under the real rdma-core: a userspace emulation of the kernel side of
//! `/dev/infiniband/uverbsN` for the mlx5 driver, so that the distro's own libibverbs and
//! libmlx5 open soft NICs as if they were ConnectX devices.
//!
//! The pieces, in the order a program meets them:
//! - [`sysfs`] writes the tree libibverbs scans (`$SYSFS_PATH`) to find devices;
//! - the preload library (`crates/uverbs/preload`) interposes the libc calls libibverbs and
//!   libmlx5 make on the device files and hands them to [`Emulation`];
//! - [`context`] answers the uverbs `write()` commands ([`abi`]) as the kernel's uverbs core and
//!   mlx5_ib would, creating soft-NIC objects on the rings, doorbell records and UAR pages the
//!   provider set up; [`events`] serves completion channels and the async event fd;
//! - [`peermem`] resolves GPU addresses an application registers (nvidia-peermem's job), and
//!   [`dmabuf`] the GPU ranges of dma-bufs (what the preload saw the CUDA driver export);
//! - [`device`] holds the soft NICs (one per `mlx5_N`, each with a RoCEv2 wire port on its
//!   own address, [`config`]).
//!
//! Core ioctls answer ENOTTY, so libibverbs takes its `write()` command path throughout; the
//! ioctl path ([`ioctl`]) serves REG_DMABUF_MR, which has no `write()` form, and the mlx5
//! driver's own methods: DEVX, DEVX umems and objects, and UAR pages allocated on demand.

pub mod abi;
pub mod cm;
pub mod config;
pub mod context;
pub mod device;
pub mod dmabuf;
pub mod events;
pub mod ioctl;
pub mod netdev;
pub mod netlink;
pub mod paths;
pub mod peermem;
pub mod sysfs;
pub mod uaccess;

pub use context::uar::is_emulated_uar;
use context::{Context, CqObj, Created, Io};
use events::EventQueue;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;
pub use uaccess::Errno;

/// Writes one line to stderr, prefixed with the emulation's name (never through the hooked
/// `write`: a raw system call).
pub fn complain(args: std::fmt::Arguments<'_>) {
    let line = format!("gpuverbs-emu: {args}\n");
    // SAFETY: writes our own buffer to fd 2.
    unsafe { libc::syscall(libc::SYS_write, 2, line.as_ptr(), line.len()) };
}

/// The RDMA connection manager's device file (the ucma module's).
pub const RDMA_CM_PATH: &[u8] = b"/dev/infiniband/rdma_cm";
/// The prefix of the umad device files (`umadN`, and `issmN` shares it after `/dev/infiniband/`).
pub const UMAD_PREFIXES: [&[u8]; 2] = [b"/dev/infiniband/umad", b"/dev/infiniband/issm"];

/// Whether `path` is a umad device file.
pub fn is_umad_path(path: &[u8]) -> bool {
    UMAD_PREFIXES.iter().any(|p| path.starts_with(p))
}

static KEYS: AtomicU64 = AtomicU64::new(1);
/// A process-unique key for an object (event ownership).
pub(crate) fn next_key() -> u64 {
    KEYS.fetch_add(1, Ordering::Relaxed)
}

enum FdKind {
    /// A device file and its context.
    Device(Arc<Context>),
    /// A completion channel of a context.
    Channel(Arc<EventQueue>, Weak<Context>),
    /// A context's async event file.
    Async(Arc<EventQueue>, Weak<Context>),
    /// An open file of the RDMA connection manager's device (an event channel).
    Cm(Arc<cm::CmFile>),
}

/// One open file of the emulation: what `open` (or a command creating a channel or the async
/// fd) made, shared by every fd `dup` makes of it, as the kernel's `struct file` is. It lives
/// until its last fd is closed ([`Emulation::close`]).
struct OpenFile {
    kind: FdKind,
    /// How many fds of the table refer to it (changed under the table's lock).
    fds: AtomicUsize,
}

impl OpenFile {
    fn new(kind: FdKind) -> Arc<Self> {
        Arc::new(Self {
            kind,
            fds: AtomicUsize::new(1),
        })
    }

    /// The file's last fd was closed: the kernel's release of the file.
    fn release(&self) {
        match &self.kind {
            FdKind::Device(ctx) => ctx.teardown(),
            FdKind::Channel(q, ctx) => {
                if let Some(c) = ctx.upgrade() {
                    c.close_channel(q.fd());
                }
            }
            FdKind::Async(_, ctx) => {
                if let Some(c) = ctx.upgrade() {
                    c.async_q.lock().take();
                }
            }
            FdKind::Cm(f) => {
                if let Some(emu) = emulation() {
                    cm::cm(emu.devices).release(f);
                }
            }
        }
    }
}

/// One fd of the table.
struct FdEntry {
    file: Arc<OpenFile>,
    /// The fd is an event queue's own eventfd, which the queue closes when it goes (a
    /// channel's or the async file's first fd); every other fd (a device file's eventfd and
    /// every duplicate) is closed by libc's `close`.
    queue_owned: bool,
}

impl FdEntry {
    fn kind(&self) -> &FdKind {
        &self.file.kind
    }
}

/// One watched CQ: its context's UAR page 0 (the CQ arm doorbell) and the last value seen there.
struct Watched {
    cq: Weak<CqObj>,
    page0: Arc<verbs::DmaBuf>,
    last_db: u64,
    /// Whether the CQ knows to wake the watcher at a write it asks for.
    woken_by_writes: bool,
}

/// Bitmap of the fds that are ours (fds below 65536), so that the hooks of `read`, `write` and
/// `close` cost one load for everyone else's fds.
static OURS: [AtomicU64; 1024] = [const { AtomicU64::new(0) }; 1024];

fn mark(fd: RawFd, on: bool) {
    if let Some(w) = OURS.get(fd as usize / 64) {
        let bit = 1u64 << (fd as usize % 64);
        if on {
            w.fetch_or(bit, Ordering::AcqRel);
        } else {
            w.fetch_and(!bit, Ordering::AcqRel);
        }
    }
}

/// Whether `fd` is a file of the emulation (cheap; for the hooks' fast path).
pub fn is_ours(fd: RawFd) -> bool {
    if fd < 0 {
        return false;
    }
    match OURS.get(fd as usize / 64) {
        Some(w) => w.load(Ordering::Acquire) & (1 << (fd as usize % 64)) != 0,
        None => EMU
            .get()
            .and_then(|e| e.as_ref())
            .is_some_and(|e| e.fds.lock().contains_key(&fd)),
    }
}

/// The emulation of this process.
pub struct Emulation {
    devices: &'static device::Devices,
    fds: Mutex<HashMap<RawFd, FdEntry>>,
    watched: Mutex<Vec<Watched>>,
    watcher: OnceLock<()>,
}

static EMU: OnceLock<Option<Emulation>> = OnceLock::new();
/// Whether every ioctl call, CQ arm and completion event is reported on stderr
/// ([`config::ENV_TRACE`]).
static TRACE: OnceLock<bool> = OnceLock::new();

fn tracing() -> bool {
    *TRACE.get_or_init(|| std::env::var_os(config::ENV_TRACE).is_some())
}

/// The folder things are recorded to ([`config::ENV_RECORD`]), when one was asked for.
fn record_dir() -> Option<&'static std::path::Path> {
    static DIR: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| std::env::var_os(config::ENV_RECORD).map(Into::into))
        .as_deref()
}

/// The stream commands are recorded to, when recording was asked for.
fn recorder() -> Option<&'static Mutex<std::fs::File>> {
    static REC: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();
    REC.get_or_init(|| {
        let path = record_dir()?.join(format!("{}.stream", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path);
        match file {
            Ok(f) => Some(Mutex::new(f)),
            Err(e) => {
                complain(format_args!(
                    "cannot record commands to {}: {e}",
                    path.display()
                ));
                None
            }
        }
    })
    .as_ref()
}

/// Appends one command to the recorded stream (kind 0: a `write()` command, 1: an ioctl's
/// header and attributes, 2: a `write()` command on the RDMA connection manager's device).
fn record(kind: u8, bytes: &[u8]) {
    let (Some(r), Ok(len)) = (recorder(), u16::try_from(bytes.len())) else {
        return;
    };
    let mut rec = Vec::with_capacity(3 + bytes.len());
    rec.push(kind);
    rec.extend_from_slice(&len.to_be_bytes());
    rec.extend_from_slice(bytes);
    use std::io::Write as _;
    let _ = r.lock().write_all(&rec);
}

/// With recording on ([`config::ENV_RECORD`]): every distinct WQE in `qp`'s SQ ring (a ring in
/// host memory, as the program's library wrote it) to `<folder>/wqe-<hash>.bin`, behind the
/// `wqe` fuzz target's control byte 0. Called as the QP is destroyed.
pub(crate) fn record_wqes(qp: &softnic::Qp) {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let (Some(dir), ring) = (record_dir(), qp.sq_ring()) else {
        return;
    };
    if !ring.is_host() {
        return;
    }
    let blocks = qp.sq_blocks() as usize;
    let mut ring_bytes = vec![0u8; blocks * prm::WQEBB];
    ring.read(0, &mut ring_bytes);
    let mut slot = 0;
    while slot < blocks {
        let at = slot * prm::WQEBB;
        let ctrl: prm::wqe::CtrlSeg =
            bytemuck::pod_read_unaligned(&ring_bytes[at..at + prm::DS_UNIT]);
        let n = prm::wqe::blocks_for_ds(ctrl.ds().max(1)).min(blocks - slot);
        let mut wqe = ring_bytes[at..at + n * prm::WQEBB].to_vec();
        slot += n;
        if ctrl.ds() == 0 {
            continue;
        }
        // the WQE index cleared: the fuzz target stamps its own, and WQEs that differ only
        // there are one seed
        wqe[1..3].fill(0);
        let mut h = DefaultHasher::new();
        wqe.hash(&mut h);
        let path = dir.join(format!("wqe-{:016x}.bin", h.finish()));
        let _ = std::fs::write(path, [&[0u8][..], &wqe].concat());
    }
}

/// The process's emulation, set up from the environment on first use; `None` (after one line
/// on stderr) when the settings are bad.
pub fn emulation() -> Option<&'static Emulation> {
    EMU.get_or_init(|| match config::EmuConfig::from_env() {
        Ok(cfg) => {
            if std::env::var_os(config::ENV_COUNTERS).is_some() {
                // SAFETY: registers a plain `extern "C" fn()` to run at exit.
                unsafe { libc::atexit(dump_counters) };
            }
            Some(Emulation {
                devices: Box::leak(Box::new(device::Devices::new(cfg))),
                fds: Mutex::new(HashMap::new()),
                watched: Mutex::new(Vec::new()),
                watcher: OnceLock::new(),
            })
        }
        Err(e) => {
            complain(format_args!("emulation disabled: {e}"));
            None
        }
    })
    .as_ref()
}

/// What the preload saw of the CUDA driver and the emulation did with it (process-wide).
#[derive(Debug, Default)]
pub struct CudaSeen {
    /// `cuMemHostRegister` with IOMEMORY of an emulated UAR page, registered as mapped host
    /// memory instead.
    pub iomem_uar: AtomicU64,
    /// dma-bufs `cuMemGetHandleForAddressRange` exported.
    pub dmabuf_exports: AtomicU64,
    /// DEVX umems registered on such a dma-buf.
    pub dmabuf_umems: AtomicU64,
    /// Memory regions registered on a dma-buf (REG_DMABUF_MR).
    pub dmabuf_mrs: AtomicU64,
}

/// The process's [`CudaSeen`].
pub static CUDA_SEEN: CudaSeen = CudaSeen {
    iomem_uar: AtomicU64::new(0),
    dmabuf_exports: AtomicU64::new(0),
    dmabuf_umems: AtomicU64::new(0),
    dmabuf_mrs: AtomicU64::new(0),
};

/// One line per started device with the counters that show the sanitizer's verdict, then one
/// with what the emulation made of the CUDA driver's calls ([`CUDA_SEEN`]).
pub fn counters_report(emu: &Emulation) -> String {
    let mut out = String::new();
    for d in emu.devices.iter() {
        if let Some(s) = d.started() {
            let c = s.counters();
            let by_syndrome: Vec<String> =
                c.errors.iter().map(|(s, n)| format!("{s:?}:{n}")).collect();
            out += &format!(
                "{} wqes={} bad_doorbells={} stale_wqes={} cq_overruns={} error_cqes={} carried_turns={} carry_calls={} answer_looks={} answers_found={} errors=[{}]\n",
                d.id.name,
                c.wqes_executed,
                c.bad_doorbells,
                c.stale_wqes,
                c.cq_overruns,
                c.errors.values().sum::<u64>(),
                c.carried_turns,
                c.carry_calls,
                c.answer_looks,
                c.answers_found,
                by_syndrome.join(",")
            );
        }
    }
    let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
    out += &format!(
        "cuda iomem_uar={} dmabuf_exports={} dmabuf_umems={} dmabuf_mrs={}\n",
        n(&CUDA_SEEN.iomem_uar),
        n(&CUDA_SEEN.dmabuf_exports),
        n(&CUDA_SEEN.dmabuf_umems),
        n(&CUDA_SEEN.dmabuf_mrs)
    );
    out
}

extern "C" fn dump_counters() {
    let _ = std::panic::catch_unwind(|| {
        if let (Some(path), Some(Some(emu))) = (std::env::var_os(config::ENV_COUNTERS), EMU.get()) {
            let _ = std::fs::write(path, counters_report(emu));
        }
    });
}

fn os_errno() -> Errno {
    Errno(
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO),
    )
}

impl Emulation {
    /// The emulated devices.
    pub fn devices(&self) -> &'static device::Devices {
        self.devices
    }

    /// Gives every started device a turn on the caller's thread ([`softnic::Device::progress`]):
    /// what a completion poll that found nothing calls, so that a program polling on every
    /// core still moves its device. Returns whether anything was done.
    pub fn progress(&self) -> bool {
        let mut work = false;
        for d in self.devices.iter() {
            if let Some(s) = d.started() {
                work |= s.progress();
            }
        }
        work
    }

    /// The answer to `request`, a datagram sent on an emulated RDMA netlink socket bound to
    /// `portid`: the datagrams the program then reads ([`netlink::answer`]). Resources are
    /// this process's (each process under `gpuverbs emu` has devices of its own); counters are
    /// the soft NIC's, by its own names (zero before the device's first context starts it).
    pub fn netlink(&self, request: &[u8], portid: u32) -> Vec<Vec<u8>> {
        let contexts: Vec<Arc<Context>> = {
            let mut seen = Vec::<Arc<Context>>::new();
            for e in self.fds.lock().values() {
                if let FdKind::Device(c) = e.kind() {
                    if !seen.iter().any(|s| Arc::ptr_eq(s, c)) {
                        seen.push(c.clone());
                    }
                }
            }
            seen
        };
        let devs: Vec<netlink::NlDevice> = self
            .devices
            .iter()
            .map(|d| {
                let mut resources = vec![
                    ("pd", 0),
                    ("cq", 0),
                    ("qp", 0),
                    (
                        "cm_id",
                        cm::existing().map_or(0, |c| c.ids_on(self.devices, d.id.index)),
                    ),
                    ("mr", 0),
                    ("ctx", 0),
                    ("srq", 0),
                ];
                for c in contexts.iter().filter(|c| c.dev.id.index == d.id.index) {
                    for (name, n) in c.resource_counts() {
                        if let Some(r) = resources.iter_mut().find(|r| r.0 == name) {
                            r.1 += n;
                        }
                    }
                    if let Some(r) = resources.iter_mut().find(|r| r.0 == "ctx") {
                        r.1 += 1;
                    }
                }
                let port = d.port();
                netlink::NlDevice {
                    index: d.id.index,
                    name: d.id.name.clone(),
                    node_guid: d.id.node_guid,
                    fw_version: sysfs::FW_VER.into(),
                    cdev: d.id.rdev(),
                    abi: 1,
                    port_cap_flags: port.port_cap_flags as u64,
                    port_state: port.state,
                    port_phys_state: port.phys_state,
                    netdev: (d.id.netdev.index, d.id.netdev.name.clone()),
                    resources,
                    counters: counter_list(&d.started().map(|s| s.counters()).unwrap_or_default()),
                }
            })
            .collect();
        netlink::answer(request, portid, &devs)
    }

    /// `open(path, flags)`: `None` when `path` is not an emulated device file. The RDMA CM
    /// device (`/dev/infiniband/rdma_cm`) opens an event channel of the emulated connection
    /// manager ([`cm`]).
    pub fn open(&self, path: &[u8], flags: i32) -> Option<Result<RawFd, Errno>> {
        if path == RDMA_CM_PATH {
            if flags & libc::O_ACCMODE != libc::O_RDWR {
                return Some(Err(Errno::EPERM));
            }
            return Some(cm::CmFile::new(flags).map(|f| {
                let fd = f.fd();
                self.register(fd, FdKind::Cm(f), true);
                fd
            }));
        }
        if is_umad_path(path) {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                complain(format_args!(
                    "umad (management datagrams: infiniband-diags, opensm) is not emulated; a RoCE \
                     port has no subnet management (ENOENT)"
                ))
            });
            return Some(Err(Errno::ENOENT));
        }
        let dev = self.devices.by_cdev(path)?;
        if flags & libc::O_ACCMODE != libc::O_RDWR {
            return Some(Err(Errno::EPERM));
        }
        let cloexec = if flags & libc::O_CLOEXEC != 0 {
            libc::EFD_CLOEXEC
        } else {
            0
        };
        // A real fd holds the number: an eventfd nothing ever signals.
        // SAFETY: plain system call; the result is checked.
        let fd = unsafe { libc::eventfd(0, cloexec) };
        if fd < 0 {
            return Some(Err(os_errno()));
        }
        self.register(fd, FdKind::Device(Arc::new(Context::new(dev))), false);
        Some(Ok(fd))
    }

    /// Enters `fd`, a new open file of `kind`, in the table.
    fn register(&self, fd: RawFd, kind: FdKind, queue_owned: bool) {
        let file = OpenFile::new(kind);
        self.fds.lock().insert(fd, FdEntry { file, queue_owned });
        mark(fd, true);
    }

    /// The connection manager's open file behind `fd`, if it is one.
    fn cm_file(&self, fd: RawFd) -> Option<Arc<cm::CmFile>> {
        match self.fds.lock().get(&fd).map(FdEntry::kind) {
            Some(FdKind::Cm(f)) => Some(f.clone()),
            _ => None,
        }
    }

    fn context(&self, fd: RawFd) -> Option<Arc<Context>> {
        match self.fds.lock().get(&fd).map(FdEntry::kind) {
            Some(FdKind::Device(c)) => Some(c.clone()),
            _ => None,
        }
    }

    /// `ioctl(fd, request, arg)` on a file of ours: the uverbs ioctl path serves the mlx5
    /// driver's methods (DEVX, its umems and objects, UAR pages) and REG_DMABUF_MR (which has
    /// no `write()` form); every other core method is ENOTTY, so libibverbs takes the
    /// `write()` command path for the rest.
    pub fn ioctl(&self, fd: RawFd, request: libc::c_ulong, arg: u64) -> Result<i32, Errno> {
        let ctx = match self.fds.lock().get(&fd).map(FdEntry::kind) {
            Some(FdKind::Device(c)) => c.clone(),
            Some(_) => return Err(Errno::ENOTTY),
            None => return Err(Errno::EBADF),
        };
        if request != abi::ioctl::RDMA_VERBS_IOCTL {
            return Err(Errno::ENOTTY);
        }
        if recorder().is_some() {
            // the header's first field is the length of header and attributes
            if let Ok(h) = context::read_command(arg, 2) {
                let n = u16::from_ne_bytes([h[0], h[1]]) as usize;
                if let Ok(b) = context::read_command(arg, n) {
                    record(1, &b);
                }
            }
        }
        let call = ioctl::Call::read(arg)?;
        let r = ctx.ioctl(&call);
        if tracing() {
            let result = match r {
                Ok(()) => "ok".to_string(),
                Err(e) => e.to_string(),
            };
            complain(format_args!(
                "ioctl object {:#x} method {:#x}: {result}",
                call.object, call.method
            ));
        }
        r?;
        Ok(0)
    }

    /// `write(fd, buf, len)` on a file of ours: one uverbs command.
    pub fn write(&self, fd: RawFd, buf: u64, len: usize) -> Result<usize, Errno> {
        if let Some(f) = self.cm_file(fd) {
            // (the table's lock is not held: GET_EVENT may wait)
            let bytes = context::read_command(buf, len)?;
            record(2, &bytes);
            cm::cm(self.devices).write(&f, &bytes, &|fd| self.cm_file(fd))?;
            return Ok(len);
        }
        let ctx = match self.fds.lock().get(&fd).map(FdEntry::kind) {
            Some(FdKind::Device(c)) => c.clone(),
            Some(_) => return Err(Errno::EINVAL),
            None => return Err(Errno::EBADF),
        };
        let bytes = context::read_command(buf, len)?;
        record(0, &bytes);
        if bytes.len() < 8 {
            return Err(Errno::EINVAL);
        }
        let hdr: abi::CmdHdr = bytemuck::pod_read_unaligned(&bytes[..8]);
        let command = hdr.command;
        let created = if command & abi::CMD_FLAG_EXTENDED != 0 {
            if bytes.len() < 24 {
                return Err(Errno::EINVAL);
            }
            let ex: abi::ExCmdHdr = bytemuck::pod_read_unaligned(&bytes[8..24]);
            let core_in = hdr.in_words as usize * 8;
            let drv_in = ex.provider_in_words as usize * 8;
            if 24 + core_in + drv_in != len || ex.cmd_hdr_reserved != 0 {
                return Err(Errno::EINVAL);
            }
            let core_out = hdr.out_words as usize * 8;
            let drv_out = ex.provider_out_words as usize * 8;
            if (core_out > 0 || drv_out > 0) && ex.response == 0 {
                return Err(Errno::EFAULT);
            }
            let uresp = ex
                .response
                .checked_add(core_out as u64)
                .ok_or(Errno::EFAULT)?;
            let io = Io {
                core: &bytes[24..24 + core_in],
                udata: &bytes[24 + core_in..],
                resp: (ex.response, core_out),
                uresp: (uresp, drv_out),
            };
            ctx.ex_command(command & abi::CMD_MASK, &io)
        } else {
            if hdr.in_words as usize * 4 != len {
                return Err(Errno::EINVAL);
            }
            let out = hdr.out_words as usize * 4;
            let c = command & abi::CMD_MASK;
            let (core_size, resp_size) = legacy_sizes(c);
            if bytes.len() < 8 + core_size {
                return Err(Errno::EINVAL);
            }
            let core = &bytes[8..8 + core_size];
            let resp = if resp_size > 0 {
                u64::from_ne_bytes(core[..8].try_into().expect("8 bytes"))
            } else {
                0
            };
            // a response pointer at the top of the address space: EFAULT, as copy_to_user
            let uresp = resp.checked_add(resp_size as u64).ok_or(Errno::EFAULT)?;
            let io = Io {
                core,
                udata: &bytes[8 + core_size..],
                resp: (resp, out.min(resp_size)),
                uresp: (uresp, out.saturating_sub(resp_size)),
            };
            if resp_size > 0 && out < resp_size {
                return Err(Errno::ENOSPC);
            }
            ctx.command(c, &io)
        };
        match created? {
            Created::Nothing => {}
            Created::Channel(q) => self.register(
                q.fd(),
                FdKind::Channel(q.clone(), Arc::downgrade(&ctx)),
                true,
            ),
            Created::Cq(cq) => self.watch(cq),
        }
        if command == abi::cmd::GET_CONTEXT {
            if let Some(q) = ctx.async_q.lock().clone() {
                self.register(q.fd(), FdKind::Async(q.clone(), Arc::downgrade(&ctx)), true);
            }
        }
        Ok(len)
    }

    /// `read(fd, buf, len)` on a file of ours.
    pub fn read(&self, fd: RawFd, buf: u64, len: usize) -> Result<usize, Errno> {
        let q = match self.fds.lock().get(&fd).map(FdEntry::kind) {
            Some(FdKind::Channel(q, _)) | Some(FdKind::Async(q, _)) => q.clone(),
            Some(FdKind::Device(_)) | Some(FdKind::Cm(_)) => return Err(Errno::EINVAL),
            None => return Err(Errno::EBADF),
        };
        // The program may sleep here: its threads stop carrying the devices.
        for d in self.devices.iter() {
            if let Some(s) = d.started() {
                s.carry_end();
            }
        }
        q.read(buf, len)
    }

    /// `mmap` of a device file: UAR pages (`offset = (cmd << 8 | index) * 4096`).
    pub fn mmap(
        &self,
        fd: RawFd,
        addr: usize,
        len: usize,
        prot: i32,
        flags: i32,
        offset: i64,
    ) -> Result<*mut libc::c_void, Errno> {
        let ctx = self.context(fd).ok_or(Errno::EINVAL)?;
        if offset < 0 || offset % 4096 != 0 {
            return Err(Errno::EINVAL);
        }
        ctx.map_uar((offset / 4096) as u64, addr, len, prot, flags)
    }

    /// `close(fd)` on a file of ours. Returns whether the caller must close the real fd too
    /// (not for an event queue's own eventfd: that closes when the queue goes, i.e. for a
    /// channel when the last CQ using it is gone). The open file is released (a context torn
    /// down, a channel or the async file closed) when this was its last fd.
    pub fn close(&self, fd: RawFd) -> bool {
        mark(fd, false);
        let Some((entry, last)) = self.forget(fd) else {
            return true;
        };
        if last {
            entry.file.release();
        }
        !entry.queue_owned
    }

    /// Takes `fd` out of the table: its entry, and whether it was its file's last fd.
    fn forget(&self, fd: RawFd) -> Option<(FdEntry, bool)> {
        let mut fds = self.fds.lock();
        let entry = fds.remove(&fd)?;
        let last = entry.file.fds.fetch_sub(1, Ordering::AcqRel) == 1;
        Some((entry, last))
    }

    /// Whether libc's `dup2`/`dup3` may make `new` a copy of another fd: not when `new` is an
    /// event queue's own eventfd (the queue writes its events there), which answers EBUSY
    /// (Linux's answer to a dup2 onto an fd it cannot take over yet).
    pub fn may_replace(&self, new: RawFd) -> Result<(), Errno> {
        match self.fds.lock().get(&new) {
            Some(e) if e.queue_owned => {
                complain(format_args!(
                    "dup2 onto the emulation's event fd {new} is not emulated (EBUSY)"
                ));
                Err(Errno::EBUSY)
            }
            _ => Ok(()),
        }
    }

    /// libc's `dup`, `dup2`, `dup3` or `fcntl(F_DUPFD…)` made `new` a copy of `old`: `new` is
    /// the same open file as `old` when that is one of ours (same context, same event queue),
    /// as the kernel's dup gives; a file of ours that `new` named before (closed by dup2) loses
    /// that fd, as a close would do (the caller checked [`Emulation::may_replace`]).
    pub fn duplicated(&self, old: RawFd, new: RawFd) {
        if old == new {
            return;
        }
        if let Some((entry, last)) = self.forget(new) {
            mark(new, false);
            if last {
                entry.file.release();
            }
        }
        let mut fds = self.fds.lock();
        let Some(file) = fds.get(&old).map(|e| e.file.clone()) else {
            return;
        };
        file.fds.fetch_add(1, Ordering::AcqRel);
        fds.insert(
            new,
            FdEntry {
                file,
                queue_owned: false,
            },
        );
        mark(new, true);
    }

    /// `fstat` of a device file: the character device libibverbs checks.
    pub fn fstat(&self, fd: RawFd) -> Option<libc::stat> {
        match self.fds.lock().get(&fd).map(FdEntry::kind) {
            Some(FdKind::Device(c)) => Some(cdev_stat(c.dev.id.rdev())),
            Some(FdKind::Cm(_)) => Some(cdev_stat(config::RDMA_CM_RDEV)),
            _ => None,
        }
    }

    /// `stat` of `/dev/infiniband/uverbsN`.
    pub fn stat(&self, path: &[u8]) -> Option<libc::stat> {
        self.devices.by_cdev(path).map(|d| cdev_stat(d.id.rdev()))
    }

    fn watch(&self, cq: Arc<CqObj>) {
        if cq.channel.is_none() {
            return;
        }
        let Some(page0) = cq.arm_page.clone() else {
            return;
        };
        let last_db = page0
            .atomic_u64(context::CQ_DOORBELL)
            .load(Ordering::Acquire);
        // The provider's first arm may write the word the record already holds (sn 0, ci 0,
        // "any completion" is 0): a mark no provider writes makes every arm a change.
        cq.dbrec.atomic_u32(4).store(ARM_UNSEEN, Ordering::Release);
        cq.arm.lock().last_word = ARM_UNSEEN;
        self.watched.lock().push(Watched {
            cq: Arc::downgrade(&cq),
            page0,
            last_db,
            woken_by_writes: false,
        });
        self.watcher.get_or_init(|| {
            let _ = std::thread::Builder::new()
                .name("gpuverbs-emu-events".into())
                .spawn(|| watch_loop(emulation().expect("running")));
        });
    }
}

/// Core struct size and response size of each legacy command (the response pointer is the
/// struct's first field when there is a response).
fn legacy_sizes(c: u32) -> (usize, usize) {
    use abi::cmd::*;
    use std::mem::size_of as s;
    match c {
        GET_CONTEXT => (8, s::<abi::GetContextResp>()),
        QUERY_DEVICE => (8, s::<abi::QueryDeviceResp>()),
        QUERY_PORT => (s::<abi::QueryPort>(), s::<abi::QueryPortResp>()),
        ALLOC_PD => (8, s::<abi::AllocPdResp>()),
        DEALLOC_PD | DEREG_MR | DEALLOC_MW | DESTROY_AH | CLOSE_XRCD => (4, 0),
        OPEN_XRCD => (s::<abi::OpenXrcd>(), s::<abi::OpenXrcdResp>()),
        OPEN_QP => (s::<abi::OpenQp>(), s::<abi::CreateQpResp>()),
        CREATE_XSRQ => (s::<abi::CreateXsrq>(), s::<abi::CreateSrqResp>()),
        REG_MR => (s::<abi::RegMr>(), s::<abi::RegMrResp>()),
        ALLOC_MW => (s::<abi::AllocMw>(), s::<abi::AllocMwResp>()),
        REREG_MR => (s::<abi::ReregMr>(), s::<abi::ReregMrResp>()),
        CREATE_COMP_CHANNEL => (8, s::<abi::CompChannelResp>()),
        CREATE_CQ => (s::<abi::CreateCq>(), s::<abi::CreateCqResp>()),
        RESIZE_CQ => (s::<abi::ResizeCq>(), s::<abi::ResizeCqResp>()),
        CREATE_SRQ => (s::<abi::CreateSrq>(), s::<abi::CreateSrqResp>()),
        MODIFY_SRQ => (s::<abi::ModifySrq>(), 0),
        QUERY_SRQ => (s::<abi::QuerySrq>(), s::<abi::QuerySrqResp>()),
        DESTROY_SRQ => (s::<abi::Destroy>(), s::<abi::DestroySrqResp>()),
        DESTROY_CQ => (s::<abi::Destroy>(), s::<abi::DestroyCqResp>()),
        CREATE_QP => (s::<abi::CreateQp>(), s::<abi::CreateQpResp>()),
        QUERY_QP => (s::<abi::QueryQp>(), s::<abi::QueryQpResp>()),
        MODIFY_QP => (s::<abi::ModifyQp>(), 0),
        DESTROY_QP => (s::<abi::Destroy>(), s::<abi::DestroyQpResp>()),
        CREATE_AH => (s::<abi::CreateAh>(), s::<abi::CreateAhResp>()),
        ATTACH_MCAST | DETACH_MCAST => (s::<abi::AttachMcast>(), 0),
        _ => (0, 0),
    }
}

fn cdev_stat((maj, min): (u32, u32)) -> libc::stat {
    // SAFETY: `stat` is plain old data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    st.st_mode = libc::S_IFCHR | 0o666;
    st.st_rdev = libc::makedev(maj, min);
    st.st_nlink = 1;
    st.st_blksize = 4096;
    st
}

/// A device's counters by the soft NIC's names ([`softnic::counters::CounterSnapshot`]), as
/// `rdma statistic` shows them.
fn counter_list(c: &softnic::counters::CounterSnapshot) -> Vec<(String, u64)> {
    let w = &c.wire;
    [
        ("wqes_executed", c.wqes_executed),
        ("bytes_moved", c.bytes_moved),
        ("cqes_written", c.cqes_written),
        ("error_cqes", c.errors.values().sum()),
        ("doorbells_seen", c.doorbells_seen),
        ("bad_doorbells", c.bad_doorbells),
        ("stale_wqes", c.stale_wqes),
        ("cq_overruns", c.cq_overruns),
        ("dc_key_violations", c.dc_key_violations),
        ("ud_sent", c.ud_sent),
        ("ud_received", c.ud_received),
        ("carried_turns", c.carried_turns),
        ("carry_calls", c.carry_calls),
        ("answer_looks", c.answer_looks),
        ("answers_found", c.answers_found),
        ("tx_packets", w.tx_packets),
        ("tx_bytes", w.tx_bytes),
        ("rx_packets", w.rx_packets),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_string(), v))
    .collect()
}

/// What the emulation leaves in a watched CQ's arm doorbell record once it has taken the
/// arm there: bit 31 of the big-endian word, which libmlx5 never sets (`sn << 28 | cmd | ci`,
/// sn two bits).
const ARM_UNSEEN: u32 = 0x8000_0000u32.to_be();

/// Notices CQ arm doorbells (page 0 of a context's UARs, and the arm word of each CQ's
/// doorbell record, which the provider writes first) and turns an armed CQ that has a
/// completion at or past its arm index into one completion event on its channel.
///
/// Between looks it sleeps [`ARM_POLL`] (what a new arm waits to be noticed), unless a CQ it
/// saw armed writes a CQE: the soft NIC wakes it then ([`softnic::Cq::wake_at_next_write`]),
/// so an event follows its completion at once, and an armed CQ that stays quiet costs no
/// wake-ups (a program that arms and busy-polls, as UCX does, shares its cores with this
/// thread).
fn watch_loop(emu: &'static Emulation) {
    let me = std::thread::current();
    loop {
        let mut again = false;
        {
            let mut w = emu.watched.lock();
            w.retain(|x| x.cq.strong_count() > 0);
            for x in w.iter_mut() {
                let Some(cq) = x.cq.upgrade() else { continue };
                if !x.woken_by_writes {
                    cq.soft.set_watcher(Some(me.clone()));
                    x.woken_by_writes = true;
                }
                let mut arm = cq.arm.lock();
                if arm.destroyed {
                    // its doorbell record may be freed memory now
                    continue;
                }
                let db = x
                    .page0
                    .atomic_u64(context::CQ_DOORBELL)
                    .load(Ordering::Acquire);
                let word = cq.dbrec.atomic_u32(4).load(Ordering::Acquire);
                if db != x.last_db {
                    x.last_db = db;
                    // {BE32(sn << 28 | cmd | ci), BE32(cqn)}
                    let b = db.to_ne_bytes();
                    let w0 = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
                    let cqn = u32::from_be_bytes([b[4], b[5], b[6], b[7]]) & 0xff_ffff;
                    if cqn == cq.soft.cqn() {
                        if tracing() {
                            complain(format_args!("arm(db) cqn {cqn:#x} ci {}", w0 & 0xff_ffff));
                        }
                        arm.armed = true;
                        arm.ci = w0 & 0xff_ffff;
                    }
                }
                if word != arm.last_word {
                    if tracing() {
                        complain(format_args!(
                            "arm(rec) cqn {:#x} ci {}",
                            cq.soft.cqn(),
                            u32::from_be(word) & 0xff_ffff
                        ));
                    }
                    arm.armed = true;
                    arm.ci = u32::from_be(word) & 0xff_ffff;
                    // Taken: mark the record again, so that the next arm is seen even when it
                    // writes the same word (arming CQs that share a context's doorbell register
                    // leaves only the last one's value there). Not over a newer arm.
                    arm.last_word = match cq.dbrec.atomic_u32(4).compare_exchange(
                        word,
                        ARM_UNSEEN,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => ARM_UNSEEN,
                        Err(_) => word,
                    };
                }
                if arm.armed {
                    let produced = cq.soft.produced() & 0xff_ffff;
                    if arm.due(produced) {
                        if tracing() {
                            complain(format_args!(
                                "event cqn {:#x} produced {produced} ci {} reported {}",
                                cq.soft.cqn(),
                                arm.ci,
                                arm.reported
                            ));
                        }
                        arm.armed = false;
                        arm.reported = produced;
                        if let Some(ch) = &cq.channel {
                            let ev = abi::CompEvent {
                                cq_handle: cq.user_handle,
                            };
                            ch.push(
                                bytemuck::bytes_of(&ev),
                                cq.key,
                                Some(cq.comp_reported.clone()),
                            );
                        }
                    } else {
                        cq.soft.wake_at_next_write();
                        // a CQE written between the look above and the ask is seen here
                        again |= arm.due(cq.soft.produced() & 0xff_ffff);
                    }
                }
            }
        }
        if !again {
            std::thread::park_timeout(ARM_POLL);
        }
    }
}

/// How often the event watcher looks for new arms (the provider writes them to memory, which
/// nothing tells the emulation of).
const ARM_POLL: Duration = Duration::from_micros(200);

#[cfg(test)]
mod tests {
    use super::*;

    fn emulation() -> Emulation {
        // one set of devices for every test, 'static as the process's emulation has it (and
        // reachable from a static, so a leak checker sees it kept, not lost)
        static DEVICES: OnceLock<&'static device::Devices> = OnceLock::new();
        Emulation {
            devices: DEVICES.get_or_init(|| {
                Box::leak(Box::new(device::Devices::new(config::EmuConfig::default())))
            }),
            fds: Mutex::new(HashMap::new()),
            watched: Mutex::new(Vec::new()),
            watcher: OnceLock::new(),
        }
    }

    /// libc's dup (this test binary is not preloaded) and the emulation told about it.
    fn dup(emu: &Emulation, fd: RawFd) -> RawFd {
        // SAFETY: plain system call on an fd the test owns.
        let new = unsafe { libc::dup(fd) };
        assert!(new >= 0);
        emu.duplicated(fd, new);
        new
    }

    fn close(emu: &Emulation, fd: RawFd, real_close: bool) {
        assert_eq!(emu.close(fd), real_close);
        if real_close {
            // SAFETY: closes an fd the test owns.
            unsafe { libc::close(fd) };
        }
    }

    fn open_device(emu: &Emulation) -> RawFd {
        let path = emu.devices.get(0).expect("device 0").id.cdev_path();
        emu.open(path.as_bytes(), libc::O_RDWR)
            .expect("a device path")
            .expect("opened")
    }

    /// The resource summary of device 0 as `rdma resource` reads it: (name, count) pairs.
    fn netlink_resources(emu: &Emulation) -> Vec<(String, u64)> {
        // RDMA_NLDEV_CMD_RES_GET of device 0: header, then DEV_INDEX (1) = 0
        let mut req = Vec::new();
        req.extend_from_slice(&24u32.to_ne_bytes());
        req.extend_from_slice(&((5u16 << 10) | 9).to_ne_bytes());
        req.extend_from_slice(&1u16.to_ne_bytes());
        req.extend_from_slice(&[7, 0, 0, 0, 0, 0, 0, 0]);
        req.extend_from_slice(&8u16.to_ne_bytes());
        req.extend_from_slice(&1u16.to_ne_bytes());
        req.extend_from_slice(&0u32.to_ne_bytes());
        let ans = emu.netlink(&req, 1234);
        assert_eq!(ans.len(), 1);
        let m = &ans[0];
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), (5 << 10) | 9);
        assert_eq!(u32::from_ne_bytes([m[12], m[13], m[14], m[15]]), 1234);
        // walk the attributes to RES_SUMMARY (15), then its entries (16: name 17, count 18)
        let attrs = |mut b: &[u8]| {
            let mut v = Vec::new();
            while b.len() >= 4 {
                let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
                v.push((u16::from_ne_bytes([b[2], b[3]]), b[4..len].to_vec()));
                b = &b[((len + 3) & !3).min(b.len())..];
            }
            v
        };
        let summary = attrs(&m[16..])
            .into_iter()
            .find(|a| a.0 == 15)
            .expect("summary")
            .1;
        attrs(&summary)
            .into_iter()
            .map(|(_, e)| {
                let e = attrs(&e);
                let name = &e.iter().find(|a| a.0 == 17).unwrap().1;
                let n = &e.iter().find(|a| a.0 == 18).unwrap().1;
                (
                    String::from_utf8(name[..name.len() - 1].to_vec()).unwrap(),
                    u64::from_ne_bytes(n[..8].try_into().unwrap()),
                )
            })
            .collect()
    }

    #[test]
    fn netlink_counts_this_processs_contexts_and_objects_and_umad_is_refused() {
        let emu = emulation();
        let count = |name: &str| {
            netlink_resources(&emu)
                .into_iter()
                .find(|r| r.0 == name)
                .map(|r| r.1)
        };
        assert_eq!(count("ctx"), Some(0));
        assert_eq!(count("cm_id"), Some(0));
        let fd = open_device(&emu);
        let copy = dup(&emu, fd);
        assert_eq!(count("ctx"), Some(1), "a dup is the same context");
        assert_eq!(count("qp"), Some(0));
        close(&emu, fd, true);
        close(&emu, copy, true);
        assert_eq!(count("ctx"), Some(0));
        for p in [&b"/dev/infiniband/umad0"[..], b"/dev/infiniband/issm1"] {
            assert!(matches!(
                emu.open(p, libc::O_RDWR),
                Some(Err(Errno::ENOENT))
            ));
        }
    }

    #[test]
    fn a_dup_of_a_device_fd_is_the_same_context_until_the_last_fd_closes() {
        let emu = emulation();
        let fd = open_device(&emu);
        let ctx = Arc::downgrade(&emu.context(fd).expect("a device fd"));
        let copy = dup(&emu, fd);
        let copy2 = dup(&emu, copy);
        for f in [copy, copy2] {
            assert!(is_ours(f));
            let c = emu.context(f).expect("the copy is a device fd");
            assert!(Arc::ptr_eq(&c, &ctx.upgrade().expect("alive")));
            assert!(emu
                .fstat(f)
                .is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFCHR));
        }
        // closing the first fd keeps the context for the copies
        close(&emu, fd, true);
        assert!(!is_ours(fd) && emu.fstat(fd).is_none());
        close(&emu, copy, true);
        assert!(ctx.upgrade().is_some());
        assert!(emu.context(copy2).is_some());
        // the last fd goes: the context with it
        close(&emu, copy2, true);
        assert!(ctx.upgrade().is_none());
        assert!(emu.fds.lock().is_empty());
    }

    #[test]
    fn a_dup_of_an_event_fd_shares_its_queue_and_a_dup2_onto_it_replaces_it() {
        let emu = emulation();
        let q = EventQueue::new(16).expect("eventfd");
        let qfd = q.fd();
        emu.register(qfd, FdKind::Channel(q.clone(), Weak::new()), true);
        let copy = dup(&emu, qfd);
        assert!(is_ours(copy));
        assert!(matches!(
            emu.fds.lock().get(&copy).map(FdEntry::kind),
            Some(FdKind::Channel(c, _)) if Arc::ptr_eq(c, &q)
        ));
        // the queue's own eventfd cannot be replaced; a copy can
        assert_eq!(emu.may_replace(qfd), Err(Errno::EBUSY));
        assert_eq!(emu.may_replace(copy), Ok(()));
        // dup2(device fd, copy): the copy becomes the device file, the channel keeps its fd
        let dev = open_device(&emu);
        // SAFETY: plain system call on fds the test owns.
        assert_eq!(unsafe { libc::dup2(dev, copy) }, copy);
        emu.duplicated(dev, copy);
        assert!(emu.context(copy).is_some());
        let channel_fds = |emu: &Emulation| {
            emu.fds
                .lock()
                .values()
                .filter(|e| matches!(e.kind(), FdKind::Channel(..)))
                .count()
        };
        assert_eq!(channel_fds(&emu), 1);
        // a second copy of the channel outlives the queue's own fd number in the table
        let copy2 = dup(&emu, qfd);
        close(&emu, qfd, false);
        assert!(is_ours(copy2) && !is_ours(qfd));
        assert_eq!(channel_fds(&emu), 1);
        close(&emu, copy2, true);
        assert_eq!(channel_fds(&emu), 0);
        close(&emu, copy, true);
        close(&emu, dev, true);
        assert!(emu.fds.lock().is_empty());
    }
}
