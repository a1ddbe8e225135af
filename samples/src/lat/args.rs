//! The options of the latency tests and their checks: each verb's [`Test`] (name, defaults), the
//! command line ([`Args`], [`command`]), and the iterations of a size; [`main`](super::main)
//! parses them.

use crate::bw::{AtomicOp, Verb};
use crate::CommonArgs;
use clap::{CommandFactory, Parser};

/// Default bytes per size and direction: larger sizes get fewer iterations.
pub(super) const BYTES_PER_SIZE: u64 = 256 << 20;

/// Fewest default iterations of a size.
pub(super) const MIN_ITERS: u32 = 100;

/// Default iterations of small sizes (perftest's).
pub(super) const DEFAULT_ITERS: u32 = 1000;

/// What a test is called and defaults to.
#[derive(Clone, Copy, Debug)]
pub(super) struct Test {
    pub(super) verb: Verb,
    pub(super) name: &'static str,
    /// Default size (perftest's: 2, atomics 8).
    pub(super) default_size: u64,
    /// perftest's -I default (WRITE 220, SEND 236; READ and atomics have none).
    pub(super) inline: Option<u32>,
}

impl Test {
    pub(super) fn of(verb: Verb) -> Self {
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
    pub(super) fn one_sided(&self) -> bool {
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
pub(super) struct Args {
    #[command(flatten)]
    pub(super) common: CommonArgs,
    /// WRITE: the receiver waits on a signal word raised by an atomic after the write, instead
    /// of polling the payload's last bytes.
    #[arg(long)]
    pub(super) signal: bool,
    /// perftest's -I (--inline_size), WRITE and SEND: messages of at most this many bytes
    /// travel inside their WQEs (an inline data segment) [default: perftest's, 220 for WRITE
    /// and 236 for SEND]. At most 256.
    #[arg(short = 'I', long = "inline_size", value_name = "BYTES",
          value_parser = clap::value_parser!(u32).range(0..=MAX_INLINE as i64))]
    pub(super) inline_size: Option<u32>,
    /// perftest's -o (--outs), READ and atomics: the QP's outstanding reads (perftest's default
    /// 16). A latency test has one in flight at a time; the value is reported.
    #[arg(short = 'o', long = "outs", value_name = "NUM",
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub(super) outs: Option<u32>,
    /// perftest's -A (--atomic_type), atomics: FETCH_AND_ADD (default) or CMP_AND_SWAP.
    #[arg(short = 'A', long = "atomic_type", value_enum, value_name = "TYPE")]
    pub(super) atomic_type: Option<AtomicOp>,
    /// Make the run fail on purpose (tests): `corrupt` flips a bit of what side A received (its
    /// receive buffer; atomics: its last fetched value) after the run, which validation must
    /// catch.
    #[arg(long, value_enum, hide = true)]
    pub(super) inject: Option<Inject>,
    /// perftest's -D (--duration): after the warm-up, each size's timed part runs this many
    /// seconds instead of -n iterations, and the row is perftest's duration row: #iterations,
    /// t_avg[usec] (the timed part's span over its round trips; halved for WRITE and SEND, as
    /// perftest does) and tps average. Each side stops on its own clock; not with -a or -n (as
    /// perftest).
    #[arg(short = 'D', long = "duration", value_name = "SECONDS",
          conflicts_with_all = ["iters", "all"],
          value_parser = clap::value_parser!(u32).range(1..=3600))]
    pub(super) duration: Option<u32>,
    /// perftest's --cpu_util: a CPU_Util[%] column, the machine's user time over user + idle
    /// time during the timed part (/proc/stat, as perftest). Duration mode (-D) only: without
    /// it perftest warns and reports none, and so does this test.
    #[arg(long = "cpu_util")]
    pub(super) cpu_util: bool,
}

/// Failures made on purpose (tests of the validation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum Inject {
    /// A bit of side A's received bytes is flipped after the run.
    Corrupt,
}

/// Largest `-I` (the QPs' inline limit).
pub(super) const MAX_INLINE: u32 = 256;

/// perftest's `-o` default.
pub(super) const DEFAULT_OUTS: u32 = 16;

/// The command line of `test`: its name, its about text, and the options of other verbs
/// hidden.
pub(super) fn command(t: &Test) -> clap::Command {
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

/// Iterations and warm-up of a size.
pub(super) fn iterations(a: &CommonArgs, size: u64) -> (u32, u32) {
    let iters = a.iters.unwrap_or_else(|| {
        (BYTES_PER_SIZE / size).clamp(MIN_ITERS as u64, DEFAULT_ITERS as u64) as u32
    });
    let warmup = a.warmup.unwrap_or((iters / 10).clamp(1, 100));
    (iters, warmup)
}
