//! The latency harness of `write_lat`, `read_lat`, `send_lat` and `atomic_lat` (perftest's
//! `ib_write_lat`, `ib_read_lat`, `ib_send_lat`, `ib_atomic_lat`): one parameterised run,
//! [`main`], with the [`Verb`] of the test. Each binary is one call.
//!
//! ```text
//! write_lat --loopback -a            # every size, both sides in this process
//! write_lat --loopback --signal      # the receiver waits on a signal word, not the payload
//! write_lat --loopback -a --initiator gpu --mem gpu   # buffers and signal words on the GPU
//! write_lat -p 18515 --initiator cpu  /  write_lat 127.0.0.1 -p 18515 --initiator cpu
//! read_lat --loopback -a             # side A reads B's buffer, one READ at a time
//! send_lat --loopback -a             # SEND ping-pong into posted receives
//! atomic_lat --loopback -A CMP_AND_SWAP
//! ```
//!
//! The verbs:
//! - **WRITE** (`write_lat`): side A writes `size` bytes into B's receive buffer; B waits until
//!   the last bytes of its receive buffer show the iteration (or, with `--signal`, until its
//!   signal word, raised by an atomic that follows the write, does) and answers the same way; A
//!   waits for the answer. Half a round trip is reported.
//! - **SEND** (`send_lat`): the same ping-pong with SENDs: each side keeps one receive posted
//!   into its receive buffer, waits for the receive completion (its byte count checked), posts
//!   the next receive and answers. Half a round trip is reported; `-I` defaults to perftest's
//!   236.
//! - **READ** (`read_lat`): side A reads `size` bytes of B's source buffer (poisoned, then
//!   filled with the size's pattern, before the run) into its receive buffer (poisoned) and
//!   waits for the READ's completion; B only answers (its NIC does). The whole READ is reported,
//!   as perftest does (no halving).
//! - **Atomics** (`atomic_lat`, `-A FETCH_AND_ADD` (default) or `CMP_AND_SWAP`): side A runs one
//!   8-byte atomic on B's word at a time (adding 1, or swapping `base + k` for `base + k + 1`)
//!   and waits for its completion; every fetched old value is checked (`base + k`) after its
//!   round trip, and B's word at the end (`base + iterations`). The whole atomic is reported.
//!
//! Server/client roles: the client is side A, the server side B; each process opens its device
//! (`-d`: a soft NIC with a wire port, RoCEv2 over UDP, or an rdma-core device such as `mlx5_0`,
//! which refuses the soft NIC's `--wire-port`, `--loss` and `--pcap`), it drives its own side
//! (a host thread with the CPU initiator, a one-block kernel with the GPU's), and each size
//! runs in steps both take over the TCP connection (buffers cleared, ping-pong, each side's
//! check of its receive buffer and side A's numbers exchanged), so both print the same row and
//! both fail when either check fails. With the GPU initiator `write_lat` and `send_lat` launch
//! a kernel for their own side in each process, `read_lat` / `atomic_lat` one in side A's
//! process (side B's NIC answers).
//!
//! The columns are perftest's, in microseconds: t_min, t_max, t_typical (median), t_avg,
//! t_stdev, 99% and 99.9% percentiles. With `-D` (perftest's duration mode) the warm-up runs
//! counted, then each side runs until the duration has passed on its own clock (its waits for
//! the peer end there, so the last message may still be in flight), and the row is perftest's
//! duration row: #iterations (side A's timed round trips), t_avg (their span over their count,
//! halved for WRITE and SEND) and tps average; each side reports how many messages it sent, and
//! the buffers are checked against that.
//!
//! WRITE and SEND: the payload's last min(size, 8) bytes carry the iteration number (written by
//! the sender before each post, as perftest does); the rest is a pattern of the run. Both
//! receive buffers are checked byte by byte after the run (and the signal words with
//! `--signal`).
//!
//! GPU initiator: one kernel, `gv_sample_verb_lat`: for WRITE and SEND in loopback one thread
//! driving both sides in turn (A sends, B takes and answers, A takes, as the CPU initiator's
//! thread does, so nothing else on the GPU polls while a side posts), across processes one
//! thread per process driving its side (each owning its QP), SEND's
//! posting its own receives with `post_recv` and taking them with `recv_wait`, WRITE's polling
//! its receive buffer's last word (or its signal word); messages of at most `-I` bytes go
//! inline (`put_inline`, `send_inline`); for READ and the atomics one block, side A's
//! (checking every fetched value itself). A times each round trip with %globaltimer. With a
//! count (not `-D`) and outside BlueFlame, WRITE and SEND prepare each message before the wait
//! that lets it go: its tail is written, its WQEs posted without a ring and released to the
//! NIC's scope (`release_ahead`), and once the peer's message is in only the doorbell is rung,
//! so the system-scope fence (≈0.55 µs on the H200) is off the round trip; messages alternate
//! between two copies of the source buffer, so a tail is never written while the NIC may still
//! read the copy. With `-D` a side learns only after its wait whether it answers, and posts
//! then (the fence in the round trip, as before). CPU initiator: one host thread drives
//! both sides in turn and times with the monotonic clock. Warm-up iterations run first, in the
//! same loop, and are left out of the numbers.
//!
//! Placement (GPU initiator only): `--mem gpu` puts each side's source buffer, receive buffer,
//! signal word and atomic result word in GPU memory registered with `Pd::register_device_mem`
//! (the kernel gets their device pointers; `--signal`'s discarded old values still land in host
//! memory); the host fills, clears and checks them by copying (`DeviceMem::write` / `read`).
//! `--rings gpu` puts the SQ/RQ and CQ rings in GPU memory. The CPU initiator refuses both: it
//! reaches its buffers and rings through host pointers.

use crate::bw::{atomic_base, atomic_value, AtomicOp, Verb};
use crate::{
    address_lines_of, arg, check_placement, common_header, common_json, connect_options,
    connect_pair, cpu_ring_mode, create_qp, create_qp_rq, doorbell_line, error_text, exit_with,
    merge, mtu_line, open_env, open_env_remote, output_number, pattern, remote_header, remote_json,
    step, table_row, tx_depth_for, upload, wire_counters, wire_delta, with_mtu, CommonArgs,
    CpuSample, Exports, GpuStatus, Header, Initiator, LatSide, LatStats, OtherCpu, Payload, Peer,
    Placement, Progress, QpSpec, UserIdle,
};
use anyhow::{bail, Context as _, Result};
use clap::{CommandFactory, Parser};
use gpuverbs::gpu::Gpu;
use gpuverbs::{Access, Endpoint, HostBuffer, Mr, Pd, Qp, RemoteMemory};
use prm::wqe::{CtrlFlags, Local, Op, RemoteAddr};
use prm::{Completion, Rkey};
use serde_json::json;
use softnic::initiator::{Initiator as CpuInitiator, InitiatorError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default bytes per size and direction: larger sizes get fewer iterations.
const BYTES_PER_SIZE: u64 = 256 << 20;
/// Fewest default iterations of a size.
const MIN_ITERS: u32 = 100;
/// Default iterations of small sizes (perftest's).
const DEFAULT_ITERS: u32 = 1000;
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

/// perftest's columns in duration mode (-D; `RESULT_FMT_LAT_DUR`).
const LAT_DUR_COLUMNS: [(&str, usize); 4] = [
    ("#bytes", 13),
    ("#iterations", 17),
    ("t_avg[usec]", 14),
    ("tps average", 0),
];

/// What a test is called and defaults to.
#[derive(Clone, Copy, Debug)]
struct Test {
    verb: Verb,
    name: &'static str,
    /// Default size (perftest's: 2, atomics 8).
    default_size: u64,
    /// perftest's -I default (WRITE 220, SEND 236; READ and atomics have none).
    inline: Option<u32>,
}

impl Test {
    fn of(verb: Verb) -> Self {
        let (name, default_size, inline) = match verb {
            Verb::Write => ("write_lat", 2, Some(220)),
            Verb::Read => ("read_lat", 2, None),
            Verb::Send => ("send_lat", 2, Some(236)),
            Verb::Atomic(_) => ("atomic_lat", 8, None),
        };
        Self {
            verb,
            name,
            default_size,
            inline,
        }
    }

    /// Whether one side only initiates (READ, atomics: the other's NIC answers).
    fn one_sided(&self) -> bool {
        matches!(self.verb, Verb::Read | Verb::Atomic(_))
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "write_lat",
    version,
    about = "RDMA WRITE ping-pong latency between GPU-driven QPs (or CPU-driven ones), perftest \
             style",
    long_about = "RDMA WRITE ping-pong latency between GPU-driven QPs (or CPU-driven ones), \
                  perftest style (ib_write_lat's columns, half round trip in microseconds). \
                  Both receive buffers are checked after every size.\n\n\
                  Roles: `write_lat --loopback` runs both sides in this process (one GPU thread, \
                  or one host thread, drives them in turn); `write_lat` \
                  (server, side B) and `write_lat SERVER` (client, side A) meet over TCP on -p, \
                  each opens its device (-d: a soft NIC with a UDP wire port, RoCEv2, or an \
                  rdma-core device such as mlx5_0) and drives its own side (a kernel, or a host \
                  thread); each side checks its receive buffer and reports to the other.\n\n\
                  Default iterations per size: 1000, or 256 MiB worth when less (at least 100); \
                  warm-up about a tenth (at most 100)."
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// WRITE: the receiver waits on a signal word raised by an atomic after the write, instead
    /// of polling the payload's last bytes.
    #[arg(long)]
    signal: bool,
    /// perftest's -I (--inline_size), WRITE and SEND: messages of at most this many bytes
    /// travel inside their WQEs (an inline data segment) [default: perftest's, 220 for WRITE
    /// and 236 for SEND]. At most 256.
    #[arg(short = 'I', long = "inline_size", value_name = "BYTES",
          value_parser = clap::value_parser!(u32).range(0..=MAX_INLINE as i64))]
    inline_size: Option<u32>,
    /// perftest's -o (--outs), READ and atomics: the QP's outstanding reads (perftest's default
    /// 16). A latency test has one in flight at a time; the value is reported.
    #[arg(short = 'o', long = "outs", value_name = "NUM",
          value_parser = clap::value_parser!(u32).range(1..=256))]
    outs: Option<u32>,
    /// perftest's -A (--atomic_type), atomics: FETCH_AND_ADD (default) or CMP_AND_SWAP.
    #[arg(short = 'A', long = "atomic_type", value_enum, value_name = "TYPE")]
    atomic_type: Option<AtomicOp>,
    /// Make the run fail on purpose (tests): `corrupt` flips a bit of what side A received (its
    /// receive buffer; atomics: its last fetched value) after the run, which validation must
    /// catch.
    #[arg(long, value_enum, hide = true)]
    inject: Option<Inject>,
    /// perftest's -D (--duration): after the warm-up, each size's timed part runs this many
    /// seconds instead of -n iterations, and the row is perftest's duration row: #iterations,
    /// t_avg[usec] (the timed part's span over its round trips; halved for WRITE and SEND, as
    /// perftest does) and tps average. Each side stops on its own clock; not with -a or -n (as
    /// perftest).
    #[arg(short = 'D', long = "duration", value_name = "SECONDS",
          conflicts_with_all = ["iters", "all"],
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    duration: Option<u32>,
    /// perftest's --cpu_util: a CPU_Util[%] column, the machine's user time over user + idle
    /// time during the timed part (/proc/stat, as perftest). Duration mode (-D) only: without
    /// it perftest warns and reports none, and so does this test.
    #[arg(long = "cpu_util")]
    cpu_util: bool,
}

/// Failures made on purpose (tests of the validation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Inject {
    /// A bit of side A's received bytes is flipped after the run.
    Corrupt,
}

/// Largest `-I` (the QPs' inline limit).
const MAX_INLINE: u32 = 256;
/// perftest's `-o` default.
const DEFAULT_OUTS: u32 = 16;

/// The command line of `test`: its name, its about text, and the options of other verbs
/// hidden.
fn command(t: &Test) -> clap::Command {
    let v = t.verb;
    let mut c = Args::command().name(t.name).bin_name(t.name);
    if v != Verb::Write {
        let (what, perftest, how) = match v {
            Verb::Read => ("RDMA READ", "ib_read_lat", "the whole READ"),
            Verb::Send => ("SEND ping-pong", "ib_send_lat", "half round trip"),
            _ => ("8-byte atomic", "ib_atomic_lat", "the whole atomic"),
        };
        let about = format!("{what} latency, posted by CUDA kernels (or the CPU), perftest style");
        c = c.about(about.clone()).long_about(format!(
            "{about} ({perftest}'s columns, {how} in microseconds). Every byte (every fetched \
             value) is checked after every size.\n\n\
             Roles: `{n} --loopback` runs both sides in this process; `{n}` (server, side B) and \
             `{n} SERVER` (client, side A) meet over TCP on -p, each driving its own side (a \
             kernel, or a host thread).\n\n\
             Default iterations per size: 1000, or 256 MiB worth when less (at least 100); \
             warm-up about a tenth (at most 100).",
            n = t.name
        ));
        c = c.mut_arg("signal", |a| a.hide(true));
    }
    if !v.has_outs() {
        c = c.mut_arg("outs", |a| a.hide(true));
    }
    if !matches!(v, Verb::Atomic(_)) {
        c = c.mut_arg("atomic_type", |a| a.hide(true));
    }
    if !v.has_inline() {
        c = c.mut_arg("inline_size", |a| a.hide(true));
    }
    c
}

/// Runs the latency test of `verb` (for an atomic, `-A` may choose the other one) with the
/// process's arguments; the binaries' `main`.
pub fn main(verb: Verb) -> std::process::ExitCode {
    let t0 = Test::of(verb);
    let mut cmd = command(&t0);
    let mut args: Args = crate::args::parse_or_exit(&mut cmd);
    let verb = verb.chosen(args.atomic_type);
    let t = Test { verb, ..t0 };
    let test = t.name;
    let mut foreign = Vec::new();
    if args.outs.is_some() && !verb.has_outs() {
        foreign.push("-o (--outs): READ and atomics");
    }
    if args.atomic_type.is_some() && !matches!(verb, Verb::Atomic(_)) {
        foreign.push("-A (--atomic_type): atomics");
    }
    if args.inline_size.is_some() && !verb.has_inline() {
        foreign.push("-I (--inline_size): WRITE and SEND");
    }
    if args.signal && verb != Verb::Write {
        foreign.push("--signal: WRITE");
    }
    if let Verb::Atomic(_) = verb {
        if args.common.all || args.common.size.is_some_and(|s| s != 8) {
            foreign.push("-a, -s other than 8: not atomics (8 bytes each, as perftest's)");
        }
    }
    if !foreign.is_empty() {
        cmd.error(
            clap::error::ErrorKind::ArgumentConflict,
            format!("{test} does not take: {}", foreign.join("; ")),
        )
        .exit();
    }
    if let Err(e) = args.common.resolve() {
        return exit_with(test, Err(e));
    }
    let refuse = |why: String| exit_with(test, Err(anyhow::anyhow!(why)));
    if let Some(o) = args
        .common
        .output
        .filter(|&o| o != crate::OutputArg::Latency)
    {
        return refuse(format!(
            "--output {}: {test}'s output can be latency (as perftest's latency tests')",
            o.name()
        ));
    }
    if args.common.db == crate::DbArg::Proxy && args.common.initiator == Some(Initiator::Cpu) {
        cmd.error(
            clap::error::ErrorKind::ArgumentConflict,
            "--db proxy needs --initiator gpu (the CPU initiator rings its own doorbells)",
        )
        .exit();
    }
    exit_with(test, run(&args, &t))
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

/// One side: its QP, outgoing payload (READ: the buffer the peer reads), receive buffer (READ:
/// where this side's reads land), signal word (atomics: the word the peer's atomics work on),
/// atomic result word (each in host or GPU memory, as `--mem` says) and `--signal`'s result
/// word (host memory: nobody reads it).
struct Side {
    qp: Qp,
    src: Payload,
    src_mr: Mr,
    /// WRITE and SEND: bytes from the outgoing payload's first copy to its second (see
    /// `LatSide::src_stride`); 0 for the verbs whose source is one copy.
    src_stride: usize,
    recv: Payload,
    recv_mr: Mr,
    sig: Payload,
    sig_mr: Mr,
    /// Where `--signal`'s old values land (the region keeps its buffer alive).
    result_mr: Mr,
    /// Where an atomic's fetched value lands (atomic_lat).
    fetch: Payload,
    fetch_mr: Mr,
}

impl Side {
    fn new(
        pd: &Pd,
        spec: QpSpec,
        gpu: Option<&Arc<Gpu>>,
        mem: Placement,
        len: usize,
        verb: Verb,
    ) -> Result<Self> {
        let qp = match verb {
            Verb::Send => create_qp_rq(pd, spec, gpu, 16)?,
            _ => create_qp(pd, spec, gpu)?,
        };
        // WRITE and SEND: two copies of the outgoing payload (see `LatSide::src_stride`).
        let src_stride = if matches!(verb, Verb::Write | Verb::Send) {
            len
        } else {
            0
        };
        let src = Payload::new(mem, gpu, src_stride + len)?;
        let src_mr = src.register(pd, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
        let recv = Payload::new(mem, gpu, len)?;
        let recv_mr = recv.register(pd, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
        let sig = Payload::new(mem, gpu, 64)?;
        let sig_mr = sig.register(pd, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
        let result = HostBuffer::new(64);
        let result_mr = pd.register_with(&result, Access::LOCAL_WRITE)?;
        let fetch = Payload::new(mem, gpu, 64)?;
        let fetch_mr = fetch.register(pd, Access::LOCAL_WRITE)?;
        Ok(Self {
            qp,
            src,
            src_mr,
            src_stride,
            recv,
            recv_mr,
            sig,
            sig_mr,
            result_mr,
            fetch,
            fetch_mr,
        })
    }
}

fn run(args: &Args, t: &Test) -> Result<()> {
    let a = &args.common;
    let verb = t.verb;
    #[allow(non_snake_case)]
    let TEST = t.name;
    let sizes = a.sizes(t.default_size);
    let outs = args.outs.unwrap_or(DEFAULT_OUTS);
    let duration = args.duration.map(|d| Duration::from_secs(d.into()));
    // perftest reports CPU utilisation in duration mode only (and warns otherwise).
    let cpu_util = args.cpu_util && duration.is_some();
    if args.cpu_util && !cpu_util {
        eprintln!("{TEST}: --cpu_util: CPU Utilization works only with Duration mode (-D)");
    }
    // The inline limit asked for (perftest's default).
    let inline_max = args.inline_size.unwrap_or(t.inline.unwrap_or(0));
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
        Some(p) => open_env_remote(a, p)?,
    };
    let pcap = crate::start_pcap(a, &env.ctx)?;
    a.check_device(&env.ctx)?;
    let ring_mode = match env.initiator {
        Initiator::Cpu => Some(cpu_ring_mode(a.db)?),
        Initiator::Gpu => None,
    };
    check_placement(a, &env)?;
    if let Some(p) = peer.as_ref().filter(|p| p.addr.ip().is_loopback()) {
        if env.initiator == Initiator::Gpu && matches!(verb, Verb::Send | Verb::Write) {
            // Measured on the H200: 2.2 ms per message without MPS, 16 µs with it.
            eprintln!(
                "{TEST}: note: the {} is on this host, and both sides run a resident kernel: \
                 when they share a GPU without MPS (nvidia-cuda-mps-control -d), the GPU \
                 time-slices the two processes and each message waits for the other's slice \
                 (milliseconds); with MPS, or a GPU each, they run at once",
                p.peer_role
            );
        }
    }
    // Loopback: both sides, on one device (a PD each). Across processes: this side (the client
    // is A, the server B), and where its messages go on the peer.
    let me = peer.as_ref().map(Peer::side);
    let mut sides: Vec<Side> = Vec::new();
    let mut targets: Vec<Target> = Vec::new();
    let mut peer_ep: Option<Endpoint> = None;
    match (&mut peer, me) {
        (Some(p), Some(_)) => {
            let pd = env.ctx.alloc_pd();
            let s = Side::new(&pd, spec, env.gpu.as_ref(), a.mem, len, verb)?;
            let export = |mr: &Mr| RemoteMemory::export_rkey(mr.addr(), mr.len(), mr.rkey().0);
            let facts = json!({
                "recv": export(&s.recv_mr)?, "sig": export(&s.sig_mr)?, "src": export(&s.src_mr)?,
            });
            let params = json!({
                "sizes": sizes, "iters": a.iters, "warmup": a.warmup, "signal": args.signal,
                "duration_s": args.duration,
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
            let (recv, sig, src) = (remote("recv")?, remote("sig")?, remote("src")?);
            if recv.len() < len as u64 || sig.len() < 8 || src.len() < len as u64 {
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
                src: RemoteAddr {
                    addr: src.addr(),
                    rkey: Rkey(src.rkey()),
                },
            });
            sides.push(s);
            peer_ep = Some(ep);
        }
        _ => {
            let (pa, pb) = (env.ctx.alloc_pd(), env.ctx.alloc_pd());
            sides = vec![
                Side::new(&pa, spec, env.gpu.as_ref(), a.mem, len, verb)?,
                Side::new(&pb, spec, env.gpu.as_ref(), a.mem, len, verb)?,
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
    let mut h = Header::new(format!("{} Latency Test ({TEST})", verb.title()));
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
        match (env.initiator, me, t.one_sided()) {
            (Initiator::Gpu, Some(1), true) => "none: side B's NIC answers",
            (Initiator::Gpu, _, true) => "one kernel: block 0 drives side A (one thread)",
            (Initiator::Gpu, Some(0), false) => "a kernel of one block (one thread) drives side A",
            (Initiator::Gpu, Some(_), false) => "a kernel of one block (one thread) drives side B",
            (Initiator::Gpu, None, false) => "one kernel: one thread drives both sides in turn",
            (Initiator::Cpu, None, true) => "one host thread drives side A (side B's NIC answers)",
            (Initiator::Cpu, None, false) => "one host thread drives both sides in turn",
            (Initiator::Cpu, Some(0), _) => "one host thread drives side A (it sends first)",
            (Initiator::Cpu, Some(_), true) => "none: side B's NIC answers",
            (Initiator::Cpu, Some(_), false) => "one host thread drives side B (it answers)",
        },
    );
    match verb {
        Verb::Write => h.line(
            "Receiver waits",
            if args.signal {
                "on a signal word (atomic add after the write)"
            } else {
                "on the last bytes of its receive buffer"
            },
        ),
        Verb::Send => h.line(
            "Receiver waits",
            "on the receive completion (one receive posted ahead)",
        ),
        _ => h.line("Initiator waits", "on the completion of each one"),
    };
    h.line("CQ Moderation", a.cq_mod)
        .line("TX depth", format!("{tx} blocks"))
        .line(
            "Mtu",
            mtu_line(a.mtu, &env.ctx, &sides[0].qp.endpoint(), peer_ep.as_ref()),
        )
        .line("GID index", env.ctx.gid_index());
    if verb.has_inline() {
        h.line("Max inline data", format!("{inline_max}[B]"));
    }
    if verb.has_outs() {
        h.line("Outstand reads", outs);
    }
    h.line(
        "Iterations",
        match (args.duration, a.iters) {
            (Some(d), _) => format!(
                "as many as {d} s take, per size, after the warm-up (-D; each side stops on its \
                 own clock)"
            ),
            (None, Some(n)) => format!("{n} per size"),
            (None, None) => format!(
                "per size: {DEFAULT_ITERS}, or {} MiB worth when less (at least {MIN_ITERS})",
                BYTES_PER_SIZE >> 20
            ),
        },
    )
    .line(
        "Times",
        format!(
            "{}, microseconds{}",
            if t.one_sided() {
                "the whole operation (perftest's: not halved)"
            } else {
                "half round trip"
            },
            if peer.is_some() {
                ", measured by side A (the client)"
            } else {
                ""
            }
        ),
    )
    .line(
        "Validation",
        match (verb, peer.is_some()) {
            (Verb::Atomic(_), _) => {
                "every fetched value (side A) and the target word's final value (side B), \
                 every size"
            }
            (Verb::Read, _) => "side A's receive buffer (what it read), every byte, every size",
            (_, true) => {
                "each side its receive buffer, every byte, every size (reported to the peer)"
            }
            (_, false) => "both receive buffers, every byte, every size",
        },
    );
    other_cpu.header(&mut h);
    let table = !a.json && a.output.is_none();
    if a.output.is_none() {
        h.print(a.json);
        // perftest's address lines: this side's QP, then the peer's (each with the buffer
        // the other reaches: WRITE's receive buffer, READ's source).
        let fmt = verb.addr_format(outs);
        let shown = |s: &Side| match verb {
            Verb::Read => (s.src_mr.rkey().0, s.src_mr.addr()),
            _ => (s.recv_mr.rkey().0, s.recv_mr.addr()),
        };
        let (lk, lv) = shown(&sides[0]);
        let mut lines = vec![address_lines_of(
            fmt,
            "local",
            &with_mtu(&sides[0].qp.endpoint(), a.mtu),
            lk,
            lv,
        )];
        match (&peer_ep, targets.first()) {
            (Some(ep), Some(t)) => {
                let r = if verb == Verb::Read { t.src } else { t.recv };
                lines.push(address_lines_of(fmt, "remote", ep, r.rkey.0, r.addr));
            }
            _ => {
                let (rk, rv) = shown(&sides[1]);
                lines.push(address_lines_of(
                    fmt,
                    "remote",
                    &sides[1].qp.endpoint(),
                    rk,
                    rv,
                ));
            }
        }
        lines.push(crate::RULE.to_string());
        if a.json {
            eprintln!("{}", lines.join("\n"));
        } else {
            println!("{}", lines.join("\n"));
        }
    }
    if table {
        let mut cols: Vec<(String, usize)> = match duration {
            Some(_) => LAT_DUR_COLUMNS.map(|(n, w)| (n.to_string(), w)).to_vec(),
            None => LAT_COLUMNS.map(|(n, w)| (n.to_string(), w)).to_vec(),
        };
        if cpu_util {
            cols.last_mut().expect("columns").1 = 14;
            cols.push(("CPU_Util[%]".into(), 0));
        }
        println!("{}", table_row(&cols));
    }
    let mut base_json = merge(
        common_json(&env, a, &sides[0].qp),
        json!({
            "test": TEST, "signal": args.signal, "cq_mod": a.cq_mod, "tx_depth": tx,
            "duration_s": args.duration,
            "inline_size": inline_max, "verb": verb.title(),
            "outs": verb.has_outs().then_some(outs),
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
            let qps: Vec<&Qp> = sides.iter().map(|s| &s.qp).collect();
            let exports = Exports::new(&gpu, &qps)?;
            let mut mapped = Vec::new();
            for s in &sides {
                mapped.push([
                    s.src.gpu_addr(&gpu)?,
                    s.recv.gpu_addr(&gpu)?,
                    s.sig.gpu_addr(&gpu)?,
                    s.fetch.gpu_addr(&gpu)?,
                ]);
            }
            let status = GpuStatus::new(&gpu)?;
            Engine::Gpu(Box::new(GpuLat {
                gpu,
                exports,
                mapped,
                status,
                verb,
            }))
        }
    };

    let mut progress = Progress::new(TEST, sizes.len());
    let mut scratch = Vec::new();
    for (n, &size) in sizes.iter().enumerate() {
        let (iters, warmup) = iterations(a, size);
        // With -D the engines run the warm-up counted, then the duration.
        let total = match duration {
            Some(_) => warmup,
            None => iters + warmup,
        };
        let seed = pattern::seed(2, size);
        let (p, tl) = (pad(size) as usize, tail_len(size));
        for (&i, s) in ids.iter().zip(&sides) {
            match verb {
                Verb::Write | Verb::Send => {
                    pattern::fill(&mut scratch, seed ^ i as u64, 0, size as usize - tl);
                    for copy in [0, s.src_stride] {
                        s.src.write(copy + p, &scratch)?;
                        s.src.fill(copy + p + size as usize - tl, tl, 0)?;
                    }
                    s.recv.fill(0, s.recv.len(), 0)?;
                    s.sig.write(0, &0u64.to_ne_bytes())?;
                }
                Verb::Read => {
                    // The source is poisoned, then filled; the receive buffer (where the
                    // reads land) holds the complement of the peer's pattern.
                    pattern::fill(&mut scratch, seed ^ i as u64, 0, size as usize);
                    scratch.iter_mut().for_each(|x| *x = !*x);
                    s.src.write(p, &scratch)?;
                    scratch.iter_mut().for_each(|x| *x = !*x);
                    s.src.write(p, &scratch)?;
                    s.recv.fill(0, s.recv.len(), 0)?;
                    pattern::fill(&mut scratch, seed ^ (1 - i) as u64, 0, size as usize);
                    scratch.iter_mut().for_each(|x| *x = !*x);
                    s.recv.write(p, &scratch)?;
                }
                Verb::Atomic(_) => {
                    s.sig.write(0, &atomic_base(0).to_ne_bytes())?;
                    s.fetch.write(0, &(!atomic_base(0)).to_ne_bytes())?;
                }
            }
        }
        // Before the step that lets the peer start (its packets may arrive, and be answered,
        // before this thread runs again after it).
        let wire_before = wire_counters(&env.ctx);
        // Across processes A sends only once B has cleared its buffers.
        step(&mut peer, "ready", Ok(()))?;
        let cpu = CpuSample::now();
        let inline = size <= inline_max as u64;
        let util_before = cpu_util.then(UserIdle::now).flatten();
        let ran = engine.run(
            &sides,
            &ids,
            &targets,
            verb,
            size,
            total,
            duration,
            args.signal,
            inline,
            a,
        );
        let util = util_before.zip(UserIdle::now()).map(|(b, e)| b.util_to(e));
        let others = other_cpu.record(cpu.and_then(CpuSample::others_since));
        let wire = wire_delta(&wire_before, &wire_counters(&env.ctx));
        // Side A's times (B has none), and what each side sent: the peer's counts, across
        // processes, come with this step.
        let mine = ran.as_ref().ok().cloned().unwrap_or_default();
        let theirs = step(&mut peer, "ran", ran.map(|r| (r.sent, r.timed)))?;
        let (their_sent, their_timed) = theirs.unwrap_or_default();
        let sent = [0, 1].map(|i| mine.sent[i].or(their_sent[i]).unwrap_or(0));
        let timed = mine.timed.or(their_timed);
        if let (Some(Inject::Corrupt), Some(k)) = (args.inject, ids.iter().position(|&i| i == 0)) {
            let (b, off) = match verb {
                Verb::Atomic(_) => (&sides[k].fetch, 3),
                _ => (&sides[k].recv, p + size as usize / 2),
            };
            let mut x = [0u8];
            b.read(off, &mut x)?;
            b.write(off, &[x[0] ^ 0x01])?;
        }
        let failure = validate(
            &sides,
            &ids,
            verb,
            size,
            sent,
            seed,
            args.signal,
            &mut scratch,
        )
        .err()
        .map(|e| error_text(&e));
        // Half a round trip (WRITE, SEND), or the whole operation (READ, atomics: perftest's).
        let per = if t.one_sided() { 1e3 } else { 2e3 };
        let stats = mine.rtt.map(|rtt| {
            let mut us: Vec<f64> = rtt[warmup as usize..]
                .iter()
                .map(|&t| t as f64 / per)
                .collect();
            LatStats::of(&mut us)
        });
        // Across processes: the peer's check, and side A's numbers for side B.
        let (failure, st) = match &mut peer {
            None => (failure, stats.unwrap_or_default()),
            Some(pr) if duration.is_some() => {
                let theirs: Option<String> = pr.step("validated", Ok(failure.clone()))?;
                let by = |f: String, who: &str| format!("{f} (checked by the {who})");
                let f = failure
                    .map(|f| by(f, pr.role))
                    .or_else(|| theirs.map(|f| by(f, pr.peer_role)));
                (f, LatStats::default())
            }
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
        if let Some(d) = duration {
            // perftest's duration row: the timed part's round trips over its span.
            let (n, span_ns) = timed.context("side A measured no timed part")?;
            let secs = span_ns as f64 / 1e9;
            let t_avg = if n > 0 {
                span_ns as f64 / n as f64 / per
            } else {
                0.0
            };
            let tps = if secs > 0.0 { n as f64 / secs } else { 0.0 };
            if a.output.is_some() {
                println!("{}", output_number(t_avg));
            } else if a.json {
                let v = merge(
                    base_json.clone(),
                    json!({
                        "bytes": size, "iterations": n, "warmup": warmup,
                        "duration_s": d.as_secs(), "time_s": secs, "t_avg_us": t_avg,
                        "tps_average": tps, "sent": sent, "validated": failure.is_none(),
                        "inline": inline, "other_cpu_cores": others, "cpu_util_pct": util,
                    }),
                );
                let v = if peer.is_some() {
                    merge(v, json!({ "wire": wire }))
                } else {
                    v
                };
                println!("{v}");
            } else {
                let mut cells = vec![
                    (size.to_string(), 13),
                    (n.to_string(), 17),
                    (format!("{t_avg:.2}"), 14),
                    (format!("{tps:.2}"), 0),
                ];
                if cpu_util {
                    cells.last_mut().expect("cells").1 = 14;
                    cells.push((format!("{:.2}", util.unwrap_or(0.0)), 0));
                }
                println!("{}", table_row(&cells));
            }
        } else if a.output.is_some() {
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
            // This side's wire port during the timed run, across processes.
            let v = if peer.is_some() {
                merge(v, json!({ "wire": wire }))
            } else {
                v
            };
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
        println!("{}", crate::RULE);
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
/// number of the peer's last message (`sent[peer]`: the messages each side sent); and the
/// signal words with `--signal`. READ: side A's receive buffer holds B's pattern; atomics: A's
/// last fetched value and B's word's final value.
#[allow(clippy::too_many_arguments)]
fn validate(
    sides: &[Side],
    ids: &[usize],
    verb: Verb,
    size: u64,
    sent: [u64; 2],
    seed: u64,
    signal: bool,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let (p, tl) = (pad(size) as usize, tail_len(size));
    let side_name = |me: usize| ["A", "B"][me];
    for (&me, s) in ids.iter().zip(sides) {
        let peer = 1 - me;
        if let Verb::Atomic(op) = verb {
            let word = |b: &Payload| -> Result<u64> {
                let mut w = [0u8; 8];
                b.read(0, &mut w)?;
                Ok(u64::from_ne_bytes(w))
            };
            let n = sent[0];
            let (got, want, what) = if me == 0 {
                (
                    word(&s.fetch)?,
                    atomic_value(0, n.saturating_sub(1)),
                    "the last fetched value",
                )
            } else {
                (
                    word(&s.sig)?,
                    atomic_value(0, n),
                    "the target word's final value",
                )
            };
            if got != want {
                bail!(
                    "side {}: {what} after {n} {} is {got:#018x}, expected {want:#018x}",
                    side_name(me),
                    op.name()
                );
            }
            continue;
        }
        if verb == Verb::Read {
            if me == 1 {
                // B's receive buffer is nobody's target.
                continue;
            }
            pattern::fill(scratch, seed ^ peer as u64, 0, size as usize);
        } else {
            pattern::fill(scratch, seed ^ peer as u64, 0, size as usize - tl);
            scratch.extend_from_slice(&sent[peer].to_le_bytes()[..tl]);
        }
        let mut got = vec![0u8; size as usize];
        s.recv.read(p, &mut got)?;
        if let Some(o) = pattern::first_difference(&got, scratch) {
            bail!(
                "side {}'s receive buffer: byte {o} of {size} is {:#04x}, expected {:#04x}{}",
                side_name(me),
                got[o],
                scratch[o],
                if verb == Verb::Read && got[o] == !scratch[o] {
                    " (the poison: the READ did not land)"
                } else {
                    ""
                }
            );
        }
        let mut before = vec![0u8; p];
        s.recv.read(0, &mut before)?;
        if before.iter().any(|&x| x != 0) {
            bail!("side {}: bytes before the payload changed", side_name(me));
        }
        if signal {
            // The run is over (every WQE completed): a plain copy reads the final value.
            let mut word = [0u8; 8];
            s.sig.read(0, &mut word)?;
            let v = u64::from_ne_bytes(word);
            if v != sent[peer] {
                bail!(
                    "side {}'s signal word is {v}, expected {} (the messages of side {})",
                    side_name(me),
                    sent[peer],
                    side_name(peer)
                );
            }
        }
    }
    Ok(())
}

struct GpuLat {
    gpu: std::sync::Arc<gpuverbs::gpu::Gpu>,
    exports: Exports,
    /// Per side: GPU addresses of src, recv, sig, fetch (mapped host memory, or GPU memory).
    mapped: Vec<[u64; 4]>,
    status: GpuStatus,
    verb: Verb,
}

enum Engine {
    /// One initiator per entry of `sides`.
    Cpu(Vec<CpuInitiator>),
    Gpu(Box<GpuLat>),
}

/// What a run of one size did on this process's sides.
#[derive(Clone, Debug, Default)]
struct Ran {
    /// Side A's round trips in ns, every one, warm-up included (counted runs, side A here).
    rtt: Option<Vec<u64>>,
    /// Messages (WRITEs, SENDs, READs, atomics) each side of this process sent, by side.
    sent: [Option<u64>; 2],
    /// With -D: side A's timed round trips and their span in ns (side A here).
    timed: Option<(u64, u64)>,
}

impl Engine {
    /// Runs `total` round trips (with `duration`: `total` of warm-up, then as many as the
    /// duration takes).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        sides: &[Side],
        ids: &[usize],
        targets: &[Target],
        verb: Verb,
        size: u64,
        total: u32,
        duration: Option<Duration>,
        signal: bool,
        inline: bool,
        a: &CommonArgs,
    ) -> Result<Ran> {
        match self {
            Engine::Cpu(inis) => {
                let mut posters: Vec<Poster<'_>> = inis
                    .iter_mut()
                    .zip(sides)
                    .zip(targets)
                    .map(|((ini, side), to)| Poster::new(ini, side, to))
                    .collect::<Result<_>>()?;
                run_cpu(
                    &mut posters,
                    ids,
                    verb,
                    size,
                    total,
                    duration,
                    signal,
                    inline,
                    a,
                )
            }
            Engine::Gpu(g) => g.run(
                sides, ids, targets, size, total, duration, signal, inline, a,
            ),
        }
    }
}

/// Where a side's messages go: the peer's receive buffer and signal word (atomics: the word
/// they work on), and the source buffer a READ reads.
#[derive(Clone, Copy, Debug)]
struct Target {
    recv: RemoteAddr,
    sig: RemoteAddr,
    src: RemoteAddr,
}

impl Target {
    /// The receive buffer, signal word and source of a side of this process.
    fn of(s: &Side) -> Self {
        Self {
            recv: s.recv_mr.remote(0),
            sig: s.sig_mr.remote(0),
            src: s.src_mr.remote(0),
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
/// the answer; side B waits for it and answers. With `duration` (-D) the `total` iterations
/// are the warm-up and a timed part follows until the duration has passed on this process's
/// clock (the waits for the peer end there). `inline`: the payload travels inside the WQE
/// (`-I`), copied from the source buffer.
#[allow(clippy::too_many_arguments)]
fn run_cpu(
    posters: &mut [Poster<'_>],
    ids: &[usize],
    verb: Verb,
    size: u64,
    total: u32,
    duration: Option<Duration>,
    signal: bool,
    inline: bool,
    a: &CommonArgs,
) -> Result<Ran> {
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

    let one_sided = matches!(verb, Verb::Read | Verb::Atomic(_));
    // Posts the payload of poster `i` for iteration number k1 (READ, atomics: side A's READ
    // or atomic of iteration k1 - 1).
    let mut send = |posters: &mut [Poster<'_>], i: usize, k1: u64| -> Result<()> {
        let Poster {
            ini, side: s, to, ..
        } = &mut posters[i];
        if !one_sided {
            s.src
                .write((p + size) as usize - tl, &k1.to_le_bytes()[..tl])?;
        }
        // One CQE per --cq-mod iterations, and for the last of a counted run (so that every
        // WQE completes; after a duration a signaled NOP follows); READ and atomics: every one
        // (the initiator waits for it).
        let sig = one_sided || k1 % a.cq_mod as u64 == 0 || k1 == total as u64;
        let flags = |on: bool| {
            if on {
                CtrlFlags::SIGNALED
            } else {
                CtrlFlags::default()
            }
        };
        let sge = [s.src_mr.sge(p, size as u32)];
        let rsge = [s.recv_mr.sge(p, size as u32)];
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
        let k = k1 - 1;
        let other = match verb {
            Verb::Send => Op::Send { local, imm: None },
            Verb::Read => Op::Read {
                remote: RemoteAddr {
                    addr: to.src.addr + p,
                    rkey: to.src.rkey,
                },
                local: &rsge,
            },
            Verb::Atomic(AtomicOp::FetchAdd) => Op::FetchAdd {
                remote: to.sig,
                add: 1,
                result: s.fetch_mr.sge(0, 8),
            },
            Verb::Atomic(AtomicOp::CmpSwap) => Op::CompareSwap {
                remote: to.sig,
                compare: atomic_value(0, k),
                swap: atomic_value(0, k + 1),
                result: s.fetch_mr.sge(0, 8),
            },
            Verb::Write => Op::Nop,
        };
        let ops: &[(&Op<'_>, CtrlFlags)] = match verb {
            Verb::Write if signal => &[(&write, flags(false)), (&add, flags(sig))],
            Verb::Write => &[(&write, flags(sig))],
            _ => &[(&other, flags(sig))],
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
                    Err(e) => return Err(e).with_context(|| format!("post a {}", verb.title())),
                }
            }
        }
        ini.ring();
        Ok(())
    };
    // Waits until poster `i`'s side has received iteration number k1: false when `deadline`
    // (the duration's end) passed first.
    let arrived = |posters: &mut [Poster<'_>],
                   i: usize,
                   k1: u64,
                   deadline: Option<Instant>|
     -> Result<bool> {
        let me = ids[i];
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let s = &mut posters[i];
            let done = match verb {
                Verb::Write if signal => s.sig.atomic_u64(0).load(Ordering::Acquire) >= k1,
                Verb::Write => {
                    let w = s.recv.atomic_u64(word_off).load(Ordering::Acquire);
                    tail_of_word(w, tl) == tail_value(k1, tl)
                }
                Verb::Send => match s.ini.poll_recv() {
                    None => false,
                    Some(Completion::Resp { byte_cnt, .. }) if byte_cnt as u64 == size => {
                        // The next message's receive (none after the last of a counted run).
                        if duration.is_some() || k1 < total as u64 {
                            s.ini
                                .post_recv(&[s.side.recv_mr.sge(p, size as u32)])
                                .context("post a receive")?;
                        }
                        true
                    }
                    Some(Completion::Resp { byte_cnt, .. }) => bail!(
                        "side {}: receive {k1} took {byte_cnt} B, the message has {size}",
                        ["A", "B"][me]
                    ),
                    Some(Completion::Error(e)) => {
                        bail!("a receive completion carries an error: {e}")
                    }
                    Some(other) => bail!("unexpected completion on the receive CQ: {other:?}"),
                },
                // The READ's or atomic's completion (every one asks for a CQE).
                Verb::Read | Verb::Atomic(_) => {
                    reap(s.ini)?;
                    s.ini.outstanding() == 0
                }
            };
            if done {
                if let (Verb::Atomic(op), Some(f)) = (verb, s.side.fetch.host()) {
                    let got = f.atomic_u64(0).load(Ordering::Acquire);
                    let want = atomic_value(0, k1 - 1);
                    if got != want {
                        bail!(
                            "side A's {} {} fetched {got:#018x}, expected {want:#018x}",
                            op.name(),
                            k1 - 1
                        );
                    }
                }
                return Ok(true);
            }
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 {
                for p in posters.iter_mut() {
                    reap(p.ini)?;
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(false);
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

    // SEND: each side's first receive, before anything is sent.
    if verb == Verb::Send {
        for pst in posters.iter_mut() {
            pst.ini
                .post_recv(&[pst.side.recv_mr.sge(p, size as u32)])
                .context("post a receive")?;
        }
    }
    let mut sent = [0u64; 2];
    // With -D: when the timed part began and ends, its round trips, the last one's end.
    let mut timed_from: Option<(Instant, Instant)> = None;
    let (mut timed, mut last) = (0u64, Instant::now());
    for k in 0.. {
        if k == total as u64 {
            let Some(d) = duration else { break };
            let now = Instant::now();
            timed_from = Some((now, now + d));
            last = now;
        }
        let deadline = timed_from.map(|(_, end)| end);
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let k1 = k + 1;
        let t0 = Instant::now();
        if let Some(ia) = a_at {
            send(posters, ia, k1)?;
            sent[0] += 1;
        }
        if let Some(ib) = b_at.filter(|_| !one_sided) {
            if !arrived(posters, ib, k1, deadline)? {
                break;
            }
            send(posters, ib, k1)?;
            sent[1] += 1;
        }
        if let Some(ia) = a_at {
            // A READ's or atomic's completion does not wait for the peer's program.
            if !arrived(posters, ia, k1, deadline.filter(|_| !one_sided))? {
                break;
            }
            if timed_from.is_some() {
                timed += 1;
                last = Instant::now();
            } else {
                rtt.push(t0.elapsed().as_nanos() as u64);
            }
        }
        if k % 64 == 63 {
            for p in posters.iter_mut() {
                reap(p.ini)?;
            }
        }
    }
    // After a duration the last WQEs may be unsignaled: a signaled NOP retires them.
    if duration.is_some() {
        for p in posters.iter_mut().filter(|p| p.ini.outstanding() > 0) {
            p.ini
                .post(&Op::Nop, CtrlFlags::SIGNALED)
                .context("post the closing NOP")?;
            p.ini.ring();
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
    let mut by_side = [None; 2];
    for &i in ids {
        by_side[i] = Some(sent[i]);
    }
    Ok(Ran {
        rtt: a_at.filter(|_| duration.is_none()).map(|_| rtt),
        sent: by_side,
        timed: timed_from
            .filter(|_| a_at.is_some())
            .map(|(from, _)| (timed, last.duration_since(from).as_nanos() as u64)),
    })
}

impl GpuLat {
    /// `gv_sample_verb_lat` for the sides of this process that post (WRITE and SEND: each;
    /// READ and atomics: side A only), block b driving side `first + b`. `targets[i]`: where
    /// local side `ids[i]`'s WQEs go (the peer's buffers, in this process or the other).
    /// `signal`: WRITE's receiver waits on its signal word; `inline`: WRITE and SEND carry the
    /// payload in the WQE; `duration` (-D): `total` is the warm-up, then a timed part.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        sides: &[Side],
        ids: &[usize],
        targets: &[Target],
        size: u64,
        total: u32,
        duration: Option<Duration>,
        signal: bool,
        inline: bool,
        a: &CommonArgs,
    ) -> Result<Ran> {
        let p = pad(size);
        let verb = self.verb;
        let acting: Vec<usize> = (0..sides.len())
            .filter(|&i| matches!(verb, Verb::Write | Verb::Send) || ids[i] == 0)
            .collect();
        let Some(&first_i) = acting.first() else {
            // Side B of a READ or atomic test: its NIC answers, nothing to launch.
            return Ok(Ran {
                sent: [None, Some(0)],
                ..Ran::default()
            });
        };
        let descs: Vec<LatSide> = acting
            .iter()
            .map(|&i| -> Result<LatSide> {
                let (s, to) = (&sides[i], &targets[i]);
                let [src_d, recv_d, sig_d, fetch_d] = self.mapped[i];
                let src_stride = u32::try_from(s.src_stride)
                    .context("the payload's two copies are more than 4 GiB apart")?;
                let base = LatSide {
                    qp: self.exports.qps[i].ptr(),
                    ..Default::default()
                };
                Ok(match verb {
                    // WRITE: the own payload into the peer's receive buffer (and signal word);
                    // the own receive buffer's last word and signal word are polled.
                    Verb::Write => LatSide {
                        src_nic: s.src_mr.addr() + p,
                        src_dev: src_d + p,
                        src_stride,
                        dst_remote: to.recv.addr + p,
                        recv_dev: recv_d + p + size - 8,
                        sig_remote: to.sig.addr,
                        sig_dev: sig_d,
                        lkey: s.src_mr.lkey().0,
                        rkey: to.recv.rkey.0,
                        sig_rkey: to.sig.rkey.0,
                        ..base
                    },
                    // SEND: the own payload, and the own receive buffer in dst_remote / rkey
                    // (its NIC address and lkey).
                    Verb::Send => LatSide {
                        src_nic: s.src_mr.addr() + p,
                        src_dev: src_d + p,
                        src_stride,
                        dst_remote: s.recv_mr.addr() + p,
                        lkey: s.src_mr.lkey().0,
                        rkey: s.recv_mr.lkey().0,
                        ..base
                    },
                    // READ: into the own receive buffer (src_nic / lkey) from the peer's source.
                    Verb::Read => LatSide {
                        src_nic: s.recv_mr.addr() + p,
                        dst_remote: to.src.addr + p,
                        lkey: s.recv_mr.lkey().0,
                        rkey: to.src.rkey.0,
                        ..base
                    },
                    // Atomics: on the peer's word, the old value into the own fetch word
                    // (dst_remote / rkey: its NIC address and lkey; recv_dev: its GPU address).
                    Verb::Atomic(_) => LatSide {
                        dst_remote: s.fetch_mr.addr(),
                        rkey: s.fetch_mr.lkey().0,
                        recv_dev: fetch_d,
                        sig_remote: to.sig.addr,
                        sig_rkey: to.sig.rkey.0,
                        ..base
                    },
                })
            })
            .collect::<Result<_>>()?;
        let dev_sides = upload(&self.gpu, &descs)?;
        let rtt = self.gpu.alloc(8 * total.max(1) as usize)?;
        // Per side: messages sent, timed round trips, their span (ns); -D only.
        let counts = self.gpu.alloc(32 * descs.len())?;
        counts.write(0, &vec![0u8; 32 * descs.len()])?;
        self.status.reset()?;
        let mut sides_ptr = dev_sides.ptr();
        let mut first = ids[first_i] as u32;
        // Loopback WRITE and SEND: one thread drives both sides in turn (one block).
        let mut in_turn = u32::from(descs.len() == 2);
        let mut code = verb.code();
        let mut size_ = size as u32;
        let mut tail = tail_len(size) as u32;
        let mut iters = total;
        let mut cq_mod = a.cq_mod;
        let mut use_signal = u32::from(signal);
        let mut use_inline = u32::from(inline);
        let mut duration_ns = duration.map_or(0, |d| d.as_nanos() as u64);
        let mut counts_ptr = counts.ptr();
        let mut budget = a.wait().as_nanos() as u64;
        let mut out = self.status.ptr();
        let mut rtt_ptr = rtt.ptr();
        let mut params = [
            arg(&mut sides_ptr),
            arg(&mut first),
            arg(&mut in_turn),
            arg(&mut code),
            arg(&mut size_),
            arg(&mut tail),
            arg(&mut iters),
            arg(&mut cq_mod),
            arg(&mut use_signal),
            arg(&mut use_inline),
            arg(&mut duration_ns),
            arg(&mut counts_ptr),
            arg(&mut budget),
            arg(&mut out),
            arg(&mut rtt_ptr),
        ];
        // SAFETY: the parameters match gv_sample_verb_lat's signature, one block per entry of
        // the side array, or one block for both with `in_turn`; the side array, the status
        // words, the counts (32 bytes per side) and the times (`total` entries, the most the
        // kernel writes) are live GPU memory for the whole launch; the NIC addresses in the
        // sides are registered regions of `sides` or the peer's (checked by the device), the
        // GPU addresses (payload, receive buffer, signal and fetch words) mapped host memory
        // or GPU memory of `sides` (alive across the launch), and the descriptors are
        // exported QPs kept alive by `self.exports`.
        unsafe {
            self.gpu.launch_sync(
                "gv_sample_verb_lat",
                (if in_turn != 0 { 1 } else { descs.len() as u32 }, 1, 1),
                (1, 1, 1),
                0,
                &mut params,
            )
        }
        .context("launch gv_sample_verb_lat")?;
        let qpn = |side: usize| {
            ids.iter()
                .position(|&i| i == side)
                .map_or(0, |k| sides[k].qp.qpn())
        };
        self.status.check("gv_sample_verb_lat", qpn)?;
        let w = self.status.words()?;
        if w[5] != 0 {
            bail!(
                "gv_sample_verb_lat: {} of {total} {} (first: iteration {})",
                w[5],
                match verb {
                    Verb::Send => "receives had the wrong byte count",
                    _ => "fetched values differ from what they must be",
                },
                w[6]
            );
        }
        let words = |m: &gpuverbs::gpu::DeviceMem, n: usize| -> Result<Vec<u64>> {
            let mut raw = vec![0u8; 8 * n];
            m.read(0, &mut raw)?;
            Ok(raw
                .chunks_exact(8)
                .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
                .collect())
        };
        // Every side here sent what it acted for; READ and atomics: side A `total`.
        let mut ran = Ran::default();
        for &i in ids {
            ran.sent[i] = Some(0);
        }
        let c = words(&counts, 4 * descs.len())?;
        for (b, &i) in acting.iter().enumerate() {
            let side = ids[i];
            ran.sent[side] = Some(match duration {
                Some(_) => c[4 * b],
                None => u64::from(total),
            });
            if side == 0 && duration.is_some() {
                ran.timed = Some((c[4 * b + 1], c[4 * b + 2]));
            }
        }
        if ids.contains(&0) && duration.is_none() {
            ran.rtt = Some(words(&rtt, total as usize)?);
        }
        Ok(ran)
    }
}
