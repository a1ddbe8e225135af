//! A user crate driving a gpuverbs QP from ITS OWN CUDA kernel.
//!
//! `build.rs` compiles `kernels/*.cu` with gpuverbs-kernel-build into one
//! `$OUT_DIR/user_kernels.fatbin`: `user_put.cu` (which includes `<gpuverbs/qp.cuh>`) and
//! `put_signal.cu`, the README's kernel (the test `tests/readme_kernel.rs` keeps README.md's copy
//! equal to it). This program embeds that fatbin, sets up two soft-NIC devices with one
//! connected RC QP pair, exports side A's QP to the GPU, loads the fatbin as a module of the
//! gpuverbs GPU's CUDA context, launches `user_put` with the descriptor pointer and checks every
//! byte that arrived at side B; then launches the README's `put_signal` on the same QP and its
//! `wait_put` on side B's signal word, and checks both statuses, the bytes and the signal.
//!
//! Usage: `user-kernel [GPU ordinal]` (default 0). Needs an NVIDIA GPU and driver; elsewhere it
//! exits with an error saying so.

use anyhow::{bail, ensure, Context as _, Result};
use cudarc::driver::{result as cu, sys, CudaContext};
use gpuverbs::gpu::Gpu;
use gpuverbs::{
    Access, ConnectOptions, Context, CqOptions, DeviceRequest, DoorbellMode, HostBuffer, QpOptions,
};
use std::ffi::{c_void, CString};
use std::process::ExitCode;
use std::sync::Arc;

/// Bytes with the alignment the driver wants for an in-memory image.
#[repr(C, align(16))]
struct Aligned<B: ?Sized>(B);

/// This crate's kernels (empty when nvcc was missing at build time).
static USER_FATBIN: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(
    env!("OUT_DIR"),
    "/user_kernels.fatbin"
)));

/// `built`, or why build.rs did not build the kernels.
const USER_KERNELS_STATUS: &str = env!("USER_KERNELS_STATUS");

/// Threads of the one block; each writes one chunk.
const THREADS: u32 = 32;
/// Bytes per thread.
const CHUNK: u32 = 256;
/// Pattern seed (the kernel and the check below agree on the pattern).
const SEED: u32 = 0x5a;
/// Bound of every wait in the kernel.
const BUDGET_NS: u64 = 2_000_000_000;

/// The byte at index `i` (same formula as `user_put_cu::pattern` in kernels/user_put.cu).
fn pattern(seed: u32, i: u32) -> u8 {
    seed.wrapping_add(i.wrapping_mul(7)).wrapping_add(i >> 8) as u8
}

/// A module loaded from our own fatbin into the gpuverbs GPU's context; unloaded on drop.
struct UserModule {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
}

impl UserModule {
    fn load(ctx: &Arc<CudaContext>, image: &'static [u8]) -> Result<Self> {
        ctx.bind_to_thread().context("cuCtxSetCurrent")?;
        // SAFETY: `image` is a complete fatbin produced by nvcc (gpuverbs-kernel-build checked its
        // magic), 16-byte aligned, and lives for the whole program.
        let module = unsafe { cu::module::load_data(image.as_ptr().cast()) }
            .context("cuModuleLoadData (this crate's fatbin)")?;
        Ok(Self {
            ctx: ctx.clone(),
            module,
        })
    }

    fn function(&self, name: &str) -> Result<sys::CUfunction> {
        // SAFETY: the module is loaded until `self` drops.
        unsafe { cu::module::get_function(self.module, CString::new(name)?) }
            .with_context(|| format!("cuModuleGetFunction({name})"))
    }
}

impl Drop for UserModule {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: loaded in `load`, unloaded once, after every launch synchronised.
            let _ = unsafe { cu::module::unload(self.module) };
        }
    }
}

/// Launches `f` on one block of `threads` threads with `params` and waits for it.
///
/// # Safety
/// `params` must match the kernel's parameters in order and type, and every pointer among them
/// must stay valid until the launch is synchronised (this function returns).
unsafe fn launch(
    gpu: &Gpu,
    f: sys::CUfunction,
    threads: u32,
    params: &mut [*mut c_void],
) -> Result<()> {
    gpu.context().bind_to_thread().context("cuCtxSetCurrent")?;
    let stream = gpu.context().default_stream();
    // SAFETY: the caller's promise.
    unsafe { cu::launch_kernel(f, (1, 1, 1), (threads, 1, 1), 0, stream.cu_stream(), params) }
        .context("cuLaunchKernel")?;
    stream.synchronize().context("cuStreamSynchronize")?;
    Ok(())
}

/// The first two `int`s of `status` (a kernel's status and syndrome).
fn status_pair(status: &gpuverbs::gpu::DeviceMem) -> Result<[i32; 2]> {
    let mut raw = [0u8; 8];
    status.read(0, &mut raw)?;
    let w = |i: usize| i32::from_ne_bytes(raw[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    Ok([w(0), w(1)])
}

/// The README's kernel: `put_signal` puts the first `LEN` bytes of `src` into a buffer of side
/// B and adds 1 to B's signal word, on the QP exported at `q`; `wait_put` then waits on side B
/// (through the signal word's GPU mapping) until it reads 1. Checks both statuses, the bytes and
/// the signal.
fn readme_kernel(
    gpu: &Arc<Gpu>,
    module: &UserModule,
    q: u64,
    (src, src_mr): (&HostBuffer, &gpuverbs::Mr),
    pb: &gpuverbs::Pd,
) -> Result<()> {
    const LEN: u32 = 1000;
    let dst = HostBuffer::new(LEN as usize);
    let sig = HostBuffer::new(8);
    let dst_mr = pb.register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let sig_mr = pb.register_with(&sig, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
    let sig_gpu = gpu.map_host(&sig)?;
    let (put_out, wait_out) = (gpu.alloc(8)?, gpu.alloc(8)?);
    let (mut q, mut laddr, mut lk, mut raddr, mut rk, mut len) = (
        q,
        src_mr.addr(),
        src_mr.lkey().0,
        dst_mr.addr(),
        dst_mr.rkey().0,
        LEN,
    );
    let (mut sig_addr, mut sig_rk, mut out) = (sig_mr.addr(), sig_mr.rkey().0, put_out.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut laddr),
        arg(&mut lk),
        arg(&mut raddr),
        arg(&mut rk),
        arg(&mut len),
        arg(&mut sig_addr),
        arg(&mut sig_rk),
        arg(&mut out),
    ];
    // SAFETY: the parameters match `put_signal(gpuverbs_qp*, uint64_t, uint32_t, uint64_t,
    // uint32_t, uint32_t, uint64_t, uint32_t, int*)`; q and out are device memory alive past
    // the synchronised launch; the addresses are only used by the NIC, which checks the keys.
    unsafe { launch(gpu, module.function("put_signal")?, 1, &mut params) }.context("put_signal")?;
    let (mut sig_ptr, mut wout) = (sig_gpu, wait_out.ptr());
    let mut params = [arg(&mut sig_ptr), arg(&mut wout)];
    // SAFETY: `wait_put(const uint64_t*, int*)`: the signal word's GPU mapping (of `sig`, alive
    // here) and 8 bytes of device memory, both alive past the synchronised launch.
    unsafe { launch(gpu, module.function("wait_put")?, 1, &mut params) }.context("wait_put")?;
    let [put, syndrome] = status_pair(&put_out)?;
    ensure!(
        put == 0,
        "put_signal: status {put}, syndrome {syndrome:#04x}"
    );
    let [wait, _] = status_pair(&wait_out)?;
    ensure!(wait == 0, "wait_put: status {wait}");
    ensure!(
        dst.to_vec() == src.to_vec()[..LEN as usize],
        "put_signal's bytes differ at the peer"
    );
    let signal = u64::from_ne_bytes(sig.to_vec()[..8].try_into().expect("8 bytes"));
    ensure!(signal == 1, "the signal word reads {signal}, not 1");
    println!(
        "user-kernel: the README's put_signal: {LEN} bytes and the signal arrived, wait_put saw it"
    );
    Ok(())
}

/// Pointer to a local, for the kernel parameter array.
fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("user-kernel: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let ordinal: usize = match std::env::args().nth(1) {
        Some(a) => a.parse().with_context(|| format!("GPU ordinal `{a}`"))?,
        None => 0,
    };
    if USER_FATBIN.0.is_empty() {
        bail!(
            "this build has no user kernels ({USER_KERNELS_STATUS}): install nvcc (`cargo xtask \
             setup-cuda`, or set NVCC / CUDA_HOME) and rebuild"
        );
    }
    let gpu = Gpu::open(ordinal).with_context(|| {
        format!("cannot open GPU {ordinal}: this example needs an NVIDIA GPU and its driver")
    })?;
    println!("user-kernel: GPU {}", gpu.info());

    // Two soft-NIC devices in this process, one RC QP each, connected to each other.
    let a = Context::open(DeviceRequest::Soft)?;
    let b = Context::open(DeviceRequest::Soft)?;
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let cq_opts = CqOptions {
        depth: 64,
        ..Default::default()
    };
    let (cqa, cqb) = (a.create_cq(cq_opts)?, b.create_cq(cq_opts)?);
    let mut oa = QpOptions::new(&cqa, &cqa);
    oa.sq_blocks = 64;
    oa.doorbell = DoorbellMode::GpuDoorbell;
    let qa = pa.create_qp(oa)?;
    let qb = pb.create_qp(QpOptions::new(&cqb, &cqb))?;
    let conn = ConnectOptions {
        access: Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        timeout: 10,
        retry_cnt: 3,
        ..Default::default()
    };
    qa.connect(&qb.endpoint(), conn)?;
    qb.connect(&qa.endpoint(), conn)?;

    // Source on side A (written by the kernel through its GPU mapping), destination on side B.
    let bytes = (THREADS * CHUNK) as usize;
    let src = HostBuffer::new(bytes);
    let dst = HostBuffer::new(bytes);
    let src_mr = pa.register_with(&src, Access::LOCAL_WRITE)?;
    let dst_mr = pb.register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let src_gpu = gpu.map_host(&src)?;
    let export = gpu.export_qp(&qa)?;
    let status = gpu.alloc(16)?;

    // Our own module, in the context gpuverbs opened (the descriptor and mappings live there).
    let module = UserModule::load(gpu.context(), &USER_FATBIN.0)?;
    let f = module.function("user_put")?;
    let (mut q, mut lbuf, mut laddr, mut lk) =
        (export.ptr(), src_gpu, src_mr.addr(), src_mr.lkey().0);
    let (mut raddr, mut rk, mut chunk, mut seed, mut budget, mut out) = (
        dst_mr.addr(),
        dst_mr.rkey().0,
        CHUNK,
        SEED,
        BUDGET_NS,
        status.ptr(),
    );
    let mut params = [
        arg(&mut q),
        arg(&mut lbuf),
        arg(&mut laddr),
        arg(&mut lk),
        arg(&mut raddr),
        arg(&mut rk),
        arg(&mut chunk),
        arg(&mut seed),
        arg(&mut budget),
        arg(&mut out),
    ];
    gpu.context().bind_to_thread().context("cuCtxSetCurrent")?;
    let stream = gpu.context().default_stream();
    // SAFETY: the parameters match `user_put(gpuverbs_qp*, uint8_t*, uint64_t, uint32_t,
    // uint64_t, uint32_t, uint32_t, uint32_t, uint64_t, int*)` in order and type; q (device
    // memory), lbuf (mapped host memory of `bytes` bytes) and out (16 bytes of device memory)
    // stay alive until the stream is synchronised below; laddr/raddr are only used by the NIC,
    // which checks them against the MRs.
    unsafe {
        cu::launch_kernel(
            f,
            (1, 1, 1),
            (THREADS, 1, 1),
            0,
            stream.cu_stream(),
            &mut params,
        )
    }
    .context("cuLaunchKernel(user_put)")?;
    stream.synchronize().context("cuStreamSynchronize")?;

    let mut raw = [0u8; 16];
    status.read(0, &mut raw)?;
    let s: Vec<i32> = raw
        .chunks_exact(4)
        .map(|c| i32::from_ne_bytes(c.try_into().expect("4 bytes")))
        .collect();
    let names = ["OK", "ERROR_CQE", "TIMEOUT", "INVALID", "BUSY", "FULL"];
    ensure!(
        s[0] == 0,
        "kernel status {} (syndrome {:#04x}, vendor {:#04x}, wqe {})",
        names.get(s[0] as usize).unwrap_or(&"?"),
        s[1],
        s[2],
        s[3]
    );

    let expected: Vec<u8> = (0..bytes as u32).map(|i| pattern(SEED, i)).collect();
    ensure!(
        src.to_vec() == expected,
        "the kernel's stores to the source differ"
    );
    let got = dst.to_vec();
    if let Some(i) = (0..bytes).find(|&i| got[i] != expected[i]) {
        bail!(
            "byte {i} (thread {}) differs: got {:#04x}, expected {:#04x}",
            i / CHUNK as usize,
            got[i],
            expected[i]
        );
    }
    readme_kernel(&gpu, &module, export.ptr(), (&src, &src_mr), &pb)?;
    let desc = export.read()?;
    let counters = a.soft_device().map(|d| d.counters());
    if let Some(c) = &counters {
        ensure!(c.errors.is_empty(), "device errors: {:?}", c.errors);
    }
    println!(
        "user-kernel: {THREADS} threads x {CHUNK} B put by this crate's kernel, {bytes} bytes \
         verified at the peer; SQ blocks published {}, retired {}; doorbells seen {}",
        desc.sq_ready,
        desc.sq_retired,
        counters.map_or(0, |c| c.doorbells_seen)
    );
    drop(module);
    Ok(())
}
