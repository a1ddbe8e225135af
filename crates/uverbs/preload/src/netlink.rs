//! The RDMA netlink socket of a process under `gpuverbs emu`. `socket(AF_NETLINK, …,
//! NETLINK_RDMA)` gets one end of a datagram socket pair; what the program sends on it is
//! answered at once by [`uverbs::Emulation::netlink`] and the answers are written into the other
//! end, where the program's reads (and polls) find them. Followed for those fds: `bind`,
//! `getsockname`, `setsockopt(SOL_NETLINK, …)`, `sendto`, `sendmsg`, `send`, `write` (a request),
//! `recvmsg` and `recvfrom` (the sender's address is the kernel's, `nl_pid` 0) and `close`;
//! `read`, `recv`, `poll` and `fcntl` are the socket pair's own. A `dup` of such an fd is a
//! plain socket: requests sent on it are not answered.

use libc::{c_int, c_void, sockaddr, socklen_t, ssize_t};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

/// One emulated netlink socket: the end of the pair the answers are written to, and the port
/// id it is bound to.
struct Sock {
    peer: c_int,
    portid: u32,
}

static SOCKS: Mutex<Option<HashMap<c_int, Sock>>> = Mutex::new(None);
/// Bitmap of the fds (below 65536) that are emulated netlink sockets: one load for everyone
/// else's fds.
static FDS: [AtomicU64; 1024] = [const { AtomicU64::new(0) }; 1024];
/// Port ids the kernel would give sockets bound with `nl_pid` 0 after the process's first
/// (which gets the process id): negative numbers from -4097 down.
static ROVER: AtomicU32 = AtomicU32::new(0);

fn mark(fd: c_int, on: bool) {
    if !(0..65536).contains(&fd) {
        return;
    }
    let (w, b) = (fd as usize / 64, 1u64 << (fd % 64));
    if on {
        FDS[w].fetch_or(b, Ordering::AcqRel);
    } else {
        FDS[w].fetch_and(!b, Ordering::AcqRel);
    }
}

/// Whether `fd` is an emulated netlink socket.
pub(crate) fn is_ours(fd: c_int) -> bool {
    (0..65536).contains(&fd)
        && FDS[fd as usize / 64].load(Ordering::Acquire) & (1 << (fd % 64)) != 0
}

fn with<T>(fd: c_int, f: impl FnOnce(&mut Sock) -> T) -> Option<T> {
    let mut g = SOCKS.lock().unwrap_or_else(|e| e.into_inner());
    g.as_mut()?.get_mut(&fd).map(f)
}

fn next_portid() -> u32 {
    let n = ROVER.fetch_add(1, Ordering::Relaxed);
    if n == 0 {
        std::process::id()
    } else {
        (-4096i32 - n as i32) as u32
    }
}

/// `socket(AF_NETLINK, ty, NETLINK_RDMA)`: the program's end of a new pair (`SOCK_NONBLOCK` and
/// `SOCK_CLOEXEC` of `ty` kept), or -1 with errno.
pub(crate) fn open(ty: c_int) -> c_int {
    let mut sv = [-1; 2];
    let flags = ty & (libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC);
    // SAFETY: socketpair writes two fds into `sv`, a live array of two.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_DGRAM | flags, 0, sv.as_mut_ptr()) } != 0
    {
        return -1;
    }
    // the emulation's end: never inherited, never blocking its writer (the program's thread)
    // SAFETY: fcntl on the fd just made.
    unsafe {
        libc::fcntl(sv[1], libc::F_SETFD, libc::FD_CLOEXEC);
        libc::fcntl(sv[1], libc::F_SETFL, libc::O_NONBLOCK);
    }
    let mut g = SOCKS.lock().unwrap_or_else(|e| e.into_inner());
    g.get_or_insert_with(HashMap::new).insert(
        sv[0],
        Sock {
            peer: sv[1],
            portid: 0,
        },
    );
    mark(sv[0], true);
    sv[0]
}

/// `close(fd)` of an emulated netlink socket: its pair's other end goes too. The caller closes
/// `fd` itself.
pub(crate) fn close(fd: c_int) {
    mark(fd, false);
    let s = {
        let mut g = SOCKS.lock().unwrap_or_else(|e| e.into_inner());
        g.as_mut().and_then(|m| m.remove(&fd))
    };
    if let Some(s) = s {
        // SAFETY: closes the emulation's own end, which nothing else holds.
        unsafe { libc::close(s.peer) };
    }
}

/// `sockaddr_nl` (family, pad, port id, groups).
fn sockaddr_nl(portid: u32) -> [u8; 12] {
    let mut a = [0u8; 12];
    a[0..2].copy_from_slice(&(libc::AF_NETLINK as u16).to_ne_bytes());
    a[4..8].copy_from_slice(&portid.to_ne_bytes());
    a
}

/// Writes `sockaddr_nl(portid)` into the caller's `addr` (at most `*len` bytes), and its size
/// into `*len`.
///
/// # Safety
/// `addr` and `len` are null or point to what `getsockname`/`recvfrom` callers pass.
unsafe fn put_addr(addr: *mut sockaddr, len: *mut socklen_t, portid: u32) {
    if addr.is_null() || len.is_null() {
        return;
    }
    let a = sockaddr_nl(portid);
    // SAFETY: `*len` is the room at `addr` the caller gave; at most that much is written.
    unsafe {
        let n = (*len as usize).min(a.len());
        std::ptr::copy_nonoverlapping(a.as_ptr(), addr as *mut u8, n);
        *len = a.len() as socklen_t;
    }
}

/// `bind(fd, addr)`: the port id asked for, or the kernel's choice for `nl_pid` 0.
///
/// # Safety
/// `addr` points to `len` readable bytes or is null.
pub(crate) unsafe fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    if addr.is_null() || (len as usize) < 12 {
        return err(libc::EINVAL);
    }
    let mut a = [0u8; 12];
    // SAFETY: `addr` holds at least 12 bytes (checked above).
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, a.as_mut_ptr(), 12) };
    if u16::from_ne_bytes([a[0], a[1]]) != libc::AF_NETLINK as u16 {
        return err(libc::EINVAL);
    }
    let asked = u32::from_ne_bytes([a[4], a[5], a[6], a[7]]);
    with(fd, |s| {
        if s.portid == 0 {
            s.portid = if asked != 0 { asked } else { next_portid() };
        }
        0
    })
    .unwrap_or_else(|| err(libc::EBADF))
}

/// `getsockname(fd)`: the socket's `sockaddr_nl` (port id 0 before it is bound).
///
/// # Safety
/// As `getsockname`'s arguments.
pub(crate) unsafe fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let Some(portid) = with(fd, |s| s.portid) else {
        return err(libc::EBADF);
    };
    // SAFETY: the caller's arguments, as getsockname takes them.
    unsafe { put_addr(addr, len, portid) };
    0
}

/// A request of `bytes` sent on `fd`: answered into the pair's other end. Returns what
/// `send` returns.
pub(crate) fn request(fd: c_int, bytes: &[u8]) -> ssize_t {
    let Some((peer, portid)) = with(fd, |s| {
        if s.portid == 0 {
            // sending autobinds, as the kernel does
            s.portid = next_portid();
        }
        (s.peer, s.portid)
    }) else {
        return err(libc::EBADF) as ssize_t;
    };
    let Some(emu) = uverbs::emulation() else {
        return err(libc::ECONNREFUSED) as ssize_t;
    };
    let answers =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| emu.netlink(bytes, portid)))
            .unwrap_or_default();
    for d in answers {
        // SAFETY: `peer` is the emulation's end of the pair; `d` is a live buffer of its length.
        let r = unsafe {
            libc::send(
                peer,
                d.as_ptr() as *const c_void,
                d.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if r < 0 {
            uverbs::complain(format_args!(
                "an RDMA netlink answer was lost: {}",
                std::io::Error::last_os_error()
            ));
            break;
        }
    }
    bytes.len() as ssize_t
}

/// The sender's address of what `recvmsg`/`recvfrom` read: the kernel's (`nl_pid` 0).
///
/// # Safety
/// As [`put_addr`].
pub(crate) unsafe fn kernel_addr(addr: *mut sockaddr, len: *mut socklen_t) {
    // SAFETY: as the caller's contract.
    unsafe { put_addr(addr, len, 0) }
}

fn err(e: c_int) -> c_int {
    // SAFETY: the thread's errno location is always valid.
    unsafe { *libc::__errno_location() = e };
    -1
}
