//! Device-side benchmarks of the gpuverbs device API on a GPU, against soft NICs.
//!
//! - `store64`: the ceiling of host-resident rings: 64-byte GPU stores into mapped host memory.
//! - `fence_store`: the floor of one doorbell: `fence.release.sys` + an 8-byte store (lowest of 5).
//! - `post_only`: kernels fill a ring deep enough for the whole run and ring the doorbell; the
//!   QP is not in RTS, so the device executes nothing and only device-side cost is timed. For
//!   1 thread, 1 warp, 1 block and many blocks, per doorbell mode and batch size.
//! - `post_complete`: the same against a QP in RTS whose soft NIC executes and completes every
//!   WQE (selective signaling, then quiet): the rate includes the soft NIC engine.
//! - `engines`: post and complete on 1, 2, 4, ... engine threads of the initiating soft NIC,
//!   `--engine-rounds` interleaved rounds (3), medians.
//! - `shapes`: issue 14's launch shapes (1 or N CTAs, a thread or a warp each, exclusive or
//!   GPU sharing, host or GPU rings), post only, five interleaved rounds, medians.
//! - `mlx5_shapes`: the GPU-ring shapes on soft-NIC QPs and on DEVX QPs of `mlx5_0` (rings in
//!   GPU memory through DEVX umems) in the same rounds; run under `gpuverbs emu --devices 2`.
//! - `gpunetio`: issue 14's launch shapes (1 or N CTAs, a thread or a warp each, exclusive or
//!   GPU sharing), post only, on QPs with the rings the device picks (`RingPlacement::Auto`),
//!   GPU doorbell: gpuverbs' gv_bench_post and NVIDIA GPUNetIO's own `doca_gpu_dev_verbs_put`
//!   on QP sets of identical config in the same five interleaved rounds; medians and
//!   gpuverbs / GPUNetIO per shape. Needs gpu_bench built with `GPUNETIO_SRC` (a checkout of
//!   NVIDIA's GPUNetIO, see `samples/build.rs`); soft NICs, or `--gpunetio-device mlx5` for
//!   DEVX QPs of `mlx5_0` under `gpuverbs emu --devices 2`.
//! - `counters`: completed, counted 8-byte WRITEs per second on one QP in RTS, GPU doorbell:
//!   put + poll (every put signaled, quiet at the end), put_counted (a software counter per
//!   block, wait_counter) and put_counter (a counter per block moved by the NIC through a
//!   companion QP, wait_counter over both), for 1 thread, 1 warp and 8 blocks of 64 threads.
//!
//! `gpu_bench [--gpu N] [--json] [--series post_only,post_complete,engines,shapes]
//! [--gpunetio-device soft|mlx5]`. Times come from %globaltimer inside the kernels.

use anyhow::{bail, ensure, Context as _, Result};
use clap::Parser;
use gpuverbs::gpu::{DeviceMem, ExportedQp, Gpu, GpuModule};
use gpuverbs::proxy::{ProxyConfig, ProxyService, ProxyTarget};
use gpuverbs::{
    Access, ConnectOptions, Context, CqOptions, DeviceRequest, DoorbellMode, HostBuffer, Mr, Qp,
    QpOptions, RingPlacement,
};
use std::ffi::c_void;
use std::sync::Arc;

#[derive(Parser)]
#[command(about = "Device-side post-rate benchmarks of the gpuverbs device API")]
struct Args {
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// Which series to run (the ceiling and the floor always run): post_only, post_complete,
    /// engines, shapes (the launch shapes of issue 14, five interleaved rounds, medians),
    /// mlx5_shapes (the GPU-ring shapes on soft-NIC QPs and on DEVX QPs of `mlx5_0`, in the
    /// same rounds; not by default: it runs under `gpuverbs emu --devices 2`), counters (put +
    /// poll next to the software and the NIC-moved counters), gpunetio (the launch shapes with
    /// gpuverbs and NVIDIA GPUNetIO's device code in the same rounds; not by default: it needs
    /// gpu_bench built with GPUNETIO_SRC).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "post_only,post_complete,engines,shapes,counters"
    )]
    series: Vec<String>,
    /// Engine-thread counts for the engine-scaling series (post and complete, 64 blocks each
    /// on its own QP, block scope): side A's soft NIC runs with each in turn; empty: skip it.
    #[arg(long, default_value = "1,2,4,8")]
    engines: Counts,
    /// Interleaved rounds of the engine-scaling series (each count once per round; medians).
    #[arg(long, default_value_t = 3)]
    engine_rounds: u32,
    /// The devices of the gpunetio series: `soft` (two soft NICs) or `mlx5` (`mlx5_0` and
    /// `mlx5_1`: run under `gpuverbs emu --devices 2`).
    #[arg(long, default_value = "soft", value_parser = ["soft", "mlx5"])]
    gpunetio_device: String,
}

/// A comma-separated list of counts; the empty string is the empty list (clap's own list
/// parsing refuses an empty value, which `--engines ""` means).
#[derive(Clone, Debug, PartialEq)]
struct Counts(Vec<u32>);

impl std::str::FromStr for Counts {
    type Err = std::num::ParseIntError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map(Counts)
    }
}

const BUDGET: u64 = 5_000_000_000;
/// The deepest SQ the soft NIC allows: a post-only run must fit in it.
const SQ_BLOCKS: u32 = 32768;

/// The median of `v` (sorted in place; the upper one of an even count).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs in M WQE/s with two decimals, space-separated (the runs behind a median).
fn runs_list(runs: &[f64]) -> String {
    let all: Vec<String> = runs.iter().map(|r| format!("{:.2}", r / 1e6)).collect();
    all.join(" ")
}

/// The lowest of `n` measurements (the floor-style lines: one level per launch, lowest kept).
fn lowest_of(n: u32, mut once: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..n {
        best = best.min(once()?);
    }
    Ok(best)
}

fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

/// Kernel-side timestamps [earliest start, latest end] and a status word.
struct Stamps {
    mem: DeviceMem,
}

impl Stamps {
    fn new(gpu: &Arc<Gpu>) -> Result<Self> {
        let mem = gpu.alloc(24)?;
        mem.write(0, &u64::MAX.to_ne_bytes())?;
        Ok(Self { mem })
    }
    fn t(&self) -> u64 {
        self.mem.ptr()
    }
    fn status(&self) -> u64 {
        self.mem.ptr() + 16
    }
    /// Elapsed ns, failing on a non-OK kernel status.
    fn elapsed_ns(&self) -> Result<f64> {
        let mut b = [0u8; 24];
        self.mem.read(0, &mut b)?;
        let w = |i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        let status = w(2) as u32 as i32;
        ensure!(
            status == 0,
            "kernel status {status} (1 error CQE, 2 timeout)"
        );
        ensure!(w(1) > w(0), "no time recorded");
        Ok((w(1) - w(0)) as f64)
    }
}

/// `nqps` QP pairs between two soft devices, side A exported.
struct Setup {
    _b: Context,
    a: Context,
    qps: Vec<(Qp, Qp, ExportedQp)>,
    ptrs: DeviceMem,
    src_mr: Mr,
    dst_mr: Mr,
    src_d: u64,
    _proxy: Option<ProxyService>,
    _bufs: (HostBuffer, HostBuffer),
}

fn setup(
    gpu: &Arc<Gpu>,
    mode: DoorbellMode,
    connect: bool,
    nqps: u32,
    sq_blocks: u32,
    sh: Shape,
) -> Result<Setup> {
    let rings = sh.rings;
    let (a, b) = if sh.mlx5 {
        (
            Context::open(DeviceRequest::Named("mlx5_0".into()))
                .context("the mlx5 shapes run under `gpuverbs emu --devices 2`")?,
            Context::open(DeviceRequest::Named("mlx5_1".into()))?,
        )
    } else {
        // The initiating soft NIC runs in completion-only mode: it checks and completes every
        // WQE but moves no payload, so post-and-complete measures posting plus the engine's
        // WQE cost. (Its engine threads also run the responder side: the peer is a device of
        // this process.)
        (
            Context::open_soft(gpuverbs::soft::DeviceConfig {
                completion_only: true,
                engine_threads: sh.engines,
                ..Default::default()
            })?,
            Context::open(DeviceRequest::Soft)?,
        )
    };
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (src, dst) = (HostBuffer::new(4096), HostBuffer::new(4096));
    let src_mr = pa.register(&src)?;
    let dst_mr = pb.register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let src_d = gpu.map_host(&src)?;
    let proxy = if mode.proxied() && connect {
        Some(ProxyService::start(ProxyConfig::default())?)
    } else {
        None
    };
    let mut qps = Vec::new();
    for _ in 0..nqps {
        let cqa = a.create_cq_on(
            gpu,
            CqOptions {
                depth: sq_blocks,
                placement: rings,
                ..Default::default()
            },
        )?;
        let cqb = b.create_cq(CqOptions::default())?;
        let mut o = QpOptions::new(&cqa, &cqa);
        o.sq_blocks = sq_blocks;
        o.doorbell = mode;
        o.placement = rings;
        let qa = pa.create_qp_on(gpu, o)?;
        let qb = pb.create_qp(QpOptions::new(&cqb, &cqb))?;
        if connect {
            let c = ConnectOptions {
                access: Access::REMOTE_WRITE,
                ..Default::default()
            };
            qa.connect(&qb.endpoint(), c)?;
            qb.connect(&qa.endpoint(), c)?;
        }
        let export = gpu.export_qp(&qa)?;
        if let Some(svc) = &proxy {
            let _h = svc.add(ProxyTarget::for_qp(&qa)?)?;
        }
        qps.push((qa, qb, export));
    }
    let ptrs = gpu.alloc(8 * nqps as usize)?;
    let list: Vec<u8> = qps
        .iter()
        .flat_map(|(_, _, e)| e.ptr().to_ne_bytes())
        .collect();
    ptrs.write(0, &list)?;
    Ok(Setup {
        _b: b,
        a,
        qps,
        ptrs,
        src_mr,
        dst_mr,
        src_d,
        _proxy: proxy,
        _bufs: (src, dst),
    })
}

/// The device API's sharing mode a run uses (the kernel's `share` code).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Share {
    /// Any thread on the GPU.
    Gpu = 0,
    /// One thread (thread scope) or one warp (warp scope) per QP, through the descriptor.
    Exclusive = 1,
    /// The threads of one block.
    Cta = 2,
    /// One thread per QP on a register copy of the descriptor (`checkout` / `checkin`).
    Checkout = 3,
}

/// One post-rate measurement.
#[derive(Clone, Copy)]
struct Shape {
    grid: u32,
    block: u32,
    /// 0 thread, 1 warp, 2 block, 3 thread with `put_inline` (8 bytes from registers).
    scope: u32,
    iters: u32,
    batch: u32,
    /// One QP per block (else one QP for the grid).
    private_qps: bool,
    share: Share,
    /// Where side A's rings live.
    rings: RingPlacement,
    /// Engine threads of side A's soft NIC.
    engines: u32,
    /// Side A is `mlx5_0` (DEVX objects for GPU rings; run under `gpuverbs emu --devices 2`),
    /// side B `mlx5_1`; else two soft NICs.
    mlx5: bool,
}

fn shape(
    grid: u32,
    block: u32,
    scope: u32,
    iters: u32,
    batch: u32,
    private_qps: bool,
    share: Share,
) -> Shape {
    Shape {
        grid,
        block,
        scope,
        iters,
        batch,
        private_qps,
        share,
        rings: RingPlacement::HostMapped,
        engines: 1,
        mlx5: false,
    }
}

/// Runs `gv_bench_post`; returns WQEs per second. `complete`: QPs in RTS, every 64th WQE
/// signaled, quiet at the end (else post-only).
fn post_rate(gpu: &Arc<Gpu>, mode: DoorbellMode, complete: bool, sh: Shape) -> Result<f64> {
    let s = setup_shape(gpu, mode, complete, sh)?;
    run_shape(gpu, &s, complete, sh)
}

/// The QPs (and soft NICs) a run of `sh` needs.
fn setup_shape(gpu: &Arc<Gpu>, mode: DoorbellMode, complete: bool, sh: Shape) -> Result<Setup> {
    let nqps = if sh.private_qps { sh.grid } else { 1 };
    let per_qp = sh.grid as u64 * sh.block as u64 * sh.iters as u64 / nqps as u64;
    let sq_blocks = if complete {
        4096
    } else {
        (per_qp as u32).next_power_of_two().max(64)
    };
    ensure!(
        sq_blocks <= SQ_BLOCKS,
        "post-only run of {per_qp} WQEs per QP does not fit the ring"
    );
    setup(gpu, mode, complete, nqps, sq_blocks, sh)
}

/// One run of `sh` on `s`: returns WQEs per second.
fn run_shape(gpu: &Arc<Gpu>, s: &Setup, complete: bool, sh: Shape) -> Result<f64> {
    let nqps = s.qps.len() as u32;
    let wqes = sh.grid as u64 * sh.block as u64 * sh.iters as u64;
    let mut before = 0;
    for (_, _, e) in &s.qps {
        before += e.read()?.sq_ready;
    }
    let st = Stamps::new(gpu)?;
    let (mut qps, mut n, mut laddr, mut lk, mut raddr, mut rk) = (
        s.ptrs.ptr(),
        nqps,
        s.src_d,
        s.src_mr.lkey().0,
        s.dst_mr.addr(),
        s.dst_mr.rkey().0,
    );
    let (mut iters, mut scope, mut batch, mut sig, mut excl) = (
        sh.iters,
        sh.scope,
        sh.batch,
        if complete { 64u32 } else { 0 },
        sh.share as u32,
    );
    let (mut budget, mut t, mut out) = (BUDGET, st.t(), st.status());
    let mut params = [
        arg(&mut qps),
        arg(&mut n),
        arg(&mut laddr),
        arg(&mut lk),
        arg(&mut raddr),
        arg(&mut rk),
        arg(&mut iters),
        arg(&mut scope),
        arg(&mut batch),
        arg(&mut sig),
        arg(&mut excl),
        arg(&mut budget),
        arg(&mut t),
        arg(&mut out),
    ];
    // SAFETY: parameters match gv_bench_post; every pointer is live device-visible memory.
    unsafe {
        gpu.launch_sync(
            "gv_bench_post",
            (sh.grid, 1, 1),
            (sh.block, 1, 1),
            0,
            &mut params,
        )?
    };
    let elapsed = st.elapsed_ns()?;
    let mut posted = 0;
    for (qa, _, e) in &s.qps {
        let d = e.read()?;
        if complete {
            ensure!(d.sq_retired == d.sq_ready, "not all WQEs completed: {d:?}");
            ensure!(qa.state() == gpuverbs::queue::QpState::Rts, "QP left RTS");
        } else {
            ensure!(
                d.sq_ready == d.sq_rung,
                "posted {} rung {}",
                d.sq_ready,
                d.sq_rung
            );
        }
        posted += d.sq_ready;
    }
    ensure!(
        posted - before >= wqes,
        "posted {} of {wqes} WQEs",
        posted - before
    );
    if let Some(d) = s.a.soft_device() {
        let errors = d.counters().errors;
        ensure!(errors.is_empty(), "device errors: {errors:?}");
    }
    Ok(wqes as f64 / (elapsed * 1e-9))
}

/// 1 CTA or `sms` CTAs, a thread (`thread`) or a warp (`warp`) each, exclusive or GPU sharing,
/// under the names of issue 14's table.
fn thread_warp_shapes(
    sms: u32,
    thread: impl Fn(u32, Share) -> Shape,
    warp: impl Fn(u32, Share) -> Shape,
) -> [(&'static str, Shape); 8] {
    [
        ("1 CTA × 1 thread, exclusive", thread(1, Share::Exclusive)),
        ("1 CTA × 1 thread, GPU sharing", thread(1, Share::Gpu)),
        ("1 CTA × 1 warp, exclusive", warp(1, Share::Exclusive)),
        ("1 CTA × 1 warp, GPU sharing", warp(1, Share::Gpu)),
        (
            "N CTAs × 1 thread, exclusive",
            thread(sms, Share::Exclusive),
        ),
        ("N CTAs × 1 thread, GPU sharing", thread(sms, Share::Gpu)),
        ("N CTAs × 1 warp, exclusive", warp(sms, Share::Exclusive)),
        ("N CTAs × 1 warp, GPU sharing", warp(sms, Share::Gpu)),
    ]
}

/// The launch shapes of issue 14 (post only, 8-byte WRITEs, an SQ of 4,096 blocks, GPU
/// doorbell, one QP per block), under the names of its table: five rounds, each running every
/// shape once in turn, and the median of each. Returns the median of "1 CTA × 1 thread,
/// exclusive" (WQE/s).
fn gpunetio_shapes(gpu: &Arc<Gpu>, sms: u32, lines: &mut Vec<Line>) -> Result<f64> {
    let thread = |grid, share| shape(grid, 1, 0, 4096, 1, true, share);
    let warp = |grid, share| shape(grid, 32, 1, 128, 1, true, share);
    let gpu_rings = |sh: Shape| Shape {
        rings: RingPlacement::Gpu,
        ..sh
    };
    // issue 14's table has no "1 CTA × 1 warp, GPU sharing"
    let mut shapes: Vec<_> = thread_warp_shapes(sms, thread, warp)
        .into_iter()
        .filter(|(name, _)| *name != "1 CTA × 1 warp, GPU sharing")
        .collect();
    shapes.extend([
        (
            "N CTAs × 1 thread, exclusive; gpuverbs with `checkout`",
            thread(sms, Share::Checkout),
        ),
        (
            "GPU rings: 1 CTA × 1 thread, exclusive",
            gpu_rings(thread(1, Share::Exclusive)),
        ),
        (
            "GPU rings: 1 CTA × 1 thread, GPU sharing",
            gpu_rings(thread(1, Share::Gpu)),
        ),
        (
            "GPU rings: N CTAs × 1 thread, exclusive",
            gpu_rings(thread(sms, Share::Exclusive)),
        ),
        (
            "GPU rings: N CTAs × 1 warp, exclusive",
            gpu_rings(warp(sms, Share::Exclusive)),
        ),
        (
            "GPU rings: N CTAs × 1 warp, GPU sharing",
            gpu_rings(warp(sms, Share::Gpu)),
        ),
    ]);
    let medians = shape_rounds(gpu, &shapes)?;
    for ((name, _), m) in shapes.iter().zip(&medians) {
        let m = *m;
        lines.push(Line {
            test: "gpunetio_shape",
            config: (*name).into(),
            db: "gpu",
            value: m / 1e6,
            unit: "M WQE/s",
            rings: None,
        });
    }
    Ok(medians[0])
}

/// Five interleaved rounds of post-only `shapes` (each on a set of QPs of its own made once;
/// between rounds gv_bench_recycle marks what a round posted retired, so the ring serves the
/// next one); the median WQE/s of each.
fn shape_rounds(gpu: &Arc<Gpu>, shapes: &[(&str, Shape)]) -> Result<Vec<f64>> {
    let mut setups = Vec::new();
    for (name, sh) in shapes {
        setups.push(
            setup_shape(gpu, DoorbellMode::GpuDoorbell, false, *sh)
                .with_context(|| format!("shape {name}"))?,
        );
    }
    let mut runs = vec![Vec::new(); shapes.len()];
    for round in 0..5 {
        for (i, (name, sh)) in shapes.iter().enumerate() {
            let r = run_shape(gpu, &setups[i], false, *sh)
                .with_context(|| format!("shape {name}, round {round}"))?;
            eprintln!("shape {name}, round {round}: {:.3} M WQE/s", r / 1e6);
            runs[i].push(r);
            recycle(gpu, &setups[i])?;
        }
    }
    let mut medians = Vec::new();
    for (i, (name, _)) in shapes.iter().enumerate() {
        let m = median(&mut runs[i]);
        eprintln!(
            "shape {name}: median {:.3} M WQE/s (runs {})",
            m / 1e6,
            runs_list(&runs[i])
        );
        medians.push(m);
    }
    Ok(medians)
}

/// The GPU-ring launch shapes on the soft NIC's QPs and on DEVX QPs of `mlx5_0` (under
/// `gpuverbs emu --devices 2`), interleaved in the same rounds: the device code cannot tell
/// them apart, so the post path must cost the same. Lines: each median, and mlx5 / soft.
fn mlx5_shapes(gpu: &Arc<Gpu>, sms: u32, lines: &mut Vec<Line>) -> Result<()> {
    let gpu_rings = |sh: Shape, mlx5| Shape {
        rings: RingPlacement::Gpu,
        mlx5,
        ..sh
    };
    let thread = |grid, share| shape(grid, 1, 0, 4096, 1, true, share);
    let warp = |grid, share| shape(grid, 32, 1, 128, 1, true, share);
    let base = [
        ("1 CTA × 1 thread, exclusive", thread(1, Share::Exclusive)),
        ("1 CTA × 1 thread, GPU sharing", thread(1, Share::Gpu)),
        ("1 CTA × 1 warp, exclusive", warp(1, Share::Exclusive)),
        (
            "N CTAs × 1 thread, exclusive",
            thread(sms, Share::Exclusive),
        ),
        ("N CTAs × 1 warp, exclusive", warp(sms, Share::Exclusive)),
    ];
    let mut shapes = Vec::new();
    for (name, sh) in base {
        shapes.push((name, gpu_rings(sh, false)));
        shapes.push((name, gpu_rings(sh, true)));
    }
    let m = shape_rounds(gpu, &shapes)?;
    for (k, (name, _)) in base.iter().enumerate() {
        let (soft, mlx5) = (m[2 * k], m[2 * k + 1]);
        for (what, v, unit) in [
            ("soft NIC", soft / 1e6, "M WQE/s"),
            ("mlx5_0 DEVX", mlx5 / 1e6, "M WQE/s"),
            ("mlx5 / soft", mlx5 / soft, "ratio"),
        ] {
            lines.push(Line {
                test: "gpu_rings_shape",
                config: format!("{name}: {what}"),
                db: "gpu",
                value: v,
                unit,
                rings: None,
            });
        }
    }
    Ok(())
}

/// Marks every block posted so far on `s`'s QPs retired (gv_bench_recycle), so that the next
/// post-only run reuses the ring.
fn recycle(gpu: &Arc<Gpu>, s: &Setup) -> Result<()> {
    let (mut qps, mut n) = (s.ptrs.ptr(), s.qps.len() as u32);
    let mut params = [arg(&mut qps), arg(&mut n)];
    // SAFETY: parameters match gv_bench_recycle; `qps` lists `n` live descriptors.
    unsafe {
        gpu.launch_sync(
            "gv_bench_recycle",
            (n.div_ceil(128), 1, 1),
            (128, 1, 1),
            0,
            &mut params,
        )?
    };
    Ok(())
}

/// gpu_bench's GPUNetIO kernels (`samples/kernels/gpunetio_bench.cu`, built by
/// `samples/build.rs` when `GPUNETIO_SRC` named a checkout of NVIDIA's GPUNetIO), 16-byte
/// aligned as the driver wants a fatbin; empty when built without it.
#[repr(C, align(16))]
struct Aligned<B: ?Sized>(B);
static GPUNETIO_KERNELS: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(
    env!("OUT_DIR"),
    "/gpu_bench_gpunetio.fatbin"
)));

/// Bytes of GPU memory per QP described in GPUNetIO's layout (the kernel asserts that
/// `doca_gpu_dev_verbs_qp` fits).
const DOCA_QP_BYTES: usize = 512;

/// The `gpunetio` series (issue 45 item 1): issue 14's launch shapes, post only, on QPs whose
/// rings go where the device puts them (`RingPlacement::Auto`: host memory on the soft NIC,
/// DEVX GPU memory on `mlx5_0`), GPU doorbell. In the same five rounds, each shape runs
/// gpuverbs' gv_bench_post on one QP set and NVIDIA GPUNetIO's own `doca_gpu_dev_verbs_put`
/// (gv_bench_gpunetio_put) on a second set of identical config, the order of the two
/// alternating from round to round. Lines: each median, and gpuverbs / GPUNetIO, with the
/// placement `Auto` chose. `mlx5`: on `mlx5_0` (under `gpuverbs emu --devices 2`), else on
/// soft NICs.
fn gpunetio(gpu: &Arc<Gpu>, sms: u32, mlx5: bool, lines: &mut Vec<Line>) -> Result<()> {
    ensure!(
        !GPUNETIO_KERNELS.0.is_empty(),
        "the gpunetio series runs NVIDIA GPUNetIO's device code, and this gpu_bench was built \
         without it: rebuild with GPUNETIO_SRC set to a checkout of \
         github.com/NVIDIA-DOCA/gpunetio (and nvcc), e.g. `GPUNETIO_SRC=/path/to/gpunetio \
         cargo build --release -p gpuverbs-samples --bin gpu_bench`"
    );
    let module = gpu.load_module(&GPUNETIO_KERNELS.0)?;
    let auto = |sh: Shape| Shape {
        rings: RingPlacement::Auto,
        mlx5,
        ..sh
    };
    let thread = |grid, share| auto(shape(grid, 1, 0, 4096, 1, true, share));
    let warp = |grid, share| auto(shape(grid, 32, 1, 128, 1, true, share));
    let shapes = thread_warp_shapes(sms, thread, warp);
    let backend = if mlx5 { "mlx5_0" } else { "soft NIC" };
    let mut sets = Vec::new();
    for (name, sh) in &shapes {
        let mk = || {
            setup_shape(gpu, DoorbellMode::GpuDoorbell, false, *sh)
                .with_context(|| format!("{backend}, shape {name}"))
        };
        let (gv, dn) = (mk()?, mk()?);
        let dq = gpu.alloc(DOCA_QP_BYTES * dn.qps.len())?;
        sets.push((gv, dn, dq));
    }
    let rings = {
        let qp = &sets[0].0.qps[0].0;
        (qp.placement(), qp.placement_reason().to_string())
    };
    for (gv, dn, _) in &sets {
        for (qa, _, _) in gv.qps.iter().chain(&dn.qps) {
            ensure!(
                qa.placement() == rings.0,
                "QPs of one series with rings apart"
            );
        }
    }
    eprintln!(
        "gpunetio on {backend}: RingPlacement::Auto -> {:?} ({})",
        rings.0, rings.1
    );
    let (mut gv_runs, mut dn_runs) = (
        vec![Vec::new(); shapes.len()],
        vec![Vec::new(); shapes.len()],
    );
    for round in 0..5 {
        for (i, (name, sh)) in shapes.iter().enumerate() {
            let (gv, dn, dq) = &sets[i];
            for gpuverbs_now in [round % 2 == 0, round % 2 != 0] {
                let what = if gpuverbs_now { "gpuverbs" } else { "GPUNetIO" };
                let r = if gpuverbs_now {
                    let r = run_shape(gpu, gv, false, *sh);
                    recycle(gpu, gv)?;
                    r
                } else {
                    gpunetio_run(gpu, &module, dn, dq, *sh)
                }
                .with_context(|| format!("{backend}, {what}, shape {name}, round {round}"))?;
                eprintln!(
                    "{backend}, {what}, shape {name}, round {round}: {:.3} M WQE/s",
                    r / 1e6
                );
                let runs = if gpuverbs_now {
                    &mut gv_runs
                } else {
                    &mut dn_runs
                };
                runs[i].push(r);
            }
        }
    }
    for (i, (name, _)) in shapes.iter().enumerate() {
        let (v, g) = (median(&mut gv_runs[i]), median(&mut dn_runs[i]));
        eprintln!(
            "{backend}, shape {name}: gpuverbs {:.3} (runs {}), GPUNetIO {:.3} (runs {}) M WQE/s",
            v / 1e6,
            runs_list(&gv_runs[i]),
            g / 1e6,
            runs_list(&dn_runs[i])
        );
        for (what, value, unit) in [
            ("gpuverbs", v / 1e6, "M WQE/s"),
            ("GPUNetIO", g / 1e6, "M WQE/s"),
            ("gpuverbs / GPUNetIO", v / g, "ratio"),
        ] {
            lines.push(Line {
                test: "gpunetio_same_run",
                config: format!("{backend}, {name}: {what}"),
                db: "gpu",
                value,
                unit,
                rings: Some(rings.clone()),
            });
        }
    }
    Ok(())
}

/// One post-only run of `sh` with GPUNetIO's device code on `s`'s QPs (described afresh in
/// GPUNetIO's layout into `dq`, every index 0: `s`'s QPs are never posted to through gpuverbs):
/// returns WQEs per second, after checking that every WQE was posted and rung.
fn gpunetio_run(
    gpu: &Arc<Gpu>,
    module: &GpuModule,
    s: &Setup,
    dq: &DeviceMem,
    sh: Shape,
) -> Result<f64> {
    let (mut qps, mut n, mut dqp) = (s.ptrs.ptr(), s.qps.len() as u32, dq.ptr());
    let blocks = (n.div_ceil(128), 1, 1);
    let mut params = [arg(&mut qps), arg(&mut n), arg(&mut dqp)];
    // SAFETY: parameters match gv_bench_gpunetio_describe; `qps` lists `n` live descriptors,
    // `dq` holds DOCA_QP_BYTES for each.
    unsafe {
        gpu.launch_sync_in(
            module,
            "gv_bench_gpunetio_describe",
            blocks,
            (128, 1, 1),
            0,
            &mut params,
        )?
    };
    let st = Stamps::new(gpu)?;
    let (mut laddr, mut lk, mut raddr, mut rk) = (
        s.src_d,
        s.src_mr.lkey().0,
        s.dst_mr.addr(),
        s.dst_mr.rkey().0,
    );
    let (mut iters, mut scope, mut share, mut t) = (sh.iters, sh.scope, sh.share as u32, st.t());
    let mut params = [
        arg(&mut dqp),
        arg(&mut n),
        arg(&mut laddr),
        arg(&mut lk),
        arg(&mut raddr),
        arg(&mut rk),
        arg(&mut iters),
        arg(&mut scope),
        arg(&mut share),
        arg(&mut t),
    ];
    // SAFETY: parameters match gv_bench_gpunetio_put; `dq` holds `n` QP descriptions, `t` the
    // stamps' live device memory.
    unsafe {
        gpu.launch_sync_in(
            module,
            "gv_bench_gpunetio_put",
            (sh.grid, 1, 1),
            (sh.block, 1, 1),
            0,
            &mut params,
        )?
    };
    let elapsed = st.elapsed_ns()?;
    let tally = gpu.alloc(16)?;
    let mut out = tally.ptr();
    let mut params = [arg(&mut dqp), arg(&mut n), arg(&mut out)];
    // SAFETY: parameters match gv_bench_gpunetio_tally; `out` is 16 live zeroed bytes.
    unsafe {
        gpu.launch_sync_in(
            module,
            "gv_bench_gpunetio_tally",
            blocks,
            (128, 1, 1),
            0,
            &mut params,
        )?
    };
    let mut b = [0u8; 16];
    tally.read(0, &mut b)?;
    let (posted, apart) = (
        u64::from_ne_bytes(b[..8].try_into().unwrap()),
        u64::from_ne_bytes(b[8..].try_into().unwrap()),
    );
    let wqes = sh.grid as u64 * sh.block as u64 * sh.iters as u64;
    ensure!(
        apart == 0,
        "{apart} QPs with reserved, ready and rung indices apart"
    );
    ensure!(posted == wqes, "GPUNetIO posted {posted} of {wqes} WQEs");
    if let Some(d) = s.a.soft_device() {
        let errors = d.counters().errors;
        ensure!(errors.is_empty(), "device errors: {errors:?}");
    }
    Ok(wqes as f64 / (elapsed * 1e-9))
}

struct Line {
    test: &'static str,
    config: String,
    db: &'static str,
    value: f64,
    unit: &'static str,
    /// Where the QPs' rings are and why (`placement()`, `placement_reason()`), for lines whose
    /// QPs leave it to the device (`RingPlacement::Auto`).
    rings: Option<(RingPlacement, String)>,
}

fn db_name(m: DoorbellMode) -> &'static str {
    match m {
        DoorbellMode::GpuDoorbell | DoorbellMode::Auto => "gpu",
        DoorbellMode::BlueFlame => "bf",
        DoorbellMode::CpuProxy => "proxy",
        DoorbellMode::NoDbr => "nodbr",
        DoorbellMode::NoDbrEmulated => "nodbr-emu",
    }
}

/// The doorbell modes of the post-rate series.
const MODES: [DoorbellMode; 3] = [
    DoorbellMode::GpuDoorbell,
    DoorbellMode::BlueFlame,
    DoorbellMode::CpuProxy,
];

fn main() -> Result<()> {
    let args = Args::parse();
    const SERIES: [&str; 7] = [
        "post_only",
        "post_complete",
        "engines",
        "shapes",
        "mlx5_shapes",
        "counters",
        "gpunetio",
    ];
    for s in &args.series {
        ensure!(
            SERIES.contains(&s.as_str()),
            "unknown series {s:?} (one of {SERIES:?})"
        );
    }
    let gpu = Gpu::open(args.gpu).context("gpu_bench needs a GPU and the embedded kernels")?;
    let mut lines = Vec::new();

    // Ceiling: 64-byte stores into mapped host memory, many blocks.
    let host = HostBuffer::new(64 << 20);
    let hd = gpu.map_host(&host)?;
    let sms = gpu.context().attribute(
        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )? as u32;
    store64_ceiling(&gpu, hd, sms, &mut lines)?;
    let floor_ns = fence_floor(&gpu, hd, &mut lines)?;
    fence_units(&gpu, hd, &mut lines)?;

    let want = |series: &str| args.series.iter().any(|s| s == series);
    let rates = if want("post_only") {
        post_only(&gpu, sms, &mut lines)?
    } else {
        RefRates::default()
    };
    if want("post_complete") {
        post_complete(&gpu, &mut lines)?;
    }
    if want("engines") && !args.engines.0.is_empty() {
        engine_scaling(&gpu, &args, &mut lines)?;
    }
    let shape_thread_rate = if want("shapes") {
        gpunetio_shapes(&gpu, sms, &mut lines)?
    } else {
        0.0
    };
    if want("mlx5_shapes") {
        mlx5_shapes(&gpu, sms, &mut lines)?;
    }
    if want("counters") {
        counters(&gpu, &mut lines)?;
    }
    if want("gpunetio") {
        gpunetio(&gpu, sms, args.gpunetio_device == "mlx5", &mut lines)?;
    }
    let ratios = ratios(want("post_only"), &rates, floor_ns, shape_thread_rate)?;
    print_lines(&args, &gpu.info().to_string(), &lines, ratios);
    Ok(())
}

/// Ceiling: 64-byte stores into mapped host memory (`hd`, 64 MiB), many blocks.
fn store64_ceiling(gpu: &Arc<Gpu>, hd: u64, sms: u32, lines: &mut Vec<Line>) -> Result<()> {
    let (grid, block, iters) = (sms * 4, 256u32, 64u32);
    let st = Stamps::new(gpu)?;
    let (mut p, mut nb, mut it, mut t) = (hd, (64u32 << 20) / 64, iters, st.t());
    let mut params = [arg(&mut p), arg(&mut nb), arg(&mut it), arg(&mut t)];
    // SAFETY: parameters match gv_bench_store64; `hd` maps 64 MiB, the kernel stays inside it.
    unsafe {
        gpu.launch_sync(
            "gv_bench_store64",
            (grid, 1, 1),
            (block, 1, 1),
            0,
            &mut params,
        )?
    };
    let stores = (grid * block * iters) as f64;
    let store_rate = stores / (st.elapsed_ns()? * 1e-9);
    lines.push(Line {
        test: "store64_ceiling",
        config: format!("{grid}x{block} threads"),
        db: "-",
        value: store_rate / 1e6,
        unit: "M 64B-stores/s",
        rings: None,
    });
    Ok(())
}

/// Floor: fence.release.sys + 8-byte store, one thread. It moves between two levels from
/// launch to launch on the H200 (~525 and ~605 ns), so it is taken five times and the
/// lowest is the floor the put is compared with.
fn fence_floor(gpu: &Arc<Gpu>, hd: u64, lines: &mut Vec<Line>) -> Result<f64> {
    let floor_ns = lowest_of(5, || {
        let st = Stamps::new(gpu)?;
        let (mut p, mut it, mut t) = (hd, 10_000u32, st.t());
        let mut params = [arg(&mut p), arg(&mut it), arg(&mut t)];
        // SAFETY: parameters match gv_bench_fence_store; `hd` is mapped host memory.
        unsafe { gpu.launch_sync("gv_bench_fence_store", (1, 1, 1), (1, 1, 1), 0, &mut params)? };
        st.elapsed_ns().map(|ns| ns / 10_000.0)
    })?;
    lines.push(Line {
        test: "fence_store_floor",
        config: "1 thread, lowest of 5".into(),
        db: "-",
        value: floor_ns,
        unit: "ns",
        rings: None,
    });
    Ok(floor_ns)
}

/// The floor with a WQE's stores before the fence and the doorbell record's after it;
/// the full put's (4 units) also while another block polls host memory, as the waiting
/// side of a single-GPU ping-pong does.
fn fence_units(gpu: &Arc<Gpu>, hd: u64, lines: &mut Vec<Line>) -> Result<()> {
    let mut token = 0u64;
    for (units, polled) in [
        (0, false),
        (1, false),
        (2, false),
        (3, false),
        (4, false),
        (4, true),
    ] {
        let best = lowest_of(5, || {
            let st = Stamps::new(gpu)?;
            token += 1;
            let (mut p, mut u, mut it, mut t) = (hd, units, 10_000u32, st.t());
            let mut tok = if polled { token } else { 0 };
            let mut params = [
                arg(&mut p),
                arg(&mut u),
                arg(&mut it),
                arg(&mut tok),
                arg(&mut t),
            ];
            // SAFETY: parameters match gv_bench_fence_units; `hd` is mapped host memory of
            // at least 64 + 64 * 64 + 16 bytes; with a token two blocks, whose poller ends
            // when block 0 stores the token (block 0 does not wait for it unboundedly).
            unsafe {
                gpu.launch_sync(
                    "gv_bench_fence_units",
                    (if polled { 2 } else { 1 }, 1, 1),
                    (1, 1, 1),
                    0,
                    &mut params,
                )?
            };
            st.elapsed_ns().map(|ns| ns / 10_000.0)
        })?;
        lines.push(Line {
            test: if polled {
                "fence_units_polled"
            } else {
                "fence_units"
            },
            config: format!(
                "{units} x 16 B, fence, 4 B + 8 B{}; lowest of 5",
                if polled {
                    ", a block polling host memory"
                } else {
                    ""
                }
            ),
            db: "-",
            value: best,
            unit: "ns",
            rings: None,
        });
    }
    Ok(())
}

/// The configurations of the post-only series (`sms`: the GPU's multiprocessors).
fn post_only_configs(sms: u32) -> [(&'static str, Shape); 14] {
    [
        (
            "1 thread, checkout, batch 1",
            shape(1, 1, 0, 8192, 1, false, Share::Checkout),
        ),
        (
            "1 thread, checkout, batch 1, GPU rings",
            Shape {
                rings: RingPlacement::Gpu,
                ..shape(1, 1, 0, 8192, 1, false, Share::Checkout)
            },
        ),
        (
            "1 thread, checkout, batch 1, put_inline",
            shape(1, 1, 3, 8192, 1, false, Share::Checkout),
        ),
        (
            "1 thread, shared, batch 1",
            shape(1, 1, 0, 8192, 1, false, Share::Gpu),
        ),
        (
            "1 thread, checkout, batch 32",
            shape(1, 1, 0, 8192, 32, false, Share::Checkout),
        ),
        (
            "1 warp, warp scope",
            shape(1, 32, 1, 512, 1, false, Share::Gpu),
        ),
        (
            "1 warp, exclusive, warp scope",
            shape(1, 32, 1, 512, 1, false, Share::Exclusive),
        ),
        (
            "1 block of 256, block scope",
            shape(1, 256, 2, 64, 1, false, Share::Gpu),
        ),
        (
            "1 block of 256, block scope, CTA sharing",
            shape(1, 256, 2, 64, 1, false, Share::Cta),
        ),
        (
            "1 block of 256, thread scope",
            shape(1, 256, 0, 32, 1, false, Share::Gpu),
        ),
        (
            "1 block of 256, thread scope, CTA sharing",
            shape(1, 256, 0, 32, 1, false, Share::Cta),
        ),
        (
            "many blocks, 1 QP, warp scope",
            shape(sms, 128, 1, 1, 1, false, Share::Gpu),
        ),
        (
            "many blocks, QP per block, block scope",
            shape(sms, 256, 2, 16, 1, true, Share::Gpu),
        ),
        (
            "many blocks, QP per block, block scope, CTA sharing",
            shape(sms, 256, 2, 16, 1, true, Share::Cta),
        ),
    ]
}

/// The post-only rates the ratios compare (GPU doorbell): one thread (host and GPU rings),
/// warp scope against one thread, both owning their QP (exclusive), and the shared warp.
#[derive(Default)]
struct RefRates {
    thread: f64,
    warp: f64,
    shared_warp: f64,
    gpu_rings: f64,
}

/// The post-only series: every configuration in every doorbell mode; the reference rates.
fn post_only(gpu: &Arc<Gpu>, sms: u32, lines: &mut Vec<Line>) -> Result<RefRates> {
    let mut rates = RefRates::default();
    for mode in MODES {
        for (name, sh) in post_only_configs(sms) {
            let r = post_rate(gpu, mode, false, sh)
                .with_context(|| format!("post_only {name}, {}", db_name(mode)))?;
            eprintln!("post_only {name} {}: {:.3} M WQE/s", db_name(mode), r / 1e6);
            if mode == DoorbellMode::GpuDoorbell {
                reference_rate(name, r, &mut rates, lines);
            }
            lines.push(Line {
                test: "post_only",
                config: name.into(),
                db: db_name(mode),
                value: r / 1e6,
                unit: "M WQE/s",
                rings: None,
            });
        }
    }
    Ok(rates)
}

/// Notes a GPU-doorbell post-only rate `r` of configuration `name` that the ratios compare
/// (and the single-put costs in ns).
fn reference_rate(name: &str, r: f64, rates: &mut RefRates, lines: &mut Vec<Line>) {
    let mode = DoorbellMode::GpuDoorbell;
    if name == "1 thread, checkout, batch 1" {
        rates.thread = r;
        let value = 1e9 / r;
        lines.push(Line {
            test: "single_put_cost",
            config: name.into(),
            db: db_name(mode),
            value,
            unit: "ns",
            rings: None,
        });
    }
    if name == "1 thread, checkout, batch 1, put_inline" {
        lines.push(Line {
            test: "single_put_inline_cost",
            config: name.into(),
            db: db_name(mode),
            value: 1e9 / r,
            unit: "ns",
            rings: None,
        });
    }
    if name == "1 thread, checkout, batch 1, GPU rings" {
        rates.gpu_rings = r;
        lines.push(Line {
            test: "single_put_cost",
            config: name.into(),
            db: db_name(mode),
            value: 1e9 / r,
            unit: "ns",
            rings: None,
        });
    }
    if name == "1 warp, exclusive, warp scope" {
        rates.warp = r;
    }
    if name == "1 warp, warp scope" {
        rates.shared_warp = r;
    }
}

/// The post-and-complete series: a few configurations in every doorbell mode.
fn post_complete(gpu: &Arc<Gpu>, lines: &mut Vec<Line>) -> Result<()> {
    let complete_configs = [
        (
            "1 thread, checkout, batch 32",
            shape(1, 1, 0, 32768, 32, false, Share::Checkout),
        ),
        (
            "1 warp, warp scope",
            shape(1, 32, 1, 2048, 1, false, Share::Gpu),
        ),
        (
            "8 blocks, QP per block, block scope",
            shape(8, 256, 2, 64, 1, true, Share::Gpu),
        ),
    ];
    for mode in MODES {
        for (name, sh) in complete_configs {
            let r = post_rate(gpu, mode, true, sh)
                .with_context(|| format!("post_complete {name}, {}", db_name(mode)))?;
            eprintln!(
                "post_complete {name} {}: {:.3} M WQE/s",
                db_name(mode),
                r / 1e6
            );
            lines.push(Line {
                test: "post_complete",
                config: name.into(),
                db: db_name(mode),
                value: r / 1e6,
                unit: "M WQE/s",
                rings: None,
            });
        }
    }
    Ok(())
}

/// One QP between two soft NICs (side A exported), its companion, and per-block counters in
/// host memory mapped into the GPU (the soft NIC's atomics on host memory are direct; on GPU
/// memory they are CUDA copies, which would time the copies).
struct CounterSetup {
    exports: (ExportedQp, ExportedQp),
    _qps: (Qp, Qp, Qp),
    src_mr: Mr,
    dst_mr: Mr,
    ctr_mr: Mr,
    src_d: u64,
    ctr_d: u64,
    bufs: (HostBuffer, HostBuffer, HostBuffer),
    _ctx: (Context, Context),
}

fn counter_setup(gpu: &Arc<Gpu>, threads: usize) -> Result<CounterSetup> {
    let (a, b) = (
        Context::open(DeviceRequest::Soft)?,
        Context::open(DeviceRequest::Soft)?,
    );
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let cq = |ctx: &Context, depth: u32| {
        ctx.create_cq(CqOptions {
            depth,
            mode: gpuverbs::queue::CqMode::OverrunIgnore,
            ..Default::default()
        })
    };
    let (cqa, cqb, cqc) = (cq(&a, 4096)?, cq(&b, 64)?, cq(&a, 8192)?);
    let mut o = QpOptions::new(&cqa, &cqa);
    o.sq_blocks = 4096;
    o.doorbell = DoorbellMode::GpuDoorbell;
    let qa = pa.create_qp_on(gpu, o)?;
    let qb = pb.create_qp(QpOptions::new(&cqb, &cqb))?;
    let c = ConnectOptions {
        access: Access::REMOTE_WRITE,
        ..Default::default()
    };
    qa.connect(&qb.endpoint(), c)?;
    qb.connect(&qa.endpoint(), c)?;
    let mut oc = QpOptions::new(&cqc, &cqc);
    oc.sq_blocks = 8192;
    oc.doorbell = DoorbellMode::GpuDoorbell;
    let qc = pa.create_companion(Some(gpu), oc)?;
    let (ea, ec) = (gpu.export_qp(&qa)?, gpu.export_qp(&qc)?);
    let bytes = 8 * threads.max(8);
    let (src, dst, ctr) = (
        HostBuffer::new(bytes),
        HostBuffer::new(bytes),
        HostBuffer::new(64 * 8),
    );
    let src_mr = pa.register(&src)?;
    let dst_mr = pb.register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let ctr_mr = pa.register_with(&ctr, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
    let (src_d, ctr_d) = (gpu.map_host(&src)?, gpu.map_host(&ctr)?);
    Ok(CounterSetup {
        exports: (ea, ec),
        _qps: (qa, qb, qc),
        src_mr,
        dst_mr,
        ctr_mr,
        src_d,
        ctr_d,
        bufs: (src, dst, ctr),
        _ctx: (a, b),
    })
}

/// One run of `gv_bench_counter` (`kind` 0 put + poll, 1 put_counted, 2 put_counter):
/// completed WRITEs per second; the counters checked.
fn counter_rate(gpu: &Arc<Gpu>, s: &CounterSetup, kind: u32, sh: (u32, u32, u32)) -> Result<f64> {
    let (grid, block, iters) = sh;
    s.bufs.2.write(0, &[0u8; 64 * 8]);
    let st = Stamps::new(gpu)?;
    let (qa, qc) = (s.exports.0.ptr(), s.exports.1.ptr());
    let (mut q, mut cp, mut laddr, mut lk, mut raddr, mut rk) = (
        qa,
        qc,
        s.src_d,
        s.src_mr.lkey().0,
        s.dst_mr.addr(),
        s.dst_mr.rkey().0,
    );
    let (mut it, mut k, mut ctr, mut ck, mut ctr_d) =
        (iters, kind, s.ctr_mr.addr(), s.ctr_mr.rkey().0, s.ctr_d);
    let (mut budget, mut t, mut out) = (BUDGET, st.t(), st.status());
    let mut params = [
        arg(&mut q),
        arg(&mut cp),
        arg(&mut laddr),
        arg(&mut lk),
        arg(&mut raddr),
        arg(&mut rk),
        arg(&mut it),
        arg(&mut k),
        arg(&mut ctr),
        arg(&mut ck),
        arg(&mut ctr_d),
        arg(&mut budget),
        arg(&mut t),
        arg(&mut out),
    ];
    // SAFETY: parameters match gv_bench_counter; every pointer is live device-visible memory.
    unsafe {
        gpu.launch_sync(
            "gv_bench_counter",
            (grid, 1, 1),
            (block, 1, 1),
            0,
            &mut params,
        )?
    };
    let elapsed = st.elapsed_ns()?;
    if kind != 0 {
        let c = s.bufs.2.to_vec();
        for b in 0..grid as usize {
            let v = u64::from_ne_bytes(c[8 * b..8 * b + 8].try_into().unwrap());
            ensure!(
                v == u64::from(iters) * u64::from(block),
                "block {b}'s counter at {v}"
            );
        }
    }
    Ok(f64::from(grid * block * iters) / (elapsed * 1e-9))
}

/// The counter series: put + poll next to put_counted and put_counter, same QP, same shapes.
fn counters(gpu: &Arc<Gpu>, lines: &mut Vec<Line>) -> Result<()> {
    let shapes = [
        ("1 thread", (1u32, 1u32, 2048u32)),
        ("1 warp, thread scope", (1, 32, 128)),
        ("8 blocks x 64 threads", (8, 64, 16)),
    ];
    let kinds = [
        (0, "put + poll"),
        (1, "put_counted"),
        (2, "put_counter (NIC)"),
    ];
    for (name, sh) in shapes {
        let s = counter_setup(gpu, (sh.0 * sh.1) as usize)?;
        for (kind, what) in kinds {
            let r = counter_rate(gpu, &s, kind, sh)
                .with_context(|| format!("counters {name}, {what}"))?;
            eprintln!("counters {name} {what}: {:.3} M WQE/s", r / 1e6);
            lines.push(Line {
                test: "counters",
                config: format!("{name}, {what}"),
                db: "gpu",
                value: r / 1e6,
                unit: "M WQE/s",
                rings: None,
            });
        }
    }
    Ok(())
}

/// Engine scaling: the same post-and-complete load on 1, 2, 4, ... engine threads, in
/// interleaved rounds (every count once per round), each count's median against the
/// median of the first count (one run is short, and the host's speed moves between runs).
fn engine_scaling(gpu: &Arc<Gpu>, args: &Args, lines: &mut Vec<Line>) -> Result<()> {
    let counts = &args.engines.0;
    let mut runs = vec![Vec::new(); counts.len()];
    for round in 0..args.engine_rounds.max(1) {
        for (i, &e) in counts.iter().enumerate() {
            let sh = Shape {
                engines: e,
                ..shape(64, 256, 2, 64, 1, true, Share::Gpu)
            };
            let r = post_rate(gpu, DoorbellMode::GpuDoorbell, true, sh).with_context(|| {
                format!("engine_scaling with {e} engine threads, round {round}")
            })?;
            eprintln!(
                "engine_scaling {e} engine threads, round {round}: {:.3} M WQE/s",
                r / 1e6
            );
            runs[i].push(r);
        }
    }
    let medians: Vec<f64> = runs.iter_mut().map(|r| median(r)).collect();
    let (base, base_n) = (medians[0], counts[0] as f64);
    for (i, &e) in counts.iter().enumerate() {
        eprintln!(
            "engine_scaling {e} engine threads: median {:.3} M WQE/s ({:.2}x {} thread(s), {:.2} of linear; runs {})",
            medians[i] / 1e6,
            medians[i] / base,
            counts[0],
            medians[i] / base / (e as f64 / base_n),
            runs_list(&runs[i])
        );
        lines.push(Line {
            test: "engine_scaling",
            config: format!(
                "64 blocks, QP per block, block scope, {e} engine threads, median of {}",
                runs[i].len()
            ),
            db: db_name(DoorbellMode::GpuDoorbell),
            value: medians[i] / 1e6,
            unit: "M WQE/s",
            rings: None,
        });
    }
    Ok(())
}

/// The ratios: the single put over the floor (host and GPU rings), warp scope and the shared
/// warp over one thread (with the post-only series), the shapes' single put over the floor.
fn ratios(
    post_only: bool,
    rates: &RefRates,
    floor_ns: f64,
    shape_thread_rate: f64,
) -> Result<serde_json::Map<String, serde_json::Value>> {
    let mut ratios = serde_json::Map::new();
    if post_only {
        let (thread_rate, warp_rate) = (rates.thread, rates.warp);
        let (shared_warp_rate, gpu_rings_rate) = (rates.shared_warp, rates.gpu_rings);
        if [thread_rate, warp_rate, shared_warp_rate, gpu_rings_rate].contains(&0.0) {
            bail!("missing reference rates");
        }
        for (k, v) in [
            ("single_put_over_floor", (1e9 / thread_rate) / floor_ns),
            (
                "single_put_gpu_rings_over_floor",
                (1e9 / gpu_rings_rate) / floor_ns,
            ),
            ("warp_over_thread", warp_rate / thread_rate),
            ("shared_warp_over_thread", shared_warp_rate / thread_rate),
        ] {
            ratios.insert(k.into(), v.into());
        }
    }
    if shape_thread_rate > 0.0 {
        ratios.insert(
            "shape_single_put_over_floor".into(),
            ((1e9 / shape_thread_rate) / floor_ns).into(),
        );
    }
    Ok(ratios)
}

/// The lines and the ratios: one JSON object each (`--json`), or a table.
fn print_lines(
    args: &Args,
    info: &str,
    lines: &[Line],
    mut ratios: serde_json::Map<String, serde_json::Value>,
) {
    if args.json {
        for l in lines {
            let mut j = serde_json::json!({"test": l.test, "config": l.config, "db": l.db, "value": l.value, "unit": l.unit, "gpu": info});
            if let Some((placement, reason)) = &l.rings {
                j["rings"] = format!("{placement:?}").into();
                j["rings_reason"] = reason.as_str().into();
            }
            println!("{j}");
        }
        ratios.insert("test".into(), "ratios".into());
        ratios.insert("gpu".into(), info.into());
        println!("{}", serde_json::Value::Object(ratios));
    } else {
        println!("# {info}");
        println!(
            "{:<18} {:<32} {:<6} {:>12} unit",
            "test", "config", "db", "value"
        );
        for l in lines {
            println!(
                "{:<18} {:<32} {:<6} {:>12.3} {}",
                l.test, l.config, l.db, l.value, l.unit
            );
        }
        for (k, v) in &ratios {
            println!("{k}: {:.2}", v.as_f64().unwrap_or(f64::NAN));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_engine_list_skips_the_series() {
        let a = Args::try_parse_from(["gpu_bench", "--engines", ""]).unwrap();
        assert_eq!(a.engines, Counts(vec![]));
        let a = Args::try_parse_from(["gpu_bench", "--engines", "1, 4"]).unwrap();
        assert_eq!(a.engines, Counts(vec![1, 4]));
        let a = Args::try_parse_from(["gpu_bench"]).unwrap();
        assert_eq!(a.engines, Counts(vec![1, 2, 4, 8]));
        assert!(Args::try_parse_from(["gpu_bench", "--engines", "two"]).is_err());
    }

    #[test]
    fn the_gpunetio_series_runs_on_soft_nics_or_mlx5() {
        let a = Args::try_parse_from(["gpu_bench"]).unwrap();
        assert_eq!(a.gpunetio_device, "soft");
        assert!(!a.series.iter().any(|s| s == "gpunetio"));
        let a = Args::try_parse_from(["gpu_bench", "--gpunetio-device", "mlx5"]).unwrap();
        assert_eq!(a.gpunetio_device, "mlx5");
        assert!(Args::try_parse_from(["gpu_bench", "--gpunetio-device", "mlx6"]).is_err());
    }
}
