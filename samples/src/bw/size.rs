//! One size of a bandwidth run, [`run_size`], in its steps: fresh sources, the warm-up, the
//! poison, the timed run, then every destination this process holds checked (both processes
//! agree on the outcome).

use super::args::Inject;
use super::cpu::Receiver;
use super::engine::{drive, Engine};
use super::plan::{
    dst_buf, poison, reset_words, validate, validate_word, words_buf, Job, Keys, Plan,
};
use super::report::combine;
use super::report::Measured;
use super::setup::Run;
use super::verb::Verb;
use crate::{merge, output_number, table_row, OutputArg};
use crate::{pattern, step, wire_counters, wire_delta, CpuSample, OtherCpu, Peer, UserIdle};
use anyhow::{Context as _, Result};
use serde_json::json;
use serde_json::Value;

/// What the sizes' runs change: the initiator, SEND's receivers, the connection to the peer,
/// the record of the other processes' CPU, and scratch bytes for the patterns.
pub(super) struct Live<'a> {
    pub(super) engine: &'a mut Option<Engine>,
    pub(super) receivers: &'a mut Vec<Receiver>,
    pub(super) peer: &'a mut Option<Peer>,
    pub(super) other_cpu: &'a mut OtherCpu,
    pub(super) scratch: Vec<u8>,
}

/// What one size measured and found: this side's and the peer's timed runs, the CPU figures,
/// this side's wire counters, and the failure (either side's).
pub(super) struct SizeOutcome {
    pub(super) own: Option<Measured>,
    pub(super) theirs: Option<Measured>,
    /// CPU_Util[%] of the timed run (--cpu_util with -D).
    pub(super) util: Option<f64>,
    /// Other processes' cores during the timed run.
    pub(super) others: Option<f64>,
    /// This side's wire port during the timed run.
    pub(super) wire: Value,
    pub(super) failure: Option<String>,
}

/// One size: fresh sources, the warm-up, the poison, the timed run, the validation.
pub(super) fn run_size(run: &Run, live: &mut Live, plan: &Plan) -> Result<SizeOutcome> {
    fill_sources(run, plan, &mut live.scratch)?;
    reset_words(run.sides, &run.rv.jobs)?;
    warm_up(run, live, plan)?;
    poison_destinations(run, plan, &mut live.scratch)?;
    let mut o = timed_run(run, live, plan)?;
    if run.args.inject == Some(Inject::Corrupt) {
        corrupt(run, plan)?;
    }
    let failure = check_destinations(run, plan, &o, &mut live.scratch)?;
    o.failure = agree(live.peer, failure)?;
    Ok(o)
}

/// The seed of a job's bytes: that of the side its sources are on.
fn job_seed(seed: u64, job: &Job, verb: Verb) -> u64 {
    seed ^ job.data_side(verb).unwrap_or(job.dir) as u64
}

/// Fresh sources (READ: the target's): every source slot gets the size's pattern.
fn fill_sources(run: &Run, plan: &Plan, scratch: &mut Vec<u8>) -> Result<()> {
    let seed = pattern::seed(1, plan.size);
    for (d, sd) in run.sides.iter().enumerate() {
        if let Some((b, _)) = sd.as_ref().and_then(|s| s.src.as_ref()) {
            for s in 0..plan.src_slots as u64 {
                pattern::fill(scratch, seed ^ d as u64, s, plan.size as usize);
                b.write((s * plan.size) as usize, scratch)?;
            }
        }
    }
    Ok(())
}

/// The keys of the jobs this process drives (`bad`: a wrong rkey, `--inject bad-rkey`).
fn keys(run: &Run, bad: bool) -> Keys {
    Keys::new(
        &run.rv.jobs,
        run.rp.verb,
        &run.rp.local,
        run.sides,
        run.peer_dst,
        bad,
    )
}

/// Warm-up, untimed (with the right keys: a failing warm-up would hide the injection); both
/// processes take the step "warm-up".
fn warm_up(run: &Run, live: &mut Live, plan: &Plan) -> Result<()> {
    let (a, rp) = (&run.args.common, run.rp);
    let Live {
        engine,
        receivers,
        peer,
        ..
    } = live;
    let warm = if plan.warmup > 0 {
        drive(
            receivers,
            plan,
            plan.warmup,
            a.wait(),
            peer,
            rp.verb == Verb::Send,
            None,
            || match engine {
                Some(e) => e
                    .run(
                        plan,
                        &run.rv.jobs,
                        &rp.local,
                        &keys(run, false),
                        plan.warmup,
                        a,
                        &run.qpns,
                        false,
                    )
                    .map(|_| ()),
                None => Ok(()),
            },
        )
    } else {
        Ok(())
    };
    step(peer, "warm-up", warm)?;
    Ok(())
}

/// The checking side poisons its destinations once the warm-up is done (and an atomic's
/// target sets its words back to their base).
fn poison_destinations(run: &Run, plan: &Plan, scratch: &mut Vec<u8>) -> Result<()> {
    let verb = run.rp.verb;
    let seed = pattern::seed(1, plan.size);
    for (j, job) in run.rv.jobs.iter().enumerate() {
        if let Some(b) = dst_buf(run.sides, job, verb) {
            poison(b, verb, plan, j, job_seed(seed, job, verb), scratch)?;
        }
    }
    reset_words(run.sides, &run.rv.jobs)
}

/// The timed run, after the step "poisoned" that lets the peer start; both processes take
/// the step "timed", which gives each what the other measured.
fn timed_run(run: &Run, live: &mut Live, plan: &Plan) -> Result<SizeOutcome> {
    let (args, rp, env) = (run.args, run.rp, run.env);
    let a = &args.common;
    let verb = rp.verb;
    let Live {
        engine,
        receivers,
        peer,
        other_cpu,
        ..
    } = live;
    // Before the step that lets the peer start: once it returns the peer's packets may
    // arrive (and be answered) before this thread runs again.
    let wire_before = wire_counters(&env.ctx);
    step(peer, "poisoned", Ok(()))?;
    let cpu = CpuSample::now();
    let util_before = rp.cpu_util.then(UserIdle::now).flatten();
    let mine: Result<Option<Measured>> = drive(
        receivers,
        plan,
        plan.iters,
        a.wait(),
        peer,
        verb == Verb::Send,
        // SEND with -D: the receivers learn the count when the sender is done.
        (verb == Verb::Send && args.duration.is_some())
            .then_some((|m: &Option<Measured>| m.map(|m| m.iters)) as fn(&_) -> _),
        || match engine {
            Some(e) => e
                .run(
                    plan,
                    &run.rv.jobs,
                    &rp.local,
                    &keys(run, args.inject == Some(Inject::BadRkey)),
                    plan.iters,
                    a,
                    &run.qpns,
                    true,
                )
                .map(|t| {
                    Some(Measured {
                        msgs: t.iters as f64 * rp.local.len() as f64,
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
    let theirs = step(peer, "timed", mine)?.flatten();
    let others = other_cpu.record(cpu.and_then(CpuSample::others_since));
    let wire = wire_delta(&wire_before, &wire_counters(&env.ctx));
    Ok(SizeOutcome {
        own,
        theirs,
        util,
        others,
        wire,
        failure: None,
    })
}

/// `--inject corrupt`: one flipped bit in the first job's destination, a write that arrived
/// corrupted (not the poison).
fn corrupt(run: &Run, plan: &Plan) -> Result<()> {
    if let Some(b) = dst_buf(run.sides, &run.rv.jobs[0], run.rp.verb) {
        let off = plan.dst_off[0] as usize + plan.size as usize / 2;
        // One flipped bit: a write that arrived corrupted (not the poison).
        let mut x = [0u8];
        b.read(off, &mut x)?;
        b.write(off, &[x[0] ^ 0x01])?;
    }
    Ok(())
}

/// The iterations the jobs of direction `dir` ran (its sender's count: with -D, as the
/// duration took).
fn ran(run: &Run, o: &SizeOutcome, dir: usize) -> Result<u32> {
    match run.rp.me {
        Some(m) if m != dir => o.theirs.map(|t| t.iters),
        _ => o.own.map(|t| t.iters),
    }
    .with_context(|| format!("no iteration count for the QPs of side {dir}"))
}

/// Every byte of the destinations this process holds (and every atomic word): the first
/// failure, if any.
fn check_destinations(
    run: &Run,
    plan: &Plan,
    o: &SizeOutcome,
    scratch: &mut Vec<u8>,
) -> Result<Option<String>> {
    let verb = run.rp.verb;
    let seed = pattern::seed(1, plan.size);
    let mut failure = None;
    for (j, job) in run.rv.jobs.iter().enumerate() {
        if let Some(w) = words_buf(run.sides, job) {
            if let Err(e) = validate_word(w, j, ran(run, o, job.dir)?) {
                failure = Some(format!("QP {:#x} (job {j}): {e}", run.rv.sender_qpn[j]));
                break;
            }
        }
        let Some(b) = dst_buf(run.sides, job, verb) else {
            continue;
        };
        let done = Plan {
            iters: ran(run, o, job.dir)?,
            ..plan.clone()
        };
        let jseed = job_seed(seed, job, verb);
        if let Err(e) = validate(b, verb, &done, plan.iters, j, jseed, scratch) {
            failure = Some(format!("QP {:#x} (job {j}): {e}", run.rv.sender_qpn[j]));
            break;
        }
    }
    Ok(failure)
}

/// Across processes both take the step "validated": the failure either side found, with who
/// checked it.
fn agree(peer: &mut Option<Peer>, failure: Option<String>) -> Result<Option<String>> {
    Ok(match peer {
        None => failure,
        Some(p) => {
            let theirs: Option<String> = p.step("validated", Ok(failure.clone()))?;
            let by = |f: String, who: &str| format!("{f} (checked by the {who})");
            failure
                .map(|f| by(f, p.role))
                .or_else(|| theirs.map(|f| by(f, p.peer_role)))
        }
    })
}

/// A size's row: the number `--output` asks for, a JSON object, or the table's row
/// (`inline`: the WQEs this side posted inline; `remote`: across processes, with the wire's
/// counters).
pub(super) fn print_row(
    run: &Run,
    base_json: &Value,
    plan: &Plan,
    o: &SizeOutcome,
    inline: Option<u64>,
    remote: bool,
) {
    let (args, rp) = (run.args, run.rp);
    let a = &args.common;
    let measured: Vec<Measured> = o.own.into_iter().chain(o.theirs).collect();
    let (peak, avg, mpps, secs) = combine(&measured, plan.size, rp.units);
    // perftest's #iterations: one side's iterations times its QPs (with -b, one
    // direction's, as ib_write_bw prints them).
    let iters = measured.first().map_or(0, |m| m.iters);
    let reported = u64::from(iters) * u64::from(args.qps);
    if let Some(out) = a.output {
        println!(
            "{}",
            output_number(match out {
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
                "time_s": secs, "validated": o.failure.is_none(),
                "other_cpu_cores": o.others, "cpu_util_pct": o.util,
                "inline_wqes": inline,
            }),
        );
        if remote {
            // This side's wire port during the timed run.
            v = merge(v, json!({ "wire": o.wire }));
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
        if rp.cpu_util {
            cells.last_mut().expect("cells").1 = 16;
            cells.push((format!("{:.2}", o.util.unwrap_or(0.0)), 0));
        }
        println!("{}", table_row(&cells));
    }
}
