//! The soft NIC's wire counters ([`wire_counters`]) and what a run did to them ([`wire_delta`]).

use gpuverbs::Context;
use serde_json::{json, Value};

/// What this side's wire port did between two counter snapshots (the JSON's `"wire"`):
/// datagrams each way, request packets sent again, timer expirations (IBTA and early), sequence
/// and RNR NAKs, datagrams dropped on purpose, requests out of sequence and duplicate, selective
/// repeat's gaps filled, gap reports each way (acted on and ignored), held packets dropped,
/// requests outside the hold window and conflicting duplicates; `null` without a soft NIC (an rdma-core device has no such counters).
pub fn wire_delta(
    before: &Option<gpuverbs::soft::WireCounters>,
    after: &Option<gpuverbs::soft::WireCounters>,
) -> Value {
    let (Some(before), Some(after)) = (before, after) else {
        return Value::Null;
    };
    let d = |a: u64, b: u64| a.saturating_sub(b);
    json!({
        "tx_packets": d(after.tx_packets, before.tx_packets),
        "rx_packets": d(after.rx_packets, before.rx_packets),
        "retransmits": d(after.retransmits, before.retransmits),
        "timeouts": d(after.timeouts, before.timeouts),
        "seq_naks_sent": d(after.seq_naks_sent, before.seq_naks_sent),
        "seq_naks_received": d(after.seq_naks_received, before.seq_naks_received),
        "injected_drops": d(after.injected_drops, before.injected_drops),
        "early_timeouts": d(after.early_timeouts, before.early_timeouts),
        "rnr_naks_sent": d(after.rnr_naks_sent, before.rnr_naks_sent),
        "rnr_naks_received": d(after.rnr_naks_received, before.rnr_naks_received),
        "out_of_sequence": d(after.out_of_sequence, before.out_of_sequence),
        "duplicates": d(after.duplicates, before.duplicates),
        "sr_gaps_filled": d(after.sr_gaps_filled, before.sr_gaps_filled),
        "sr_gap_reports_sent": d(after.sr_gap_reports_sent, before.sr_gap_reports_sent),
        "sr_gap_reports_received": d(after.sr_gap_reports_received, before.sr_gap_reports_received),
        "sr_gap_reports_ignored": d(after.sr_gap_reports_ignored, before.sr_gap_reports_ignored),
        "sr_held_dropped": d(after.sr_held_dropped, before.sr_held_dropped),
        "out_of_window": d(after.out_of_window, before.out_of_window),
        "rx_conflicting_duplicates": d(after.rx_conflicting_duplicates, before.rx_conflicting_duplicates),
    })
}

/// The wire counters of a context's soft NIC (`None` without one).
pub fn wire_counters(ctx: &Context) -> Option<gpuverbs::soft::WireCounters> {
    ctx.soft_device().map(|d| d.counters().wire)
}
