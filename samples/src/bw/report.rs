//! What the bandwidth tests report: what a timed run measured ([`Timing`]), what a side measured
//! of a size ([`Measured`]), the numbers of a row ([`combine`]), and the registration cache's
//! line and JSON.

use super::plan::{RegTiming, Side};
use crate::Units;
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
