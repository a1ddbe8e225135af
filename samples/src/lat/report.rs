//! What the latency tests report: what a run of one size did on this process's sides ([`Ran`]:
//! round trips, messages sent), perftest's latency columns and their widths, for counted
//! runs and for runs of a duration (`-D`), the header ([`header`]) and what is printed before
//! the rows ([`print_preamble`]), the JSON every row shares ([`base_json`]), and a size's row
//! ([`print_row`]).

use super::args::{BYTES_PER_SIZE, DEFAULT_ITERS, MIN_ITERS};
use super::setup::Run;
use super::side::Side;
use crate::bw::Verb;
use crate::{
    address_lines_of, common_header, common_json, doorbell_line, merge, mtu_line, remote_header,
    remote_json, table_row, with_mtu, Header, Initiator, OtherCpu, Peer,
};
use serde_json::{json, Value};

/// perftest's latency columns and their widths (its RESULT_FMT_LAT's spacing).
pub(super) const LAT_COLUMNS: [(&str, usize); 9] = [
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
pub(super) const LAT_DUR_COLUMNS: [(&str, usize); 4] = [
    ("#bytes", 13),
    ("#iterations", 17),
    ("t_avg[usec]", 14),
    ("tps average", 0),
];

/// What a run of one size did on this process's sides.
#[derive(Clone, Debug, Default)]
pub(super) struct Ran {
    /// Side A's round trips in ns, every one, warm-up included (counted runs, side A here).
    pub(super) rtt: Option<Vec<u64>>,
    /// Messages (WRITEs, SENDs, READs, atomics) each side of this process sent, by side.
    pub(super) sent: [Option<u64>; 2],
    /// With -D: side A's timed round trips and their span in ns (side A here).
    pub(super) timed: Option<(u64, u64)>,
}

/// The header: the common lines and the peer's, then the run's (posting, waits, depths, MTU,
/// iterations, times, validation) and the other processes' CPU before the run.
pub(super) fn header(run: &Run, peer: Option<&Peer>, other_cpu: &OtherCpu) -> Header {
    let (args, t, lp, env) = (run.args, run.t, run.lp, run.env);
    let a = &args.common;
    let verb = lp.verb;
    let sides = &run.c.sides;
    let mut h = Header::new(format!("{} Latency Test ({})", verb.title(), lp.test));
    common_header(
        &mut h,
        env,
        a,
        &sides[0].qp,
        doorbell_line(&sides[0].qp, env.initiator, run.ring_mode, a.db),
    );
    if let (Some(p), Some(ep)) = (peer, &run.c.peer_ep) {
        remote_header(&mut h, a, p, &env.ctx, ep);
    }
    h.line(
        "Posting",
        posting(env.initiator, peer.map(Peer::side), t.one_sided()),
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
        .line("TX depth", format!("{} blocks", lp.tx))
        .line(
            "Mtu",
            mtu_line(
                a.mtu,
                &env.ctx,
                &sides[0].qp.endpoint(),
                run.c.peer_ep.as_ref(),
            ),
        )
        .line("GID index", env.ctx.gid_index());
    if verb.has_inline() {
        h.line("Max inline data", format!("{}[B]", lp.inline_max));
    }
    if verb.has_outs() {
        h.line("Outstand reads", lp.outs);
    }
    h.line("Iterations", iterations_line(args.duration, a.iters))
        .line("Times", times_line(t.one_sided(), peer.is_some()))
        .line("Validation", validation(verb, peer.is_some()));
    other_cpu.header(&mut h);
    h
}

/// The header's `Posting`: who drives which side (`me`: this side across processes).
fn posting(initiator: Initiator, me: Option<usize>, one_sided: bool) -> &'static str {
    match (initiator, me, one_sided) {
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
    }
}

/// The header's `Iterations`: a duration's (`-D`), a count's (`-n`), or the defaults.
fn iterations_line(duration: Option<u32>, iters: Option<u32>) -> String {
    match (duration, iters) {
        (Some(d), _) => format!(
            "as many as {d} s take, per size, after the warm-up (-D; each side stops on its \
             own clock)"
        ),
        (None, Some(n)) => format!("{n} per size"),
        (None, None) => format!(
            "per size: {DEFAULT_ITERS}, or {} MiB worth when less (at least {MIN_ITERS})",
            BYTES_PER_SIZE >> 20
        ),
    }
}

/// The header's `Times`: what a time covers (`remote`: across processes, measured by A).
fn times_line(one_sided: bool, remote: bool) -> String {
    format!(
        "{}, microseconds{}",
        if one_sided {
            "the whole operation (perftest's: not halved)"
        } else {
            "half round trip"
        },
        if remote {
            ", measured by side A (the client)"
        } else {
            ""
        }
    )
}

/// The header's `Validation`: what is checked, and by whom (`remote`: across processes).
fn validation(verb: Verb, remote: bool) -> &'static str {
    match (verb, remote) {
        (Verb::Atomic(_), _) => {
            "every fetched value (side A) and the target word's final value (side B), \
             every size"
        }
        (Verb::Read, _) => "side A's receive buffer (what it read), every byte, every size",
        (_, true) => "each side its receive buffer, every byte, every size (reported to the peer)",
        (_, false) => "both receive buffers, every byte, every size",
    }
}

/// The header (unless `--output`), perftest's address lines (this side's QP, then the peer's),
/// and the table's columns (unless `--json` or `--output`).
pub(super) fn print_preamble(run: &Run, h: &Header) {
    let (a, lp) = (&run.args.common, run.lp);
    let verb = lp.verb;
    let sides = &run.c.sides;
    let table = !a.json && a.output.is_none();
    if a.output.is_none() {
        h.print(a.json);
        // perftest's address lines: this side's QP, then the peer's (each with the buffer
        // the other reaches: WRITE's receive buffer, READ's source).
        let fmt = verb.addr_format(lp.outs);
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
        match (&run.c.peer_ep, run.c.targets.first()) {
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
        let mut cols: Vec<(String, usize)> = match lp.duration {
            Some(_) => LAT_DUR_COLUMNS.map(|(n, w)| (n.to_string(), w)).to_vec(),
            None => LAT_COLUMNS.map(|(n, w)| (n.to_string(), w)).to_vec(),
        };
        if lp.cpu_util {
            cols.last_mut().expect("columns").1 = 14;
            cols.push(("CPU_Util[%]".into(), 0));
        }
        println!("{}", table_row(&cols));
    }
}

/// What every JSON row carries: the common fields, the run's options and the peer's fields.
pub(super) fn base_json(run: &Run, peer: Option<&Peer>) -> Value {
    let (args, lp, env) = (run.args, run.lp, run.env);
    let a = &args.common;
    let mut base_json = merge(
        common_json(env, a, &run.c.sides[0].qp),
        json!({
            "test": lp.test, "signal": args.signal, "cq_mod": a.cq_mod, "tx_depth": lp.tx,
            "duration_s": args.duration,
            "inline_size": lp.inline_max, "verb": lp.verb.title(),
            "outs": lp.verb.has_outs().then_some(lp.outs),
        }),
    );
    if let (Some(p), Some(ep)) = (peer, &run.c.peer_ep) {
        base_json = merge(base_json, remote_json(a, p, &env.ctx, ep));
    }
    base_json
}
