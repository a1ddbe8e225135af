//! `gpuverbs emu` with UD QPs: the distro's ibv_ud_pingpong and perftest's `-c UD` send and
//! latency tests between two emulated processes, each with its own address (127.0.140.x ..
//! 127.0.149.x, TCP ports 19400..19499, used by no other test); both sides must exit 0 with
//! their result, and the soft NICs' counters must show no sanitizer complaint.
//!
//! Needs Debian's ibverbs-utils and perftest (CI installs them); a missing tool fails the test
//! with the package to install.

mod emu_util;
use emu_util::*;

/// [`emu_util::pair`] on this file's addresses only.
fn pair(
    tool: &str,
    net: u8,
    tcp_port: u16,
    args: &[&str],
    extra_client: &[&str],
) -> (String, String) {
    // 127.0.140.x .. 127.0.149.x are this file's
    assert!((140..150).contains(&net));
    emu_util::pair(tool, net, tcp_port, args, extra_client)
}

#[test]
fn ud_pingpong_between_two_processes() {
    need("ibv_ud_pingpong", "ibverbs-utils");
    let _g = serial();
    // ibv_ud_pingpong has no byte check (--chk): it checks its completions and the number of
    // iterations; every size up to the MTU minus the GRH it reserves
    for (i, size) in ["1", "1024", "2048", "4056"].into_iter().enumerate() {
        let (c, s) = pair(
            "ibv_ud_pingpong",
            140 + i as u8,
            19400 + i as u16,
            &["-g", "0", "-n", "200", "-s", size],
            &[],
        );
        for out in [c, s] {
            check_pingpong(&out, 200, size);
        }
    }
}

#[test]
fn perftest_send_bw_over_ud_every_size_to_the_mtu() {
    need("ib_send_bw", "perftest");
    let _g = serial();
    let (c, s) = pair(
        "ib_send_bw",
        145,
        19410,
        &["-c", "UD", "-x", "0", "-a", "-n", "200"],
        &[],
    );
    for (side, out) in [("client", &c), ("server", &s)] {
        let r = rows(out);
        let sizes: Vec<u64> = r.iter().map(|row| row[0] as u64).collect();
        // perftest caps UD sizes at the MTU: 2 .. 4096
        let want: Vec<u64> = (1..=12).map(|k| 1u64 << k).collect();
        assert_eq!(sizes, want, "{side}:\n{out}");
        assert!(r.iter().all(|row| row[1] as u64 == 200), "{side}:\n{out}");
    }
    // the client measured a bandwidth at every size
    assert!(rows(&c).iter().all(|row| row[3] > 0.0), "{c}");
}

#[test]
fn perftest_send_lat_over_ud() {
    need("ib_send_lat", "perftest");
    let _g = serial();
    for (i, size) in ["8", "4096"].into_iter().enumerate() {
        let (c, s) = pair(
            "ib_send_lat",
            146 + i as u8,
            19420 + i as u16,
            &["-c", "UD", "-x", "0", "-s", size, "-n", "200"],
            &[],
        );
        for (side, out) in [("client", &c), ("server", &s)] {
            let r = rows(out);
            assert!(
                r.len() == 1 && r[0][0] as u64 == size.parse::<u64>().unwrap() && r[0][1] == 200.0,
                "{side} size {size}:\n{out}"
            );
        }
    }
}
