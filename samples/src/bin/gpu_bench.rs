//! Device-side benchmarks of the gpuverbs device API on a GPU, against soft NICs.
//!
//! - `store64`: the ceiling of host-resident rings: 64-byte GPU stores into mapped host memory.
//! - `fence_store`: the floor of one doorbell: `fence.release.sys` + an 8-byte store (lowest of 5).
//! - `post_only`: kernels fill a ring deep enough for the whole run and ring the doorbell; the
//!   QP is not in RTS, so the device executes nothing and only device-side cost is timed. For
//!   1 thread, 1 warp, 1 block and many blocks, per doorbell mode and batch size.
//! - `post_complete`: the same against a QP in RTS whose soft NIC executes and completes every
//!   WQE (selective signaling, then quiet): the rate includes the soft NIC engine.
//!
//! `gpu_bench [--gpu N] [--json]`. Times come from %globaltimer inside the kernels.

use anyhow::{bail, ensure, Context as _, Result};
use clap::Parser;
use gpuverbs::gpu::{DeviceMem, ExportedQp, Gpu};
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
    /// Engine-thread counts for the engine-scaling series (post and complete, 64 blocks each
    /// on its own QP, block scope): side A's soft NIC runs with each in turn; empty: skip it.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    engines: Vec<u32>,
}

const BUDGET: u64 = 5_000_000_000;
/// The deepest SQ the soft NIC allows: a post-only run must fit in it.
const SQ_BLOCKS: u32 = 32768;

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
    rings: RingPlacement,
    engines: u32,
) -> Result<Setup> {
    // The initiating soft NIC runs in completion-only mode: it checks and completes every WQE
    // but moves no payload, so post-and-complete measures posting plus the engine's WQE cost.
    // (Its engine threads also run the responder side: the peer is a device of this process.)
    let a = Context::open_soft(softnic::DeviceConfig {
        completion_only: true,
        engine_threads: engines,
        ..Default::default()
    })?;
    let b = Context::open(DeviceRequest::Soft)?;
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (src, dst) = (HostBuffer::new(4096), HostBuffer::new(4096));
    let src_mr = pa.register(&src)?;
    let dst_mr = pb.register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let src_d = gpu.map_host(&src)?;
    let proxy = if mode == DoorbellMode::CpuProxy && connect {
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
            let _h = svc.add(ProxyTarget::for_soft_qp(
                a.soft_device().expect("soft"),
                qa.soft().expect("a soft-NIC QP"),
            ))?;
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
    /// One thread (thread scope, on a checked-out copy) or one warp (warp scope) per QP.
    Exclusive = 1,
    /// The threads of one block.
    Cta = 2,
}

/// One post-rate measurement.
#[derive(Clone, Copy)]
struct Shape {
    grid: u32,
    block: u32,
    /// 0 thread, 1 warp, 2 block.
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
    }
}

/// Runs `gv_bench_post`; returns WQEs per second. `complete`: QPs in RTS, every 64th WQE
/// signaled, quiet at the end (else post-only).
fn post_rate(gpu: &Arc<Gpu>, mode: DoorbellMode, complete: bool, sh: Shape) -> Result<f64> {
    let nqps = if sh.private_qps { sh.grid } else { 1 };
    let wqes = sh.grid as u64 * sh.block as u64 * sh.iters as u64;
    let per_qp = wqes / nqps as u64;
    let sq_blocks = if complete {
        4096
    } else {
        (per_qp as u32).next_power_of_two().max(64)
    };
    ensure!(
        sq_blocks <= SQ_BLOCKS,
        "post-only run of {per_qp} WQEs per QP does not fit the ring"
    );
    let s = setup(gpu, mode, complete, nqps, sq_blocks, sh.rings, sh.engines)?;
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
    ensure!(posted >= wqes, "posted {posted} of {wqes} WQEs");
    let errors = s.a.soft_device().expect("soft").counters().errors;
    ensure!(errors.is_empty(), "device errors: {errors:?}");
    Ok(wqes as f64 / (elapsed * 1e-9))
}

struct Line {
    test: &'static str,
    config: String,
    db: &'static str,
    value: f64,
    unit: &'static str,
}

fn db_name(m: DoorbellMode) -> &'static str {
    match m {
        DoorbellMode::GpuDoorbell | DoorbellMode::Auto => "gpu",
        DoorbellMode::BlueFlame => "bf",
        DoorbellMode::CpuProxy => "proxy",
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let gpu = Gpu::open(args.gpu).context("gpu_bench needs a GPU and the embedded kernels")?;
    let mut lines = Vec::new();

    // Ceiling: 64-byte stores into mapped host memory, many blocks.
    let host = HostBuffer::new(64 << 20);
    let hd = gpu.map_host(&host)?;
    let sms = gpu.context().attribute(
        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )? as u32;
    let (grid, block, iters) = (sms * 4, 256u32, 64u32);
    let st = Stamps::new(&gpu)?;
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
    });

    // Floor: fence.release.sys + 8-byte store, one thread. It moves between two levels from
    // launch to launch on the H200 (~525 and ~605 ns), so it is taken five times and the
    // lowest is the floor the put is compared with.
    let mut floor_ns = f64::INFINITY;
    for _ in 0..5 {
        let st = Stamps::new(&gpu)?;
        let (mut p, mut it, mut t) = (hd, 10_000u32, st.t());
        let mut params = [arg(&mut p), arg(&mut it), arg(&mut t)];
        // SAFETY: parameters match gv_bench_fence_store; `hd` is mapped host memory.
        unsafe { gpu.launch_sync("gv_bench_fence_store", (1, 1, 1), (1, 1, 1), 0, &mut params)? };
        floor_ns = floor_ns.min(st.elapsed_ns()? / 10_000.0);
    }
    lines.push(Line {
        test: "fence_store_floor",
        config: "1 thread, lowest of 5".into(),
        db: "-",
        value: floor_ns,
        unit: "ns",
    });

    let modes = [
        DoorbellMode::GpuDoorbell,
        DoorbellMode::BlueFlame,
        DoorbellMode::CpuProxy,
    ];
    let configs = [
        (
            "1 thread, exclusive, batch 1",
            shape(1, 1, 0, 8192, 1, false, Share::Exclusive),
        ),
        (
            "1 thread, exclusive, batch 1, GPU rings",
            Shape {
                rings: RingPlacement::Gpu,
                ..shape(1, 1, 0, 8192, 1, false, Share::Exclusive)
            },
        ),
        (
            "1 thread, shared, batch 1",
            shape(1, 1, 0, 8192, 1, false, Share::Gpu),
        ),
        (
            "1 thread, exclusive, batch 32",
            shape(1, 1, 0, 8192, 32, false, Share::Exclusive),
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
    ];
    let mut thread_rate = 0.0;
    // Warp scope against one thread, both owning their QP (exclusive), and the shared warp.
    let mut warp_rate = 0.0;
    let mut shared_warp_rate = 0.0;
    let mut gpu_rings_rate = 0.0;
    for mode in modes {
        for (name, sh) in configs {
            let r = post_rate(&gpu, mode, false, sh)
                .with_context(|| format!("post_only {name}, {}", db_name(mode)))?;
            eprintln!("post_only {name} {}: {:.3} M WQE/s", db_name(mode), r / 1e6);
            if mode == DoorbellMode::GpuDoorbell && name == "1 thread, exclusive, batch 1" {
                thread_rate = r;
                let value = 1e9 / r;
                lines.push(Line {
                    test: "single_put_cost",
                    config: name.into(),
                    db: db_name(mode),
                    value,
                    unit: "ns",
                });
            }
            if mode == DoorbellMode::GpuDoorbell
                && name == "1 thread, exclusive, batch 1, GPU rings"
            {
                gpu_rings_rate = r;
                lines.push(Line {
                    test: "single_put_cost",
                    config: name.into(),
                    db: db_name(mode),
                    value: 1e9 / r,
                    unit: "ns",
                });
            }
            if mode == DoorbellMode::GpuDoorbell && name == "1 warp, exclusive, warp scope" {
                warp_rate = r;
            }
            if mode == DoorbellMode::GpuDoorbell && name == "1 warp, warp scope" {
                shared_warp_rate = r;
            }
            lines.push(Line {
                test: "post_only",
                config: name.into(),
                db: db_name(mode),
                value: r / 1e6,
                unit: "M WQE/s",
            });
        }
    }
    let complete_configs = [
        (
            "1 thread, exclusive, batch 32",
            shape(1, 1, 0, 32768, 32, false, Share::Exclusive),
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
    for mode in modes {
        for (name, sh) in complete_configs {
            let r = post_rate(&gpu, mode, true, sh)
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
            });
        }
    }
    // Engine scaling: the same post-and-complete load on 1, 2, 4, ... engine threads.
    let mut one_engine = 0.0;
    for &e in &args.engines {
        let sh = Shape {
            engines: e,
            ..shape(64, 256, 2, 64, 1, true, Share::Gpu)
        };
        let mode = DoorbellMode::GpuDoorbell;
        let r = post_rate(&gpu, mode, true, sh)
            .with_context(|| format!("engine_scaling with {e} engine threads"))?;
        if e == 1 {
            one_engine = r;
        }
        let scaling = if one_engine > 0.0 {
            format!(
                " ({:.2}x one thread, {:.2} of linear)",
                r / one_engine,
                r / one_engine / e as f64
            )
        } else {
            String::new()
        };
        eprintln!(
            "engine_scaling {e} engine threads: {:.3} M WQE/s{scaling}",
            r / 1e6
        );
        lines.push(Line {
            test: "engine_scaling",
            config: format!("64 blocks, QP per block, block scope, {e} engine threads"),
            db: db_name(mode),
            value: r / 1e6,
            unit: "M WQE/s",
        });
    }
    if [thread_rate, warp_rate, shared_warp_rate, gpu_rings_rate].contains(&0.0) {
        bail!("missing reference rates");
    }
    let info = gpu.info().to_string();
    if args.json {
        for l in &lines {
            println!(
                "{}",
                serde_json::json!({"test": l.test, "config": l.config, "db": l.db, "value": l.value, "unit": l.unit, "gpu": info})
            );
        }
        println!(
            "{}",
            serde_json::json!({"test": "ratios", "single_put_over_floor": (1e9 / thread_rate) / floor_ns, "single_put_gpu_rings_over_floor": (1e9 / gpu_rings_rate) / floor_ns, "warp_over_thread": warp_rate / thread_rate, "shared_warp_over_thread": shared_warp_rate / thread_rate, "gpu": info})
        );
    } else {
        println!("# {info}");
        println!(
            "{:<18} {:<32} {:<6} {:>12} unit",
            "test", "config", "db", "value"
        );
        for l in &lines {
            println!(
                "{:<18} {:<32} {:<6} {:>12.3} {}",
                l.test, l.config, l.db, l.value, l.unit
            );
        }
        println!(
            "single put / (fence + store) floor: {:.2}x",
            (1e9 / thread_rate) / floor_ns
        );
        println!(
            "single put with GPU-resident rings / floor: {:.2}x",
            (1e9 / gpu_rings_rate) / floor_ns
        );
        println!(
            "warp-scope rate / one-thread rate (both exclusive): {:.1}x",
            warp_rate / thread_rate
        );
        println!(
            "shared warp-scope rate / exclusive one-thread rate: {:.1}x",
            shared_warp_rate / thread_rate
        );
    }
    Ok(())
}
