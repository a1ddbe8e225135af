//! A bandwidth run set up: the options as this process resolves them against its device
//! ([`RunPlan`]), the connected jobs ([`Rendezvous`]) and what every later step reads ([`Run`]).
//! Below the steps of [`super::run`], which make them, and of the header and the sizes,
//! which read them.

use super::args::{needs, Args, Scope, Test, DEFAULT_RX_DEPTH};
use super::plan::{reached_buf, Job, Side};
use super::verb::Verb;
use crate::{check_placement, cpu_ring_mode, tx_depth_for, Env, Initiator, QpSpec, Units};
use anyhow::{bail, Result};
use gpuverbs::post::RingMode;
use gpuverbs::{Endpoint, Qp, RemoteMemory};

/// The options of a run as this process resolves them against its device: the sizes, the jobs
/// it drives and their workers, how they post, the SQ size, the units of the table.
pub(super) struct RunPlan {
    /// The test's name (perftest's binary name).
    pub(super) test: &'static str,
    pub(super) verb: Verb,
    pub(super) sizes: Vec<u64>,
    /// `-o` as it applies (0 where the verb has none).
    pub(super) outs: u32,
    /// SEND: receives kept posted per QP.
    pub(super) rx_depth: u32,
    /// This process's side across processes (the client is A, the server B); `None` in
    /// loopback.
    pub(super) me: Option<usize>,
    /// QPs per direction.
    pub(super) qps: usize,
    /// Jobs of both directions.
    pub(super) njobs: usize,
    /// The jobs this process drives.
    pub(super) local: Vec<usize>,
    pub(super) scope: Scope,
    pub(super) threads: u32,
    pub(super) ctas: u32,
    /// Workers of the jobs this process drives: CTA c drives local job c % n.
    pub(super) local_workers: Vec<u32>,
    /// Calls per signaled WQE.
    pub(super) sig_calls: u32,
    /// SQ size in blocks.
    pub(super) tx: u32,
    pub(super) spec: QpSpec,
    /// The CPU initiator's doorbell convention (`None`: the GPU's).
    pub(super) ring_mode: Option<RingMode>,
    pub(super) units: Units,
    /// The CPU_Util column: --cpu_util in duration mode.
    pub(super) cpu_util: bool,
}

impl RunPlan {
    /// The options resolved against `env` (and checked: the initiator's options, the CTAs),
    /// for side `me` (`None`: both, in loopback).
    pub(super) fn resolve(args: &Args, t: &Test, env: &Env, me: Option<usize>) -> Result<Self> {
        let a = &args.common;
        let verb = t.verb;
        let sizes = a.sizes(t.default_size);
        let outs = args.outs(verb);
        let dirs = if args.bidir { 2 } else { 1 };
        let ring_mode = check_initiator(args, env)?;
        // Jobs: QP k of side A writes into side B (direction 0) and, with --bidir, QP k of B
        // into A (direction 1). In loopback this process drives them all; across processes
        // each side drives the jobs it sends (the client is A, the server B).
        let qps = args.qps as usize;
        let njobs = qps * dirs;
        let local: Vec<usize> = (0..njobs)
            .filter(|&j| me.is_none_or(|s| j / qps == s))
            .collect();
        let scope = args
            .scope
            .unwrap_or(default_scope(args, env.initiator, verb));
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
        let local_workers = local_workers(env.initiator, local.len(), ctas, threads);
        let wmax = local_workers.iter().copied().max().unwrap_or(1) as u64;
        let (sig_calls, tx) = sq_depth(args, env.initiator, scope, threads, outs, &sizes, wmax)?;
        Ok(Self {
            test: t.name,
            verb,
            sizes,
            outs,
            rx_depth: args.rx_depth.unwrap_or(DEFAULT_RX_DEPTH),
            me,
            qps,
            njobs,
            local,
            scope,
            threads,
            ctas,
            local_workers,
            sig_calls,
            tx,
            spec: QpSpec {
                tx_depth: tx,
                rings: a.rings,
                db: a.db,
            },
            ring_mode,
            units: if args.report_gbits {
                Units::Gbits
            } else {
                Units::MBytes
            },
            // perftest reports CPU utilisation in duration mode only (and warns otherwise).
            cpu_util: args.cpu_util && args.duration.is_some(),
        })
    }

    /// This side drives no job: it only answers (or, for SEND, receives).
    pub(super) fn receives_only(&self) -> bool {
        self.local.is_empty()
    }
}

/// The initiator's checks: the GPU-only options refused with the CPU, the CPU's doorbell
/// convention, the placements it can reach; the convention (`None`: the GPU posts).
fn check_initiator(args: &Args, env: &Env) -> Result<Option<RingMode>> {
    let a = &args.common;
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
    check_placement(a, env)?;
    Ok(ring_mode)
}

/// Workers of each of the `n` jobs this process drives: CTA c drives local job c % n.
fn local_workers(initiator: Initiator, n: usize, ctas: u32, threads: u32) -> Vec<u32> {
    (0..n)
        .map(|i| match initiator {
            Initiator::Cpu => 1,
            Initiator::Gpu => {
                let c = ctas as usize / n + usize::from(i < ctas as usize % n);
                (c as u32) * threads
            }
        })
        .collect()
}

/// SQ size and signaling: the calls per signaled WQE, and the SQ blocks that hold what one
/// QP's `wmax` posters may leave unsignaled or unrung.
fn sq_depth(
    args: &Args,
    initiator: Initiator,
    scope: Scope,
    threads: u32,
    outs: u32,
    sizes: &[u64],
    wmax: u64,
) -> Result<(u32, u32)> {
    let a = &args.common;
    let (unit, batch_eff) = match (initiator, scope) {
        (Initiator::Cpu, _) => (1, args.post_list),
        (Initiator::Gpu, Scope::Thread) => (1, args.post_list),
        (Initiator::Gpu, Scope::Warp) => (threads.min(32), 1),
        (Initiator::Gpu, Scope::Block) => (threads, 1),
    };
    let sig_calls = match outs {
        0 => (a.cq_mod / unit).max(1),
        o => a.cq_mod.min(o),
    };
    // Blocks one QP's posters may leave without a CQE (unsignaled) or unrung.
    // An inline WQE takes ctrl + raddr + the inline header and data, in 64-byte blocks.
    let largest_inline = sizes
        .iter()
        .copied()
        .filter(|&s| s <= args.inline_size as u64)
        .max();
    let wqe_blocks = largest_inline.map_or(1, |s| (36 + s).div_ceil(64));
    let pending = wmax * (sig_calls as u64 + batch_eff as u64) * wqe_blocks + unit as u64;
    Ok((sig_calls, tx_depth_for(a.tx_depth, pending)?))
}

/// The connected jobs: every job with its workers (the peer says how many drive its jobs), the
/// QPN of each job's sender, and the peer's endpoints (across processes).
pub(super) struct Rendezvous {
    pub(super) jobs: Vec<Job>,
    /// QPN of each job's sender (this process's QP, or the peer's).
    pub(super) sender_qpn: Vec<u32>,
    pub(super) peer_eps: Vec<Endpoint>,
}

/// A run set up: its options, plan, device, sides and jobs, and the peer's buffer; what the
/// header, the initiators and every size read.
pub(super) struct Run<'a> {
    pub(super) args: &'a Args,
    pub(super) t: &'a Test,
    pub(super) rp: &'a RunPlan,
    pub(super) env: &'a Env,
    pub(super) sides: &'a [Option<Side>; 2],
    pub(super) rv: &'a Rendezvous,
    /// The peer's buffer that this side's WQEs reach (across processes).
    pub(super) peer_dst: Option<&'a RemoteMemory>,
    /// The RKey and VAddr of the peer's address lines.
    pub(super) peer_shown: (u32, u64),
    /// The QP the header and the JSON describe.
    pub(super) first_qp: &'a Qp,
    /// The QPNs of the jobs this process drives, in the order of `rp.local`.
    pub(super) qpns: Vec<u32>,
}

/// The RKey and VAddr side `s`'s address lines show (perftest's): the buffer the peer's WQEs
/// reach (WRITE's destination, READ's source, the atomics' words), or on a side that is no
/// target its destination or source.
pub(super) fn shown(sides: &[Option<Side>; 2], s: usize, verb: Verb) -> (u32, u64) {
    sides[s]
        .as_ref()
        .and_then(|sd| {
            reached_buf(sd, verb)
                .or(sd.dst.as_ref())
                .or(sd.src.as_ref())
        })
        .map_or((0, 0), |(_, mr)| (mr.rkey().0, mr.addr()))
}

/// The posting scope when `--scope` is not given: a warp for the GPU initiator's WRITEs, READs
/// and atomics (one thread ringing a doorbell, and for READs and atomics taking a CQE, per WQE
/// leaves the GPU initiator at a fraction of the CPU's message rate on small messages; a warp's
/// 32 WQEs per doorbell and per CQE reach it, docs/benchmarks.md), a thread otherwise: SENDs
/// post with one thread per QP, `-I` and `-l` are thread-scope options, the CPU has no scope.
fn default_scope(args: &Args, initiator: Initiator, verb: Verb) -> Scope {
    match (initiator, verb) {
        (Initiator::Gpu, Verb::Write) if args.inline_size == 0 && args.post_list == 1 => {
            Scope::Warp
        }
        (Initiator::Gpu, v) if v.has_outs() => Scope::Warp,
        _ => Scope::Thread,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(v: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("put_bw").chain(v.iter().copied())).unwrap()
    }

    #[test]
    fn the_gpu_initiator_posts_writes_reads_and_atomics_with_a_warp_unless_asked_otherwise() {
        let gpu_write = |v: &[&str]| default_scope(&args(v), Initiator::Gpu, Verb::Write);
        assert_eq!(gpu_write(&[]), Scope::Warp);
        assert_eq!(
            gpu_write(&["-I", "64"]),
            Scope::Thread,
            "-I is a thread-scope option"
        );
        assert_eq!(
            gpu_write(&["-l", "8"]),
            Scope::Thread,
            "-l is a thread-scope option"
        );
        assert_eq!(
            default_scope(&args(&[]), Initiator::Cpu, Verb::Write),
            Scope::Thread
        );
        assert_eq!(
            default_scope(&args(&[]), Initiator::Gpu, Verb::Read),
            Scope::Warp,
            "READs and atomics: a warp's WQEs under one doorbell and one CQE"
        );
        assert_eq!(
            default_scope(&args(&[]), Initiator::Gpu, Verb::Send),
            Scope::Thread
        );
        assert_eq!(
            default_scope(&args(&[]), Initiator::Cpu, Verb::Read),
            Scope::Thread
        );
    }
}
