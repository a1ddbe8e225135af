//! `gpuverbs` for Python: the host API — devices, protection domains, registered memory (any
//! object with the buffer protocol: NumPy arrays, `bytearray`, host torch tensors through
//! NumPy), CQs, RC QPs, endpoints and memory descriptors as bytes, QP recovery, and the CPU
//! initiator for host-side posts — with every error a Python exception of its own class.
//! The GIL is released around every call that waits.

mod errors;
mod gpu;
mod initiator;
mod memory;
mod objects;
mod region;

include!(concat!(env!("OUT_DIR"), "/headers.rs"));

use pyo3::prelude::*;

/// The version of this package's layout of what it hands to Python.
const VERSION: &str = env!("CARGO_PKG_VERSION");

#[pymodule]
fn _gpuverbs(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", VERSION)?;
    m.add("ACCESS_LOCAL_WRITE", gpuverbs::Access::LOCAL_WRITE.0)?;
    m.add("ACCESS_REMOTE_WRITE", gpuverbs::Access::REMOTE_WRITE.0)?;
    m.add("ACCESS_REMOTE_READ", gpuverbs::Access::REMOTE_READ.0)?;
    m.add("ACCESS_REMOTE_ATOMIC", gpuverbs::Access::REMOTE_ATOMIC.0)?;
    m.add_function(wrap_pyfunction!(_headers, m)?)?;
    errors::register(m)?;
    region::register(m)?;
    objects::register(m)?;
    initiator::register(m)?;
    gpu::register(m)?;
    Ok(())
}

/// The device API's headers as `(path, text)` pairs (`gpuverbs.include_dir()` writes them out).
#[pyfunction]
fn _headers() -> Vec<(&'static str, &'static str)> {
    HEADERS.to_vec()
}
