//! The options of the bandwidth tests and their checks: each verb's [`Test`] (name, defaults), the
//! command line ([`Args`], [`command`]), and the iterations of a size; [`main`](super::main)
//! parses them.

use super::verb::{AtomicOp, Verb};
use crate::CommonArgs;
use clap::{CommandFactory, Parser, ValueEnum};

/// Default bytes per job and size: larger sizes get fewer iterations.
pub(super) const BYTES_PER_SIZE: u64 = 1 << 30;

/// Fewest default iterations of a size.
pub(super) const MIN_ITERS: u32 = 64;

/// perftest's `-o` default (the device's maximum under `gpuverbs emu`).
pub(super) const DEFAULT_OUTS: u32 = 16;

/// perftest's `-r` default.
pub(super) const DEFAULT_RX_DEPTH: u32 = 512;

/// What a test is called and defaults to.
#[derive(Clone, Copy, Debug)]
pub(super) struct Test {
    pub(super) verb: Verb,
    /// The binary's name.
    pub(super) name: &'static str,
    /// Default size (perftest's).
    pub(super) default_size: u64,
    /// Default iterations of small sizes (perftest's: 5000 for ib_write_bw, 1000 otherwise).
    pub(super) default_iters: u32,
}

impl Test {
    pub(super) fn of(verb: Verb) -> Self {
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
pub(super) enum Scope {
    /// Each thread posts its own WQEs (`put`), `-l` (`--post_list`) per doorbell.
    Thread,
    /// The lanes of a warp post together (`put_warp`): one reservation and doorbell per call.
    Warp,
    /// The threads of a block post together (`put_block`): one doorbell per call.
    Block,
}

impl Scope {
    pub(super) fn code(self) -> u32 {
        match self {
            Self::Thread => 0,
            Self::Warp => 1,
            Self::Block => 2,
        }
    }
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Thread => "thread",
            Self::Warp => "warp",
            Self::Block => "block",
        }
    }
}

/// Failures made on purpose (tests of the error paths).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Inject {
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
pub(super) struct Args {
    #[command(flatten)]
    pub(super) common: CommonArgs,
    /// Number of QPs (in each direction).
    #[arg(short = 'q', long, default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(super) qps: u32,
    /// Both sides initiate at once; the numbers are the sum of both directions.
    #[arg(short = 'b', long, alias = "bidirectional")]
    pub(super) bidir: bool,
    /// Report Gb/sec (10^9 bits) instead of MB/sec (2^20 bytes).
    #[arg(long, alias = "report_gbits")]
    pub(super) report_gbits: bool,
    /// GPU, WRITE: CTAs (thread blocks); CTA c drives QP c % QPs [default: one per QP].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65535))]
    pub(super) ctas: Option<u32>,
    /// GPU, WRITE: threads per CTA [default: 1 for thread scope, 32 for warp, 128 for block].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(super) threads: Option<u32>,
    /// GPU, WRITE (READ and atomics: thread or warp): who posts together [default: warp, as GPU
    /// code posts small messages: the 32 lanes' WQEs under one reservation and one doorbell
    /// (READ and atomics: and one CQE); thread with -I or -l, which are thread-scope options;
    /// `thread` is perftest's single poster].
    #[arg(long, value_enum)]
    pub(super) scope: Option<Scope>,
    /// perftest's -l (--post_list): WQEs per doorbell, perftest's default 1 (thread scope and
    /// CPU; a warp or block call rings once for its WQEs). --batch is the older spelling.
    #[arg(short = 'l', long = "post_list", alias = "batch", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(super) post_list: u32,
    /// perftest's -I (--inline_size): messages of at most this many bytes travel inside their
    /// WQEs (an inline data segment) instead of being gathered from the source buffer;
    /// perftest's default for ib_write_bw and ib_send_bw, 0, posts none inline. WRITE and SEND
    /// only; with the GPU initiator at thread scope (the kernels' put_inline / send_inline).
    #[arg(short = 'I', long = "inline_size", value_name = "BYTES", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=MAX_INLINE as i64))]
    pub(super) inline_size: u32,
    /// perftest's -D (--duration): run each size's timed part for this many seconds instead of
    /// a number of iterations (the table reports the iterations done); not with -a or -n (as
    /// perftest).
    #[arg(short = 'D', long = "duration", value_name = "SECONDS",
          conflicts_with_all = ["iters", "all"],
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub(super) duration: Option<u32>,
    /// perftest's --cpu_util: a CPU_Util[%] column, the machine's user time over user + idle
    /// time during the timed run (/proc/stat, as perftest computes it). Duration mode (-D)
    /// only: without it perftest warns and reports none, and so does this test.
    #[arg(long = "cpu_util")]
    pub(super) cpu_util: bool,
    /// perftest's -o (--outs), READ and atomics: at most this many reads or atomics in flight
    /// per QP [default: 16, the device's maximum under perftest].
    #[arg(short = 'o', long = "outs", value_name = "NUM",
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub(super) outs: Option<u32>,
    /// perftest's -r (--rx-depth), SEND: receives kept posted per QP [default: 512, perftest's].
    #[arg(short = 'r', long = "rx-depth", value_name = "DEPTH",
          value_parser = clap::value_parser!(u32).range(1..=8192))]
    pub(super) rx_depth: Option<u32>,
    /// perftest's -A (--atomic_type), atomics: FETCH_AND_ADD (default) or CMP_AND_SWAP.
    #[arg(short = 'A', long = "atomic_type", value_enum, value_name = "TYPE")]
    pub(super) atomic_type: Option<AtomicOp>,
    /// Register the payload buffers through the PD's registration cache, and report the
    /// cold (first: a miss) and warm (again: a hit) registration times.
    #[arg(long)]
    pub(super) reg_cache: bool,
    /// Make the run fail on purpose (tests).
    #[arg(long, value_enum, hide = true)]
    pub(super) inject: Option<Inject>,
}

/// Largest `-I` (the QPs' inline limit).
pub(super) const MAX_INLINE: u32 = 256;

/// What `-D` gives a size as its iterations before the run: the layout of the destinations
/// (as many slots as fit) and the most a flow may post.
pub(super) const DURATION_ITERS: u32 = u32::MAX - 1;

impl Args {
    /// The options the CPU initiator has and the kernels do not.
    pub(super) fn gpu_only_options(&self) -> Vec<&'static str> {
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
    pub(super) fn outs(&self, verb: Verb) -> u32 {
        if verb.has_outs() {
            self.outs.unwrap_or(DEFAULT_OUTS)
        } else {
            0
        }
    }
}

/// The command line of `test`: its name, its about text, and the options of other verbs
/// hidden.
pub(super) fn command(t: &Test) -> clap::Command {
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
        for id in ["ctas", "threads"] {
            c = c.mut_arg(id, |a| a.hide(true));
        }
        if !v.has_outs() {
            c = c.mut_arg("scope", |a| a.hide(true));
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

/// "needs" or "need", for a list of options.
pub(super) fn needs(options: &[&str]) -> &'static str {
    if options.len() == 1 {
        "needs"
    } else {
        "need"
    }
}

/// Iterations and warm-up of a size (with `-D`, [`DURATION_ITERS`] and the warm-up of the
/// default count).
pub(super) fn iterations(t: &Test, a: &CommonArgs, size: u64, duration: bool) -> (u32, u32) {
    let default = (BYTES_PER_SIZE / size).clamp(MIN_ITERS as u64, t.default_iters as u64) as u32;
    let iters = a.iters.unwrap_or(default);
    let warmup = a.warmup.unwrap_or((iters / 10).clamp(1, 500));
    if duration {
        return (DURATION_ITERS, warmup);
    }
    (iters, warmup)
}
