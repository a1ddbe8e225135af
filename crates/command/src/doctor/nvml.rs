//! BAR1 size and use through NVML (`libnvidia-ml.so.1`, loaded at run time when present).
//!
//! BAR1 is the window through which a NIC reaches GPU memory (dma-buf and nvidia-peermem map
//! GPU pages into it); its size bounds how much GPU memory can be registered at once.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

/// The NVML library file.
pub const LIBNVML: &str = "libnvidia-ml.so.1";

/// Why NVML could not answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NvmlError {
    /// The library did not load.
    #[error("{LIBNVML} could not be loaded ({0})")]
    NotLoaded(String),
    /// A symbol is missing.
    #[error("{LIBNVML} lacks {0}")]
    Symbol(&'static str),
    /// A call failed.
    #[error("{call} returned {message} ({code})")]
    Call {
        /// The call.
        call: &'static str,
        /// `nvmlReturn_t`.
        code: c_int,
        /// `nvmlErrorString`.
        message: String,
    },
}

/// `nvmlBAR1Memory_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bar1 {
    /// Total BAR1 bytes.
    pub total: u64,
    /// Free bytes.
    pub free: u64,
    /// Used bytes.
    pub used: u64,
}

type InitFn = unsafe extern "C" fn() -> c_int;
type ShutdownFn = unsafe extern "C" fn() -> c_int;
type HandleFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_int;
type Bar1Fn = unsafe extern "C" fn(*mut c_void, *mut Bar1) -> c_int;
type ErrStrFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// Reads BAR1 of each device named by PCI bus id (`0000:65:00.0`). The outer error: NVML is
/// not usable at all; the inner ones: that device.
pub fn bar1(bus_ids: &[String]) -> Result<Vec<Result<Bar1, NvmlError>>, NvmlError> {
    // SAFETY: loading NVML runs its initialisers, which only set up its own state.
    let lib = unsafe { libloading::Library::new(LIBNVML) }.map_err(|e| {
        NvmlError::NotLoaded(
            std::error::Error::source(&e).map_or_else(|| e.to_string(), ToString::to_string),
        )
    })?;
    // SAFETY: each symbol is looked up with the C signature NVML's header gives it.
    let (init, shutdown, handle, bar1, errstr) = unsafe {
        let sym = |n: &'static str| -> Result<*mut c_void, NvmlError> {
            lib.get::<*mut c_void>(n.as_bytes())
                .map(|s| *s)
                .map_err(|_| NvmlError::Symbol(n))
        };
        (
            std::mem::transmute::<*mut c_void, InitFn>(sym("nvmlInit_v2")?),
            std::mem::transmute::<*mut c_void, ShutdownFn>(sym("nvmlShutdown")?),
            std::mem::transmute::<*mut c_void, HandleFn>(sym("nvmlDeviceGetHandleByPciBusId_v2")?),
            std::mem::transmute::<*mut c_void, Bar1Fn>(sym("nvmlDeviceGetBAR1MemoryInfo")?),
            std::mem::transmute::<*mut c_void, ErrStrFn>(sym("nvmlErrorString")?),
        )
    };
    let err = |call: &'static str, code: c_int| {
        // SAFETY: nvmlErrorString returns a static string for any code.
        let p = unsafe { errstr(code) };
        let message = if p.is_null() {
            "unknown".to_string()
        } else {
            // SAFETY: NUL-terminated, static.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        NvmlError::Call {
            call,
            code,
            message,
        }
    };
    // SAFETY: no preconditions; paired with nvmlShutdown below.
    let rc = unsafe { init() };
    if rc != 0 {
        return Err(err("nvmlInit_v2", rc));
    }
    let out = bus_ids
        .iter()
        .map(|id| {
            let cid = CString::new(id.as_str()).map_err(|_| NvmlError::Call {
                call: "nvmlDeviceGetHandleByPciBusId_v2",
                code: 2,
                message: "bus id contains NUL".into(),
            })?;
            let mut dev: *mut c_void = std::ptr::null_mut();
            // SAFETY: a NUL-terminated bus id and a writable handle.
            let rc = unsafe { handle(cid.as_ptr(), &mut dev) };
            if rc != 0 {
                return Err(err("nvmlDeviceGetHandleByPciBusId_v2", rc));
            }
            let mut b = Bar1::default();
            // SAFETY: a handle NVML just gave and a writable nvmlBAR1Memory_t.
            let rc = unsafe { bar1(dev, &mut b) };
            if rc != 0 {
                return Err(err("nvmlDeviceGetBAR1MemoryInfo", rc));
            }
            Ok(b)
        })
        .collect();
    // SAFETY: paired with the successful nvmlInit_v2 above.
    unsafe { shutdown() };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_nvml_is_an_error() {
        match bar1(&["0000:00:00.0".to_string()]) {
            Err(NvmlError::NotLoaded(why)) => assert!(!why.is_empty()),
            // a GPU machine: NVML loads; the fake bus id is not a GPU
            Ok(v) => assert!(v[0].is_err()),
            // NVML present but no driver to talk to
            Err(NvmlError::Call { call, .. }) => assert_eq!(call, "nvmlInit_v2"),
            Err(e) => panic!("{e}"),
        }
    }
}
