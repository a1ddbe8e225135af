//! `gpuverbs emu` with UC QPs: the distro's ibv_uc_pingpong between two emulated processes
//! (the soft NICs' UC on the wire: no ACKs), each with its own address (127.0.180.x ..
//! 127.0.189.x, TCP ports 19800..19899, used by no other test), every buffer checked (`--chk`);
//! both sides must exit 0 with their result, and the soft NICs' counters must show no
//! sanitizer complaint.
//!
//! Needs Debian's ibverbs-utils (CI installs it); a missing tool fails the test with the
//! package to install.

mod emu_util;
use emu_util::*;

#[test]
fn uc_pingpong_between_two_processes_checks_every_buffer() {
    need("ibv_uc_pingpong", "ibverbs-utils");
    let _g = serial();
    for (i, size) in ["1", "4096", "65536"].into_iter().enumerate() {
        let (c, s) = pair(
            "ibv_uc_pingpong",
            180 + i as u8,
            19800 + i as u16,
            &["-g", "0", "--chk", "-n", "200", "-s", size],
            &[],
        );
        for out in [c, s] {
            check_pingpong(&out, 200, size);
        }
    }
}
