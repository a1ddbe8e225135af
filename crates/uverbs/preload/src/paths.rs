//! The hooks that show the emulated devices under their absolute paths (`/sys/class/infiniband…`,
//! `/dev/infiniband`; the mapping is [`uverbs::paths`]): every libc call a library uses to find
//! them (access, the stat family, realpath, fopen, opendir, scandir, readlink, glibc's fortified
//! and legacy `__xstat` entries), and `syscall(SYS_mmap, …)` on a device file.
//!
//! Each hook first tests two bytes of the path (`/s…`, `/d…`); every other path goes to libc
//! without a length count or a copy. A rewritten path is built on the stack.

use crate::{guard, next, open_any, set_errno};
use libc::{c_char, c_int, c_long, c_uint, size_t, ssize_t};
use std::ffi::CStr;
use std::sync::atomic::AtomicUsize;
use uverbs::paths::{self, Rewrite};
use uverbs::Errno;

/// Longest path the kernel takes (with its NUL).
const PATH_MAX: usize = libc::PATH_MAX as usize;

/// Where a path goes.
pub(crate) enum Route<'a> {
    /// libc, with this path (the caller's, or its rewrite on the stack).
    Forward(*const c_char),
    /// An emulated device node (`/dev/infiniband/uverbsN` of a device this process has).
    Device(&'a [u8]),
    /// A rewrite that does not fit: ENAMETOOLONG.
    TooLong,
}

/// Routes `path`; `buf` receives a rewritten path.
///
/// # Safety
/// `path` is null or a NUL-terminated string.
pub(crate) unsafe fn route<'a>(path: *const c_char, buf: &mut [u8; PATH_MAX]) -> Route<'a> {
    if path.is_null() {
        return Route::Forward(path);
    }
    // SAFETY: a NUL-terminated string has at least its NUL; the second byte is read only when
    // the first is not the NUL.
    let (a, b) = unsafe {
        let a = *path as u8;
        (a, if a == 0 { 0 } else { *path.add(1) as u8 })
    };
    if !paths::maybe_ours(a, b) {
        return Route::Forward(path);
    }
    // SAFETY: the caller's NUL-terminated path.
    let p: &'a [u8] = unsafe { CStr::from_ptr(path) }.to_bytes();
    if p.starts_with(b"/dev/infiniband/uverbs") && is_device(p) {
        return Route::Device(p);
    }
    let Some(rw) = paths::rewriter() else {
        return Route::Forward(path);
    };
    match paths::rewrite(p, &rw.root, buf) {
        Rewrite::Untouched => Route::Forward(path),
        Rewrite::Mapped(_) => Route::Forward(buf.as_ptr() as *const c_char),
        Rewrite::TooLong => Route::TooLong,
    }
}

/// Whether `p` is the device node of an emulated device.
fn is_device(p: &[u8]) -> bool {
    std::panic::catch_unwind(|| {
        uverbs::emulation().is_some_and(|e| e.devices().by_cdev(p).is_some())
    })
    .unwrap_or(false)
}

/// Runs `f` on the path libc should see: the caller's or its rewrite (device nodes too: callers
/// that handle them do so before). ENAMETOOLONG gives `fail`.
///
/// # Safety
/// `path` is null or a NUL-terminated string.
pub(crate) unsafe fn with_path<R>(
    path: *const c_char,
    fail: R,
    f: impl FnOnce(*const c_char) -> R,
) -> R {
    let mut buf = [0u8; PATH_MAX];
    // SAFETY: the caller's path.
    match unsafe { route(path, &mut buf) } {
        Route::Forward(p) => f(p),
        Route::Device(_) => f(path),
        Route::TooLong => {
            set_errno(Errno(libc::ENAMETOOLONG));
            fail
        }
    }
}

/// The device node's `stat` (a character device, 0666).
fn device_stat(p: &[u8]) -> Option<libc::stat> {
    std::panic::catch_unwind(|| uverbs::emulation()?.stat(p))
        .ok()
        .flatten()
}

/// Writes the device node's `stat` to `out` (EFAULT for a null `out`).
///
/// # Safety
/// `out` is null or points to a `struct stat`.
unsafe fn put_stat(p: &[u8], out: *mut libc::stat) -> c_int {
    let Some(st) = device_stat(p) else {
        set_errno(Errno::ENOENT);
        return -1;
    };
    if out.is_null() {
        set_errno(Errno::EFAULT);
        return -1;
    }
    // SAFETY: the caller's `struct stat`.
    unsafe { out.write(st) };
    0
}

/// `access` of a device node: read and write for everyone, not executable.
fn device_access(mode: c_int) -> c_int {
    if mode & libc::X_OK != 0 {
        set_errno(Errno(libc::EACCES));
        return -1;
    }
    0
}

/// A path-taking call: the device node's answer, or libc's on the (rewritten) path.
///
/// # Safety
/// `path` is null or a NUL-terminated string.
unsafe fn path_call<R>(
    path: *const c_char,
    fail: R,
    device: impl FnOnce(&[u8]) -> R,
    forward: impl FnOnce(*const c_char) -> R,
) -> R {
    let mut buf = [0u8; PATH_MAX];
    // SAFETY: the caller's path.
    match unsafe { route(path, &mut buf) } {
        Route::Forward(p) => forward(p),
        Route::Device(p) => device(p),
        Route::TooLong => {
            set_errno(Errno(libc::ENAMETOOLONG));
            fail
        }
    }
}

// ---- access ----

#[no_mangle]
pub unsafe extern "C" fn access(path: *const c_char, mode: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        path_call(
            path,
            -1,
            |_| device_access(mode),
            |p| real!(c"access": fn(*const c_char, c_int) -> c_int)(p, mode),
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn euidaccess(path: *const c_char, mode: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        path_call(
            path,
            -1,
            |_| device_access(mode),
            |p| real!(c"euidaccess": fn(*const c_char, c_int) -> c_int)(p, mode),
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn eaccess(path: *const c_char, mode: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        path_call(
            path,
            -1,
            |_| device_access(mode),
            |p| real!(c"eaccess": fn(*const c_char, c_int) -> c_int)(p, mode),
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn faccessat(
    dirfd: c_int,
    path: *const c_char,
    mode: c_int,
    flags: c_int,
) -> c_int {
    // SAFETY: forwards the caller's arguments (our paths are absolute, so dirfd is moot).
    unsafe {
        path_call(
            path,
            -1,
            |_| device_access(mode),
            |p| {
                real!(c"faccessat": fn(c_int, *const c_char, c_int, c_int) -> c_int)(
                    dirfd, p, mode, flags,
                )
            },
        )
    }
}

// ---- the stat family (stat and stat64 are in lib.rs) ----

#[no_mangle]
pub unsafe extern "C" fn lstat(path: *const c_char, out: *mut libc::stat) -> c_int {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        path_call(
            path,
            -1,
            |d| put_stat(d, out),
            |p| real!(c"lstat": fn(*const c_char, *mut libc::stat) -> c_int)(p, out),
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn lstat64(path: *const c_char, out: *mut libc::stat) -> c_int {
    // SAFETY: forwards the caller's arguments (`stat64` is `stat` on 64-bit Linux).
    unsafe {
        path_call(
            path,
            -1,
            |d| put_stat(d, out),
            |p| real!(c"lstat64": fn(*const c_char, *mut libc::stat) -> c_int)(p, out),
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn fstatat(
    dirfd: c_int,
    path: *const c_char,
    out: *mut libc::stat,
    flags: c_int,
) -> c_int {
    // SAFETY: forwards the caller's arguments (our paths are absolute, so dirfd is moot).
    unsafe {
        path_call(
            path,
            -1,
            |d| put_stat(d, out),
            |p| {
                real!(c"fstatat": fn(c_int, *const c_char, *mut libc::stat, c_int) -> c_int)(
                    dirfd, p, out, flags,
                )
            },
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn fstatat64(
    dirfd: c_int,
    path: *const c_char,
    out: *mut libc::stat,
    flags: c_int,
) -> c_int {
    // SAFETY: forwards the caller's arguments (our paths are absolute, so dirfd is moot).
    unsafe {
        path_call(
            path,
            -1,
            |d| put_stat(d, out),
            |p| {
                real!(c"fstatat64": fn(c_int, *const c_char, *mut libc::stat, c_int) -> c_int)(
                    dirfd, p, out, flags,
                )
            },
        )
    }
}

/// The device node's `statx`.
///
/// # Safety
/// `out` is null or points to a `struct statx`.
unsafe fn put_statx(p: &[u8], out: *mut libc::statx) -> c_int {
    let Some(st) = device_stat(p) else {
        set_errno(Errno::ENOENT);
        return -1;
    };
    if out.is_null() {
        set_errno(Errno::EFAULT);
        return -1;
    }
    // SAFETY: `statx` is plain old data; all-zero is a valid value.
    let mut x: libc::statx = unsafe { std::mem::zeroed() };
    x.stx_mask = libc::STATX_BASIC_STATS;
    x.stx_blksize = st.st_blksize as u32;
    x.stx_nlink = st.st_nlink as u32;
    x.stx_mode = st.st_mode as u16;
    x.stx_rdev_major = libc::major(st.st_rdev);
    x.stx_rdev_minor = libc::minor(st.st_rdev);
    // SAFETY: the caller's `struct statx`.
    unsafe { out.write(x) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn statx(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mask: c_uint,
    out: *mut libc::statx,
) -> c_int {
    // SAFETY: forwards the caller's arguments (our paths are absolute, so dirfd is moot).
    unsafe {
        path_call(
            path,
            -1,
            |d| put_statx(d, out),
            |p| {
                real!(c"statx": fn(c_int, *const c_char, c_int, c_uint, *mut libc::statx) -> c_int)(
                    dirfd, p, flags, mask, out,
                )
            },
        )
    }
}

// glibc's legacy entries (`__xstat(ver, path, buf)`, ...): glibc 2.36 still exports them as
// default versions, and programs built against glibc before 2.33 call them instead of `stat`.

#[no_mangle]
pub unsafe extern "C" fn __xstat(ver: c_int, path: *const c_char, out: *mut libc::stat) -> c_int {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        path_call(
            path,
            -1,
            |d| put_stat(d, out),
            |p| real!(c"__xstat": fn(c_int, *const c_char, *mut libc::stat) -> c_int)(ver, p, out),
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn __xstat64(ver: c_int, path: *const c_char, out: *mut libc::stat) -> c_int {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        path_call(
            path,
            -1,
            |d| put_stat(d, out),
            |p| {
                real!(c"__xstat64": fn(c_int, *const c_char, *mut libc::stat) -> c_int)(ver, p, out)
            },
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn __lxstat(ver: c_int, path: *const c_char, out: *mut libc::stat) -> c_int {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        path_call(
            path,
            -1,
            |d| put_stat(d, out),
            |p| real!(c"__lxstat": fn(c_int, *const c_char, *mut libc::stat) -> c_int)(ver, p, out),
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn __lxstat64(
    ver: c_int,
    path: *const c_char,
    out: *mut libc::stat,
) -> c_int {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        path_call(
            path,
            -1,
            |d| put_stat(d, out),
            |p| {
                real!(c"__lxstat64": fn(c_int, *const c_char, *mut libc::stat) -> c_int)(
                    ver, p, out,
                )
            },
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn __fxstatat(
    ver: c_int,
    dirfd: c_int,
    path: *const c_char,
    out: *mut libc::stat,
    flags: c_int,
) -> c_int {
    // SAFETY: forwards the caller's arguments (our paths are absolute, so dirfd is moot).
    unsafe {
        path_call(
            path,
            -1,
            |d| put_stat(d, out),
            |p| {
                real!(c"__fxstatat": fn(c_int, c_int, *const c_char, *mut libc::stat, c_int) -> c_int)(
                    ver, dirfd, p, out, flags,
                )
            },
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn __fxstatat64(
    ver: c_int,
    dirfd: c_int,
    path: *const c_char,
    out: *mut libc::stat,
    flags: c_int,
) -> c_int {
    // SAFETY: forwards the caller's arguments (our paths are absolute, so dirfd is moot).
    unsafe {
        path_call(
            path,
            -1,
            |d| put_stat(d, out),
            |p| {
                real!(c"__fxstatat64": fn(c_int, c_int, *const c_char, *mut libc::stat, c_int) -> c_int)(
                    ver, dirfd, p, out, flags,
                )
            },
        )
    }
}

// ---- fortified open (`_FORTIFY_SOURCE` builds call these when the flags are not constant) ----

#[no_mangle]
pub unsafe extern "C" fn __open_2(path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments to the emulation or to libc.
    unsafe {
        open_any(path, flags, |p| {
            real!(c"__open_2": fn(*const c_char, c_int) -> c_int)(p, flags)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn __open64_2(path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments to the emulation or to libc.
    unsafe {
        open_any(path, flags, |p| {
            real!(c"__open64_2": fn(*const c_char, c_int) -> c_int)(p, flags)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn __openat_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments (device paths are absolute, so dirfd is moot).
    unsafe {
        open_any(path, flags, |p| {
            real!(c"__openat_2": fn(c_int, *const c_char, c_int) -> c_int)(dirfd, p, flags)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn __openat64_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: forwards the caller's arguments (device paths are absolute, so dirfd is moot).
    unsafe {
        open_any(path, flags, |p| {
            real!(c"__openat64_2": fn(c_int, *const c_char, c_int) -> c_int)(dirfd, p, flags)
        })
    }
}

// ---- stdio and folders (glibc's own fopen and opendir open without the `open` symbol) ----

#[no_mangle]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut libc::FILE {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        with_path(path, std::ptr::null_mut(), |p| {
            real!(c"fopen": fn(*const c_char, *const c_char) -> *mut libc::FILE)(p, mode)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut libc::FILE {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        with_path(path, std::ptr::null_mut(), |p| {
            real!(c"fopen64": fn(*const c_char, *const c_char) -> *mut libc::FILE)(p, mode)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn opendir(path: *const c_char) -> *mut libc::DIR {
    // SAFETY: forwards the caller's argument (the path rewritten when it is one of ours).
    unsafe {
        with_path(path, std::ptr::null_mut(), |p| {
            real!(c"opendir": fn(*const c_char) -> *mut libc::DIR)(p)
        })
    }
}

/// `cd /sys/class/infiniband` (ibstatus does it) lands in the emulated tree.
#[no_mangle]
pub unsafe extern "C" fn chdir(path: *const c_char) -> c_int {
    // SAFETY: forwards the caller's argument (the path rewritten when it is one of ours).
    unsafe { with_path(path, -1, |p| real!(c"chdir": fn(*const c_char) -> c_int)(p)) }
}

type Filter = Option<unsafe extern "C" fn(*const libc::dirent) -> c_int>;
type Compare =
    Option<unsafe extern "C" fn(*mut *const libc::dirent, *mut *const libc::dirent) -> c_int>;

#[no_mangle]
pub unsafe extern "C" fn scandir(
    path: *const c_char,
    list: *mut *mut *mut libc::dirent,
    filter: Filter,
    compare: Compare,
) -> c_int {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        with_path(path, -1, |p| {
            real!(c"scandir": fn(*const c_char, *mut *mut *mut libc::dirent, Filter, Compare) -> c_int)(
                p, list, filter, compare,
            )
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn scandir64(
    path: *const c_char,
    list: *mut *mut *mut libc::dirent,
    filter: Filter,
    compare: Compare,
) -> c_int {
    // SAFETY: forwards the caller's arguments (`dirent64` is `dirent` on 64-bit Linux).
    unsafe {
        with_path(path, -1, |p| {
            real!(c"scandir64": fn(*const c_char, *mut *mut *mut libc::dirent, Filter, Compare) -> c_int)(
                p, list, filter, compare,
            )
        })
    }
}

// ---- links ----

#[no_mangle]
pub unsafe extern "C" fn readlink(path: *const c_char, buf: *mut c_char, n: size_t) -> ssize_t {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours; the
    // tree's links are relative, so their text needs no mapping).
    unsafe {
        with_path(path, -1, |p| {
            real!(c"readlink": fn(*const c_char, *mut c_char, size_t) -> ssize_t)(p, buf, n)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn readlinkat(
    dirfd: c_int,
    path: *const c_char,
    buf: *mut c_char,
    n: size_t,
) -> ssize_t {
    // SAFETY: forwards the caller's arguments (our paths are absolute, so dirfd is moot).
    unsafe {
        with_path(path, -1, |p| {
            real!(c"readlinkat": fn(c_int, *const c_char, *mut c_char, size_t) -> ssize_t)(
                dirfd, p, buf, n,
            )
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn __readlink_chk(
    path: *const c_char,
    buf: *mut c_char,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        with_path(path, -1, |p| {
            real!(c"__readlink_chk": fn(*const c_char, *mut c_char, size_t, size_t) -> ssize_t)(
                p, buf, n, buflen,
            )
        })
    }
}

// ---- realpath ----

/// libc's answer for a rewritten path, mapped back to the absolute path it stands for
/// (`<tree>/devices/…` is `/sys/devices/…`). `resolve(p, out)` is libc's realpath writing
/// into `out` (PATH_MAX bytes); the answer goes to `resolved`, or to new `malloc` memory when
/// `resolved` is null, as realpath does.
///
/// # Safety
/// `path` is null or a NUL-terminated string; `resolved` is null or has PATH_MAX bytes.
unsafe fn realpath_any(
    path: *const c_char,
    resolved: *mut c_char,
    resolve: impl Fn(*const c_char, *mut c_char) -> *mut c_char,
) -> *mut c_char {
    let mut buf = [0u8; PATH_MAX];
    // SAFETY: the caller's path.
    let p = match unsafe { route(path, &mut buf) } {
        Route::Forward(p) if p == path => return resolve(path, resolved),
        Route::Forward(p) => p,
        // the device node's path as the caller wrote it: the tree has a plain file there
        Route::Device(_) => match unsafe { route_tree(path, &mut buf) } {
            Some(p) => p,
            None => return resolve(path, resolved),
        },
        Route::TooLong => {
            set_errno(Errno(libc::ENAMETOOLONG));
            return std::ptr::null_mut();
        }
    };
    let mut out = [0u8; PATH_MAX];
    if resolve(p, out.as_mut_ptr() as *mut c_char).is_null() {
        return std::ptr::null_mut();
    }
    guard(std::ptr::null_mut(), || {
        // SAFETY: libc's realpath wrote a NUL-terminated path into `out`.
        let got = unsafe { CStr::from_ptr(out.as_ptr() as *const c_char) }.to_bytes();
        let rw = paths::rewriter().ok_or(Errno::ENOENT)?;
        let mapped = paths::unmap(got, &rw.canon_root).unwrap_or_else(|| got.to_vec());
        if mapped.len() + 1 > PATH_MAX {
            return Err(Errno(libc::ENAMETOOLONG));
        }
        let dst = if resolved.is_null() {
            // SAFETY: plain allocation; the caller frees it, as realpath's.
            let m = unsafe { libc::malloc(mapped.len() + 1) } as *mut c_char;
            if m.is_null() {
                return Err(Errno(libc::ENOMEM));
            }
            m
        } else {
            resolved
        };
        // SAFETY: `dst` has room for the path and its NUL (PATH_MAX, or just allocated).
        unsafe {
            std::ptr::copy_nonoverlapping(mapped.as_ptr(), dst as *mut u8, mapped.len());
            *dst.add(mapped.len()) = 0;
        }
        Ok(dst)
    })
}

/// A device node's path rewritten into the tree (ignoring that it is a device).
///
/// # Safety
/// `path` is a NUL-terminated string.
unsafe fn route_tree(path: *const c_char, buf: &mut [u8; PATH_MAX]) -> Option<*const c_char> {
    // SAFETY: the caller's NUL-terminated path.
    let p = unsafe { CStr::from_ptr(path) }.to_bytes();
    let rw = paths::rewriter()?;
    match paths::rewrite(p, &rw.root, buf) {
        Rewrite::Mapped(_) => Some(buf.as_ptr() as *const c_char),
        _ => None,
    }
}

#[no_mangle]
pub unsafe extern "C" fn realpath(path: *const c_char, resolved: *mut c_char) -> *mut c_char {
    // SAFETY: libc's realpath with the caller's arguments, or a rewritten path and a buffer of
    // PATH_MAX bytes.
    unsafe {
        realpath_any(path, resolved, |p, out| {
            real!(c"realpath": fn(*const c_char, *mut c_char) -> *mut c_char)(p, out)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn __realpath_chk(
    path: *const c_char,
    resolved: *mut c_char,
    resolvedlen: size_t,
) -> *mut c_char {
    if !resolved.is_null() && resolvedlen < PATH_MAX {
        // as glibc: a buffer smaller than PATH_MAX is a fortify failure; let libc say so
        // SAFETY: libc's __realpath_chk with the caller's arguments.
        return unsafe {
            real!(c"__realpath_chk": fn(*const c_char, *mut c_char, size_t) -> *mut c_char)(
                path,
                resolved,
                resolvedlen,
            )
        };
    }
    // SAFETY: as `realpath` (the caller's buffer has PATH_MAX bytes, checked above).
    unsafe {
        realpath_any(path, resolved, |p, out| {
            real!(c"realpath": fn(*const c_char, *mut c_char) -> *mut c_char)(p, out)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn canonicalize_file_name(path: *const c_char) -> *mut c_char {
    // SAFETY: realpath with a null buffer is canonicalize_file_name.
    unsafe { realpath(path, std::ptr::null_mut()) }
}

// ---- syscall(SYS_mmap, …) ----

/// libc's `syscall`, called with all seven values (as a variadic function).
fn real_syscall() -> unsafe extern "C" fn(c_long, ...) -> c_long {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    let p = next(&SLOT, c"syscall");
    // SAFETY: `p` is libc's `syscall`, `long syscall(long number, ...)`.
    unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(c_long, ...) -> c_long>(p) }
}

/// `syscall(number, …)`: `SYS_mmap` of an emulated device file is the emulation's mmap (as the
/// `mmap` hook); every other call goes to libc's `syscall` with the seven values untouched.
///
/// # Safety
/// `syscall` is variadic in C. On x86_64 and aarch64 Linux the integer arguments of a variadic
/// call are passed exactly as those of a fixed function with the same integer parameters (the
/// first six in registers rdi..r9 / x0..x5, the seventh on the stack / in x6), so this
/// non-variadic definition reads the number and up to six values a caller passed. Values a
/// caller did not pass are whatever the registers or the caller's stack slot hold: they are
/// only forwarded (libc's own `syscall` reads the same seven), never used for anything but
/// `SYS_mmap`, whose six arguments every caller passes.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn syscall(
    n: c_long,
    a: c_long,
    b: c_long,
    c: c_long,
    d: c_long,
    e: c_long,
    f: c_long,
) -> c_long {
    if n == libc::SYS_mmap && uverbs::is_ours(e as c_int) {
        if let Some(emu) = uverbs::emulation() {
            let r = guard(libc::MAP_FAILED, || {
                emu.mmap(
                    e as c_int, a as usize, b as usize, c as c_int, d as c_int, f,
                )
            });
            // the wrapper's convention: -1 and errno on failure (MAP_FAILED is -1)
            return r as c_long;
        }
    }
    // SAFETY: libc's syscall with the caller's seven values.
    unsafe { real_syscall()(n, a, b, c, d, e, f) }
}

// ---- extended attributes (`ls -l` asks for ACLs of every name it lists) ----

#[no_mangle]
pub unsafe extern "C" fn getxattr(
    path: *const c_char,
    name: *const c_char,
    value: *mut libc::c_void,
    size: size_t,
) -> ssize_t {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        with_path(path, -1, |p| {
            real!(c"getxattr": fn(*const c_char, *const c_char, *mut libc::c_void, size_t) -> ssize_t)(
                p, name, value, size,
            )
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn lgetxattr(
    path: *const c_char,
    name: *const c_char,
    value: *mut libc::c_void,
    size: size_t,
) -> ssize_t {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        with_path(path, -1, |p| {
            real!(c"lgetxattr": fn(*const c_char, *const c_char, *mut libc::c_void, size_t) -> ssize_t)(
                p, name, value, size,
            )
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn listxattr(
    path: *const c_char,
    list: *mut c_char,
    size: size_t,
) -> ssize_t {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        with_path(path, -1, |p| {
            real!(c"listxattr": fn(*const c_char, *mut c_char, size_t) -> ssize_t)(p, list, size)
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn llistxattr(
    path: *const c_char,
    list: *mut c_char,
    size: size_t,
) -> ssize_t {
    // SAFETY: forwards the caller's arguments (the path rewritten when it is one of ours).
    unsafe {
        with_path(path, -1, |p| {
            real!(c"llistxattr": fn(*const c_char, *mut c_char, size_t) -> ssize_t)(p, list, size)
        })
    }
}
