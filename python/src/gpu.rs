//! GPUs and exports from Python: `Gpu(ordinal)` (one per device in the process, in CUDA's
//! primary context, the one torch and CuPy use, so their pointers and ours agree), and
//! `ExportedQp`, a QP's descriptor in GPU memory whose address a kernel takes, with the
//! CPU-proxy thread that rings for it when the QP's doorbell mode is the proxy.

use crate::errors;
use gpuverbs::proxy::{ProxyConfig, ProxyHandle, ProxyService, ProxyTarget};
use gpuverbs::{DoorbellMode, RingPlacement};
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Gpu>()?;
    m.add_class::<ExportedQp>()?;
    m.add("DESC_VERSION", gpuverbs::export::DESC_VERSION)?;
    Ok(())
}

/// The process's open GPUs, by ordinal: one `gpuverbs::gpu::Gpu` each, whoever asks.
fn open_gpus() -> &'static Mutex<HashMap<usize, Arc<gpuverbs::gpu::Gpu>>> {
    static GPUS: OnceLock<Mutex<HashMap<usize, Arc<gpuverbs::gpu::Gpu>>>> = OnceLock::new();
    GPUS.get_or_init(Default::default)
}

/// GPU `ordinal`, opened once per process.
pub(crate) fn gpu(py: Python<'_>, ordinal: usize) -> PyResult<Arc<gpuverbs::gpu::Gpu>> {
    let mut gpus = open_gpus().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(g) = gpus.get(&ordinal) {
        return Ok(g.clone());
    }
    let g = py
        .detach(|| gpuverbs::gpu::Gpu::open(ordinal))
        .map_err(|e| errors::host(e.into()))?;
    gpus.insert(ordinal, g.clone());
    Ok(g)
}

/// A GPU of this process: `Gpu(0)`. Opening it again returns the same device. Registering
/// GPU memory opens the GPU it is on by itself; a QP's rings in GPU memory and an export need
/// one named.
#[pyclass(frozen, module = "gpuverbs")]
pub struct Gpu(pub(crate) Arc<gpuverbs::gpu::Gpu>);

#[pymethods]
impl Gpu {
    #[new]
    #[pyo3(signature = (ordinal = 0))]
    fn new(py: Python<'_>, ordinal: usize) -> PyResult<Self> {
        gpu(py, ordinal).map(Self)
    }
    #[getter]
    fn ordinal(&self) -> usize {
        self.0.info().ordinal
    }
    /// The device's name, e.g. `NVIDIA H200`.
    #[getter]
    fn name(&self) -> String {
        self.0.info().name.clone()
    }
    /// `(major, minor)`.
    #[getter]
    fn compute_capability(&self) -> (i32, i32) {
        self.0.info().compute_capability
    }
    fn __repr__(&self) -> String {
        format!("Gpu({})", self.0.info())
    }
}

/// The CPU-proxy service of the process: one thread rings for every exported QP in proxy
/// mode.
fn proxy() -> PyResult<&'static ProxyService> {
    static SVC: OnceLock<ProxyService> = OnceLock::new();
    if let Some(s) = SVC.get() {
        return Ok(s);
    }
    let s = ProxyService::start(ProxyConfig::default())
        .map_err(|e| errors::GpuverbsError::new_err(e.to_string()))?;
    Ok(SVC.get_or_init(|| s))
}

pub(crate) fn mode_name(m: DoorbellMode) -> &'static str {
    match m {
        DoorbellMode::Auto => "auto",
        DoorbellMode::GpuDoorbell => "gpu_doorbell",
        DoorbellMode::BlueFlame => "blueflame",
        DoorbellMode::CpuProxy => "cpu_proxy",
        DoorbellMode::NoDbr => "no_dbr",
        DoorbellMode::NoDbrEmulated => "no_dbr_emulated",
    }
}

pub(crate) fn parse_mode(s: &str) -> PyResult<DoorbellMode> {
    Ok(match s {
        "auto" => DoorbellMode::Auto,
        "gpu_doorbell" => DoorbellMode::GpuDoorbell,
        "blueflame" => DoorbellMode::BlueFlame,
        "cpu_proxy" => DoorbellMode::CpuProxy,
        "no_dbr" => DoorbellMode::NoDbr,
        "no_dbr_emulated" => DoorbellMode::NoDbrEmulated,
        _ => {
            return Err(errors::InvalidArgument::new_err(format!(
                "doorbell {s:?}: one of auto, gpu_doorbell, blueflame, cpu_proxy, no_dbr, \
                 no_dbr_emulated"
            )))
        }
    })
}

pub(crate) fn placement_name(p: RingPlacement) -> &'static str {
    match p {
        RingPlacement::Auto => "auto",
        RingPlacement::HostMapped => "host",
        RingPlacement::Gpu => "gpu",
    }
}

pub(crate) fn parse_placement(s: &str) -> PyResult<RingPlacement> {
    match s {
        "auto" => Ok(RingPlacement::Auto),
        "host" => Ok(RingPlacement::HostMapped),
        "gpu" => Ok(RingPlacement::Gpu),
        _ => Err(errors::InvalidArgument::new_err(format!(
            "rings {s:?}: \"auto\", \"host\" or \"gpu\""
        ))),
    }
}

/// A QP exported to a GPU (`Qp.export`): `ptr` is the device address of its `gpuverbs_qp`
/// descriptor, the argument the device API's calls take. The export is the QP's poster until
/// `close()` (or until it is collected); in CPU-proxy mode the process's proxy thread rings
/// for it meanwhile.
#[pyclass(module = "gpuverbs")]
pub struct ExportedQp {
    inner: Option<(gpuverbs::gpu::ExportedQp, Option<ProxyHandle>)>,
    ptr: u64,
    mode: DoorbellMode,
    placement: RingPlacement,
}

impl ExportedQp {
    pub(crate) fn new(qp: &gpuverbs::Qp, gpu: &Gpu, header_version: u32) -> PyResult<Self> {
        let e = gpu
            .0
            .export_qp_for(qp, header_version)
            .map_err(errors::host)?;
        let mode = qp.doorbell().0;
        let handle = if mode.proxied() {
            let target = ProxyTarget::for_qp(qp).map_err(errors::host)?;
            Some(
                proxy()?
                    .add(target)
                    .map_err(|e| errors::GpuverbsError::new_err(e.to_string()))?,
            )
        } else {
            None
        };
        Ok(Self {
            ptr: e.ptr(),
            inner: Some((e, handle)),
            mode,
            placement: qp.placement(),
        })
    }

    fn live(&self) -> PyResult<&gpuverbs::gpu::ExportedQp> {
        self.inner
            .as_ref()
            .map(|(e, _)| e)
            .ok_or_else(|| errors::InvalidArgument::new_err("the export is closed"))
    }
}

#[pymethods]
impl ExportedQp {
    /// Device address of the descriptor (pass it to kernels as `gpuverbs_qp*`).
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }
    /// `"gpu_doorbell"`, `"blueflame"` or `"cpu_proxy"`.
    #[getter]
    fn doorbell_mode(&self) -> &'static str {
        mode_name(self.mode)
    }
    /// Where the QP's rings live: `"host"` (mapped into the GPU) or `"gpu"`.
    #[getter]
    fn ring_placement(&self) -> &'static str {
        placement_name(self.placement)
    }
    /// Whether kernels found the send queue broken (a reservation never published): reset
    /// the QP (`recover`), connect it and export it again.
    fn is_broken(&self, py: Python<'_>) -> PyResult<bool> {
        let e = self.live()?;
        py.detach(|| e.is_broken())
            .map_err(|e| errors::host(e.into()))
    }
    /// The descriptor's counters as a dict (device API state: `sq_reserved`, `sq_retired`,
    /// `scq_ci`, `sq_error`, ...), read from GPU memory.
    fn counters(&self, py: Python<'_>) -> PyResult<HashMap<&'static str, u64>> {
        let e = self.live()?;
        let d = py.detach(|| e.read()).map_err(|e| errors::host(e.into()))?;
        Ok(HashMap::from([
            ("version", u64::from(d.version)),
            ("sq_reserved", d.sq_reserved),
            ("sq_ready", d.sq_ready),
            ("sq_rung", d.sq_rung),
            ("sq_retired", d.sq_retired),
            ("scq_ci", d.scq_ci),
            ("rcq_ci", d.rcq_ci),
            ("rq_posted", d.rq_posted),
            ("sq_error", d.sq_error),
            ("sq_error_info", d.sq_error_info),
            ("sq_broken", u64::from(d.sq_broken)),
        ]))
    }
    /// Ends the export: the proxy stops ringing for it and the QP is free for another poster.
    /// Kernels that use the descriptor must have finished.
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        if let Some((e, handle)) = self.inner.take() {
            if let Some(h) = handle {
                let svc = proxy()?;
                py.detach(|| svc.remove(h))
                    .map_err(|e| errors::GpuverbsError::new_err(e.to_string()))?;
            }
            drop(e);
        }
        Ok(())
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    fn __exit__(
        &mut self,
        py: Python<'_>,
        _t: Option<&Bound<'_, PyAny>>,
        _v: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.close(py)
    }
}

impl Drop for ExportedQp {
    fn drop(&mut self) {
        if let Some((_, Some(h))) = self.inner.take() {
            if let Ok(svc) = proxy() {
                let _ = svc.remove(h);
            }
        }
    }
}
