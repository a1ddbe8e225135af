//! A latency run set up: the options as this process resolves them ([`LatPlan`]), the
//! connection ([`Connected`]) and what every later step reads ([`Run`]). Below the steps of
//! [`super::run`], which make them, and of the header and the sizes, which read them.

use super::args::{Args, Test, DEFAULT_OUTS};
use super::side::{Side, Target};
use crate::bw::Verb;
use crate::{tx_depth_for, Env, QpSpec};
use anyhow::Result;
use gpuverbs::post::RingMode;
use gpuverbs::Endpoint;
use std::time::Duration;

/// The options of a run as resolved before it meets its peer: the sizes, the duration, the
/// inline limit, the SQ size and the buffers' length.
pub(super) struct LatPlan {
    /// The test's name (perftest's binary name).
    pub(super) test: &'static str,
    pub(super) verb: Verb,
    pub(super) sizes: Vec<u64>,
    /// `-o` (READ and atomics).
    pub(super) outs: u32,
    /// `-D`.
    pub(super) duration: Option<Duration>,
    /// The CPU_Util column: --cpu_util in duration mode.
    pub(super) cpu_util: bool,
    /// The inline limit asked for (perftest's default).
    pub(super) inline_max: u32,
    /// SQ size in blocks.
    pub(super) tx: u32,
    pub(super) spec: QpSpec,
    /// Bytes of each side's buffers (the largest size, in whole words).
    pub(super) len: usize,
}

impl LatPlan {
    /// The options resolved (and --cpu_util's warning without -D).
    pub(super) fn resolve(args: &Args, t: &Test) -> Result<Self> {
        let a = &args.common;
        let sizes = a.sizes(t.default_size);
        let duration = args.duration.map(|d| Duration::from_secs(d.into()));
        // perftest reports CPU utilisation in duration mode only (and warns otherwise).
        let cpu_util = args.cpu_util && duration.is_some();
        if args.cpu_util && !cpu_util {
            eprintln!(
                "{}: --cpu_util: CPU Utilization works only with Duration mode (-D)",
                t.name
            );
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
        // Two WQEs per iteration with --signal (write + atomic), one CQE per --cq-mod
        // iterations.
        let tx = tx_depth_for(a.tx_depth, (2 * a.cq_mod as u64 + 2) * wqe_blocks)?;
        let max = *sizes.iter().max().expect("one size at least");
        Ok(Self {
            test: t.name,
            verb: t.verb,
            outs: args.outs.unwrap_or(DEFAULT_OUTS),
            duration,
            cpu_util,
            inline_max,
            tx,
            spec: QpSpec {
                tx_depth: tx,
                rings: a.rings,
                db: a.db,
            },
            len: (max.next_multiple_of(8) as usize).max(8),
            sizes,
        })
    }
}

/// The connected sides: this process's (both in loopback; across processes its own, the client
/// is A and the server B), where each one's messages go, and the peer's endpoint.
pub(super) struct Connected {
    pub(super) sides: Vec<Side>,
    pub(super) targets: Vec<Target>,
    pub(super) peer_ep: Option<Endpoint>,
    /// The side number (A = 0, B = 1) of each entry of `sides`.
    pub(super) ids: Vec<usize>,
}

/// A run set up: its options, plan, device and connected sides; what the header, the initiator
/// and every size read.
pub(super) struct Run<'a> {
    pub(super) args: &'a Args,
    pub(super) t: &'a Test,
    pub(super) lp: &'a LatPlan,
    pub(super) env: &'a Env,
    pub(super) c: &'a Connected,
    /// The CPU initiator's doorbell convention (`None`: the GPU's).
    pub(super) ring_mode: Option<RingMode>,
}
