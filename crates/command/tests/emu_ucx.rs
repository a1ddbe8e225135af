//! UCX (Debian 12's UCX 1.13.1, package ucx-utils) on the emulated device: `ucx_info -d`
//! under `gpuverbs emu --devices 2` lists rc_verbs, rc_mlx5, ud_verbs, ud_mlx5 and dc_mlx5 on
//! both devices, and `ucx_perftest` runs between two emulated processes, each with its own
//! address (127.0.150.x .. 127.0.159.x, TCP ports 19500..19599, used by no other test) over
//! rc_mlx5 (UCX's own WQEs, CQ polling and 128-byte CQEs, ud_mlx5 for wire-up), over dc_mlx5
//! (DC initiators and a DC target of UCX's, the soft NIC's DC on the wire) and over
//! rc_verbs/ud_verbs: tag matching (eager and rendezvous) and active messages. Both sides must exit 0 with their final row, UCX must report the lane it was
//! given, and the soft NICs' counters must show no sanitizer complaint. ucx_perftest 1.13.1
//! has no data-validation option.
//!
//! Needs Debian's ucx-utils (CI installs it); a missing tool fails the test with the package
//! to install.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod emu_util;
use emu_util::*;

/// A ucx_perftest server and client, each under its own `gpuverbs emu` with its own address
/// (`net`: 127.0.net.1 and .2), UCX limited to `tls` on mlx5_0 port 1 with GID index 0.
/// Returns the client's and the server's output.
fn perftest(tls: &str, net: u8, tcp_port: u16, args: &[&str]) -> (String, String) {
    need("ucx_perftest", "ucx-utils");
    assert!((150..160).contains(&net) && (19500..19600).contains(&tcp_port));
    let (sip, cip) = (format!("127.0.{net}.1"), format!("127.0.{net}.2"));
    let (sc, cc) = (tmp(&format!("{net}-s")), tmp(&format!("{net}-c")));
    let port = tcp_port.to_string();
    let ucx = |mut c: Command| {
        c.env("UCX_NET_DEVICES", "mlx5_0:1")
            .env("UCX_TLS", tls)
            .env("UCX_IB_GID_INDEX", "0")
            .env("UCX_LOG_LEVEL", "info");
        c
    };
    let server = ucx(emu(&sip, Some(&sc), &["ucx_perftest", "-p", &port]))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !listening(tcp_port) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "ucx_perftest server never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // the out-of-band exchange goes to the server's address; each side's RoCE address is
    // its own --ip
    let mut cargs = vec!["ucx_perftest", &sip, "-p", &port];
    cargs.extend_from_slice(args);
    let client = run(
        ucx(emu(&cip, Some(&cc), &cargs)),
        Duration::from_secs(120),
        "ucx_perftest client",
    );
    let so = wait(server, Duration::from_secs(30), "ucx_perftest server");
    let stext =
        String::from_utf8_lossy(&so.stdout).to_string() + &String::from_utf8_lossy(&so.stderr);
    assert!(so.status.success(), "ucx_perftest server failed:\n{stext}");
    check_counters(&cc, "ucx_perftest client", true, false);
    check_counters(&sc, "ucx_perftest server", true, false);
    (client, stext)
}

/// The client's `Final:` row: iterations, then the overhead and bandwidth columns.
fn final_row(out: &str) -> Vec<f64> {
    out.lines()
        .find_map(|l| l.strip_prefix("Final:"))
        .unwrap_or_else(|| panic!("no Final: row:\n{out}"))
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect()
}

#[test]
fn ucx_info_lists_rc_ud_and_dc_transports_on_both_devices() {
    need("ucx_info", "ucx-utils");
    let _g = serial();
    let mut c = Command::new(GPUVERBS);
    c.env("GPUVERBS_PRELOAD", preload())
        .args(["emu", "--ip", "127.0.159.1", "--devices", "2", "--"])
        .args(["ucx_info", "-d"]);
    let out = run(c, Duration::from_secs(120), "ucx_info -d");
    // the transports listed under each memory domain
    let mut domains: Vec<(String, Vec<String>)> = Vec::new();
    for l in out.lines() {
        if let Some(md) = l.strip_prefix("# Memory domain:") {
            domains.push((md.trim().to_string(), Vec::new()));
        } else if let Some(tl) = l.trim_start_matches('#').trim().strip_prefix("Transport:") {
            if let Some((_, tls)) = domains.last_mut() {
                tls.push(tl.trim().to_string());
            }
        }
    }
    for dev in ["mlx5_0", "mlx5_1"] {
        let tls = &domains
            .iter()
            .find(|(md, _)| md == dev)
            .unwrap_or_else(|| panic!("no memory domain {dev}:\n{out}"))
            .1;
        for tl in ["rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5", "dc_mlx5"] {
            assert!(
                tls.iter().any(|t| t == tl),
                "{dev}: no {tl} in {tls:?}\n{out}"
            );
        }
        // every transport UCX opened on the device says which port it is
        assert!(
            out.contains(&format!("Device: {dev}:1")),
            "{dev}: no port listed:\n{out}"
        );
    }
}

#[test]
fn ucx_perftest_tag_and_am_bandwidth_over_rc_mlx5() {
    let _g = serial();
    let tls = "rc_mlx5,ud_mlx5,self";
    // eager tag messages (4 KiB)
    let (c, s) = perftest(
        tls,
        150,
        19500,
        &["-t", "tag_bw", "-n", "1000", "-s", "4096"],
    );
    used("tag(rc_mlx5/mlx5_0:1)", &c, &s);
    let r = final_row(&c);
    assert!(r[0] == 1000.0 && r[4] > 0.0, "{c}");
    // rendezvous (100 kB: the receiver READs the data)
    let (c, s) = perftest(
        tls,
        151,
        19501,
        &["-t", "tag_bw", "-n", "100", "-s", "100000"],
    );
    used("tag(rc_mlx5/mlx5_0:1)", &c, &s);
    let r = final_row(&c);
    assert!(r[0] == 100.0 && r[4] > 0.0, "{c}");
    // UCP active messages
    let (c, s) = perftest(
        tls,
        152,
        19502,
        &["-t", "ucp_am_bw", "-n", "1000", "-s", "4096"],
    );
    used("am(rc_mlx5/mlx5_0:1)", &c, &s);
    let r = final_row(&c);
    assert!(r[0] == 1000.0 && r[4] > 0.0, "{c}");
}

#[test]
fn ucx_perftest_tag_bandwidth_over_dc_mlx5() {
    let _g = serial();
    let tls = "dc_mlx5,ud_mlx5,self";
    // eager tag messages (4 KiB), then rendezvous (100 kB: the receiver READs over DC)
    for (net, port, n, size) in [(154, 19504, "1000", "4096"), (155, 19505, "100", "100000")] {
        let (c, s) = perftest(tls, net, port, &["-t", "tag_bw", "-n", n, "-s", size]);
        used("tag(dc_mlx5/mlx5_0:1)", &c, &s);
        let r = final_row(&c);
        assert!(r[0] == n.parse::<f64>().unwrap() && r[4] > 0.0, "{c}");
    }
}

#[test]
fn ucx_perftest_tag_bandwidth_over_rc_verbs() {
    let _g = serial();
    let (c, s) = perftest(
        "rc_verbs,ud_verbs,self",
        153,
        19503,
        &["-t", "tag_bw", "-n", "1000", "-s", "4096"],
    );
    used("tag(rc_verbs/mlx5_0:1)", &c, &s);
    let r = final_row(&c);
    assert!(r[0] == 1000.0 && r[4] > 0.0, "{c}");
}
