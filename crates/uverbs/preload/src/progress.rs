//! Progress without a spare core. A program that busy-polls its completion queue on every core
//! it has leaves the emulated device's threads (engine, wire I/O) no time to run: on a 2-core
//! machine two such processes wait a scheduler time slice (milliseconds) for every message. So
//! the completion polls libmlx5 installs in a context of an emulated device are wrapped: a poll
//! that finds nothing gives the devices a turn on the polling thread
//! ([`uverbs::Emulation::progress`]: doorbells, WQEs, received datagrams) and polls again, or,
//! when there was nothing to do, yields the core so that the device's threads and the peer
//! can run.
//!
//! Wrapped: `ibv_context_ops.poll_cq` (what `ibv_poll_cq` calls) of every context
//! `ibv_open_device` returns for an emulated device, and `start_poll` of every extended CQ its
//! `create_cq_ex` makes (`ibv_start_poll`). Direct CQ access (mlx5dv) is not seen.
//!
//! The provider picks one of a few poll functions per context or per CQ (CQE version, locking,
//! ...), so each distinct original gets a slot and a wrapper of its own (no lookup per poll).

use libc::c_int;
use rdma_core_sys as sys;
use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};

type PollCq = unsafe extern "C" fn(*mut sys::ibv_cq, c_int, *mut sys::ibv_wc) -> c_int;
type StartPoll = unsafe extern "C" fn(*mut sys::ibv_cq_ex, *mut sys::ibv_poll_cq_attr) -> c_int;
type CreateCqEx = unsafe extern "C" fn(
    *mut sys::ibv_context,
    *mut sys::ibv_cq_init_attr_ex,
) -> *mut sys::ibv_cq_ex;
type OpenDevice = unsafe extern "C" fn(*mut sys::ibv_device) -> *mut sys::ibv_context;

/// `__VERBS_ABI_IS_EXTENDED`: the context is embedded in a `struct verbs_context`.
const ABI_IS_EXTENDED: usize = usize::MAX;

/// The slot of `f` in `table`: the one that holds it, else a free one claimed for it.
fn slot(table: &[AtomicUsize], f: usize) -> Option<usize> {
    for (k, s) in table.iter().enumerate() {
        match s.compare_exchange(0, f, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(k),
            Err(v) if v == f => return Some(k),
            Err(_) => {}
        }
    }
    None
}

/// After a poll found nothing: a turn of the devices, else the core given away. Returns
/// whether the devices did anything (so that polling again may find a completion).
fn idle_turn() -> bool {
    let worked = std::panic::catch_unwind(|| uverbs::emulation().is_some_and(|e| e.progress()))
        .unwrap_or(false);
    if !worked {
        // SAFETY: sched_yield takes no arguments and touches no memory.
        unsafe { libc::sched_yield() };
    }
    worked
}

const POLL_SLOTS: usize = 4;
static POLL_CQ: [AtomicUsize; POLL_SLOTS] = [const { AtomicUsize::new(0) }; POLL_SLOTS];
const POLL_WRAPPERS: [PollCq; POLL_SLOTS] =
    [poll_cq::<0>, poll_cq::<1>, poll_cq::<2>, poll_cq::<3>];

unsafe extern "C" fn poll_cq<const K: usize>(
    cq: *mut sys::ibv_cq,
    n: c_int,
    wc: *mut sys::ibv_wc,
) -> c_int {
    // SAFETY: slot K was filled with the provider's poll_cq before this wrapper was installed
    // (a function of that type), and the arguments are the caller's, passed on unchanged.
    unsafe {
        let f = std::mem::transmute::<usize, PollCq>(POLL_CQ[K].load(Ordering::Acquire));
        let r = f(cq, n, wc);
        if r != 0 || !idle_turn() {
            return r;
        }
        f(cq, n, wc)
    }
}

const START_SLOTS: usize = 16;
static START_POLL: [AtomicUsize; START_SLOTS] = [const { AtomicUsize::new(0) }; START_SLOTS];
const START_WRAPPERS: [StartPoll; START_SLOTS] = [
    start_poll::<0>,
    start_poll::<1>,
    start_poll::<2>,
    start_poll::<3>,
    start_poll::<4>,
    start_poll::<5>,
    start_poll::<6>,
    start_poll::<7>,
    start_poll::<8>,
    start_poll::<9>,
    start_poll::<10>,
    start_poll::<11>,
    start_poll::<12>,
    start_poll::<13>,
    start_poll::<14>,
    start_poll::<15>,
];

unsafe extern "C" fn start_poll<const K: usize>(
    cq: *mut sys::ibv_cq_ex,
    attr: *mut sys::ibv_poll_cq_attr,
) -> c_int {
    // SAFETY: slot K holds the provider's start_poll of this CQ (filled before the wrapper
    // was installed); an empty CQ answers ENOENT and holds no lock then, so asking again is
    // what the caller would do.
    unsafe {
        let f = std::mem::transmute::<usize, StartPoll>(START_POLL[K].load(Ordering::Acquire));
        let r = f(cq, attr);
        if r != libc::ENOENT || !idle_turn() {
            return r;
        }
        f(cq, attr)
    }
}

/// The provider's `create_cq_ex` (one per provider; a second one is left unwrapped).
static CREATE_CQ_EX: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn create_cq_ex(
    ctx: *mut sys::ibv_context,
    attr: *mut sys::ibv_cq_init_attr_ex,
) -> *mut sys::ibv_cq_ex {
    // SAFETY: CREATE_CQ_EX was filled with the provider's create_cq_ex before this wrapper
    // was installed; a CQ it returns is live and not yet seen by the caller, so its
    // start_poll may be replaced.
    unsafe {
        let f = std::mem::transmute::<usize, CreateCqEx>(CREATE_CQ_EX.load(Ordering::Acquire));
        let cq = f(ctx, attr);
        if let Some(cq) = cq.as_mut() {
            if let Some(orig) = cq.start_poll {
                if let Some(k) = slot(&START_POLL, orig as usize) {
                    cq.start_poll = Some(START_WRAPPERS[k]);
                }
            }
        }
        cq
    }
}

/// Installs the wrappers in a context of an emulated device.
///
/// # Safety
/// `ctx` is a live context that `ibv_open_device` just returned, not yet used by anyone else.
unsafe fn wrap_context(ctx: &mut sys::ibv_context) {
    if let Some(orig) = ctx.ops.poll_cq {
        if !POLL_WRAPPERS.iter().any(|w| *w as usize == orig as usize) {
            if let Some(k) = slot(&POLL_CQ, orig as usize) {
                ctx.ops.poll_cq = Some(POLL_WRAPPERS[k]);
            }
        }
    }
    if ctx.abi_compat as usize != ABI_IS_EXTENDED {
        return;
    }
    let off = std::mem::offset_of!(sys::verbs_context, context);
    // SAFETY: an extended context is the last member of a `struct verbs_context` (libibverbs'
    // verbs_get_ctx); `sz` says how much of it precedes the context, so the op is read only
    // where this provider's structure has it.
    unsafe {
        let v =
            &mut *((ctx as *mut sys::ibv_context as *mut u8).sub(off) as *mut sys::verbs_context);
        if v.sz < off - std::mem::offset_of!(sys::verbs_context, create_cq_ex) {
            return;
        }
        let Some(orig) = v.create_cq_ex else {
            return;
        };
        let orig = orig as usize;
        if orig == create_cq_ex as *const () as usize {
            return;
        }
        let mine = match CREATE_CQ_EX.compare_exchange(0, orig, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(v) => v == orig,
        };
        if mine {
            v.create_cq_ex = Some(create_cq_ex);
        }
    }
}

/// libibverbs' definition of `name`: the next one after this library, else (libibverbs opened
/// privately, as Python opens extension modules) the one of the loaded `libibverbs.so.1`.
fn libibverbs(slot: &AtomicUsize, name: &CStr) -> usize {
    let p = slot.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    // SAFETY: dlsym / dlopen with NUL-terminated names; RTLD_NOLOAD only finds a library that
    // is already loaded (the caller's), and its handle is kept for the process's life.
    let p = unsafe {
        let mut p = libc::dlsym(libc::RTLD_NEXT, name.as_ptr());
        if p.is_null() {
            let h = libc::dlopen(
                c"libibverbs.so.1".as_ptr(),
                libc::RTLD_NOW | libc::RTLD_NOLOAD,
            );
            if !h.is_null() {
                p = libc::dlsym(h, name.as_ptr());
            }
        }
        p as usize
    };
    if p != 0 {
        slot.store(p, Ordering::Release);
    }
    p
}

/// `ibv_open_device`: libibverbs' own, then, for an emulated device, the poll wrappers.
#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(device: *mut sys::ibv_device) -> *mut sys::ibv_context {
    static REAL: AtomicUsize = AtomicUsize::new(0);
    let real = libibverbs(&REAL, c"ibv_open_device");
    if real == 0 {
        uverbs::complain(format_args!("ibv_open_device: libibverbs not found"));
        // SAFETY: the thread's errno location is always valid.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return std::ptr::null_mut();
    }
    // SAFETY: `real` is libibverbs' ibv_open_device, called with the caller's argument; a
    // context it returns is live and still private to this call.
    unsafe {
        let ctx = std::mem::transmute::<usize, OpenDevice>(real)(device);
        if let Some(c) = ctx.as_mut() {
            if uverbs::is_ours(c.cmd_fd) {
                wrap_context(c);
            }
        }
        ctx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_shared_by_equal_functions_and_run_out() {
        let t: [AtomicUsize; 2] = [const { AtomicUsize::new(0) }; 2];
        assert_eq!(slot(&t, 10), Some(0));
        assert_eq!(slot(&t, 20), Some(1));
        assert_eq!(slot(&t, 10), Some(0));
        assert_eq!(slot(&t, 20), Some(1));
        assert_eq!(slot(&t, 30), None);
    }
}
