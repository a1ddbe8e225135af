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
//!
//! [`main`] is here; the harness's other files, one job each:
//! - `args`: the test of each verb, its options and their checks, the iterations of a size.
//! - `side`: one side's QP and buffers, where its messages go, the tail words, and the check of
//!   what arrived.
//! - `run`: one run of every size, in its steps: the plan (the options resolved), the
//!   rendezvous and the sides' connection, the header, the initiator, every size, the closing
//!   lines.
//! - `size`: one size, in its steps: the buffers prepared, the round trips, the validation,
//!   the statistics both processes agree on.
//! - `engine`: the initiator of this process behind one call.
//! - `cpu`: the CPU initiator (one host thread drives this process's sides in turn).
//! - `gpu`: the GPU initiator (the `gv_sample_verb_lat` kernel).
//! - `report`: what a run of one size did, perftest's latency columns, the header, the address
//!   lines and columns, the JSON, a size's row.

mod args;
mod cpu;
mod engine;
mod gpu;
mod report;
mod run;
mod setup;
mod side;
mod size;

use crate::bw::Verb;
use crate::{exit_with, Initiator};
use args::{command, Args, Test};
use run::run;

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
