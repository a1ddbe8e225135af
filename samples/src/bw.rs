//! The bandwidth harness of `put_bw`, `read_bw`, `send_bw` and `atomic_bw` (perftest's
//! `ib_write_bw`, `ib_read_bw`, `ib_send_bw`, `ib_atomic_bw`): one parameterised run, [`main`],
//! with the [`Verb`] of the test. Each binary is one call.
//!
//! ```text
//! put_bw --loopback -a                      # every size, both sides in this process
//! put_bw --loopback -s 1M -q 4 --bidir      # 4 QPs each way
//! put_bw --loopback --scope warp --db proxy --report-gbits
//! put_bw -p 18515        /  put_bw <server> -p 18515     # server / client roles
//! read_bw --loopback -a -o 16               # RDMA READ, 16 outstanding reads per QP
//! send_bw --loopback -a -r 512              # SEND into 512 posted receives per QP
//! atomic_bw --loopback -A CMP_AND_SWAP      # 8-byte compare-and-swap
//! put_bw --loopback -a --initiator gpu --mem gpu --rings gpu   # buffers and rings on the GPU
//! ```
//!
//! The verbs. Job (QP) `j` of direction `d` is driven by side `d` (the initiator; the client
//! is side A, the server side B) against side `1 - d` (the target):
//! - **WRITE** (`put_bw`): the initiator writes source slots into the target's destination
//!   slots; the target checks every byte.
//! - **READ** (`read_bw`): the initiator reads the target's source slots (poisoned, then
//!   filled with the size's pattern before the reads) into its own destination slots, at most
//!   `-o` (`--outs`, perftest's default 16) reads in flight per QP; the initiator checks every
//!   byte it read.
//! - **SEND** (`send_bw`): the target keeps `-r` (`--rx-depth`, perftest's 512) receives
//!   posted per QP, receive `k` into slot `k % D`, and takes each completion (its byte count
//!   checked); the initiator SENDs source slots; the target checks every byte of every slot.
//!   The receives are always posted by a host thread of the target's process, also when the
//!   initiator is the GPU (the kernels post only the SENDs). With `-D` the target reposts
//!   until the sender's duration is over, then takes as many as the sender says it posted (the
//!   step "sent"). Not with `--bidir` (a QP has one poster at a time).
//! - **Atomics** (`atomic_bw`, `-A FETCH_AND_ADD` (default) or `CMP_AND_SWAP`, perftest's
//!   8 bytes): each job has its own 8-byte word at the target, set to a base value of the job
//!   before the warm-up and again before the timed run; iteration `i` adds 1 (FETCH_AND_ADD) or
//!   swaps `base + i` for `base + i + 1` (CMP_AND_SWAP, so every one succeeds); the old value
//!   lands in result slot `i % D` of the initiator. The initiator checks every fetched value
//!   (`base + i`), the target the word's final value (`base + iterations`). At most `-o`
//!   atomics in flight per QP.
//!
//! READ, SEND and the atomics run one poster per QP: the CPU initiator's one thread, or one GPU
//! thread per QP (`--ctas`, `--threads`, `--scope` are WRITE's).
//!
//! Registration cache: `--reg-cache` registers the payload buffers through the PD's
//! registration cache (`Pd::register_cached`), each twice: the first registration is a miss
//! (it registers; "cold"), the second a hit on the same region ("warm"). The header's
//! `Reg cache` line and every JSON row's `"reg_cache"` object report both times (mean over the
//! buffers, and per buffer) with the caches' hits and misses. Without it, buffers are
//! registered with `Pd::register_with` / `Pd::register_device_mem` as before.
//!
//! Placement (GPU initiator only): `--rings gpu` puts the SQ/RQ and CQ rings in GPU memory
//! (`Context::create_cq_on` / `Pd::create_qp_on`); `--mem gpu` puts the source and
//! destination slots in GPU memory registered with `Pd::register_device_mem`, which the host
//! fills, poisons and checks by copying (`DeviceMem::write` / `read`). The CPU initiator
//! refuses both.
//!
//! Server/client roles: the processes meet over TCP (`-p`; the server waits for its client
//! without a limit unless `--timeout` is given, and `-p 0` listens on a port the system picks
//! and prints it), each opens its device (`-d`, GPUVERBS_DEVICE, or the best available: a soft
//! NIC gets a wire port, RoCEv2 over UDP, on the local address that reaches the other,
//! `--wire-port` or `GPUVERBS_SOFTNIC_ADDR`; an rdma-core device such as `mlx5_0` is used as it
//! is, its endpoints carrying its port's RoCE v2 GID, and refuses the soft NIC's `--wire-port`,
//! `--loss` and `--pcap`), both confirm that the other opened one, then they exchange
//! endpoints, parameters and the buffer the peer's WQEs reach (WRITE: the destination, READ:
//! the source, atomics: the words), and connect QP k to QP k. The client is side A (it
//! initiates; the server only answers, unless `--bidir`). Each size runs in steps both sides
//! take together over the TCP connection (warm-up, poison, timed run, validation), so that the
//! checking side poisons after the warm-up and checks after the timed run, and every failure,
//! on either side, ends both runs with its reason. Both print the same row (with `--bidir`, the
//! sum of both directions).
//!
//! What one size does:
//! 1. The sources get a fresh pattern: `S` slots of `size` bytes, each its own bytes
//!    ([`crate::pattern`]); iteration `i` of job (QP) `j` uses slot `(i + j) % S`.
//! 2. Warm-up iterations run untimed.
//! 3. The destinations are poisoned: every slot gets the complement of what it must end with.
//! 4. The timed iterations run. Iteration `i` of a job lands in destination slot `i % D`; a job
//!    has `D` slots (`D` >= the iterations when they fit in 16 MiB, else as many as fit), and
//!    `S` does not divide `D`, so two messages into one slot always carry different bytes. With
//!    the GPU initiator every thread of the grid is a worker of one QP and owns the slots `i % D`
//!    of its iterations, so every slot has one writer, in order.
//! 5. The checking side checks every byte of every destination slot: the bytes of the last
//!    message into it (or, for a slot nobody writes, the poison). The plan is a function of the
//!    options and of each job's workers, so a checker in another process knows what every slot
//!    must hold.
//!
//! Timing: GPU initiator — average from CUDA events around the launch, peak from the kernel's
//! own run (%globaltimer, first CTA start to last CTA end after its quiet). CPU initiator —
//! average from the first post to the last completion, peak the best rate over windows of
//! completions (at least `--cq-mod` messages and a sixteenth of the run), sampled once per
//! polling pass ([`crate::Peak`]). MB/sec is 2^20 bytes per second, Gb/sec 10^9 bits (as
//! perftest does); the peak is never shown below the average. With `--bidir` the numbers are
//! the sum of both directions. Exit status: 0 when every size ran and validated; 1 on a
//! validation failure, an error completion (printed decoded), a lost peer, or any other error;
//! 2 on bad arguments.

use crate::{
    address_lines_of, arg, check_placement, common_header, common_json, connect_options,
    connect_pair, cpu_ring_mode, create_qp, create_qp_rq, doorbell_line, exit_with, merge,
    mtu_line, open_env, open_env_remote, output_number, pattern, remote_header, remote_json, step,
    table_row, tx_depth_for, upload, wire_counters, wire_delta, with_mtu, AddrFormat, BwJob,
    CommonArgs, CpuSample, Exports, GpuStatus, Header, Initiator, OtherCpu, OutputArg, Payload,
    Peak, Peer, Progress, QpSpec, Units, UserIdle,
};
use anyhow::{bail, Context as _, Result};
use clap::{CommandFactory, Parser, ValueEnum};
use gpuverbs::gpu::Gpu;
use gpuverbs::{Access, CachedMr, Endpoint, Mr, Qp, RemoteMemory};
use prm::wqe::{CtrlFlags, Local, Op, RemoteAddr, Sge};
use prm::{Completion, Lkey, Rkey};
use serde_json::{json, Value};
use softnic::initiator::{InitiatorError, RingMode};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// perftest's `-A`: the atomic operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AtomicOp {
    /// 8-byte fetch-and-add (perftest's default).
    #[value(name = "FETCH_AND_ADD")]
    FetchAdd,
    /// 8-byte compare-and-swap.
    #[value(name = "CMP_AND_SWAP")]
    CmpSwap,
}

impl AtomicOp {
    /// perftest's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::FetchAdd => "FETCH_AND_ADD",
            Self::CmpSwap => "CMP_AND_SWAP",
        }
    }
}

/// The operation a test measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// RDMA WRITE (`put_bw`, `write_lat`).
    Write,
    /// RDMA READ (`read_bw`, `read_lat`).
    Read,
    /// SEND into posted receives (`send_bw`, `send_lat`).
    Send,
    /// An 8-byte atomic (`atomic_bw`, `atomic_lat`; `-A` chooses which).
    Atomic(AtomicOp),
}

impl Verb {
    /// The verb a binary of `self` runs: an atomic's kind as `-A` chose it.
    pub fn chosen(self, atomic: Option<AtomicOp>) -> Self {
        match (self, atomic) {
            (Self::Atomic(_), Some(op)) => Self::Atomic(op),
            (v, _) => v,
        }
    }

    /// The kernels' code of the verb (`gv_sample_verb_bw`, `gv_sample_verb_lat`).
    pub fn code(self) -> u32 {
        match self {
            Self::Write => 0,
            Self::Read => 1,
            Self::Send => 2,
            Self::Atomic(AtomicOp::FetchAdd) => 3,
            Self::Atomic(AtomicOp::CmpSwap) => 4,
        }
    }

    /// perftest's name of the verb in its titles ("RDMA_Write", "Send", "Atomic FETCH_AND_ADD").
    pub fn title(self) -> String {
        match self {
            Self::Write => "RDMA_Write".into(),
            Self::Read => "RDMA_Read".into(),
            Self::Send => "Send".into(),
            Self::Atomic(op) => format!("Atomic {}", op.name()),
        }
    }

    /// Whether `-o` (outstanding reads / atomics) applies.
    pub fn has_outs(self) -> bool {
        matches!(self, Self::Read | Self::Atomic(_))
    }

    /// Whether `-I` (inline) applies.
    pub fn has_inline(self) -> bool {
        matches!(self, Self::Write | Self::Send)
    }

    /// The format of perftest's address lines for this verb.
    pub fn addr_format(self, outs: u32) -> AddrFormat {
        match self {
            Self::Write => AddrFormat::Rdma,
            Self::Read => AddrFormat::Read { outs },
            Self::Send | Self::Atomic(_) => AddrFormat::Basic,
        }
    }
}

/// The 8-byte word an atomic job starts from (job `j`): all bytes of the results and the word
/// change from one iteration's value to the poison (the complement). `gv_sample_verb_bw` and
/// `gv_sample_verb_lat` compute the same (`samples::atomic_base`).
pub fn atomic_base(j: u64) -> u64 {
    0x0123_4567_0000_0000 ^ ((j + 1) << 40)
}

/// The old value iteration `i` of an atomic job fetches (one poster per QP, in order; add 1 or
/// swap `base + i` for `base + i + 1`), and so the word's value after `i` iterations.
pub fn atomic_value(j: u64, i: u64) -> u64 {
    atomic_base(j).wrapping_add(i)
}

/// Default bytes per job and size: larger sizes get fewer iterations.
const BYTES_PER_SIZE: u64 = 1 << 30;
/// Fewest default iterations of a size.
const MIN_ITERS: u32 = 64;
/// Destination bytes per job before slots are reused.
const DST_CAP: u64 = 16 << 20;
/// Source bytes (per direction) before fewer source slots are used.
const SRC_CAP: u64 = 64 << 20;
/// Byte of destination slots that no iteration writes.
const UNTOUCHED: u8 = 0xa5;
/// perftest's `-o` default (the device's maximum under `gpuverbs emu`).
const DEFAULT_OUTS: u32 = 16;
/// perftest's `-r` default.
const DEFAULT_RX_DEPTH: u32 = 512;

/// What a test is called and defaults to.
#[derive(Clone, Copy, Debug)]
struct Test {
    verb: Verb,
    /// The binary's name.
    name: &'static str,
    /// Default size (perftest's).
    default_size: u64,
    /// Default iterations of small sizes (perftest's: 5000 for ib_write_bw, 1000 otherwise).
    default_iters: u32,
}

impl Test {
    fn of(verb: Verb) -> Self {
        let (name, default_size, default_iters) = match verb {
            Verb::Write => ("put_bw", 65536, 5000),
            Verb::Read => ("read_bw", 65536, 1000),
            Verb::Send => ("send_bw", 65536, 1000),
            Verb::Atomic(_) => ("atomic_bw", 8, 1000),
        };
        Self {
            verb,
            name,
            default_size,
            default_iters,
        }
    }
}

/// How GPU threads post.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Scope {
    /// Each thread posts its own WQEs (`put`), `-l` (`--post_list`) per doorbell.
    Thread,
    /// The lanes of a warp post together (`put_warp`): one reservation and doorbell per call.
    Warp,
    /// The threads of a block post together (`put_block`): one doorbell per call.
    Block,
}

impl Scope {
    fn code(self) -> u32 {
        match self {
            Self::Thread => 0,
            Self::Warp => 1,
            Self::Block => 2,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Self::Thread => "thread",
            Self::Warp => "warp",
            Self::Block => "block",
        }
    }
}

/// Failures made on purpose (tests of the error paths).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Inject {
    /// The timed WQEs use a wrong rkey: the device answers with REMOTE_ACCESS error CQEs (a
    /// SEND, which has no rkey, is not affected).
    BadRkey,
    /// A bit of a destination byte is flipped after the run: validation must fail.
    Corrupt,
}

#[derive(Parser, Debug)]
#[command(
    name = "put_bw",
    version,
    about = "RDMA WRITE bandwidth, posted by CUDA kernels (or the CPU), perftest style",
    long_about = "RDMA WRITE bandwidth, posted by CUDA kernels (or the CPU), perftest style \
                  (ib_write_bw's table). Every byte that arrives is checked.\n\n\
                  Roles: `put_bw --loopback` runs both sides in this process; `put_bw` (server) \
                  and `put_bw SERVER` (client) meet over TCP on -p, each opens its device (-d: \
                  a soft NIC gets a UDP wire port, RoCEv2, on the address that reaches the \
                  other; an rdma-core device such as mlx5_0 sends from its own port), and the \
                  client \
                  writes into the server's memory (with --bidir both write); the receiver checks \
                  every byte after each size and reports to the sender, so both exit non-zero \
                  on a failure. --loss PCT (soft NIC) drops datagrams on purpose.\n\n\
                  Default iterations per size and QP: 5000, or 1 GiB worth when less (at least \
                  64); warm-up about a tenth (at most 500)."
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// Number of QPs (in each direction).
    #[arg(short = 'q', long, default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    qps: u32,
    /// Both sides initiate at once; the numbers are the sum of both directions.
    #[arg(short = 'b', long, alias = "bidirectional")]
    bidir: bool,
    /// Report Gb/sec (10^9 bits) instead of MB/sec (2^20 bytes).
    #[arg(long, alias = "report_gbits")]
    report_gbits: bool,
    /// GPU, WRITE: CTAs (thread blocks); CTA c drives QP c % QPs [default: one per QP].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65535))]
    ctas: Option<u32>,
    /// GPU, WRITE: threads per CTA [default: 1 for thread scope, 32 for warp, 128 for block].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// GPU, WRITE: who posts together [default: thread].
    #[arg(long, value_enum)]
    scope: Option<Scope>,
    /// perftest's -l (--post_list): WQEs per doorbell, perftest's default 1 (thread scope and
    /// CPU; a warp or block call rings once for its WQEs). --batch is the older spelling.
    #[arg(short = 'l', long = "post_list", alias = "batch", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    post_list: u32,
    /// perftest's -I (--inline_size): messages of at most this many bytes travel inside their
    /// WQEs (an inline data segment) instead of being gathered from the source buffer;
    /// perftest's default for ib_write_bw and ib_send_bw, 0, posts none inline. WRITE and SEND
    /// only; with the GPU initiator at thread scope (the kernels' put_inline / send_inline).
    #[arg(short = 'I', long = "inline_size", value_name = "BYTES", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=MAX_INLINE as i64))]
    inline_size: u32,
    /// perftest's -D (--duration): run each size's timed part for this many seconds instead of
    /// a number of iterations (the table reports the iterations done); not with -a or -n (as
    /// perftest).
    #[arg(short = 'D', long = "duration", value_name = "SECONDS",
          conflicts_with_all = ["iters", "all"],
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    duration: Option<u32>,
    /// perftest's --cpu_util: a CPU_Util[%] column, the machine's user time over user + idle
    /// time during the timed run (/proc/stat, as perftest computes it). Duration mode (-D)
    /// only: without it perftest warns and reports none, and so does this test.
    #[arg(long = "cpu_util")]
    cpu_util: bool,
    /// perftest's -o (--outs), READ and atomics: at most this many reads or atomics in flight
    /// per QP [default: 16, the device's maximum under perftest].
    #[arg(short = 'o', long = "outs", value_name = "NUM",
          value_parser = clap::value_parser!(u32).range(1..=256))]
    outs: Option<u32>,
    /// perftest's -r (--rx-depth), SEND: receives kept posted per QP [default: 512, perftest's].
    #[arg(short = 'r', long = "rx-depth", value_name = "DEPTH",
          value_parser = clap::value_parser!(u32).range(1..=8192))]
    rx_depth: Option<u32>,
    /// perftest's -A (--atomic_type), atomics: FETCH_AND_ADD (default) or CMP_AND_SWAP.
    #[arg(short = 'A', long = "atomic_type", value_enum, value_name = "TYPE")]
    atomic_type: Option<AtomicOp>,
    /// Register the payload buffers through the PD's registration cache, and report the
    /// cold (first: a miss) and warm (again: a hit) registration times.
    #[arg(long)]
    reg_cache: bool,
    /// Make the run fail on purpose (tests).
    #[arg(long, value_enum, hide = true)]
    inject: Option<Inject>,
}

/// Largest `-I` (the QPs' inline limit).
const MAX_INLINE: u32 = 256;
/// What `-D` gives a size as its iterations before the run: the layout of the destinations
/// (as many slots as fit) and the most a flow may post.
const DURATION_ITERS: u32 = u32::MAX - 1;

impl Args {
    /// The options the CPU initiator has and the kernels do not.
    fn gpu_only_options(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.ctas.is_some() {
            v.push("--ctas");
        }
        if self.threads.is_some() {
            v.push("--threads");
        }
        if self.scope.is_some() {
            v.push("--scope");
        }
        v
    }

    /// `-o` as it applies (the default where the verb has it, else 0).
    fn outs(&self, verb: Verb) -> u32 {
        if verb.has_outs() {
            self.outs.unwrap_or(DEFAULT_OUTS)
        } else {
            0
        }
    }
}

/// The command line of `test`: its name, its about text, and the options of other verbs
/// hidden.
fn command(t: &Test) -> clap::Command {
    let v = t.verb;
    let what = match v {
        Verb::Write => "RDMA WRITE",
        Verb::Read => "RDMA READ",
        Verb::Send => "SEND",
        Verb::Atomic(_) => "8-byte atomic (FETCH_AND_ADD or CMP_AND_SWAP, -A)",
    };
    let mut c = Args::command().name(t.name).bin_name(t.name);
    if v != Verb::Write {
        let perftest = match v {
            Verb::Read => "ib_read_bw",
            Verb::Send => "ib_send_bw",
            _ => "ib_atomic_bw",
        };
        let about =
            format!("{what} bandwidth, posted by CUDA kernels (or the CPU), perftest style");
        c = c.about(about.clone()).long_about(format!(
            "{about} ({perftest}'s table). Every byte (every atomic result) is checked.\n\n\
             Roles: `{n} --loopback` runs both sides in this process; `{n}` (server) and `{n} \
             SERVER` (client) meet over TCP on -p; the client initiates (with --bidir both \
             do), and the checking side reports to the other, so both exit non-zero on a \
             failure.\n\n\
             Default iterations per size and QP: {i}, or 1 GiB worth when less (at least 64); \
             warm-up about a tenth (at most 500).",
            n = t.name,
            i = t.default_iters
        ));
        for id in ["ctas", "threads", "scope"] {
            c = c.mut_arg(id, |a| a.hide(true));
        }
    }
    if !v.has_outs() {
        c = c.mut_arg("outs", |a| a.hide(true));
    }
    if v != Verb::Send {
        c = c.mut_arg("rx_depth", |a| a.hide(true));
    }
    if !matches!(v, Verb::Atomic(_)) {
        c = c.mut_arg("atomic_type", |a| a.hide(true));
    }
    if !v.has_inline() {
        c = c.mut_arg("inline_size", |a| a.hide(true));
    }
    c
}

/// Runs the bandwidth test of `verb` (for an atomic, `-A` may choose the other one) with the
/// process's arguments; the binaries' `main`.
pub fn main(verb: Verb) -> std::process::ExitCode {
    let t0 = Test::of(verb);
    let mut cmd = command(&t0);
    let mut args: Args = crate::args::parse_or_exit(&mut cmd);
    let verb = verb.chosen(args.atomic_type);
    let t = Test { verb, ..t0 };
    let usage = |cmd: &mut clap::Command, msg: String| -> ! {
        cmd.error(clap::error::ErrorKind::ArgumentConflict, msg)
            .exit()
    };
    // Options of other verbs are usage errors.
    let mut foreign = Vec::new();
    if args.outs.is_some() && !verb.has_outs() {
        foreign.push("-o (--outs): READ and atomics");
    }
    if args.rx_depth.is_some() && verb != Verb::Send {
        foreign.push("-r (--rx-depth): SEND");
    }
    if args.atomic_type.is_some() && !matches!(verb, Verb::Atomic(_)) {
        foreign.push("-A (--atomic_type): atomics");
    }
    if args.inline_size > 0 && !verb.has_inline() {
        foreign.push("-I (--inline_size): WRITE and SEND");
    }
    if verb != Verb::Write && !args.gpu_only_options().is_empty() {
        foreign.push(
            "--ctas, --threads, --scope: WRITE (the other verbs post with one thread per QP)",
        );
    }
    if verb == Verb::Send && args.bidir {
        foreign.push(
            "--bidir: not SEND (a QP that sends and receives would need two posters at once)",
        );
    }
    if let Verb::Atomic(_) = verb {
        if args.common.all || args.common.size.is_some_and(|s| s != 8) {
            foreign.push("-a, -s other than 8: not atomics (8 bytes each, as perftest's)");
        }
    }
    if !foreign.is_empty() {
        usage(
            &mut cmd,
            format!("{} does not take: {}", t.name, foreign.join("; ")),
        );
    }
    if let Err(e) = args.common.resolve() {
        return exit_with(t.name, Err(e));
    }
    if args.common.output == Some(OutputArg::Latency) {
        return exit_with(
            t.name,
            Err(anyhow::anyhow!(
                "--output latency: {}'s output can be bandwidth or message_rate (as perftest's \
                 BW tests')",
                t.name
            )),
        );
    }
    if args.inline_size > 0 && matches!(args.scope, Some(Scope::Warp | Scope::Block)) {
        usage(
            &mut cmd,
            "-I needs --scope thread (put_warp and put_block post gather WQEs)".into(),
        );
    }
    // Conflicts visible in the arguments alone are usage errors (exit code 2).
    if args.common.initiator == Some(Initiator::Cpu) {
        let gpu_only = args.gpu_only_options();
        if !gpu_only.is_empty() {
            usage(
                &mut cmd,
                format!(
                    "{} {} --initiator gpu",
                    gpu_only.join(", "),
                    needs(&gpu_only)
                ),
            );
        }
        if args.common.db == crate::DbArg::Proxy {
            usage(
                &mut cmd,
                "--db proxy needs --initiator gpu (the CPU initiator rings its own doorbells)"
                    .into(),
            );
        }
    }
    exit_with(t.name, run(&args, &t))
}

/// "needs" or "need", for a list of options.
fn needs(options: &[&str]) -> &'static str {
    if options.len() == 1 {
        "needs"
    } else {
        "need"
    }
}

/// Iterations and warm-up of a size (with `-D`, [`DURATION_ITERS`] and the warm-up of the
/// default count).
fn iterations(t: &Test, a: &CommonArgs, size: u64, duration: bool) -> (u32, u32) {
    let default = (BYTES_PER_SIZE / size).clamp(MIN_ITERS as u64, t.default_iters as u64) as u32;
    let iters = a.iters.unwrap_or(default);
    let warmup = a.warmup.unwrap_or((iters / 10).clamp(1, 500));
    if duration {
        return (DURATION_ITERS, warmup);
    }
    (iters, warmup)
}

/// One QP's work: direction 0 is A → B, 1 is B → A (with --bidir).
#[derive(Clone, Copy, Debug)]
struct Job {
    dir: usize,
    /// QP index within its side.
    k: usize,
    /// Threads that drive it (1 for the CPU).
    workers: u32,
}

impl Job {
    /// The side that holds the job's destination slots and checks them: the target of a WRITE
    /// or SEND, the initiator of a READ or an atomic.
    fn check_side(&self, verb: Verb) -> usize {
        match verb {
            Verb::Write | Verb::Send => 1 - self.dir,
            Verb::Read | Verb::Atomic(_) => self.dir,
        }
    }

    /// The side whose source slots the job's messages carry (`None` for an atomic).
    fn data_side(&self, verb: Verb) -> Option<usize> {
        match verb {
            Verb::Write | Verb::Send => Some(self.dir),
            Verb::Read => Some(1 - self.dir),
            Verb::Atomic(_) => None,
        }
    }
}

/// The layout of one size.
#[derive(Clone, Debug)]
struct Plan {
    size: u64,
    iters: u32,
    warmup: u32,
    /// Destination slots of each job.
    dst_slots: Vec<u32>,
    /// Byte offset of each job's slots in its receiver's destination buffer.
    dst_off: Vec<u64>,
    /// Source slots (shared by the jobs of a direction).
    src_slots: u32,
    /// Destination bytes each checking side needs.
    dst_len: [u64; 2],
}

impl Plan {
    fn new(jobs: &[Job], verb: Verb, size: u64, iters: u32, warmup: u32) -> Self {
        let mut dst_slots = Vec::with_capacity(jobs.len());
        let mut dst_off = Vec::with_capacity(jobs.len());
        let mut dst_len = [0u64; 2];
        let most = iters.max(warmup) as u64;
        for j in jobs {
            let w = j.workers as u64;
            let fit = (DST_CAP / (w * size)).max(1);
            let per_worker = most.div_ceil(w).clamp(1, fit);
            let d = (w * per_worker) as u32;
            let c = j.check_side(verb);
            dst_off.push(dst_len[c]);
            dst_len[c] += d as u64 * size;
            dst_slots.push(d);
        }
        // Two consecutive writes into a slot (iterations i and i + D) read sources i and i + D
        // modulo S: they differ when S does not divide D. S = D + 1 gives every iteration of a
        // pass its own bytes; large sizes take fewer sources (the largest S that still divides
        // no D).
        let dmax = dst_slots.iter().copied().max().unwrap_or(1);
        let cap = ((SRC_CAP / size).min(u32::MAX as u64) as u32)
            .max(3)
            .min(dmax + 1);
        let src_slots = (2..=cap)
            .rev()
            .find(|s| dst_slots.iter().all(|d| d % s != 0))
            .unwrap_or(dmax + 1);
        Self {
            size,
            iters,
            warmup,
            dst_slots,
            dst_off,
            src_slots,
            dst_len,
        }
    }

    /// The source slot whose bytes destination slot `r` of job `j` ends with after `iters`
    /// iterations, or `None` when no iteration writes it.
    fn expected(&self, j: usize, r: u32, iters: u32) -> Option<u64> {
        self.last(j, r, iters)
            .map(|last| (last + j as u64) % self.src_slots as u64)
    }

    /// The last of `iters` iterations of job `j` that lands in its slot `r` (`None`: none).
    fn last(&self, j: usize, r: u32, iters: u32) -> Option<u64> {
        let d = self.dst_slots[j] as u64;
        let r = r as u64;
        if r >= iters as u64 {
            return None;
        }
        Some(r + d * ((iters as u64 - 1 - r) / d))
    }

    /// What destination slot `r` of job `j` holds after `iters` iterations, into `scratch`
    /// (`false`: no iteration lands there): the bytes of its source slot, or for an atomic the
    /// 8 bytes of the old value the last iteration into it fetched.
    fn fill_expected(
        &self,
        verb: Verb,
        j: usize,
        r: u32,
        iters: u32,
        seed: u64,
        scratch: &mut Vec<u8>,
    ) -> bool {
        match verb {
            Verb::Atomic(_) => match self.last(j, r, iters) {
                Some(i) => {
                    scratch.clear();
                    scratch.extend_from_slice(&atomic_value(j as u64, i).to_ne_bytes());
                    true
                }
                None => false,
            },
            _ => match self.expected(j, r, iters) {
                Some(s) => {
                    pattern::fill(scratch, seed, s, self.size as usize);
                    true
                }
                None => false,
            },
        }
    }
}

/// One side: its QPs, its source and destination buffers.
struct Side {
    qps: Vec<Qp>,
    /// Source slots (the messages' bytes).
    src: Option<(Payload, Reg)>,
    /// Destination slots (what this side checks).
    dst: Option<(Payload, Reg)>,
    /// Atomics: the words the peer's jobs work on (word `j` for job `j`).
    words: Option<(Payload, Reg)>,
}

/// A buffer's region: registered directly, or held from the PD's registration cache.
enum Reg {
    Plain(Mr),
    Cached(CachedMr),
}

impl std::ops::Deref for Reg {
    type Target = Mr;
    fn deref(&self) -> &Mr {
        match self {
            Reg::Plain(m) => m,
            Reg::Cached(c) => c,
        }
    }
}

/// One buffer's cold and warm registration through the cache (`--reg-cache`).
struct RegTiming {
    side: &'static str,
    buffer: &'static str,
    bytes: usize,
    cold_ns: u64,
    warm_ns: u64,
}

/// Registers `b`: directly, or (with `timings`) twice through the cache, timing both.
fn register(
    b: &Payload,
    pd: &gpuverbs::Pd,
    access: Access,
    timings: Option<(&mut Vec<RegTiming>, &'static str, &'static str, usize)>,
) -> Result<Reg> {
    let Some((timings, side, buffer, bytes)) = timings else {
        return Ok(Reg::Plain(b.register(pd, access)?));
    };
    let ns = |t: Instant| u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
    let t = Instant::now();
    let first = b.register_cached(pd, access)?;
    let cold_ns = ns(t);
    let t = Instant::now();
    let again = b.register_cached(pd, access)?;
    let warm_ns = ns(t);
    if again.lkey() != first.lkey() {
        bail!("the registration cache gave another region for the same buffer");
    }
    timings.push(RegTiming {
        side,
        buffer,
        bytes,
        cold_ns,
        warm_ns,
    });
    Ok(Reg::Cached(first))
}

/// Cold and warm times of the cached registrations and the caches' counters, as the header
/// line and the JSON object `"reg_cache"`.
fn reg_cache_report(timings: &[RegTiming], sides: &[Option<Side>; 2]) -> (String, Value) {
    let mean = |f: fn(&RegTiming) -> u64| {
        let n = timings.len().max(1) as u64;
        timings.iter().map(f).sum::<u64>() / n
    };
    let (cold, warm) = (mean(|t| t.cold_ns), mean(|t| t.warm_ns));
    let (mut hits, mut misses) = (0, 0);
    for sd in sides.iter().flatten() {
        let st = sd.qps[0].pd().reg_cache().stats();
        hits += st.hits;
        misses += st.misses;
    }
    let us = |ns: u64| ns as f64 / 1e3;
    let line = format!(
        "on: cold {:.1} us, warm {:.2} us (mean of {} buffer(s); hits {hits}, misses {misses})",
        us(cold),
        us(warm),
        timings.len()
    );
    let buffers: Vec<Value> = timings
        .iter()
        .map(|t| {
            json!({
                "side": t.side, "buffer": t.buffer, "bytes": t.bytes,
                "cold_ns": t.cold_ns, "warm_ns": t.warm_ns,
            })
        })
        .collect();
    let v = json!({
        "cold_ns": cold, "warm_ns": warm, "hits": hits, "misses": misses, "buffers": buffers,
    });
    (line, v)
}

/// A CPU initiator driving one job.
struct Flow {
    ini: softnic::initiator::Initiator,
    lkey: Lkey,
    /// Local base: source slot 0 (WRITE, SEND) or the job's destination slot 0 (READ, atomics).
    lbase: u64,
    rkey: Rkey,
    /// Remote base: the job's destination slot 0 (WRITE), source slot 0 (READ), the job's word
    /// (atomics).
    rbase: u64,
    /// The job's number (its atomic values).
    job: u64,
    slots: u64,
    shift: u64,
    posted: u32,
    /// Messages whose completion was seen.
    completed: u32,
    since_sig: u32,
    /// Signaled WQEs in flight: the messages each completes.
    pending: VecDeque<u64>,
    /// The source buffer, whose bytes inline WQEs carry (`-I`).
    src_buf: Option<gpuverbs::HostBuffer>,
    /// WQEs posted inline, in the last run.
    inlined: u64,
}

/// How the CPU initiator posts.
#[derive(Clone, Copy, Debug)]
struct CpuOpts {
    /// WQEs per doorbell (`-l`).
    post_list: u32,
    /// Messages of at most this many bytes go inline (`-I`).
    inline_size: u32,
    /// The timed runs' duration (`-D`).
    duration: Option<Duration>,
    /// The verb.
    verb: Verb,
    /// Most WQEs in flight per QP (`-o`; 0: no limit but the SQ).
    outs: u32,
}

/// The WQEs this side's initiator posted inline in the last run (`null` for a side that only
/// receives).
fn own_inline(engine: &Option<Engine>) -> Option<u64> {
    match engine {
        Some(Engine::Cpu(flows, _)) => Some(flows.iter().map(|f| f.inlined).sum()),
        Some(Engine::Gpu(g)) => Some(g.inlined),
        None => None,
    }
}

/// What one side measured of one size (its own jobs); the server/client roles send it to the
/// peer, so that both print the same row.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
struct Measured {
    /// Messages sent.
    msgs: f64,
    /// Seconds from the first post to the last completion.
    secs: f64,
    /// Peak message rate per second, when measured.
    peak_rate: Option<f64>,
    /// Iterations each of this side's QPs ran (with -D: as many as the duration took).
    iters: u32,
}

/// The numbers of a row: the sum over the sides that sent (peak, average, Mpps), and the
/// longest time.
fn combine(ms: &[Measured], size: u64, units: Units) -> (f64, f64, f64, f64) {
    let (mut peak, mut avg, mut mpps, mut secs) = (0.0, 0.0, 0.0, 0.0f64);
    for m in ms {
        let bytes = m.msgs * size as f64;
        let a = units.bw(bytes, m.secs);
        avg += a;
        peak += m
            .peak_rate
            .map_or(a, |r| units.bw(r * size as f64, 1.0))
            .max(a);
        if m.secs > 0.0 {
            mpps += m.msgs / m.secs / 1e6;
        }
        secs = secs.max(m.secs);
    }
    (peak, avg, mpps, secs)
}

fn run(args: &Args, t: &Test) -> Result<()> {
    let a = &args.common;
    let verb = t.verb;
    #[allow(non_snake_case)]
    let TEST = t.name;
    let sizes = a.sizes(t.default_size);
    let outs = args.outs(verb);
    let rx_depth = args.rx_depth.unwrap_or(DEFAULT_RX_DEPTH);
    let dirs = if args.bidir { 2 } else { 1 };
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
    if env.initiator == Initiator::Cpu {
        let gpu_only = args.gpu_only_options();
        if !gpu_only.is_empty() {
            bail!(
                "{} {} the GPU initiator, and this run uses the CPU ({}; GPU: {})",
                gpu_only.join(", "),
                needs(&gpu_only),
                env.initiator_why,
                env.gpu_line
            );
        }
    }
    let ring_mode = match env.initiator {
        Initiator::Cpu => Some(cpu_ring_mode(a.db)?),
        Initiator::Gpu => None,
    };
    check_placement(a, &env)?;

    // Jobs: QP k of side A writes into side B (direction 0) and, with --bidir, QP k of B into A
    // (direction 1). In loopback this process drives them all; across processes each side
    // drives the jobs it sends (the client is A, the server B).
    let me = peer.as_ref().map(Peer::side);
    let qps = args.qps as usize;
    let njobs = qps * dirs;
    let local: Vec<usize> = (0..njobs)
        .filter(|&j| me.is_none_or(|s| j / qps == s))
        .collect();
    let scope = args.scope.unwrap_or(Scope::Thread);
    let threads = args.threads.unwrap_or(match scope {
        Scope::Thread => 1,
        Scope::Warp => 32,
        Scope::Block => 128,
    });
    let ctas = args.ctas.unwrap_or(local.len().max(1) as u32);
    if env.initiator == Initiator::Gpu && !local.is_empty() && (ctas as usize) < local.len() {
        bail!(
            "--ctas {ctas} is fewer than the {} QPs this process drives (--qps{})",
            local.len(),
            if a.loopback { " x directions" } else { "" }
        );
    }
    // Workers of the jobs this process drives: CTA c drives local job c % n.
    let local_workers: Vec<u32> = (0..local.len())
        .map(|i| match env.initiator {
            Initiator::Cpu => 1,
            Initiator::Gpu => {
                let n = local.len();
                let c = ctas as usize / n + usize::from(i < ctas as usize % n);
                (c as u32) * threads
            }
        })
        .collect();

    // SQ size and signaling.
    let (unit, batch_eff) = match (env.initiator, scope) {
        (Initiator::Cpu, _) => (1, args.post_list),
        (Initiator::Gpu, Scope::Thread) => (1, args.post_list),
        (Initiator::Gpu, Scope::Warp) => (threads.min(32), 1),
        (Initiator::Gpu, Scope::Block) => (threads, 1),
    };
    let sig_calls = match outs {
        0 => (a.cq_mod / unit).max(1),
        o => a.cq_mod.min(o),
    };
    let wmax = local_workers.iter().copied().max().unwrap_or(1) as u64;
    // Blocks one QP's posters may leave without a CQE (unsignaled) or unrung.
    // An inline WQE takes ctrl + raddr + the inline header and data, in 64-byte blocks.
    let largest_inline = sizes
        .iter()
        .copied()
        .filter(|&s| s <= args.inline_size as u64)
        .max();
    let wqe_blocks = largest_inline.map_or(1, |s| (36 + s).div_ceil(64));
    let pending = wmax * (sig_calls as u64 + batch_eff as u64) * wqe_blocks + unit as u64;
    let tx = tx_depth_for(a.tx_depth, pending)?;
    let spec = QpSpec {
        tx_depth: tx,
        rings: a.rings,
        db: a.db,
    };

    // QPs: both sides in loopback (one device, a PD each), this side's across processes.
    let mut sides: [Option<Side>; 2] = [None, None];
    for (s, slot) in sides.iter_mut().enumerate() {
        if me.is_none_or(|m| m == s) {
            let pd = env.ctx.alloc_pd();
            // SEND's side B only receives, through a host thread: its rings stay in host memory.
            let spec = match verb {
                Verb::Send if s == 1 => QpSpec {
                    rings: crate::Placement::Host,
                    ..spec
                },
                _ => spec,
            };
            let qps = (0..args.qps)
                .map(|_| match verb {
                    Verb::Send => create_qp_rq(&pd, spec, env.gpu.as_ref(), rx_depth),
                    _ => create_qp(&pd, spec, env.gpu.as_ref()),
                })
                .collect::<Result<Vec<_>>>()?;
            *slot = Some(Side {
                qps,
                src: None,
                dst: None,
                words: None,
            });
        }
    }
    let side = |s: usize| sides[s].as_ref();

    // Connection, and the workers of every job (the peer says how many drive its jobs).
    let mut peer_eps: Vec<Endpoint> = Vec::new();
    let workers: Vec<u32> = match (&mut peer, me) {
        (Some(p), Some(m)) => {
            let params = json!({
                "sizes": sizes, "iters": a.iters, "warmup": a.warmup, "qps": args.qps,
                "bidir": args.bidir, "inject": args.inject.map(|i| format!("{i:?}")),
                "verb": verb.title(), "outs": outs, "rx_depth": rx_depth,
            });
            let mine = side(m)
                .expect("this side")
                .qps
                .iter()
                .map(|q| with_mtu(&q.endpoint(), a.mtu))
                .collect();
            let hello = p.hello(a, TEST, params, mine, json!({ "workers": local_workers }))?;
            let theirs: Vec<u32> = serde_json::from_value(hello.facts["workers"].clone())
                .context("the peer's workers per QP")?;
            if theirs.len() != njobs - local.len() || theirs.contains(&0) {
                bail!(
                    "the peer drives {} QPs with {theirs:?} workers; expected {}",
                    theirs.len(),
                    njobs - local.len()
                );
            }
            for (k, (q, ep)) in side(m)
                .expect("this side")
                .qps
                .iter()
                .zip(&hello.endpoints)
                .enumerate()
            {
                q.connect(&with_mtu(ep, a.mtu), connect_options())
                    .with_context(|| format!("connect QP {k} to the {} ({ep})", p.peer_role))?;
            }
            peer_eps = hello.endpoints;
            let (mut mine_w, mut theirs_w) = (local_workers.iter(), theirs.iter());
            (0..njobs)
                .map(|j| {
                    if j / qps == m {
                        mine_w.next()
                    } else {
                        theirs_w.next()
                    }
                    .copied()
                    .expect("counts checked")
                })
                .collect()
        }
        _ => {
            let (sa, sb) = (side(0).expect("side A"), side(1).expect("side B"));
            for k in 0..qps {
                connect_pair(&sa.qps[k], &sb.qps[k], a.mtu)?;
            }
            local_workers.clone()
        }
    };
    let jobs: Vec<Job> = (0..njobs)
        .map(|j| Job {
            dir: j / qps,
            k: j % qps,
            workers: workers[j],
        })
        .collect();
    // QPN of each job's sender (this process's QP, or the peer's).
    let sender_qpn: Vec<u32> = jobs
        .iter()
        .map(|job| match side(job.dir) {
            Some(s) => s.qps[job.k].qpn(),
            None => peer_eps.get(job.k).map_or(0, Endpoint::qpn),
        })
        .collect();

    // Plans of every size, and the buffers the largest needs.
    let plans: Vec<Plan> = sizes
        .iter()
        .map(|&s| {
            let (n, w) = iterations(t, a, s, args.duration.is_some());
            Plan::new(&jobs, verb, s, n, w)
        })
        .collect();
    let src_len = plans
        .iter()
        .map(|p| p.src_slots as u64 * p.size)
        .max()
        .unwrap_or(0);
    let dst_len = |d: usize| plans.iter().map(|p| p.dst_len[d]).max().unwrap_or(0);
    let mut timings = Vec::new();
    for (s, slot) in sides.iter_mut().enumerate() {
        let Some(sd) = slot else { continue };
        let pd = sd.qps[0].pd().clone();
        let name = ["A", "B"][s];
        if jobs.iter().any(|j| j.data_side(verb) == Some(s)) {
            let len = src_len as usize;
            let b = Payload::new(a.mem, env.gpu.as_ref(), len)?;
            let t = args.reg_cache.then_some((&mut timings, name, "src", len));
            let access = match verb {
                Verb::Read => Access::LOCAL_WRITE | Access::REMOTE_READ,
                _ => Access::LOCAL_WRITE,
            };
            let mr = register(&b, &pd, access, t)?;
            a.check_dmabuf(&mr, "source")?;
            sd.src = Some((b, mr));
        }
        if jobs.iter().any(|j| j.check_side(verb) == s) {
            let len = dst_len(s) as usize;
            let b = Payload::new(a.mem, env.gpu.as_ref(), len)?;
            let t = args.reg_cache.then_some((&mut timings, name, "dst", len));
            let access = match verb {
                Verb::Write => Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                _ => Access::LOCAL_WRITE,
            };
            let mr = register(&b, &pd, access, t)?;
            a.check_dmabuf(&mr, "destination")?;
            sd.dst = Some((b, mr));
        }
        if matches!(verb, Verb::Atomic(_)) && jobs.iter().any(|j| j.dir == 1 - s) {
            let len = 8 * njobs;
            let b = Payload::new(a.mem, env.gpu.as_ref(), len)?;
            let t = args.reg_cache.then_some((&mut timings, name, "words", len));
            let mr = register(&b, &pd, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC, t)?;
            a.check_dmabuf(&mr, "atomic words")?;
            sd.words = Some((b, mr));
        }
    }
    let reg_cache = args.reg_cache.then(|| reg_cache_report(&timings, &sides));
    let side = |s: usize| sides[s].as_ref();
    // The buffer of a side that the peer's WQEs reach: WRITE's destination, READ's source,
    // the atomics' words (SEND: none).
    let reached = |sd| reached_buf(sd, verb);
    // Across processes each side hands out that buffer.
    // The buffer each side's address lines show (perftest's RKey / VAddr): that one, or on a
    // side that is no target its destination or source.
    let shown = |s: usize| -> (u32, u64) {
        side(s)
            .and_then(|sd| reached(sd).or(sd.dst.as_ref()).or(sd.src.as_ref()))
            .map_or((0, 0), |(_, mr)| (mr.rkey().0, mr.addr()))
    };
    let mut peer_shown = (0u32, 0u64);
    let peer_dst: Option<RemoteMemory> = match (&mut peer, me) {
        (Some(p), Some(m)) => {
            let mine = side(m)
                .and_then(reached)
                .map(|(_, mr)| RemoteMemory::export_rkey(mr.addr(), mr.len(), mr.rkey().0))
                .transpose()
                .map(|d| (d, shown(m)))
                .map_err(anyhow::Error::from);
            let (theirs, their_shown): (Option<RemoteMemory>, (u32, u64)) =
                p.step("memory", mine)?;
            peer_shown = their_shown;
            let need = match verb {
                Verb::Write => dst_len(1 - m),
                Verb::Read => src_len,
                Verb::Atomic(_) => 8 * njobs as u64,
                Verb::Send => 0,
            };
            match theirs {
                Some(r) if r.len() < need => bail!(
                    "the {}'s target buffer has {} B, the plan needs {need}",
                    p.peer_role,
                    r.len()
                ),
                None if !local.is_empty() && verb != Verb::Send => {
                    bail!("the {} exported no target buffer", p.peer_role)
                }
                t => t,
            }
        }
        _ => None,
    };
    let initiating: Vec<&Qp> = local
        .iter()
        .map(|&j| &side(jobs[j].dir).expect("a local job's side").qps[jobs[j].k])
        .collect();
    let first_qp = initiating.first().copied().unwrap_or_else(|| {
        &sides
            .iter()
            .flatten()
            .next()
            .expect("one side at least")
            .qps[0]
    });

    // Header.
    let units = if args.report_gbits {
        Units::Gbits
    } else {
        Units::MBytes
    };
    let receives_only = local.is_empty();
    let peer_role = peer.as_ref().map_or("peer", |p| p.peer_role);
    let mut other_cpu = OtherCpu::sample_before_run();
    let mut h = Header::new(format!("{} BW Test ({TEST})", verb.title()));
    common_header(
        &mut h,
        &env,
        a,
        if receives_only {
            format!("none: this side only answers (the {peer_role} posts)")
        } else {
            doorbell_line(first_qp, env.initiator, ring_mode, a.db)
        },
    );
    if let (Some(p), Some(ep)) = (&peer, peer_eps.first()) {
        remote_header(&mut h, a, p, &env.ctx, ep);
    }
    h.line("Number of qps", format!("{} (each direction)", args.qps))
        .line("Bidirectional", if args.bidir { "on" } else { "off" });
    match env.initiator {
        _ if receives_only => h.line(
            "Posting",
            if verb == Verb::Send {
                "receives only, by a host thread"
            } else {
                "none: this side only answers"
            },
        ),
        Initiator::Gpu if verb != Verb::Write => h.line(
            "Posting",
            format!("{ctas} CTA(s) x 1 thread: one thread per QP, one doorbell per WQE"),
        ),
        Initiator::Gpu => h.line(
            "Posting",
            format!(
                "{ctas} CTA(s) x {threads} thread(s), {} scope, {}",
                scope.name(),
                match scope {
                    Scope::Thread => format!("{} WQEs per doorbell per thread", args.post_list),
                    Scope::Warp => "one doorbell per warp call".into(),
                    Scope::Block => "one doorbell per block call".into(),
                }
            ),
        ),
        Initiator::Cpu => h.line(
            "Posting",
            format!("one host thread, {} WQEs per doorbell", args.post_list),
        ),
    };
    if let Some((line, _)) = &reg_cache {
        h.line("Reg cache", line);
    }
    if verb == Verb::Send && (me.is_none() || receives_only) {
        h.line("RX depth", rx_depth);
    }
    h.line("Post List", args.post_list)
        .line("CQ Moderation", a.cq_mod)
        .line("TX depth", format!("{tx} blocks"))
        .line(
            "Mtu",
            mtu_line(a.mtu, &env.ctx, &first_qp.endpoint(), peer_eps.first()),
        )
        .line("GID index", env.ctx.gid_index());
    if verb.has_inline() {
        h.line("Max inline data", format!("{}[B]", args.inline_size));
    }
    if verb.has_outs() {
        h.line("Outstand reads", outs);
    }
    h.line(
        "Iterations",
        match (args.duration, a.iters) {
            (Some(d), _) => format!(
                "as many as {d} s take, per size (-D; the table reports them, all QPs together)"
            ),
            (None, Some(n)) => format!("{n} per size and QP"),
            (None, None) => format!(
                "per size and QP: {}, or {} MiB worth when less (at least {MIN_ITERS})",
                t.default_iters,
                BYTES_PER_SIZE >> 20
            ),
        },
    )
    .line(
        "Validation",
        match (verb, peer.is_some()) {
            (Verb::Atomic(_), false) => {
                "every fetched value and every target word's final value, every size"
            }
            (Verb::Atomic(_), true) => {
                "every fetched value (by the initiator) and every target word's final value (by \
                 the target), every size, each reported to the other side"
            }
            (Verb::Read, true) => {
                "every byte of every destination slot, every size, by the reading side (which \
                 reports to the other)"
            }
            (_, true) => {
                "every byte of every destination slot, every size, by the receiving side (which \
                 reports to the sender)"
            }
            (_, false) => "every byte of every destination slot, every size",
        },
    );
    other_cpu.header(&mut h);
    // perftest reports CPU utilisation in duration mode only (and warns otherwise).
    let cpu_util = args.cpu_util && args.duration.is_some();
    if args.cpu_util && !cpu_util {
        eprintln!("{TEST}: --cpu_util: CPU Utilization works only with Duration mode (-D)");
    }
    let table = !a.json && a.output.is_none();
    if a.output.is_none() {
        h.print(a.json);
        // perftest's address lines: this side's QPs, then the peer's.
        let fmt = verb.addr_format(outs);
        let mut lines = Vec::new();
        let (lside, rside) = match me {
            Some(m) => (m, None),
            None => (0, Some(1)),
        };
        let (lk, lv) = shown(lside);
        for q in &side(lside).expect("this side").qps {
            lines.push(address_lines_of(
                fmt,
                "local",
                &with_mtu(&q.endpoint(), a.mtu),
                lk,
                lv,
            ));
        }
        match rside {
            Some(r) => {
                let (rk, rv) = shown(r);
                for q in &side(r).expect("side B").qps {
                    lines.push(address_lines_of(fmt, "remote", &q.endpoint(), rk, rv));
                }
            }
            None => {
                for ep in &peer_eps {
                    lines.push(address_lines_of(
                        fmt,
                        "remote",
                        ep,
                        peer_shown.0,
                        peer_shown.1,
                    ));
                }
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
        let mut cols = vec![
            ("#bytes".to_string(), 10),
            ("#iterations".to_string(), 14),
            (format!("BW peak[{}]", units.label()), 18),
            (format!("BW average[{}]", units.label()), 20),
            ("MsgRate[Mpps]".to_string(), 0),
        ];
        if cpu_util {
            cols.last_mut().expect("columns").1 = 16;
            cols.push(("CPU_Util[%]".to_string(), 0));
        }
        println!("{}", table_row(&cols));
    }
    let mut base_json = merge(
        common_json(&env, a, first_qp),
        json!({
            "test": TEST, "qps": args.qps, "bidir": args.bidir, "cq_mod": a.cq_mod,
            "tx_depth": tx, "post_list": args.post_list, "bw_unit": units.label(),
            "inline_size": args.inline_size, "duration_s": args.duration,
            "scope": (env.initiator == Initiator::Gpu).then(|| scope.name()),
            "ctas": (env.initiator == Initiator::Gpu).then_some(ctas),
            "threads": (env.initiator == Initiator::Gpu).then_some(threads),
            "verb": verb.title(), "outs": verb.has_outs().then_some(outs),
            "rx_depth": (verb == Verb::Send).then_some(rx_depth),
        }),
    );
    if let (Some(p), Some(ep)) = (&peer, peer_eps.first()) {
        base_json = merge(base_json, remote_json(a, p, &env.ctx, ep));
    }
    if let Some((_, v)) = &reg_cache {
        base_json = merge(base_json, json!({ "reg_cache": v }));
    }

    // The initiators of the jobs this process drives.
    let mut engine = match env.initiator {
        _ if receives_only => None,
        Initiator::Cpu => {
            let mode = ring_mode.expect("CPU ring mode");
            // The source buffer of each flow, for its inline WQEs.
            let srcs = local.iter().map(|&j| {
                side(jobs[j].dir)
                    .and_then(|s| s.src.as_ref())
                    .and_then(|(b, _)| b.host().cloned())
            });
            Some(Engine::Cpu(
                initiating
                    .iter()
                    .zip(srcs)
                    .map(|(q, src)| cpu_flow(q, mode, src))
                    .collect(),
                CpuOpts {
                    post_list: args.post_list,
                    inline_size: args.inline_size,
                    duration: args.duration.map(|d| Duration::from_secs(d.into())),
                    verb,
                    outs,
                },
            ))
        }
        Initiator::Gpu => {
            let gpu = env.gpu.clone().expect("GPU initiator has a GPU");
            let exports = Exports::new(&gpu, &initiating)?;
            let status = GpuStatus::new(&gpu)?;
            let times = gpu.alloc(16 * ctas as usize)?;
            // Each flow's source slot 0 as the kernels see it (inline WQEs copy from it).
            let mut src_dev = Vec::new();
            for &j in &local {
                src_dev.push(match side(jobs[j].dir).and_then(|s| s.src.as_ref()) {
                    Some((b, _)) if verb.has_inline() && args.inline_size > 0 => {
                        b.gpu_addr(&gpu)?
                    }
                    _ => 0,
                });
            }
            Some(Engine::Gpu(Box::new(GpuEngine {
                ctl: gpu.alloc(16)?,
                gpu,
                exports,
                status,
                times,
                ctas,
                threads,
                scope,
                batch: args.post_list,
                sig_calls,
                verb,
                outs,
                inline_size: args.inline_size,
                src_dev,
                duration: args.duration.map(|d| Duration::from_secs(d.into())),
                inlined: 0,
            })))
        }
    };
    let qpns: Vec<u32> = initiating.iter().map(|q| q.qpn()).collect();
    // SEND: the receives of the jobs whose target is here, posted by a host thread.
    let mut receivers: Vec<Receiver> = Vec::new();
    if verb == Verb::Send {
        let mode = cpu_ring_mode(a.db).unwrap_or(RingMode::Doca);
        for (j, job) in jobs.iter().enumerate() {
            let Some(sd) = side(1 - job.dir) else {
                continue;
            };
            let mr = &sd.dst.as_ref().expect("a SEND target has destinations").1;
            let ini = sd.qps[job.k]
                .try_cpu_initiator(mode)
                .context("a host thread posts the receives")?;
            receivers.push(Receiver {
                ini,
                job: j,
                base: mr.addr(),
                lkey: mr.lkey(),
                depth: rx_depth,
                posted: 0,
                taken: 0,
            });
        }
    }

    let mut progress = Progress::new(TEST, plans.len());
    let mut scratch = Vec::new();
    for (n, plan) in plans.iter().enumerate() {
        let seed = pattern::seed(1, plan.size);
        // The seed of a job's bytes: that of the side its sources are on.
        let jseed = |job: &Job| seed ^ job.data_side(verb).unwrap_or(job.dir) as u64;
        // Fresh sources (READ: the target's).
        for (d, sd) in sides.iter().enumerate() {
            if let Some((b, _)) = sd.as_ref().and_then(|s| s.src.as_ref()) {
                for s in 0..plan.src_slots as u64 {
                    pattern::fill(&mut scratch, seed ^ d as u64, s, plan.size as usize);
                    b.write((s * plan.size) as usize, &scratch)?;
                }
            }
        }
        reset_words(&sides, &jobs)?;
        let keys = |bad| Keys::new(&jobs, verb, &local, &sides, peer_dst.as_ref(), bad);
        // Warm-up, untimed (with the right keys: a failing warm-up would hide the injection).
        let warm = if plan.warmup > 0 {
            drive(
                &mut receivers,
                plan,
                plan.warmup,
                a.wait(),
                &mut peer,
                verb == Verb::Send,
                None,
                || match &mut engine {
                    Some(e) => e
                        .run(
                            plan,
                            &jobs,
                            &local,
                            &keys(false),
                            plan.warmup,
                            a,
                            &qpns,
                            false,
                        )
                        .map(|_| ()),
                    None => Ok(()),
                },
            )
        } else {
            Ok(())
        };
        step(&mut peer, "warm-up", warm)?;
        // The checking side poisons its destinations once the warm-up is done (and an atomic's
        // target sets its words back to their base).
        for (j, job) in jobs.iter().enumerate() {
            if let Some(b) = dst_buf(&sides, job, verb) {
                poison(b, verb, plan, j, jseed(job), &mut scratch)?;
            }
        }
        reset_words(&sides, &jobs)?;
        // Before the step that lets the peer start: once it returns the peer's packets may
        // arrive (and be answered) before this thread runs again.
        let wire_before = wire_counters(&env.ctx);
        step(&mut peer, "poisoned", Ok(()))?;
        let cpu = CpuSample::now();
        let util_before = cpu_util.then(UserIdle::now).flatten();
        let mine: Result<Option<Measured>> = drive(
            &mut receivers,
            plan,
            plan.iters,
            a.wait(),
            &mut peer,
            verb == Verb::Send,
            // SEND with -D: the receivers learn the count when the sender is done.
            (verb == Verb::Send && args.duration.is_some())
                .then_some((|m: &Option<Measured>| m.map(|m| m.iters)) as fn(&_) -> _),
            || match &mut engine {
                Some(e) => e
                    .run(
                        plan,
                        &jobs,
                        &local,
                        &keys(args.inject == Some(Inject::BadRkey)),
                        plan.iters,
                        a,
                        &qpns,
                        true,
                    )
                    .map(|t| {
                        Some(Measured {
                            msgs: t.iters as f64 * local.len() as f64,
                            secs: t.total.as_secs_f64(),
                            peak_rate: t.peak_rate,
                            iters: t.iters,
                        })
                    }),
                None => Ok(None),
            },
        );
        let util = util_before.zip(UserIdle::now()).map(|(b, e)| b.util_to(e));
        let own = mine.as_ref().ok().copied().flatten();
        let theirs = step(&mut peer, "timed", mine)?.flatten();
        let others = other_cpu.record(cpu.and_then(CpuSample::others_since));
        // The iterations each job ran (its sender's count: with -D, as the duration took).
        let ran = |dir: usize| -> Result<u32> {
            match me {
                Some(m) if m != dir => theirs.map(|t| t.iters),
                _ => own.map(|t| t.iters),
            }
            .with_context(|| format!("no iteration count for the QPs of side {dir}"))
        };
        let wire = wire_delta(&wire_before, &wire_counters(&env.ctx));
        if args.inject == Some(Inject::Corrupt) {
            if let Some(b) = dst_buf(&sides, &jobs[0], verb) {
                let off = plan.dst_off[0] as usize + plan.size as usize / 2;
                // One flipped bit: a write that arrived corrupted (not the poison).
                let mut x = [0u8];
                b.read(off, &mut x)?;
                b.write(off, &[x[0] ^ 0x01])?;
            }
        }
        // Every byte of the destinations this process holds.
        let mut failure = None;
        for (j, job) in jobs.iter().enumerate() {
            if let Some(w) = words_buf(&sides, job) {
                if let Err(e) = validate_word(w, j, ran(job.dir)?) {
                    failure = Some(format!("QP {:#x} (job {j}): {e}", sender_qpn[j]));
                    break;
                }
            }
            let Some(b) = dst_buf(&sides, job, verb) else {
                continue;
            };
            let done = Plan {
                iters: ran(job.dir)?,
                ..plan.clone()
            };
            if let Err(e) = validate(b, verb, &done, plan.iters, j, jseed(job), &mut scratch) {
                failure = Some(format!("QP {:#x} (job {j}): {e}", sender_qpn[j]));
                break;
            }
        }
        let failure = match &mut peer {
            None => failure,
            Some(p) => {
                let theirs: Option<String> = p.step("validated", Ok(failure.clone()))?;
                let by = |f: String, who: &str| format!("{f} (checked by the {who})");
                failure
                    .map(|f| by(f, p.role))
                    .or_else(|| theirs.map(|f| by(f, p.peer_role)))
            }
        };
        let measured: Vec<Measured> = own.into_iter().chain(theirs).collect();
        let (peak, avg, mpps, secs) = combine(&measured, plan.size, units);
        // perftest's #iterations: one side's iterations times its QPs (with -b, one
        // direction's, as ib_write_bw prints them).
        let iters = measured.first().map_or(0, |m| m.iters);
        let reported = u64::from(iters) * u64::from(args.qps);
        progress.clear();
        if let Some(o) = a.output {
            println!(
                "{}",
                output_number(match o {
                    OutputArg::MessageRate => mpps,
                    _ => avg,
                })
            );
        } else if a.json {
            let mut v = merge(
                base_json.clone(),
                json!({
                    "bytes": plan.size, "iterations": iters, "warmup": plan.warmup,
                    "iterations_reported": reported,
                    "bw_peak": peak, "bw_average": avg, "msg_rate_mpps": mpps,
                    "time_s": secs, "validated": failure.is_none(),
                    "other_cpu_cores": others, "cpu_util_pct": util,
                    "inline_wqes": own_inline(&engine),
                }),
            );
            if peer.is_some() {
                // This side's wire port during the timed run.
                v = merge(v, json!({ "wire": wire }));
            }
            println!("{v}");
        } else {
            let mut cells = vec![
                (plan.size.to_string(), 10),
                (reported.to_string(), 14),
                (format!("{peak:.2}"), 18),
                (format!("{avg:.2}"), 20),
                (format!("{mpps:.6}"), 0),
            ];
            if cpu_util {
                cells.last_mut().expect("cells").1 = 16;
                cells.push((format!("{:.2}", util.unwrap_or(0.0)), 0));
            }
            println!("{}", table_row(&cells));
        }
        if let Some(f) = failure {
            bail!("validation failed at {} B: {f}", plan.size);
        }
        progress.step(n + 1, plan.size);
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

/// The destination buffer of job `job` (the slots its checking side checks), when this
/// process holds it.
fn dst_buf<'a>(sides: &'a [Option<Side>; 2], job: &Job, verb: Verb) -> Option<&'a Payload> {
    sides[job.check_side(verb)]
        .as_ref()
        .and_then(|s| s.dst.as_ref())
        .map(|(b, _)| b)
}

/// The words of the atomic jobs that target a side of this process (word `j` of job `j`).
fn words_buf<'a>(sides: &'a [Option<Side>; 2], job: &Job) -> Option<&'a Payload> {
    sides[1 - job.dir]
        .as_ref()
        .and_then(|s| s.words.as_ref())
        .map(|(b, _)| b)
}

/// Sets the words of the atomic jobs this process's sides are targets of to their base.
fn reset_words(sides: &[Option<Side>; 2], jobs: &[Job]) -> Result<()> {
    for (j, job) in jobs.iter().enumerate() {
        if let Some(w) = words_buf(sides, job) {
            w.write(8 * j, &atomic_base(j as u64).to_ne_bytes())?;
        }
    }
    Ok(())
}

/// Checks the word of atomic job `j` after `iters` iterations.
fn validate_word(w: &Payload, j: usize, iters: u32) -> Result<()> {
    let mut b = [0u8; 8];
    w.read(8 * j, &mut b)?;
    let (got, want) = (u64::from_ne_bytes(b), atomic_value(j as u64, iters as u64));
    if got != want {
        bail!(
            "the target's word is {got:#018x} after {iters} atomics, expected {want:#018x} (base              {:#018x} + {iters})",
            atomic_base(j as u64)
        );
    }
    Ok(())
}

/// The buffer of a side that the peer's WQEs reach: WRITE's destination, READ's source, the
/// atomics' words (SEND: none).
fn reached_buf(sd: &Side, verb: Verb) -> Option<&(Payload, Reg)> {
    match verb {
        Verb::Write => sd.dst.as_ref(),
        Verb::Read => sd.src.as_ref(),
        Verb::Atomic(_) => sd.words.as_ref(),
        Verb::Send => None,
    }
}

/// SEND: the receives of one job, posted and taken by a host thread of the target's process.
struct Receiver {
    ini: softnic::initiator::Initiator,
    /// The job.
    job: usize,
    /// The target's destination buffer (the job's slots from its offset on).
    base: u64,
    lkey: Lkey,
    /// Receives kept posted (`-r`).
    depth: u32,
    posted: u64,
    taken: u64,
}

impl Receiver {
    /// Posts the first receives of a run of `n` messages.
    fn start(&mut self, p: &Plan, n: u32) -> Result<()> {
        self.posted = 0;
        self.taken = 0;
        for _ in 0..self.depth.min(n) {
            self.post(p)?;
        }
        Ok(())
    }

    /// Posts receive `posted`, into slot `posted % D` of the job.
    fn post(&mut self, p: &Plan) -> Result<()> {
        let d = p.dst_slots[self.job] as u64;
        let addr = self.base + p.dst_off[self.job] + (self.posted % d) * p.size;
        self.ini
            .post_recv(&[Sge {
                addr,
                len: p.size as u32,
                lkey: self.lkey,
            }])
            .context("post a receive")?;
        self.posted += 1;
        Ok(())
    }
}

/// Takes the receive completions of a run of `n` messages per job (each one's byte count
/// checked), posting a receive for each until `n` are posted; fails when nothing arrives for
/// `wait`, or soon after `stop` (the sender failed).
fn receive_all(
    rs: &mut [Receiver],
    p: &Plan,
    target: &AtomicU64,
    wait: Duration,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<()> {
    let mut last = Instant::now();
    loop {
        // The messages per job: known before a counted run, set once a timed run of a
        // duration ends (what its sender posted).
        let n = target.load(Ordering::Acquire);
        let mut progress = false;
        let mut all = true;
        for r in rs.iter_mut() {
            while let Some(c) = r.ini.poll_recv() {
                match c {
                    Completion::Resp { byte_cnt, .. } => {
                        if byte_cnt as u64 != p.size {
                            bail!(
                                "job {}: receive {} took {byte_cnt} B, the message has {}",
                                r.job,
                                r.taken,
                                p.size
                            );
                        }
                        r.taken += 1;
                        progress = true;
                        if r.posted < n {
                            r.post(p)?;
                        }
                    }
                    Completion::Error(e) => bail!("a receive completion carries an error: {e}"),
                    other => bail!("unexpected completion on the receive CQ: {other:?}"),
                }
            }
            all &= r.taken >= n;
        }
        if all {
            return Ok(());
        }
        if progress {
            last = Instant::now();
        } else {
            if stop.load(Ordering::Acquire) {
                bail!("the receives stopped: the sender failed");
            }
            if last.elapsed() > wait {
                let got: Vec<u64> = rs.iter().map(|r| r.taken).collect();
                bail!("no receive completion for {wait:?} (received {got:?} of {n} per job)");
            }
            // nothing arrived: sleep until a receive CQE is written (the sender may need
            // this core)
            match rs.iter().find(|r| r.taken < n) {
                Some(r) => r.ini.idle_until_completion(true, Duration::from_millis(1)),
                None => std::thread::yield_now(),
            }
        }
    }
}

/// Runs `run` (the posting of this process's jobs); with SEND, this process's receivers first
/// post their receives (and both processes take the step "posted", so that no SEND starts
/// before its receives are there), then take `n` messages each on a thread of their own while
/// `run` posts. With `sent` (SEND, -D: `n` is not known before) the receivers repost until
/// the run is over, then both processes take the step "sent", which gives the receivers the
/// count the sender posted per job (`sent` of its run's outcome) to take.
#[allow(clippy::too_many_arguments)]
fn drive<T>(
    receivers: &mut [Receiver],
    p: &Plan,
    n: u32,
    wait: Duration,
    peer: &mut Option<Peer>,
    send: bool,
    sent: Option<fn(&T) -> Option<u32>>,
    run: impl FnOnce() -> Result<T>,
) -> Result<T> {
    if send {
        let posted = receivers.iter_mut().try_for_each(|r| r.start(p, n));
        step(peer, "posted", posted)?;
    }
    // The sender's count, when the run was one of a duration (both sides take the step).
    let count = |peer: &mut Option<Peer>, r: &Result<T>| -> Result<Option<u32>> {
        let Some(sent) = sent else { return Ok(None) };
        let mine = match r {
            Ok(t) => Ok(sent(t)),
            Err(e) => Err(anyhow::anyhow!("{}", crate::error_text(e))),
        };
        let own = mine.as_ref().ok().copied().flatten();
        let theirs = step(peer, "sent", mine)?.flatten();
        own.or(theirs)
            .map(Some)
            .context("neither side says how many messages it sent")
    };
    if receivers.is_empty() {
        let r = run();
        count(peer, &r)?;
        return r;
    }
    let target = AtomicU64::new(n.into());
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        let h = sc.spawn(|| receive_all(receivers, p, &target, wait, &stop));
        let r = run();
        let counted = count(peer, &r);
        match counted {
            Ok(Some(c)) => target.store(c.into(), Ordering::Release),
            Ok(None) => {}
            Err(_) => stop.store(true, Ordering::Release),
        }
        let got = h
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the receiving thread panicked")));
        let out = r?;
        counted?;
        got?;
        Ok(out)
    })
}

/// Keys and addresses of the jobs this process drives (in the order of `ids`).
struct Keys {
    lbase: Vec<u64>,
    lkey: Vec<u32>,
    rbase: Vec<u64>,
    rkey: Vec<u32>,
}

impl Keys {
    /// `peer_mem`: the buffer of the peer that the WQEs reach (across processes).
    fn new(
        jobs: &[Job],
        verb: Verb,
        ids: &[usize],
        sides: &[Option<Side>; 2],
        peer_mem: Option<&RemoteMemory>,
        bad_rkey: bool,
    ) -> Self {
        let mut k = Self {
            lbase: vec![],
            lkey: vec![],
            rbase: vec![],
            rkey: vec![],
        };
        for &j in ids {
            let job = &jobs[j];
            let me = sides[job.dir].as_ref().expect("the initiator's side");
            let src = match verb {
                Verb::Write | Verb::Send => &me.src.as_ref().expect("sender has sources").1,
                Verb::Read | Verb::Atomic(_) => {
                    &me.dst.as_ref().expect("initiator has destinations").1
                }
            };
            let (rbase, rkey) = match sides[1 - job.dir].as_ref() {
                Some(s) => {
                    let b = match verb {
                        Verb::Write => s.dst.as_ref(),
                        Verb::Read => s.src.as_ref(),
                        Verb::Atomic(_) => s.words.as_ref(),
                        Verb::Send => None,
                    };
                    b.map_or((0, 0), |(_, mr)| (mr.addr(), mr.rkey().0))
                }
                None => peer_mem.map_or((0, 0), |r| (r.addr(), r.rkey())),
            };
            k.lbase.push(src.addr());
            k.lkey.push(src.lkey().0);
            k.rbase.push(rbase);
            k.rkey.push(rkey ^ if bad_rkey { 0x5a00 } else { 0 });
        }
        k
    }
}

fn cpu_flow(q: &Qp, mode: RingMode, src_buf: Option<gpuverbs::HostBuffer>) -> Flow {
    Flow {
        ini: q.cpu_initiator(mode),
        lkey: Lkey(0),
        lbase: 0,
        rkey: Rkey(0),
        rbase: 0,
        job: 0,
        slots: 1,
        shift: 0,
        posted: 0,
        completed: 0,
        since_sig: 0,
        pending: VecDeque::new(),
        src_buf,
        inlined: 0,
    }
}

/// Fills job `j`'s destination slots with the complement of what they must end with (and the
/// slots no iteration writes with [`UNTOUCHED`]).
fn poison(
    b: &Payload,
    verb: Verb,
    p: &Plan,
    j: usize,
    seed: u64,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let size = p.size as usize;
    for r in 0..p.dst_slots[j] {
        let off = p.dst_off[j] as usize + r as usize * size;
        if p.fill_expected(verb, j, r, p.iters, seed, scratch) {
            scratch.iter_mut().for_each(|x| *x = !*x);
            b.write(off, scratch)?;
        } else {
            b.fill(off, size, UNTOUCHED)?;
        }
    }
    Ok(())
}

/// Checks every byte of job `j`'s destination slots after `p.iters` iterations; `poisoned`:
/// the iterations the poison was made for (with -D more than ran: a slot no iteration wrote
/// still holds the poison of the plan's layout).
#[allow(clippy::too_many_arguments)]
fn validate(
    b: &Payload,
    verb: Verb,
    p: &Plan,
    poisoned: u32,
    j: usize,
    seed: u64,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let size = p.size as usize;
    let mut got = vec![0u8; size];
    for r in 0..p.dst_slots[j] {
        let off = p.dst_off[j] as usize + r as usize * size;
        b.read(off, &mut got)?;
        if p.fill_expected(verb, j, r, p.iters, seed, scratch) {
            if let Some(o) = pattern::first_difference(&got, scratch) {
                let last = p.last(j, r, p.iters).unwrap_or(0);
                if let Verb::Atomic(op) = verb {
                    bail!(
                        "result slot {r}: iteration {last}'s {} fetched {:#018x}, expected \
                         {:#018x}",
                        op.name(),
                        u64::from_ne_bytes(got[..8].try_into().expect("8 bytes")),
                        u64::from_ne_bytes(scratch[..8].try_into().expect("8 bytes"))
                    );
                }
                bail!(
                    "destination slot {r} (last written by iteration {last}, source slot {}): \
                     byte {o} is {:#04x}, expected {:#04x} ({})",
                    p.expected(j, r, p.iters).unwrap_or(0),
                    got[o],
                    scratch[o],
                    mismatch(&got, scratch)
                );
            }
        } else {
            {
                let want_poison = p
                    .fill_expected(verb, j, r, poisoned, seed, scratch)
                    .then(|| scratch.iter_mut().for_each(|x| *x = !*x));
                let changed = match want_poison {
                    Some(()) => pattern::first_difference(&got, scratch),
                    None => got.iter().position(|&x| x != UNTOUCHED),
                };
                if let Some(o) = changed {
                    bail!("destination slot {r} is written by no iteration, but byte {o} changed");
                }
            }
        }
    }
    Ok(())
}

/// What a slot that differs from its pattern `want` holds: still the poison everywhere (the
/// write never arrived), the poison where it differs (the write arrived in part), or other
/// bytes (it arrived with wrong bytes).
fn mismatch(got: &[u8], want: &[u8]) -> String {
    let (mut wrong, mut poison) = (0usize, 0usize);
    for (g, w) in got.iter().zip(want) {
        if g != w {
            wrong += 1;
            poison += usize::from(*g == !*w);
        }
    }
    let n = want.len();
    if poison == n {
        "the whole slot still holds the poison: the write never arrived".to_string()
    } else if poison == wrong {
        format!("{wrong} of {n} bytes still hold the poison: the write arrived in part")
    } else {
        format!("{wrong} of {n} bytes differ: the write arrived with wrong bytes")
    }
}

/// What a timed run measured.
struct Timing {
    /// Average: the whole run.
    total: Duration,
    /// Peak message rate per second, when measured.
    peak_rate: Option<f64>,
    /// Iterations each job ran.
    iters: u32,
}

struct GpuEngine {
    gpu: Arc<Gpu>,
    exports: Exports,
    status: GpuStatus,
    times: gpuverbs::gpu::DeviceMem,
    /// The duration control words of a timed run with -D (`samples::duration_ctl`).
    ctl: gpuverbs::gpu::DeviceMem,
    ctas: u32,
    threads: u32,
    scope: Scope,
    batch: u32,
    sig_calls: u32,
    verb: Verb,
    outs: u32,
    /// Messages of at most this many bytes go inline (`-I`), copied from `src_dev`.
    inline_size: u32,
    /// Per flow: its source slot 0 as the GPU sees it (WRITE and SEND; 0 otherwise).
    src_dev: Vec<u64>,
    /// The timed runs' duration (`-D`).
    duration: Option<Duration>,
    /// WQEs posted inline, in the last run.
    inlined: u64,
}

enum Engine {
    Cpu(Vec<Flow>, CpuOpts),
    Gpu(Box<GpuEngine>),
}

impl Engine {
    /// Runs `iters` iterations of the jobs `ids` (those this process drives; the flows,
    /// exported QPs, keys and `qpns` are in that order); `timed`: the timed run (with -D it
    /// lasts the duration).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        p: &Plan,
        jobs: &[Job],
        ids: &[usize],
        keys: &Keys,
        iters: u32,
        a: &CommonArgs,
        qpns: &[u32],
        timed: bool,
    ) -> Result<Timing> {
        match self {
            Engine::Cpu(flows, o) => {
                let deadline = o.duration.filter(|_| timed);
                run_cpu(flows, o, deadline, p, ids, keys, iters, a)
            }
            Engine::Gpu(g) => {
                let duration = g.duration.filter(|_| timed);
                g.run(p, jobs, ids, keys, iters, duration, a, qpns)
            }
        }
    }
}

/// Polls without a completion after which the CPU initiator's loop sleeps on the CQ (in one
/// process: spinning is fastest while the engine has a core of its own, sleeping once it
/// does not).
const IDLE_POLLS: u32 = 256;
/// Polls after which the loop sleeps at once when the soft NIC engine of the QP it waits on
/// has not moved meanwhile ([`Initiator::engine_turn`]): the engine is not running, perhaps
/// waiting for this very core, and spinning on would only keep it waiting.
const STALL_POLLS: u32 = 16;

/// The CPU initiator: one host thread, round robin over the jobs, `-l` WQEs per doorbell,
/// one CQE per `--cq-mod` WQEs (and for each job's last), messages of at most `-I` bytes
/// inline. With `duration` (-D) it posts until the duration has passed, then every job up to
/// one more than the most any has posted (that last WQE signaled), and says how many.
#[allow(clippy::too_many_arguments)]
fn run_cpu(
    flows: &mut [Flow],
    o: &CpuOpts,
    duration: Option<Duration>,
    p: &Plan,
    ids: &[usize],
    keys: &Keys,
    iters: u32,
    a: &CommonArgs,
) -> Result<Timing> {
    let size = p.size;
    let verb = o.verb;
    for (i, f) in flows.iter_mut().enumerate() {
        let j = ids[i];
        f.slots = p.dst_slots[j] as u64;
        f.shift = j as u64;
        f.job = j as u64;
        (f.lbase, f.rbase) = match verb {
            Verb::Write => (keys.lbase[i], keys.rbase[i] + p.dst_off[j]),
            Verb::Send => (keys.lbase[i], 0),
            Verb::Read => (keys.lbase[i] + p.dst_off[j], keys.rbase[i]),
            Verb::Atomic(_) => (keys.lbase[i] + p.dst_off[j], keys.rbase[i] + 8 * j as u64),
        };
        f.rkey = Rkey(keys.rkey[i]);
        f.lkey = Lkey(keys.lkey[i]);
        f.posted = 0;
        f.completed = 0;
        f.since_sig = 0;
        f.pending.clear();
        f.inlined = 0;
    }
    let batch = o.post_list;
    // With a limit on reads in flight, a CQE at least every `outs` WQEs (else the limit waits
    // for a completion nobody asked for).
    let sig_every = if o.outs > 0 {
        a.cq_mod.min(o.outs)
    } else {
        a.cq_mod
    };
    let inline = verb.has_inline() && size <= o.inline_size as u64;
    let mut inline_bytes = vec![0u8; if inline { size as usize } else { 0 }];
    // Without -D every job posts `iters`; with it, the count is set when the duration ends.
    let mut target = duration.is_none().then_some(iters);
    let mut total = iters as u64 * flows.len() as u64;
    let mut peak = Peak::with_capacity((total / a.cq_mod as u64 + 8) as usize);
    let mut done = 0u64;
    let start = Instant::now();
    peak.record(start, 0);
    let mut last_progress = start;
    // loop turns without a completion (then the thread sleeps on the CQ), and the engine
    // turn of the QP waited on when they began
    let mut idle = 0u32;
    let mut idle_turn = None;
    while done < total {
        if target.is_none() && duration.is_some_and(|d| start.elapsed() >= d) {
            // One more for every job, so that each ends with a signaled WQE.
            let t = flows.iter().map(|f| f.posted).max().unwrap_or(0) + 1;
            target = Some(t.min(iters));
            total = t.min(iters) as u64 * flows.len() as u64;
        }
        let limit = target.unwrap_or(iters);
        let before = done;
        let mut posted = false;
        for f in flows.iter_mut() {
            let mut n = 0;
            while n < batch && f.posted < limit && (o.outs == 0 || f.posted - f.completed < o.outs)
            {
                let i = f.posted as u64;
                let last = target.is_some_and(|t| f.posted + 1 == t);
                let sig = f.since_sig + 1 >= sig_every || last;
                let slot = ((i + f.shift) % p.src_slots as u64) * size;
                let sge = Sge {
                    addr: f.lbase + slot,
                    len: size as u32,
                    lkey: f.lkey,
                };
                // READ's destination slot, an atomic's result slot.
                let dsge = Sge {
                    addr: f.lbase + (i % f.slots) * size,
                    len: size as u32,
                    lkey: f.lkey,
                };
                let local = if inline {
                    let b = f
                        .src_buf
                        .as_ref()
                        .context("-I: inline WQEs need the source in host memory")?;
                    b.read(slot as usize, &mut inline_bytes);
                    Local::Inline(&inline_bytes)
                } else {
                    Local::Sges(std::slice::from_ref(&sge))
                };
                let op = match verb {
                    Verb::Write => Op::Write {
                        remote: RemoteAddr {
                            addr: f.rbase + (i % f.slots) * size,
                            rkey: f.rkey,
                        },
                        local,
                        imm: None,
                    },
                    Verb::Send => Op::Send { local, imm: None },
                    Verb::Read => Op::Read {
                        remote: RemoteAddr {
                            addr: f.rbase + slot,
                            rkey: f.rkey,
                        },
                        local: std::slice::from_ref(&dsge),
                    },
                    Verb::Atomic(AtomicOp::FetchAdd) => Op::FetchAdd {
                        remote: RemoteAddr {
                            addr: f.rbase,
                            rkey: f.rkey,
                        },
                        add: 1,
                        result: dsge,
                    },
                    Verb::Atomic(AtomicOp::CmpSwap) => Op::CompareSwap {
                        remote: RemoteAddr {
                            addr: f.rbase,
                            rkey: f.rkey,
                        },
                        compare: atomic_value(f.job, i),
                        swap: atomic_value(f.job, i + 1),
                        result: dsge,
                    },
                };
                let flags = if sig {
                    CtrlFlags::SIGNALED
                } else {
                    CtrlFlags::default()
                };
                match f.ini.post(&op, flags) {
                    Ok(_) => {}
                    Err(InitiatorError::SqFull { .. }) => break,
                    Err(e) => return Err(e).with_context(|| format!("post an {}", verb.title())),
                }
                f.posted += 1;
                f.since_sig += 1;
                f.inlined += u64::from(inline);
                n += 1;
                if sig {
                    f.pending.push_back(f.since_sig as u64);
                    f.since_sig = 0;
                }
            }
            if n > 0 {
                f.ini.ring();
                posted = true;
            }
            while let Some(c) = f.ini.poll_send() {
                match c {
                    Completion::Req { .. } => {
                        let m = f
                            .pending
                            .pop_front()
                            .context("a completion for a WQE that asked for none")?;
                        done += m;
                        f.completed += m as u32;
                    }
                    Completion::Error(e) => bail!("a completion carries an error: {e}"),
                    other => bail!("unexpected completion on the send CQ: {other:?}"),
                }
            }
        }
        if done > before {
            last_progress = Instant::now();
            peak.record(last_progress, done);
            idle = 0;
        } else if posted {
            idle = 0;
        } else {
            idle += 1;
            let waited = flows.iter().find(|f| !f.pending.is_empty());
            if idle == 1 {
                idle_turn = waited.and_then(|f| f.ini.engine_turn());
            }
            let stalled = idle > STALL_POLLS
                && idle_turn.is_some()
                && waited.and_then(|f| f.ini.engine_turn()) == idle_turn;
            // Across processes the completions come from this process's device threads (the
            // wire's ACKs); in one process from the engine, which may share a core with this
            // thread when another process is busy. Either way, once a few polls found
            // nothing (or the engine did not run meanwhile), give the core away until a CQE
            // is written.
            if !a.loopback || idle > IDLE_POLLS || stalled {
                match waited {
                    Some(f) => f.ini.idle_until_completion(false, Duration::from_millis(1)),
                    None => std::thread::yield_now(),
                }
            }
        }
        if done == before && last_progress.elapsed() > a.wait() {
            bail!(
                "no completion for {:?} ({done} of {total} {} WQEs completed): the device \
                 stopped answering",
                a.wait(),
                verb.title()
            );
        }
    }
    let total_t = last_progress.duration_since(start);
    let window = (a.cq_mod as u64).max(total / 16);
    Ok(Timing {
        total: total_t,
        peak_rate: peak.best_rate(window),
        iters: target.unwrap_or(iters),
    })
}

impl GpuEngine {
    /// READ, SEND, atomics: `gv_sample_verb_bw`, one thread (one CTA) per job.
    #[allow(clippy::too_many_arguments)]
    fn run_verb(
        &mut self,
        dev_jobs: &gpuverbs::gpu::DeviceMem,
        p: &Plan,
        njobs: usize,
        iters: u32,
        inline: bool,
        duration: Option<Duration>,
        a: &CommonArgs,
        qpns: &[u32],
    ) -> Result<Timing> {
        let mut jobs_ptr = dev_jobs.ptr();
        let mut njobs_ = njobs as u32;
        let mut verb = self.verb.code();
        let mut size = p.size as u32;
        let mut iters_ = iters;
        let mut sig_calls = self.sig_calls;
        let mut outs = self.outs;
        let mut inl = u32::from(inline);
        let (mut ctl, mut duration_ns) = self.arm(duration)?;
        let mut budget = a.wait().as_nanos() as u64;
        let mut out = self.status.ptr();
        let mut times = self.times.ptr();
        let mut params = [
            arg(&mut jobs_ptr),
            arg(&mut njobs_),
            arg(&mut verb),
            arg(&mut size),
            arg(&mut iters_),
            arg(&mut sig_calls),
            arg(&mut outs),
            arg(&mut inl),
            arg(&mut ctl),
            arg(&mut duration_ns),
            arg(&mut budget),
            arg(&mut out),
            arg(&mut times),
        ];
        // SAFETY: the parameters match gv_sample_verb_bw's signature; the job array, the
        // status words, the duration words and the times (16 bytes per CTA, one CTA per job)
        // are live GPU memory for the whole launch; the descriptors are exported QPs kept alive
        // by `self.exports`; the NIC addresses in the jobs are checked by the device against
        // the registered regions, and an inline SEND's source (`src_dev`) is the sender's
        // source buffer (mapped host memory or GPU memory), which outlives the engine.
        let total = unsafe {
            self.gpu.launch_timed(
                "gv_sample_verb_bw",
                (njobs as u32, 1, 1),
                (1, 1, 1),
                0,
                &mut params,
            )
        }
        .context("launch gv_sample_verb_bw")?;
        self.status
            .check("gv_sample_verb_bw", |j| qpns.get(j).copied().unwrap_or(0))?;
        let iters = self.ran(duration, iters)?;
        self.inlined = if inline {
            u64::from(iters) * njobs as u64
        } else {
            0
        };
        let peak = self.peak_rate(njobs as u32, iters as f64 * njobs as f64)?;
        Ok(Timing {
            total,
            peak_rate: peak,
            iters,
        })
    }

    /// The duration words' pointer (cleared) and the duration in ns, for a run of `duration`;
    /// a null pointer for a counted run.
    fn arm(&self, duration: Option<Duration>) -> Result<(u64, u64)> {
        let Some(d) = duration else {
            return Ok((0, 0));
        };
        self.ctl.write(0, &[0u8; 16])?;
        Ok((self.ctl.ptr(), d.as_nanos() as u64))
    }

    /// The iterations every job ran: `iters`, or after a run of a duration one more than the
    /// highest iteration index started (the low 63 bits of the first duration word).
    fn ran(&self, duration: Option<Duration>, iters: u32) -> Result<u32> {
        if duration.is_none() {
            return Ok(iters);
        }
        let mut w = [0u8; 8];
        self.ctl.read(0, &mut w)?;
        let highest = u64::from_ne_bytes(w) & !(1 << 63);
        u32::try_from(highest + 1).context("the duration's iteration count")
    }

    /// The message rate over the kernel's own span: first CTA start to last CTA end.
    fn peak_rate(&self, ctas: u32, msgs: f64) -> Result<Option<f64>> {
        let mut raw = vec![0u8; 16 * ctas as usize];
        self.times.read(0, &mut raw)?;
        let t: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let first = t.iter().step_by(2).min().copied().unwrap_or(0);
        let last = t.iter().skip(1).step_by(2).max().copied().unwrap_or(0);
        let span = last.saturating_sub(first);
        Ok((span > 0).then(|| msgs / (span as f64 / 1e9)))
    }

    /// Runs `iters` iterations of the jobs `ids` (or, with `duration`, as many as it takes).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        p: &Plan,
        jobs: &[Job],
        ids: &[usize],
        keys: &Keys,
        iters: u32,
        duration: Option<Duration>,
        a: &CommonArgs,
        qpns: &[u32],
    ) -> Result<Timing> {
        let inline = self.verb.has_inline() && p.size <= u64::from(self.inline_size);
        let descs: Vec<BwJob> = ids
            .iter()
            .enumerate()
            .map(|(i, &j)| BwJob {
                qp: self.exports.qps[i].ptr(),
                lbase: match self.verb {
                    Verb::Write | Verb::Send => keys.lbase[i],
                    Verb::Read | Verb::Atomic(_) => keys.lbase[i] + p.dst_off[j],
                },
                rbase: match self.verb {
                    Verb::Write => keys.rbase[i] + p.dst_off[j],
                    Verb::Send => 0,
                    Verb::Read => keys.rbase[i],
                    Verb::Atomic(_) => keys.rbase[i] + 8 * j as u64,
                },
                lkey: keys.lkey[i],
                rkey: keys.rkey[i],
                workers: jobs[j].workers,
                dst_slots: p.dst_slots[j],
                src_slots: p.src_slots,
                src_shift: j as u32,
                src_dev: self.src_dev[i],
            })
            .collect();
        let dev_jobs = upload(&self.gpu, &descs)?;
        self.status.reset()?;
        if self.verb != Verb::Write {
            return self.run_verb(&dev_jobs, p, ids.len(), iters, inline, duration, a, qpns);
        }
        let mut jobs_ptr = dev_jobs.ptr();
        let mut njobs = ids.len() as u32;
        let mut size = p.size as u32;
        let mut iters_ = iters;
        let mut scope = self.scope.code();
        let mut batch = self.batch;
        let mut sig_calls = self.sig_calls;
        let mut inl = u32::from(inline);
        let (mut ctl, mut duration_ns) = self.arm(duration)?;
        let mut budget = a.wait().as_nanos() as u64;
        let mut out = self.status.ptr();
        let mut times = self.times.ptr();
        let mut params = [
            arg(&mut jobs_ptr),
            arg(&mut njobs),
            arg(&mut size),
            arg(&mut iters_),
            arg(&mut scope),
            arg(&mut batch),
            arg(&mut sig_calls),
            arg(&mut inl),
            arg(&mut ctl),
            arg(&mut duration_ns),
            arg(&mut budget),
            arg(&mut out),
            arg(&mut times),
        ];
        // SAFETY: the parameters match gv_sample_put_bw's signature; the job array, the status
        // words, the duration words and the times are live GPU memory for the whole launch;
        // the descriptors are exported QPs kept alive by `self.exports`; the NIC addresses in
        // the jobs are checked by the device against the registered regions, and an inline
        // WRITE's source (`src_dev`) is the sender's source buffer (mapped host memory or GPU
        // memory), which outlives the engine.
        let total = unsafe {
            self.gpu.launch_timed(
                "gv_sample_put_bw",
                (self.ctas, 1, 1),
                (self.threads, 1, 1),
                0,
                &mut params,
            )
        }
        .context("launch gv_sample_put_bw")?;
        self.status
            .check("gv_sample_put_bw", |j| qpns.get(j).copied().unwrap_or(0))?;
        let iters = self.ran(duration, iters)?;
        self.inlined = if inline {
            u64::from(iters) * ids.len() as u64
        } else {
            0
        };
        let msgs = iters as f64 * ids.len() as f64;
        Ok(Timing {
            total,
            peak_rate: self.peak_rate(self.ctas, msgs)?,
            iters,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jobs(workers: &[u32], dirs: usize) -> Vec<Job> {
        let per = workers.len() / dirs;
        workers
            .iter()
            .enumerate()
            .map(|(j, &w)| Job {
                dir: j / per,
                k: j % per,
                workers: w,
            })
            .collect()
    }

    /// Simulates a run: each slot ends with the source of its last write.
    fn check_plan(p: &Plan, jobs: &[Job]) {
        for (j, job) in jobs.iter().enumerate() {
            let d = p.dst_slots[j];
            assert_eq!(d % job.workers, 0, "{p:?}");
            assert!(d as u64 * p.size <= (DST_CAP).max(job.workers as u64 * p.size));
            let mut last = vec![None; d as usize];
            for i in 0..p.iters as u64 {
                let slot = (i % d as u64) as usize;
                let src = (i + j as u64) % p.src_slots as u64;
                if let Some(prev) = last[slot] {
                    assert_ne!(
                        prev, src,
                        "two writes into slot {slot} carry the same bytes"
                    );
                }
                last[slot] = Some(src);
            }
            for r in 0..d {
                assert_eq!(p.expected(j, r, p.iters), last[r as usize], "slot {r}");
            }
        }
        assert!(p.src_slots as u64 * p.size <= SRC_CAP.max(3 * p.size) || p.src_slots == 2);
    }

    #[test]
    fn plans_give_each_slot_one_writer_and_distinct_consecutive_bytes() {
        for (workers, dirs) in [
            (vec![1], 1),
            (vec![1, 1, 1, 1], 2),
            (vec![32, 32], 1),
            (vec![256, 128, 128], 1),
            (vec![128], 1),
        ] {
            let js = jobs(&workers, dirs);
            for size in [2u64, 4096, 1 << 20, 8 << 20] {
                for (iters, warmup) in [(1, 1), (7, 1), (5000, 500), (64, 6), (300, 30)] {
                    let p = Plan::new(&js, Verb::Write, size, iters, warmup);
                    check_plan(&p, &js);
                    for d in 0..dirs {
                        let sum: u64 = js
                            .iter()
                            .enumerate()
                            .filter(|(_, j)| 1 - j.dir == d)
                            .map(|(j, _)| p.dst_slots[j] as u64 * size)
                            .sum();
                        assert_eq!(p.dst_len[d], sum);
                    }
                }
            }
        }
    }
}
