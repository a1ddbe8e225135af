//! Soft NIC benchmark: CPU-initiated loopback between two soft QPs on two soft devices, host
//! memory.
//!
//! Measures, in one run:
//! - `write_rate`: 8-byte RDMA_WRITE message rate with the SQ kept full, `--batch` WQEs per
//!   doorbell and one signaled WQE in `--signal` (the initiator and the engine run at once);
//! - `write_rate_burst`: the same WQEs, but the whole SQ is written first and announced with one
//!   doorbell, so the time is the engine's alone;
//! - `write_bw`: `--size` (1 MiB) RDMA_WRITE bandwidth with `--depth` writes in flight, next to a
//!   plain memcpy of the same bytes between the same buffers (on this thread, and on another
//!   thread that sleeps between rounds as the engine does), measured in alternating rounds;
//! - `write_latency`: doorbell-to-CQE time of single 8-byte writes with the engine spinning,
//!   asleep and woken by the initiator, and asleep and finding the doorbell by polling (as it
//!   finds a GPU's).
//!
//! Each measurement also reports how much CPU other processes took meanwhile
//! (`other_cpu_cores`): on a 2-core machine the benchmark needs both cores.
//!
//! Every transfer is checked: each signaled completion must name the expected WQE and its
//! destination must hold that WQE's value; at the end every destination slot must hold its last
//! write; every bandwidth destination must hold the pattern of its round (a new one per round).
//! An error CQE aborts the run with the decoded error.
//!
//! `softnic_bench [--ring rdma-core|doca|bf] [--batch N] [--signal N] [--seconds S | --iters N]
//! [--inline] [--tests rate,burst,bw,latency] [--json]`
//!
//! Files: this one holds the run and its report ([`main`]); `args` the options; `loopback` the
//! two soft devices and their QPs; `rate` the message-rate and latency measurements; `bw` the
//! bandwidth measurement next to memcpy.

mod args;
mod bw;
mod loopback;
mod rate;

use anyhow::{bail, Context, Result};
use args::{Args, Stop, Test};
use bw::{bandwidth, measure_memcpy, memcpy_rate};
use clap::Parser;
use gpuverbs_samples::CpuSample;
use loopback::{Loopback, SLOT};
use rate::{latency, percentile, RateRun};
use serde_json::json;
use std::time::{Duration, Instant};

/// The target for 8-byte writes, per engine thread.
const TARGET_MSGS_PER_S: f64 = 2.0e6;

/// The target for 1 MiB writes, as a fraction of memcpy.
const TARGET_BW_RATIO: f64 = 0.5;

/// What the measurements found: the JSON lines, the table's rows, and the most CPU other
/// processes took during one.
#[derive(Default)]
struct Report {
    lines: Vec<serde_json::Value>,
    rows: Vec<[String; 6]>,
    busiest: f64,
}

/// How long the measurements run (a count or a duration) and their warm-ups.
struct Stops {
    measure: Stop,
    warm: Stop,
}

fn main() -> Result<()> {
    let args = Args::parse();
    check_args(&args)?;
    let stops = Stops {
        measure: match args.iters {
            Some(n) => Stop::Count(n.max(1)),
            None => Stop::After(Duration::from_secs_f64(args.seconds)),
        },
        warm: Stop::After(Duration::from_secs_f64(args.warmup)),
    };
    let mut report = Report::default();
    let rate_tests = args
        .tests
        .iter()
        .any(|t| matches!(t, Test::Rate | Test::Burst));
    if rate_tests {
        message_rates(&args, &stops, &mut report)?;
    }
    if args.tests.contains(&Test::Bw) {
        write_bw(&args, &stops, &mut report)?;
    }
    if args.tests.contains(&Test::Latency) {
        write_latency(&args, &mut report)?;
    }
    if args.tests.contains(&Test::Idle) {
        idle_cpu(&args, &mut report)?;
    }
    print_report(&args, &report);
    Ok(())
}

/// The options' checks: the SQ, the batch and the signaling fit each other, the bandwidth
/// test's size and depth.
fn check_args(args: &Args) -> Result<()> {
    if args.sq_blocks < 2 || !args.sq_blocks.is_power_of_two() {
        bail!("--sq-blocks must be a power of two ≥ 2");
    }
    if args.batch == 0 || args.batch > args.sq_blocks {
        bail!("--batch must be 1..=sq_blocks");
    }
    // A full SQ (more than sq_blocks - batch blocks outstanding) must hold a signaled WQE.
    if args.signal == 0 || args.signal > args.sq_blocks - args.batch + 1 {
        bail!("--signal must be 1..=sq_blocks - batch + 1");
    }
    if args.size == 0 || args.size % 8 != 0 || args.size > 1 << 30 || args.depth == 0 {
        bail!("--size must be a multiple of 8 up to 1 GiB, --depth ≥ 1");
    }
    if args.depth as u64 > args.sq_blocks as u64 {
        bail!("--depth must not exceed --sq-blocks");
    }
    Ok(())
}

/// `write_rate` and `write_rate_burst` (those asked for): 8-byte writes with the SQ kept full,
/// and whole SQs announced with one doorbell, next to memcpy's copy rate; then every slot
/// checked.
fn message_rates(args: &Args, stops: &Stops, report: &mut Report) -> Result<()> {
    let (measure, warm) = (stops.measure, stops.warm);
    let ring = args.ring.name();
    let mut lb = Loopback::new(args, args.ring, args.sq_blocks as usize * SLOT, true)?;
    let memcpy = memcpy_rate(args.sq_blocks as usize, measure_memcpy(measure));
    let mut run = RateRun::new(&mut lb, args);
    for test in [Test::Rate, Test::Burst] {
        if !args.tests.contains(&test) {
            continue;
        }
        let (r, others) = if test == Test::Rate {
            run.steady(args.batch, warm)?;
            let cpu = CpuSample::now();
            (
                run.steady(args.batch, measure)?,
                cpu.and_then(CpuSample::others_since),
            )
        } else {
            run.bursts(warm)?;
            let cpu = CpuSample::now();
            (run.bursts(measure)?, cpu.and_then(CpuSample::others_since))
        };
        run.drain()?;
        report.busiest = report.busiest.max(others.unwrap_or(0.0));
        let name = if test == Test::Rate {
            "write_rate"
        } else {
            "write_rate_burst"
        };
        let per_db = r.msgs as f64 / r.doorbells.max(1) as f64;
        report.lines.push(json!({
            "test": name,
            "size": SLOT,
            "ring": ring,
            "inline": args.inline,
            "batch": if test == Test::Rate { args.batch } else { args.sq_blocks },
            "signal_every": args.signal,
            "sq_blocks": args.sq_blocks,
            "engine_threads": 1,
            "msgs": r.msgs,
            "seconds": r.secs,
            "msgs_per_s": r.rate(),
            "msgs_per_doorbell": per_db,
            "initiator_post_ns_per_msg": r.post_ns_per_msg,
            "memcpy_copies_per_s": memcpy,
            "target_msgs_per_s": TARGET_MSGS_PER_S,
            "target_met": r.rate() >= TARGET_MSGS_PER_S,
            "other_cpu_cores": others,
        }));
        report.rows.push([
            name.into(),
            "8 B".into(),
            format!("{}msg/s", human_rate(r.rate())),
            format!("{}copies/s", human_rate(memcpy)),
            "≥ 2 M/s/engine thread".into(),
            yes_no(r.rate() >= TARGET_MSGS_PER_S).into(),
        ]);
    }
    run.check_all_slots()?;
    drop(run);
    lb.check_clean()
}

/// `write_bw`: `--size` writes, `--depth` in flight, next to memcpy (on this thread and on
/// another).
fn write_bw(args: &Args, stops: &Stops, report: &mut Report) -> Result<()> {
    let (measure, warm) = (stops.measure, stops.warm);
    let ring = args.ring.name();
    let mut lb = Loopback::new(args, args.ring, args.size * args.depth, true)?;
    let mut k = 1u64;
    bandwidth(&mut lb, args.size, args.depth, warm, &mut k)?;
    let cpu = CpuSample::now();
    let r = bandwidth(&mut lb, args.size, args.depth, measure, &mut k)?;
    let others = cpu.and_then(CpuSample::others_since);
    report.busiest = report.busiest.max(others.unwrap_or(0.0));
    lb.check_clean()?;
    let (gb, mc, mt) = (r.gbps(r.engine), r.gbps(r.memcpy), r.gbps(r.memcpy_thread));
    let ratio = gb / mc;
    report.lines.push(json!({
        "test": "write_bw",
        "size": args.size,
        "ring": ring,
        "depth": args.depth,
        "engine_threads": 1,
        "writes": r.writes,
        "seconds": r.engine.as_secs_f64(),
        "gb_per_s": gb,
        "memcpy_gb_per_s": mc,
        "ratio": ratio,
        "memcpy_other_thread_gb_per_s": mt,
        "ratio_other_thread": gb / mt,
        "target_ratio": TARGET_BW_RATIO,
        "target_met": ratio >= TARGET_BW_RATIO,
        "other_cpu_cores": others,
    }));
    report.rows.push([
        "write_bw".into(),
        size_name(args.size),
        format!("{gb:.2} GB/s"),
        format!(
            "{mc:.2} GB/s ({:.0}%); other thread {mt:.2} GB/s ({:.0}%)",
            ratio * 100.0,
            gb / mt * 100.0
        ),
        "≥ 50% of memcpy".into(),
        yes_no(ratio >= TARGET_BW_RATIO).into(),
    ]);
    Ok(())
}

/// `write_latency`: doorbell-to-CQE times of single 8-byte writes, the engine spinning, asleep
/// and woken, and asleep and polling.
fn write_latency(args: &Args, report: &mut Report) -> Result<()> {
    let ring = args.ring.name();
    if args.latency_samples == 0 {
        bail!("--latency-samples must be ≥ 1");
    }
    let gap = Duration::from_millis(2);
    for (engine, kick, gap) in [
        ("spinning", true, Duration::ZERO),
        ("asleep", true, gap),
        ("asleep", false, gap),
    ] {
        let mut lb = Loopback::new(args, args.ring, args.sq_blocks as usize * SLOT, kick)?;
        let cpu = CpuSample::now();
        let us = latency(&mut lb, args, gap, args.latency_samples)?;
        let others = cpu.and_then(CpuSample::others_since);
        report.busiest = report.busiest.max(others.unwrap_or(0.0));
        lb.check_clean()?;
        let doorbell = if kick { "kicked" } else { "polled" };
        let (p50, p99, max) = (
            percentile(&us, 0.5),
            percentile(&us, 0.99),
            percentile(&us, 1.0),
        );
        report.lines.push(json!({
            "test": "write_latency",
            "size": SLOT,
            "ring": ring,
            "engine": engine,
            "doorbell": doorbell,
            "idle_gap_us": gap.as_micros() as u64,
            "engine_threads": 1,
            "samples": us.len(),
            "median_us": p50,
            "p99_us": p99,
            "max_us": max,
            "other_cpu_cores": others,
        }));
        report.rows.push([
            format!("write_latency ({engine}, {doorbell})"),
            "8 B".into(),
            format!("median {p50:.1} µs, p99 {p99:.1} µs, max {max:.1} µs"),
            "-".into(),
            "-".into(),
            "-".into(),
        ]);
    }
    Ok(())
}

/// `idle_cpu`: the CPU the idle engines take, per engine thread, once they sleep.
fn idle_cpu(args: &Args, report: &mut Report) -> Result<()> {
    let lb = Loopback::new(args, args.ring, SLOT, false)?;
    // Let the engines fall through their spin phase into parked sleep first.
    std::thread::sleep(Duration::from_millis(500));
    let window = Duration::from_secs(3);
    let (t0, c0) = (Instant::now(), process_cpu_seconds()?);
    std::thread::sleep(window);
    let (elapsed, c1) = (t0.elapsed().as_secs_f64(), process_cpu_seconds()?);
    lb.check_clean()?;
    // Two devices, one engine thread each; nothing else of this process runs meanwhile.
    let per_engine = (c1 - c0) / elapsed / 2.0;
    report.lines.push(json!({
        "test": "idle_cpu",
        "engine_threads": 2,
        "window_s": elapsed,
        "cpu_cores_per_engine": per_engine,
        "target": "< 0.05",
    }));
    report.rows.push([
        "idle_cpu (per engine thread)".into(),
        "-".into(),
        format!("{:.2}% of a core", per_engine * 100.0),
        "-".into(),
        "< 5% of one core".into(),
        if per_engine < 0.05 { "yes" } else { "no" }.into(),
    ]);
    Ok(())
}

/// The report: one JSON object per measurement (`--json`), or the setup line, the table and
/// a warning when other processes took much CPU.
fn print_report(args: &Args, report: &Report) {
    let ring = args.ring.name();
    if args.json {
        for l in &report.lines {
            println!("{l}");
        }
        return;
    }
    println!(
        "soft NIC loopback, CPU initiator: ring {ring}, batch {}, signal every {}, SQ {} blocks, {} payload, bandwidth depth {}; 1 engine thread",
        args.batch,
        args.signal,
        args.sq_blocks,
        if args.inline { "inline" } else { "SGE" },
        args.depth
    );
    let head = ["test", "size", "soft NIC", "memcpy", "target", "met"];
    let mut w = head.map(|h| h.chars().count());
    for r in &report.rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let s: Vec<String> = cells
            .iter()
            .zip(w)
            .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
            .collect();
        println!("{}", s.join("  ").trim_end());
    };
    line(&head.map(String::from));
    for r in &report.rows {
        line(r);
    }
    if report.busiest > 0.1 {
        println!(
            "warning: other processes used up to {:.2} cores during a measurement; the figures are low",
            report.busiest
        );
    }
}

fn human_rate(r: f64) -> String {
    if r >= 1e9 {
        format!("{:.2} G", r / 1e9)
    } else {
        format!("{:.2} M", r / 1e6)
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}

fn size_name(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

/// This process's user + system CPU time so far, in seconds (from /proc/self/stat).
fn process_cpu_seconds() -> Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc/self/stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> Result<f64> {
        Ok(f.get(i).context("short /proc/self/stat")?.parse::<f64>()?)
    };
    // rest starts at field 3 (state): utime is field 14, stime 15.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}
