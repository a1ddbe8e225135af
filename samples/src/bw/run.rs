//! One bandwidth run, [`run`], in its steps: the plan (the options as this process resolves
//! them), the rendezvous and the device, the QPs and their connection, the buffers, the header,
//! the initiators, then every size ([`super::size`]) and the closing lines.

use super::args::{iterations, Args, Test};
use super::cpu::{cpu_flow, CpuOpts, Receiver};
use super::engine::{own_inline, Engine};
use super::gpu::GpuEngine;
use super::plan::{reached_buf, register, Job, Plan, RegTiming, Side};
use super::report::{base_json, header, print_preamble, reg_cache_report};
use super::setup::{shown, Rendezvous, Run, RunPlan};
use super::size::{print_row, run_size, Live};
use super::verb::Verb;
use crate::{
    connect_options, connect_pair, cpu_ring_mode, create_qp, create_qp_rq, open_env,
    open_env_remote, with_mtu, Env, Exports, GpuStatus, Initiator, OtherCpu, Payload, Peer,
    Progress, QpSpec,
};
use anyhow::{bail, Context as _, Result};
use gpuverbs::post::RingMode;
use gpuverbs::{Access, Endpoint, Qp, RemoteMemory};
use serde_json::json;
use std::time::Duration;

/// One run of every size: the plan, the rendezvous, the QPs and their connection, the buffers,
/// the header, the initiators, then each size's steps and row, and the closing lines.
pub(super) fn run(args: &Args, t: &Test) -> Result<()> {
    let a = &args.common;
    // The server/client roles meet first: a soft NIC's wire port binds the local address
    // that reaches the peer.
    let mut peer = if a.loopback {
        None
    } else {
        Some(Peer::rendezvous(a, t.name)?)
    };
    let env = match &mut peer {
        None => open_env(a)?,
        Some(p) => open_env_remote(a, p)?,
    };
    let pcap = crate::start_pcap(a, &env.ctx)?;
    a.check_device(&env.ctx)?;
    let rp = RunPlan::resolve(args, t, &env, peer.as_ref().map(Peer::side))?;
    let mut sides = create_sides(args, &rp, &env)?;
    let rv = connect(args, &rp, &mut peer, &sides)?;
    // Plans of every size, and the buffers the largest needs.
    let plans = plans(args, t, &rp, &rv.jobs);
    let timings = register_buffers(args, &rp, &env, &rv.jobs, &plans, &mut sides)?;
    let reg_cache = args.reg_cache.then(|| reg_cache_report(&timings, &sides));
    let (peer_dst, peer_shown) = exchange_memory(&rp, &mut peer, &sides, &plans)?;
    let initiating = initiating(&rp, &rv.jobs, &sides);
    let run = Run {
        args,
        t,
        rp: &rp,
        env: &env,
        sides: &sides,
        rv: &rv,
        peer_dst: peer_dst.as_ref(),
        peer_shown,
        first_qp: first_qp(&initiating, &sides),
        qpns: initiating.iter().map(|q| q.qpn()).collect(),
    };

    let mut other_cpu = OtherCpu::sample_before_run();
    let h = header(&run, peer.as_ref(), reg_cache.as_ref(), &other_cpu);
    if args.cpu_util && !rp.cpu_util {
        eprintln!(
            "{}: --cpu_util: CPU Utilization works only with Duration mode (-D)",
            rp.test
        );
    }
    let table = !a.json && a.output.is_none();
    print_preamble(&run, &h);
    let base_json = base_json(&run, peer.as_ref(), reg_cache.as_ref());
    let mut engine = engine(&run, &initiating)?;
    let mut receivers = receivers(&run)?;

    let mut progress = Progress::new(rp.test, plans.len());
    let mut live = Live {
        engine: &mut engine,
        receivers: &mut receivers,
        peer: &mut peer,
        other_cpu: &mut other_cpu,
        scratch: Vec::new(),
    };
    for (n, plan) in plans.iter().enumerate() {
        let o = run_size(&run, &mut live, plan)?;
        progress.clear();
        let remote = live.peer.is_some();
        print_row(&run, &base_json, plan, &o, own_inline(live.engine), remote);
        if let Some(f) = o.failure {
            bail!("validation failed at {} B: {f}", plan.size);
        }
        progress.step(n + 1, plan.size);
    }
    progress.clear();
    crate::report::finish_run(table, pcap, other_cpu.warning(rp.test))
}

/// The QPs: both sides in loopback (one device, a PD each), this side's across processes.
fn create_sides(args: &Args, rp: &RunPlan, env: &Env) -> Result<[Option<Side>; 2]> {
    let mut sides: [Option<Side>; 2] = [None, None];
    for (s, slot) in sides.iter_mut().enumerate() {
        if rp.me.is_none_or(|m| m == s) {
            let pd = env.ctx.alloc_pd();
            // SEND's side B only receives, through a host thread: its rings stay in host memory.
            let spec = match rp.verb {
                Verb::Send if s == 1 => QpSpec {
                    rings: crate::RingsArg::Host,
                    ..rp.spec
                },
                _ => rp.spec,
            };
            let qps = (0..args.qps)
                .map(|_| match rp.verb {
                    Verb::Send => create_qp_rq(&pd, spec, env.gpu.as_ref(), rp.rx_depth),
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
    Ok(sides)
}

/// Connection, and the workers of every job (the peer says how many drive its jobs): the
/// hello and this side's QPs to the peer's across processes, side A's to side B's in loopback.
fn connect(
    args: &Args,
    rp: &RunPlan,
    peer: &mut Option<Peer>,
    sides: &[Option<Side>; 2],
) -> Result<Rendezvous> {
    let a = &args.common;
    let side = |s: usize| sides[s].as_ref();
    let mut peer_eps: Vec<Endpoint> = Vec::new();
    let workers: Vec<u32> = match (peer, rp.me) {
        (Some(p), Some(m)) => {
            let (workers, eps) = hello(args, rp, p, m, sides)?;
            peer_eps = eps;
            workers
        }
        _ => {
            let (sa, sb) = (side(0).expect("side A"), side(1).expect("side B"));
            for k in 0..rp.qps {
                connect_pair(&sa.qps[k], &sb.qps[k], a.mtu)?;
            }
            rp.local_workers.clone()
        }
    };
    let jobs: Vec<Job> = (0..rp.njobs)
        .map(|j| Job {
            dir: j / rp.qps,
            k: j % rp.qps,
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
    Ok(Rendezvous {
        jobs,
        sender_qpn,
        peer_eps,
    })
}

/// Across processes: the hello (the parameters both must share, the endpoints, the workers of
/// each side's jobs), then QP k of this side connects to QP k of the peer; the workers of every
/// job, and the peer's endpoints.
fn hello(
    args: &Args,
    rp: &RunPlan,
    p: &mut Peer,
    m: usize,
    sides: &[Option<Side>; 2],
) -> Result<(Vec<u32>, Vec<Endpoint>)> {
    let a = &args.common;
    let side = |s: usize| sides[s].as_ref();
    let params = json!({
        "sizes": rp.sizes, "iters": a.iters, "warmup": a.warmup, "qps": args.qps,
        "bidir": args.bidir, "inject": args.inject.map(|i| format!("{i:?}")),
        "verb": rp.verb.title(), "outs": rp.outs, "rx_depth": rp.rx_depth,
    });
    let mine = side(m)
        .expect("this side")
        .qps
        .iter()
        .map(|q| with_mtu(&q.endpoint(), a.mtu))
        .collect();
    let hello = p.hello(
        a,
        rp.test,
        params,
        mine,
        json!({ "workers": rp.local_workers }),
    )?;
    let theirs: Vec<u32> = serde_json::from_value(hello.facts["workers"].clone())
        .context("the peer's workers per QP")?;
    if theirs.len() != rp.njobs - rp.local.len() || theirs.contains(&0) {
        bail!(
            "the peer drives {} QPs with {theirs:?} workers; expected {}",
            theirs.len(),
            rp.njobs - rp.local.len()
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
    let (mut mine_w, mut theirs_w) = (rp.local_workers.iter(), theirs.iter());
    let workers = (0..rp.njobs)
        .map(|j| {
            if j / rp.qps == m {
                mine_w.next()
            } else {
                theirs_w.next()
            }
            .copied()
            .expect("counts checked")
        })
        .collect();
    Ok((workers, hello.endpoints))
}

/// The layout of every size (its slots, iterations and warm-up).
fn plans(args: &Args, t: &Test, rp: &RunPlan, jobs: &[Job]) -> Vec<Plan> {
    rp.sizes
        .iter()
        .map(|&s| {
            let (n, w) = iterations(t, &args.common, s, args.duration.is_some());
            Plan::new(jobs, rp.verb, s, n, w)
        })
        .collect()
}

/// Source bytes the plans need (the largest).
fn src_len(plans: &[Plan]) -> u64 {
    plans
        .iter()
        .map(|p| p.src_slots as u64 * p.size)
        .max()
        .unwrap_or(0)
}

/// Destination bytes side `d` needs for the plans (the largest).
fn dst_len(plans: &[Plan], d: usize) -> u64 {
    plans.iter().map(|p| p.dst_len[d]).max().unwrap_or(0)
}

/// The buffers of this process's sides, as large as the largest plan needs: the sources of
/// the jobs whose bytes come from a side, the destinations it checks, the atomic words its
/// peer works on; with `--reg-cache` the cold and warm times of their registrations.
fn register_buffers(
    args: &Args,
    rp: &RunPlan,
    env: &Env,
    jobs: &[Job],
    plans: &[Plan],
    sides: &mut [Option<Side>; 2],
) -> Result<Vec<RegTiming>> {
    let a = &args.common;
    let verb = rp.verb;
    let mut timings = Vec::new();
    for (s, slot) in sides.iter_mut().enumerate() {
        let Some(sd) = slot else { continue };
        let pd = sd.qps[0].pd().clone();
        let name = ["A", "B"][s];
        if jobs.iter().any(|j| j.data_side(verb) == Some(s)) {
            let len = src_len(plans) as usize;
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
            let len = dst_len(plans, s) as usize;
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
            let len = 8 * rp.njobs;
            let b = Payload::new(a.mem, env.gpu.as_ref(), len)?;
            let t = args.reg_cache.then_some((&mut timings, name, "words", len));
            let mr = register(&b, &pd, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC, t)?;
            a.check_dmabuf(&mr, "atomic words")?;
            sd.words = Some((b, mr));
        }
    }
    Ok(timings)
}

/// Across processes each side hands out the buffer the peer's WQEs reach (and what its address
/// lines show): the peer's, checked against what the plans need, and the peer's shown RKey and
/// VAddr.
fn exchange_memory(
    rp: &RunPlan,
    peer: &mut Option<Peer>,
    sides: &[Option<Side>; 2],
    plans: &[Plan],
) -> Result<(Option<RemoteMemory>, (u32, u64))> {
    let verb = rp.verb;
    let (Some(p), Some(m)) = (peer, rp.me) else {
        return Ok((None, (0, 0)));
    };
    let mine = sides[m]
        .as_ref()
        .and_then(|sd| reached_buf(sd, verb))
        .map(|(_, mr)| RemoteMemory::export_rkey(mr.addr(), mr.len(), mr.rkey().0))
        .transpose()
        .map(|d| (d, shown(sides, m, verb)))
        .map_err(anyhow::Error::from);
    let (theirs, their_shown): (Option<RemoteMemory>, (u32, u64)) = p.step("memory", mine)?;
    let need = match verb {
        Verb::Write => dst_len(plans, 1 - m),
        Verb::Read => src_len(plans),
        Verb::Atomic(_) => 8 * rp.njobs as u64,
        Verb::Send => 0,
    };
    let dst = match theirs {
        Some(r) if r.len() < need => bail!(
            "the {}'s target buffer has {} B, the plan needs {need}",
            p.peer_role,
            r.len()
        ),
        None if !rp.local.is_empty() && verb != Verb::Send => {
            bail!("the {} exported no target buffer", p.peer_role)
        }
        t => t,
    };
    Ok((dst, their_shown))
}

/// The QPs of the jobs this process drives, in the order of `rp.local`.
fn initiating<'a>(rp: &RunPlan, jobs: &[Job], sides: &'a [Option<Side>; 2]) -> Vec<&'a Qp> {
    rp.local
        .iter()
        .map(|&j| &sides[jobs[j].dir].as_ref().expect("a local job's side").qps[jobs[j].k])
        .collect()
}

/// The QP the header describes: the first this process initiates on, else its first.
fn first_qp<'a>(initiating: &[&'a Qp], sides: &'a [Option<Side>; 2]) -> &'a Qp {
    initiating.first().copied().unwrap_or_else(|| {
        &sides
            .iter()
            .flatten()
            .next()
            .expect("one side at least")
            .qps[0]
    })
}

/// The initiators of the jobs this process drives (`None`: it drives none).
fn engine(run: &Run, initiating: &[&Qp]) -> Result<Option<Engine>> {
    let (args, rp) = (run.args, run.rp);
    Ok(match run.env.initiator {
        _ if rp.receives_only() => None,
        Initiator::Cpu => {
            let mode = rp.ring_mode.expect("CPU ring mode");
            // The source buffer of each flow, for its inline WQEs.
            let srcs = rp.local.iter().map(|&j| {
                run.sides[run.rv.jobs[j].dir]
                    .as_ref()
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
                    verb: rp.verb,
                    outs: rp.outs,
                },
            ))
        }
        Initiator::Gpu => Some(Engine::Gpu(Box::new(gpu_engine(run, initiating)?))),
    })
}

/// The GPU initiator: the exported QPs of the jobs this process drives, its status and timing
/// words, and each flow's source slot 0 as the kernels see it.
fn gpu_engine(run: &Run, initiating: &[&Qp]) -> Result<GpuEngine> {
    let (args, rp) = (run.args, run.rp);
    let gpu = run.env.gpu.clone().expect("GPU initiator has a GPU");
    let exports = Exports::new(&gpu, initiating)?;
    let status = GpuStatus::new(&gpu)?;
    let times = gpu.alloc(16 * rp.ctas as usize)?;
    // Each flow's source slot 0 as the kernels see it (inline WQEs copy from it).
    let mut src_dev = Vec::new();
    for &j in &rp.local {
        src_dev.push(
            match run.sides[run.rv.jobs[j].dir]
                .as_ref()
                .and_then(|s| s.src.as_ref())
            {
                Some((b, _)) if rp.verb.has_inline() && args.inline_size > 0 => b.gpu_addr(&gpu)?,
                _ => 0,
            },
        );
    }
    Ok(GpuEngine {
        ctl: gpu.alloc(16)?,
        gpu,
        exports,
        status,
        times,
        ctas: rp.ctas,
        threads: rp.threads,
        scope: rp.scope,
        batch: args.post_list,
        sig_calls: rp.sig_calls,
        verb: rp.verb,
        outs: rp.outs,
        inline_size: args.inline_size,
        src_dev,
        duration: args.duration.map(|d| Duration::from_secs(d.into())),
        inlined: 0,
    })
}

/// SEND: the receives of the jobs whose target is here, posted by a host thread.
fn receivers(run: &Run) -> Result<Vec<Receiver>> {
    let mut receivers: Vec<Receiver> = Vec::new();
    if run.rp.verb == Verb::Send {
        let mode = cpu_ring_mode(run.args.common.db).unwrap_or(RingMode::Doca);
        for (j, job) in run.rv.jobs.iter().enumerate() {
            let Some(sd) = run.sides[1 - job.dir].as_ref() else {
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
                depth: run.rp.rx_depth,
                posted: 0,
                taken: 0,
            });
        }
    }
    Ok(receivers)
}
