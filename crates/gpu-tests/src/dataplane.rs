//! Data-path cases: kernels drive exported soft-NIC QPs through the device API; the host checks
//! every byte and every status.

use anyhow::{bail, ensure, Context as _, Result};
use gpuverbs::gpu::{DeviceMem, ExportedQp, Gpu};
use gpuverbs::post::{Completion, CtrlFlags, Local, Op, RingMode};
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
    /// The proxy thread ringing for a CPU-proxy QP.
    _proxy: Option<ProxyService>,
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
        skip_on_mlx5(
            rings == RingPlacement::Gpu,
            "GPU-resident rings need DEVX (not yet)",
        )?;
        skip_on_mlx5(
            cq_mode == CqMode::Collapsed,
            "collapsed CQs need DEVX (not yet)",
        )?;
        // rdma-core's CQs always detect overrun; the device API keeps their consumer index
        let cq_mode = if backend() == Backend::Mlx5 {
            CqMode::OverrunDetect
        } else {
            cq_mode
        };
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
        ensure!(
            qa.placement() == rings && cqa.placement() == rings,
            "rings not where asked"
        );
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
        let proxy = if mode == DoorbellMode::CpuProxy {
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
pub fn counters(ctx: &Context) -> Option<softnic::CounterSnapshot> {
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

/// Pointer-to-local helper for kernel parameter arrays.
pub fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

/// The shape of one `gv_test_put` launch.
#[derive(Clone, Copy, Debug)]
pub struct PutArgs {
    pub grid: u32,
    pub block: u32,
    /// 0 thread, 1 warp, 2 block.
    pub scope: u32,
    /// Threads with index % skip_mod == skip_mod - 1 do not take part (0: all do).
    pub skip_mod: u32,
    pub size: u32,
    pub iters: u32,
    pub signal_every: u32,
    pub budget_ns: u64,
}

impl PutArgs {
    /// One thread writing one signaled message of `size` bytes.
    pub fn single(size: u32, budget_ns: u64) -> Self {
        Self {
            grid: 1,
            block: 1,
            scope: 0,
            skip_mod: 0,
            size,
            iters: 1,
            signal_every: 1,
            budget_ns,
        }
    }
    fn takes_part(&self, thread: u64) -> bool {
        let m = self.skip_mod as u64;
        m == 0 || (thread % self.block as u64) % m != m - 1
    }
}

impl Pair {
    /// Launches `gv_test_put` with rkey `rk` and returns the kernel's status words.
    pub fn launch_put(&self, a: &PutArgs, rk: u32) -> Result<Status> {
        let threads = a.grid as u64 * a.block as u64;
        ensure!(
            threads * a.iters as u64 * a.size as u64 <= self.dst.len() as u64,
            "buffers too small"
        );
        let st = Status::new(&self.gpu)?;
        let (mut q, mut lbase, mut lk, mut rbase, mut rk) = (
            self.export.ptr(),
            self.src_d,
            self.src_mr.lkey().0,
            self.dst_mr.addr(),
            rk,
        );
        let (mut size, mut iters, mut scope, mut skip, mut sig, mut budget, mut out) = (
            a.size,
            a.iters,
            a.scope,
            a.skip_mod,
            a.signal_every,
            a.budget_ns,
            st.ptr(),
        );
        let mut params = [
            arg(&mut q),
            arg(&mut lbase),
            arg(&mut lk),
            arg(&mut rbase),
            arg(&mut rk),
            arg(&mut size),
            arg(&mut iters),
            arg(&mut scope),
            arg(&mut skip),
            arg(&mut sig),
            arg(&mut budget),
            arg(&mut out),
        ];
        // SAFETY: the parameters match gv_test_put's signature; q, lbase (mapped host memory)
        // and out are live device-visible memory for the whole launch; rbase is only used as a
        // remote address (checked by the device).
        unsafe {
            self.gpu.launch_sync(
                "gv_test_put",
                (a.grid, 1, 1),
                (a.block, 1, 1),
                0,
                &mut params,
            )?
        };
        Ok(st)
    }
}

/// Launches `gv_test_put` and checks every written byte.
pub fn run_put(p: &Pair, a: &PutArgs) -> Result<String> {
    p.launch_put(a, p.dst_mr.rkey().0)?.expect_ok()?;
    let (src, dst) = (p.src.to_vec()?, p.dst.to_vec()?);
    let mut msgs = 0u64;
    for t in 0..a.grid as u64 * a.block as u64 {
        for i in 0..a.iters as u64 {
            let off = ((t * a.iters as u64 + i) * a.size as u64) as usize;
            let range = off..off + a.size as usize;
            if a.takes_part(t) {
                ensure!(
                    dst[range.clone()] == src[range.clone()],
                    "thread {t} message {i}: bytes differ"
                );
                msgs += 1;
            } else {
                ensure!(
                    dst[range].iter().all(|&b| b == 0),
                    "thread {t} (not taking part) wrote bytes"
                );
            }
        }
    }
    let d = p.export.read()?;
    ensure!(
        d.sq_retired == d.sq_ready && d.sq_ready == d.sq_rung,
        "counters: {d:?}"
    );
    Ok(format!(
        "{msgs} messages of {} B verified, {} blocks",
        a.size, d.sq_ready
    ))
}

/// A `put` case: doorbell mode, SQ size, launch shape, payload and ring placement.
pub struct PutCase {
    pub mode: DoorbellMode,
    pub sq_blocks: u32,
    pub args: PutArgs,
    pub mem: Mem,
    pub rings: RingPlacement,
}

pub fn put_case(ordinal: usize, c: &PutCase) -> Result<String> {
    let a = &c.args;
    let bytes = (a.grid * a.block * a.iters * a.size) as usize;
    let spec = PairSpec {
        mode: c.mode,
        bytes,
        sq_blocks: c.sq_blocks,
        mem: c.mem,
        rings: c.rings,
    };
    let p = Pair::with(ordinal, spec)?;
    let r = run_put(&p, a)?;
    let Some(dev) = counters(&p.a) else {
        return Ok(format!("{r}; device counters not available (mlx5)"));
    };
    ensure!(dev.errors.is_empty(), "device errors: {:?}", dev.errors);
    Ok(format!("{r}; {} doorbells", dev.doorbells_seen))
}

/// The QP passes from a kernel to the CPU initiator and back to a kernel: each poster continues
/// where the last left the queue (producer, blocks not yet retired, CQ consumer index), with
/// unsignaled WQEs left behind by the CPU; every byte and the final counters checked.
pub fn poster_handover(ordinal: usize) -> Result<String> {
    let a = PutArgs {
        grid: 1,
        block: 32,
        scope: 0,
        skip_mod: 0,
        size: 64,
        iters: 2,
        signal_every: 1,
        budget_ns: 2_000_000_000,
    };
    let p = Pair::new(ordinal, DoorbellMode::GpuDoorbell, 64 * 64, 64)?;
    run_put(&p, &a)?;
    let first = p.export.read()?.sq_rung;
    let Pair {
        a: ctx,
        qa,
        qb,
        src,
        dst,
        src_mr,
        dst_mr,
        src_d,
        export,
        gpu,
        _b,
        _proxy,
    } = p;
    drop(export);
    // the CPU: two unsignaled WRITEs and a signaled one, then one unsignaled left behind
    let zeros = vec![0u8; dst.len()];
    dst.write(0, &zeros)?;
    let mut ini = qa.try_cpu_initiator(RingMode::RdmaCore)?;
    ensure!(
        u64::from(ini.producer()) == first & 0xffff,
        "the CPU initiator starts at {}, the kernel left the queue at {first}",
        ini.producer()
    );
    let unsig = CtrlFlags {
        signaled: false,
        ..CtrlFlags::SIGNALED
    };
    let sges: Vec<_> = (0..4u64).map(|k| [src_mr.sge(k * 64, 64)]).collect();
    let w = |k: usize| Op::Write {
        remote: dst_mr.remote(k as u64 * 64),
        local: Local::Sges(&sges[k]),
        imm: None,
    };
    ini.post(&w(0), unsig)?;
    ini.post(&w(1), unsig)?;
    ini.post_and_ring(&w(2), CtrlFlags::SIGNALED)?;
    let c = ini.wait_send(std::time::Duration::from_secs(10))?;
    ensure!(matches!(c, Completion::Req { .. }), "{c:?}");
    ini.post_and_ring(&w(3), unsig)?;
    let left = ini.producer();
    drop(ini);
    let t = std::time::Instant::now();
    let (srcv, mut dstv) = (src.to_vec()?, dst.to_vec()?);
    while dstv[..256] != srcv[..256] && t.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(1));
        dstv = dst.to_vec()?;
    }
    ensure!(dstv[..256] == srcv[..256], "the CPU's WRITEs did not land");
    // a kernel again, on a new export
    dst.write(0, &zeros)?;
    let export = gpu.export_qp(&qa)?;
    let d = export.read()?;
    ensure!(
        d.sq_rung & 0xffff == u64::from(left),
        "the new export starts at {}, the CPU left the queue at {left}",
        d.sq_rung
    );
    let p = Pair {
        a: ctx,
        qa,
        qb,
        src,
        dst,
        src_mr,
        dst_mr,
        src_d,
        export,
        gpu,
        _b,
        _proxy,
    };
    let r = run_put(&p, &a)?;
    Ok(format!(
        "kernel (to block {first}) -> CPU initiator (3 WRITEs, 1 left unsignaled, to block \
         {left}) -> kernel: {r}"
    ))
}

/// One thread, exclusive sharing on a register copy of the descriptor (checkout / checkin),
/// many laps of a 64-block ring (in host or GPU memory); the descriptor read back afterwards
/// must hold the state the copy reached.
pub fn exclusive_wrap(ordinal: usize, mode: DoorbellMode, rings: RingPlacement) -> Result<String> {
    let (iters, size) = (2000u32, 32u32);
    let spec = PairSpec {
        mode,
        bytes: (iters * size) as usize,
        sq_blocks: 64,
        mem: Mem::Host,
        rings,
    };
    let p = Pair::with(ordinal, spec)?;
    let st = Status::new(&p.gpu)?;
    let (mut q, mut lbase, mut lk, mut rbase, mut rk) = (
        p.export.ptr(),
        p.src_d,
        p.src_mr.lkey().0,
        p.dst_mr.addr(),
        p.dst_mr.rkey().0,
    );
    let (mut size_, mut iters_, mut sig, mut budget, mut out) =
        (size, iters, 16u32, BUDGET_NS, st.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut lbase),
        arg(&mut lk),
        arg(&mut rbase),
        arg(&mut rk),
        arg(&mut size_),
        arg(&mut iters_),
        arg(&mut sig),
        arg(&mut budget),
        arg(&mut out),
    ];
    // SAFETY: parameters match gv_test_put_exclusive; pointers are live device-visible memory.
    unsafe {
        p.gpu.launch_sync(
            "gv_test_put_exclusive",
            (1, 1, 1),
            (1, 1, 1),
            0,
            &mut params,
        )?
    };
    st.expect_ok()?;
    ensure!(
        p.dst.to_vec()? == p.src.to_vec()?[..p.dst.len()],
        "bytes differ"
    );
    let d = p.export.read()?;
    ensure!(
        d.sq_ready / 64 >= 30,
        "only {} blocks: fewer than 30 laps (state not checked in?)",
        d.sq_ready
    );
    // quiet returned OK, so everything posted retired; checkin wrote that back, released the
    // QP, and the BUSY calls made while it was checked out posted nothing.
    ensure!(
        d.sq_ready == u64::from(iters),
        "{} blocks published for {iters} one-block writes",
        d.sq_ready
    );
    ensure!(d.checked_out == 0, "the QP is still checked out");
    ensure!(
        d.sq_retired == d.sq_ready && d.sq_rung == d.sq_ready && d.sq_reserved == d.sq_ready,
        "descriptor after checkin: reserved {} ready {} rung {} retired {}",
        d.sq_reserved,
        d.sq_ready,
        d.sq_rung,
        d.sq_retired
    );
    let Some(dev) = counters(&p.a) else {
        return Ok(format!(
            "{iters} writes over {} laps of a 64-block SQ verified; device counters not \
             available (mlx5)",
            iters / 64
        ));
    };
    ensure!(dev.errors.is_empty(), "device errors: {:?}", dev.errors);
    ensure!(
        (mode == DoorbellMode::BlueFlame) == (dev.bf_run > 0),
        "{} WQEs ran from BlueFlame copies in {mode:?} mode",
        dev.bf_run
    );
    Ok(format!(
        "{iters} writes over {} laps of a 64-block SQ verified; {} WQEs from BlueFlame copies, {} \
         copies torn",
        d.sq_ready / 64,
        dev.bf_run,
        dev.bf_torn
    ))
}

/// put_inline, put_signal, signal, get, fetch-add, compare-swap from one thread; payload,
/// atomic targets, results and the signal word in `mem`, side A's rings in `rings`.
pub fn ops(ordinal: usize, mode: DoorbellMode, mem: Mem, rings: RingPlacement) -> Result<String> {
    let spec = PairSpec {
        mode,
        bytes: 4096,
        sq_blocks: 64,
        mem,
        rings,
    };
    let p = Pair::with(ordinal, spec)?;
    // remote words for the atomics; remote bytes for the get
    p.dst.write(1024, &100u64.to_ne_bytes())?;
    p.dst.write(1032, &11u64.to_ne_bytes())?;
    let pattern: Vec<u8> = (0..64).map(|i| 0x40 + i as u8).collect();
    p.dst.write(256, &pattern)?;
    let sig = Buf::new(&p.gpu, mem, 8)?;
    let sig_mr = sig.register(p.qb.pd(), Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
    let st = Status::new(&p.gpu)?;
    let (mut q, mut lbase, mut lk, mut rbase, mut rk) = (
        p.export.ptr(),
        p.src_d,
        p.src_mr.lkey().0,
        p.dst_mr.addr(),
        p.dst_mr.rkey().0,
    );
    let (mut sig_addr, mut sig_key, mut budget, mut out) =
        (sig_mr.addr(), sig_mr.rkey().0, BUDGET_NS, st.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut lbase),
        arg(&mut lk),
        arg(&mut rbase),
        arg(&mut rk),
        arg(&mut sig_addr),
        arg(&mut sig_key),
        arg(&mut budget),
        arg(&mut out),
    ];
    // SAFETY: parameters match gv_test_ops; pointers are live device-visible memory.
    unsafe {
        p.gpu
            .launch_sync("gv_test_ops", (1, 1, 1), (1, 1, 1), 0, &mut params)?
    };
    st.expect_ok()?;
    let (src, dst) = (p.src.to_vec()?, p.dst.to_vec()?);
    let inline: Vec<u8> = (0..40).map(|i| 0xA0 + i as u8).collect();
    ensure!(dst[..40] == inline[..], "put_inline bytes differ");
    ensure!(
        dst[600..637] == inline[1..38] && dst[637..640] == [0, 0, 0],
        "put_inline from an unaligned source: {:02x?}",
        &dst[600..640]
    );
    ensure!(
        dst[700..706] == inline[4..10] && dst[706..708] == [0, 0],
        "put_inline of a cut word: {:02x?}",
        &dst[700..708]
    );
    ensure!(dst[64..128] == src[64..128], "put_signal payload differs");
    let s = u64::from_ne_bytes(sig.to_vec()?[..8].try_into()?);
    ensure!(s == 6, "signal word {s}, expected 1 + 5");
    ensure!(src[512..576] == pattern[..], "get bytes differ");
    let word = |b: &[u8], o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap());
    ensure!(
        word(&dst, 1024) == 107 && word(&src, 1024) == 100,
        "fetch-add: target {} old {}",
        word(&dst, 1024),
        word(&src, 1024)
    );
    ensure!(
        word(&dst, 1032) == 22 && word(&src, 1032) == 11,
        "compare-swap: target {} old {}",
        word(&dst, 1032),
        word(&src, 1032)
    );
    if let Some(c) = counters(&p.a) {
        ensure!(
            c.errors.is_empty() && c.device_memory_errors == 0,
            "device: {c:?}"
        );
    }
    Ok(format!(
        "inline, put_signal, signal, get, fetch-add, compare-swap verified (payload {mem:?}, \
         rings {rings:?})"
    ))
}

/// A bad rkey comes back to the kernel as an error CQE with REMOTE_ACCESS; the WQEs behind it
/// are flushed (each with its own WR_FLUSH CQE) and retired, so quiet returns instead of
/// spinning; the next operation on the QP (now in ERR) fails at once.
pub fn bad_rkey(ordinal: usize, rings: RingPlacement) -> Result<String> {
    let spec = PairSpec {
        mode: DoorbellMode::GpuDoorbell,
        bytes: 4096,
        sq_blocks: 64,
        mem: Mem::Host,
        rings,
    };
    let p = Pair::with(ordinal, spec)?;
    let one = PutArgs::single(64, BUDGET_NS);
    let eight = PutArgs { iters: 8, ..one };
    let s = p.launch_put(&eight, p.dst_mr.rkey().0 ^ 0x5500)?.read()?;
    ensure!(
        s[0] == 1 && s[1] == 0x13,
        "expected ERROR_CQE REMOTE_ACCESS, got {} syndrome {:#x}",
        status_name(s[0]),
        s[1]
    );
    let err = prm::ErrorCqe {
        responder: false,
        syndrome: s[1] as u8,
        vendor_syndrome: s[2] as u8,
        wqe_opcode: 0x08,
        qpn: p.qa.qpn(),
        wqe_counter: s[3] as u16,
    };
    ensure!(
        p.dst.to_vec()?.iter().all(|&b| b == 0),
        "bytes landed despite the bad key"
    );
    ensure!(
        p.qa.state() == gpuverbs::queue::QpState::Err,
        "QP not in ERR"
    );
    let d = p.export.read()?;
    if let Some(c) = counters(&p.a) {
        let flushed = c.errors_of(prm::Syndrome::WrFlush);
        ensure!(
            c.errors_of(prm::Syndrome::RemoteAccess) == 1 && flushed + 1 == d.sq_ready,
            "{} blocks posted, errors {:?}",
            d.sq_ready,
            c.errors
        );
    }
    ensure!(
        d.sq_retired == d.sq_ready,
        "not all flushed WQEs retired: {d:?}"
    );
    let s2 = p.launch_put(&one, p.dst_mr.rkey().0)?.read()?;
    ensure!(
        s2[0] == 1,
        "a post on a QP in ERR returned {}",
        status_name(s2[0])
    );
    // the device API retired every WQE posted after the failed one (flushes)
    let flushed = d.sq_ready.saturating_sub(1);
    Ok(format!(
        "kernel saw: {err}; {flushed} later WQEs flushed and retired; next post on the ERR QP \
         failed at once"
    ))
}

/// A dropped doorbell makes the kernel's quiet return TIMEOUT within its budget, not hang.
pub fn dropped_doorbell_timeout(ordinal: usize) -> Result<String> {
    skip_on_mlx5(
        true,
        "needs the soft NIC's fault injection (dropped doorbells)",
    )?;
    let p = Pair::new(ordinal, DoorbellMode::GpuDoorbell, 4096, 64)?;
    p.qa.soft()
        .expect("a soft-NIC QP")
        .inject(softnic::Fault::DropDoorbells(1));
    let t = std::time::Instant::now();
    let st = p.launch_put(&PutArgs::single(64, 50_000_000), p.dst_mr.rkey().0)?;
    let s = st.read()?;
    ensure!(s[0] == 2, "expected TIMEOUT, got {}", status_name(s[0]));
    let c = p.a.soft_device().expect("soft").counters();
    ensure!(c.doorbells_dropped == 1, "counters: {c:?}");
    Ok(format!(
        "TIMEOUT after {:.1?} with a 50 ms budget",
        t.elapsed()
    ))
}

/// wait_signal on a word nobody signals returns TIMEOUT; on a word already at the value, OK.
pub fn wait_signal(ordinal: usize) -> Result<String> {
    let gpu = gpu(ordinal)?;
    let word = HostBuffer::new(8);
    let d = gpu.map_host(&word)?;
    let mut results = Vec::new();
    for (value, preset, want) in [(1u64, 0u64, 2), (3, 3, 0)] {
        word.write(0, &preset.to_ne_bytes());
        let st = Status::new(&gpu)?;
        let (mut sig, mut v, mut budget, mut out) = (d, value, 20_000_000u64, st.ptr());
        let mut params = [arg(&mut sig), arg(&mut v), arg(&mut budget), arg(&mut out)];
        // SAFETY: parameters match gv_test_wait_signal; `d` is the mapped word.
        unsafe { gpu.launch_sync("gv_test_wait_signal", (1, 1, 1), (1, 1, 1), 0, &mut params)? };
        let s = st.read()?;
        ensure!(
            s[0] == want,
            "wait for {value} with {preset}: {}",
            status_name(s[0])
        );
        results.push(status_name(s[0]));
    }
    Ok(format!(
        "unsignaled: {}, already signaled: {}",
        results[0], results[1]
    ))
}

/// Many CTAs, each driving a private QP of its own pair (CTA sharing): every byte of every pair
/// checked.
pub fn private_qps(ordinal: usize, mode: DoorbellMode) -> Result<String> {
    let (ctas, threads, iters, size) = (8u32, 64u32, 8u32, 64u32);
    let bytes = (threads * iters * size) as usize;
    let pairs: Vec<Pair> = (0..ctas)
        .map(|_| Pair::new(ordinal, mode, bytes, 256))
        .collect::<Result<_>>()?;
    let gpu = pairs[0].gpu.clone();
    let array = |words: Vec<u8>| -> Result<gpuverbs::gpu::DeviceMem> {
        let m = gpu.alloc(words.len())?;
        m.write(0, &words)?;
        Ok(m)
    };
    let qps = array(
        pairs
            .iter()
            .flat_map(|p| p.export.ptr().to_ne_bytes())
            .collect(),
    )?;
    let lbases = array(pairs.iter().flat_map(|p| p.src_d.to_ne_bytes()).collect())?;
    let lks = array(
        pairs
            .iter()
            .flat_map(|p| p.src_mr.lkey().0.to_ne_bytes())
            .collect(),
    )?;
    let rbases = array(
        pairs
            .iter()
            .flat_map(|p| p.dst_mr.addr().to_ne_bytes())
            .collect(),
    )?;
    let rks = array(
        pairs
            .iter()
            .flat_map(|p| p.dst_mr.rkey().0.to_ne_bytes())
            .collect(),
    )?;
    let st = Status::new(&gpu)?;
    let (mut a, mut b, mut c, mut d, mut e) =
        (qps.ptr(), lbases.ptr(), lks.ptr(), rbases.ptr(), rks.ptr());
    let (mut size_, mut iters_, mut budget, mut out) = (size, iters, BUDGET_NS, st.ptr());
    let mut params = [
        arg(&mut a),
        arg(&mut b),
        arg(&mut c),
        arg(&mut d),
        arg(&mut e),
        arg(&mut size_),
        arg(&mut iters_),
        arg(&mut budget),
        arg(&mut out),
    ];
    // SAFETY: parameters match gv_test_put_private; the arrays hold one entry per CTA and
    // every pointer in them is live device-visible memory for the whole launch.
    unsafe {
        gpu.launch_sync(
            "gv_test_put_private",
            (ctas, 1, 1),
            (threads, 1, 1),
            0,
            &mut params,
        )?
    };
    st.expect_ok()?;
    for (i, p) in pairs.iter().enumerate() {
        ensure!(
            p.dst.to_vec()? == p.src.to_vec()?,
            "CTA {i}: destination differs from source"
        );
        let desc = p.export.read()?;
        ensure!(desc.sq_retired == desc.sq_ready, "CTA {i}: {desc:?}");
    }
    Ok(format!(
        "{ctas} CTAs x {threads} threads, each CTA on its own QP: {} messages of {size} B verified",
        ctas * threads * iters
    ))
}

/// A collapsed send CQ (every CQE in slot 0): the device API takes slot 0 whenever its last word
/// changes and retires up to the WQE it names; puts, quiet and the bytes all check out.
pub fn collapsed_cq(ordinal: usize) -> Result<String> {
    let a = PutArgs {
        grid: 2,
        block: 64,
        scope: 0,
        skip_mod: 0,
        size: 64,
        iters: 8,
        signal_every: 4,
        budget_ns: BUDGET_NS,
    };
    let spec = PairSpec {
        mode: DoorbellMode::GpuDoorbell,
        bytes: (a.grid * a.block * a.iters * a.size) as usize,
        sq_blocks: 256,
        mem: Mem::Host,
        rings: RingPlacement::HostMapped,
    };
    let p = Pair::build(ordinal, spec, CqMode::Collapsed)?;
    let r = run_put(&p, &a)?;
    Ok(format!("{r} (collapsed send CQ)"))
}

/// What [`recv`] varies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvCase {
    /// The sends gather from B's source buffer.
    Gather,
    /// The sends are `send_inline` calls copying the source (mapped into the GPU) into their
    /// WQEs.
    InlineSends,
    /// A's one receive buffer is half the message: A's receive completes with LOCAL_LENGTH and
    /// B's send with REMOTE_INVAL_REQ, both seen by the kernel.
    TooSmall,
}

/// Receive side on the GPU: one kernel thread on side B writes with immediate, sends and sends
/// with immediate to side A, where another kernel thread has posted the receive buffers and
/// takes the receive completions (A's rings, receive CQ included, in `rings`; B rings in
/// `mode`). The host checks every completion field and every byte. [`RecvCase`] says what
/// varies.
pub fn recv(
    ordinal: usize,
    mode: DoorbellMode,
    rings: RingPlacement,
    case: RecvCase,
) -> Result<String> {
    let too_small = case == RecvCase::TooSmall;
    let (n_imm, n_send, size) = match case {
        RecvCase::TooSmall => (0u32, 1u32, 256u32),
        RecvCase::Gather => (24, 24, 256),
        // Payloads that fill several WQE blocks, none a multiple of 16 bytes.
        RecvCase::InlineSends => (4, 24, 180),
    };
    let rsize = if too_small { size / 2 } else { size };
    let n = (n_imm + n_send) as usize;
    skip_on_mlx5(
        rings == RingPlacement::Gpu,
        "GPU-resident rings need DEVX (not yet)",
    )?;
    let gpu = gpu(ordinal)?;
    let (a, b) = contexts()?;
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let cq_a = |depth| {
        a.create_cq_on(
            &gpu,
            CqOptions {
                depth,
                placement: rings,
                ..Default::default()
            },
        )
    };
    let (scq_a, rcq_a) = (cq_a(64)?, cq_a(64)?);
    let mut oa = QpOptions::new(&scq_a, &rcq_a);
    oa.rq_wqes = 64;
    // A only receives: an SQ no deeper than its send CQ (an exported mlx5 QP must have that)
    oa.sq_blocks = 64;
    oa.placement = rings;
    let qa = pa.create_qp_on(&gpu, oa)?;
    let (scq_b, rcq_b) = (
        b.create_cq(CqOptions::default())?,
        b.create_cq(CqOptions::default())?,
    );
    let mut ob = QpOptions::new(&scq_b, &rcq_b);
    ob.doorbell = mode;
    let qb = pb.create_qp(ob)?;
    connect_both(&qa, &qb, Access::REMOTE_WRITE)?;
    // B's source; A's write-with-immediate target, then its receive buffers.
    let src = HostBuffer::new(n * size as usize);
    let pattern: Vec<u8> = (0..src.len())
        .map(|j| (j as u32).wrapping_mul(2654435761) as u8 | 1)
        .collect();
    src.write(0, &pattern);
    let recv_off = n_imm as usize * size as usize;
    let dst = HostBuffer::new(recv_off + n * rsize as usize);
    let src_mr = pb.register(&src)?;
    let dst_mr = pa.register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let (ea, eb) = (gpu.export_qp(&qa)?, gpu.export_qp(&qb)?);
    let _proxy = if mode == DoorbellMode::CpuProxy {
        let svc = ProxyService::start(ProxyConfig::default())?;
        let _handle = svc.add(ProxyTarget::for_qp(&qb)?)?;
        Some(svc)
    } else {
        None
    };
    let ready = gpu.alloc(4)?;
    ready.write(0, &[0; 4])?;
    let comps = gpu.alloc(16 * n)?;
    comps.write(0, &vec![0xff; 16 * n])?;
    let (st_recv, st_send) = (Status::new(&gpu)?, Status::new(&gpu)?);
    let (mut sq, mut rq) = (eb.ptr(), ea.ptr());
    let (mut src_a, mut slk) = (src_mr.addr(), src_mr.lkey().0);
    let mut src_dev = match case {
        RecvCase::InlineSends => gpu.map_host(&src)?,
        _ => 0u64,
    };
    let (mut dst_a, mut drk) = (dst_mr.addr(), dst_mr.rkey().0);
    let (mut size_, mut n_imm_, mut n_send_) = (size, n_imm, n_send);
    let (mut rbuf, mut rlk, mut rsize_) = (dst_mr.addr() + recv_off as u64, dst_mr.lkey().0, rsize);
    let (mut ready_p, mut comps_p, mut budget) = (ready.ptr(), comps.ptr(), BUDGET_NS);
    let (mut out_r, mut out_s) = (st_recv.ptr(), st_send.ptr());
    let mut params = [
        arg(&mut sq),
        arg(&mut rq),
        arg(&mut src_a),
        arg(&mut slk),
        arg(&mut src_dev),
        arg(&mut dst_a),
        arg(&mut drk),
        arg(&mut size_),
        arg(&mut n_imm_),
        arg(&mut n_send_),
        arg(&mut rbuf),
        arg(&mut rlk),
        arg(&mut rsize_),
        arg(&mut ready_p),
        arg(&mut comps_p),
        arg(&mut budget),
        arg(&mut out_r),
        arg(&mut out_s),
    ];
    // SAFETY: parameters match gv_test_recv; the descriptors, the flag, the completion array
    // and the status words are live GPU memory for the whole launch, and the NIC addresses
    // belong to regions registered above (alive until this function returns).
    unsafe { gpu.launch_sync("gv_test_recv", (2, 1, 1), (1, 1, 1), 0, &mut params)? };
    if too_small {
        let (r, s) = (st_recv.read()?, st_send.read()?);
        ensure!(
            r[0] == 1 && r[1] == 0x01,
            "receiver: {} syndrome {:#04x}, expected ERROR_CQE LOCAL_LENGTH (0x01)",
            status_name(r[0]),
            r[1]
        );
        ensure!(
            s[0] == 1 && s[1] == 0x12,
            "sender: {} syndrome {:#04x}, expected ERROR_CQE REMOTE_INVAL_REQ (0x12)",
            status_name(s[0]),
            s[1]
        );
        return Ok(format!(
            "a {size} B send into a {rsize} B receive buffer: the receiving kernel got \
             LOCAL_LENGTH (vendor {:#04x}), the sending kernel REMOTE_INVAL_REQ",
            r[2]
        ));
    }
    st_recv.expect_ok().context("receiver")?;
    st_send.expect_ok().context("sender")?;
    let mut raw = vec![0u8; 16 * n];
    comps.read(0, &mut raw)?;
    let words: Vec<u32> = raw
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes(c.try_into().expect("4 bytes")))
        .collect();
    let (s, d) = (src.to_vec(), dst.to_vec());
    for k in 0..n {
        let c = &words[4 * k..4 * k + 4];
        let kk = k as u32;
        let want = if kk < n_imm {
            [1, 0x1000 + kk, size, kk]
        } else {
            let j = kk - n_imm;
            if j % 2 == 1 {
                [3, 0x2000 + j, size, kk]
            } else {
                [2, 0, size, kk]
            }
        };
        ensure!(
            c == want,
            "receive completion {k}: {{opcode, imm, bytes, wqe}} = {c:x?}, expected {want:x?}"
        );
        let sz = size as usize;
        let (from, to) = if kk < n_imm {
            (k * sz, k * sz)
        } else {
            (k * sz, recv_off + k * rsize as usize)
        };
        ensure!(
            d[to..to + sz] == s[from..from + sz],
            "message {k}: bytes differ"
        );
    }
    let da = ea.read()?;
    ensure!(
        da.rq_posted == n as u64 && da.rcq_ci == n as u64,
        "receiver descriptor: {} posted, {} receive CQEs taken",
        da.rq_posted,
        da.rcq_ci
    );
    let how = match case {
        RecvCase::InlineSends => " (the sends inline)",
        _ => "",
    };
    Ok(format!(
        "{n_imm} WRITE_IMM, {} SEND, {} SEND_IMM of {size} B{how}: every receive completion \
         (opcode, immediate, length, WQE) and every byte verified",
        n_send.div_ceil(2),
        n_send / 2
    ))
}

/// Budget of each status-path call, and how far past it a call may return (the clock's
/// granularity, launch noise).
const STATUS_BUDGET_NS: u64 = 2_000_000;
const STATUS_SLACK_NS: u64 = 1_000_000;

/// One QP for a status path: A has its own receive CQ (16 receives), an SQ of 64 blocks, a
/// host buffer to send from; B is its connected peer.
struct StatusSetup {
    qa: Qp,
    qb: Qp,
    _a: Context,
    _b: Context,
    pa: Pd,
    src: HostBuffer,
    src_mr: Mr,
    dst_mr: Mr,
    _dst: HostBuffer,
    export: Option<gpuverbs::gpu::ExportedQp>,
}

fn status_setup(gpu: &Arc<Gpu>) -> Result<StatusSetup> {
    let (a, b) = contexts()?;
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (scq, rcq) = (
        a.create_cq(CqOptions {
            depth: 64,
            ..Default::default()
        })?,
        a.create_cq(CqOptions {
            depth: 64,
            ..Default::default()
        })?,
    );
    let mut oa = QpOptions::new(&scq, &rcq);
    oa.sq_blocks = 64;
    oa.rq_wqes = 16;
    let qa = pa.create_qp(oa)?;
    let cqb = b.create_cq(CqOptions::default())?;
    let qb = pb.create_qp(QpOptions::new(&cqb, &cqb))?;
    connect_both(&qa, &qb, Access::REMOTE_WRITE)?;
    let src = HostBuffer::new(4096);
    let dst = HostBuffer::new(4096);
    let src_mr = pa.register_with(&src, Access::LOCAL_WRITE)?;
    let dst_mr = pb.register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    gpu.map_host(&src)?;
    let export = Some(gpu.export_qp(&qa)?);
    Ok(StatusSetup {
        qa,
        qb,
        _a: a,
        _b: b,
        pa,
        src,
        src_mr,
        dst_mr,
        _dst: dst,
        export,
    })
}

/// Runs gv_test_status case `which` on `st`: [status, ns, follow-up status, OK calls before].
fn launch_status(gpu: &Arc<Gpu>, st: &StatusSetup, which: u32, threads: u32) -> Result<[u64; 4]> {
    let out = gpu.alloc(32)?;
    out.write(0, &[0u8; 32])?;
    let export = st.export.as_ref().context("no export")?;
    let (mut q, mut w, mut budget) = (export.ptr(), which, STATUS_BUDGET_NS);
    let (mut laddr, mut lk) = (gpu.map_host(&st.src)?, st.src_mr.lkey().0);
    let (mut raddr, mut rk, mut o) = (st.dst_mr.addr(), st.dst_mr.rkey().0, out.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut w),
        arg(&mut budget),
        arg(&mut laddr),
        arg(&mut lk),
        arg(&mut raddr),
        arg(&mut rk),
        arg(&mut o),
    ];
    // SAFETY: the parameters match gv_test_status's signature; q, laddr (mapped host memory) and
    // out are live device-visible memory for the whole launch; raddr is only a remote address.
    unsafe { gpu.launch_sync("gv_test_status", (1, 1, 1), (threads, 1, 1), 0, &mut params)? };
    let mut b = [0u8; 32];
    out.read(0, &mut b)?;
    Ok(bytemuck::cast(b))
}

/// Every status path of the device API, each call timed: it must return its status within its
/// budget plus a small bound. The shared-publish timeout breaks the send queue (every later call
/// BROKEN) and the host recovers by resetting, reconnecting and exporting the QP again.
pub fn status_paths(ordinal: usize) -> Result<String> {
    let gpu = gpu(ordinal)?;
    let mut worst = 0u64;
    let mut seen = Vec::new();
    // (case, name, expected status, lock word the host holds, threads)
    let cases: [(u32, &str, i32, Option<&str>, u32); 9] = [
        (0, "reserve (SQ full)", 2, None, 1),
        (1, "doorbell lock", 2, Some("ring"), 1),
        (2, "receive lock", 2, Some("rq"), 1),
        (3, "recv_wait", 2, None, 1),
        (4, "wait_ticket", 2, None, 1),
        (5, "shared publish", 2, None, 2),
        (6, "post_recv", 5, None, 1),
        (7, "put_inline", 3, None, 1),
        (8, "quiet", 2, Some("ring"), 1),
    ];
    for (which, name, want, lock, threads) in cases {
        let mut st = status_setup(&gpu)?;
        if let Some(l) = lock {
            let export = st.export.as_ref().context("no export")?;
            let mut d = export.read()?;
            match l {
                "ring" => d.sq_rung = u64::MAX,
                _ => d.rq_lock = 1,
            }
            export.write(&d)?;
        }
        let r = launch_status(&gpu, &st, which, threads)?;
        ensure!(
            r[0] as i32 == want,
            "{name}: {} where {} was expected ({r:?})",
            status_name(r[0] as i32),
            status_name(want)
        );
        if want == 2 {
            ensure!(
                r[1] + 1000 >= STATUS_BUDGET_NS && r[1] <= STATUS_BUDGET_NS + STATUS_SLACK_NS,
                "{name}: TIMEOUT after {} ns for a budget of {STATUS_BUDGET_NS} ns",
                r[1]
            );
            worst = worst.max(r[1].saturating_sub(STATUS_BUDGET_NS));
        } else {
            ensure!(
                r[1] <= STATUS_SLACK_NS,
                "{name}: {} ns to say {}",
                r[1],
                status_name(want)
            );
        }
        match which {
            0 => ensure!(
                r[3] >= 1,
                "reserve: no put succeeded before the SQ filled: {r:?}"
            ),
            6 => ensure!(
                r[3] == 16,
                "post_recv: {} receives fitted a 16-entry RQ",
                r[3]
            ),
            5 => {
                ensure!(
                    r[2] as i32 == 6,
                    "after the publish timeout: {} (BROKEN expected)",
                    status_name(r[2] as i32)
                );
                let export = st.export.take().context("no export")?;
                ensure!(export.is_broken()?, "the descriptor does not say broken");
                drop(export);
                // the host recovers: reset, connect again, export again
                st.qa.modify(gpuverbs::Modify::Reset)?;
                st.qb.modify(gpuverbs::Modify::Reset)?;
                connect_both(&st.qa, &st.qb, Access::REMOTE_WRITE)?;
                st.export = Some(gpu.export_qp(&st.qa)?);
                let again = launch_status(&gpu, &st, 1, 1)?;
                ensure!(
                    again[0] == 0,
                    "after reset and a new export: {}",
                    status_name(again[0] as i32)
                );
            }
            _ => {}
        }
        let _ = &st.pa;
        seen.push(format!("{name} {}", status_name(want)));
    }
    Ok(format!(
        "{}; every TIMEOUT within {:.1} ms of its {} ms budget (worst {:.2} ms over); a broken \
         send queue recovered by reset and a new export",
        seen.join(", "),
        STATUS_SLACK_NS as f64 / 1e6,
        STATUS_BUDGET_NS / 1_000_000,
        worst as f64 / 1e6
    ))
}
