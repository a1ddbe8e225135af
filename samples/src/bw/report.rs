//! What the bandwidth tests report: what a timed run measured ([`Timing`]), what a side measured
//! of a size ([`Measured`]), the numbers of a row ([`combine`]), the registration cache's
//! line and JSON, the header ([`header`]) and what is printed before the rows
//! ([`print_preamble`]), the JSON every row shares ([`base_json`]), and a size's row
//! ([`print_row`]).

use super::args::{Scope, BYTES_PER_SIZE, MIN_ITERS};
use super::plan::{RegTiming, Side};
use super::setup::{shown, Run};
use super::verb::Verb;
use crate::{
    address_lines_of, common_header, common_json, doorbell_line, merge, mtu_line, remote_header,
    remote_json, table_row, with_mtu, Header, Initiator, OtherCpu, Peer, Units,
};
use serde_json::{json, Value};
use std::time::Duration;

/// Cold and warm times of the cached registrations and the caches' counters, as the header
/// line and the JSON object `"reg_cache"`.
pub(super) fn reg_cache_report(
    timings: &[RegTiming],
    sides: &[Option<Side>; 2],
) -> (String, Value) {
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

/// What one side measured of one size (its own jobs); the server/client roles send it to the
/// peer, so that both print the same row.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct Measured {
    /// Messages sent.
    pub(super) msgs: f64,
    /// Seconds from the first post to the last completion.
    pub(super) secs: f64,
    /// Peak message rate per second, when measured.
    pub(super) peak_rate: Option<f64>,
    /// Iterations each of this side's QPs ran (with -D: as many as the duration took).
    pub(super) iters: u32,
}

/// The numbers of a row: the sum over the sides that sent (peak, average, Mpps), and the
/// longest time.
pub(super) fn combine(ms: &[Measured], size: u64, units: Units) -> (f64, f64, f64, f64) {
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

/// What a timed run measured.
pub(super) struct Timing {
    /// Average: the whole run.
    pub(super) total: Duration,
    /// Peak message rate per second, when measured.
    pub(super) peak_rate: Option<f64>,
    /// Iterations each job ran.
    pub(super) iters: u32,
}

/// The header: the common lines and the peer's, then the run's (QPs, posting, depths, MTU,
/// iterations, validation) and the other processes' CPU before the run.
pub(super) fn header(
    run: &Run,
    peer: Option<&Peer>,
    reg_cache: Option<&(String, Value)>,
    other_cpu: &OtherCpu,
) -> Header {
    let (args, t, rp, env) = (run.args, run.t, run.rp, run.env);
    let a = &args.common;
    let verb = rp.verb;
    let receives_only = rp.receives_only();
    let peer_role = peer.map_or("peer", |p| p.peer_role);
    let mut h = Header::new(format!("{} BW Test ({})", verb.title(), rp.test));
    common_header(
        &mut h,
        env,
        a,
        run.first_qp,
        if receives_only {
            format!("none: this side only answers (the {peer_role} posts)")
        } else {
            doorbell_line(run.first_qp, env.initiator, rp.ring_mode, a.db)
        },
    );
    if let (Some(p), Some(ep)) = (peer, run.rv.peer_eps.first()) {
        remote_header(&mut h, a, p, &env.ctx, ep);
    }
    h.line("Number of qps", format!("{} (each direction)", args.qps))
        .line("Bidirectional", if args.bidir { "on" } else { "off" });
    h.line("Posting", posting(run));
    if let Some((line, _)) = reg_cache {
        h.line("Reg cache", line);
    }
    if verb == Verb::Send && (rp.me.is_none() || receives_only) {
        h.line("RX depth", rp.rx_depth);
    }
    h.line("Post List", args.post_list)
        .line("CQ Moderation", a.cq_mod)
        .line("TX depth", format!("{} blocks", rp.tx))
        .line(
            "Mtu",
            mtu_line(
                a.mtu,
                &env.ctx,
                &run.first_qp.endpoint(),
                run.rv.peer_eps.first(),
            ),
        )
        .line("GID index", env.ctx.gid_index());
    if verb.has_inline() {
        h.line("Max inline data", format!("{}[B]", args.inline_size));
    }
    if verb.has_outs() {
        h.line("Outstand reads", rp.outs);
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
    .line("Validation", validation(verb, peer.is_some()));
    other_cpu.header(&mut h);
    h
}

/// The header's `Posting`: who posts this side's WQEs, and how many per doorbell.
fn posting(run: &Run) -> String {
    let (args, rp) = (run.args, run.rp);
    let (ctas, threads, scope) = (rp.ctas, rp.threads, rp.scope);
    match run.env.initiator {
        _ if rp.receives_only() => if rp.verb == Verb::Send {
            "receives only, by a host thread"
        } else {
            "none: this side only answers"
        }
        .to_string(),
        Initiator::Gpu if rp.verb != Verb::Write && scope == Scope::Warp => format!(
            "{ctas} CTA(s) x 32 threads, warp scope{}: one warp per QP, one doorbell and one \
             CQE per warp call of 32 WQEs",
            if args.scope.is_none() {
                " (the default, as GPU code posts; --scope thread for perftest's single poster)"
            } else {
                ""
            }
        ),
        Initiator::Gpu if rp.verb != Verb::Write => {
            format!("{ctas} CTA(s) x 1 thread: one thread per QP, one doorbell per WQE")
        }
        Initiator::Gpu => format!(
            "{ctas} CTA(s) x {threads} thread(s), {} scope{}, {}",
            scope.name(),
            if args.scope.is_none() && scope == Scope::Warp {
                " (the default: a warp's WQEs under one doorbell, as GPU code posts, unless -I \
                 or -l asks for thread scope; --scope thread for perftest's single poster)"
            } else {
                ""
            },
            match scope {
                Scope::Thread => format!("{} WQEs per doorbell per thread", args.post_list),
                Scope::Warp => "one doorbell per warp call".into(),
                Scope::Block => "one doorbell per block call".into(),
            }
        ),
        Initiator::Cpu => format!("one host thread, {} WQEs per doorbell", args.post_list),
    }
}

/// The header's `Validation`: what is checked, and by whom (`remote`: across processes).
fn validation(verb: Verb, remote: bool) -> &'static str {
    match (verb, remote) {
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
    }
}

/// The header (unless `--output`), perftest's address lines (this side's QPs, then the
/// peer's), and the table's columns (unless `--json` or `--output`).
pub(super) fn print_preamble(run: &Run, h: &Header) {
    let (a, rp) = (&run.args.common, run.rp);
    let table = !a.json && a.output.is_none();
    if a.output.is_none() {
        h.print(a.json);
        // perftest's address lines: this side's QPs, then the peer's.
        let fmt = rp.verb.addr_format(rp.outs);
        let mut lines = Vec::new();
        let (lside, rside) = match rp.me {
            Some(m) => (m, None),
            None => (0, Some(1)),
        };
        let (lk, lv) = shown(run.sides, lside, rp.verb);
        for q in &run.sides[lside].as_ref().expect("this side").qps {
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
                let (rk, rv) = shown(run.sides, r, rp.verb);
                for q in &run.sides[r].as_ref().expect("side B").qps {
                    lines.push(address_lines_of(fmt, "remote", &q.endpoint(), rk, rv));
                }
            }
            None => {
                for ep in &run.rv.peer_eps {
                    lines.push(address_lines_of(
                        fmt,
                        "remote",
                        ep,
                        run.peer_shown.0,
                        run.peer_shown.1,
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
            (format!("BW peak[{}]", rp.units.label()), 18),
            (format!("BW average[{}]", rp.units.label()), 20),
            ("MsgRate[Mpps]".to_string(), 0),
        ];
        if rp.cpu_util {
            cols.last_mut().expect("columns").1 = 16;
            cols.push(("CPU_Util[%]".to_string(), 0));
        }
        println!("{}", table_row(&cols));
    }
}

/// What every JSON row carries: the common fields, the run's options, the peer's fields and
/// the registration cache's report.
pub(super) fn base_json(
    run: &Run,
    peer: Option<&Peer>,
    reg_cache: Option<&(String, Value)>,
) -> Value {
    let (args, rp, env) = (run.args, run.rp, run.env);
    let a = &args.common;
    let verb = rp.verb;
    let mut base_json = merge(
        common_json(env, a, run.first_qp),
        json!({
            "test": rp.test, "qps": args.qps, "bidir": args.bidir, "cq_mod": a.cq_mod,
            "tx_depth": rp.tx, "post_list": args.post_list, "bw_unit": rp.units.label(),
            "inline_size": args.inline_size, "duration_s": args.duration,
            "scope": (env.initiator == Initiator::Gpu).then(|| rp.scope.name()),
            "ctas": (env.initiator == Initiator::Gpu).then_some(rp.ctas),
            "threads": (env.initiator == Initiator::Gpu).then_some(rp.threads),
            "verb": verb.title(), "outs": verb.has_outs().then_some(rp.outs),
            "rx_depth": (verb == Verb::Send).then_some(rp.rx_depth),
        }),
    );
    if let (Some(p), Some(ep)) = (peer, run.rv.peer_eps.first()) {
        base_json = merge(base_json, remote_json(a, p, &env.ctx, ep));
    }
    if let Some((_, v)) = reg_cache {
        base_json = merge(base_json, json!({ "reg_cache": v }));
    }
    base_json
}
