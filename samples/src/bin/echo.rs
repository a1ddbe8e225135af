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
//! With `--initiator gpu` the client is a kernel too (SEND only): it fills each message, sends
//! it, checks the answer on the GPU and times it with %globaltimer.
//!
//! Roles, as perftest's (the TCP bootstrap of `put_bw` and `write_lat`, samples/src/peer.rs):
//!
//! - `echo [--loopback]` (no server host and no `-p`: today's default): both sides in this
//!   process, between two soft NICs; with `--initiator gpu` one launch of two blocks (block 0
//!   serves, block 1 is the client, which stops the server itself).
//! - `echo -p PORT` (server; `-p 0`: a port the system picks, printed): this process's soft
//!   NIC gets a wire port (RoCEv2 over UDP, docs/wire.md), its resident kernel echoes until the
//!   client is done, then the server sets the stop word the kernel polls and reports how many
//!   messages it echoed and why it stopped. It needs a GPU and says so at once without one.
//! - `echo SERVER -p PORT [--initiator cpu|gpu]` (client): the CPU initiator by default, or a
//!   client kernel (`gv_sample_echo_client`); it measures the round trips, checks every byte
//!   and tells the server over TCP when it is done.
//!
//! Both processes print the result (the client's round trips, the kernel's count); a failure on
//! either side ends both, with its reason (an error CQE's syndrome, a message not answered).
//! Both on one host and one GPU: the CPU client (the default) leaves one resident kernel on the
//! GPU (H200: about 70 µs per 64-byte round trip over the soft NICs' UDP wire); with
//! `--initiator gpu` two processes' kernels time-slice the GPU without MPS (about 4.5 ms).
//!
//! `echo [--gpu N] [-s SIZE] [-n ITERS] [--slots N] [--op send|write-imm]
//! [--initiator cpu|gpu] [--json] [--loopback | -p PORT [SERVER] [--timeout S] [--wire-port P]]`.

use anyhow::{bail, ensure, Context as _, Result};
use clap::{Parser, ValueEnum};
use gpuverbs::gpu::Gpu;
use gpuverbs::post::{Completion, CtrlFlags, Local, Op, RemoteAddr, RingMode};
use gpuverbs::{Access, Context, CqOptions, DeviceRequest, HostBuffer, QpOptions};
use gpuverbs_samples::{arg, connect_pair, LatStats, Role, RoleArgs};
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
#[command(
    about = "A persistent GPU kernel echoes every message; the client (CPU or GPU) measures",
    after_help = "Roles: `echo` or `echo --loopback` runs both sides in this process; `echo -p \
                  PORT` is the server (its kernel echoes; it needs a GPU) and `echo SERVER -p \
                  PORT` the client (CPU initiator, or --initiator gpu), over the TCP bootstrap \
                  and the soft NICs' RoCEv2-over-UDP wire."
)]
struct Args {
    #[command(flatten)]
    roles: RoleArgs,
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

/// The GPU and its kernels (the server's and a GPU client's), or why not.
fn open_gpu(a: &Args, who: &str) -> Result<std::sync::Arc<Gpu>> {
    let gpu = Gpu::open(a.gpu).with_context(|| format!("echo needs a GPU: {who}"))?;
    gpuverbs::cuda::fatbin().with_context(|| {
        format!("echo needs the gpuverbs kernels ({who}), and this build has none")
    })?;
    Ok(gpu)
}

fn run(a: Args) -> Result<()> {
    if a.initiator == Client::Gpu {
        ensure!(
            a.op == EchoOp::Send,
            "--initiator gpu sends SENDs (--op send)"
        );
    }
    match a.roles.role() {
        Role::Loopback => run_loopback(a),
        Role::Server | Role::Client => remote::run(&a),
    }
}

/// Loopback: the server's QP (exported to its kernel) and slots, and the client's QP and
/// buffers, on two soft NICs of this process; then the GPU client or the CPU client.
fn run_loopback(a: Args) -> Result<()> {
    let gpu = open_gpu(&a, "the server is a kernel")?;
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
    let pair = Pair {
        gpu: &gpu,
        export: &export,
        smr: &smr,
        qc: &qc,
        src: &src,
        src_mr: &src_mr,
        back: &back,
        back_mr: &back_mr,
        ctl: &ctl,
        ctl_d,
        stop,
    };
    if a.initiator == Client::Gpu {
        return gpu_client(&a, &pair);
    }
    cpu_client(&a, &pair)
}

/// The loopback's pieces: the server's exported QP and slots, the client's QP and buffers,
/// and the control page (the stop word, then the kernel's report) with its GPU address.
struct Pair<'a> {
    gpu: &'a std::sync::Arc<Gpu>,
    export: &'a gpuverbs::gpu::ExportedQp,
    smr: &'a gpuverbs::Mr,
    qc: &'a gpuverbs::Qp,
    src: &'a HostBuffer,
    src_mr: &'a gpuverbs::Mr,
    back: &'a HostBuffer,
    back_mr: &'a gpuverbs::Mr,
    ctl: &'a HostBuffer,
    ctl_d: u64,
    stop: &'a AtomicU32,
}

/// Loopback with the GPU client: one launch of two blocks (block 0 serves, block 1 is the
/// client, which stops the server itself); the kernel's report, the client's status and its
/// round trips.
fn gpu_client(a: &Args, p: &Pair) -> Result<()> {
    let Pair {
        gpu,
        export,
        smr,
        qc,
        src,
        src_mr,
        back,
        back_mr,
        ctl,
        ctl_d,
        ..
    } = *p;
    let client_export = gpu.export_qp(qc)?;
    let (src_d, back_d) = (gpu.map_host(src)?, gpu.map_host(back)?);
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
    print(
        a,
        &gpu.info().to_string(),
        None,
        report,
        LatStats::of(&mut rtts),
    )
}

/// Loopback with the CPU client: the server kernel on a thread of its own while the client
/// sends, then the stop word (whatever the client's outcome) and the kernel's report.
fn cpu_client(a: &Args, p: &Pair) -> Result<()> {
    let Pair {
        gpu,
        export,
        smr,
        qc,
        src,
        src_mr,
        back,
        back_mr,
        ctl,
        ctl_d,
        stop,
    } = *p;
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
            let mut ready = 0u64;
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
                arg(&mut ready),
            ];
            // SAFETY: the parameters match gv_sample_echo's signature (no ready word: null);
            // the descriptor, the mapped control page and the registered buffers outlive the
            // launch (the scope joins it before they drop).
            unsafe { gpu.launch_sync("gv_sample_echo", (1, 1, 1), (1, 1, 1), 0, &mut params) }?;
            Ok(())
        });
        let client = client(a, qc, src, src_mr, back, back_mr, smr.remote(0));
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
    print(
        a,
        &gpu.info().to_string(),
        None,
        report,
        LatStats::of(&mut rtts),
    )
}

/// Checks the kernel's count and prints the round trips. `roles`: this side's role and the
/// JSON fields of the server/client roles (`None` in loopback).
fn print(
    a: &Args,
    gpu: &str,
    roles: Option<(&str, serde_json::Value)>,
    report: [u64; 6],
    st: LatStats,
) -> Result<()> {
    ensure!(
        report[0] == u64::from(a.iters) && report[1] == u64::from(a.iters) * u64::from(a.size),
        "the kernel echoed {} messages, {} bytes (expected {} of {} B)",
        report[0],
        report[1],
        a.iters,
        a.size
    );
    // the client's initiator: this side's option, or (on the server) what the client said
    let client = roles
        .as_ref()
        .and_then(|(_, v)| v["initiator"].as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{:?}", a.initiator).to_lowercase());
    if a.json {
        let mut v = json!({"test": "echo", "op": format!("{:?}", a.op).to_lowercase(),
                   "bytes": a.size, "initiator": client,
                   "iterations": a.iters, "slots": a.slots, "gpu": gpu,
                   "echoed": report[0], "validated": true, "rtt_min_us": st.min,
                   "rtt_typical_us": st.typical, "rtt_avg_us": st.avg, "rtt_p99_us": st.p99,
                   "rtt_p99_9_us": st.p999, "rtt_max_us": st.max});
        if let Some((_, extra)) = &roles {
            v = gpuverbs_samples::merge(v, extra.clone());
        }
        println!("{v}");
    } else {
        let role = roles
            .as_ref()
            .map_or(String::new(), |(r, _)| format!(" ({r}, two processes)"));
        println!("# echo{role}: a persistent kernel on {gpu} answers; {client} client");
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
    slots: RemoteAddr,
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
                    remote: RemoteAddr {
                        addr: slots.addr + u64::from(s) * u64::from(size),
                        rkey: slots.rkey,
                    },
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

/// The server/client roles: two processes, over the TCP bootstrap of samples/src/peer.rs and
/// the soft NICs' wire (RoCEv2 over UDP). The steps: open the device (and set up the QP and
/// buffers), exchange endpoints (and the server's slots), connect, ready (the server's kernel
/// has posted its receives), run (the client's outcome), report (the kernel's).
mod remote {
    use super::*;
    use gpuverbs::gpu::ExportedQp;
    use gpuverbs::{Cq, Mr, Qp, RemoteMemory};
    use gpuverbs_samples::{connect_options, error_text, local_ip_towards, Peer};
    use serde::{Deserialize, Serialize};
    use std::net::SocketAddr;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    const TEST: &str = "echo";
    /// Where in the control page the server's kernel says its receives are posted.
    const READY_AT: u64 = 128;

    /// What the client tells the server when it is done.
    #[derive(Serialize, Deserialize)]
    struct ClientRun {
        /// The round trips (µs), when every message was answered and checked.
        stats: Option<LatStats>,
        /// Why the client stopped, otherwise.
        error: Option<String>,
    }

    /// This side's device, QP and buffers.
    struct Side {
        ctx: Context,
        _cqs: [Cq; 2],
        qp: Qp,
        /// The server's slots, or the client's source.
        buf: HostBuffer,
        mr: Mr,
        /// The client's answer buffer (the server: one unused byte).
        back: HostBuffer,
        back_mr: Mr,
        /// The server's QP (or a GPU client's), exported to the GPU.
        export: Option<ExportedQp>,
        /// The control page: the stop word, the server kernel's report and its ready word (or
        /// a GPU client's status); its device address.
        ctl: HostBuffer,
        ctl_d: u64,
    }

    /// Opens the soft NIC with a wire port on the address that reaches the peer, and sets up
    /// this side's QP and buffers.
    fn open(a: &Args, peer: &Peer, gpu: Option<&Arc<Gpu>>) -> Result<Side> {
        let ip = local_ip_towards(peer.addr.ip())?;
        let bind = SocketAddr::from((ip, a.roles.wire_port.unwrap_or(0)));
        let ctx = Context::open_wire(DeviceRequest::Soft, bind)
            .with_context(|| format!("open the soft NIC (a wire port on {bind})"))?;
        let pd = ctx.alloc_pd();
        let (scq, rcq) = (
            ctx.create_cq(CqOptions::default())?,
            ctx.create_cq(CqOptions::default())?,
        );
        let qp = pd.create_qp(QpOptions::new(&scq, &rcq))?;
        let server = a.roles.role() == Role::Server;
        let len = a.size as usize * if server { a.slots as usize } else { 1 };
        let buf = HostBuffer::new(len);
        let mr = pd.register_with(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
        let back = HostBuffer::new(if server { 1 } else { a.size as usize });
        let back_mr = pd.register(&back)?;
        let export = gpu.map(|g| g.export_qp(&qp)).transpose()?;
        let ctl = HostBuffer::new(256);
        let ctl_d = match gpu {
            Some(g) => g.map_host(&ctl)?,
            None => 0,
        };
        Ok(Side {
            ctx,
            _cqs: [scq, rcq],
            qp,
            buf,
            mr,
            back,
            back_mr,
            export,
            ctl,
            ctl_d,
        })
    }

    /// The kernel's report: words 1..7 of the control page.
    fn report_of(ctl: &HostBuffer) -> [u64; 6] {
        let words = ctl.to_vec();
        std::array::from_fn(|i| {
            let at = 8 + 8 * i;
            u64::from_ne_bytes(words[at..at + 8].try_into().expect("8 bytes"))
        })
    }

    pub fn run(a: &Args) -> Result<()> {
        let role = a.roles.role();
        // Before the rendezvous: a server without a GPU says so at once instead of waiting.
        let gpu = match (role, a.initiator) {
            (Role::Server, _) => Some(open_gpu(a, "the server is a kernel")?),
            (_, Client::Gpu) => Some(open_gpu(a, "--initiator gpu: the client is a kernel")?),
            _ => None,
        };
        if role == Role::Client && a.roles.port == Some(0) {
            bail!("-p 0: the client needs the server's port (the one the server printed)");
        }
        let common = a.roles.common(TEST)?;
        let mut peer = Peer::rendezvous(&common, TEST)?;
        if gpu.is_some() && role == Role::Client && peer.addr.ip().is_loopback() {
            // Measured on the H200: 4.5 ms per round trip without MPS, 70 µs with a CPU client.
            eprintln!(
                "{TEST}: note: the server is on this host and both sides run a resident kernel: \
                 when they share a GPU without MPS (nvidia-cuda-mps-control -d), the GPU \
                 time-slices the two processes and each round trip waits for the other's slice \
                 (milliseconds); --initiator cpu, MPS, or a GPU each avoid it"
            );
        }
        let (side, mine) = match open(a, &peer, gpu.as_ref()) {
            Ok(s) => (Some(s), Ok(())),
            Err(e) => (None, Err(e)),
        };
        peer.step("open the device", mine)?;
        let side = side.context("the device step succeeded without a device")?;
        let params = json!({"size": a.size, "iters": a.iters, "slots": a.slots,
                            "op": format!("{:?}", a.op).to_lowercase()});
        let facts = match role {
            Role::Server => json!({
                "slots": RemoteMemory::export_rkey(side.mr.addr(), side.mr.len(), side.mr.rkey().0)?,
                "gpu": gpu.as_ref().map(|g| g.info().to_string()),
            }),
            _ => json!({"initiator": format!("{:?}", a.initiator).to_lowercase()}),
        };
        let hello = peer.hello(&common, TEST, params, vec![side.qp.endpoint()], facts)?;
        let ep = hello.endpoints[0].clone();
        let connected = side
            .qp
            .connect(&ep, connect_options())
            .with_context(|| format!("connect to the {} ({ep})", peer.peer_role));
        peer.step("connect", connected)?;
        let client_initiator = match role {
            Role::Server => hello.facts["initiator"].as_str().unwrap_or("?").to_string(),
            _ => format!("{:?}", a.initiator).to_lowercase(),
        };
        let extra = json!({
            "role": peer.role,
            "initiator": client_initiator,
            "wire_addr": side.ctx.wire_addr().map(|w| w.to_string()),
            "peer_wire_addr": ep.udp_addr().map(|w| w.to_string()),
        });
        match role {
            Role::Server => {
                let gpu = gpu.context("the server without its GPU")?;
                serve(a, &mut peer, &side, &gpu, extra)
            }
            _ => {
                let slots: RemoteMemory = serde_json::from_value(hello.facts["slots"].clone())
                    .context("the server's slots")?;
                ensure!(
                    slots.len() >= u64::from(a.size) * u64::from(a.slots),
                    "the server's slots are too small ({} B)",
                    slots.len()
                );
                let server_gpu = hello.facts["gpu"].as_str().unwrap_or("?").to_string();
                let slots = RemoteAddr {
                    addr: slots.addr(),
                    rkey: gpuverbs::post::Rkey(slots.rkey()),
                };
                ask(a, &mut peer, &side, gpu.as_ref(), slots, &server_gpu, extra)
            }
        }
    }

    /// The server: its kernel echoes until the client is done, then is told to stop.
    fn serve(
        a: &Args,
        peer: &mut Peer,
        side: &Side,
        gpu: &Arc<Gpu>,
        extra: serde_json::Value,
    ) -> Result<()> {
        let export = side
            .export
            .as_ref()
            .context("the server's QP is not exported")?;
        // SAFETY: the control page lives until the end of this function, after the kernel has
        // returned (the scope joins it); the host only reads and writes these words atomically
        // (the kernel reads the stop word and writes the ready word).
        let (stop, ready) = unsafe {
            (
                &*(side.ctl.addr() as *const AtomicU32),
                &*((side.ctl.addr() + READY_AT) as *const AtomicU64),
            )
        };
        let outcome = std::thread::scope(|sc| -> Result<(Option<ClientRun>, [u64; 6])> {
            let k = sc.spawn(|| -> Result<()> {
                let (mut q, mut nic, mut lk, mut sz, mut n, mut st) = (
                    export.ptr(),
                    side.mr.addr(),
                    side.mr.lkey().0,
                    a.size,
                    a.slots,
                    side.ctl_d,
                );
                let (mut budget, mut op_budget, mut out, mut rd) = (
                    KERNEL_WAIT_NS,
                    ANSWER.as_nanos() as u64,
                    side.ctl_d + 8,
                    side.ctl_d + READY_AT,
                );
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
                    arg(&mut rd),
                ];
                // SAFETY: the parameters match gv_sample_echo's signature; the descriptor, the
                // mapped control page and the registered slots outlive the launch (the scope
                // joins it before they drop).
                unsafe { gpu.launch_sync("gv_sample_echo", (1, 1, 1), (1, 1, 1), 0, &mut params) }?;
                Ok(())
            });
            let t0 = Instant::now();
            let posted = loop {
                if ready.load(Ordering::Acquire) != 0 {
                    break Ok(());
                }
                if k.is_finished() {
                    break Err(anyhow::anyhow!(
                        "the echo kernel ended before its receives were posted"
                    ));
                }
                if t0.elapsed() > ANSWER {
                    break Err(anyhow::anyhow!(
                        "the echo kernel did not post its receives within {ANSWER:?}"
                    ));
                }
                std::thread::sleep(Duration::from_micros(100));
            };
            eprintln!(
                "{TEST}: server: the kernel on {} echoes; waiting for the client's {} messages",
                gpu.info(),
                a.iters
            );
            let run = peer
                .step("ready", posted)
                .and_then(|()| peer.step::<Option<ClientRun>>("run", Ok(None)));
            // whatever the client's outcome, the kernel is asked to stop
            stop.store(1, Ordering::Release);
            let launched = k
                .join()
                .map_err(|_| anyhow::anyhow!("the launch thread panicked"))?;
            let report = report_of(&side.ctl);
            let run = match run {
                Ok(r) => r,
                Err(e) if report[2] != 0 => return Err(e.context(kernel_failure(&report))),
                Err(e) => return Err(e),
            };
            peer.step("report", launched.map(|()| Some(report)))?;
            Ok((run, report))
        });
        let (run, report) = outcome?;
        let run = run.context("the client sent no outcome")?;
        eprintln!(
            "{TEST}: server: the kernel echoed {} messages ({} B) and stopped ({})",
            report[0],
            report[1],
            if report[2] == 0 {
                "on request".to_string()
            } else {
                kernel_failure(&report)
            }
        );
        if let Some(e) = run.error {
            if report[2] != 0 {
                bail!("the client failed: {e}; {}", kernel_failure(&report));
            }
            bail!("the client failed: {e}");
        }
        ensure!(report[2] == 0, "{}", kernel_failure(&report));
        let st = run.stats.context("the client sent no round trips")?;
        print(
            a,
            &gpu.info().to_string(),
            Some(("server", extra)),
            report,
            st,
        )
    }

    /// The client: `iters` messages, each answered and checked; then the server is told.
    fn ask(
        a: &Args,
        peer: &mut Peer,
        side: &Side,
        gpu: Option<&Arc<Gpu>>,
        slots: RemoteAddr,
        server_gpu: &str,
        extra: serde_json::Value,
    ) -> Result<()> {
        peer.step("ready", Ok(()))?;
        let run = match gpu {
            None => client(
                a,
                &side.qp,
                &side.buf,
                &side.mr,
                &side.back,
                &side.back_mr,
                slots,
            ),
            Some(g) => gpu_client(a, side, g),
        };
        let mut rtts = run;
        let out = match &mut rtts {
            Ok(r) => ClientRun {
                stats: Some(LatStats::of(r)),
                error: None,
            },
            Err(e) => ClientRun {
                stats: None,
                error: Some(error_text(e)),
            },
        };
        let stats = out.stats;
        let report = peer
            .step("run", Ok(Some(out)))
            .and_then(|_| peer.step::<Option<[u64; 6]>>("report", Ok(None)));
        let report = match (report, &rtts) {
            (Ok(r), _) => r.context("the server sent no report")?,
            // the server is gone (or failed): this side's own failure is said too
            (Err(pe), Err(_)) => {
                let e = rtts.expect_err("the client failed");
                return Err(e.context(error_text(&pe)));
            }
            (Err(pe), Ok(_)) => return Err(pe),
        };
        match rtts {
            Err(e) if report[2] != 0 => Err(e.context(kernel_failure(&report))),
            Err(e) => Err(e),
            Ok(_) => {
                ensure!(report[2] == 0, "{}", kernel_failure(&report));
                let st = stats.context("no round trips")?;
                print(a, server_gpu, Some(("client", extra)), report, st)
            }
        }
    }

    /// The GPU client (`gv_sample_echo_client`): the round trips (µs), or why it stopped.
    fn gpu_client(a: &Args, side: &Side, gpu: &Arc<Gpu>) -> Result<Vec<f64>> {
        let export = side
            .export
            .as_ref()
            .context("the client's QP is not exported")?;
        let (src_d, back_d) = (gpu.map_host(&side.buf)?, gpu.map_host(&side.back)?);
        let rtt_buf = HostBuffer::new(8 * a.iters as usize);
        let rtt_d = gpu.map_host(&rtt_buf)?;
        let (mut qcd, mut cnic, mut cdev, mut clk) =
            (export.ptr(), side.mr.addr(), src_d, side.mr.lkey().0);
        let (mut bnic, mut bdev, mut blk, mut size, mut iters) = (
            side.back_mr.addr(),
            back_d,
            side.back_mr.lkey().0,
            a.size,
            a.iters,
        );
        let (mut cbudget, mut out, mut rtt) = (ANSWER.as_nanos() as u64, side.ctl_d, rtt_d);
        let mut params = [
            arg(&mut qcd),
            arg(&mut cnic),
            arg(&mut cdev),
            arg(&mut clk),
            arg(&mut bnic),
            arg(&mut bdev),
            arg(&mut blk),
            arg(&mut size),
            arg(&mut iters),
            arg(&mut cbudget),
            arg(&mut out),
            arg(&mut rtt),
        ];
        // SAFETY: the parameters match gv_sample_echo_client's signature; the descriptor, the
        // mapped buffers (payloads, control page, round trips) and the registered regions live
        // until the synchronous launch has returned.
        unsafe {
            gpu.launch_sync(
                "gv_sample_echo_client",
                (1, 1, 1),
                (CLIENT_THREADS, 1, 1),
                0,
                &mut params,
            )
        }?;
        let words = side.ctl.to_vec();
        let word = |i: usize| u64::from_ne_bytes(words[8 * i..8 * i + 8].try_into().expect("8"));
        ensure!(
            word(0) == 0 && word(1) == 0,
            "the client kernel ended with status {} (error CQE syndrome {:#x}), {} bytes wrong",
            word(0),
            word(2),
            word(1)
        );
        Ok(rtt_buf
            .to_vec()
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")) as f64 / 1e3)
            .collect())
    }
}
