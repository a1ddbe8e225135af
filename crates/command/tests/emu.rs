//! `gpuverbs emu` end to end: the distro's real libibverbs and libmlx5 drive soft NICs.
//! Unmodified rdma-core tools (ibv_devices, ibv_devinfo, ibv_rc_pingpong), Debian's perftest
//! (server and client as two processes with their own addresses) and rdma-core's pyverbs test
//! suite run on the emulated devices; afterwards the soft NICs' counters must show no
//! sanitizer complaint.
//!
//! Needs Debian's ibverbs-utils, perftest, python3-pyverbs and rdma-core (CI installs them);
//! a missing tool fails the test with the package to install.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

mod emu_util;
use emu_util::*;

#[test]
fn ibv_devices_and_devinfo_describe_the_device() {
    need("ibv_devices", "ibverbs-utils");
    let _g = serial();
    let mut two = Command::new(GPUVERBS);
    two.env("GPUVERBS_PRELOAD", preload()).args([
        "emu",
        "--ip",
        "127.0.9.1",
        "--devices",
        "2",
        "--",
        "ibv_devices",
    ]);
    let out = run(two, Duration::from_secs(30), "ibv_devices");
    assert!(out.contains("mlx5_0") && out.contains("mlx5_1"), "{out}");
    assert!(
        out.contains("029ca5ff7f000901"),
        "node GUID from the address: {out}"
    );
    let info = run(
        emu("127.0.9.1", None, &["ibv_devinfo", "-v"]),
        Duration::from_secs(30),
        "ibv_devinfo",
    );
    for want in [
        "hca_id:\tmlx5_0",
        "board_id:\t\t\tGPUVERBS_SOFTNIC",
        "vendor_part_id:\t\t\t4125",
        "PORT_ACTIVE (4)",
        "link_layer:\t\tEthernet",
        "GID[  0]:\t\t::ffff:127.0.9.1, RoCE v2",
        "max_qp_wr:\t\t\t32768",
    ] {
        assert!(
            info.contains(want),
            "ibv_devinfo -v lacks {want:?}:\n{info}"
        );
    }
}

#[test]
fn rc_pingpong_checks_every_byte_polled_and_with_events() {
    need("ibv_rc_pingpong", "ibverbs-utils");
    let _g = serial();
    for (i, (size, events)) in [
        ("64", false),
        ("4096", false),
        ("65536", false),
        ("8", true),
        ("16384", true),
    ]
    .into_iter()
    .enumerate()
    {
        let mut args = vec!["-g", "0", "-n", "50", "-s", size, "--chk"];
        if events {
            args.push("-e");
        }
        let (c, s) = pair(
            "ibv_rc_pingpong",
            20 + i as u8,
            18510 + i as u16,
            &args,
            &[],
        );
        for out in [c, s] {
            assert!(
                out.contains("50 iters in"),
                "size {size} events {events}:\n{out}"
            );
        }
    }
}

/// The legacy mode (`GPUVERBS_EMU_UARS=static`: BlueFlame registers on pages given at
/// GET_CONTEXT, no UAR ioctl) still serves verbs programs: ibv_rc_pingpong polled and with
/// events, and ib_write_bw.
#[test]
fn static_uar_mode_serves_pingpong_and_perftest() {
    need("ibv_rc_pingpong", "ibverbs-utils");
    need("ib_write_bw", "perftest");
    let _g = serial();
    struct Back;
    impl Drop for Back {
        fn drop(&mut self) {
            STATIC_UARS.store(false, Ordering::Relaxed);
        }
    }
    STATIC_UARS.store(true, Ordering::Relaxed);
    let _back = Back;
    for (i, events) in [false, true].into_iter().enumerate() {
        let mut args = vec!["-g", "0", "-n", "50", "-s", "4096", "--chk"];
        if events {
            args.push("-e");
        }
        let (c, s) = pair(
            "ibv_rc_pingpong",
            27 + i as u8,
            18517 + i as u16,
            &args,
            &[],
        );
        for out in [c, s] {
            assert!(
                out.contains("50 iters in"),
                "static UARs, events {events}:\n{out}"
            );
        }
    }
    let args = ["-x", "0", "-s", "4096", "-n", "200"];
    let (c, _) = pair("ib_write_bw", 29, 18519, &args, &[]);
    assert!(
        rows(&c)
            .first()
            .is_some_and(|r| r[1] == 200.0 && r[3] > 0.0),
        "static UARs, ib_write_bw:\n{c}"
    );
}

#[test]
fn perftest_bandwidth_tests_run_on_the_emulated_device() {
    need("ib_write_bw", "perftest");
    let _g = serial();
    let mut net = 30;
    for tool in ["ib_write_bw", "ib_read_bw", "ib_send_bw", "ib_atomic_bw"] {
        let sizes: &[&str] = if tool == "ib_atomic_bw" {
            &["8"]
        } else {
            &["8", "4096", "65536"]
        };
        for size in sizes {
            net += 1;
            let args = ["-x", "0", "-s", size, "-n", "200"];
            let (c, _) = pair(tool, net, 18600 + net as u16, &args, &[]);
            let r = rows(&c);
            assert_eq!(
                r.len(),
                1,
                "{tool} -s {size}: one result row expected:\n{c}"
            );
            let [bytes, iters, peak, avg, rate] = r[0][..5] else {
                panic!("{c}")
            };
            assert_eq!(bytes, size.parse::<f64>().unwrap(), "{c}");
            assert_eq!(iters, 200.0, "{c}");
            assert!(
                avg > 0.0 && peak >= avg * 0.99 && rate > 0.0,
                "{tool}: implausible {c}"
            );
        }
    }
    // duration mode and two QPs
    net += 1;
    let (c, _) = pair(
        "ib_write_bw",
        net,
        18600 + net as u16,
        &["-x", "0", "-s", "4096", "-D", "1"],
        &[],
    );
    assert!(rows(&c).first().is_some_and(|r| r[3] > 0.0), "-D 1:\n{c}");
    net += 1;
    let (c, _) = pair(
        "ib_send_bw",
        net,
        18600 + net as u16,
        &["-x", "0", "-s", "1024", "-n", "100", "-q", "2"],
        &[],
    );
    let r = rows(&c);
    assert!(
        r.first().is_some_and(|r| r[1] == 200.0 && r[3] > 0.0),
        "-q 2 counts 2 x 100 iterations:\n{c}"
    );
}

#[test]
fn perftest_latency_tests_run_on_the_emulated_device() {
    need("ib_write_lat", "perftest");
    let _g = serial();
    let mut net = 60;
    for tool in ["ib_write_lat", "ib_read_lat", "ib_send_lat"] {
        for size in ["8", "4096"] {
            net += 1;
            let (c, _) = pair(
                tool,
                net,
                18700 + net as u16,
                &["-x", "0", "-s", size, "-n", "100"],
                &[],
            );
            let r = rows(&c);
            assert_eq!(
                r.len(),
                1,
                "{tool} -s {size}: one result row expected:\n{c}"
            );
            let (tmin, tmax, typical) = (r[0][2], r[0][3], r[0][4]);
            assert!(
                tmin > 0.0 && tmin <= typical && typical <= tmax,
                "{tool}: implausible {c}"
            );
        }
    }
}

#[test]
fn perftest_send_bw_with_completion_events() {
    // `-e`: each side arms its send CQ and its receive CQ (one channel) and sleeps in
    // ibv_get_cq_event. Only the CQ armed last got its event before 2026-12-03: both sides
    // hung. Issue 30, defect 1.
    need("ib_send_bw", "perftest");
    let _g = serial();
    for (i, size) in ["8", "4096"].into_iter().enumerate() {
        let net = 111 + i as u8;
        let args = ["-x", "0", "-s", size, "-n", "50", "-e"];
        let (c, s) = pair("ib_send_bw", net, 18830 + i as u16, &args, &[]);
        for out in [&c, &s] {
            let r = rows(out);
            assert!(
                r.first()
                    .is_some_and(|r| r[0] == size.parse::<f64>().unwrap() && r[1] == 50.0),
                "-e -s {size}:\n{out}"
            );
        }
    }
}

#[test]
fn perftest_send_lat_with_completion_events() {
    // `-e` with one poll per event, whose status perftest reads even when the poll found
    // nothing: it needs a CQ's event exactly when that CQ has a new completion (not again for
    // the one it is about to poll: the event rule of 2026-12-03), and the peer's ACK of a
    // SEND ahead of the peer's reply (the wire responder's answer leaves before its receive
    // completion is visible). Before, it stopped within a few hundred iterations.
    need("ib_send_lat", "perftest");
    let _g = serial();
    for (i, size) in ["8", "4096", "65536"].into_iter().enumerate() {
        let net = 115 + i as u8;
        let args = ["-x", "0", "-s", size, "-n", "500", "-e"];
        let (c, _) = pair("ib_send_lat", net, 18840 + i as u16, &args, &[]);
        let r = rows(&c);
        assert!(
            r.first()
                .is_some_and(|r| r[0] == size.parse::<f64>().unwrap() && r[1] == 500.0),
            "ib_send_lat -e -s {size}:\n{c}"
        );
    }
}

#[test]
fn perftest_send_bw_on_a_shared_receive_queue() {
    need("ib_send_bw", "perftest");
    let _g = serial();
    for (i, (size, qps)) in [("8", "1"), ("4096", "1"), ("65536", "1"), ("1024", "2")]
        .into_iter()
        .enumerate()
    {
        let net = 103 + i as u8;
        let args = ["-x", "0", "-s", size, "-n", "100", "-q", qps, "--use-srq"];
        let (c, s) = pair("ib_send_bw", net, 18810 + i as u16, &args, &[]);
        let want = 100.0 * qps.parse::<f64>().unwrap();
        for out in [&c, &s] {
            let r = rows(out);
            assert!(
                r.first()
                    .is_some_and(|r| r[0] == size.parse::<f64>().unwrap() && r[1] == want),
                "--use-srq -s {size} -q {qps}:\n{out}"
            );
        }
        assert!(rows(&c)[0][3] > 0.0, "{c}");
    }
}

/// `verbs_traffic.py` through the real libibverbs: WRITE, READ, SEND/RECV, WRITE_IMM and
/// atomics with every byte and old value checked; the error cases with a ConnectX's statuses;
/// SRQs (two QPs sharing one, its limit and LAST_WQE_REACHED events); RESIZE_CQ with
/// completions carried over; a CQ overrun's CQ_ERR and QP_FATAL events; memory windows of
/// both types bound by libmlx5's UMR WQEs, SEND_WITH_INV, and refused binds.
#[test]
fn verbs_traffic_script_checks_bytes_statuses_and_events() {
    need("/usr/bin/python3", "python3");
    let _g = serial();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/verbs_traffic.py");
    let mut c = Command::new(GPUVERBS);
    c.env("GPUVERBS_PRELOAD", preload())
        .env("VERBS_TRAFFIC_LIMIT", "150")
        .args(["emu", "--ip", "127.0.102.1", "--devices", "2", "--"])
        .arg("/usr/bin/python3")
        .arg(&script);
    let out = run(c, Duration::from_secs(180), "verbs_traffic.py");
    for case in ["traffic", "errors", "srq", "resize", "async", "windows"] {
        assert!(
            out.contains(&format!("PASS {case}\n")),
            "verbs_traffic.py {case}:\n{out}"
        );
    }
}

/// A copy of rdma-core's pyverbs test suite (Debian ships it gzipped), unpacked in a fresh
/// folder; returns its `tests` package folder.
fn unpacked_suite(name: &str) -> PathBuf {
    let suite = Path::new("/usr/share/doc/rdma-core/tests");
    assert!(
        suite.join("run_tests.py").is_file(),
        "install the Debian package rdma-core (pyverbs tests)"
    );
    let dir = tmp(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let st = Command::new("cp")
        .arg("-r")
        .arg(suite)
        .arg(&dir)
        .status()
        .unwrap();
    assert!(st.success());
    let tests = dir.join("tests");
    let st = Command::new("sh")
        .arg("-c")
        .arg("gunzip -f *.gz")
        .current_dir(&tests)
        .status()
        .unwrap();
    assert!(st.success());
    tests
}

/// `devx_traffic.py` through the real libmlx5's DEVX calls: the device's answers to the queries
/// (capabilities that say what the soft NIC implements, RoCE address, vport, EQ), refused
/// commands with their errno or PRM status, umem and object lifetimes (EBUSY while used), bad
/// CQ and QP contexts, the QP transitions in and out of order, and WRITE, READ, SEND_IMM,
/// FETCH_ADD and CMP_SWP between DEVX QPs of two devices whose WQEs the script writes into umem
/// rings and rings on an NC UAR page, every byte checked; a collapsed CQ; a cross-channel
/// master's WAIT and FETCH_ADD moving a counter (and not for a failed WRITE).
#[test]
fn devx_script_checks_commands_objects_and_bytes() {
    need("/usr/bin/python3", "python3");
    need(
        "/usr/lib/python3/dist-packages/scapy/__init__.py",
        "python3-scapy",
    );
    let _g = serial();
    let suite = unpacked_suite("devx");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/devx_traffic.py");
    let cases = [
        "queries",
        "umems",
        "traffic",
        "collapsed",
        "transitions",
        "dc",
        "no_dbr",
        "cross_channel",
    ];
    let mut c = Command::new(GPUVERBS);
    c.env("GPUVERBS_PRELOAD", preload())
        .args(["emu", "--ip", "127.0.104.1", "--devices", "2", "--"])
        .arg("/usr/bin/python3")
        .arg(&script)
        .arg(suite.parent().unwrap())
        .args(cases);
    let out = run(c, Duration::from_secs(180), "devx_traffic.py");
    let _ = std::fs::remove_dir_all(suite.parent().unwrap());
    for case in cases {
        assert!(
            out.contains(&format!("PASS {case}\n")),
            "devx_traffic.py {case}:\n{out}"
        );
    }
}

/// gpuverbs' PRM field tables (`prm::cmd`, what the emulation parses DEVX mailboxes with and
/// the mlx5 backend builds them with) agree bit for bit with rdma-core's description of the
/// same structures (`tests/mlx5_prm_structs.py`), field by field.
#[test]
fn prm_field_tables_match_rdma_core() {
    need("/usr/bin/python3", "python3");
    need(
        "/usr/lib/python3/dist-packages/scapy/__init__.py",
        "python3-scapy",
    );
    let suite = unpacked_suite("prm-layout");
    let tables: Vec<serde_json::Value> = prm::cmd::ALL
        .iter()
        .filter(|(name, _)| !name.is_empty())
        .map(|(name, fields)| {
            let f: Vec<_> = fields
                .iter()
                .map(|(n, f)| serde_json::json!([n, f.bit, f.width]))
                .collect();
            serde_json::json!({ "struct": name, "fields": f })
        })
        .collect();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/prm_layout.py");
    let mut child = Command::new("/usr/bin/python3")
        .arg(&script)
        .arg(suite.join("mlx5_prm_structs.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let json = serde_json::to_vec(&tables).unwrap();
    child.stdin.take().unwrap().write_all(&json).unwrap();
    let o = wait(child, Duration::from_secs(60), "prm_layout.py");
    let _ = std::fs::remove_dir_all(suite.parent().unwrap());
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && text.starts_with("OK "), "{text}");
}

/// rdma-core's whole pyverbs suite: the tests pyverbs-pass.txt lists pass, and no others; none
/// fails or ends in ERROR (each of the rest skips by pyverbs' own check).
#[test]
fn pyverbs_tests_pass_or_skip() {
    let suite = Path::new("/usr/share/doc/rdma-core/tests");
    assert!(
        suite.join("run_tests.py").is_file(),
        "install the Debian package rdma-core (pyverbs tests)"
    );
    need("/usr/bin/python3", "python3");
    // the DEVX tests describe PRM structures with scapy (they skip without it)
    need(
        "/usr/lib/python3/dist-packages/scapy/__init__.py",
        "python3-scapy",
    );
    let _g = serial();
    let tests = unpacked_suite("pyverbs");
    let mut c = emu(
        "127.0.90.1",
        None,
        &[
            "/usr/bin/python3",
            "run_tests.py",
            "--dev",
            "mlx5_0",
            "--port",
            "1",
            "--gid",
            "0",
            "-v",
        ],
    );
    c.current_dir(&tests);
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let o = wait(child, Duration::from_secs(600), "pyverbs tests");
    let text = String::from_utf8_lossy(&o.stderr).to_string();
    let _ = std::fs::remove_dir_all(tests.parent().unwrap());
    let results = pyverbs_results(&text);
    assert!(results.len() > 250, "pyverbs suite did not run:\n{text}");
    let expected: Vec<&str> = include_str!("pyverbs-pass.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let unlisted: Vec<_> = results
        .iter()
        .filter(|(n, s)| s == "ok" && !expected.contains(&n.as_str()))
        .map(|(n, _)| n)
        .collect();
    assert!(
        unlisted.is_empty(),
        "pyverbs tests pass that pyverbs-pass.txt does not list (add them): {unlisted:?}"
    );
    for name in expected {
        let got = results
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s.as_str());
        assert_eq!(got, Some("ok"), "pyverbs {name} no longer passes:\n{text}");
    }
    let bad: Vec<_> = results
        .iter()
        .filter(|(_, s)| s == "ERROR" || s == "FAIL")
        .collect();
    assert!(bad.is_empty(), "pyverbs tests failed: {bad:?}\n{text}");
}

/// (test id, status) from unittest's verbose output: `name (module.Class.name) ... ok`, where
/// a docstring line may come between and the emulation's own stderr lines may precede the
/// status.
fn pyverbs_results(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    let mut pending = false;
    for line in text.lines() {
        if line.starts_with("test_") && line.contains(" (tests.") {
            let id = line.split(')').next().unwrap_or(line).to_string() + ")";
            current = Some(id);
            pending = false;
        }
        let status = if let Some((_, rest)) = line.rsplit_once(" ... ") {
            Some(rest)
        } else if pending {
            Some(line)
        } else {
            None
        };
        if let (Some(id), Some(st)) = (&current, status) {
            let st = st.trim();
            if st.starts_with("gpuverbs-emu:") || st.is_empty() {
                pending = true;
                continue;
            }
            let word = st.split_whitespace().next().unwrap_or("").to_string();
            out.push((id.clone(), word));
            current = None;
            pending = false;
        }
    }
    out
}
