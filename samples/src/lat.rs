//! `write_lat`: RDMA WRITE ping-pong latency between two GPU kernels (or two CPU initiators), in
//! the style of perftest's `ib_write_lat`.
//!
//! ```text
//! write_lat --loopback -a            # every size, both sides in this process
//! write_lat --loopback --signal      # the receiver waits on a signal word, not the payload
//! write_lat --loopback -a --initiator gpu --mem gpu   # buffers and signal words on the GPU
//! write_lat -p 18515 --initiator cpu  /  write_lat 127.0.0.1 -p 18515 --initiator cpu
//! ```
//!
//! Server/client roles: the client is side A, the server side B; each process opens its device
//! (`-d`: a soft NIC with a wire port, RoCEv2 over UDP, or an rdma-core device such as `mlx5_0`,
//! which refuses the soft NIC's `--wire-port`, `--loss` and `--pcap`), its own thread drives
//! its side with the CPU initiator,
//! and each size runs in steps both take over the TCP connection (buffers cleared, ping-pong,
//! each side's check of its receive buffer and side A's numbers exchanged), so both print the
//! same row and both fail when either check fails. The GPU initiator needs `--loopback`: its
//! kernel runs both sides in one launch.
//!
//! Side A writes `size` bytes into B's receive buffer; B waits until the last bytes of its
//! receive buffer show the iteration (or, with `--signal`, until its signal word, raised by an
//! atomic that follows the write, does) and answers the same way; A waits for the answer. The
//! columns are perftest's, in microseconds of half a round trip: t_min, t_max, t_typical
//! (median), t_avg, t_stdev, 99% and 99.9% percentiles.
//!
//! The payload's last min(size, 8) bytes carry the iteration number (written by the sender
//! before each post, as perftest does); the rest is a pattern of the run. Both receive buffers
//! are checked byte by byte after the run (and the signal words with `--signal`).
//!
//! GPU initiator: one kernel of two blocks, block 0 drives side A and block 1 side B (one thread
//! each, owning its QP); A times each round trip with %globaltimer. CPU initiator: one host
//! thread drives both sides in turn and times with the monotonic clock. Warm-up iterations run
//! first, in the same loop, and are left out of the numbers.
//!
//! Placement (GPU initiator only): `--mem gpu` puts each side's source buffer, receive buffer
//! and signal word in GPU memory registered with `Pd::register_device_mem` (the kernel gets
//! their device pointers; the atomics' discarded old values still land in host memory); the
//! host fills, clears and checks them by copying (`DeviceMem::write` / `read`). `--rings gpu`
//! puts the SQ/RQ and CQ rings in GPU memory. The CPU initiator refuses both: it reaches its
//! buffers and rings through host pointers.

use anyhow::{bail, Context as _, Result};
use clap::{CommandFactory, Parser};
use gpuverbs::gpu::Gpu;
use gpuverbs::{Access, Endpoint, HostBuffer, Mr, Pd, Qp, RemoteMemory};
use gpuverbs_samples::{
    address_lines, arg, check_placement, common_header, common_json, connect_options, connect_pair,
    cpu_ring_mode, create_qp, doorbell_line, error_text, exit_with, merge, mtu_line, open_env,
    open_env_remote, output_number, pattern, remote_header, remote_json, step, table_row,
    tx_depth_for, upload, with_mtu, CommonArgs, CpuSample, Exports, GpuStatus, Header, Initiator,
    LatSide, LatStats, OtherCpu, Payload, Peer, Placement, Progress, QpSpec,
};
use prm::wqe::{CtrlFlags, Local, Op, RemoteAddr};
use prm::{Completion, Rkey};
use serde_json::json;
use softnic::initiator::{Initiator as CpuInitiator, InitiatorError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

const TEST: &str = "write_lat";
/// Default size (perftest's).
const DEFAULT_SIZE: u64 = 2;
/// Default iterations of small sizes (perftest's).
const DEFAULT_ITERS: u32 = 1000;
/// Default bytes per size and direction: larger sizes get fewer iterations.
const BYTES_PER_SIZE: u64 = 256 << 20;
/// Fewest default iterations of a size.
const MIN_ITERS: u32 = 100;
/// perftest's latency columns and their widths (its RESULT_FMT_LAT's spacing).
const LAT_COLUMNS: [(&str, usize); 9] = [
    ("#bytes", 6),
    ("#iterations", 14),
    ("t_min[usec]", 14),
    ("t_max[usec]", 12),
    ("t_typical[usec]", 18),
    ("t_avg[usec]", 14),
    ("t_stdev[usec]", 15),
    ("99% percentile[usec]", 22),
    ("99.9% percentile[usec]", 0),
];

#[derive(Parser, Debug)]
#[command(
    name = "write_lat",
    version,
    about = "RDMA WRITE ping-pong latency between two GPU kernels (or CPU initiators), perftest \
             style",
    long_about = "RDMA WRITE ping-pong latency between two GPU kernels (or CPU initiators), \
                  perftest style (ib_write_lat's columns, half round trip in microseconds). \
                  Both receive buffers are checked after every size.\n\n\
                  Roles: `write_lat --loopback` runs both sides in this process; `write_lat` \
                  (server, side B) and `write_lat SERVER` (client, side A) meet over TCP on -p, \
                  each opens its device (-d: a soft NIC with a UDP wire port, RoCEv2, or an \
                  rdma-core device such as mlx5_0) and the CPU posts (the GPU \
                  initiator needs --loopback); each side checks its receive buffer and reports \
                  to the other.\n\n\
                  Default iterations per size: 1000, or 256 MiB worth when less (at least 100); \
                  warm-up about a tenth (at most 100)."
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// The receiver waits on a signal word raised by an atomic after the write, instead of
    /// polling the payload's last bytes.
    #[arg(long)]
    signal: bool,
    /// perftest's -I (--inline_size): messages of at most this many bytes travel inside their
    /// WQEs (an inline data segment) [default: perftest's 220 with the CPU initiator; the
    /// kernels post gather WQEs, so 0 with the GPU, which refuses the option]. At most 256.
    #[arg(short = 'I', long = "inline_size", value_name = "BYTES",
          value_parser = clap::value_parser!(u32).range(0..=MAX_INLINE as i64))]
    inline_size: Option<u32>,
    /// perftest's -D (duration): refused, write_lat runs a number of iterations (-n).
    #[arg(short = 'D', long = "duration", value_name = "SECONDS", hide = true)]
    duration: Option<u32>,
    /// perftest's --cpu_util: refused (perftest reports it in duration mode only, and
    /// write_lat has none).
    #[arg(long = "cpu_util", hide = true)]
    cpu_util: bool,
}

/// perftest's -I default of its WRITE latency test (DEF_INLINE_WRITE).
const PERFTEST_INLINE: u32 = 220;
/// Largest `-I` (the QPs' inline limit).
const MAX_INLINE: u32 = 256;

fn main() -> std::process::ExitCode {
    let mut args = Args::parse();
    if let Err(e) = args.common.resolve() {
        return exit_with(TEST, Err(e));
    }
    let refuse = |why: String| exit_with(TEST, Err(anyhow::anyhow!(why)));
    if args.duration.is_some() {
        return refuse(
            "-D: not supported by write_lat (it runs -n iterations per size; put_bw has -D)".into(),
        );
    }
    if args.cpu_util {
        return refuse(
            "--cpu_util: perftest reports CPU utilisation in duration mode (-D) only, which \
             write_lat does not have"
                .into(),
        );
    }
    if let Some(o) = args
        .common
        .output
        .filter(|&o| o != gpuverbs_samples::OutputArg::Latency)
    {
        return refuse(format!(
            "--output {}: write_lat's output can be latency (as ib_write_lat's)",
            o.name()
        ));
    }
    if args.common.initiator == Some(Initiator::Gpu) && args.inline_size.is_some_and(|i| i > 0) {
        Args::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "-I needs --initiator cpu (the kernels post gather WQEs)",
            )
            .exit();
    }
    let cpu = args.common.initiator == Some(Initiator::Cpu);
    if args.common.db == gpuverbs_samples::DbArg::Proxy && (cpu || !args.common.loopback) {
        Args::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "--db proxy needs --initiator gpu (the CPU initiator rings its own doorbells), \
                 which needs --loopback",
            )
            .exit();
    }
    if args.common.initiator == Some(Initiator::Gpu) && !args.common.loopback {
        Args::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                format!("--initiator gpu needs --loopback: {GPU_NEEDS_LOOPBACK}"),
            )
            .exit();
    }
    exit_with(TEST, run(&args))
}

/// Iterations and warm-up of a size.
fn iterations(a: &CommonArgs, size: u64) -> (u32, u32) {
    let iters = a.iters.unwrap_or_else(|| {
        (BYTES_PER_SIZE / size).clamp(MIN_ITERS as u64, DEFAULT_ITERS as u64) as u32
    });
    let warmup = a.warmup.unwrap_or((iters / 10).clamp(1, 100));
    (iters, warmup)
}

/// Bytes of the tail that carries the iteration number.
fn tail_len(size: u64) -> usize {
    size.min(8) as usize
}

/// Where a message of `size` bytes starts in its buffer: it ends on an 8-byte boundary, so its
/// last bytes lie in one aligned word that can be read atomically.
fn pad(size: u64) -> u64 {
    size.next_multiple_of(8) - size
}

/// The value the last `n` bytes of the word ending a payload show for iteration number `k1`
/// (they are the word's top bytes).
fn tail_of_word(word: u64, n: usize) -> u64 {
    let mask = if n >= 8 {
        u64::MAX
    } else {
        (1u64 << (8 * n)) - 1
    };
    (word >> (64 - 8 * n as u32)) & mask
}

fn tail_value(k1: u64, n: usize) -> u64 {
    if n >= 8 {
        k1
    } else {
        k1 & ((1u64 << (8 * n)) - 1)
    }
}

/// One side: its QP, outgoing payload, receive buffer, signal word (each in host or GPU memory,
/// as `--mem` says) and atomic result word (host memory: nobody reads it).
struct Side {
    qp: Qp,
    src: Payload,
    src_mr: Mr,
    recv: Payload,
    recv_mr: Mr,
    sig: Payload,
    sig_mr: Mr,
    /// Where the atomics' old values land (the region keeps its buffer alive).
    result_mr: Mr,
}

impl Side {
    fn new(
        pd: &Pd,
        spec: QpSpec,
        gpu: Option<&Arc<Gpu>>,
        mem: Placement,
        len: usize,
    ) -> Result<Self> {
        let qp = create_qp(pd, spec, gpu)?;
        let src = Payload::new(mem, gpu, len)?;
        let src_mr = src.register(pd, Access::LOCAL_WRITE)?;
        let recv = Payload::new(mem, gpu, len)?;
        let recv_mr = recv.register(pd, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
        let sig = Payload::new(mem, gpu, 64)?;
        let sig_mr = sig.register(pd, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
        let result = HostBuffer::new(64);
        let result_mr = pd.register_with(&result, Access::LOCAL_WRITE)?;
        Ok(Self {
            qp,
            src,
            src_mr,
            recv,
            recv_mr,
            sig,
            sig_mr,
            result_mr,
        })
    }
}

/// Why the GPU initiator needs `--loopback`.
const GPU_NEEDS_LOOPBACK: &str = "write_lat's kernel runs both sides of the ping-pong in one \
     launch (block 0 is side A, block 1 side B), so a process cannot run one side alone: the CPU \
     posts across processes (use --loopback for the GPU initiator)";

fn run(args: &Args) -> Result<()> {
    let a = &args.common;
    let sizes = a.sizes(DEFAULT_SIZE);
    // The inline limit asked for (the CPU's default is perftest's; the GPU has none).
    let inline_max = args.inline_size.unwrap_or(match a.initiator {
        Some(Initiator::Gpu) => 0,
        _ => PERFTEST_INLINE,
    });
    let largest_inline = sizes
        .iter()
        .copied()
        .filter(|&s| s <= inline_max as u64)
        .max();
    // An inline WQE takes ctrl + raddr + the inline header and data, in 64-byte blocks.
    let wqe_blocks = largest_inline.map_or(1, |s| (36 + s).div_ceil(64));
    // Two WQEs per iteration with --signal (write + atomic), one CQE per --cq-mod iterations.
    let tx = tx_depth_for(a.tx_depth, (2 * a.cq_mod as u64 + 2) * wqe_blocks)?;
    let spec = QpSpec {
        tx_depth: tx,
        rings: a.rings,
        db: a.db,
    };
    let max = *sizes.iter().max().expect("one size at least");
    let len = (max.next_multiple_of(8) as usize).max(8);
    // The server/client roles meet first: a soft NIC's wire port binds the local address
    // that reaches the peer.
    let mut peer = if a.loopback {
        None
    } else {
        Some(Peer::rendezvous(a, TEST)?)
    };
    let env = match &mut peer {
        None => open_env(a)?,
        Some(p) => open_env_remote(a, p, Some(GPU_NEEDS_LOOPBACK))?,
    };
    let pcap = gpuverbs_samples::start_pcap(a, &env.ctx)?;
    a.check_device(&env.ctx)?;
    let inline_max = match env.initiator {
        Initiator::Cpu => inline_max,
        Initiator::Gpu if args.inline_size.is_some_and(|i| i > 0) => bail!(
            "-I needs the CPU initiator (the kernels post gather WQEs), and this run uses the \
             GPU ({}): add --initiator cpu",
            env.initiator_why
        ),
        Initiator::Gpu => 0,
    };
    let ring_mode = match env.initiator {
        Initiator::Cpu => Some(cpu_ring_mode(a.db)?),
        Initiator::Gpu => None,
    };
    check_placement(a, &env)?;
    // Loopback: both sides, on one device (a PD each). Across processes: this side (the client
    // is A, the server B), and where its messages go on the peer.
    let me = peer.as_ref().map(Peer::side);
    let mut sides: Vec<Side> = Vec::new();
    let mut targets: Vec<Target> = Vec::new();
    let mut peer_ep: Option<Endpoint> = None;
    match (&mut peer, me) {
        (Some(p), Some(_)) => {
            let pd = env.ctx.alloc_pd();
            let s = Side::new(&pd, spec, env.gpu.as_ref(), a.mem, len)?;
            let export = |mr: &Mr| RemoteMemory::export_rkey(mr.addr(), mr.len(), mr.rkey().0);
            let facts = json!({ "recv": export(&s.recv_mr)?, "sig": export(&s.sig_mr)? });
            let params = json!({
                "sizes": sizes, "iters": a.iters, "warmup": a.warmup, "signal": args.signal,
            });
            let hello = p.hello(
                a,
                TEST,
                params,
                vec![with_mtu(&s.qp.endpoint(), a.mtu)],
                facts,
            )?;
            let remote = |k: &str| -> Result<RemoteMemory> {
                serde_json::from_value(hello.facts[k].clone())
                    .with_context(|| format!("the {}'s {k} buffer", p.peer_role))
            };
            let (recv, sig) = (remote("recv")?, remote("sig")?);
            if recv.len() < len as u64 || sig.len() < 8 {
                bail!(
                    "the {}'s buffers are too small ({} B to receive, {} B of signal word)",
                    p.peer_role,
                    recv.len(),
                    sig.len()
                );
            }
            let ep = hello.endpoints[0].clone();
            s.qp.connect(&with_mtu(&ep, a.mtu), connect_options())
                .with_context(|| format!("connect to the {} ({ep})", p.peer_role))?;
            targets.push(Target {
                recv: RemoteAddr {
                    addr: recv.addr(),
                    rkey: Rkey(recv.rkey()),
                },
                sig: RemoteAddr {
                    addr: sig.addr(),
                    rkey: Rkey(sig.rkey()),
                },
            });
            sides.push(s);
            peer_ep = Some(ep);
        }
        _ => {
            let (pa, pb) = (env.ctx.alloc_pd(), env.ctx.alloc_pd());
            sides = vec![
                Side::new(&pa, spec, env.gpu.as_ref(), a.mem, len)?,
                Side::new(&pb, spec, env.gpu.as_ref(), a.mem, len)?,
            ];
            connect_pair(&sides[0].qp, &sides[1].qp, a.mtu)?;
            targets = (0..2).map(|i| Target::of(&sides[1 - i])).collect();
        }
    }
    for s in &sides {
        a.check_dmabuf(&s.src_mr, "source")?;
        a.check_dmabuf(&s.recv_mr, "receive")?;
        a.check_dmabuf(&s.sig_mr, "signal")?;
    }
    // The side number (A = 0, B = 1) of each entry of `sides`.
    let ids: Vec<usize> = match me {
        Some(m) => vec![m],
        None => vec![0, 1],
    };

    let mut other_cpu = OtherCpu::sample_before_run();
    let mut h = Header::new("RDMA_Write Latency Test (write_lat)");
    common_header(
        &mut h,
        &env,
        a,
        doorbell_line(&sides[0].qp, env.initiator, ring_mode, a.db),
    );
    if let (Some(p), Some(ep)) = (&peer, &peer_ep) {
        remote_header(&mut h, a, p, &env.ctx, ep);
    }
    h.line(
        "Posting",
        match (env.initiator, me) {
            (Initiator::Gpu, _) => {
                "one kernel: block 0 drives side A, block 1 side B (one thread each)"
            }
            (Initiator::Cpu, None) => "one host thread drives both sides in turn",
            (Initiator::Cpu, Some(0)) => "one host thread drives side A (it sends first)",
            (Initiator::Cpu, Some(_)) => "one host thread drives side B (it answers)",
        },
    )
    .line(
        "Receiver waits",
        if args.signal {
            "on a signal word (atomic add after the write)"
        } else {
            "on the last bytes of its receive buffer"
        },
    )
    .line("CQ Moderation", a.cq_mod)
    .line("TX depth", format!("{tx} blocks"))
    .line(
        "Mtu",
        mtu_line(a.mtu, &env.ctx, &sides[0].qp.endpoint(), peer_ep.as_ref()),
    )
    .line("GID index", env.ctx.gid_index())
    .line("Max inline data", format!("{inline_max}[B]"))
    .line(
        "Iterations",
        match a.iters {
            Some(n) => format!("{n} per size"),
            None => format!(
                "per size: {DEFAULT_ITERS}, or {} MiB worth when less (at least {MIN_ITERS})",
                BYTES_PER_SIZE >> 20
            ),
        },
    )
    .line(
        "Times",
        if peer.is_some() {
            "half round trip, microseconds, measured by side A (the client)"
        } else {
            "half round trip, microseconds"
        },
    )
    .line(
        "Validation",
        if peer.is_some() {
            "each side its receive buffer, every byte, every size (reported to the peer)"
        } else {
            "both receive buffers, every byte, every size"
        },
    );
    other_cpu.header(&mut h);
    let table = !a.json && a.output.is_none();
    if a.output.is_none() {
        h.print(a.json);
        // perftest's address lines: this side's QP, then the peer's (each with the receive
        // buffer the other writes into).
        let recv = |s: &Side| (s.recv_mr.rkey().0, s.recv_mr.addr());
        let (lk, lv) = recv(&sides[0]);
        let mut lines = vec![address_lines(
            "local",
            &with_mtu(&sides[0].qp.endpoint(), a.mtu),
            lk,
            lv,
        )];
        match (&peer_ep, targets.first()) {
            (Some(ep), Some(t)) => {
                lines.push(address_lines("remote", ep, t.recv.rkey.0, t.recv.addr));
            }
            _ => {
                let (rk, rv) = recv(&sides[1]);
                lines.push(address_lines("remote", &sides[1].qp.endpoint(), rk, rv));
            }
        }
        lines.push(gpuverbs_samples::RULE.to_string());
        if a.json {
            eprintln!("{}", lines.join("\n"));
        } else {
            println!("{}", lines.join("\n"));
        }
    }
    if table {
        println!(
            "{}",
            table_row(&LAT_COLUMNS.map(|(n, w)| (n.to_string(), w)))
        );
    }
    let mut base_json = merge(
        common_json(&env, a, &sides[0].qp),
        json!({
            "test": TEST, "signal": args.signal, "cq_mod": a.cq_mod, "tx_depth": tx,
            "inline_size": inline_max,
        }),
    );
    if let (Some(p), Some(ep)) = (&peer, &peer_ep) {
        base_json = merge(base_json, remote_json(a, p, &env.ctx, ep));
    }

    let mut engine = match env.initiator {
        Initiator::Cpu => {
            let mode = ring_mode.expect("CPU ring mode");
            Engine::Cpu(sides.iter().map(|s| s.qp.cpu_initiator(mode)).collect())
        }
        Initiator::Gpu => {
            let gpu = env.gpu.clone().expect("GPU initiator has a GPU");
            let exports = Exports::new(&gpu, &[&sides[0].qp, &sides[1].qp])?;
            let mut mapped = Vec::new();
            for s in &sides {
                mapped.push([
                    s.src.gpu_addr(&gpu)?,
                    s.recv.gpu_addr(&gpu)?,
                    s.sig.gpu_addr(&gpu)?,
                ]);
            }
            let status = GpuStatus::new(&gpu)?;
            Engine::Gpu(Box::new(GpuLat {
                gpu,
                exports,
                mapped,
                status,
            }))
        }
    };

    let mut progress = Progress::new(TEST, sizes.len());
    let mut scratch = Vec::new();
    for (n, &size) in sizes.iter().enumerate() {
        let (iters, warmup) = iterations(a, size);
        let total = iters + warmup;
        let seed = pattern::seed(2, size);
        let (p, tl) = (pad(size) as usize, tail_len(size));
        for (&i, s) in ids.iter().zip(&sides) {
            pattern::fill(&mut scratch, seed ^ i as u64, 0, size as usize - tl);
            s.src.write(p, &scratch)?;
            s.src.fill(p + size as usize - tl, tl, 0)?;
            s.recv.fill(0, s.recv.len(), 0)?;
            s.sig.write(0, &0u64.to_ne_bytes())?;
        }
        // Across processes A sends only once B has cleared its buffers.
        step(&mut peer, "ready", Ok(()))?;
        let cpu = CpuSample::now();
        let inline = size <= inline_max as u64;
        let ran = engine.run(&sides, &ids, &targets, size, total, args.signal, inline, a);
        let others = other_cpu.record(cpu.and_then(CpuSample::others_since));
        // Side A's times (B has none).
        let mine: Option<Vec<u64>> = ran.as_ref().ok().cloned().flatten();
        step(&mut peer, "ran", ran.map(|_| ()))?;
        let failure = validate(&sides, &ids, size, total, seed, args.signal, &mut scratch)
            .err()
            .map(|e| error_text(&e));
        let stats = mine.map(|rtt| {
            let mut half_us: Vec<f64> = rtt[warmup as usize..]
                .iter()
                .map(|&t| t as f64 / 2e3)
                .collect();
            LatStats::of(&mut half_us)
        });
        // Across processes: the peer's check, and side A's numbers for side B.
        let (failure, st) = match &mut peer {
            None => (failure, stats.unwrap_or_default()),
            Some(pr) => {
                let (their_failure, their_stats): (Option<String>, Option<LatStats>) =
                    pr.step("validated", Ok((failure.clone(), stats)))?;
                let by = |f: String, who: &str| format!("{f} (checked by the {who})");
                (
                    failure
                        .map(|f| by(f, pr.role))
                        .or_else(|| their_failure.map(|f| by(f, pr.peer_role))),
                    stats
                        .or(their_stats)
                        .context("neither side measured round trips")?,
                )
            }
        };
        progress.clear();
        if a.output.is_some() {
            println!("{}", output_number(st.avg));
        } else if a.json {
            let v = merge(
                base_json.clone(),
                json!({
                    "bytes": size, "iterations": iters, "warmup": warmup,
                    "t_min_us": st.min, "t_max_us": st.max, "t_typical_us": st.typical,
                    "t_avg_us": st.avg, "t_stdev_us": st.stdev, "p99_us": st.p99,
                    "p99_9_us": st.p999, "validated": failure.is_none(), "inline": inline,
                    "other_cpu_cores": others,
                }),
            );
            println!("{v}");
        } else {
            let f = |x: f64| format!("{x:.2}");
            let cells = [
                size.to_string(),
                iters.to_string(),
                f(st.min),
                f(st.max),
                f(st.typical),
                f(st.avg),
                f(st.stdev),
                f(st.p99),
                f(st.p999),
            ];
            let row: Vec<(String, usize)> =
                cells.into_iter().zip(LAT_COLUMNS.map(|(_, w)| w)).collect();
            println!("{}", table_row(&row));
        }
        if let Some(e) = failure {
            bail!("validation failed at {size} B: {e}");
        }
        progress.step(n + 1, size);
    }
    progress.clear();
    if table {
        println!("{}", gpuverbs_samples::RULE);
    }
    if let Some(p) = pcap {
        p.finish()?;
    }
    if let Some(w) = other_cpu.warning(TEST) {
        let _ = std::io::Write::flush(&mut std::io::stdout());
        eprintln!("{w}");
    }
    Ok(())
}

/// Checks the receive buffers of `sides` (side numbers `ids`): the peer's pattern, then the
/// last iteration's number; and the signal words with `--signal`.
fn validate(
    sides: &[Side],
    ids: &[usize],
    size: u64,
    total: u32,
    seed: u64,
    signal: bool,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let (p, tl) = (pad(size) as usize, tail_len(size));
    for (&me, s) in ids.iter().zip(sides) {
        let peer = 1 - me;
        pattern::fill(scratch, seed ^ peer as u64, 0, size as usize - tl);
        scratch.extend_from_slice(&(total as u64).to_le_bytes()[..tl]);
        let mut got = vec![0u8; size as usize];
        s.recv.read(p, &mut got)?;
        if let Some(o) = pattern::first_difference(&got, scratch) {
            bail!(
                "side {}'s receive buffer: byte {o} of {size} is {:#04x}, expected {:#04x}",
                ["A", "B"][me],
                got[o],
                scratch[o]
            );
        }
        let mut before = vec![0u8; p];
        s.recv.read(0, &mut before)?;
        if before.iter().any(|&x| x != 0) {
            bail!("side {}: bytes before the payload changed", ["A", "B"][me]);
        }
        if signal {
            // The run is over (every WQE completed): a plain copy reads the final value.
            let mut word = [0u8; 8];
            s.sig.read(0, &mut word)?;
            let v = u64::from_ne_bytes(word);
            if v != total as u64 {
                bail!(
                    "side {}'s signal word is {v}, expected {total}",
                    ["A", "B"][me]
                );
            }
        }
    }
    Ok(())
}

struct GpuLat {
    gpu: std::sync::Arc<gpuverbs::gpu::Gpu>,
    exports: Exports,
    /// Per side: GPU addresses of src, recv, sig (mapped host memory, or GPU memory).
    mapped: Vec<[u64; 3]>,
    status: GpuStatus,
}

enum Engine {
    /// One initiator per entry of `sides`.
    Cpu(Vec<CpuInitiator>),
    Gpu(Box<GpuLat>),
}

impl Engine {
    /// Runs `total` round trips; returns each one's time in ns when this process runs side A.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        sides: &[Side],
        ids: &[usize],
        targets: &[Target],
        size: u64,
        total: u32,
        signal: bool,
        inline: bool,
        a: &CommonArgs,
    ) -> Result<Option<Vec<u64>>> {
        match self {
            Engine::Cpu(inis) => {
                let mut posters: Vec<Poster<'_>> = inis
                    .iter_mut()
                    .zip(sides)
                    .zip(targets)
                    .map(|((ini, side), to)| Poster::new(ini, side, to))
                    .collect::<Result<_>>()?;
                run_cpu(&mut posters, ids, size, total, signal, inline, a)
            }
            Engine::Gpu(g) => {
                let sides: &[Side; 2] = sides.try_into().context("the GPU runs both sides")?;
                g.run(sides, size, total, signal, a).map(Some)
            }
        }
    }
}

/// Where a side's messages go: the peer's receive buffer and signal word.
#[derive(Clone, Copy, Debug)]
struct Target {
    recv: RemoteAddr,
    sig: RemoteAddr,
}

impl Target {
    /// The receive buffer and signal word of a side of this process.
    fn of(s: &Side) -> Self {
        Self {
            recv: s.recv_mr.remote(0),
            sig: s.sig_mr.remote(0),
        }
    }
}

/// One side driven by the CPU: its initiator, its buffers, and where its messages go.
struct Poster<'a> {
    ini: &'a mut CpuInitiator,
    side: &'a Side,
    to: &'a Target,
    /// The side's receive buffer and signal word, which the CPU polls with host atomics.
    recv: &'a HostBuffer,
    sig: &'a HostBuffer,
}

impl<'a> Poster<'a> {
    fn new(ini: &'a mut CpuInitiator, side: &'a Side, to: &'a Target) -> Result<Self> {
        // check_placement keeps GPU memory from the CPU initiator.
        let host = |p: &'a Payload| {
            p.host()
                .context("the CPU initiator polls host memory only (--mem host)")
        };
        Ok(Self {
            ini,
            side,
            to,
            recv: host(&side.recv)?,
            sig: host(&side.sig)?,
        })
    }
}

/// Takes the send completions there are; an error completion ends the run.
fn reap(ini: &mut CpuInitiator) -> Result<()> {
    while let Some(c) = ini.poll_send() {
        match c {
            Completion::Req { .. } => {}
            Completion::Error(e) => bail!("a completion carries an error: {e}"),
            other => bail!("unexpected completion on the send CQ: {other:?}"),
        }
    }
    Ok(())
}

/// The CPU initiator: `posters` are the sides of this process (numbers `ids`: both in loopback,
/// driven in turn by one thread; one across processes). Side A sends iteration k and waits for
/// the answer; side B waits for it and answers. Returns side A's round trips, when it is here.
/// `inline`: the payload travels inside the WQE (`-I`), copied from the source buffer.
#[allow(clippy::too_many_arguments)]
fn run_cpu(
    posters: &mut [Poster<'_>],
    ids: &[usize],
    size: u64,
    total: u32,
    signal: bool,
    inline: bool,
    a: &CommonArgs,
) -> Result<Option<Vec<u64>>> {
    let mut inline_bytes = vec![0u8; if inline { size as usize } else { 0 }];
    let (p, tl) = (pad(size), tail_len(size));
    let word_off = (p + size - 8) as usize;
    let wait = a.wait();
    let mut rtt = Vec::with_capacity(total as usize);
    let at = |side: usize| ids.iter().position(|&i| i == side);
    // Across processes the waits give the CPU away after a short spin: the peer's packets are
    // handled by this process's device threads, which need a core (a 2-core machine runs six
    // busy threads here).
    let yield_after = if a.loopback { u32::MAX } else { 64 };
    let (a_at, b_at) = (at(0), at(1));

    // Posts the payload of poster `i` for iteration number k1.
    let mut send = |posters: &mut [Poster<'_>], i: usize, k1: u64| -> Result<()> {
        let Poster {
            ini, side: s, to, ..
        } = &mut posters[i];
        s.src
            .write((p + size) as usize - tl, &k1.to_le_bytes()[..tl])?;
        // One CQE per --cq-mod iterations, and for the last (so that every WQE completes).
        let sig = k1 % a.cq_mod as u64 == 0 || k1 == total as u64;
        let flags = |on: bool| {
            if on {
                CtrlFlags::SIGNALED
            } else {
                CtrlFlags::default()
            }
        };
        let sge = [s.src_mr.sge(p, size as u32)];
        let local = if inline {
            s.src.read(p as usize, &mut inline_bytes)?;
            Local::Inline(&inline_bytes)
        } else {
            Local::Sges(&sge)
        };
        let write = Op::Write {
            remote: RemoteAddr {
                addr: to.recv.addr + p,
                rkey: to.recv.rkey,
            },
            local,
            imm: None,
        };
        let add = Op::FetchAdd {
            remote: to.sig,
            add: 1,
            result: s.result_mr.sge(0, 8),
        };
        let ops: &[(&Op<'_>, CtrlFlags)] = if signal {
            &[(&write, flags(false)), (&add, flags(sig))]
        } else {
            &[(&write, flags(sig))]
        };
        let start = Instant::now();
        for (op, f) in ops {
            loop {
                match ini.post(op, *f) {
                    Ok(_) => break,
                    Err(InitiatorError::SqFull { .. }) => {
                        reap(ini)?;
                        if start.elapsed() > wait {
                            bail!("the send queue stayed full for {wait:?}");
                        }
                    }
                    Err(e) => return Err(e).context("post a WRITE"),
                }
            }
        }
        ini.ring();
        Ok(())
    };
    // Waits until poster `i`'s side has received iteration number k1.
    let arrived = |posters: &mut [Poster<'_>], i: usize, k1: u64| -> Result<()> {
        let me = ids[i];
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let s = &posters[i];
            let done = if signal {
                s.sig.atomic_u64(0).load(Ordering::Acquire) >= k1
            } else {
                let w = s.recv.atomic_u64(word_off).load(Ordering::Acquire);
                tail_of_word(w, tl) == tail_value(k1, tl)
            };
            if done {
                return Ok(());
            }
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 {
                for p in posters.iter_mut() {
                    reap(p.ini)?;
                }
                if start.elapsed() > wait {
                    bail!(
                        "side {} waited {wait:?} for iteration {k1}: nothing arrived",
                        ["A", "B"][me]
                    );
                }
            }
            if spins >= yield_after {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    };

    for k in 0..total as u64 {
        let k1 = k + 1;
        let t0 = Instant::now();
        if let Some(ia) = a_at {
            send(posters, ia, k1)?;
        }
        if let Some(ib) = b_at {
            arrived(posters, ib, k1)?;
            send(posters, ib, k1)?;
        }
        if let Some(ia) = a_at {
            arrived(posters, ia, k1)?;
            rtt.push(t0.elapsed().as_nanos() as u64);
        }
        if k % 64 == 63 {
            for p in posters.iter_mut() {
                reap(p.ini)?;
            }
        }
    }
    // Drain: every WQE done (and any error reported) before the buffers are checked; the
    // last WQE of each side asked for a CQE, which retires every earlier one.
    for (i, p) in posters.iter_mut().enumerate() {
        let start = Instant::now();
        while p.ini.outstanding() > 0 {
            reap(p.ini)?;
            if start.elapsed() > wait {
                bail!(
                    "side {}: {} SQ blocks still uncompleted after {wait:?}",
                    ["A", "B"][ids[i]],
                    p.ini.outstanding()
                );
            }
            std::hint::spin_loop();
        }
    }
    Ok(a_at.map(|_| rtt))
}

impl GpuLat {
    fn run(
        &mut self,
        sides: &[Side; 2],
        size: u64,
        total: u32,
        signal: bool,
        a: &CommonArgs,
    ) -> Result<Vec<u64>> {
        let p = pad(size);
        let descs: Vec<LatSide> = (0..2)
            .map(|me| {
                let (s, peer) = (&sides[me], &sides[1 - me]);
                let [src_d, recv_d, sig_d] = self.mapped[me];
                LatSide {
                    qp: self.exports.qps[me].ptr(),
                    src_nic: s.src_mr.addr() + p,
                    src_dev: src_d + p,
                    dst_remote: peer.recv_mr.addr() + p,
                    recv_dev: recv_d + p + size - 8,
                    sig_remote: peer.sig_mr.addr(),
                    sig_dev: sig_d,
                    lkey: s.src_mr.lkey().0,
                    rkey: peer.recv_mr.rkey().0,
                    sig_rkey: peer.sig_mr.rkey().0,
                    pad: 0,
                }
            })
            .collect();
        let dev_sides = upload(&self.gpu, &descs)?;
        let rtt = self.gpu.alloc(8 * total as usize)?;
        self.status.reset()?;
        let mut sides_ptr = dev_sides.ptr();
        let mut size_ = size as u32;
        let mut tail = tail_len(size) as u32;
        let mut iters = total;
        let mut use_signal = signal as u32;
        let mut cq_mod = a.cq_mod;
        let mut budget = a.wait().as_nanos() as u64;
        let mut out = self.status.ptr();
        let mut rtt_ptr = rtt.ptr();
        let mut params = [
            arg(&mut sides_ptr),
            arg(&mut size_),
            arg(&mut tail),
            arg(&mut iters),
            arg(&mut use_signal),
            arg(&mut cq_mod),
            arg(&mut budget),
            arg(&mut out),
            arg(&mut rtt_ptr),
        ];
        // SAFETY: the parameters match gv_sample_write_lat's signature; the side array, the
        // status words and the times are live GPU memory for the whole launch; the GPU
        // addresses in the sides are mapped host buffers or GPU memory (`--mem gpu`) owned by
        // `sides` (alive across the launch) and the descriptors are exported QPs kept alive by
        // `self.exports`.
        unsafe {
            self.gpu
                .launch_sync("gv_sample_write_lat", (2, 1, 1), (1, 1, 1), 0, &mut params)
        }
        .context("launch gv_sample_write_lat")?;
        let qpns = [sides[0].qp.qpn(), sides[1].qp.qpn()];
        self.status
            .check("gv_sample_write_lat", |i| qpns.get(i).copied().unwrap_or(0))?;
        let mut raw = vec![0u8; 8 * total as usize];
        rtt.read(0, &mut raw)?;
        Ok(raw
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }
}
