//! `dup`, `dup2`, `dup3` and `fcntl(F_DUPFD / F_DUPFD_CLOEXEC)` (and `fcntl64`) of the
//! emulation's files: libc makes the new fd (a copy of the eventfd that holds the number), and
//! [`uverbs::Emulation::duplicated`] enters it as the same open file (the same context, the
//! same completion channel or async event queue), as the kernel's dup gives; the file lives
//! until its last fd is closed. `ibv_import_device` on `os.dup(ctx.cmd_fd)` needs this: its
//! `fstat` must see the device file. Every other fd, and every other `fcntl` command, goes to
//! libc untouched.

use crate::{guard, next};
use libc::c_int;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
use libc::c_long;
use std::sync::atomic::AtomicUsize;
use uverbs::{emulation, is_ours};

/// Tells the emulation that libc made `new` a copy of `old` (when either is ours).
fn duplicated(old: c_int, new: c_int) {
    if new < 0 || !(is_ours(old) || is_ours(new)) {
        return;
    }
    if let Some(emu) = emulation() {
        let done =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| emu.duplicated(old, new)));
        if done.is_err() {
            uverbs::complain(format_args!(
                "internal error (panic) following dup of fd {old}"
            ));
        }
    }
}

/// Whether `new` may become a copy of another fd (dup2, dup3); sets errno when not.
fn may_replace(new: c_int) -> bool {
    if !is_ours(new) {
        return true;
    }
    match emulation() {
        Some(emu) => guard(false, || emu.may_replace(new).map(|()| true)),
        None => true,
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: libc's dup with the caller's fd.
    let new = unsafe { real!(c"dup": fn(c_int) -> c_int)(fd) };
    duplicated(fd, new);
    new
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    if old != new && !may_replace(new) {
        return -1;
    }
    // SAFETY: libc's dup2 with the caller's fds.
    let r = unsafe { real!(c"dup2": fn(c_int, c_int) -> c_int)(old, new) };
    duplicated(old, r);
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    if old != new && !may_replace(new) {
        return -1;
    }
    // SAFETY: libc's dup3 with the caller's arguments.
    let r = unsafe { real!(c"dup3": fn(c_int, c_int, c_int) -> c_int)(old, new, flags) };
    duplicated(old, r);
    r
}

/// libc's `fcntl` or `fcntl64` (`slot`, `name`) with the caller's arguments, then the
/// emulation told of a copy F_DUPFD / F_DUPFD_CLOEXEC made.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
unsafe fn fcntl_hook(
    slot: &AtomicUsize,
    name: &std::ffi::CStr,
    fd: c_int,
    cmd: c_int,
    arg: c_long,
) -> c_int {
    let p = next(slot, name);
    // SAFETY: `p` is libc's definition of `name`, `int (int, int, ...)`; it is called as the C
    // variadic function it is. `arg` carries the caller's third argument unchanged: an
    // integer, or a pointer passed in the same register (or nothing the command reads).
    let r = unsafe {
        let real =
            std::mem::transmute::<usize, unsafe extern "C" fn(c_int, c_int, ...) -> c_int>(p);
        real(fd, cmd, arg)
    };
    if cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC {
        duplicated(fd, r);
    }
    r
}

// SAFETY (of the signature): `fcntl` is variadic in C (`int fcntl(int, int, ...)`). On x86_64
// (System V) and aarch64 Linux (AAPCS64; unlike Apple's, variadic arguments go where fixed
// ones would) a variadic integer or pointer argument is passed in the same register as the
// same fixed argument, so this three-argument definition reads the caller's third argument
// (an `int`, a `long` or a pointer, all one general register) correctly; a command without
// one leaves a value nobody reads. Other targets get no `fcntl` hook.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_long) -> c_int {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    // SAFETY: forwards the caller's arguments to libc's fcntl.
    unsafe { fcntl_hook(&SLOT, c"fcntl", fd, cmd, arg) }
}

/// `fcntl64` (glibc 2.28 and later export it; `fcntl` is it on 64-bit targets): as `fcntl`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_long) -> c_int {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    // SAFETY: forwards the caller's arguments to libc's fcntl64.
    unsafe { fcntl_hook(&SLOT, c"fcntl64", fd, cmd, arg) }
}
