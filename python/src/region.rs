//! Registered memory and a peer's memory as Python classes: `Mr` (a region, with the checks
//! of a local range) and `RemoteMemory` (a peer's descriptor, with the checks of a remote
//! range), and the conversion of timeouts. Below the objects that make them and the
//! initiator that posts with them.

use crate::errors;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::time::Duration;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Mr>()?;
    m.add_class::<RemoteMemory>()?;
    Ok(())
}

/// A registered region: `addr`, `length`, `lkey`, `rkey`; `remote_memory()` is what a peer
/// needs to access it (the whole region).
#[pyclass(frozen, module = "gpuverbs")]
pub struct Mr {
    pub(crate) mr: gpuverbs::Mr,
    // declared after the region: the registration goes before the memory is released
    pub(crate) _mem: crate::memory::Imported,
}

#[pymethods]
impl Mr {
    #[getter]
    fn addr(&self) -> u64 {
        self.mr.addr()
    }
    #[getter]
    fn length(&self) -> u64 {
        self.mr.len()
    }
    #[getter]
    fn lkey(&self) -> u32 {
        self.mr.lkey().0
    }
    #[getter]
    fn rkey(&self) -> u32 {
        self.mr.rkey().0
    }
    /// `"host"` or `"gpu"`: where the registered bytes are.
    #[getter]
    fn memory(&self) -> &'static str {
        match self.mr.kind() {
            gpuverbs::memory::MemKind::Device => "gpu",
            _ => "host",
        }
    }
    /// The region's descriptor for a peer (address, length, rkey, generation) as bytes.
    fn remote_memory<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &gpuverbs::RemoteMemory::export_mr(&self.mr).to_bytes())
    }
}

impl Mr {
    /// Checks that `off..off + len` lies in the region.
    pub(crate) fn local(&self, off: u64, len: u64) -> PyResult<u64> {
        within(off, len, self.mr.len(), "offset", "a region")?;
        Ok(self.mr.addr() + off)
    }
}

/// A peer's memory, decoded from the bytes of its `Mr.remote_memory()`.
#[pyclass(frozen, module = "gpuverbs")]
pub struct RemoteMemory(pub(crate) gpuverbs::RemoteMemory);

#[pymethods]
impl RemoteMemory {
    #[new]
    fn new(data: &[u8]) -> PyResult<Self> {
        gpuverbs::RemoteMemory::from_bytes(data)
            .map(Self)
            .map_err(|e| errors::InvalidArgument::new_err(e.to_string()))
    }
    #[getter]
    fn addr(&self) -> u64 {
        self.0.addr()
    }
    #[getter]
    fn length(&self) -> u64 {
        self.0.len()
    }
    #[getter]
    fn rkey(&self) -> u32 {
        self.0.rkey()
    }
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.to_bytes())
    }
}

impl RemoteMemory {
    /// The remote address of `off..off + len`, checked against the descriptor.
    pub(crate) fn at(&self, off: u64, len: u64) -> PyResult<gpuverbs::post::RemoteAddr> {
        within(off, len, self.0.len(), "remote offset", "remote memory")?;
        Ok(gpuverbs::post::RemoteAddr {
            addr: self.0.addr() + off,
            rkey: gpuverbs::post::Rkey(self.0.rkey()),
        })
    }
}

/// Checks that `off..off + len` lies in `0..total` (`InvalidArgument` naming the range).
fn within(off: u64, len: u64, total: u64, offset: &str, what: &str) -> PyResult<()> {
    match off.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(errors::InvalidArgument::new_err(format!(
            "{len} bytes at {offset} {off} do not fit {what} of {total} bytes"
        ))),
    }
}

/// Seconds as a duration (finite, not negative).
pub(crate) fn secs(s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|e| errors::InvalidArgument::new_err(format!("timeout {s}: {e}")))
}
