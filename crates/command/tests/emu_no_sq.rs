//! QPs without a send queue (issue 47): `tests/verbs/no_sq.c`, built with cc against the
//! distro's libibverbs, runs under `gpuverbs emu`: an RC QP with max_send_wr 0 and 1,024
//! receives (what qperf's servers create) and a UD QP with max_send_wr 0 are created, as mlx5_ib
//! creates them (no_sq); the RC one takes a SEND into a posted receive, checked byte for byte,
//! and refuses a send of its own.
//!
//! Needs cc and libibverbs-dev; CI installs them.

mod emu_util;
use emu_util::*;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

#[test]
fn a_qp_without_a_send_queue_is_created_and_receives() {
    need("cc", "gcc");
    let dir = tmp("no-sq");
    std::fs::create_dir_all(&dir).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/verbs/no_sq.c");
    let bin = dir.join("no_sq");
    let mut c = Command::new("cc");
    c.args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(&src)
        .arg("-libverbs");
    run(c, Duration::from_secs(120), "cc no_sq.c");
    let counters = dir.join("counters");
    let out = run(
        emu("127.0.191.1", Some(&counters), &[bin.to_str().unwrap()]),
        Duration::from_secs(120),
        "no_sq under gpuverbs emu",
    );
    assert!(out.contains("no_sq ok"), "{out}");
    assert!(out.contains("3000 bytes received"), "{out}");
    check_counters(&counters, "no_sq", true, false);
    let _ = std::fs::remove_dir_all(&dir);
}
