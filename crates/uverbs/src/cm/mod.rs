//! The RDMA connection manager under the emulation: `/dev/infiniband/rdma_cm` as the kernel's
//! ucma module answers librdmacm, over a connection manager that exchanges IBTA CM messages
//! with its peers as a RoCE ConnectX host does — MADs on QP1 over the soft NIC's RoCEv2 port
//! (`softnic::gsi`).
//!
//! - [`abi`]: the ucma commands and responses; [`addr`]: socket addresses and the CMA's
//!   private-data header; [`mad`]: the CM messages.
//! - This module: the open files of the device ([`CmFile`], each an event channel: an eventfd
//!   that is readable while events wait, so `poll`/`epoll` work, and GET_EVENT blocks on it
//!   unless the file is non-blocking) and the ids (`rdma_cm_id`s) of the process.
//! - `cmds`: each `write()` command, as `drivers/infiniband/core/ucma.c` and `cma.c` answer it.
//! - `mcast`: multicast joins (JOIN_IP_MCAST, JOIN_MCAST, LEAVE_MCAST) and their events.
//! - `agent`: the connection protocol (REQ / REP / RTU / REJ / DREQ / DREP / MRA, SIDR), its
//!   retransmissions, and the QP attributes each side's QP gets (INIT_QP_ATTR).
//!
//! Addresses are the emulated devices' IPv4 addresses (`gpuverbs emu --ip`); an address
//! resolves to the device that has it, a remote one to the first device (the route out), and
//! the route is that device's port 1 with the peer's RoCE v2 GID.

mod abi;
pub mod addr;
mod agent;
mod cmds;
pub mod mad;
mod mcast;
#[cfg(test)]
mod tests;

use crate::device::Devices;
use crate::uaccess::Errno;
use abi::EventResp;
use addr::Addr;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// One queued event of a file.
struct Queued {
    resp: EventResp,
    /// The id whose `events_reported` counts it when it is read.
    owner: u32,
    counter: Arc<AtomicU32>,
    /// A connection request's new id (it becomes usable when the event is read).
    child: Option<u32>,
    /// A multicast event's group (its handle, and the counter LEAVE_MCAST reports).
    mc: Option<(u32, Arc<AtomicU32>)>,
}

/// One open file of `/dev/infiniband/rdma_cm`: an event channel.
pub struct CmFile {
    fd: RawFd,
    q: Mutex<VecDeque<Queued>>,
    cv: Condvar,
}

impl CmFile {
    /// A new file; `flags` are `open`'s (O_NONBLOCK and O_CLOEXEC are kept).
    pub fn new(flags: i32) -> Result<Arc<Self>, Errno> {
        let mut efd = libc::EFD_SEMAPHORE;
        if flags & libc::O_CLOEXEC != 0 {
            efd |= libc::EFD_CLOEXEC;
        }
        if flags & libc::O_NONBLOCK != 0 {
            efd |= libc::EFD_NONBLOCK;
        }
        // SAFETY: plain system call; the result is checked.
        let fd = unsafe { libc::eventfd(0, efd) };
        if fd < 0 {
            return Err(Errno(
                std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EMFILE),
            ));
        }
        Ok(Arc::new(Self {
            fd,
            q: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
        }))
    }

    /// The fd the program holds.
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    fn push(&self, e: Queued) {
        let mut q = self.q.lock();
        q.push_back(e);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from `one` to this file's own eventfd (one token per event).
        unsafe { libc::syscall(libc::SYS_write, self.fd, &one as *const u64, 8usize) };
        self.cv.notify_all();
    }

    /// Takes the token of one event off the eventfd (called with the queue locked, so the
    /// counter always equals the queue's length and the read never waits).
    fn take_token(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into `v` from this file's own eventfd, whose counter is > 0.
        unsafe { libc::syscall(libc::SYS_read, self.fd, &mut v as *mut u64, 8usize) };
    }

    fn nonblocking(&self) -> bool {
        // SAFETY: F_GETFL on our own fd.
        let fl = unsafe { libc::syscall(libc::SYS_fcntl, self.fd, libc::F_GETFL) };
        fl >= 0 && (fl as i32) & libc::O_NONBLOCK != 0
    }

    /// The next event, waiting for one unless the file is non-blocking (EAGAIN then). Its id
    /// counts it as reported.
    fn next(&self) -> Result<Queued, Errno> {
        let mut q = self.q.lock();
        loop {
            if let Some(e) = q.pop_front() {
                self.take_token();
                e.counter.fetch_add(1, Ordering::AcqRel);
                if let Some((_, c)) = &e.mc {
                    c.fetch_add(1, Ordering::AcqRel);
                }
                return Ok(e);
            }
            if self.nonblocking() {
                return Err(Errno::EAGAIN);
            }
            self.cv.wait(&mut q);
        }
    }

    /// Drops the queued events of id `owner`; returns the new ids of connection requests
    /// among them (never read: they go too).
    fn purge(&self, owner: u32) -> Vec<u32> {
        let mut q = self.q.lock();
        let mut children = Vec::new();
        let before = q.len();
        q.retain(|e| {
            let mine = e.owner == owner || e.child == Some(owner);
            if mine && e.owner == owner {
                children.extend(e.child);
            }
            !mine
        });
        for _ in q.len()..before {
            self.take_token();
        }
        children
    }
}

impl CmFile {
    /// Drops the queued events of multicast group `mc` (ucma's `ucma_cleanup_mc_events`).
    fn purge_mc(&self, mc: u32) {
        let mut q = self.q.lock();
        let before = q.len();
        q.retain(|e| e.mc.as_ref().is_none_or(|(h, _)| *h != mc));
        for _ in q.len()..before {
            self.take_token();
        }
    }
}

impl Drop for CmFile {
    fn drop(&mut self) {
        // SAFETY: closes the eventfd this file owns; nothing else closes it.
        unsafe { libc::syscall(libc::SYS_close, self.fd) };
    }
}

/// Where an id stands (the CMA's `rdma_cm_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    Idle,
    AddrBound,
    AddrResolved,
    RouteResolved,
    Listen,
    Connect,
    Disconnect,
}

/// One `rdma_cm_id`.
struct Id {
    handle: u32,
    file: Arc<CmFile>,
    uid: u64,
    ps: u16,
    qp_type: u8,
    st: St,
    src: Addr,
    dst: Addr,
    /// The device (index) the id is bound to.
    dev: Option<u32>,
    /// Whether it holds its port (a bound id; not a connection request's, which shares its
    /// listener's).
    holds_port: bool,
    /// Connection requests not yet read, and how many may wait (a listener).
    pending: u32,
    backlog: u32,
    reported: Arc<AtomicU32>,
    /// A connection request's id: its listener, until the request is read.
    listener: Option<u32>,
    /// Whether commands may name it (a connection request's id: once its event was read).
    visible: bool,
    /// Options.
    tos: u8,
    reuseaddr: bool,
    ack_timeout: Option<u8>,
    /// The connection, once one is being made.
    conn: Option<agent::Conn>,
    /// The multicast groups it joined.
    mcs: Vec<mcast::Mc>,
}

impl Id {
    fn new(handle: u32, file: Arc<CmFile>, uid: u64, ps: u16, qp_type: u8) -> Self {
        Self {
            handle,
            file,
            uid,
            ps,
            qp_type,
            st: St::Idle,
            src: Addr::default(),
            dst: Addr::default(),
            dev: None,
            holds_port: false,
            pending: 0,
            backlog: 0,
            reported: Arc::new(AtomicU32::new(0)),
            listener: None,
            visible: true,
            tos: 0,
            reuseaddr: false,
            ack_timeout: None,
            conn: None,
            mcs: Vec::new(),
        }
    }

    /// Queues an event for this id on its file.
    fn event(&self, mut resp: EventResp, child: Option<u32>) {
        resp.uid = self.uid;
        if child.is_none() {
            resp.id = self.handle;
        }
        self.file.push(Queued {
            resp,
            owner: self.handle,
            counter: self.reported.clone(),
            child,
            mc: None,
        });
    }

    fn is_ud(&self) -> bool {
        self.qp_type == agent::QPT_UD
    }
}

/// Writes a response: ENOSPC when the room is smaller.
fn respond<T: bytemuck::Pod>(to: u64, out: usize, v: &T) -> Result<(), Errno> {
    let b = bytemuck::bytes_of(v);
    if out < b.len() {
        return Err(Errno::ENOSPC);
    }
    crate::uaccess::copy_to_user(to, b)
}

/// The id `h` of `file`: ENOENT when there is none (or it is a connection request not yet
/// reported), EINVAL when it is another file's.
fn id_mut<'a>(st: &'a mut State, file: &Arc<CmFile>, h: u32) -> Result<&'a mut Id, Errno> {
    let id = st
        .ids
        .get_mut(&h)
        .filter(|i| i.visible)
        .ok_or(Errno::ENOENT)?;
    if !Arc::ptr_eq(&id.file, file) {
        return Err(Errno::EINVAL);
    }
    Ok(id)
}

/// An event with nothing but its type and status.
fn plain_event(event: u32, status: i32) -> EventResp {
    let mut e: EventResp = bytemuck::Zeroable::zeroed();
    e.event = event;
    e.status = status as u32;
    e
}

#[derive(Default)]
struct State {
    ids: HashMap<u32, Id>,
    next_id: u32,
    /// Devices whose QP1 handler is installed.
    agents: Vec<u32>,
    /// The last multicast group handle given.
    last_mc: u32,
}

/// The connection manager of the process.
pub struct Cm {
    devices: &'static Devices,
    /// The process that made it: a child `fork` made shares the files, and its exit must not
    /// end the parent's connections (the kernel's files live while either holds them).
    pid: u32,
    st: Mutex<State>,
    timer: OnceLock<()>,
    epoch: Instant,
}

static CM: OnceLock<Cm> = OnceLock::new();

/// The process's connection manager over `devices`.
pub fn cm(devices: &'static Devices) -> &'static Cm {
    CM.get_or_init(|| {
        // SAFETY: registers a plain `extern "C" fn()` to run at exit.
        unsafe { libc::atexit(at_exit) };
        on_fatal_signals();
        Cm {
            devices,
            pid: std::process::id(),
            st: Mutex::new(State::default()),
            timer: OnceLock::new(),
            epoch: Instant::now(),
        }
    })
}

/// Signals whose default action ends the process, caught (where the program left them at
/// their default) so that a process that dies of one still tells its peers, as the kernel
/// would when it closes the dead process's files.
const FATAL: [libc::c_int; 8] = [
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGABRT,
    libc::SIGFPE,
    libc::SIGILL,
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
];

/// The pipes between the fatal-signal handler and the thread that tells the peers: the
/// handler writes the signal's number to `REQ` and waits for a byte on `ACK` (a self-pipe:
/// `write`, `poll` and `read` are async-signal-safe, taking the manager's lock and sending are
/// not, so they run on the thread).
static FATAL_REQ: AtomicI32 = AtomicI32::new(-1);
static FATAL_ACK: AtomicI32 = AtomicI32::new(-1);

/// A pipe's (read, write) ends, close-on-exec.
fn pipe() -> Option<(libc::c_int, libc::c_int)> {
    let mut fds = [-1; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    (unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == 0).then_some((fds[0], fds[1]))
}

fn on_fatal_signals() {
    let (Some((req_r, req_w)), Some((ack_r, ack_w))) = (pipe(), pipe()) else {
        return;
    };
    let watcher = std::thread::Builder::new()
        .name("gpuverbs-emu-cm-fatal".into())
        .spawn(move || fatal_watcher(req_r, ack_w));
    if watcher.is_err() {
        return;
    }
    FATAL_REQ.store(req_w, Ordering::Release);
    FATAL_ACK.store(ack_r, Ordering::Release);
    for sig in FATAL {
        // SAFETY: reads the current disposition into a zeroed struct.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: query only (no new action).
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0
            || old.sa_sigaction != libc::SIG_DFL
        {
            continue;
        }
        // SAFETY: a zeroed sigaction with our handler, SA_RESETHAND so that the re-raised
        // signal takes its default action.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = on_fatal as extern "C" fn(libc::c_int) as usize;
        act.sa_flags = libc::SA_RESETHAND;
        // SAFETY: installs the handler for a signal the program left at its default.
        unsafe { libc::sigaction(sig, &act, std::ptr::null_mut()) };
    }
}

/// The thread behind the handler: for each signal number read from `req`, the connections'
/// peers are told (best effort: nothing is done when the manager's lock stays held 300 ms),
/// then a byte goes back on `ack`.
fn fatal_watcher(req: libc::c_int, ack: libc::c_int) {
    loop {
        let mut sig = [0u8; 1];
        // SAFETY: reads one byte into a live local from the pipe this thread owns.
        match unsafe { libc::read(req, sig.as_mut_ptr().cast(), 1) } {
            1 => {}
            -1 if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {
                continue
            }
            _ => return,
        }
        let _ = std::panic::catch_unwind(|| farewell(sig[0]));
        // SAFETY: writes one byte from a live local to the pipe this thread owns.
        unsafe { libc::write(ack, sig.as_ptr().cast(), 1) };
    }
}

/// Tells the peers of every connection of this process that it is gone (a fatal signal).
fn farewell(sig: u8) {
    let Some(cm) = CM.get().filter(|c| c.pid == std::process::id()) else {
        return;
    };
    // another thread may hold the lock a moment longer (the one that queued the event the
    // program took before it died); the dying thread itself, for good
    match cm.st.try_lock_for(std::time::Duration::from_millis(300)) {
        Some(st) => {
            for id in st.ids.values() {
                cm.conn_gone(id);
            }
        }
        None if crate::tracing() => {
            crate::complain(format_args!("rdma_cm: signal {sig}: the manager is busy"))
        }
        None => {}
    }
}

/// A fatal signal: only async-signal-safe calls. The watcher thread is asked to tell the
/// connections' peers and waited for (at most 1.5 s; an alarm ends a process that would hang
/// here all the same), then the signal takes its default action. A child `fork` made has no
/// watcher (and tells nobody: its parent's connections are not its own).
extern "C" fn on_fatal(sig: libc::c_int) {
    // SAFETY: async-signal-safe calls only: sigaction (through signal), alarm, getpid, write,
    // poll, read and raise, on descriptors made before the handler was installed.
    unsafe {
        libc::signal(libc::SIGALRM, libc::SIG_DFL);
        libc::alarm(2);
        let (req, ack) = (
            FATAL_REQ.load(Ordering::Acquire),
            FATAL_ACK.load(Ordering::Acquire),
        );
        let starter = CM.get().is_some_and(|c| c.pid == libc::getpid() as u32);
        if starter && req >= 0 && ack >= 0 {
            let b = sig as u8;
            if libc::write(req, (&b as *const u8).cast(), 1) == 1 {
                let mut p = libc::pollfd {
                    fd: ack,
                    events: libc::POLLIN,
                    revents: 0,
                };
                if libc::poll(&mut p, 1, 1500) == 1 {
                    let mut r = 0u8;
                    libc::read(ack, (&mut r as *mut u8).cast(), 1);
                }
            }
        }
        // the handler was reset (SA_RESETHAND): the signal now takes its default action
        libc::raise(sig);
    }
}

/// The process's connection manager, if a program opened the device.
pub fn existing() -> Option<&'static Cm> {
    CM.get()
}

impl Cm {
    /// How many ids device `dev` of `devices` has (`rdma resource`'s `cm_id`): those bound to
    /// it, and one for each id listening on every device (the kernel makes an internal
    /// listener per device). Devices other than the manager's have none.
    pub fn ids_on(&self, devices: &Devices, dev: u32) -> u64 {
        if !std::ptr::eq(self.devices, devices) {
            return 0;
        }
        self.st
            .lock()
            .ids
            .values()
            .filter(|i| i.dev == Some(dev) || (i.dev.is_none() && i.st == St::Listen))
            .count() as u64
    }
}

/// At exit the kernel closes the process's files, which destroys its ids: its peers learn
/// of it (a DREQ for each connection, a REJ for each one being made). The same here.
extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(cm) = CM.get().filter(|c| c.pid == std::process::id()) {
            let handles: Vec<u32> = cm.st.lock().ids.keys().copied().collect();
            for h in handles {
                cm.destroy(h);
            }
        }
    });
}

impl Cm {
    /// One `write()` on `file`: a ucma command (`buf`: the whole write). `file_of` finds the
    /// open file of another fd (MIGRATE_ID names the id's current file by its fd).
    pub fn write(
        &'static self,
        file: &Arc<CmFile>,
        buf: &[u8],
        file_of: &dyn Fn(RawFd) -> Option<Arc<CmFile>>,
    ) -> Result<(), Errno> {
        if buf.len() < abi::HDR_LEN {
            return Err(Errno::EINVAL);
        }
        let cmd = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]);
        let inl = u16::from_ne_bytes([buf[4], buf[5]]) as usize;
        let out = u16::from_ne_bytes([buf[6], buf[7]]) as usize;
        if abi::HDR_LEN + inl > buf.len() {
            return Err(Errno::EINVAL);
        }
        let body = &buf[abi::HDR_LEN..abi::HDR_LEN + inl];
        let r = cmds::run(self, file, cmd, body, out, file_of);
        if crate::tracing() {
            crate::complain(format_args!(
                "rdma_cm command {cmd} (in {inl}, out {out}): {r:?}"
            ));
        }
        r
    }

    /// The file's last fd was closed: its ids are destroyed, as `close` of the device does.
    pub fn release(&'static self, file: &Arc<CmFile>) {
        let handles: Vec<u32> = self
            .st
            .lock()
            .ids
            .values()
            .filter(|i| Arc::ptr_eq(&i.file, file))
            .map(|i| i.handle)
            .collect();
        for h in handles {
            let _ = self.destroy(h);
        }
    }

    /// Destroys id `h` (and the connection requests its unread events carry): what it was
    /// doing on the wire ends as the kernel's CM ends it. Returns its events reported.
    fn destroy(&'static self, h: u32) -> Option<u32> {
        let mut st = self.st.lock();
        let id = st.ids.remove(&h)?;
        if let Some(l) = id.listener.and_then(|l| st.ids.get_mut(&l)) {
            l.pending = l.pending.saturating_sub(1);
        }
        for child in id.file.purge(h) {
            if let Some(c) = st.ids.remove(&child) {
                self.conn_gone(&c);
            }
        }
        self.conn_gone(&id);
        Some(id.reported.load(Ordering::Acquire))
    }

    /// Milliseconds since the manager started (deadlines).
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}
