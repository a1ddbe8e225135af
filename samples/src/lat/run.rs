//! One latency run, [`run`]: the rendezvous and the device, the sides and their connection, the
//! header, the initiator, then every size (warm-up and timed round trips, validation, row).

use super::args::{
    iterations, Args, Inject, Test, BYTES_PER_SIZE, DEFAULT_ITERS, DEFAULT_OUTS, MIN_ITERS,
};
use super::engine::Engine;
use super::gpu::GpuLat;
use super::report::{LAT_COLUMNS, LAT_DUR_COLUMNS};
use super::side::{pad, tail_len, validate, Side, Target};
use crate::bw::{atomic_base, Verb};
use crate::{
    address_lines_of, check_placement, common_header, common_json, connect_options, connect_pair,
    cpu_ring_mode, doorbell_line, error_text, merge, mtu_line, open_env, open_env_remote,
    output_number, pattern, remote_header, remote_json, step, table_row, tx_depth_for,
    wire_counters, wire_delta, with_mtu, CpuSample, Exports, GpuStatus, Header, Initiator,
    LatStats, OtherCpu, Peer, Progress, QpSpec, UserIdle,
};
use anyhow::{bail, Context as _, Result};
use gpuverbs::post::{RemoteAddr, Rkey};
use gpuverbs::{Endpoint, Mr, Qp, RemoteMemory};
use serde_json::json;
use std::time::Duration;

pub(super) fn run(args: &Args, t: &Test) -> Result<()> {
    let a = &args.common;
    let verb = t.verb;
    #[allow(non_snake_case)]
    let TEST = t.name;
    let sizes = a.sizes(t.default_size);
    let outs = args.outs.unwrap_or(DEFAULT_OUTS);
    let duration = args.duration.map(|d| Duration::from_secs(d.into()));
    // perftest reports CPU utilisation in duration mode only (and warns otherwise).
    let cpu_util = args.cpu_util && duration.is_some();
    if args.cpu_util && !cpu_util {
        eprintln!("{TEST}: --cpu_util: CPU Utilization works only with Duration mode (-D)");
    }
    // The inline limit asked for (perftest's default).
    let inline_max = args.inline_size.unwrap_or(t.inline.unwrap_or(0));
    let largest_inline = sizes
        .iter()
        .copied()
        .filter(|&s| s <= inline_max as u64)
        .max();
    // An inline WQE takes ctrl + raddr + the inline header and data, in 64-byte blocks.
    let wqe_blocks = largest_inline.map_or(1, |s| (36 + s).div_ceil(64));
    // Two WQEs per iteration with --signal (write + atomic), one CQE per --cq-mod iterations.
    let tx = tx_depth_for(a.tx_depth, (2 * a.cq_mod as u64 + 2) * wqe_blocks)?;
    let spec = QpSpec {
        tx_depth: tx,
        rings: a.rings,
        db: a.db,
    };
    let max = *sizes.iter().max().expect("one size at least");
    let len = (max.next_multiple_of(8) as usize).max(8);
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
    let ring_mode = match env.initiator {
        Initiator::Cpu => Some(cpu_ring_mode(a.db)?),
        Initiator::Gpu => None,
    };
    check_placement(a, &env)?;
    if let Some(p) = peer.as_ref().filter(|p| p.addr.ip().is_loopback()) {
        if env.initiator == Initiator::Gpu && matches!(verb, Verb::Send | Verb::Write) {
            // Measured on the H200: 2.2 ms per message without MPS, 16 µs with it.
            eprintln!(
                "{TEST}: note: the {} is on this host, and both sides run a resident kernel: \
                 when they share a GPU without MPS (nvidia-cuda-mps-control -d), the GPU \
                 time-slices the two processes and each message waits for the other's slice \
                 (milliseconds); with MPS, or a GPU each, they run at once",
                p.peer_role
            );
        }
    }
    // Loopback: both sides, on one device (a PD each). Across processes: this side (the client
    // is A, the server B), and where its messages go on the peer.
    let me = peer.as_ref().map(Peer::side);
    let mut sides: Vec<Side> = Vec::new();
    let mut targets: Vec<Target> = Vec::new();
    let mut peer_ep: Option<Endpoint> = None;
    match (&mut peer, me) {
        (Some(p), Some(_)) => {
            let pd = env.ctx.alloc_pd();
            let s = Side::new(&pd, spec, env.gpu.as_ref(), a.mem, len, verb)?;
            let export = |mr: &Mr| RemoteMemory::export_rkey(mr.addr(), mr.len(), mr.rkey().0);
            let facts = json!({
                "recv": export(&s.recv_mr)?, "sig": export(&s.sig_mr)?, "src": export(&s.src_mr)?,
            });
            let params = json!({
                "sizes": sizes, "iters": a.iters, "warmup": a.warmup, "signal": args.signal,
                "duration_s": args.duration,
            });
            let hello = p.hello(
                a,
                TEST,
                params,
                vec![with_mtu(&s.qp.endpoint(), a.mtu)],
                facts,
            )?;
            let remote = |k: &str| -> Result<RemoteMemory> {
                serde_json::from_value(hello.facts[k].clone())
                    .with_context(|| format!("the {}'s {k} buffer", p.peer_role))
            };
            let (recv, sig, src) = (remote("recv")?, remote("sig")?, remote("src")?);
            if recv.len() < len as u64 || sig.len() < 8 || src.len() < len as u64 {
                bail!(
                    "the {}'s buffers are too small ({} B to receive, {} B of signal word)",
                    p.peer_role,
                    recv.len(),
                    sig.len()
                );
            }
            let ep = hello.endpoints[0].clone();
            s.qp.connect(&with_mtu(&ep, a.mtu), connect_options())
                .with_context(|| format!("connect to the {} ({ep})", p.peer_role))?;
            targets.push(Target {
                recv: RemoteAddr {
                    addr: recv.addr(),
                    rkey: Rkey(recv.rkey()),
                },
                sig: RemoteAddr {
                    addr: sig.addr(),
                    rkey: Rkey(sig.rkey()),
                },
                src: RemoteAddr {
                    addr: src.addr(),
                    rkey: Rkey(src.rkey()),
                },
            });
            sides.push(s);
            peer_ep = Some(ep);
        }
        _ => {
            let (pa, pb) = (env.ctx.alloc_pd(), env.ctx.alloc_pd());
            sides = vec![
                Side::new(&pa, spec, env.gpu.as_ref(), a.mem, len, verb)?,
                Side::new(&pb, spec, env.gpu.as_ref(), a.mem, len, verb)?,
            ];
            connect_pair(&sides[0].qp, &sides[1].qp, a.mtu)?;
            targets = (0..2).map(|i| Target::of(&sides[1 - i])).collect();
        }
    }
    for s in &sides {
        a.check_dmabuf(&s.src_mr, "source")?;
        a.check_dmabuf(&s.recv_mr, "receive")?;
        a.check_dmabuf(&s.sig_mr, "signal")?;
    }
    // The side number (A = 0, B = 1) of each entry of `sides`.
    let ids: Vec<usize> = match me {
        Some(m) => vec![m],
        None => vec![0, 1],
    };

    let mut other_cpu = OtherCpu::sample_before_run();
    let mut h = Header::new(format!("{} Latency Test ({TEST})", verb.title()));
    common_header(
        &mut h,
        &env,
        a,
        doorbell_line(&sides[0].qp, env.initiator, ring_mode, a.db),
    );
    if let (Some(p), Some(ep)) = (&peer, &peer_ep) {
        remote_header(&mut h, a, p, &env.ctx, ep);
    }
    h.line(
        "Posting",
        match (env.initiator, me, t.one_sided()) {
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
        },
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
        .line("TX depth", format!("{tx} blocks"))
        .line(
            "Mtu",
            mtu_line(a.mtu, &env.ctx, &sides[0].qp.endpoint(), peer_ep.as_ref()),
        )
        .line("GID index", env.ctx.gid_index());
    if verb.has_inline() {
        h.line("Max inline data", format!("{inline_max}[B]"));
    }
    if verb.has_outs() {
        h.line("Outstand reads", outs);
    }
    h.line(
        "Iterations",
        match (args.duration, a.iters) {
            (Some(d), _) => format!(
                "as many as {d} s take, per size, after the warm-up (-D; each side stops on its \
                 own clock)"
            ),
            (None, Some(n)) => format!("{n} per size"),
            (None, None) => format!(
                "per size: {DEFAULT_ITERS}, or {} MiB worth when less (at least {MIN_ITERS})",
                BYTES_PER_SIZE >> 20
            ),
        },
    )
    .line(
        "Times",
        format!(
            "{}, microseconds{}",
            if t.one_sided() {
                "the whole operation (perftest's: not halved)"
            } else {
                "half round trip"
            },
            if peer.is_some() {
                ", measured by side A (the client)"
            } else {
                ""
            }
        ),
    )
    .line(
        "Validation",
        match (verb, peer.is_some()) {
            (Verb::Atomic(_), _) => {
                "every fetched value (side A) and the target word's final value (side B), \
                 every size"
            }
            (Verb::Read, _) => "side A's receive buffer (what it read), every byte, every size",
            (_, true) => {
                "each side its receive buffer, every byte, every size (reported to the peer)"
            }
            (_, false) => "both receive buffers, every byte, every size",
        },
    );
    other_cpu.header(&mut h);
    let table = !a.json && a.output.is_none();
    if a.output.is_none() {
        h.print(a.json);
        // perftest's address lines: this side's QP, then the peer's (each with the buffer
        // the other reaches: WRITE's receive buffer, READ's source).
        let fmt = verb.addr_format(outs);
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
        match (&peer_ep, targets.first()) {
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
        let mut cols: Vec<(String, usize)> = match duration {
            Some(_) => LAT_DUR_COLUMNS.map(|(n, w)| (n.to_string(), w)).to_vec(),
            None => LAT_COLUMNS.map(|(n, w)| (n.to_string(), w)).to_vec(),
        };
        if cpu_util {
            cols.last_mut().expect("columns").1 = 14;
            cols.push(("CPU_Util[%]".into(), 0));
        }
        println!("{}", table_row(&cols));
    }
    let mut base_json = merge(
        common_json(&env, a, &sides[0].qp),
        json!({
            "test": TEST, "signal": args.signal, "cq_mod": a.cq_mod, "tx_depth": tx,
            "duration_s": args.duration,
            "inline_size": inline_max, "verb": verb.title(),
            "outs": verb.has_outs().then_some(outs),
        }),
    );
    if let (Some(p), Some(ep)) = (&peer, &peer_ep) {
        base_json = merge(base_json, remote_json(a, p, &env.ctx, ep));
    }

    let mut engine = match env.initiator {
        Initiator::Cpu => {
            let mode = ring_mode.expect("CPU ring mode");
            Engine::Cpu(sides.iter().map(|s| s.qp.cpu_initiator(mode)).collect())
        }
        Initiator::Gpu => {
            let gpu = env.gpu.clone().expect("GPU initiator has a GPU");
            let qps: Vec<&Qp> = sides.iter().map(|s| &s.qp).collect();
            let exports = Exports::new(&gpu, &qps)?;
            let mut mapped = Vec::new();
            for s in &sides {
                mapped.push([
                    s.src.gpu_addr(&gpu)?,
                    s.recv.gpu_addr(&gpu)?,
                    s.sig.gpu_addr(&gpu)?,
                    s.fetch.gpu_addr(&gpu)?,
                ]);
            }
            let status = GpuStatus::new(&gpu)?;
            Engine::Gpu(Box::new(GpuLat {
                gpu,
                exports,
                mapped,
                status,
                verb,
            }))
        }
    };

    let mut progress = Progress::new(TEST, sizes.len());
    let mut scratch = Vec::new();
    for (n, &size) in sizes.iter().enumerate() {
        let (iters, warmup) = iterations(a, size);
        // With -D the engines run the warm-up counted, then the duration.
        let total = match duration {
            Some(_) => warmup,
            None => iters + warmup,
        };
        let seed = pattern::seed(2, size);
        let (p, tl) = (pad(size) as usize, tail_len(size));
        for (&i, s) in ids.iter().zip(&sides) {
            match verb {
                Verb::Write | Verb::Send => {
                    pattern::fill(&mut scratch, seed ^ i as u64, 0, size as usize - tl);
                    for copy in [0, s.src_stride] {
                        s.src.write(copy + p, &scratch)?;
                        s.src.fill(copy + p + size as usize - tl, tl, 0)?;
                    }
                    s.recv.fill(0, s.recv.len(), 0)?;
                    s.sig.write(0, &0u64.to_ne_bytes())?;
                }
                Verb::Read => {
                    // The source is poisoned, then filled; the receive buffer (where the
                    // reads land) holds the complement of the peer's pattern.
                    pattern::fill(&mut scratch, seed ^ i as u64, 0, size as usize);
                    scratch.iter_mut().for_each(|x| *x = !*x);
                    s.src.write(p, &scratch)?;
                    scratch.iter_mut().for_each(|x| *x = !*x);
                    s.src.write(p, &scratch)?;
                    s.recv.fill(0, s.recv.len(), 0)?;
                    pattern::fill(&mut scratch, seed ^ (1 - i) as u64, 0, size as usize);
                    scratch.iter_mut().for_each(|x| *x = !*x);
                    s.recv.write(p, &scratch)?;
                }
                Verb::Atomic(_) => {
                    s.sig.write(0, &atomic_base(0).to_ne_bytes())?;
                    s.fetch.write(0, &(!atomic_base(0)).to_ne_bytes())?;
                }
            }
        }
        // Before the step that lets the peer start (its packets may arrive, and be answered,
        // before this thread runs again after it).
        let wire_before = wire_counters(&env.ctx);
        // Across processes A sends only once B has cleared its buffers.
        step(&mut peer, "ready", Ok(()))?;
        let cpu = CpuSample::now();
        let inline = size <= inline_max as u64;
        let util_before = cpu_util.then(UserIdle::now).flatten();
        let ran = engine.run(
            &sides,
            &ids,
            &targets,
            verb,
            size,
            total,
            duration,
            args.signal,
            inline,
            a,
        );
        let util = util_before.zip(UserIdle::now()).map(|(b, e)| b.util_to(e));
        let others = other_cpu.record(cpu.and_then(CpuSample::others_since));
        let wire = wire_delta(&wire_before, &wire_counters(&env.ctx));
        // Side A's times (B has none), and what each side sent: the peer's counts, across
        // processes, come with this step.
        let mine = ran.as_ref().ok().cloned().unwrap_or_default();
        let theirs = step(&mut peer, "ran", ran.map(|r| (r.sent, r.timed)))?;
        let (their_sent, their_timed) = theirs.unwrap_or_default();
        let sent = [0, 1].map(|i| mine.sent[i].or(their_sent[i]).unwrap_or(0));
        let timed = mine.timed.or(their_timed);
        if let (Some(Inject::Corrupt), Some(k)) = (args.inject, ids.iter().position(|&i| i == 0)) {
            let (b, off) = match verb {
                Verb::Atomic(_) => (&sides[k].fetch, 3),
                _ => (&sides[k].recv, p + size as usize / 2),
            };
            let mut x = [0u8];
            b.read(off, &mut x)?;
            b.write(off, &[x[0] ^ 0x01])?;
        }
        let failure = validate(
            &sides,
            &ids,
            verb,
            size,
            sent,
            seed,
            args.signal,
            &mut scratch,
        )
        .err()
        .map(|e| error_text(&e));
        // Half a round trip (WRITE, SEND), or the whole operation (READ, atomics: perftest's).
        let per = if t.one_sided() { 1e3 } else { 2e3 };
        let stats = mine.rtt.map(|rtt| {
            let mut us: Vec<f64> = rtt[warmup as usize..]
                .iter()
                .map(|&t| t as f64 / per)
                .collect();
            LatStats::of(&mut us)
        });
        // Across processes: the peer's check, and side A's numbers for side B.
        let (failure, st) = match &mut peer {
            None => (failure, stats.unwrap_or_default()),
            Some(pr) if duration.is_some() => {
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
        };
        progress.clear();
        if let Some(d) = duration {
            // perftest's duration row: the timed part's round trips over its span.
            let (n, span_ns) = timed.context("side A measured no timed part")?;
            let secs = span_ns as f64 / 1e9;
            let t_avg = if n > 0 {
                span_ns as f64 / n as f64 / per
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
                        "bytes": size, "iterations": n, "warmup": warmup,
                        "duration_s": d.as_secs(), "time_s": secs, "t_avg_us": t_avg,
                        "tps_average": tps, "sent": sent, "validated": failure.is_none(),
                        "inline": inline, "other_cpu_cores": others, "cpu_util_pct": util,
                    }),
                );
                let v = if peer.is_some() {
                    merge(v, json!({ "wire": wire }))
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
                if cpu_util {
                    cells.last_mut().expect("cells").1 = 14;
                    cells.push((format!("{:.2}", util.unwrap_or(0.0)), 0));
                }
                println!("{}", table_row(&cells));
            }
        } else if a.output.is_some() {
            println!("{}", output_number(st.avg));
        } else if a.json {
            let v = merge(
                base_json.clone(),
                json!({
                    "bytes": size, "iterations": iters, "warmup": warmup,
                    "t_min_us": st.min, "t_max_us": st.max, "t_typical_us": st.typical,
                    "t_avg_us": st.avg, "t_stdev_us": st.stdev, "p99_us": st.p99,
                    "p99_9_us": st.p999, "validated": failure.is_none(), "inline": inline,
                    "other_cpu_cores": others,
                }),
            );
            // This side's wire port during the timed run, across processes.
            let v = if peer.is_some() {
                merge(v, json!({ "wire": wire }))
            } else {
                v
            };
            println!("{v}");
        } else {
            let f = |x: f64| format!("{x:.2}");
            let cells = [
                size.to_string(),
                iters.to_string(),
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
        if let Some(e) = failure {
            bail!("validation failed at {size} B: {e}");
        }
        progress.step(n + 1, size);
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
