//! Wire bandwidth: 1 MiB RDMA WRITEs over UDP on 127.0.0.1 without loss and at 1% loss.
//! Ignored by default (a measurement, not a check); run it optimized:
//!
//! ```text
//! cargo test --release -p gpuverbs-softnic --test wire_bench -- --ignored --nocapture
//! ```

use softnic::bench::{write_bw, WriteBw};

#[test]
#[ignore = "a measurement: run with --release -- --ignored --nocapture"]
fn write_bw_1mib() {
    for loss in [0.0, 0.01, 0.05] {
        for _ in 0..3 {
            let r = write_bw(WriteBw {
                loss,
                ..WriteBw::default()
            })
            .unwrap();
            println!(
                "1 MiB WRITEs, {:>3.0}% loss: {:>6.0} MB/s ({} MiB in {:?}; {} packets sent, {} \
                 retransmitted, {} timeouts)",
                loss * 100.0,
                r.bytes_per_sec() / 1e6,
                r.bytes >> 20,
                r.elapsed,
                r.requester.tx_packets,
                r.requester.retransmits,
                r.requester.timeouts,
            );
        }
    }
}

#[test]
fn write_bw_smoke() {
    // the measurement itself works (small, in any build)
    let r = write_bw(WriteBw {
        total: 4 << 20,
        loss: 0.01,
        ..WriteBw::default()
    })
    .unwrap();
    assert_eq!(r.bytes, 4 << 20);
    assert!(r.requester.tx_packets >= 1024);
}

#[test]
#[ignore = "diagnostics"]
fn write_bw_clean_counters() {
    for _ in 0..3 {
        let r = write_bw(WriteBw::default()).unwrap();
        println!("{:?}\n{:?}", r.requester, r.responder);
    }
}
