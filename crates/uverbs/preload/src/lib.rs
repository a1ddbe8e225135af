//! The LD_PRELOAD library of `gpuverbs emu`: interposes the libc calls that libibverbs and
//! libmlx5 make on `/dev/infiniband/uverbsN` (open, close, read, write, ioctl, mmap, stat,
//! fstat) and the RDMA netlink socket, and hands those on the emulation's files to
//! [`uverbs::Emulation`]. Every other file descriptor and path goes to the real libc function
//! untouched (one bitmap load for `read`, `write` and `close`). [`paths`] shows the emulated
//! devices under their absolute paths (`/sys/class/infiniband…`, `/dev/infiniband`: access, the
//! stat family, realpath, fopen, opendir, readlink, ...) and serves `syscall(SYS_mmap, …)` of a
//! device file. [`dup`] follows `dup`, `dup2`, `dup3` and `fcntl(F_DUPFD…)` of the emulation's
//! files.
//!
//! No Rust panic crosses into C: each hook catches unwinds and answers EIO.

#![allow(clippy::missing_safety_doc)]

mod progress;

use libc::{c_char, c_int, c_ulong, c_void, mode_t, off_t, size_t, ssize_t};
use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use uverbs::{emulation, is_ours, Errno};

/// The next definition of `name` (libc's), looked up once.
fn next(slot: &AtomicUsize, name: &CStr) -> usize {
    let p = slot.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name; the result is checked below.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    if p == 0 {
        // Nothing to forward to: no process can work like this.
        uverbs::complain(format_args!("no next definition of {name:?}"));
        // SAFETY: terminating the process is always sound.
        unsafe { libc::abort() };
    }
    slot.store(p, Ordering::Release);
    p
}

macro_rules! real {
    ($name:literal : fn($($t:ty),*) -> $r:ty) => {{
        static SLOT: AtomicUsize = AtomicUsize::new(0);
        let p = next(&SLOT, $name);
        // (used inside the caller's `unsafe` block: `p` is libc's definition of this symbol,
        // whose C signature this type states)
        std::mem::transmute::<usize, unsafe extern "C" fn($($t),*) -> $r>(p)
    }};
}

fn set_errno(e: Errno) {
    // SAFETY: the thread's errno location is always valid.
    unsafe { *libc::__errno_location() = e.0 };
}

/// Runs a hook body; a panic becomes EIO.
fn guard<T>(fail: T, f: impl FnOnce() -> Result<T, Errno>) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            set_errno(e);
            fail
        }
        Err(_) => {
            uverbs::complain(format_args!("internal error (panic) in a device call; EIO"));
            set_errno(Errno(libc::EIO));
            fail
        }
    }
}

mod cuda;
mod dup;
mod netlink;
mod paths;

/// The path bytes when `path` names an emulated device file (cheap prefix test first).
unsafe fn device_path<'a>(path: *const c_char) -> Option<&'a [u8]> {
    if path.is_null() {
        return None;
    }
    // SAFETY: the caller passed a NUL-terminated path (as open/stat require).
    let p = unsafe { CStr::from_ptr(path) }.to_bytes();
    (p.starts_with(b"/dev/infiniband/uverbs")
        || p == uverbs::RDMA_CM_PATH
        || uverbs::is_umad_path(p))
    .then_some(p)
}

fn open_device(p: &[u8], flags: c_int) -> Option<c_int> {
    let emu = emulation()?;
    let r =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| emu.open(p, flags))).ok()??;
    Some(match r {
        Ok(fd) => fd,
        Err(e) => {
            set_errno(e);
            -1
        }
    })
}

/// The open family: an emulated device file, or libc's call (`forward`) on the path, rewritten
/// when it is one of the emulated tree's ([`paths`]).
unsafe fn open_any(
    path: *const c_char,
    flags: c_int,
    forward: impl FnOnce(*const c_char) -> c_int,
) -> c_int {
    // SAFETY: `path` is the caller's NUL-terminated path (as open requires).
    if let Some(p) = unsafe { device_path(path) } {
        if let Some(fd) = open_device(p, flags) {
            return fd;
        }
    }
    // SAFETY: as above.
    unsafe { paths::with_path(path, -1, forward) }
}

#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    // SAFETY: forwards the caller's arguments to the emulation or to libc's open.
    unsafe {
        open_any(path, flags, |p| {
            real!(c"open": fn(*const c_char, c_int, mode_t) -> c_int)(p, flags, mode)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    // SAFETY: forwards the caller's arguments to the emulation or to libc's open64.
    unsafe {
        open_any(path, flags, |p| {
            real!(c"open64": fn(*const c_char, c_int, mode_t) -> c_int)(p, flags, mode)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn openat(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mode: mode_t,
) -> c_int {
    // SAFETY: forwards the caller's arguments (device paths are absolute, so dirfd is moot).
    unsafe {
        open_any(path, flags, |p| {
            real!(c"openat": fn(c_int, *const c_char, c_int, mode_t) -> c_int)(
                dirfd, p, flags, mode,
            )
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn openat64(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mode: mode_t,
) -> c_int {
    // SAFETY: forwards the caller's arguments (device paths are absolute, so dirfd is moot).
    unsafe {
        open_any(path, flags, |p| {
            real!(c"openat64": fn(c_int, *const c_char, c_int, mode_t) -> c_int)(
                dirfd, p, flags, mode,
            )
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if netlink::is_ours(fd) {
        netlink::close(fd);
    }
    if is_ours(fd) {
        if let Some(emu) = emulation() {
            let forward = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| emu.close(fd)))
                .unwrap_or(true);
            if !forward {
                return 0;
            }
        }
    }
    // SAFETY: libc's close with the caller's fd.
    unsafe { real!(c"close": fn(c_int) -> c_int)(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    if is_ours(fd) {
        if let Some(emu) = emulation() {
            return guard(-1, || emu.read(fd, buf as u64, n).map(|v| v as ssize_t));
        }
    }
    // SAFETY: libc's read with the caller's arguments.
    unsafe { real!(c"read": fn(c_int, *mut c_void, size_t) -> ssize_t)(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    if netlink::is_ours(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        return netlink::request(fd, unsafe { bytes(buf, n) });
    }
    if is_ours(fd) {
        if let Some(emu) = emulation() {
            return guard(-1, || emu.write(fd, buf as u64, n).map(|v| v as ssize_t));
        }
    }
    // SAFETY: libc's write with the caller's arguments.
    unsafe { real!(c"write": fn(c_int, *const c_void, size_t) -> ssize_t)(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, request: c_ulong, arg: *mut c_void) -> c_int {
    if is_ours(fd) {
        // The ioctl path serves REG_DMABUF_MR only (ENOTTY for the rest: libibverbs then uses
        // the write() commands for everything else).
        return match emulation() {
            Some(emu) => guard(-1, || emu.ioctl(fd, request, arg as u64)),
            None => {
                set_errno(Errno::ENOTTY);
                -1
            }
        };
    }
    // SAFETY: libc's ioctl with the caller's arguments.
    unsafe { real!(c"ioctl": fn(c_int, c_ulong, *mut c_void) -> c_int)(fd, request, arg) }
}

unsafe fn mmap_hook(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
    sixty_four: bool,
) -> *mut c_void {
    if is_ours(fd) {
        if let Some(emu) = emulation() {
            return guard(libc::MAP_FAILED, || {
                emu.mmap(fd, addr as usize, len, prot, flags, off)
            });
        }
    }
    if sixty_four {
        // SAFETY: libc's mmap64 with the caller's arguments.
        unsafe {
            real!(c"mmap64": fn(*mut c_void, size_t, c_int, c_int, c_int, off_t) -> *mut c_void)(
                addr, len, prot, flags, fd, off,
            )
        }
    } else {
        // SAFETY: libc's mmap with the caller's arguments.
        unsafe {
            real!(c"mmap": fn(*mut c_void, size_t, c_int, c_int, c_int, off_t) -> *mut c_void)(
                addr, len, prot, flags, fd, off,
            )
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    // SAFETY: forwards the caller's arguments.
    unsafe { mmap_hook(addr, len, prot, flags, fd, off, false) }
}

#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    // SAFETY: forwards the caller's arguments.
    unsafe { mmap_hook(addr, len, prot, flags, fd, off, true) }
}

unsafe fn fake_stat(path: *const c_char, out: *mut libc::stat) -> Option<c_int> {
    // SAFETY: `path` is the caller's NUL-terminated path.
    let p = unsafe { device_path(path) }?;
    let st =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| emulation()?.stat(p))).ok()??;
    if out.is_null() {
        set_errno(Errno::EFAULT);
        return Some(-1);
    }
    // SAFETY: the caller passed a `struct stat` to fill.
    unsafe { out.write(st) };
    Some(0)
}

unsafe fn fake_fstat(fd: c_int, out: *mut libc::stat) -> Option<c_int> {
    if !is_ours(fd) {
        return None;
    }
    let st = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| emulation()?.fstat(fd)))
        .ok()??;
    if out.is_null() {
        set_errno(Errno::EFAULT);
        return Some(-1);
    }
    // SAFETY: the caller passed a `struct stat` to fill.
    unsafe { out.write(st) };
    Some(0)
}

#[no_mangle]
pub unsafe extern "C" fn stat(path: *const c_char, out: *mut libc::stat) -> c_int {
    // SAFETY: forwards the caller's arguments.
    if let Some(r) = unsafe { fake_stat(path, out) } {
        return r;
    }
    // SAFETY: libc's stat with the caller's arguments (the path rewritten when it is one of the
    // emulated tree's).
    unsafe {
        paths::with_path(path, -1, |p| {
            real!(c"stat": fn(*const c_char, *mut libc::stat) -> c_int)(p, out)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn stat64(path: *const c_char, out: *mut libc::stat) -> c_int {
    // SAFETY: forwards the caller's arguments (`stat64` is `stat` on 64-bit Linux).
    if let Some(r) = unsafe { fake_stat(path, out) } {
        return r;
    }
    // SAFETY: libc's stat64 with the caller's arguments (the path rewritten as for stat).
    unsafe {
        paths::with_path(path, -1, |p| {
            real!(c"stat64": fn(*const c_char, *mut libc::stat) -> c_int)(p, out)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn fstat(fd: c_int, out: *mut libc::stat) -> c_int {
    // SAFETY: forwards the caller's arguments.
    if let Some(r) = unsafe { fake_fstat(fd, out) } {
        return r;
    }
    // SAFETY: libc's fstat with the caller's arguments.
    unsafe { real!(c"fstat": fn(c_int, *mut libc::stat) -> c_int)(fd, out) }
}

#[no_mangle]
pub unsafe extern "C" fn fstat64(fd: c_int, out: *mut libc::stat) -> c_int {
    // SAFETY: forwards the caller's arguments.
    if let Some(r) = unsafe { fake_fstat(fd, out) } {
        return r;
    }
    // SAFETY: libc's fstat64 with the caller's arguments.
    unsafe { real!(c"fstat64": fn(c_int, *mut libc::stat) -> c_int)(fd, out) }
}

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    if domain == libc::AF_NETLINK
        && protocol == uverbs::netlink::NETLINK_RDMA
        && emulation().is_some()
    {
        // The emulated devices' netlink (never the host's: libibverbs and `rdma` see the
        // emulated devices only).
        return netlink::open(ty);
    }
    // SAFETY: libc's socket with the caller's arguments.
    unsafe { real!(c"socket": fn(c_int, c_int, c_int) -> c_int)(domain, ty, protocol) }
}

/// `n` bytes at `buf` (none when null).
///
/// # Safety
/// `buf` points to `n` readable bytes or is null.
unsafe fn bytes<'a>(buf: *const c_void, n: size_t) -> &'a [u8] {
    if buf.is_null() {
        return &[];
    }
    // SAFETY: as the caller's contract.
    unsafe { std::slice::from_raw_parts(buf as *const u8, n) }
}

#[no_mangle]
pub unsafe extern "C" fn bind(
    fd: c_int,
    addr: *const libc::sockaddr,
    len: libc::socklen_t,
) -> c_int {
    if netlink::is_ours(fd) {
        // SAFETY: the caller's address of `len` bytes.
        return unsafe { netlink::bind(fd, addr, len) };
    }
    // SAFETY: libc's bind with the caller's arguments.
    unsafe {
        real!(c"bind": fn(c_int, *const libc::sockaddr, libc::socklen_t) -> c_int)(fd, addr, len)
    }
}

#[no_mangle]
pub unsafe extern "C" fn getsockname(
    fd: c_int,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) -> c_int {
    if netlink::is_ours(fd) {
        // SAFETY: the caller's arguments, as getsockname takes them.
        return unsafe { netlink::getsockname(fd, addr, len) };
    }
    // SAFETY: libc's getsockname with the caller's arguments.
    unsafe {
        real!(c"getsockname": fn(c_int, *mut libc::sockaddr, *mut libc::socklen_t) -> c_int)(
            fd, addr, len,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: libc::socklen_t,
) -> c_int {
    if level == libc::SOL_NETLINK && netlink::is_ours(fd) {
        // extended ACKs, strict checking, capped ACKs: the answers are what they are
        return 0;
    }
    // SAFETY: libc's setsockopt with the caller's arguments.
    unsafe {
        real!(c"setsockopt": fn(c_int, c_int, c_int, *const c_void, libc::socklen_t) -> c_int)(
            fd, level, name, val, len,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    if netlink::is_ours(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        return netlink::request(fd, unsafe { bytes(buf, n) });
    }
    // SAFETY: libc's send with the caller's arguments.
    unsafe { real!(c"send": fn(c_int, *const c_void, size_t, c_int) -> ssize_t)(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const libc::sockaddr,
    len: libc::socklen_t,
) -> ssize_t {
    if netlink::is_ours(fd) {
        // SAFETY: the caller's buffer of `n` bytes (the address is the kernel's, whatever it
        // says).
        return netlink::request(fd, unsafe { bytes(buf, n) });
    }
    // SAFETY: libc's sendto with the caller's arguments.
    unsafe {
        real!(c"sendto": fn(c_int, *const c_void, size_t, c_int, *const libc::sockaddr, libc::socklen_t) -> ssize_t)(
            fd, buf, n, flags, addr, len,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> ssize_t {
    if netlink::is_ours(fd) && !msg.is_null() {
        let mut req = Vec::new();
        // SAFETY: the caller's msghdr names `msg_iovlen` live iovecs of readable bytes.
        unsafe {
            let m = &*msg;
            if !m.msg_iov.is_null() {
                for v in std::slice::from_raw_parts(m.msg_iov, m.msg_iovlen) {
                    req.extend_from_slice(bytes(v.iov_base, v.iov_len));
                }
            }
        }
        return netlink::request(fd, &req);
    }
    // SAFETY: libc's sendmsg with the caller's arguments.
    unsafe { real!(c"sendmsg": fn(c_int, *const libc::msghdr, c_int) -> ssize_t)(fd, msg, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> ssize_t {
    // SAFETY: libc's recvmsg; `msg` is the caller's (with its name cleared around the call for
    // an emulated netlink socket, and restored before returning).
    unsafe {
        let real = real!(c"recvmsg": fn(c_int, *mut libc::msghdr, c_int) -> ssize_t);
        if !netlink::is_ours(fd) || msg.is_null() {
            return real(fd, msg, flags);
        }
        let (name, room) = ((*msg).msg_name, (*msg).msg_namelen);
        (*msg).msg_name = std::ptr::null_mut();
        (*msg).msg_namelen = 0;
        let r = real(fd, msg, flags);
        (*msg).msg_name = name;
        (*msg).msg_namelen = room;
        if r >= 0 && !name.is_null() {
            netlink::kernel_addr(name as *mut libc::sockaddr, &mut (*msg).msg_namelen);
        }
        r
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) -> ssize_t {
    if netlink::is_ours(fd) {
        // SAFETY: libc's recv with the caller's buffer; then the kernel's address into the
        // caller's.
        unsafe {
            let r =
                real!(c"recv": fn(c_int, *mut c_void, size_t, c_int) -> ssize_t)(fd, buf, n, flags);
            if r >= 0 {
                netlink::kernel_addr(addr, len);
            }
            return r;
        }
    }
    // SAFETY: libc's recvfrom with the caller's arguments.
    unsafe {
        real!(c"recvfrom": fn(c_int, *mut c_void, size_t, c_int, *mut libc::sockaddr, *mut libc::socklen_t) -> ssize_t)(
            fd, buf, n, flags, addr, len,
        )
    }
}
