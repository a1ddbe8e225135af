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
