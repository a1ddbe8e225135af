//! Data-path cases: kernels drive exported soft-NIC QPs through the device API; the host checks
//! every byte and every status.

mod dc;
mod gin;
mod nic_counter;
mod ops;
mod put;
mod recv;
mod sharing;
mod status;

pub use dc::dc_ops;
pub use gin::{counted, counter_error, gin, rolling, scope_waits, scopes};
pub use nic_counter::{gpunetio_counter, nic_counter_error, nic_counters};
pub use ops::{
    bad_rkey, dropped_doorbell_timeout, ops, recover_after_error, recover_in_place, wait_signal,
};
pub use put::{collapsed_cq, put_case, put_no_dbr, PutArgs, PutCase};
pub use recv::{recv, RecvCase};
pub use sharing::{exclusive_wrap, poster_handover, private_qps, ring_multi};
pub use status::status_paths;

use anyhow::{bail, ensure, Context as _, Result};
use gpuverbs::gpu::{DeviceMem, ExportedQp, Gpu};
use gpuverbs::proxy::{ProxyConfig, ProxyService, ProxyTarget};
use gpuverbs::queue::CqMode;
use gpuverbs::{
    Access, ConnectOptions, Context, CqOptions, DeviceRequest, DoorbellMode, HostBuffer, Mr, Pd,
    Qp, QpOptions, RingPlacement,
};
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// Budget for every wait in the kernels (ns).
pub const BUDGET_NS: u64 = 2_000_000_000;

/// The GPU shared by all cases (opening it loads the module once).
pub fn gpu(ordinal: usize) -> Result<Arc<Gpu>> {
    static GPU: OnceLock<Arc<Gpu>> = OnceLock::new();
    if let Some(g) = GPU.get() {
        return Ok(g.clone());
    }
    let g = Gpu::open(ordinal).context("open GPU")?;
    Ok(GPU.get_or_init(|| g).clone())
}

/// Where a payload buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mem {
    /// Host memory mapped into the GPU.
    Host,
    /// GPU memory (registered with `Pd::register_device_mem`).
    Gpu,
}

/// A payload buffer in host or GPU memory.
pub enum Buf {
    Host(HostBuffer),
    Gpu(DeviceMem),
}

impl Buf {
    fn new(gpu: &Arc<Gpu>, mem: Mem, bytes: usize) -> Result<Self> {
        Ok(match mem {
            Mem::Host => Buf::Host(HostBuffer::new(bytes)),
            Mem::Gpu => Buf::Gpu(gpu.alloc(bytes)?),
        })
    }
    fn register(&self, pd: &Pd, access: Access) -> Result<Mr> {
        Ok(match self {
            Buf::Host(b) => pd.register_with(b, access)?,
            Buf::Gpu(m) => pd.register_device_mem(m, access)?,
        })
    }
    /// The address kernels use for it.
    fn gpu_addr(&self, gpu: &Gpu) -> Result<u64> {
        Ok(match self {
            Buf::Host(b) => gpu.map_host(b)?,
            Buf::Gpu(m) => m.ptr(),
        })
    }
    pub fn len(&self) -> usize {
        match self {
            Buf::Host(b) => b.len(),
            Buf::Gpu(m) => m.len(),
        }
    }
    pub fn write(&self, off: usize, bytes: &[u8]) -> Result<()> {
        match self {
            Buf::Host(b) => b.write(off, bytes),
            Buf::Gpu(m) => m.write(off, bytes)?,
        }
        Ok(())
    }
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        Ok(match self {
            Buf::Host(b) => b.to_vec(),
            Buf::Gpu(m) => {
                let mut v = vec![0; m.len()];
                m.read(0, &mut v)?;
                v
            }
        })
    }
}

/// What a [`Pair`] is made of.
#[derive(Clone, Copy, Debug)]
pub struct PairSpec {
    pub mode: DoorbellMode,
    /// Payload bytes of each side's buffer.
    pub bytes: usize,
    pub sq_blocks: u32,
    /// Where both payload buffers live.
    pub mem: Mem,
    /// Where side A's SQ, RQ and CQ rings live.
    pub rings: RingPlacement,
}

/// Two soft devices with one connected RC QP pair; side A is exported to the GPU.
pub struct Pair {
    /// The proxy thread ringing for a CPU-proxy QP (or keeping an emulated no-DBR QP's
    /// record): declared first, so it stops and lets its target go before the QPs are
    /// destroyed.
    _proxy: Option<ProxyService>,
    pub a: Context,
    pub qa: Qp,
    pub qb: Qp,
    pub src: Buf,
    pub dst: Buf,
    pub src_mr: Mr,
    pub dst_mr: Mr,
    pub src_d: u64,
    pub export: ExportedQp,
    pub gpu: Arc<Gpu>,
    _b: Context,
}

impl Pair {
    pub fn new(ordinal: usize, mode: DoorbellMode, bytes: usize, sq_blocks: u32) -> Result<Self> {
        Self::with(
            ordinal,
            PairSpec {
                mode,
                bytes,
                sq_blocks,
                mem: Mem::Host,
                rings: RingPlacement::HostMapped,
            },
        )
    }

    pub fn with(ordinal: usize, spec: PairSpec) -> Result<Self> {
        Self::build(ordinal, spec, CqMode::OverrunIgnore)
    }

    /// As [`Pair::with`], with side A's CQ in `cq_mode`.
    pub fn build(ordinal: usize, spec: PairSpec, cq_mode: CqMode) -> Result<Self> {
        let PairSpec {
            mode,
            bytes,
            sq_blocks,
            mem,
            rings,
        } = spec;
        // on the mlx5 backend GPU-resident rings and collapsed or overrun-ignore CQs are
        // DEVX objects (the provider's CQs always detect overrun, in host memory)
        let gpu = gpu(ordinal)?;
        let (a, b) = contexts()?;
        let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
        let cqa = a.create_cq_on(
            &gpu,
            CqOptions {
                depth: sq_blocks.max(64),
                placement: rings,
                mode: cq_mode,
                ..Default::default()
            },
        )?;
        let cqb = b.create_cq(CqOptions {
            depth: 64,
            ..Default::default()
        })?;
        let mut oa = QpOptions::new(&cqa, &cqa);
        oa.sq_blocks = sq_blocks;
        oa.doorbell = mode;
        oa.placement = rings;
        let qa = pa.create_qp_on(&gpu, oa)?;
        // Auto: GPU rings on a ConnectX, host rings on the soft NIC (its engine is a CPU thread)
        let rings = match (rings, a.selection().kind) {
            (RingPlacement::Auto, gpuverbs::device::BackendKind::Mlx5) => RingPlacement::Gpu,
            (RingPlacement::Auto, gpuverbs::device::BackendKind::Soft) => RingPlacement::HostMapped,
            (r, _) => r,
        };
        ensure!(
            qa.placement() == rings && cqa.placement() == rings,
            "rings not where expected ({rings:?}): QP {:?} ({}), CQ {:?} ({})",
            qa.placement(),
            qa.placement_reason(),
            cqa.placement(),
            cqa.placement_reason()
        );
        // Auto doorbell: BlueFlame for GPU rings on the soft NIC (its engine would copy each
        // WQE out of GPU memory), a GPU doorbell otherwise
        if mode == DoorbellMode::Auto {
            let soft = a.selection().kind == gpuverbs::device::BackendKind::Soft;
            let want = if soft && rings == RingPlacement::Gpu {
                DoorbellMode::BlueFlame
            } else {
                DoorbellMode::GpuDoorbell
            };
            let (got, why) = qa.doorbell();
            ensure!(
                got == want,
                "auto doorbell {got:?} ({why}), expected {want:?}"
            );
        }
        let qb = pb.create_qp(QpOptions::new(&cqb, &cqb))?;
        let remote = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        connect_both(&qa, &qb, remote)?;
        let src = Buf::new(&gpu, mem, bytes)?;
        let dst = Buf::new(&gpu, mem, bytes)?;
        let pattern: Vec<u8> = (0..bytes)
            .map(|j| (j as u32).wrapping_mul(2654435761) as u8 | 1)
            .collect();
        src.write(0, &pattern)?;
        let src_mr = src.register(&pa, Access::LOCAL_WRITE | remote)?;
        let dst_mr = dst.register(&pb, Access::LOCAL_WRITE | remote)?;
        let want_kind = match mem {
            Mem::Host => gpuverbs::memory::MemKind::Host,
            Mem::Gpu => gpuverbs::memory::MemKind::Device,
        };
        ensure!(src_mr.kind() == want_kind && dst_mr.kind() == want_kind);
        let src_d = src.gpu_addr(&gpu)?;
        let export = gpu.export_qp(&qa)?;
        let ring_loc = export.read()?.ring_loc;
        let want_loc = u32::from(rings == RingPlacement::Gpu);
        ensure!(
            ring_loc == want_loc,
            "descriptor ring_loc {ring_loc}, expected {want_loc}"
        );
        let proxy = if mode.proxied() {
            let svc = ProxyService::start(ProxyConfig::default())?;
            // The handle is not needed: the service (dropped with the pair) releases the target.
            let _handle = svc.add(ProxyTarget::for_qp(&qa)?)?;
            Some(svc)
        } else {
            None
        };
        Ok(Self {
            a,
            qa,
            qb,
            src,
            dst,
            src_mr,
            dst_mr,
            src_d,
            export,
            gpu,
            _b: b,
            _proxy: proxy,
        })
    }
}

/// Which backend the suite drives: the in-process soft NIC, or rdma-core's `mlx5_0` and
/// `mlx5_1` (`gpu-test --backend mlx5`, run under `gpuverbs emu --devices 2`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Soft,
    Mlx5,
}

/// Set once by `main` from the command line.
pub static BACKEND: std::sync::OnceLock<Backend> = std::sync::OnceLock::new();

pub fn backend() -> Backend {
    *BACKEND.get().unwrap_or(&Backend::Soft)
}

/// A case that does not apply to this backend, and why (printed as `SKIP`).
#[derive(Debug)]
pub struct Skip(pub String);

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Skip {}

/// Skips the case on the mlx5 backend when `cond`, saying why.
pub fn skip_on_mlx5(cond: bool, why: &str) -> Result<()> {
    if cond && backend() == Backend::Mlx5 {
        return Err(Skip(format!("mlx5 backend: {why}")).into());
    }
    Ok(())
}

/// The two devices a case connects: two soft NICs, or `mlx5_0` and `mlx5_1`.
pub fn contexts() -> Result<(Context, Context)> {
    Ok(match backend() {
        Backend::Soft => (
            Context::open(DeviceRequest::Soft)?,
            Context::open(DeviceRequest::Soft)?,
        ),
        Backend::Mlx5 => (
            Context::open(DeviceRequest::Named("mlx5_0".into()))?,
            Context::open(DeviceRequest::Named("mlx5_1".into()))?,
        ),
    })
}

/// The soft NIC's counters of `ctx`; `None` on an rdma-core device (which has no such
/// counters: checks that need them are not made, and the case says so).
pub fn counters(ctx: &Context) -> Option<gpuverbs::soft::CounterSnapshot> {
    ctx.soft_device().map(|d| d.counters())
}

/// Connects `qa` and `qb` to each other, granting `access` to the peer (10 ≈ 4 ms timeout,
/// 3 retries).
fn connect_both(qa: &Qp, qb: &Qp, access: Access) -> Result<()> {
    let conn = ConnectOptions {
        access,
        timeout: 10,
        retry_cnt: 3,
        ..Default::default()
    };
    qa.connect(&qb.endpoint(), conn)?;
    qb.connect(&qa.endpoint(), conn)?;
    Ok(())
}

/// Status words a kernel reports: [status, syndrome, vendor, wqe_counter, reached, ...].
pub struct Status {
    mem: gpuverbs::gpu::DeviceMem,
}

impl Status {
    pub fn new(gpu: &Arc<Gpu>) -> Result<Self> {
        Ok(Self {
            mem: gpu.alloc(32)?,
        })
    }
    pub fn ptr(&self) -> u64 {
        self.mem.ptr()
    }
    pub fn read(&self) -> Result<[i32; 8]> {
        let mut b = [0u8; 32];
        self.mem.read(0, &mut b)?;
        Ok(bytemuck::cast(b))
    }
    /// Fails unless every thread reported OK.
    pub fn expect_ok(&self) -> Result<()> {
        let s = self.read()?;
        if s[0] != 0 {
            bail!(
                "kernel status {} (syndrome {:#04x}, vendor {:#04x}, wqe {})",
                status_name(s[0]),
                s[1],
                s[2],
                s[3]
            );
        }
        Ok(())
    }
}

pub fn status_name(s: i32) -> &'static str {
    match s {
        0 => "OK",
        1 => "ERROR_CQE",
        2 => "TIMEOUT",
        3 => "INVALID",
        4 => "BUSY",
        5 => "FULL",
        6 => "BROKEN",
        _ => "?",
    }
}

/// The suite's own kernels (`crates/gpu-tests/kernels`, built by this crate's build script),
/// 16-byte aligned as the driver wants a fatbin; empty when the build found no nvcc.
#[repr(C, align(16))]
struct Aligned<B: ?Sized>(B);
static OWN_KERNELS: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(
    env!("OUT_DIR"),
    "/gpu_tests_kernels.fatbin"
)));

/// Launches `name`, one of the suite's own kernels, on `gpu` (its module loaded into the
/// context gpuverbs opened for the launch) and waits for it.
///
/// # Safety
/// As [`Gpu::launch_sync`]: `params` match the kernel's parameters and point at live values.
pub unsafe fn launch_own(
    gpu: &Gpu,
    name: &str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    params: &mut [*mut c_void],
) -> Result<()> {
    ensure!(
        !OWN_KERNELS.0.is_empty(),
        "gpu-test was built without nvcc: its own kernels ({name}) are missing (build it with \
         GPUVERBS_REQUIRE_NVCC=1, as `cargo xtask gpu-test` does)"
    );
    let module = gpu.load_module(&OWN_KERNELS.0)?;
    // SAFETY: forwarded contract.
    unsafe { gpu.launch_sync_in(&module, name, grid, block, 0, params)? };
    Ok(())
}

/// Pointer-to-local helper for kernel parameter arrays.
pub fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}
