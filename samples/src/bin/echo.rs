//! echo: a persistent GPU kernel that answers every message it receives with the same bytes,
//! without the CPU (the "GPU RoCE transceiver" pattern of NVQLink / Holoscan). The server side
//! is one resident kernel (`gv_sample_echo`, one thread owning its exported QP): it keeps
//! `--slots` receive buffers posted, and for each receive completion (a SEND, or a WRITE_IMM
//! whose immediate names the slot the peer wrote) sends the slot's bytes back, takes that
//! send's completion and posts the buffer again. The client, a CPU initiator on the peer QP,
//! sends `--iters` messages of `--size` bytes (each a new pattern), waits for each answer,
//! checks every byte and measures the round trip; then it asks the kernel to stop (a word in
//! host memory the kernel polls), which reports how many messages it echoed and why it
//! stopped (an error CQE with its syndrome).
//!
//! With `--initiator gpu` the client is a kernel too (one launch, two blocks: block 0 serves,
//! block 1 sends SENDs, checks each answer on the GPU and times it with %globaltimer; then it
//! stops the server itself).
//!
//! Loopback between two soft NICs of this process: `echo [--gpu N] [-s SIZE] [-n ITERS]
//! [--slots N] [--op send|write-imm] [--initiator cpu|gpu] [--json]`.

use anyhow::{bail, ensure, Context as _, Result};
use clap::{Parser, ValueEnum};
use gpuverbs::gpu::Gpu;
use gpuverbs::post::{Completion, CtrlFlags, Local, Op, RingMode};
use gpuverbs::{Access, Context, CqOptions, DeviceRequest, HostBuffer, QpOptions};
use gpuverbs_samples::{arg, connect_pair, LatStats};
use serde_json::json;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum EchoOp {
    /// The client SENDs; the kernel answers from the receive buffer.
    Send,
    /// The client RDMA-WRITEs into a slot and names it in the immediate (WRITE_IMM).
    WriteImm,
}

#[derive(Parser)]
#[command(about = "A persistent GPU kernel echoes every message; the client (CPU or GPU) measures")]
struct Args {
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Message size in bytes.
    #[arg(short = 's', long, default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=(1 << 20)))]
    size: u32,
    /// Messages.
    #[arg(short = 'n', long, default_value_t = 10_000)]
    iters: u32,
    /// Receive buffers the kernel keeps posted.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=64))]
    slots: u32,
    /// How the client sends.
    #[arg(long, value_enum, default_value_t = EchoOp::Send)]
    op: EchoOp,
    /// Who the client is: a CPU initiator, or a GPU kernel (SEND only).
    #[arg(long, value_enum, default_value_t = Client::Cpu)]
    initiator: Client,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Client {
    /// A CPU initiator on the client QP.
    Cpu,
    /// A kernel block on the exported client QP.
    Gpu,
}

/// The longest the client waits for one answer.
const ANSWER: Duration = Duration::from_secs(5);
/// The server's wait for the next message (a run-out wait only makes it look at the stop word
/// again); its other calls (send, completion, receive) get [`ANSWER`].
const KERNEL_WAIT_NS: u64 = 1_000_000;
/// Threads of the GPU client's block: they fill and check the message together, a warp's
/// eight-byte stores side by side (one thread of the server's block serves).
const CLIENT_THREADS: u32 = 256;

fn main() -> std::process::ExitCode {
    gpuverbs_samples::exit_with("echo", run(Args::parse()))
}

fn run(a: Args) -> Result<()> {
    let gpu = Gpu::open(a.gpu).context("echo needs a GPU: the server is a kernel")?;
    let (sc, cc) = (
        Context::open(DeviceRequest::Soft)?,
        Context::open(DeviceRequest::Soft)?,
    );
    let (sp, cp) = (sc.alloc_pd(), cc.alloc_pd());
    let cq = |c: &Context| c.create_cq(CqOptions::default());
    // the server takes receive completions: a receive CQ of its own
    let (s_scq, s_rcq, c_scq, c_rcq) = (cq(&sc)?, cq(&sc)?, cq(&cc)?, cq(&cc)?);
    let qs = sp.create_qp(QpOptions::new(&s_scq, &s_rcq))?;
    let qc = cp.create_qp(QpOptions::new(&c_scq, &c_rcq))?;
    connect_pair(&qs, &qc, None)?;
    let slot = a.size as usize;
    let slots = a.slots as usize;
    let sbuf = HostBuffer::new(slot * slots);
    let smr = sp.register_with(&sbuf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let (src, back) = (HostBuffer::new(slot), HostBuffer::new(slot));
    let src_mr = cp.register(&src)?;
    let back_mr = cp.register(&back)?;
    let export = gpu.export_qp(&qs)?;
    // the stop word and the kernel's report, in host memory the kernel reaches
    let ctl = HostBuffer::new(256);
    let ctl_d = gpu.map_host(&ctl)?;
    // SAFETY: `ctl` lives until the end of `run`, after the kernel has returned; the kernel
    // only reads this word.
    let stop = unsafe { &*(ctl.addr() as *const AtomicU32) };
    if a.initiator == Client::Gpu {
        ensure!(
            a.op == EchoOp::Send,
            "--initiator gpu sends SENDs (--op send)"
        );
        let client_export = gpu.export_qp(&qc)?;
        let (src_d, back_d) = (gpu.map_host(&src)?, gpu.map_host(&back)?);
        let rtt_buf = HostBuffer::new(8 * a.iters as usize);
        let rtt_d = gpu.map_host(&rtt_buf)?;
        let (mut qsd, mut snic, mut slk, mut sz, mut n) =
            (export.ptr(), smr.addr(), smr.lkey().0, a.size, a.slots);
        let (mut qcd, mut cnic, mut cdev, mut clk) =
            (client_export.ptr(), src_mr.addr(), src_d, src_mr.lkey().0);
        let (mut bnic, mut bdev, mut blk, mut size, mut iters) =
            (back_mr.addr(), back_d, back_mr.lkey().0, a.size, a.iters);
        let (mut st, mut budget, mut cbudget, mut out, mut rtt) = (
            ctl_d,
            KERNEL_WAIT_NS,
            ANSWER.as_nanos() as u64,
            ctl_d + 8,
            rtt_d,
        );
        let mut params = [
            arg(&mut qsd),
            arg(&mut snic),
            arg(&mut slk),
            arg(&mut sz),
            arg(&mut n),
            arg(&mut qcd),
            arg(&mut cnic),
            arg(&mut cdev),
            arg(&mut clk),
            arg(&mut bnic),
            arg(&mut bdev),
            arg(&mut blk),
            arg(&mut size),
            arg(&mut iters),
            arg(&mut st),
            arg(&mut budget),
            arg(&mut cbudget),
            arg(&mut out),
            arg(&mut rtt),
        ];
        // SAFETY: the parameters match gv_sample_echo_gpu's signature; both descriptors, the
        // mapped buffers (payloads, control page, round trips) and the registered regions live
        // until the synchronous launch has returned.
        unsafe {
            gpu.launch_sync(
                "gv_sample_echo_gpu",
                (2, 1, 1),
                (CLIENT_THREADS, 1, 1),
                0,
                &mut params,
            )
        }?;
        let words = ctl.to_vec();
        let word = |i: usize| {
            let at = 8 + 8 * i;
            u64::from_ne_bytes(words[at..at + 8].try_into().expect("8 bytes"))
        };
        let report: [u64; 6] = std::array::from_fn(word);
        ensure!(report[2] == 0, "{}", kernel_failure(&report));
        ensure!(
            word(6) == 0 && word(7) == 0,
            "the client kernel ended with status {} (error CQE syndrome {:#x}), {} bytes wrong",
            word(6),
            word(8),
            word(7)
        );
        let r = rtt_buf.to_vec();
        let mut rtts: Vec<f64> = r
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")) as f64 / 1e3)
            .collect();
        return print(&a, &gpu, report, &mut rtts);
    }
    let kernel = std::thread::scope(|sc| -> Result<(Vec<f64>, [u64; 6])> {
        let k = sc.spawn(|| -> Result<()> {
            let (mut q, mut nic, mut lk, mut sz, mut n, mut st) = (
                export.ptr(),
                smr.addr(),
                smr.lkey().0,
                a.size,
                a.slots,
                ctl_d,
            );
            let (mut budget, mut op_budget, mut out) =
                (KERNEL_WAIT_NS, ANSWER.as_nanos() as u64, ctl_d + 8);
            let mut params = [
                arg(&mut q),
                arg(&mut nic),
                arg(&mut lk),
                arg(&mut sz),
                arg(&mut n),
                arg(&mut st),
                arg(&mut budget),
                arg(&mut op_budget),
                arg(&mut out),
            ];
            // SAFETY: the parameters match gv_sample_echo's signature; the descriptor, the
            // mapped control page and the registered buffers outlive the launch (the scope
            // joins it before they drop).
            unsafe { gpu.launch_sync("gv_sample_echo", (1, 1, 1), (1, 1, 1), 0, &mut params) }?;
            Ok(())
        });
        let client = client(&a, &qc, &src, &src_mr, &back, &back_mr, &smr);
        // whatever the client's outcome, the kernel is asked to stop
        stop.store(1, Ordering::Release);
        let launched = k
            .join()
            .map_err(|_| anyhow::anyhow!("the launch thread panicked"))?;
        launched?;
        let words = ctl.to_vec();
        let mut report = [0u64; 6];
        for (i, r) in report.iter_mut().enumerate() {
            let at = 8 + 8 * i;
            *r = u64::from_ne_bytes(words[at..at + 8].try_into().expect("8 bytes"));
        }
        match client {
            Ok(rtts) => Ok((rtts, report)),
            // the kernel's reason first: the client only saw that no answer came
            Err(e) if report[2] != 0 => Err(e.context(kernel_failure(&report))),
            Err(e) => Err(e),
        }
    });
    let (mut rtts, report) = kernel?;
    ensure!(report[2] == 0, "{}", kernel_failure(&report));
    print(&a, &gpu, report, &mut rtts)
}

/// Checks the kernel's count and prints the round trips.
fn print(a: &Args, gpu: &Gpu, report: [u64; 6], rtts: &mut [f64]) -> Result<()> {
    ensure!(
        report[0] == u64::from(a.iters) && report[1] == u64::from(a.iters) * u64::from(a.size),
        "the kernel echoed {} messages, {} bytes (expected {} of {} B)",
        report[0],
        report[1],
        a.iters,
        a.size
    );
    let st = LatStats::of(rtts);
    let client = format!("{:?}", a.initiator).to_lowercase();
    if a.json {
        println!(
            "{}",
            json!({"test": "echo", "op": format!("{:?}", a.op).to_lowercase(), "bytes": a.size,
                   "initiator": client,
                   "iterations": a.iters, "slots": a.slots, "gpu": gpu.info().to_string(),
                   "echoed": report[0], "validated": true, "rtt_min_us": st.min,
                   "rtt_typical_us": st.typical, "rtt_avg_us": st.avg, "rtt_p99_us": st.p99,
                   "rtt_p99_9_us": st.p999, "rtt_max_us": st.max})
        );
    } else {
        println!(
            "# echo: a persistent kernel on {} answers; {client} client",
            gpu.info()
        );
        println!(
            " {:<8} {:<10} {:<8} {:>12} {:>12} {:>12} {:>12} {:>12}",
            "#bytes", "op", "#iters", "rtt_min[us]", "typical[us]", "avg[us]", "99%[us]", "max[us]"
        );
        println!(
            " {:<8} {:<10} {:<8} {:>12.2} {:>12.2} {:>12.2} {:>12.2} {:>12.2}",
            a.size,
            format!("{:?}", a.op).to_lowercase(),
            a.iters,
            st.min,
            st.typical,
            st.avg,
            st.p99,
            st.max
        );
        println!(
            " every answer's bytes checked; the kernel echoed {} messages and stopped on request",
            report[0]
        );
    }
    Ok(())
}

/// Why the kernel stopped, from its report.
fn kernel_failure(r: &[u64; 6]) -> String {
    format!(
        "the echo kernel stopped with status {} (error CQE syndrome {:#x}, vendor {:#x}, WQE {})",
        r[2], r[3], r[4], r[5]
    )
}

/// The client: `iters` messages, each answered and checked; returns the round trips (µs).
#[allow(clippy::too_many_arguments)]
fn client(
    a: &Args,
    qc: &gpuverbs::Qp,
    src: &HostBuffer,
    src_mr: &gpuverbs::Mr,
    back: &HostBuffer,
    back_mr: &gpuverbs::Mr,
    smr: &gpuverbs::Mr,
) -> Result<Vec<f64>> {
    let mut ini = qc.try_cpu_initiator(RingMode::RdmaCore)?;
    let mut rtts = Vec::with_capacity(a.iters as usize);
    let size = a.size;
    for k in 0..a.iters {
        let pattern: Vec<u8> = (0..size)
            .map(|i| (i.wrapping_mul(31) ^ k.wrapping_mul(2654435761)) as u8 | 1)
            .collect();
        src.write(0, &pattern);
        back.fill(0, size as usize, 0);
        ini.post_recv(&[back_mr.sge(0, size)])?;
        let op = match a.op {
            EchoOp::Send => Op::Send {
                local: Local::Sges(&[src_mr.sge(0, size)]),
                imm: None,
            },
            EchoOp::WriteImm => {
                let s = k % a.slots;
                Op::Write {
                    remote: smr.remote(u64::from(s) * u64::from(size)),
                    local: Local::Sges(&[src_mr.sge(0, size)]),
                    imm: Some(s),
                }
            }
        };
        let t0 = Instant::now();
        ini.post_and_ring(&op, CtrlFlags::SIGNALED)?;
        let answer = ini
            .wait_recv(ANSWER)
            .with_context(|| format!("no answer to message {k}"))?;
        let rtt = t0.elapsed();
        match answer {
            Completion::Resp { byte_cnt, .. } if byte_cnt == size => {}
            c => bail!("message {k}: the answer completed as {c:?}"),
        }
        match ini.wait_send(ANSWER)? {
            Completion::Req { .. } => {}
            c => bail!("message {k}: the send completed as {c:?}"),
        }
        ensure!(
            back.to_vec()[..size as usize] == pattern[..],
            "message {k}: the answer's bytes differ"
        );
        rtts.push(rtt.as_secs_f64() * 1e6);
    }
    Ok(rtts)
}
