//! The READ, SEND and atomic tests (`read_bw`, `send_bw`, `atomic_bw`, `read_lat`, `send_lat`,
//! `atomic_lat`) with the CPU initiator on the soft NIC: in loopback and as server/client
//! processes on 127.0.0.1, every byte (every fetched value) validated; their perftest titles,
//! address lines and flags; and failures made on purpose that validation and the error path
//! must catch. CI has no GPU: the GPU initiator's paths run on the GPU machine.

use serde_json::Value;
use std::process::{Child, Output};
use std::time::{Duration, Instant};

mod common;
use common::{command, ok, run, text};

const READ_BW: &str = env!("CARGO_BIN_EXE_read_bw");
const SEND_BW: &str = env!("CARGO_BIN_EXE_send_bw");
const ATOMIC_BW: &str = env!("CARGO_BIN_EXE_atomic_bw");
const READ_LAT: &str = env!("CARGO_BIN_EXE_read_lat");
const SEND_LAT: &str = env!("CARGO_BIN_EXE_send_lat");
const ATOMIC_LAT: &str = env!("CARGO_BIN_EXE_atomic_lat");

fn json_lines(out: &str) -> Vec<Value> {
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// A loopback CPU run of `bin` with `args`, as JSON rows.
fn loopback(bin: &str, args: &[&str]) -> Vec<Value> {
    let mut a = vec!["--loopback", "--initiator", "cpu", "--json"];
    a.extend_from_slice(args);
    json_lines(&ok(bin, &a))
}

fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("{k} is not a number in {v}"))
}

/// A bandwidth row: validated, the size and iterations asked for, positive numbers.
fn check_bw(v: &Value, test: &str, bytes: u64, iters: u64) {
    assert_eq!(v["test"], test, "{v}");
    assert_eq!(v["validated"], true, "{v}");
    assert_eq!(v["initiator"], "cpu", "{v}");
    assert_eq!(v["bytes"], bytes, "{v}");
    assert_eq!(v["iterations"], iters, "{v}");
    for k in ["bw_average", "bw_peak", "msg_rate_mpps"] {
        assert!(num(v, k) > 0.0, "{k} in {v}");
    }
    assert!(num(v, "bw_peak") >= num(v, "bw_average"), "{v}");
}

/// A latency row: validated, ordered percentiles.
fn check_lat(v: &Value, test: &str, bytes: u64, iters: u64) {
    assert_eq!(v["test"], test, "{v}");
    assert_eq!(v["validated"], true, "{v}");
    assert_eq!(v["bytes"], bytes, "{v}");
    assert_eq!(v["iterations"], iters, "{v}");
    let (min, typ, max) = (
        num(v, "t_min_us"),
        num(v, "t_typical_us"),
        num(v, "t_max_us"),
    );
    assert!(min > 0.0 && min <= typ && typ <= max, "{v}");
    assert!(num(v, "p99_us") <= max, "{v}");
}

#[test]
fn bandwidth_tests_validate_in_loopback() {
    for (bin, test, verb) in [
        (READ_BW, "read_bw", "RDMA_Read"),
        (SEND_BW, "send_bw", "Send"),
    ] {
        for (size, iters) in [(2u64, 300u64), (4096, 200), (1 << 20, 20)] {
            let rows = loopback(bin, &["-s", &size.to_string(), "-n", &iters.to_string()]);
            assert_eq!(rows.len(), 1);
            check_bw(&rows[0], test, size, iters);
            assert_eq!(rows[0]["verb"], verb);
        }
        // Several QPs: perftest's #iterations counts them all.
        let rows = loopback(bin, &["-s", "8192", "-n", "100", "-q", "3"]);
        check_bw(&rows[0], test, 8192, 100);
        assert_eq!(rows[0]["iterations_reported"], 300, "{}", rows[0]);
    }
    // READ both ways, fewer reads in flight than perftest's 16.
    let rows = loopback(
        READ_BW,
        &["-s", "65536", "-n", "64", "-q", "2", "-b", "-o", "4"],
    );
    check_bw(&rows[0], "read_bw", 65536, 64);
    assert_eq!(rows[0]["outs"], 4);
    // SEND into fewer posted receives than messages.
    let rows = loopback(SEND_BW, &["-s", "1024", "-n", "500", "-r", "8"]);
    check_bw(&rows[0], "send_bw", 1024, 500);
    assert_eq!(rows[0]["rx_depth"], 8);
    for (args, verb) in [
        (vec!["-n", "400"], "Atomic FETCH_AND_ADD"),
        (
            vec!["-n", "400", "-A", "CMP_AND_SWAP"],
            "Atomic CMP_AND_SWAP",
        ),
        (
            vec!["-n", "150", "-q", "2", "-b", "-o", "3"],
            "Atomic FETCH_AND_ADD",
        ),
    ] {
        let rows = loopback(ATOMIC_BW, &args);
        check_bw(&rows[0], "atomic_bw", 8, num(&rows[0], "iterations") as u64);
        assert_eq!(rows[0]["verb"], verb);
    }
}

/// perftest's -D: READ, SEND and atomics run for the duration, and what ran is validated (the
/// atomic words' final values included; SEND's receivers learn the count when it is over).
#[test]
fn duration_mode_validates_what_ran() {
    for (bin, test, args) in [
        (READ_BW, "read_bw", vec!["-D", "1", "-s", "4096"]),
        (SEND_BW, "send_bw", vec!["-D", "1", "-s", "4096"]),
        (SEND_BW, "send_bw", vec!["-D", "1", "-s", "64", "-q", "2"]),
        (ATOMIC_BW, "atomic_bw", vec!["-D", "1"]),
        (
            ATOMIC_BW,
            "atomic_bw",
            vec!["-D", "1", "-A", "CMP_AND_SWAP", "-q", "2"],
        ),
    ] {
        let rows = loopback(bin, &args);
        let v = &rows[0];
        assert_eq!(v["test"], test, "{v}");
        assert_eq!(v["validated"], true, "{v}");
        assert_eq!(v["duration_s"], 1, "{v}");
        assert!(num(v, "iterations") >= 1.0, "{v}");
        assert!(num(v, "time_s") >= 0.9, "{v}");
    }
}

#[test]
fn bandwidth_sweep_of_every_size() {
    for (bin, test) in [(READ_BW, "read_bw"), (SEND_BW, "send_bw")] {
        let rows = loopback(bin, &["-a", "-n", "16"]);
        assert_eq!(rows.len(), 23, "{test}: 2 B .. 8 MiB");
        for (e, v) in (1..=23).zip(&rows) {
            check_bw(v, test, 1 << e, 16);
        }
    }
}

#[test]
fn latency_tests_validate_in_loopback() {
    for (bin, test, sizes) in [
        (READ_LAT, "read_lat", vec![2u64, 4096, 1 << 20]),
        (SEND_LAT, "send_lat", vec![2, 300, 65536]),
    ] {
        for size in sizes {
            let rows = loopback(bin, &["-s", &size.to_string(), "-n", "150"]);
            check_lat(&rows[0], test, size, 150);
        }
    }
    for args in [vec!["-n", "300"], vec!["-n", "300", "-A", "CMP_AND_SWAP"]] {
        let rows = loopback(ATOMIC_LAT, &args);
        check_lat(&rows[0], "atomic_lat", 8, 300);
    }
    // SEND's inline default is perftest's 236: 2 B travel inline, 300 B do not.
    let rows = loopback(SEND_LAT, &["-n", "100"]);
    assert_eq!(rows[0]["inline_size"], 236, "{}", rows[0]);
    assert_eq!(rows[0]["inline"], true, "{}", rows[0]);
    let rows = loopback(SEND_LAT, &["-n", "100", "-s", "300"]);
    assert_eq!(rows[0]["inline"], false, "{}", rows[0]);
}

/// The tables: perftest's title (verb first), address lines and columns.
#[test]
fn titles_and_address_lines_are_perftests() {
    let cpu = ["--loopback", "--initiator", "cpu", "-n", "50"];
    let out = |bin: &str, extra: &[&str]| {
        let mut a = cpu.to_vec();
        a.extend_from_slice(extra);
        ok(bin, &a)
    };
    for (bin, extra, title, fields) in [
        (READ_BW, vec![], "RDMA_Read BW Test (read_bw)", 14),
        (SEND_BW, vec![], "Send BW Test (send_bw)", 8),
        (
            ATOMIC_BW,
            vec![],
            "Atomic FETCH_AND_ADD BW Test (atomic_bw)",
            8,
        ),
        (
            ATOMIC_BW,
            vec!["-A", "CMP_AND_SWAP"],
            "Atomic CMP_AND_SWAP BW Test (atomic_bw)",
            8,
        ),
        (READ_LAT, vec![], "RDMA_Read Latency Test (read_lat)", 14),
        (SEND_LAT, vec![], "Send Latency Test (send_lat)", 8),
        (
            ATOMIC_LAT,
            vec![],
            "Atomic FETCH_AND_ADD Latency Test (atomic_lat)",
            8,
        ),
    ] {
        let o = out(bin, &extra);
        assert_eq!(o.lines().nth(1).unwrap_or_default().trim(), title, "{o}");
        let addr: Vec<&str> = o.lines().filter(|l| l.contains(" address: ")).collect();
        assert_eq!(addr.len(), 2, "{o}");
        for l in addr {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), fields, "{l}");
            assert_eq!(&f[2..5], ["LID", "0000", "QPN"], "{l}");
            if fields == 14 {
                // READ: ` OUT 0x10` (perftest's -o default) before RKey and VAddr.
                assert_eq!((f[8], f[9], f[10]), ("OUT", "0x10", "RKey"), "{l}");
            }
        }
        // perftest's header lines of the verb.
        let has = |n: &str| o.lines().any(|l| l.starts_with(&format!(" {n:<16}:")));
        assert_eq!(
            has("Outstand reads"),
            fields == 14 || title.contains("Atomic"),
            "{o}"
        );
        assert_eq!(has("Max inline data"), title.contains("Send"), "{o}");
        assert_eq!(has("RX depth"), title.starts_with("Send BW"), "{o}");
    }
    let o = out(READ_BW, &["-o", "4"]);
    assert!(o.contains(" OUT 0x04 RKey "), "{o}");
}

/// Two processes on 127.0.0.1 (soft NICs on UDP wire ports), both sides printing the same
/// validated rows.
fn pair(bin: &str, args: &[&str]) -> (Vec<Value>, Vec<Value>) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let mut s: Vec<&str> = vec![
        "-p",
        &port,
        "--timeout",
        "30",
        "--initiator",
        "cpu",
        "--json",
    ];
    s.extend_from_slice(args);
    let server = command(bin, &s).spawn().expect("start the server");
    let mut c = vec!["127.0.0.1"];
    c.extend_from_slice(&s);
    let client = command(bin, &c).spawn().expect("start the client");
    let wait = |mut child: Child| {
        let start = Instant::now();
        while child.try_wait().expect("poll").is_none() {
            if start.elapsed() > Duration::from_secs(240) {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        child.wait_with_output().expect("output")
    };
    let (client, server) = (wait(client), wait(server));
    let rows = |role: &str, o: &Output| {
        assert!(
            o.status.success(),
            "{bin} {role} failed:\n{}\n{}",
            text(&o.stdout),
            text(&o.stderr)
        );
        json_lines(&text(&o.stdout))
    };
    (rows("server", &server), rows("client", &client))
}

#[test]
fn server_and_client_validate() {
    for (bin, test, args, numbers) in [
        (
            READ_BW,
            "read_bw",
            vec!["-s", "65536", "-n", "100"],
            "bw_average",
        ),
        (
            READ_BW,
            "read_bw",
            vec!["-s", "4096", "-n", "100", "-q", "2", "-b"],
            "bw_average",
        ),
        (
            SEND_BW,
            "send_bw",
            vec!["-s", "65536", "-n", "100"],
            "bw_average",
        ),
        (
            SEND_BW,
            "send_bw",
            vec!["-s", "100", "-n", "300", "-q", "2"],
            "bw_average",
        ),
        (ATOMIC_BW, "atomic_bw", vec!["-n", "200"], "bw_average"),
        (
            ATOMIC_BW,
            "atomic_bw",
            vec!["-n", "100", "-A", "CMP_AND_SWAP", "-b"],
            "bw_average",
        ),
        (
            READ_LAT,
            "read_lat",
            vec!["-s", "4096", "-n", "100"],
            "t_avg_us",
        ),
        (
            SEND_LAT,
            "send_lat",
            vec!["-s", "4096", "-n", "100"],
            "t_avg_us",
        ),
        (ATOMIC_LAT, "atomic_lat", vec!["-n", "100"], "t_avg_us"),
    ] {
        let (s, c) = pair(bin, &args);
        assert_eq!(s.len(), 1, "{test} {args:?}");
        assert_eq!(c.len(), 1, "{test} {args:?}");
        for v in [&s[0], &c[0]] {
            assert_eq!(v["test"], test, "{v}");
            assert_eq!(v["validated"], true, "{v}");
            assert_eq!(v["backend"], "soft", "{v}");
        }
        assert_eq!(s[0]["role"], "server");
        assert_eq!(c[0]["role"], "client");
        assert_eq!(s[0]["iterations"], c[0]["iterations"]);
        let (x, y) = (num(&s[0], numbers), num(&c[0], numbers));
        assert!(x > 0.0 && (x - y).abs() <= 1e-9 * x, "{test}: {x} vs {y}");
    }
}

/// Failures made on purpose: a corrupted destination byte (or fetched value) fails
/// validation, a wrong rkey fails with its error completion, on both sides across processes.
#[test]
fn validation_and_error_completions_fail_the_run() {
    for (bin, what) in [
        (READ_BW, "destination slot 0"),
        (SEND_BW, "destination slot 0"),
        (ATOMIC_BW, "result slot 0"),
    ] {
        let o = run(
            bin,
            &[
                "--loopback",
                "--initiator",
                "cpu",
                "-n",
                "50",
                "--inject",
                "corrupt",
            ],
        );
        assert_eq!(o.status.code(), Some(1), "{bin}: {}", text(&o.stderr));
        let e = text(&o.stderr);
        assert!(
            e.contains("validation failed") && e.contains(what),
            "{bin}: {e}"
        );
    }
    for (bin, what) in [
        (READ_LAT, "side A's receive buffer"),
        (SEND_LAT, "side A's receive buffer"),
        (ATOMIC_LAT, "the last fetched value"),
    ] {
        let o = run(
            bin,
            &[
                "--loopback",
                "--initiator",
                "cpu",
                "-n",
                "50",
                "--inject",
                "corrupt",
            ],
        );
        assert_eq!(o.status.code(), Some(1), "{bin}: {}", text(&o.stderr));
        let e = text(&o.stderr);
        assert!(
            e.contains("validation failed") && e.contains(what),
            "{bin}: {e}"
        );
    }
    for bin in [READ_BW, ATOMIC_BW] {
        let o = run(
            bin,
            &[
                "--loopback",
                "--initiator",
                "cpu",
                "-n",
                "50",
                "--inject",
                "bad-rkey",
            ],
        );
        assert_eq!(o.status.code(), Some(1), "{bin}");
        let e = text(&o.stderr);
        assert!(
            e.contains("REMOTE_ACCESS") || e.contains("remote access"),
            "{bin}: {e}"
        );
    }
}

#[test]
fn options_of_other_verbs_are_usage_errors() {
    for (bin, args, says) in [
        (READ_BW, vec!["-r", "64"], "-r (--rx-depth)"),
        (SEND_BW, vec!["-o", "4"], "-o (--outs)"),
        (SEND_BW, vec!["--bidir"], "--bidir"),
        (READ_BW, vec!["-I", "64"], "-I (--inline_size)"),
        (READ_BW, vec!["-A", "CMP_AND_SWAP"], "-A (--atomic_type)"),
        (ATOMIC_BW, vec!["-s", "16"], "-s other than 8"),
        (READ_BW, vec!["--threads", "4"], "--threads"),
        (SEND_BW, vec!["--scope", "warp"], "--scope"),
        (ATOMIC_BW, vec!["--scope", "block"], "--scope block"),
        (READ_LAT, vec!["-I", "8"], "-I (--inline_size)"),
        (SEND_LAT, vec!["--signal"], "--signal"),
        (ATOMIC_LAT, vec!["-a"], "-s other than 8"),
    ] {
        let mut a = vec!["--loopback", "--initiator", "cpu"];
        a.extend_from_slice(&args);
        let o = run(bin, &a);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{bin} {args:?}: {}",
            text(&o.stderr)
        );
        assert!(
            text(&o.stderr).contains(says),
            "{bin} {args:?}: {}",
            text(&o.stderr)
        );
    }
    // perftest's spellings of the atomic type, and nothing else.
    let o = run(ATOMIC_BW, &["--loopback", "-A", "SWAP"]);
    assert_eq!(o.status.code(), Some(2));
}
