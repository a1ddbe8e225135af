//! `gpuverbs emu` with XRC: the distro's ibv_xsrq_pingpong between two emulated processes, each
//! with its own address (127.0.195.x .. 127.0.198.x, TCP ports 19950..19959, used by no other
//! test), polled and with `-e` (sleeping on the SRQ's CQ). Each side opens an XRC domain on a
//! file, an XRC SRQ bound to it and a CQ, an XRC target and an XRC initiator; every SEND names
//! the peer's SRQ, lands there through the peer's target and completes on the SRQ's CQ. The
//! tool's own checks: every completion successful and from the target QP it expects, the
//! counts of sends and receives, "success" at the end; both sides must exit 0, and the soft
//! NICs' counters must show no sanitizer complaint.
//!
//! And `tests/verbs/xrc.c` (built with cc against the distro's libibverbs, address
//! 127.0.194.1): two contexts of one device share the domain of a file (O_CREAT, O_EXCL and
//! the missing O_CREAT as the kernel answers them), an initiator of one context sends through a
//! target of the other into an SRQ of the first (SEND and RDMA WRITE, byte for byte), CLOSE_XRCD
//! of a domain in use is EBUSY, the first context opens the target (`ibv_open_qp`: OPEN_QP),
//! which then outlives the second context's handle, and an SRQ of another domain is
//! IBV_WC_REM_INV_REQ_ERR.
//!
//! Needs Debian's ibverbs-utils, cc and libibverbs-dev (CI installs them); a missing tool fails
//! the test with the package to install.

mod emu_util;
use emu_util::*;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

#[test]
fn contexts_share_a_domain_and_a_foreign_srq_is_refused() {
    need("cc", "gcc");
    let dir = tmp("xrc-c");
    std::fs::create_dir_all(&dir).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/verbs/xrc.c");
    let bin = dir.join("xrc");
    let mut c = Command::new("cc");
    c.args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(&src)
        .arg("-libverbs");
    run(c, Duration::from_secs(120), "cc xrc.c");
    let out = run(
        emu("127.0.194.1", None, &[bin.to_str().unwrap()]),
        Duration::from_secs(120),
        "xrc under gpuverbs emu",
    );
    assert!(out.contains("xrc ok"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn xsrq_pingpong_between_two_processes() {
    need("ibv_xsrq_pingpong", "ibverbs-utils");
    let _g = serial();
    // polled, then sleeping on the XRC SRQ's CQ (-e: its completion channel)
    let runs = [
        ("1", false),
        ("4096", false),
        ("10000", false),
        ("4096", true),
    ];
    for (i, (size, events)) in runs.into_iter().enumerate() {
        let mut args = vec!["-g", "0", "-n", "50", "-s", size];
        if events {
            args.push("-e");
        }
        let (c, s) = pair(
            "ibv_xsrq_pingpong",
            195 + i as u8,
            19950 + i as u16,
            &args,
            &[],
        );
        for (side, out) in [("client", c), ("server", s)] {
            assert!(
                out.lines().any(|l| l.trim() == "success"),
                "size {size}, events {events}, {side}:\n{out}"
            );
        }
    }
}
