//! The host API's objects as Python classes: `Context`, `Pd`, `Cq`, `Qp` (regions and peers'
//! memory: [`crate::region`]). Endpoints and memory descriptors travel as `bytes` (the same
//! encodings the Rust API and the bootstrap use).

use crate::errors;
use crate::region::{secs, Mr};
use gpuverbs::{Access, ConnectOptions, CqOptions, DeviceRequest, Endpoint, QpOptions};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Context>()?;
    m.add_class::<Pd>()?;
    m.add_class::<Cq>()?;
    m.add_class::<Qp>()?;
    Ok(())
}

/// An open device: `Context("auto")` (a ConnectX when rdma-core lists one, else the soft
/// NIC; `GPUVERBS_DEVICE` overrides, as in Rust), `"soft"`, or a device name. `wire`
/// (`"127.0.0.1:0"`) gives a soft NIC a RoCEv2 port, so QPs of other processes reach it.
#[pyclass(frozen, module = "gpuverbs")]
pub struct Context(pub(crate) gpuverbs::Context);

#[pymethods]
impl Context {
    #[new]
    #[pyo3(signature = (device = "auto", wire = None))]
    fn new(py: Python<'_>, device: &str, wire: Option<&str>) -> PyResult<Self> {
        let req = match device {
            "auto" => DeviceRequest::Auto,
            "soft" => DeviceRequest::Soft,
            name => DeviceRequest::Named(name.to_string()),
        };
        let wire = wire
            .map(|w| {
                w.parse::<std::net::SocketAddr>()
                    .map_err(|e| errors::InvalidArgument::new_err(format!("wire {w:?}: {e}")))
            })
            .transpose()?;
        let ctx = py.detach(|| match wire {
            Some(addr) => gpuverbs::Context::open_wire(req, addr),
            None => gpuverbs::Context::open(req),
        });
        ctx.map(Self).map_err(errors::host)
    }
    /// The device's name (`softnic0`, `mlx5_0`, ...).
    #[getter]
    fn name(&self) -> String {
        self.0.selection().name.clone()
    }
    /// `"soft"` or `"mlx5"`.
    #[getter]
    fn kind(&self) -> &'static str {
        match self.0.selection().kind {
            gpuverbs::device::BackendKind::Soft => "soft",
            gpuverbs::device::BackendKind::Mlx5 => "mlx5",
        }
    }
    /// Why this device was chosen.
    #[getter]
    fn reason(&self) -> String {
        self.0.selection().reason.clone()
    }
    /// The soft NIC's RoCEv2 port, `"ip:port"`, when it has one.
    #[getter]
    fn wire_addr(&self) -> Option<String> {
        self.0.wire_addr().map(|a| a.to_string())
    }
    /// A protection domain.
    fn alloc_pd(&self) -> Pd {
        Pd(self.0.alloc_pd())
    }
    /// A CQ of `depth` entries (a power of two), detecting overrun; its ring in host memory
    /// or, with `rings="gpu"`, in GPU memory of `gpu`; `"auto"`: where the device wants it
    /// for `gpu`'s kernels (host memory without a `gpu`; `placement_reason` says why).
    #[pyo3(signature = (depth = 256, rings = "auto", gpu = None))]
    fn create_cq(&self, depth: u32, rings: &str, gpu: Option<&crate::gpu::Gpu>) -> PyResult<Cq> {
        let o = CqOptions {
            depth,
            placement: crate::gpu::parse_placement(rings)?,
            ..Default::default()
        };
        match gpu {
            Some(g) => self.0.create_cq_on(&g.0, o),
            None => self.0.create_cq(o),
        }
        .map(Cq)
        .map_err(errors::host)
    }
    fn __repr__(&self) -> String {
        format!("Context({})", self.0.selection())
    }
}

/// A protection domain.
#[pyclass(frozen, module = "gpuverbs")]
pub struct Pd(gpuverbs::Pd);

#[pymethods]
impl Pd {
    /// Registers the memory of `obj` without copying, with the rights in `access`
    /// (`ACCESS_*` flags): host memory through the buffer protocol (NumPy arrays,
    /// `bytearray`, `memoryview`) or DLPack (torch CPU tensors, pinned ones too); GPU memory
    /// through DLPack or `__cuda_array_interface__` (torch CUDA tensors, CuPy arrays), on the
    /// GPU the memory is on (opened if it is not). The object must be C-contiguous, and
    /// writable when `access` asks for a write. The region holds the object's memory (the
    /// buffer export, the DLPack tensor, or the object) until it is dropped.
    #[pyo3(signature = (obj, access = gpuverbs::Access::LOCAL_WRITE.0))]
    fn register(&self, obj: &Bound<'_, PyAny>, access: u32) -> PyResult<Mr> {
        let mem = crate::memory::import(obj)?;
        let writes = Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0;
        if mem.readonly && access & writes != 0 {
            return Err(errors::InvalidArgument::new_err(
                "a read-only buffer cannot be registered for writing (drop ACCESS_LOCAL_WRITE, \
                 ACCESS_REMOTE_WRITE and ACCESS_REMOTE_ATOMIC, or pass a writable object)",
            ));
        }
        if mem.len == 0 {
            return Err(errors::InvalidArgument::new_err(
                "register needs at least one byte",
            ));
        }
        let mr = match mem.place {
            crate::memory::Place::Host => {
                // SAFETY: the memory is held by `mem`, which the returned region keeps for as
                // long as the registration lives, so its `len` bytes at `addr` stay mapped
                // and do not move.
                unsafe { self.0.register_raw(mem.addr, mem.len, Access(access)) }
            }
            crate::memory::Place::Gpu(ordinal) => {
                // the owner of the allocation must be open in this process
                crate::gpu::gpu(obj.py(), ordinal)?;
                self.0.register_gpu(mem.addr, mem.len, Access(access))
            }
        }
        .map_err(errors::host)?;
        Ok(Mr { mr, _mem: mem })
    }
    /// An RC QP in RESET on `send_cq` and `recv_cq`. `doorbell`: how kernels ring it once
    /// exported (`"auto"`, `"gpu_doorbell"`, `"blueflame"`, `"cpu_proxy"`; the choice and its
    /// reason are reported by `doorbell_mode` / `doorbell_reason`); `rings`: `"host"` (mapped
    /// into the GPU), `"gpu"` (GPU memory of `gpu`, for a QP only kernels drive) or `"auto"`
    /// (where the device wants them for `gpu`'s kernels, host memory without a `gpu`; reported
    /// by `ring_placement` / `placement_reason`).
    #[pyo3(signature = (send_cq, recv_cq, sq_blocks = 256, rq_wqes = 256, max_inline = 256,
                        doorbell = "auto", rings = "auto", gpu = None))]
    #[allow(clippy::too_many_arguments)]
    fn create_qp(
        &self,
        send_cq: &Cq,
        recv_cq: &Cq,
        sq_blocks: u32,
        rq_wqes: u32,
        max_inline: u32,
        doorbell: &str,
        rings: &str,
        gpu: Option<&crate::gpu::Gpu>,
    ) -> PyResult<Qp> {
        let mut o = QpOptions::new(&send_cq.0, &recv_cq.0);
        o.sq_blocks = sq_blocks;
        o.rq_wqes = rq_wqes;
        o.max_inline = max_inline;
        o.doorbell = crate::gpu::parse_mode(doorbell)?;
        o.placement = crate::gpu::parse_placement(rings)?;
        match gpu {
            Some(g) => self.0.create_qp_on(&g.0, o),
            None => self.0.create_qp(o),
        }
        .map(Qp)
        .map_err(errors::host)
    }
}

/// A completion queue.
#[pyclass(frozen, module = "gpuverbs")]
pub struct Cq(gpuverbs::Cq);

#[pymethods]
impl Cq {
    #[getter]
    fn cqn(&self) -> u32 {
        self.0.cqn()
    }
    #[getter]
    fn depth(&self) -> u32 {
        self.0.depth()
    }
    /// `"host"` or `"gpu"`: where the ring lives (`"auto"` resolved at creation).
    #[getter]
    fn ring_placement(&self) -> &'static str {
        crate::gpu::placement_name(self.0.placement())
    }
    /// Why the ring is there.
    #[getter]
    fn placement_reason(&self) -> String {
        self.0.placement_reason().to_string()
    }
}

/// An RC queue pair.
#[pyclass(frozen, module = "gpuverbs")]
pub struct Qp(pub(crate) gpuverbs::Qp);

#[pymethods]
impl Qp {
    #[getter]
    fn qpn(&self) -> u32 {
        self.0.qpn()
    }
    #[getter]
    fn psn(&self) -> u32 {
        self.0.psn()
    }
    /// `"RESET"`, `"INIT"`, `"RTR"`, `"RTS"` or `"ERR"`.
    #[getter]
    fn state(&self) -> String {
        format!("{:?}", self.0.state()).to_uppercase()
    }
    /// What the peer needs to connect to this QP, as bytes (never an rkey).
    fn endpoint<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.endpoint().to_bytes())
    }
    /// RESET → INIT → RTR → RTS towards the peer's endpoint, granting the peer `access`.
    #[pyo3(signature = (endpoint, access = 0, timeout = 14, retry_cnt = 7, rnr_retry = 7))]
    fn connect(
        &self,
        py: Python<'_>,
        endpoint: &[u8],
        access: u32,
        timeout: u8,
        retry_cnt: u8,
        rnr_retry: u8,
    ) -> PyResult<()> {
        let ep = Endpoint::from_bytes(endpoint)
            .map_err(|e| errors::InvalidArgument::new_err(e.to_string()))?;
        let o = ConnectOptions {
            access: Access(access),
            timeout,
            retry_cnt,
            rnr_retry,
            ..Default::default()
        };
        py.detach(|| self.0.connect(&ep, o)).map_err(errors::host)
    }
    /// Moves the QP to ERR: what it holds and what is posted later completes with flushes.
    fn to_error(&self) -> PyResult<()> {
        self.0.modify(gpuverbs::Modify::Err).map_err(errors::host)
    }
    /// Drains the QP (its outstanding work's completions, flushes included, are returned as
    /// `(send, recv)` lists), resets it and draws a new PSN: exchange endpoints again and
    /// `connect`. No poster may hold it (drop its `Initiator` first).
    #[pyo3(signature = (timeout = 5.0))]
    fn recover(
        &self,
        py: Python<'_>,
        timeout: f64,
    ) -> PyResult<(
        Vec<crate::initiator::Completion>,
        Vec<crate::initiator::Completion>,
    )> {
        let t = secs(timeout)?;
        let d = py.detach(|| self.0.recover(t)).map_err(errors::host)?;
        let conv = |v: &[gpuverbs::post::Completion]| {
            v.iter().map(crate::initiator::Completion::from).collect()
        };
        Ok((conv(&d.send), conv(&d.recv)))
    }
    /// How kernels ring this QP once exported: `"gpu_doorbell"`, `"blueflame"` or
    /// `"cpu_proxy"` (`"auto"` resolved at creation).
    #[getter]
    fn doorbell_mode(&self) -> &'static str {
        crate::gpu::mode_name(self.0.doorbell().0)
    }
    /// Why that doorbell mode.
    #[getter]
    fn doorbell_reason(&self) -> String {
        self.0.doorbell().1.to_string()
    }
    /// `"host"` or `"gpu"`: where the rings live (`"auto"` resolved at creation).
    #[getter]
    fn ring_placement(&self) -> &'static str {
        crate::gpu::placement_name(self.0.placement())
    }
    /// Why the rings are there.
    #[getter]
    fn placement_reason(&self) -> String {
        self.0.placement_reason().to_string()
    }
    /// Exports the QP to `gpu` (a `Gpu` or an ordinal) for kernels built against headers of
    /// descriptor version `header_version` (`GPUVERBS_DESC_VERSION`; by default this
    /// package's, the headers `include_dir()` gives): another version is a
    /// `DescVersionError`, checked before anything else. The export is the QP's poster.
    #[pyo3(signature = (gpu = None, header_version = gpuverbs::export::DESC_VERSION))]
    fn export(
        &self,
        py: Python<'_>,
        gpu: Option<&Bound<'_, PyAny>>,
        header_version: u32,
    ) -> PyResult<crate::gpu::ExportedQp> {
        gpuverbs::export::check_header(header_version).map_err(errors::host)?;
        let g = match gpu {
            None => crate::gpu::Gpu(crate::gpu::gpu(py, 0)?),
            Some(o) => match o.cast::<crate::gpu::Gpu>() {
                Ok(g) => crate::gpu::Gpu(g.get().0.clone()),
                Err(_) => crate::gpu::Gpu(crate::gpu::gpu(py, o.extract()?)?),
            },
        };
        crate::gpu::ExportedQp::new(&self.0, &g, header_version)
    }
    /// A CPU initiator: posts from the host and polls this QP's CQs. One poster at a time.
    /// It rings as the QP's doorbell mode says: whole WQEs into the register (seqlocked, as
    /// the device API writes them) on a BlueFlame QP, rdma-core's 8-byte doorbell otherwise.
    fn initiator(&self) -> PyResult<crate::initiator::Initiator> {
        use gpuverbs::post::RingMode;
        let mode = match self.0.doorbell().0 {
            gpuverbs::DoorbellMode::BlueFlame => RingMode::BlueFlame,
            _ => RingMode::RdmaCore,
        };
        let ini = self.0.try_cpu_initiator(mode).map_err(errors::host)?;
        Ok(crate::initiator::Initiator::new(ini))
    }
}
