//! The WQE path: any bytes as one send WQE (up to 16 blocks) in the SQ ring of a connected QP
//! pair (two soft NICs in process), rung with a doorbell. The oracle: the WQE completes (a CQE,
//! success or error) within a bound, or it is a WAIT whose CQ count is never reached (the SQ
//! stalls, as on a ConnectX); never a panic; nothing written outside the registered buffers
//! (guard memory on both sides of each; AddressSanitizer for the rest). The buffers are at
//! fixed addresses (`fixture.rs`), so seeds name them.
//!
//! Input: a control byte, then the WQE. Control bit 0 clear: the harness writes the WQE index
//! and the QPN into the control segment (so the WQE is not refused as stale); set: the bytes
//! stay as given. The control segment always asks for a CQE. The fixture is fresh for each
//! input, so keys, QPNs and addresses are the same in every run (the seeds name them).
#![no_main]

#[path = "../../crates/softnic/tests/common/mod.rs"]
mod common;
mod fixture;
#[path = "../../crates/softnic/tests/wire_util/mod.rs"]
mod wire_util;

use fixture::Fixture;
use libfuzzer_sys::fuzz_target;
use std::time::Duration;

/// A WQE that neither completes nor stalls on a WAIT within this is a hang.
const BOUND: Duration = Duration::from_secs(5);
/// How long a WAIT is given to complete before it counts as stalled.
const WAIT_BOUND: Duration = Duration::from_millis(50);
const MAX_BLOCKS: usize = 16;
const WAIT: u8 = 0x0f;

fuzz_target!(|d: &[u8]| {
    let Some((&ctl, body)) = d.split_first() else {
        return;
    };
    let blocks = body.len().div_ceil(64).clamp(1, MAX_BLOCKS);
    let mut w = vec![0u8; blocks * 64];
    let n = body.len().min(w.len());
    w[..n].copy_from_slice(&body[..n]);

    let mut f = Fixture::local();
    let p = &mut f.p;
    let idx = p.ea.ini.producer();
    if ctl & 1 == 0 {
        w[1..3].copy_from_slice(&idx.to_be_bytes());
        w[4..7].copy_from_slice(&p.ea.qpn().to_be_bytes()[1..]);
    }
    w[11] |= 0x08;
    let opcode = w[3];
    p.ea.post_raw(&w);
    p.ea.ini.ring();
    // a WAIT's CQ count may never be reached: it completes at once or stalls
    let bound = if opcode == WAIT { WAIT_BOUND } else { BOUND };
    if let Err(e) = p.ea.ini.wait_send(bound) {
        assert_eq!(opcode, WAIT, "no completion for opcode {opcode:#x}: {e:?}");
    }
    f.finish();
});
