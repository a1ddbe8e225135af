//! `gpuverbs emu` with XRC: the distro's ibv_xsrq_pingpong between two emulated processes, each
//! with its own address (127.0.195.x .. 127.0.198.x, TCP ports 19950..19959, used by no other
//! test), polled and with `-e` (sleeping on the SRQ's CQ), and a server with two clients
//! (127.0.193.x). Each side opens an XRC domain on a file, an XRC SRQ bound to it and a CQ, an
//! XRC target and an XRC initiator per peer; every SEND names the peer's SRQ, lands there
//! through the peer's target and completes on the SRQ's CQ. The tool's own checks: every
//! completion successful and from the target QP it expects, the counts of sends and receives,
//! "success" at the end; every side must exit 0, and (two processes) the soft NICs' counters
//! must show no sanitizer complaint.
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
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A server with two clients (`-c 2`, 127.0.193.x, TCP port 19958): the server's SRQ takes
/// the SENDs of both clients through two targets, and it sends to each over both of its
/// initiators (the tool's round robin); every side ends with "success".
#[test]
fn xsrq_pingpong_server_with_two_clients() {
    need("ibv_xsrq_pingpong", "ibverbs-utils");
    let _g = serial();
    let port = "19958";
    let common = ["ibv_xsrq_pingpong", "-p", port, "-g", "0", "-n", "20"];
    let mut sargs = common.to_vec();
    sargs.extend(["-c", "2"]);
    let server = emu("127.0.193.1", None, &sargs)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !listening(19958) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "server never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let client = |ip: &str| {
        let mut a = common.to_vec();
        a.push("127.0.193.1");
        emu(ip, None, &a)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // the server takes its clients one after the other
    let c1 = client("127.0.193.2");
    std::thread::sleep(Duration::from_millis(300));
    let c2 = client("127.0.193.3");
    for (what, child) in [("client 1", c1), ("client 2", c2), ("server", server)] {
        let o = wait(child, Duration::from_secs(60), what);
        let out =
            String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.success() && out.lines().any(|l| l.trim() == "success"),
            "{what}:\n{out}"
        );
    }
}

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
