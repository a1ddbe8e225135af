//! The soft NIC's GPU memory against the CUDA driver's own copies, in one run (issue 45 item 2).
//!
//! - `copies`: per size, the median time of one copy by the soft NIC's device memory (the
//!   [`DeviceMemory`] a GPU-memory region or ring goes through: `read_to_host`,
//!   `write_from_host`, `copy`) and by the driver itself (`cuMemcpyDtoH` / `cuMemcpyHtoD` into
//!   and from pinned and pageable host memory, `cuMemcpyDtoDAsync` + synchronise, at 8 B
//!   `cuStreamWriteValue64` + synchronise, a way to store an aligned word without the copy
//!   engine, against the soft NIC's write of 8 bytes); the soft NIC's
//!   ratio is against the driver's copy with the same kind of host memory: pageable (the soft
//!   NIC's packet buffers, and most host regions, are ordinary memory) and pinned (host memory
//!   CUDA allocated or registered, which the soft NIC copies directly from 64 KiB on).
//! - `rdma`: WRITE and READ between two in-process soft NICs, GPU buffer to GPU buffer against
//!   host buffer to host buffer: the latency of one signaled WQE (post, ring, wait) and the rate
//!   of a window of WQEs (every 16th signaled, a doorbell per 16). For GPU buffers it also
//!   says on stderr how many WRITEs completed in runs whose device-to-device copies were queued
//!   and settled together (the requester device's `local_copy_batches` / `local_copy_wqes`).
//!
//! `devmem_bench [--gpu N] [--json] [--series copies,rdma] [--sizes 8,4096,...]`.

use anyhow::{ensure, Context as _, Result};
use clap::Parser;
use cudarc::driver::sys;
use gpuverbs::gpu::{DeviceMemory, Gpu};
use gpuverbs::post::{Completion, CtrlFlags, Local, Op, RingMode};
use gpuverbs::{Access, ConnectOptions, Context, CqOptions, DeviceRequest, HostBuffer, QpOptions};
use std::ffi::c_void;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(about = "The soft NIC's GPU-memory copies and RDMA rates against the CUDA driver's")]
struct Args {
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// Which series: copies, rdma.
    #[arg(long, value_delimiter = ',', default_value = "copies,rdma")]
    series: Vec<String>,
    /// Sizes in bytes.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8,64,512,4096,65536,1048576,4194304"
    )]
    sizes: Vec<usize>,
}

/// Time spent per measured point (at least `MIN_ITERS` copies, at most `MAX_ITERS`).
const POINT: Duration = Duration::from_millis(60);
const MIN_ITERS: usize = 16;
const MAX_ITERS: usize = 4000;

/// The median of `v` (the upper one of an even count).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of `once` over a point's iterations (one untimed warm-up call first).
fn time_median(mut once: impl FnMut() -> Result<()>) -> Result<f64> {
    once()?;
    let start = Instant::now();
    let mut t = Vec::new();
    while t.len() < MIN_ITERS || (start.elapsed() < POINT && t.len() < MAX_ITERS) {
        let t0 = Instant::now();
        once()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    Ok(median(&mut t))
}

/// Pinned host memory (`cuMemHostAlloc`), freed on drop.
struct Pinned(*mut u8);

impl Pinned {
    fn new(len: usize) -> Result<Self> {
        // SAFETY: a plain pinned allocation of `len` bytes, freed once in drop.
        let p = unsafe { cudarc::driver::result::malloc_host(len, 0) }.context("cuMemHostAlloc")?;
        Ok(Self(p.cast()))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once.
        let _ = unsafe { cudarc::driver::result::free_host(self.0.cast()) };
    }
}

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    r.result().with_context(|| what.to_string())
}

struct Row {
    series: &'static str,
    op: String,
    bytes: usize,
    us: f64,
    reference: Option<f64>,
}

impl Row {
    fn print(&self, json: bool) {
        let gbps = self.bytes as f64 / (self.us * 1e-6) / 1e9;
        let ratio = self.reference.map(|r| r / self.us);
        if json {
            let v = serde_json::json!({
                "series": self.series, "op": self.op, "bytes": self.bytes,
                "median_us": self.us, "gb_per_s": gbps, "speed_vs_reference": ratio,
            });
            println!("{v}");
        } else {
            let r = ratio.map_or(String::new(), |r| format!("  {r:.2}× the reference"));
            println!(
                "{:<6} {:<34} {:>8} B  {:>10.2} µs  {:>8.3} GB/s{r}",
                self.series, self.op, self.bytes, self.us, gbps
            );
        }
    }
}

/// The `copies` series at one size: the driver's copies first, then the soft NIC's.
fn copies(gpu: &std::sync::Arc<Gpu>, mem: &dyn DeviceMemory, n: usize, json: bool) -> Result<()> {
    gpu.context().bind_to_thread()?;
    let dev = gpu.alloc(2 * n)?;
    let (a, b) = (dev.ptr(), dev.ptr() + n as u64);
    let pinned = Pinned::new(n)?;
    let mut page = vec![0x5au8; n];
    let stream = cudarc::driver::result::stream::create(
        cudarc::driver::result::stream::StreamKind::NonBlocking,
    )?;
    let mut rows = Vec::new();
    let mut row = |op: &str, us: f64, reference: Option<f64>| {
        rows.push(Row {
            series: "copies",
            op: op.into(),
            bytes: n,
            us,
            reference,
        });
        us
    };
    // SAFETY (every driver copy below): `a`, `b` are `n` bytes each of a live allocation;
    // the pinned buffer and `page` hold `n` bytes and live across the calls.
    let dtoh_pinned = time_median(|| {
        check(
            unsafe { sys::cuMemcpyDtoH_v2(pinned.0.cast::<c_void>(), a, n) },
            "cuMemcpyDtoH",
        )
    })?;
    let dtoh_pinned = row("cuMemcpyDtoH, pinned", dtoh_pinned * 1e6, None);
    let dtoh = time_median(|| {
        check(
            unsafe { sys::cuMemcpyDtoH_v2(page.as_mut_ptr().cast::<c_void>(), a, n) },
            "cuMemcpyDtoH",
        )
    })?;
    let dtoh = row("cuMemcpyDtoH, pageable", dtoh * 1e6, None);
    let htod_pinned = time_median(|| {
        check(
            unsafe { sys::cuMemcpyHtoD_v2(a, pinned.0.cast::<c_void>(), n) },
            "cuMemcpyHtoD",
        )
    })?;
    let htod_pinned = row("cuMemcpyHtoD, pinned", htod_pinned * 1e6, None);
    let htod = time_median(|| {
        check(
            unsafe { sys::cuMemcpyHtoD_v2(a, page.as_ptr().cast::<c_void>(), n) },
            "cuMemcpyHtoD",
        )
    })?;
    let htod = row("cuMemcpyHtoD, pageable", htod * 1e6, None);
    let dtod = time_median(|| {
        check(
            unsafe { sys::cuMemcpyDtoDAsync_v2(b, a, n, stream) },
            "cuMemcpyDtoDAsync",
        )?;
        check(
            unsafe { sys::cuStreamSynchronize(stream) },
            "cuStreamSynchronize",
        )
    })?;
    let dtod = row("cuMemcpyDtoDAsync + sync", dtod * 1e6, None);
    if n == 8 {
        // a store of an aligned word by the GPU's front end, without the copy engine
        // SAFETY: `a` is 8-byte aligned (an allocation's start) in a live allocation; the
        // stream is live until destroyed below.
        let word = time_median(|| {
            check(
                unsafe { sys::cuStreamWriteValue64_v2(stream, a, 0x5a5a, 0) },
                "cuStreamWriteValue64",
            )?;
            check(
                unsafe { sys::cuStreamSynchronize(stream) },
                "cuStreamSynchronize",
            )
        })?;
        row("cuStreamWriteValue64 + sync", word * 1e6, None);
    }
    // SAFETY: created above, destroyed once; nothing uses it after.
    unsafe { cudarc::driver::result::stream::destroy(stream) }?;
    let nic_read = time_median(|| {
        // SAFETY: `page` is `n` writable bytes no reference covers during the call.
        unsafe { mem.read_to_host(a, page.as_mut_ptr(), n) }.map_err(Into::into)
    })?;
    row("soft NIC read (to pageable)", nic_read * 1e6, Some(dtoh));
    let nic_write = time_median(|| {
        // SAFETY: `page` is `n` readable bytes.
        unsafe { mem.write_from_host(a, page.as_ptr(), n) }.map_err(Into::into)
    })?;
    row(
        "soft NIC write (from pageable)",
        nic_write * 1e6,
        Some(htod),
    );
    let nic_read = time_median(|| {
        // SAFETY: the pinned buffer is `n` writable bytes no reference covers during the call.
        unsafe { mem.read_to_host(a, pinned.0, n) }.map_err(Into::into)
    })?;
    row(
        "soft NIC read (to pinned)",
        nic_read * 1e6,
        Some(dtoh_pinned),
    );
    let nic_write = time_median(|| {
        // SAFETY: the pinned buffer is `n` readable bytes.
        unsafe { mem.write_from_host(a, pinned.0, n) }.map_err(Into::into)
    })?;
    row(
        "soft NIC write (from pinned)",
        nic_write * 1e6,
        Some(htod_pinned),
    );
    let nic_copy = time_median(|| mem.copy(b, a, n).map_err(Into::into))?;
    row(
        "soft NIC copy (device to device)",
        nic_copy * 1e6,
        Some(dtod),
    );
    for r in rows {
        r.print(json);
    }
    Ok(())
}

/// Where the `rdma` series' buffers live.
#[derive(Clone, Copy, PartialEq)]
enum Place {
    Host,
    Gpu,
}

/// Signaled every this many WQEs in the rate window (a doorbell each time too).
const BATCH: usize = 16;
/// WQEs of the rate window.
const WINDOW: usize = 256;

/// The `rdma` series at one size and placement: latency and rate of WRITE and READ between two
/// in-process soft NICs; returns (write latency, write time per WQE, read latency, read time per
/// WQE) in seconds.
fn rdma(gpu: &std::sync::Arc<Gpu>, place: Place, n: usize) -> Result<[f64; 4]> {
    let (a, b) = (
        Context::open(DeviceRequest::Soft)?,
        Context::open(DeviceRequest::Soft)?,
    );
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (ca, cb) = (
        a.create_cq(CqOptions::default())?,
        b.create_cq(CqOptions::default())?,
    );
    let qa = pa.create_qp(QpOptions::new(&ca, &ca))?;
    let qb = pb.create_qp(QpOptions::new(&cb, &cb))?;
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let conn = ConnectOptions {
        access: all,
        ..Default::default()
    };
    qa.connect(&qb.endpoint(), conn)?;
    qb.connect(&qa.endpoint(), conn)?;
    let (host_a, host_b);
    let (dev_a, dev_b);
    let (mra, mrb) = match place {
        Place::Host => {
            host_a = HostBuffer::new(n);
            host_b = HostBuffer::new(n);
            (
                pa.register_with(&host_a, all)?,
                pb.register_with(&host_b, all)?,
            )
        }
        Place::Gpu => {
            dev_a = gpu.alloc(n)?;
            dev_b = gpu.alloc(n)?;
            (
                pa.register_device_mem(&dev_a, all)?,
                pb.register_device_mem(&dev_b, all)?,
            )
        }
    };
    let mut ini = qa.try_cpu_initiator(RingMode::Doca)?;
    let sge = [mra.sge(0, n as u32)];
    let write = Op::Write {
        remote: mrb.remote(0),
        local: Local::Sges(&sge),
        imm: None,
    };
    let read = Op::Read {
        remote: mrb.remote(0),
        local: &sge,
    };
    let timeout = Duration::from_secs(10);
    let done = |ini: &mut gpuverbs::post::CpuInitiator| -> Result<()> {
        let c = ini.wait_send(timeout)?;
        ensure!(matches!(c, Completion::Req { .. }), "{c:?}");
        Ok(())
    };
    let mut out = [0.0; 4];
    let counted = |ctx: &Context| {
        ctx.soft_device()
            .map(|d| d.counters())
            .map(|c| (c.local_copy_batches, c.local_copy_wqes))
    };
    let before = counted(&a);
    for (k, op) in [&write, &read].into_iter().enumerate() {
        out[2 * k] = time_median(|| {
            ini.post_and_ring(op, CtrlFlags::SIGNALED)?;
            done(&mut ini)
        })?;
        out[2 * k + 1] = time_median(|| {
            for i in 0..WINDOW {
                let last = i % BATCH == BATCH - 1;
                let flags = if last {
                    CtrlFlags::SIGNALED
                } else {
                    CtrlFlags::default()
                };
                ini.post(op, flags)?;
                if last {
                    ini.ring();
                }
                if i >= 2 * BATCH && last {
                    done(&mut ini)?;
                }
            }
            for _ in 0..2 {
                done(&mut ini)?;
            }
            Ok(())
        })? / WINDOW as f64;
        if let (0, Place::Gpu, Some((b0, w0)), Some((b1, w1))) = (k, place, before, counted(&a)) {
            eprintln!(
                "rdma {n} B, GPU memory: WRITEs completed in queued-copy runs: {} runs, {} WQEs",
                b1 - b0,
                w1 - w0
            );
        }
    }
    Ok(out)
}

fn main() -> Result<()> {
    let args = Args::parse();
    for s in &args.series {
        ensure!(
            ["copies", "rdma"].contains(&s.as_str()),
            "unknown series {s:?} (copies, rdma)"
        );
    }
    let gpu = Gpu::open(args.gpu)?;
    let want = |s: &str| args.series.iter().any(|x| x == s);
    if want("copies") {
        let mem = gpu.device_memory();
        for &n in &args.sizes {
            copies(&gpu, mem.as_ref(), n, args.json)?;
        }
    }
    if want("rdma") {
        for &n in &args.sizes {
            let host = rdma(&gpu, Place::Host, n)?;
            let dev = rdma(&gpu, Place::Gpu, n)?;
            let names = [
                "WRITE latency",
                "WRITE per WQE",
                "READ latency",
                "READ per WQE",
            ];
            for (i, name) in names.iter().enumerate() {
                for (place, v, reference) in [
                    ("host", host[i], None),
                    ("GPU", dev[i], Some(host[i] * 1e6)),
                ] {
                    Row {
                        series: "rdma",
                        op: format!("{name}, {place} memory"),
                        bytes: n,
                        us: v * 1e6,
                        reference,
                    }
                    .print(args.json);
                }
            }
        }
    }
    Ok(())
}
