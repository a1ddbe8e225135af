//! Bulk data over the wire: 64 MiB of RDMA WRITEs in 1 MiB WQEs from one device to another
//! over UDP on 127.0.0.1, without faults, under 1% and 5% loss, under duplication and under
//! reordering (on both directions: requests and ACKs): the receiver's bytes must be identical,
//! every signaled WQE must complete (in order), and nothing may hang.

mod common;
mod wire_util;

use softnic::{Access, WireFaults};
use std::time::Duration;
use wire_util::*;

const MIB: usize = 1 << 20;

fn run(name: &str, total: usize, f: WireFaults) {
    let mut g = f;
    g.seed = f.seed.wrapping_add(1000);
    let mut p = wire_pair(wire_opts(), wire_opts(), 4096, f, g);
    let src = p.a.buf(total, Access::NONE);
    fill_random(&src, f.seed ^ 0xb01c);
    let dst = p.b.buf(total, ALL_REMOTE);
    let took = bulk_write(&mut p, &src, &dst, MIB, 16);
    assert!(dst.bytes() == src.bytes(), "{name}: bytes differ");
    assert!(dst.guards_intact());
    p.ea.expect_quiet(Duration::from_millis(1));
    let (ca, cb) = (p.a.dev.counters(), p.b.dev.counters());
    assert_eq!(ca.wqes_executed, (total / MIB) as u64);
    assert_eq!(ca.bytes_moved, total as u64);
    eprintln!(
        "{name}: {} MiB in {took:?} ({:.0} MB/s); A: {} sent, {} retransmitted, {} timeouts; \
         B: {} duplicates, {} out of sequence, {} bad ICRC",
        total / MIB,
        total as f64 / took.as_secs_f64() / 1e6,
        ca.wire.tx_packets,
        ca.wire.retransmits,
        ca.wire.timeouts,
        cb.wire.duplicates,
        cb.wire.out_of_sequence,
        cb.wire.rx_bad_icrc,
    );
}

#[test]
fn writes_64mib_clean() {
    let _s = serial();
    run("clean", 64 * MIB, WireFaults::default());
}

#[test]
fn writes_64mib_1pct_loss() {
    let _s = serial();
    run("1% loss", 64 * MIB, WireFaults::loss(0.01, 11));
}

#[test]
fn writes_under_5pct_loss() {
    let _s = serial();
    run("5% loss", 64 * MIB, WireFaults::loss(0.05, 12));
}

#[test]
fn writes_64mib_duplication() {
    let _s = serial();
    run("2% duplication", 64 * MIB, faults(13, 0.0, 0.02, 0.0, 0.0));
}

#[test]
fn writes_64mib_reordering() {
    let _s = serial();
    run("2% reordering", 64 * MIB, faults(14, 0.0, 0.0, 0.02, 0.0));
}

#[test]
fn writes_64mib_corruption() {
    let _s = serial();
    run("1% corruption", 64 * MIB, faults(15, 0.0, 0.0, 0.0, 0.01));
}

/// On-CPU time (ns) of this process's threads whose name ends in `-wire` (the devices' I/O
/// threads), from /proc/self/task/*/schedstat.
fn wire_threads_cpu_ns() -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
        let dir = t.expect("task entry").path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let comm = comm.trim();
        if !comm.ends_with("-wire") {
            continue;
        }
        let st = std::fs::read_to_string(dir.join("schedstat")).unwrap_or_default();
        let ns = st.split_whitespace().next().and_then(|v| v.parse().ok());
        out.push((
            format!("{comm} ({})", dir.display()),
            ns.expect("schedstat"),
        ));
    }
    out
}

#[test]
fn wire_threads_sleep_once_traffic_stops() {
    // The I/O thread keeps looking for datagrams for a moment after traffic (instead of
    // sleeping at once): once traffic stops it must go back to sleep in `poll`, and sleep
    // there (no fault injection holds a datagram back, so nothing needs it sooner).
    let _s = serial();
    let mut p = wire_pair(
        wire_opts(),
        wire_opts(),
        4096,
        WireFaults::default(),
        WireFaults::default(),
    );
    let src = p.a.buf(8 * MIB, Access::NONE);
    fill_random(&src, 77);
    let dst = p.b.buf(8 * MIB, ALL_REMOTE);
    bulk_write(&mut p, &src, &dst, MIB, 16);
    assert!(dst.bytes() == src.bytes());
    std::thread::sleep(Duration::from_millis(50));
    let before = wire_threads_cpu_ns();
    assert_eq!(before.len(), 2, "two wire threads: {before:?}");
    let idle = Duration::from_millis(400);
    std::thread::sleep(idle);
    let after = wire_threads_cpu_ns();
    for ((name, a), (_, b)) in before.iter().zip(after.iter()) {
        let used = b.saturating_sub(*a);
        eprintln!("{name}: {used} ns on a CPU in {idle:?} idle");
        // 1% of the idle time (a thread that spins takes most of it; one that woke every
        // millisecond, as before, about 3%)
        assert!(
            used < idle.as_nanos() as u64 / 100,
            "{name} used {used} ns of {idle:?} while idle"
        );
    }
}
