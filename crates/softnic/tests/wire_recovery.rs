//! Loss recovery without waste: a responder sends one sequence NAK per gap (not one per
//! packet out of sequence), and a clean run retransmits nothing (the early retransmission
//! timer adapts to the round trips and scheduling pauses it measures). With selective repeat
//! (both QPs agreed on it) the responder holds what arrives behind a gap and the requester
//! resends only what was lost. Counts only; no timing is asserted.

mod common;
mod wire_util;

use common::*;
use prm::wqe::{Local, Op, Opcode};
use softnic::{Access, RtsAttr, WireCounters, WireFaults};
use std::time::{Duration, Instant};
use wire_util::*;

const MIB: usize = 1 << 20;

/// `total` bytes of 1 MiB WRITEs, 16 outstanding, A → B, with selective repeat; returns both
/// sides' wire counters.
fn bulk(total: usize, fa: WireFaults, fb: WireFaults) -> (WireCounters, WireCounters) {
    bulk_with(wire_opts(), total, fa, fb)
}

/// The IBTA local ACK timeout of these tests' QPs: 4.096 µs · 2^18 ≈ 1.07 s. The tests count
/// its expirations as failures of the early recovery (NAKs, gap reports, the early timer), so
/// it must not fire for a pause of the whole process: CI's loaded job (a busy loop per core of
/// a 2-core VM) once saw one expiry of wire_opts()'s 268 ms (2026-12-07, 3cd18c7: 5% loss both
/// ways, 11 early timeouts), not seen in 55 runs here beside 2 and 4 busy loops. A recovery
/// that needs the IBTA timer still shows: the timer fires, later.
const RECOVERY_TIMEOUT: u8 = 18;

/// [`bulk`] with the options `o` on both QPs (their local ACK timeout [`RECOVERY_TIMEOUT`]).
fn bulk_with(
    o: Opts,
    total: usize,
    fa: WireFaults,
    fb: WireFaults,
) -> (WireCounters, WireCounters) {
    let o = Opts {
        rts: RtsAttr {
            timeout: RECOVERY_TIMEOUT,
            ..o.rts
        },
        ..o
    };
    let mut p = wire_pair(o.clone(), o, 4096, fa, fb);
    let src = p.a.buf(total, Access::NONE);
    fill_random(&src, 0x6a9);
    let dst = p.b.buf(total, ALL_REMOTE);
    bulk_write(&mut p, &src, &dst, MIB, 16);
    assert!(dst.bytes() == src.bytes(), "bytes differ");
    (p.a.dev.counters().wire, p.b.dev.counters().wire)
}

/// The default send window (packets): what an early timeout's go-back-N resends at most.
fn window() -> u64 {
    u64::from(softnic::WireConfig::loopback().window)
}

/// Selective repeat on requests lost (answers never): each lost packet is resent about once,
/// at most twice (its resend lost too, or its gap named again before the resend arrived), plus
/// a window for each early timeout (generous: an early timeout resends one packet, a probe,
/// and what the responder then reports missing).
fn assert_resends_per_loss_at_most_two(a: &WireCounters) {
    assert!(
        a.retransmits <= a.injected_drops * 2 + 16 + a.early_timeouts * window(),
        "{} packets resent for {} lost ({} early timeouts)",
        a.retransmits,
        a.injected_drops,
        a.early_timeouts
    );
}

#[test]
fn one_sequence_nak_per_gap() {
    let _s = serial();
    // Go-back-N. Requests lost at 1%, answers never: every NAK the responder sends arrives. A
    // gap is one or more consecutive losses; the responder NAKs it once, and once more only
    // when the retransmission it asked for is lost too, which is another loss. So never more
    // NAKs than losses (about 6.5 per loss before).
    let (a, b) = bulk_with(
        go_back_n_opts(),
        16 * MIB,
        WireFaults::loss(0.01, 77),
        WireFaults::default(),
    );
    assert_eq!(b.sr_gaps_filled, 0, "go-back-N holds nothing: {b:?}");
    eprintln!(
        "A: {} drops, {} retransmitted, {} NAKs received, {} timeouts; B: {} NAKs sent, {} out \
         of sequence",
        a.injected_drops,
        a.retransmits,
        a.seq_naks_received,
        a.timeouts,
        b.seq_naks_sent,
        b.out_of_sequence
    );
    assert!(a.injected_drops > 10, "{a:?}");
    assert!(b.seq_naks_sent > 0, "{b:?}");
    assert!(
        b.seq_naks_sent <= a.injected_drops,
        "{} sequence NAKs for {} lost packets",
        b.seq_naks_sent,
        a.injected_drops
    );
    assert_eq!(a.seq_naks_received, b.seq_naks_sent);
}

#[test]
fn selective_repeat_resends_only_what_was_lost() {
    let _s = serial();
    // Requests lost at 1%, answers never: the responder holds what follows each gap and NAKs
    // the gap once; the requester resends that packet alone. Go-back-N resent about 22
    // packets per loss here; selective repeat resends each lost packet about once (again
    // only when its resend is lost too, or the responder's timer names the gap again before
    // the resend arrived).
    let (a, b) = bulk(16 * MIB, WireFaults::loss(0.01, 77), WireFaults::default());
    eprintln!("A: {a:?}\nB: {b:?}");
    assert!(a.injected_drops > 10, "{a:?}");
    assert!(b.sr_gaps_filled > 0 && b.sr_held_run > 0, "{b:?}");
    // (An early timer that fired after a scheduling pause longer than it, on a loaded
    // machine, goes back N: at most a window, 256 packets, each. They stay rare next to the
    // losses: 0-2 on an idle machine, 4 for 42 losses seen with two busy loops per core.)
    assert!(a.early_timeouts <= 2 + a.injected_drops / 8, "{a:?}");
    assert_resends_per_loss_at_most_two(&a);
    assert_eq!(a.timeouts, 0, "{a:?}");
}

#[test]
fn selective_repeat_reports_every_gap_as_it_opens() {
    let _s = serial();
    // Requests lost at 5%, answers never: about 13 losses per window, so most gaps open
    // behind another. The responder reports each as it opens (a sequence NAK names only the
    // first gap and acknowledges everything before it, which repaired one gap per round
    // trip); every report reaches the requester and names PSNs in flight, which it resends
    // without waiting for the gaps in front of them (at most once a round trip each).
    let (a, b) = bulk(16 * MIB, WireFaults::loss(0.05, 31), WireFaults::default());
    eprintln!("A: {a:?}\nB: {b:?}");
    assert!(a.injected_drops > 100, "{a:?}");
    assert!(
        b.sr_gap_reports_sent * 4 >= a.injected_drops,
        "{} gap reports for {} lost packets",
        b.sr_gap_reports_sent,
        a.injected_drops
    );
    // every report arrives; one naming a PSN resent less than a round trip ago (the
    // responder's timer may name a gap again before the resend reached it) is counted as
    // ignored rather than acted on (seen once in CI: 203 acted on, 1 ignored, 204 sent)
    assert_eq!(
        a.sr_gap_reports_received + a.sr_gap_reports_ignored,
        b.sr_gap_reports_sent,
        "{a:?}"
    );
    // every sequence NAK sent arrives, and is counted on both sides
    assert_eq!(a.seq_naks_received, b.seq_naks_sent, "{a:?}\n{b:?}");
    assert_eq!(a.rx_unexpected, 0, "{a:?}");
    assert_eq!(a.timeouts, 0, "{a:?}");
    assert_resends_per_loss_at_most_two(&a);
}

#[test]
fn selective_repeat_recovers_lost_naks_and_resends() {
    let _s = serial();
    // 5% each way: NAKs, resends and the ACKs after them are lost too. The responder's
    // timer names a gap again while packets are held behind it; everything arrives (checked
    // byte for byte by `bulk`) without the IBTA timer.
    let (a, b) = bulk(
        8 * MIB,
        WireFaults::loss(0.05, 11),
        WireFaults::loss(0.05, 12),
    );
    eprintln!("A: {a:?}\nB: {b:?}");
    assert!(a.injected_drops > 50 && b.injected_drops > 0, "{a:?} {b:?}");
    assert!(b.sr_gaps_filled > 0, "{b:?}");
    assert_eq!(a.timeouts, 0, "{a:?}");
    assert!(
        a.retransmits < a.injected_drops * 4 + a.early_timeouts * window(),
        "{} packets resent for {} lost ({} early timeouts)",
        a.retransmits,
        a.injected_drops,
        a.early_timeouts
    );
}

#[test]
fn a_clean_run_retransmits_nothing() {
    let _s = serial();
    // 4 MiB without faults, three times each way of recovering: the early timer must not
    // fire for packets that are only late. A run passes when it resent nothing, or (a VM
    // whose host steals a third of the time stalls threads longer than the early timer,
    // seen on this machine at 2026-12-03 15:40 UTC with the code before and after that day's
    // changes alike) when each resend was an early timer's probe: one packet per expiry,
    // never a window, no NAK, no IBTA timeout.
    for o in [wire_opts(), go_back_n_opts()] {
        clean_runs(o);
    }
}

fn clean_runs(o: Opts) {
    let mut seen = Vec::new();
    for _ in 0..3 {
        let (a, b) = bulk_with(
            o.clone(),
            4 * MIB,
            WireFaults::default(),
            WireFaults::default(),
        );
        assert_eq!(b.seq_naks_sent, 0, "{b:?}");
        assert_eq!(a.timeouts, 0, "{a:?}");
        assert!(
            a.retransmits <= a.early_timeouts,
            "selective repeat {}: {} packets resent for {} early timeouts",
            o.selective_repeat,
            a.retransmits,
            a.early_timeouts
        );
        if a.retransmits == 0 {
            return;
        }
        seen.push((a.retransmits, a.early_timeouts));
    }
    eprintln!(
        "note: every clean run had early timeouts (selective repeat {}), one probe each:          (resent, early timeouts) {seen:?}",
        o.selective_repeat
    );
}

/// A pause of the responder longer than the early timer costs a probe per early timeout, not
/// a window: B's fourth datagram (an ACK, after A has timed round trips) waits 60 ms, beyond
/// the early timer (at most 40 ms here, the IBTA timer 268 ms). Everything A sent had arrived;
/// each probe resends one packet, and its duplicate draws the ACK. Going back N here resent
/// what was in flight, hundreds of packets, all arriving as duplicates.
#[test]
fn a_paused_peer_costs_a_probe_not_a_window() {
    let _s = serial();
    for o in [wire_opts(), go_back_n_opts()] {
        let mode = if o.selective_repeat {
            "selective repeat"
        } else {
            "go-back-N"
        };
        // The pause must outlast the early timer, which adapts to the round trips it measured:
        // on a machine loaded enough to stretch them, a run may see none; a few tries then.
        let mut fired = false;
        for _ in 0..3 {
            let stall = WireFaults {
                stall: Some((3, Duration::from_millis(60))),
                ..WireFaults::default()
            };
            let (a, b) = bulk_with(o.clone(), 4 * MIB, WireFaults::default(), stall);
            assert_eq!(a.timeouts, 0, "{mode}: {a:?}");
            assert!(
                a.retransmits <= a.early_timeouts,
                "{mode}: {} packets resent for {} early timeouts: {a:?}",
                a.retransmits,
                a.early_timeouts
            );
            assert_eq!(b.seq_naks_sent, 0, "{mode}: {b:?}");
            if a.early_timeouts >= 1 {
                fired = true;
                break;
            }
            eprintln!("note: {mode}: the pause did not outlast the early timer: {a:?}");
        }
        assert!(
            fired,
            "{mode}: in three runs the pause never outlasted the early timer"
        );
    }
}

/// A WQE handed to the wire is not finished until its answer arrives: `Qp::sq_finished` stays
/// at it while the consumer index has moved on (what `Mr::deregister` waits for), and catches
/// up when the peer's ACK gets through.
#[test]
fn a_wqe_on_the_wire_is_finished_only_when_answered() {
    let _serial = serial();
    let mut p = wire_pair(
        wire_opts(),
        wire_opts(),
        1024,
        WireFaults::default(),
        WireFaults::loss(1.0, 7),
    );
    let dst = p.b.buf(4096, ALL_REMOTE);
    let w = Op::Write {
        remote: dst.remote(0),
        local: Local::Inline(b"on the wire"),
        imm: None,
    };
    let idx = p.ea.go(&w, SIG);
    let t = Instant::now();
    while p.ea.qp.sq_consumer() == idx {
        assert!(t.elapsed() < T, "the engine never took the WQE");
        std::thread::sleep(Duration::from_millis(1));
    }
    // the requester retransmits into silence (B's answers are all lost)
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(p.ea.qp.sq_finished(), idx, "finished before the ACK came");
    p.b.dev.set_wire_faults(WireFaults::default()).unwrap();
    p.ea.expect_req(Opcode::RdmaWrite as u8, idx);
    assert_eq!(p.ea.qp.sq_finished(), p.ea.qp.sq_consumer());
    assert_eq!(dst.read(0, 11), b"on the wire");
}
