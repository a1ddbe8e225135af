//! One bandwidth run, [`run`]: the rendezvous and the device, the QPs and their connection, the
//! plans and buffers, the header, the initiators, then every size (warm-up, poison, timed run,
//! validation, row).

use super::args::{
    iterations, needs, Args, Inject, Scope, Test, BYTES_PER_SIZE, DEFAULT_RX_DEPTH, MIN_ITERS,
};
use super::cpu::{cpu_flow, CpuOpts, Receiver};
use super::engine::{drive, own_inline, Engine};
use super::gpu::GpuEngine;
use super::plan::{
    dst_buf, poison, reached_buf, register, reset_words, validate, validate_word, words_buf, Job,
    Keys, Plan, Side,
};
use super::report::{combine, reg_cache_report, Measured};
use super::verb::Verb;
use crate::{
    address_lines_of, check_placement, common_header, common_json, connect_options, connect_pair,
    cpu_ring_mode, create_qp, create_qp_rq, doorbell_line, merge, mtu_line, open_env,
    open_env_remote, output_number, pattern, remote_header, remote_json, step, table_row,
    tx_depth_for, wire_counters, wire_delta, with_mtu, CpuSample, Exports, GpuStatus, Header,
    Initiator, OtherCpu, OutputArg, Payload, Peer, Progress, QpSpec, Units, UserIdle,
};
use anyhow::{bail, Context as _, Result};
use gpuverbs::post::RingMode;
use gpuverbs::{Access, Endpoint, Qp, RemoteMemory};
use serde_json::json;
use std::time::Duration;

pub(super) fn run(args: &Args, t: &Test) -> Result<()> {
    let a = &args.common;
    let verb = t.verb;
    #[allow(non_snake_case)]
    let TEST = t.name;
    let sizes = a.sizes(t.default_size);
    let outs = args.outs(verb);
    let rx_depth = args.rx_depth.unwrap_or(DEFAULT_RX_DEPTH);
    let dirs = if args.bidir { 2 } else { 1 };
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
    if env.initiator == Initiator::Cpu {
        let gpu_only = args.gpu_only_options();
        if !gpu_only.is_empty() {
            bail!(
                "{} {} the GPU initiator, and this run uses the CPU ({}; GPU: {})",
                gpu_only.join(", "),
                needs(&gpu_only),
                env.initiator_why,
                env.gpu_line
            );
        }
    }
    let ring_mode = match env.initiator {
        Initiator::Cpu => Some(cpu_ring_mode(a.db)?),
        Initiator::Gpu => None,
    };
    check_placement(a, &env)?;

    // Jobs: QP k of side A writes into side B (direction 0) and, with --bidir, QP k of B into A
    // (direction 1). In loopback this process drives them all; across processes each side
    // drives the jobs it sends (the client is A, the server B).
    let me = peer.as_ref().map(Peer::side);
    let qps = args.qps as usize;
    let njobs = qps * dirs;
    let local: Vec<usize> = (0..njobs)
        .filter(|&j| me.is_none_or(|s| j / qps == s))
        .collect();
    let scope = args.scope.unwrap_or(Scope::Thread);
    let threads = args.threads.unwrap_or(match scope {
        Scope::Thread => 1,
        Scope::Warp => 32,
        Scope::Block => 128,
    });
    let ctas = args.ctas.unwrap_or(local.len().max(1) as u32);
    if env.initiator == Initiator::Gpu && !local.is_empty() && (ctas as usize) < local.len() {
        bail!(
            "--ctas {ctas} is fewer than the {} QPs this process drives (--qps{})",
            local.len(),
            if a.loopback { " x directions" } else { "" }
        );
    }
    // Workers of the jobs this process drives: CTA c drives local job c % n.
    let local_workers: Vec<u32> = (0..local.len())
        .map(|i| match env.initiator {
            Initiator::Cpu => 1,
            Initiator::Gpu => {
                let n = local.len();
                let c = ctas as usize / n + usize::from(i < ctas as usize % n);
                (c as u32) * threads
            }
        })
        .collect();

    // SQ size and signaling.
    let (unit, batch_eff) = match (env.initiator, scope) {
        (Initiator::Cpu, _) => (1, args.post_list),
        (Initiator::Gpu, Scope::Thread) => (1, args.post_list),
        (Initiator::Gpu, Scope::Warp) => (threads.min(32), 1),
        (Initiator::Gpu, Scope::Block) => (threads, 1),
    };
    let sig_calls = match outs {
        0 => (a.cq_mod / unit).max(1),
        o => a.cq_mod.min(o),
    };
    let wmax = local_workers.iter().copied().max().unwrap_or(1) as u64;
    // Blocks one QP's posters may leave without a CQE (unsignaled) or unrung.
    // An inline WQE takes ctrl + raddr + the inline header and data, in 64-byte blocks.
    let largest_inline = sizes
        .iter()
        .copied()
        .filter(|&s| s <= args.inline_size as u64)
        .max();
    let wqe_blocks = largest_inline.map_or(1, |s| (36 + s).div_ceil(64));
    let pending = wmax * (sig_calls as u64 + batch_eff as u64) * wqe_blocks + unit as u64;
    let tx = tx_depth_for(a.tx_depth, pending)?;
    let spec = QpSpec {
        tx_depth: tx,
        rings: a.rings,
        db: a.db,
    };

    // QPs: both sides in loopback (one device, a PD each), this side's across processes.
    let mut sides: [Option<Side>; 2] = [None, None];
    for (s, slot) in sides.iter_mut().enumerate() {
        if me.is_none_or(|m| m == s) {
            let pd = env.ctx.alloc_pd();
            // SEND's side B only receives, through a host thread: its rings stay in host memory.
            let spec = match verb {
                Verb::Send if s == 1 => QpSpec {
                    rings: crate::Placement::Host,
                    ..spec
                },
                _ => spec,
            };
            let qps = (0..args.qps)
                .map(|_| match verb {
                    Verb::Send => create_qp_rq(&pd, spec, env.gpu.as_ref(), rx_depth),
                    _ => create_qp(&pd, spec, env.gpu.as_ref()),
                })
                .collect::<Result<Vec<_>>>()?;
            *slot = Some(Side {
                qps,
                src: None,
                dst: None,
                words: None,
            });
        }
    }
    let side = |s: usize| sides[s].as_ref();

    // Connection, and the workers of every job (the peer says how many drive its jobs).
    let mut peer_eps: Vec<Endpoint> = Vec::new();
    let workers: Vec<u32> = match (&mut peer, me) {
        (Some(p), Some(m)) => {
            let params = json!({
                "sizes": sizes, "iters": a.iters, "warmup": a.warmup, "qps": args.qps,
                "bidir": args.bidir, "inject": args.inject.map(|i| format!("{i:?}")),
                "verb": verb.title(), "outs": outs, "rx_depth": rx_depth,
            });
            let mine = side(m)
                .expect("this side")
                .qps
                .iter()
                .map(|q| with_mtu(&q.endpoint(), a.mtu))
                .collect();
            let hello = p.hello(a, TEST, params, mine, json!({ "workers": local_workers }))?;
            let theirs: Vec<u32> = serde_json::from_value(hello.facts["workers"].clone())
                .context("the peer's workers per QP")?;
            if theirs.len() != njobs - local.len() || theirs.contains(&0) {
                bail!(
                    "the peer drives {} QPs with {theirs:?} workers; expected {}",
                    theirs.len(),
                    njobs - local.len()
                );
            }
            for (k, (q, ep)) in side(m)
                .expect("this side")
                .qps
                .iter()
                .zip(&hello.endpoints)
                .enumerate()
            {
                q.connect(&with_mtu(ep, a.mtu), connect_options())
                    .with_context(|| format!("connect QP {k} to the {} ({ep})", p.peer_role))?;
            }
            peer_eps = hello.endpoints;
            let (mut mine_w, mut theirs_w) = (local_workers.iter(), theirs.iter());
            (0..njobs)
                .map(|j| {
                    if j / qps == m {
                        mine_w.next()
                    } else {
                        theirs_w.next()
                    }
                    .copied()
                    .expect("counts checked")
                })
                .collect()
        }
        _ => {
            let (sa, sb) = (side(0).expect("side A"), side(1).expect("side B"));
            for k in 0..qps {
                connect_pair(&sa.qps[k], &sb.qps[k], a.mtu)?;
            }
            local_workers.clone()
        }
    };
    let jobs: Vec<Job> = (0..njobs)
        .map(|j| Job {
            dir: j / qps,
            k: j % qps,
            workers: workers[j],
        })
        .collect();
    // QPN of each job's sender (this process's QP, or the peer's).
    let sender_qpn: Vec<u32> = jobs
        .iter()
        .map(|job| match side(job.dir) {
            Some(s) => s.qps[job.k].qpn(),
            None => peer_eps.get(job.k).map_or(0, Endpoint::qpn),
        })
        .collect();

    // Plans of every size, and the buffers the largest needs.
    let plans: Vec<Plan> = sizes
        .iter()
        .map(|&s| {
            let (n, w) = iterations(t, a, s, args.duration.is_some());
            Plan::new(&jobs, verb, s, n, w)
        })
        .collect();
    let src_len = plans
        .iter()
        .map(|p| p.src_slots as u64 * p.size)
        .max()
        .unwrap_or(0);
    let dst_len = |d: usize| plans.iter().map(|p| p.dst_len[d]).max().unwrap_or(0);
    let mut timings = Vec::new();
    for (s, slot) in sides.iter_mut().enumerate() {
        let Some(sd) = slot else { continue };
        let pd = sd.qps[0].pd().clone();
        let name = ["A", "B"][s];
        if jobs.iter().any(|j| j.data_side(verb) == Some(s)) {
            let len = src_len as usize;
            let b = Payload::new(a.mem, env.gpu.as_ref(), len)?;
            let t = args.reg_cache.then_some((&mut timings, name, "src", len));
            let access = match verb {
                Verb::Read => Access::LOCAL_WRITE | Access::REMOTE_READ,
                _ => Access::LOCAL_WRITE,
            };
            let mr = register(&b, &pd, access, t)?;
            a.check_dmabuf(&mr, "source")?;
            sd.src = Some((b, mr));
        }
        if jobs.iter().any(|j| j.check_side(verb) == s) {
            let len = dst_len(s) as usize;
            let b = Payload::new(a.mem, env.gpu.as_ref(), len)?;
            let t = args.reg_cache.then_some((&mut timings, name, "dst", len));
            let access = match verb {
                Verb::Write => Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                _ => Access::LOCAL_WRITE,
            };
            let mr = register(&b, &pd, access, t)?;
            a.check_dmabuf(&mr, "destination")?;
            sd.dst = Some((b, mr));
        }
        if matches!(verb, Verb::Atomic(_)) && jobs.iter().any(|j| j.dir == 1 - s) {
            let len = 8 * njobs;
            let b = Payload::new(a.mem, env.gpu.as_ref(), len)?;
            let t = args.reg_cache.then_some((&mut timings, name, "words", len));
            let mr = register(&b, &pd, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC, t)?;
            a.check_dmabuf(&mr, "atomic words")?;
            sd.words = Some((b, mr));
        }
    }
    let reg_cache = args.reg_cache.then(|| reg_cache_report(&timings, &sides));
    let side = |s: usize| sides[s].as_ref();
    // The buffer of a side that the peer's WQEs reach: WRITE's destination, READ's source,
    // the atomics' words (SEND: none).
    let reached = |sd| reached_buf(sd, verb);
    // Across processes each side hands out that buffer.
    // The buffer each side's address lines show (perftest's RKey / VAddr): that one, or on a
    // side that is no target its destination or source.
    let shown = |s: usize| -> (u32, u64) {
        side(s)
            .and_then(|sd| reached(sd).or(sd.dst.as_ref()).or(sd.src.as_ref()))
            .map_or((0, 0), |(_, mr)| (mr.rkey().0, mr.addr()))
    };
    let mut peer_shown = (0u32, 0u64);
    let peer_dst: Option<RemoteMemory> = match (&mut peer, me) {
        (Some(p), Some(m)) => {
            let mine = side(m)
                .and_then(reached)
                .map(|(_, mr)| RemoteMemory::export_rkey(mr.addr(), mr.len(), mr.rkey().0))
                .transpose()
                .map(|d| (d, shown(m)))
                .map_err(anyhow::Error::from);
            let (theirs, their_shown): (Option<RemoteMemory>, (u32, u64)) =
                p.step("memory", mine)?;
            peer_shown = their_shown;
            let need = match verb {
                Verb::Write => dst_len(1 - m),
                Verb::Read => src_len,
                Verb::Atomic(_) => 8 * njobs as u64,
                Verb::Send => 0,
            };
            match theirs {
                Some(r) if r.len() < need => bail!(
                    "the {}'s target buffer has {} B, the plan needs {need}",
                    p.peer_role,
                    r.len()
                ),
                None if !local.is_empty() && verb != Verb::Send => {
                    bail!("the {} exported no target buffer", p.peer_role)
                }
                t => t,
            }
        }
        _ => None,
    };
    let initiating: Vec<&Qp> = local
        .iter()
        .map(|&j| &side(jobs[j].dir).expect("a local job's side").qps[jobs[j].k])
        .collect();
    let first_qp = initiating.first().copied().unwrap_or_else(|| {
        &sides
            .iter()
            .flatten()
            .next()
            .expect("one side at least")
            .qps[0]
    });

    // Header.
    let units = if args.report_gbits {
        Units::Gbits
    } else {
        Units::MBytes
    };
    let receives_only = local.is_empty();
    let peer_role = peer.as_ref().map_or("peer", |p| p.peer_role);
    let mut other_cpu = OtherCpu::sample_before_run();
    let mut h = Header::new(format!("{} BW Test ({TEST})", verb.title()));
    common_header(
        &mut h,
        &env,
        a,
        if receives_only {
            format!("none: this side only answers (the {peer_role} posts)")
        } else {
            doorbell_line(first_qp, env.initiator, ring_mode, a.db)
        },
    );
    if let (Some(p), Some(ep)) = (&peer, peer_eps.first()) {
        remote_header(&mut h, a, p, &env.ctx, ep);
    }
    h.line("Number of qps", format!("{} (each direction)", args.qps))
        .line("Bidirectional", if args.bidir { "on" } else { "off" });
    match env.initiator {
        _ if receives_only => h.line(
            "Posting",
            if verb == Verb::Send {
                "receives only, by a host thread"
            } else {
                "none: this side only answers"
            },
        ),
        Initiator::Gpu if verb != Verb::Write => h.line(
            "Posting",
            format!("{ctas} CTA(s) x 1 thread: one thread per QP, one doorbell per WQE"),
        ),
        Initiator::Gpu => h.line(
            "Posting",
            format!(
                "{ctas} CTA(s) x {threads} thread(s), {} scope, {}",
                scope.name(),
                match scope {
                    Scope::Thread => format!("{} WQEs per doorbell per thread", args.post_list),
                    Scope::Warp => "one doorbell per warp call".into(),
                    Scope::Block => "one doorbell per block call".into(),
                }
            ),
        ),
        Initiator::Cpu => h.line(
            "Posting",
            format!("one host thread, {} WQEs per doorbell", args.post_list),
        ),
    };
    if let Some((line, _)) = &reg_cache {
        h.line("Reg cache", line);
    }
    if verb == Verb::Send && (me.is_none() || receives_only) {
        h.line("RX depth", rx_depth);
    }
    h.line("Post List", args.post_list)
        .line("CQ Moderation", a.cq_mod)
        .line("TX depth", format!("{tx} blocks"))
        .line(
            "Mtu",
            mtu_line(a.mtu, &env.ctx, &first_qp.endpoint(), peer_eps.first()),
        )
        .line("GID index", env.ctx.gid_index());
    if verb.has_inline() {
        h.line("Max inline data", format!("{}[B]", args.inline_size));
    }
    if verb.has_outs() {
        h.line("Outstand reads", outs);
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
    .line(
        "Validation",
        match (verb, peer.is_some()) {
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
        },
    );
    other_cpu.header(&mut h);
    // perftest reports CPU utilisation in duration mode only (and warns otherwise).
    let cpu_util = args.cpu_util && args.duration.is_some();
    if args.cpu_util && !cpu_util {
        eprintln!("{TEST}: --cpu_util: CPU Utilization works only with Duration mode (-D)");
    }
    let table = !a.json && a.output.is_none();
    if a.output.is_none() {
        h.print(a.json);
        // perftest's address lines: this side's QPs, then the peer's.
        let fmt = verb.addr_format(outs);
        let mut lines = Vec::new();
        let (lside, rside) = match me {
            Some(m) => (m, None),
            None => (0, Some(1)),
        };
        let (lk, lv) = shown(lside);
        for q in &side(lside).expect("this side").qps {
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
                let (rk, rv) = shown(r);
                for q in &side(r).expect("side B").qps {
                    lines.push(address_lines_of(fmt, "remote", &q.endpoint(), rk, rv));
                }
            }
            None => {
                for ep in &peer_eps {
                    lines.push(address_lines_of(
                        fmt,
                        "remote",
                        ep,
                        peer_shown.0,
                        peer_shown.1,
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
            (format!("BW peak[{}]", units.label()), 18),
            (format!("BW average[{}]", units.label()), 20),
            ("MsgRate[Mpps]".to_string(), 0),
        ];
        if cpu_util {
            cols.last_mut().expect("columns").1 = 16;
            cols.push(("CPU_Util[%]".to_string(), 0));
        }
        println!("{}", table_row(&cols));
    }
    let mut base_json = merge(
        common_json(&env, a, first_qp),
        json!({
            "test": TEST, "qps": args.qps, "bidir": args.bidir, "cq_mod": a.cq_mod,
            "tx_depth": tx, "post_list": args.post_list, "bw_unit": units.label(),
            "inline_size": args.inline_size, "duration_s": args.duration,
            "scope": (env.initiator == Initiator::Gpu).then(|| scope.name()),
            "ctas": (env.initiator == Initiator::Gpu).then_some(ctas),
            "threads": (env.initiator == Initiator::Gpu).then_some(threads),
            "verb": verb.title(), "outs": verb.has_outs().then_some(outs),
            "rx_depth": (verb == Verb::Send).then_some(rx_depth),
        }),
    );
    if let (Some(p), Some(ep)) = (&peer, peer_eps.first()) {
        base_json = merge(base_json, remote_json(a, p, &env.ctx, ep));
    }
    if let Some((_, v)) = &reg_cache {
        base_json = merge(base_json, json!({ "reg_cache": v }));
    }

    // The initiators of the jobs this process drives.
    let mut engine = match env.initiator {
        _ if receives_only => None,
        Initiator::Cpu => {
            let mode = ring_mode.expect("CPU ring mode");
            // The source buffer of each flow, for its inline WQEs.
            let srcs = local.iter().map(|&j| {
                side(jobs[j].dir)
                    .and_then(|s| s.src.as_ref())
                    .and_then(|(b, _)| b.host().cloned())
            });
            Some(Engine::Cpu(
                initiating
                    .iter()
                    .zip(srcs)
                    .map(|(q, src)| cpu_flow(q, mode, src))
                    .collect(),
                CpuOpts {
                    post_list: args.post_list,
                    inline_size: args.inline_size,
                    duration: args.duration.map(|d| Duration::from_secs(d.into())),
                    verb,
                    outs,
                },
            ))
        }
        Initiator::Gpu => {
            let gpu = env.gpu.clone().expect("GPU initiator has a GPU");
            let exports = Exports::new(&gpu, &initiating)?;
            let status = GpuStatus::new(&gpu)?;
            let times = gpu.alloc(16 * ctas as usize)?;
            // Each flow's source slot 0 as the kernels see it (inline WQEs copy from it).
            let mut src_dev = Vec::new();
            for &j in &local {
                src_dev.push(match side(jobs[j].dir).and_then(|s| s.src.as_ref()) {
                    Some((b, _)) if verb.has_inline() && args.inline_size > 0 => {
                        b.gpu_addr(&gpu)?
                    }
                    _ => 0,
                });
            }
            Some(Engine::Gpu(Box::new(GpuEngine {
                ctl: gpu.alloc(16)?,
                gpu,
                exports,
                status,
                times,
                ctas,
                threads,
                scope,
                batch: args.post_list,
                sig_calls,
                verb,
                outs,
                inline_size: args.inline_size,
                src_dev,
                duration: args.duration.map(|d| Duration::from_secs(d.into())),
                inlined: 0,
            })))
        }
    };
    let qpns: Vec<u32> = initiating.iter().map(|q| q.qpn()).collect();
    // SEND: the receives of the jobs whose target is here, posted by a host thread.
    let mut receivers: Vec<Receiver> = Vec::new();
    if verb == Verb::Send {
        let mode = cpu_ring_mode(a.db).unwrap_or(RingMode::Doca);
        for (j, job) in jobs.iter().enumerate() {
            let Some(sd) = side(1 - job.dir) else {
                continue;
            };
            let mr = &sd.dst.as_ref().expect("a SEND target has destinations").1;
            let ini = sd.qps[job.k]
                .try_cpu_initiator(mode)
                .context("a host thread posts the receives")?;
            receivers.push(Receiver {
                ini,
                job: j,
                base: mr.addr(),
                lkey: mr.lkey(),
                depth: rx_depth,
                posted: 0,
                taken: 0,
            });
        }
    }

    let mut progress = Progress::new(TEST, plans.len());
    let mut scratch = Vec::new();
    for (n, plan) in plans.iter().enumerate() {
        let seed = pattern::seed(1, plan.size);
        // The seed of a job's bytes: that of the side its sources are on.
        let jseed = |job: &Job| seed ^ job.data_side(verb).unwrap_or(job.dir) as u64;
        // Fresh sources (READ: the target's).
        for (d, sd) in sides.iter().enumerate() {
            if let Some((b, _)) = sd.as_ref().and_then(|s| s.src.as_ref()) {
                for s in 0..plan.src_slots as u64 {
                    pattern::fill(&mut scratch, seed ^ d as u64, s, plan.size as usize);
                    b.write((s * plan.size) as usize, &scratch)?;
                }
            }
        }
        reset_words(&sides, &jobs)?;
        let keys = |bad| Keys::new(&jobs, verb, &local, &sides, peer_dst.as_ref(), bad);
        // Warm-up, untimed (with the right keys: a failing warm-up would hide the injection).
        let warm = if plan.warmup > 0 {
            drive(
                &mut receivers,
                plan,
                plan.warmup,
                a.wait(),
                &mut peer,
                verb == Verb::Send,
                None,
                || match &mut engine {
                    Some(e) => e
                        .run(
                            plan,
                            &jobs,
                            &local,
                            &keys(false),
                            plan.warmup,
                            a,
                            &qpns,
                            false,
                        )
                        .map(|_| ()),
                    None => Ok(()),
                },
            )
        } else {
            Ok(())
        };
        step(&mut peer, "warm-up", warm)?;
        // The checking side poisons its destinations once the warm-up is done (and an atomic's
        // target sets its words back to their base).
        for (j, job) in jobs.iter().enumerate() {
            if let Some(b) = dst_buf(&sides, job, verb) {
                poison(b, verb, plan, j, jseed(job), &mut scratch)?;
            }
        }
        reset_words(&sides, &jobs)?;
        // Before the step that lets the peer start: once it returns the peer's packets may
        // arrive (and be answered) before this thread runs again.
        let wire_before = wire_counters(&env.ctx);
        step(&mut peer, "poisoned", Ok(()))?;
        let cpu = CpuSample::now();
        let util_before = cpu_util.then(UserIdle::now).flatten();
        let mine: Result<Option<Measured>> = drive(
            &mut receivers,
            plan,
            plan.iters,
            a.wait(),
            &mut peer,
            verb == Verb::Send,
            // SEND with -D: the receivers learn the count when the sender is done.
            (verb == Verb::Send && args.duration.is_some())
                .then_some((|m: &Option<Measured>| m.map(|m| m.iters)) as fn(&_) -> _),
            || match &mut engine {
                Some(e) => e
                    .run(
                        plan,
                        &jobs,
                        &local,
                        &keys(args.inject == Some(Inject::BadRkey)),
                        plan.iters,
                        a,
                        &qpns,
                        true,
                    )
                    .map(|t| {
                        Some(Measured {
                            msgs: t.iters as f64 * local.len() as f64,
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
        let theirs = step(&mut peer, "timed", mine)?.flatten();
        let others = other_cpu.record(cpu.and_then(CpuSample::others_since));
        // The iterations each job ran (its sender's count: with -D, as the duration took).
        let ran = |dir: usize| -> Result<u32> {
            match me {
                Some(m) if m != dir => theirs.map(|t| t.iters),
                _ => own.map(|t| t.iters),
            }
            .with_context(|| format!("no iteration count for the QPs of side {dir}"))
        };
        let wire = wire_delta(&wire_before, &wire_counters(&env.ctx));
        if args.inject == Some(Inject::Corrupt) {
            if let Some(b) = dst_buf(&sides, &jobs[0], verb) {
                let off = plan.dst_off[0] as usize + plan.size as usize / 2;
                // One flipped bit: a write that arrived corrupted (not the poison).
                let mut x = [0u8];
                b.read(off, &mut x)?;
                b.write(off, &[x[0] ^ 0x01])?;
            }
        }
        // Every byte of the destinations this process holds.
        let mut failure = None;
        for (j, job) in jobs.iter().enumerate() {
            if let Some(w) = words_buf(&sides, job) {
                if let Err(e) = validate_word(w, j, ran(job.dir)?) {
                    failure = Some(format!("QP {:#x} (job {j}): {e}", sender_qpn[j]));
                    break;
                }
            }
            let Some(b) = dst_buf(&sides, job, verb) else {
                continue;
            };
            let done = Plan {
                iters: ran(job.dir)?,
                ..plan.clone()
            };
            if let Err(e) = validate(b, verb, &done, plan.iters, j, jseed(job), &mut scratch) {
                failure = Some(format!("QP {:#x} (job {j}): {e}", sender_qpn[j]));
                break;
            }
        }
        let failure = match &mut peer {
            None => failure,
            Some(p) => {
                let theirs: Option<String> = p.step("validated", Ok(failure.clone()))?;
                let by = |f: String, who: &str| format!("{f} (checked by the {who})");
                failure
                    .map(|f| by(f, p.role))
                    .or_else(|| theirs.map(|f| by(f, p.peer_role)))
            }
        };
        let measured: Vec<Measured> = own.into_iter().chain(theirs).collect();
        let (peak, avg, mpps, secs) = combine(&measured, plan.size, units);
        // perftest's #iterations: one side's iterations times its QPs (with -b, one
        // direction's, as ib_write_bw prints them).
        let iters = measured.first().map_or(0, |m| m.iters);
        let reported = u64::from(iters) * u64::from(args.qps);
        progress.clear();
        if let Some(o) = a.output {
            println!(
                "{}",
                output_number(match o {
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
                    "time_s": secs, "validated": failure.is_none(),
                    "other_cpu_cores": others, "cpu_util_pct": util,
                    "inline_wqes": own_inline(&engine),
                }),
            );
            if peer.is_some() {
                // This side's wire port during the timed run.
                v = merge(v, json!({ "wire": wire }));
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
            if cpu_util {
                cells.last_mut().expect("cells").1 = 16;
                cells.push((format!("{:.2}", util.unwrap_or(0.0)), 0));
            }
            println!("{}", table_row(&cells));
        }
        if let Some(f) = failure {
            bail!("validation failed at {} B: {f}", plan.size);
        }
        progress.step(n + 1, plan.size);
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
