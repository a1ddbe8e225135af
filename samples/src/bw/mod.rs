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
//!
//! [`main`] is here; the harness's other files, one job each:
//! - `verb`: the verbs ([`Verb`], [`AtomicOp`]) and an atomic job's values.
//! - `args`: the test of each verb, its options and their checks, the iterations of a size.
//! - `plan`: the jobs (QPs), the slots of a size, each side's QPs and registered buffers, the
//!   keys the initiators use, and the poison and validation of the destinations.
//! - `run`: one run of every size, in its steps: the plan (the options resolved), the
//!   rendezvous and the connection, the buffers, the header, the initiators, every size, the
//!   closing lines.
//! - `size`: one size, in its steps: fresh sources, warm-up, poison, timed run, validation.
//! - `engine`: the initiator of this process behind one call, and SEND's receives alongside.
//! - `cpu`: the CPU initiator (one host thread) and SEND's receivers.
//! - `gpu`: the GPU initiator (the `gv_sample_*_bw` kernels).
//! - `report`: what a timed run and a side measured, the row's numbers, the registration
//!   cache's report, the header, the address lines and columns, the JSON, a size's row.

mod args;
mod cpu;
mod engine;
mod gpu;
mod plan;
mod report;
mod run;
mod setup;
mod size;
mod verb;

pub use verb::{atomic_base, atomic_value, AtomicOp, Verb};

use crate::{exit_with, Initiator, OutputArg};
use args::{command, needs, Args, Scope, Test};
use run::run;

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
    let shaped = args.ctas.is_some() || args.threads.is_some();
    if verb != Verb::Write && (shaped || (args.scope.is_some() && !verb.has_outs())) {
        foreign.push(
            "--ctas, --threads: WRITE; --scope: WRITE, READ and atomics (the other verbs post \
             from one thread, or one warp, per QP)",
        );
    }
    if verb.has_outs() && args.scope == Some(Scope::Block) {
        foreign.push("--scope block: WRITE (READ and atomics post at thread or warp scope)");
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
