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
    for selective_repeat in [true, false] {
        for loss in [0.0, 0.01, 0.05] {
            for _ in 0..3 {
                let r = write_bw(WriteBw {
                    loss,
                    selective_repeat,
                    ..WriteBw::default()
                })
                .unwrap();
                println!(
                    "1 MiB WRITEs, {}, {:>3.0}% loss: {:>6.0} MB/s ({} MiB in {:?}; {} packets \
                     sent, {} retransmitted, {} timeouts, {} early, {} NAKs; \
                     )",
                    if selective_repeat {
                        "selective repeat"
                    } else {
                        "go-back-N"
                    },
                    loss * 100.0,
                    r.bytes_per_sec() / 1e6,
                    r.bytes >> 20,
                    r.elapsed,
                    r.requester.tx_packets,
                    r.requester.retransmits,
                    r.requester.timeouts,
                    r.requester.early_timeouts,
                    r.requester.seq_naks_received,
                );
            }
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

#[test]
#[ignore = "diagnostics"]
fn write_bw_windows() {
    for _ in 0..2 {
        for window in [128u32, 256, 512, 1024] {
            for loss in [0.0, 0.01, 0.05] {
                let r = write_bw(WriteBw {
                    loss,
                    window,
                    total: 128 << 20,
                    ..WriteBw::default()
                })
                .unwrap();
                println!(
                "window {window}, {:>3.0}% loss: {:>6.0} MB/s; {} retransmitted, {} early; resp: {} filled {} run {} naks {} oos {} dup",
                loss * 100.0,
                r.bytes_per_sec() / 1e6,
                r.requester.retransmits,
                r.requester.early_timeouts,
                r.responder.sr_gaps_filled,
                r.responder.sr_held_run,
                r.responder.seq_naks_sent,
                r.responder.out_of_sequence,
                r.responder.duplicates,
            );
            }
        }
    }
}
