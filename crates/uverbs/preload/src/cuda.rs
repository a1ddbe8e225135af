//! The CUDA driver as the emulated kernel needs to see it. A process finds the driver's entry
//! points with `dlopen("libcuda.so.1")` + `dlsym` (the CUDA runtime, static inside NVSHMEM and
//! GPUNetIO, then asks `cuGetProcAddress` for every other one), or links them directly. This
//! module defines `dlsym` (glibc's own is reached with `dlvsym`), `cuGetProcAddress` (both ABIs)
//! and the two driver calls the emulation needs, and hands the process its wrappers of those:
//!
//! - `cuMemHostRegister` with `CU_MEMHOSTREGISTER_IOMEMORY` of an emulated UAR page: a
//!   ConnectX's UAR is BAR space, which the driver maps for the GPU as I/O memory; the emulated
//!   page is shared host memory, which the driver refuses as I/O memory, so it is registered as
//!   mapped host memory instead (what the GPU gets is the same: a device address whose stores
//!   reach the device). The driver takes BAR registrations of parts of one page (a QP's
//!   doorbell register each, as NVSHMEM's IBGDA registers them); host memory it takes by whole
//!   pages, once. So the first such part registers its whole pages, a later part of pages
//!   already registered is answered here, and `cuMemHostUnregister` of a part lets the pages go
//!   with the last one ([`UarPages`]). Any other range goes to the driver untouched.
//! - `cuMemGetHandleForAddressRange` with `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`: the driver
//!   exports the range; the emulated kernel records which GPU range the dma-buf holds
//!   ([`uverbs::dmabuf::exported`]), so that a DEVX umem or a memory region on that dma-buf
//!   reaches the GPU memory, as a kernel with a ConnectX reaches it through the exporter.
//!
//! Only processes under `gpuverbs emu` load this library. A `dlsym(RTLD_NEXT, …)` goes to
//! glibc's by a tail jump (x86_64), so that glibc, which finds the caller by the return
//! address, still starts the lookup after the program's own object.

use libc::{c_char, c_int, c_uint, c_void, size_t};
use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// `CUresult`.
type CuResult = c_int;
/// `CUDA_ERROR_NOT_INITIALIZED`: what a wrapper answers when no driver is loaded to forward to.
const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
/// `CU_MEMHOSTREGISTER_DEVICEMAP`.
const DEVICEMAP: c_uint = 0x02;
/// `CU_MEMHOSTREGISTER_IOMEMORY`.
const IOMEMORY: c_uint = 0x04;
/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`.
const DMA_BUF_FD: c_int = 0x1;
/// The first CUDA version whose `cuGetProcAddress` takes the `_v2` arguments (12.0).
const GET_PROC_ADDRESS_V2_FROM: c_int = 12000;

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
type GetProcV1 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CuResult;
type GetProcV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CuResult;
type HostRegister = unsafe extern "C" fn(*mut c_void, size_t, c_uint) -> CuResult;
type HostUnregister = unsafe extern "C" fn(*mut c_void) -> CuResult;
type GetHandle = unsafe extern "C" fn(*mut c_void, u64, size_t, c_int, u64) -> CuResult;

/// glibc's `dlsym` (looked up once with `dlvsym`, which this library does not define).
fn real_dlsym() -> DlsymFn {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    let mut p = SLOT.load(Ordering::Acquire);
    if p == 0 {
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
            // SAFETY: dlvsym with RTLD_NEXT and NUL-terminated names; checked below.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) }
                as usize;
            if p != 0 {
                break;
            }
        }
        if p == 0 {
            uverbs::complain(format_args!("no glibc dlsym to forward to"));
            // SAFETY: terminating the process is always sound.
            unsafe { libc::abort() };
        }
        SLOT.store(p, Ordering::Release);
    }
    // SAFETY: glibc's dlsym, whose C signature this type states.
    unsafe { std::mem::transmute::<usize, DlsymFn>(p) }
}

/// The driver's definitions of the wrapped entry points, as the process was given them.
struct Slot {
    real: AtomicUsize,
    /// The name the driver exports it under (for a direct call made before any lookup).
    name: &'static CStr,
}

static GET_PROC_V1: Slot = Slot::new(c"cuGetProcAddress");
static GET_PROC_V2: Slot = Slot::new(c"cuGetProcAddress_v2");
static HOST_REGISTER_V1: Slot = Slot::new(c"cuMemHostRegister");
static HOST_REGISTER_V2: Slot = Slot::new(c"cuMemHostRegister_v2");
static HOST_UNREGISTER: Slot = Slot::new(c"cuMemHostUnregister");
static GET_HANDLE: Slot = Slot::new(c"cuMemGetHandleForAddressRange");

impl Slot {
    const fn new(name: &'static CStr) -> Self {
        Self {
            real: AtomicUsize::new(0),
            name,
        }
    }

    /// Records the driver's definition (never one of this library's wrappers).
    fn set(&self, p: usize) {
        if p != 0 && !is_wrapper(p) {
            self.real.store(p, Ordering::Release);
        }
    }

    /// The driver's definition: the one recorded, else the next one after this library's.
    fn get(&self) -> Option<usize> {
        let p = self.real.load(Ordering::Acquire);
        if p != 0 {
            return Some(p);
        }
        // SAFETY: RTLD_NEXT from this library (the call comes from here) and a static name.
        let p = unsafe { real_dlsym()(libc::RTLD_NEXT, self.name.as_ptr()) } as usize;
        self.set(p);
        (p != 0 && !is_wrapper(p)).then_some(p)
    }
}

/// The wrappers, by the driver name they stand for (`_v2` names: the `_v2` ABI).
fn wrapper_of(name: &[u8], v2_abi: bool) -> Option<(usize, &'static Slot)> {
    Some(match (name, v2_abi) {
        (b"cuGetProcAddress", false) => (cuGetProcAddress as *const () as usize, &GET_PROC_V1),
        (b"cuGetProcAddress", true) | (b"cuGetProcAddress_v2", _) => {
            (cuGetProcAddress_v2 as *const () as usize, &GET_PROC_V2)
        }
        (b"cuMemHostRegister", false) => {
            (cuMemHostRegister as *const () as usize, &HOST_REGISTER_V1)
        }
        (b"cuMemHostRegister", true) | (b"cuMemHostRegister_v2", _) => (
            cuMemHostRegister_v2 as *const () as usize,
            &HOST_REGISTER_V2,
        ),
        (b"cuMemHostUnregister", _) => {
            (cuMemHostUnregister as *const () as usize, &HOST_UNREGISTER)
        }
        (b"cuMemGetHandleForAddressRange", _) => (
            cuMemGetHandleForAddressRange as *const () as usize,
            &GET_HANDLE,
        ),
        _ => return None,
    })
}

fn is_wrapper(p: usize) -> bool {
    [
        cuGetProcAddress as *const () as usize,
        cuGetProcAddress_v2 as *const () as usize,
        cuMemHostRegister as *const () as usize,
        cuMemHostRegister_v2 as *const () as usize,
        cuMemHostUnregister as *const () as usize,
        cuMemGetHandleForAddressRange as *const () as usize,
    ]
    .contains(&p)
}

/// `p`, the driver's definition of `name`, or this library's wrapper of it (recording `p`).
fn wrap(name: &[u8], v2_abi: bool, p: usize) -> usize {
    match wrapper_of(name, v2_abi) {
        Some((w, slot)) if p != 0 && p != w => {
            slot.set(p);
            w
        }
        _ => p,
    }
}

/// `dlsym` for every handle but `RTLD_NEXT`: glibc's answer, or a wrapper of it.
unsafe extern "C" fn dlsym_hook(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // SAFETY: the caller's arguments, forwarded.
    let p = unsafe { real_dlsym()(handle, symbol) };
    if p.is_null() || symbol.is_null() {
        return p;
    }
    // SAFETY: dlsym's symbol is a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    if !name.starts_with(b"cu") {
        return p;
    }
    wrap(name, false, p as usize) as *mut c_void
}

/// glibc's `dlsym`'s address, for the trampoline below.
extern "C" fn glibc_dlsym() -> usize {
    real_dlsym() as usize
}

/// `dlsym`: `RTLD_NEXT` (`(void *)-1`) goes to glibc's by a tail jump, so that the caller glibc
/// finds from the return address is the program's, not this library (the lookup then starts
/// after the caller, as it must); every other handle goes to [`dlsym_hook`].
// SAFETY (naked): the body is the whole function; it keeps the System V argument registers
// (rdi, rsi) across the one call, aligns the stack for it, and leaves by a jump to a function
// of dlsym's own signature, which returns to our caller.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "cmp rdi, -1",
        "jne {hook}",
        // keep the arguments across the call (and the stack 16-byte aligned at the call)
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {addr}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "jmp rax",
        hook = sym dlsym_hook,
        addr = sym glibc_dlsym,
    )
}

/// `dlsym` (elsewhere than x86_64 a `dlsym(RTLD_NEXT, …)` of the program resolves from this
/// library onwards: glibc sees this library as the caller).
#[cfg(not(target_arch = "x86_64"))]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // SAFETY: forwarded.
    unsafe { dlsym_hook(handle, symbol) }
}

/// The `cuGetProcAddress` answer `*pfn` for `symbol`, replaced by a wrapper where there is one.
///
/// # Safety
/// `symbol` NUL-terminated or null, `pfn` null or valid.
unsafe fn wrap_proc(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int) {
    if symbol.is_null() || pfn.is_null() {
        return;
    }
    // SAFETY: the caller's promise.
    let (name, p) = unsafe { (CStr::from_ptr(symbol).to_bytes(), *pfn) };
    if p.is_null() {
        return;
    }
    // cuMemHostRegister's _v2 is the one from CUDA 6.5 on; cuGetProcAddress's from 12.0 on
    let v2_abi = match name {
        b"cuGetProcAddress" => version >= GET_PROC_ADDRESS_V2_FROM,
        b"cuMemHostRegister" => version >= 6050,
        _ => false,
    };
    // SAFETY: the caller's promise.
    unsafe { *pfn = wrap(name, v2_abi, p as usize) as *mut c_void };
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CuResult {
    let Some(real) = GET_PROC_V1.get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: the driver's cuGetProcAddress (v1 ABI) with the caller's arguments.
    let r = unsafe { std::mem::transmute::<usize, GetProcV1>(real)(symbol, pfn, version, flags) };
    if r == 0 {
        // SAFETY: the driver succeeded with the caller's valid arguments.
        unsafe { wrap_proc(symbol, pfn, version) };
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    let Some(real) = GET_PROC_V2.get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: the driver's cuGetProcAddress_v2 with the caller's arguments.
    let r = unsafe {
        std::mem::transmute::<usize, GetProcV2>(real)(symbol, pfn, version, flags, status)
    };
    if r == 0 {
        // SAFETY: the driver succeeded with the caller's valid arguments.
        unsafe { wrap_proc(symbol, pfn, version) };
    }
    r
}

/// Whether `p..p+len`, asked for as I/O memory, lies in an emulated UAR page (and is counted as
/// one rewritten registration).
fn is_uar_iomem(p: *mut c_void, len: size_t, flags: c_uint) -> bool {
    if flags & IOMEMORY == 0 {
        return false;
    }
    let uar = std::panic::catch_unwind(|| uverbs::is_emulated_uar(p as u64, len as u64));
    if !matches!(uar, Ok(true)) {
        return false;
    }
    uverbs::CUDA_SEEN.iomem_uar.fetch_add(1, Ordering::Relaxed);
    true
}

/// Emulated UAR pages registered with the driver as mapped host memory: each run of whole
/// pages once, with the addresses the program registered in it (parts of it, as BAR
/// registrations may be).
struct UarPages(Mutex<Vec<UarRun>>);

struct UarRun {
    start: usize,
    len: usize,
    /// The addresses the program registered in the run, each until it unregisters it.
    parts: Vec<usize>,
}

static UAR_PAGES: UarPages = UarPages(Mutex::new(Vec::new()));

/// The host page size: the driver's unit of host-memory registration.
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

impl UarPages {
    fn runs(&self) -> std::sync::MutexGuard<'_, Vec<UarRun>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `p..p+len` of a UAR page through `real`: its whole pages, unless a run already
    /// holds them.
    ///
    /// # Safety
    /// `real` is the driver's `cuMemHostRegister` (either ABI: their arguments are the same).
    unsafe fn register(&self, real: HostRegister, p: usize, len: usize, flags: c_uint) -> CuResult {
        let page = page_size();
        let start = p & !(page - 1);
        let end = p.saturating_add(len.max(1)).saturating_add(page - 1) & !(page - 1);
        let mut runs = self.runs();
        if let Some(run) = runs
            .iter_mut()
            .find(|r| r.start <= start && end <= r.start + r.len)
        {
            run.parts.push(p);
            return 0;
        }
        let flags = (flags & !IOMEMORY) | DEVICEMAP;
        // SAFETY: the driver's cuMemHostRegister on whole pages of a live UAR mapping.
        let r = unsafe { real(start as *mut c_void, end - start, flags) };
        if r == 0 {
            runs.push(UarRun {
                start,
                len: end - start,
                parts: vec![p],
            });
        }
        r
    }

    /// Takes `p`'s registration back.
    fn unregister(&self, p: usize) -> Unregister {
        let mut runs = self.runs();
        let Some(i) = runs.iter().position(|r| r.parts.contains(&p)) else {
            return Unregister::NotOurs;
        };
        let parts = &mut runs[i].parts;
        if let Some(k) = parts.iter().position(|&q| q == p) {
            parts.swap_remove(k);
        }
        if parts.is_empty() {
            Unregister::LastPart(runs.swap_remove(i).start)
        } else {
            Unregister::Kept
        }
    }
}

/// What [`UarPages::unregister`] found.
enum Unregister {
    /// Other parts of the run remain registered.
    Kept,
    /// The run's last part: its pages (from this address) go back to the driver.
    LastPart(usize),
    /// No part of a run: the driver's to answer.
    NotOurs,
}

/// A `cuMemHostRegister` through `slot`.
///
/// # Safety
/// The caller's arguments, as the driver takes them.
unsafe fn host_register(slot: &Slot, p: *mut c_void, len: size_t, flags: c_uint) -> CuResult {
    let Some(real) = slot.get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: the driver's cuMemHostRegister, whose C signature this type states.
    let real = unsafe { std::mem::transmute::<usize, HostRegister>(real) };
    if is_uar_iomem(p, len, flags) {
        // SAFETY: `real` is the driver's; the range lies in an emulated UAR mapping.
        return unsafe { UAR_PAGES.register(real, p as usize, len, flags) };
    }
    // SAFETY: the driver's cuMemHostRegister with the caller's range.
    unsafe { real(p, len, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CuResult {
    let Some(real) = HOST_UNREGISTER.get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: the driver's cuMemHostUnregister, whose C signature this type states.
    let real = unsafe { std::mem::transmute::<usize, HostUnregister>(real) };
    match std::panic::catch_unwind(|| UAR_PAGES.unregister(p as usize)) {
        Ok(Unregister::Kept) => 0,
        // SAFETY: the start of pages this library registered, now without a part.
        Ok(Unregister::LastPart(start)) => unsafe { real(start as *mut c_void) },
        // SAFETY: forwarded.
        Ok(Unregister::NotOurs) | Err(_) => unsafe { real(p) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostRegister(p: *mut c_void, len: size_t, flags: c_uint) -> CuResult {
    // SAFETY: forwarded.
    unsafe { host_register(&HOST_REGISTER_V1, p, len, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostRegister_v2(
    p: *mut c_void,
    len: size_t,
    flags: c_uint,
) -> CuResult {
    // SAFETY: forwarded.
    unsafe { host_register(&HOST_REGISTER_V2, p, len, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetHandleForAddressRange(
    handle: *mut c_void,
    dptr: u64,
    size: size_t,
    kind: c_int,
    flags: u64,
) -> CuResult {
    let Some(real) = GET_HANDLE.get() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: the driver's cuMemGetHandleForAddressRange with the caller's arguments.
    let r =
        unsafe { std::mem::transmute::<usize, GetHandle>(real)(handle, dptr, size, kind, flags) };
    if r == 0 && kind == DMA_BUF_FD && !handle.is_null() {
        // SAFETY: for DMA_BUF_FD the driver wrote the new fd into the int at `handle`.
        let fd = unsafe { *handle.cast::<c_int>() };
        let _ = std::panic::catch_unwind(|| uverbs::dmabuf::exported(fd, dptr, size as u64));
    }
    r
}
