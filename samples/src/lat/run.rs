//! One latency run, [`run`], in its steps: the plan (the options resolved), the rendezvous and
//! the device, the sides and their connection, the header, the initiator, then every size
//! ([`super::size`]) and the closing lines.

use super::args::{Args, Test};
use super::engine::Engine;
use super::gpu::GpuLat;
use super::report::{base_json, header, print_preamble};
use super::setup::{Connected, LatPlan, Run};
use super::side::{Side, Target};
use super::size::{print_row, run_size, Live};
use crate::bw::Verb;
use crate::{
    check_placement, connect_options, connect_pair, cpu_ring_mode, open_env, open_env_remote,
    with_mtu, Env, Exports, GpuStatus, Initiator, OtherCpu, Peer, Progress,
};
use anyhow::{bail, Context as _, Result};
use gpuverbs::post::{RemoteAddr, RingMode, Rkey};
use gpuverbs::{Mr, Qp, RemoteMemory};
use serde_json::json;

/// One run of every size: the plan, the rendezvous, the sides and their connection, the
/// header, the initiator, then each size's steps and row, and the closing lines.
pub(super) fn run(args: &Args, t: &Test) -> Result<()> {
    let a = &args.common;
    let lp = LatPlan::resolve(args, t)?;
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
    let ring_mode = check_initiator(args, &lp, &env, peer.as_ref())?;
    let c = connect(args, &lp, &env, &mut peer)?;
    let run = Run {
        args,
        t,
        lp: &lp,
        env: &env,
        c: &c,
        ring_mode,
    };

    let mut other_cpu = OtherCpu::sample_before_run();
    let h = header(&run, peer.as_ref(), &other_cpu);
    let table = !a.json && a.output.is_none();
    print_preamble(&run, &h);
    let base_json = base_json(&run, peer.as_ref());
    let mut engine = engine(&run)?;

    let mut progress = Progress::new(lp.test, lp.sizes.len());
    let mut live = Live {
        engine: &mut engine,
        peer: &mut peer,
        other_cpu: &mut other_cpu,
        scratch: Vec::new(),
    };
    for (n, &size) in lp.sizes.iter().enumerate() {
        let o = run_size(&run, &mut live, size)?;
        progress.clear();
        print_row(&run, &base_json, size, &o, live.peer.is_some())?;
        if let Some(e) = o.failure {
            bail!("validation failed at {size} B: {e}");
        }
        progress.step(n + 1, size);
    }
    progress.clear();
    crate::report::finish_run(table, pcap, other_cpu.warning(lp.test))
}

/// The initiator's doorbell convention and the placements it can reach; across processes on
/// one host with GPU initiators, a note on sharing the GPU.
fn check_initiator(
    args: &Args,
    lp: &LatPlan,
    env: &Env,
    peer: Option<&Peer>,
) -> Result<Option<RingMode>> {
    let a = &args.common;
    let ring_mode = match env.initiator {
        Initiator::Cpu => Some(cpu_ring_mode(a.db)?),
        Initiator::Gpu => None,
    };
    check_placement(a, env)?;
    if let Some(p) = peer.filter(|p| p.addr.ip().is_loopback()) {
        if env.initiator == Initiator::Gpu && matches!(lp.verb, Verb::Send | Verb::Write) {
            // Measured on the H200: 2.2 ms per message without MPS, 16 µs with it.
            eprintln!(
                "{}: note: the {} is on this host, and both sides run a resident kernel: \
                 when they share a GPU without MPS (nvidia-cuda-mps-control -d), the GPU \
                 time-slices the two processes and each message waits for the other's slice \
                 (milliseconds); with MPS, or a GPU each, they run at once",
                lp.test, p.peer_role
            );
        }
    }
    Ok(ring_mode)
}

/// The sides and their connection. Loopback: both sides, on one device (a PD each).
/// Across processes: this side (the client is A, the server B), and where its messages go on
/// the peer.
fn connect(args: &Args, lp: &LatPlan, env: &Env, peer: &mut Option<Peer>) -> Result<Connected> {
    let a = &args.common;
    let me = peer.as_ref().map(Peer::side);
    let c = match (peer, me) {
        (Some(p), Some(m)) => hello(args, lp, env, p, m)?,
        _ => {
            let (pa, pb) = (env.ctx.alloc_pd(), env.ctx.alloc_pd());
            let sides = vec![
                Side::new(&pa, lp.spec, env.gpu.as_ref(), a.mem, lp.len, lp.verb)?,
                Side::new(&pb, lp.spec, env.gpu.as_ref(), a.mem, lp.len, lp.verb)?,
            ];
            connect_pair(&sides[0].qp, &sides[1].qp, a.mtu)?;
            let targets = (0..2).map(|i| Target::of(&sides[1 - i])).collect();
            Connected {
                sides,
                targets,
                peer_ep: None,
                ids: vec![0, 1],
            }
        }
    };
    for s in &c.sides {
        a.check_dmabuf(&s.src_mr, "source")?;
        a.check_dmabuf(&s.recv_mr, "receive")?;
        a.check_dmabuf(&s.sig_mr, "signal")?;
    }
    Ok(c)
}

/// Across processes: this side `m`, the hello (the parameters both must share, the endpoints,
/// the buffers each side's messages reach), its buffers checked, and its QP connected to the
/// peer's.
fn hello(args: &Args, lp: &LatPlan, env: &Env, p: &mut Peer, m: usize) -> Result<Connected> {
    let a = &args.common;
    let len = lp.len;
    let pd = env.ctx.alloc_pd();
    let s = Side::new(&pd, lp.spec, env.gpu.as_ref(), a.mem, len, lp.verb)?;
    let export = |mr: &Mr| RemoteMemory::export_rkey(mr.addr(), mr.len(), mr.rkey().0);
    let facts = json!({
        "recv": export(&s.recv_mr)?, "sig": export(&s.sig_mr)?, "src": export(&s.src_mr)?,
    });
    let params = json!({
        "sizes": lp.sizes, "iters": a.iters, "warmup": a.warmup, "signal": args.signal,
        "duration_s": args.duration,
    });
    let hello = p.hello(
        a,
        lp.test,
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
    let at = |r: &RemoteMemory| RemoteAddr {
        addr: r.addr(),
        rkey: Rkey(r.rkey()),
    };
    Ok(Connected {
        sides: vec![s],
        targets: vec![Target {
            recv: at(&recv),
            sig: at(&sig),
            src: at(&src),
        }],
        peer_ep: Some(ep),
        ids: vec![m],
    })
}

/// The initiator: a CPU initiator per side of this process, or the GPU's kernel with the
/// exported QPs and the buffers' GPU addresses.
fn engine(run: &Run) -> Result<Engine> {
    let sides = &run.c.sides;
    Ok(match run.env.initiator {
        Initiator::Cpu => {
            let mode = run.ring_mode.expect("CPU ring mode");
            Engine::Cpu(sides.iter().map(|s| s.qp.cpu_initiator(mode)).collect())
        }
        Initiator::Gpu => {
            let gpu = run.env.gpu.clone().expect("GPU initiator has a GPU");
            let qps: Vec<&Qp> = sides.iter().map(|s| &s.qp).collect();
            let exports = Exports::new(&gpu, &qps)?;
            let mut mapped = Vec::new();
            for s in sides {
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
                verb: run.lp.verb,
            }))
        }
    })
}
