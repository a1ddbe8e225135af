//! One size of a latency run, [`run_size`], in its steps: the buffers prepared, the round trips
//! (warm-up and timed, after the step "ready"), the validation, the statistics, and the outcome
//! both processes agree on.

use super::args::{iterations, Inject};
use super::engine::Engine;
use super::report::Ran;
use super::report::LAT_COLUMNS;
use super::setup::Run;
use super::side::{pad, tail_len, validate};
use crate::bw::{atomic_base, Verb};
use crate::{
    error_text, pattern, step, wire_counters, wire_delta, CpuSample, LatStats, OtherCpu, Peer,
    UserIdle,
};
use crate::{merge, output_number, table_row};
use anyhow::{Context as _, Result};
use serde_json::json;
use serde_json::Value;

/// What the sizes' runs change: the initiator, the connection to the peer, the record of the
/// other processes' CPU, and scratch bytes for the patterns.
pub(super) struct Live<'a> {
    pub(super) engine: &'a mut Engine,
    pub(super) peer: &'a mut Option<Peer>,
    pub(super) other_cpu: &'a mut OtherCpu,
    pub(super) scratch: Vec<u8>,
}

/// What one size did and found: its iterations, the messages each side sent, side A's timed
/// part (-D), the statistics of the round trips, the CPU figures, this side's wire counters,
/// and the failure (either side's).
pub(super) struct SizeOutcome {
    /// Timed iterations (counted runs).
    pub(super) iters: u32,
    pub(super) warmup: u32,
    /// The messages travelled inside their WQEs (`-I`).
    pub(super) inline: bool,
    /// Messages each side sent.
    pub(super) sent: [u64; 2],
    /// With -D: side A's timed round trips and their span in ns.
    pub(super) timed: Option<(u64, u64)>,
    /// What a time is divided by to give microseconds: half a round trip (WRITE, SEND), or
    /// the whole operation (READ, atomics: perftest's).
    pub(super) per: f64,
    /// The round trips' statistics (counted runs).
    pub(super) st: LatStats,
    /// CPU_Util[%] of the timed run (--cpu_util with -D).
    pub(super) util: Option<f64>,
    /// Other processes' cores during the run.
    pub(super) others: Option<f64>,
    /// This side's wire port during the run.
    pub(super) wire: Value,
    pub(super) failure: Option<String>,
}

/// One size: the buffers prepared, the round trips, the validation, the statistics.
pub(super) fn run_size(run: &Run, live: &mut Live, size: u64) -> Result<SizeOutcome> {
    let (args, lp) = (run.args, run.lp);
    let (iters, warmup) = iterations(&args.common, size);
    let seed = pattern::seed(2, size);
    prepare(run, size, seed, &mut live.scratch)?;
    let (mine, mut o) = round_trips(run, live, size, iters, warmup)?;
    if let (Some(Inject::Corrupt), Some(k)) = (args.inject, run.c.ids.iter().position(|&i| i == 0))
    {
        let s = &run.c.sides[k];
        let (b, off) = match lp.verb {
            Verb::Atomic(_) => (&s.fetch, 3),
            _ => (&s.recv, pad(size) as usize + size as usize / 2),
        };
        let mut x = [0u8];
        b.read(off, &mut x)?;
        b.write(off, &[x[0] ^ 0x01])?;
    }
    let failure = validate(
        &run.c.sides,
        &run.c.ids,
        lp.verb,
        size,
        o.sent,
        seed,
        args.signal,
        &mut live.scratch,
    )
    .err()
    .map(|e| error_text(&e));
    let stats = mine.rtt.map(|rtt| {
        let mut us: Vec<f64> = rtt[warmup as usize..]
            .iter()
            .map(|&t| t as f64 / o.per)
            .collect();
        LatStats::of(&mut us)
    });
    (o.failure, o.st) = agree(live.peer, lp.duration.is_some(), failure, stats)?;
    Ok(o)
}

/// The buffers of this process's sides for a size: WRITE and SEND, both copies of the source
/// filled and the receive buffer and signal word cleared; READ, the source poisoned then filled
/// and the receive buffer the complement of the peer's pattern; atomics, the word at its base
/// and the fetched value its complement.
fn prepare(run: &Run, size: u64, seed: u64, scratch: &mut Vec<u8>) -> Result<()> {
    let (p, tl) = (pad(size) as usize, tail_len(size));
    for (&i, s) in run.c.ids.iter().zip(&run.c.sides) {
        match run.lp.verb {
            Verb::Write | Verb::Send => {
                pattern::fill(scratch, seed ^ i as u64, 0, size as usize - tl);
                for copy in [0, s.src_stride] {
                    s.src.write(copy + p, scratch)?;
                    s.src.fill(copy + p + size as usize - tl, tl, 0)?;
                }
                s.recv.fill(0, s.recv.len(), 0)?;
                s.sig.write(0, &0u64.to_ne_bytes())?;
            }
            Verb::Read => {
                // The source is poisoned, then filled; the receive buffer (where the
                // reads land) holds the complement of the peer's pattern.
                pattern::fill(scratch, seed ^ i as u64, 0, size as usize);
                scratch.iter_mut().for_each(|x| *x = !*x);
                s.src.write(p, scratch)?;
                scratch.iter_mut().for_each(|x| *x = !*x);
                s.src.write(p, scratch)?;
                s.recv.fill(0, s.recv.len(), 0)?;
                pattern::fill(scratch, seed ^ (1 - i) as u64, 0, size as usize);
                scratch.iter_mut().for_each(|x| *x = !*x);
                s.recv.write(p, scratch)?;
            }
            Verb::Atomic(_) => {
                s.sig.write(0, &atomic_base(0).to_ne_bytes())?;
                s.fetch.write(0, &(!atomic_base(0)).to_ne_bytes())?;
            }
        }
    }
    Ok(())
}

/// The round trips of a size (after the step "ready": across processes A sends only once B
/// has cleared its buffers), then the step "ran", which gives each process what the other's
/// sides sent (and side A's timed part); what this process ran, and the size's outcome so far.
fn round_trips(
    run: &Run,
    live: &mut Live,
    size: u64,
    iters: u32,
    warmup: u32,
) -> Result<(Ran, SizeOutcome)> {
    let (args, lp) = (run.args, run.lp);
    // With -D the engines run the warm-up counted, then the duration.
    let total = match lp.duration {
        Some(_) => warmup,
        None => iters + warmup,
    };
    // Before the step that lets the peer start (its packets may arrive, and be answered,
    // before this thread runs again after it).
    let wire_before = wire_counters(&run.env.ctx);
    // Across processes A sends only once B has cleared its buffers.
    step(live.peer, "ready", Ok(()))?;
    let cpu = CpuSample::now();
    let inline = size <= lp.inline_max as u64;
    let util_before = lp.cpu_util.then(UserIdle::now).flatten();
    let ran = live.engine.run(
        &run.c.sides,
        &run.c.ids,
        &run.c.targets,
        lp.verb,
        size,
        total,
        lp.duration,
        args.signal,
        inline,
        &args.common,
    );
    let util = util_before.zip(UserIdle::now()).map(|(b, e)| b.util_to(e));
    let others = live.other_cpu.record(cpu.and_then(CpuSample::others_since));
    let wire = wire_delta(&wire_before, &wire_counters(&run.env.ctx));
    // Side A's times (B has none), and what each side sent: the peer's counts, across
    // processes, come with this step.
    let mine = ran.as_ref().ok().cloned().unwrap_or_default();
    let theirs = step(live.peer, "ran", ran.map(|r| (r.sent, r.timed)))?;
    let (their_sent, their_timed) = theirs.unwrap_or_default();
    let sent = [0, 1].map(|i| mine.sent[i].or(their_sent[i]).unwrap_or(0));
    let timed = mine.timed.or(their_timed);
    let o = SizeOutcome {
        iters,
        warmup,
        inline,
        sent,
        timed,
        // Half a round trip (WRITE, SEND), or the whole operation (READ, atomics: perftest's).
        per: if run.t.one_sided() { 1e3 } else { 2e3 },
        st: LatStats::default(),
        util,
        others,
        wire,
        failure: None,
    };
    Ok((mine, o))
}

/// Across processes: the peer's check, and side A's numbers for side B (the step
/// "validated"); the failure either side found, with who checked it, and the statistics.
fn agree(
    peer: &mut Option<Peer>,
    duration: bool,
    failure: Option<String>,
    stats: Option<LatStats>,
) -> Result<(Option<String>, LatStats)> {
    Ok(match peer {
        None => (failure, stats.unwrap_or_default()),
        Some(pr) if duration => {
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
    })
}

/// A size's row: a run of a duration's (perftest's duration row: the timed part's round trips
/// over its span) or a counted run's, as the number `--output` asks for, a JSON object, or the
/// table's row (`remote`: across processes, with the wire's counters).
pub(super) fn print_row(
    run: &Run,
    base_json: &Value,
    size: u64,
    o: &SizeOutcome,
    remote: bool,
) -> Result<()> {
    let (a, lp) = (&run.args.common, run.lp);
    if let Some(d) = lp.duration {
        // perftest's duration row: the timed part's round trips over its span.
        let (n, span_ns) = o.timed.context("side A measured no timed part")?;
        let secs = span_ns as f64 / 1e9;
        let t_avg = if n > 0 {
            span_ns as f64 / n as f64 / o.per
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
                    "bytes": size, "iterations": n, "warmup": o.warmup,
                    "duration_s": d.as_secs(), "time_s": secs, "t_avg_us": t_avg,
                    "tps_average": tps, "sent": o.sent, "validated": o.failure.is_none(),
                    "inline": o.inline, "other_cpu_cores": o.others, "cpu_util_pct": o.util,
                }),
            );
            let v = if remote {
                merge(v, json!({ "wire": o.wire }))
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
            if lp.cpu_util {
                cells.last_mut().expect("cells").1 = 14;
                cells.push((format!("{:.2}", o.util.unwrap_or(0.0)), 0));
            }
            println!("{}", table_row(&cells));
        }
    } else {
        print_counted_row(run, base_json, size, o, remote);
    }
    Ok(())
}

/// A counted run's row: the average, a JSON object with every statistic, or perftest's row.
fn print_counted_row(run: &Run, base_json: &Value, size: u64, o: &SizeOutcome, remote: bool) {
    let a = &run.args.common;
    let st = &o.st;
    if a.output.is_some() {
        println!("{}", output_number(st.avg));
    } else if a.json {
        let v = merge(
            base_json.clone(),
            json!({
                "bytes": size, "iterations": o.iters, "warmup": o.warmup,
                "t_min_us": st.min, "t_max_us": st.max, "t_typical_us": st.typical,
                "t_avg_us": st.avg, "t_stdev_us": st.stdev, "p99_us": st.p99,
                "p99_9_us": st.p999, "validated": o.failure.is_none(), "inline": o.inline,
                "other_cpu_cores": o.others,
            }),
        );
        // This side's wire port during the timed run, across processes.
        let v = if remote {
            merge(v, json!({ "wire": o.wire }))
        } else {
            v
        };
        println!("{v}");
    } else {
        let f = |x: f64| format!("{x:.2}");
        let cells = [
            size.to_string(),
            o.iters.to_string(),
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
}
