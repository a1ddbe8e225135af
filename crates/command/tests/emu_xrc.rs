//! `gpuverbs emu` with XRC: the distro's ibv_xsrq_pingpong between two emulated processes, each
//! with its own address (127.0.195.x .. 127.0.197.x, TCP ports 19950..19959, used by no other
//! test). Each side opens an XRC domain on a file, an XRC SRQ bound to it and a CQ, an XRC
//! target and an XRC initiator; every SEND names the peer's SRQ, lands there through the
//! peer's target and completes on the SRQ's CQ. The tool's own checks: every completion
//! successful and from the target QP it expects, the counts of sends and receives, "success"
//! at the end; both sides must exit 0, and the soft NICs' counters must show no sanitizer
//! complaint.
//!
//! Needs Debian's ibverbs-utils (CI installs it); a missing tool fails the test with the
//! package to install.

mod emu_util;
use emu_util::*;

#[test]
fn xsrq_pingpong_between_two_processes() {
    need("ibv_xsrq_pingpong", "ibverbs-utils");
    let _g = serial();
    for (i, size) in ["1", "4096", "10000"].into_iter().enumerate() {
        let (c, s) = pair(
            "ibv_xsrq_pingpong",
            195 + i as u8,
            19950 + i as u16,
            &["-g", "0", "-n", "50", "-s", size],
            &[],
        );
        for (side, out) in [("client", c), ("server", s)] {
            assert!(
                out.lines().any(|l| l.trim() == "success"),
                "size {size}, {side}:\n{out}"
            );
        }
    }
}
