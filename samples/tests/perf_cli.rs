//! The perftest-style samples from the outside: `put_bw` and `write_lat` run in loopback with the
//! CPU initiator (CI has no GPU), their JSON is checked, and bad arguments, unsupported
//! placements, a missing server and failures on purpose give clear errors and non-zero exit
//! codes, never a panic. The server/client roles (two processes) are in `remote_cli.rs`.

use serde_json::Value;
use std::process::{Command, Output};

const PUT_BW: &str = env!("CARGO_BIN_EXE_put_bw");
const WRITE_LAT: &str = env!("CARGO_BIN_EXE_write_lat");

fn run(bin: &str, args: &[&str]) -> Output {
    let out = Command::new(bin)
        .args(args)
        .env_remove("GPUVERBS_DEVICE")
        .output()
        .expect("start the sample");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("panicked"),
        "{bin} {args:?} panicked:\n{stderr}"
    );
    out
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs and expects success; returns the JSON lines of stdout.
fn json_lines(bin: &str, args: &[&str]) -> Vec<Value> {
    let out = run(bin, args);
    assert!(
        out.status.success(),
        "{bin} {args:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("{k} is not a number in {v}"))
}

fn check_bw(v: &Value, bytes: u64, iters: u64) {
    assert_eq!(v["test"], "put_bw", "{v}");
    assert_eq!(v["validated"], true, "{v}");
    assert_eq!(v["bytes"].as_u64(), Some(bytes), "{v}");
    assert_eq!(v["iterations"].as_u64(), Some(iters), "{v}");
    for k in ["bw_peak", "bw_average", "msg_rate_mpps", "time_s"] {
        let x = num(v, k);
        assert!(x.is_finite() && x > 0.0, "{k} = {x} in {v}");
    }
    assert!(num(v, "bw_peak") >= num(v, "bw_average"), "{v}");
    assert_eq!(v["initiator"], "cpu", "{v}");
    assert_eq!(v["rings"], "host", "{v}");
    assert_eq!(v["mem"], "host", "{v}");
    assert!(v["doorbell"].is_string() && v["device"].is_string(), "{v}");
}

#[test]
fn put_bw_cpu_loopback_sizes_validate() {
    for (size, iters) in [(2u64, 500u64), (4096, 300), (65536, 200), (1 << 20, 40)] {
        let s = size.to_string();
        let n = iters.to_string();
        let lines = json_lines(
            PUT_BW,
            &[
                "--loopback",
                "--initiator",
                "cpu",
                "--json",
                "-s",
                &s,
                "-n",
                &n,
            ],
        );
        assert_eq!(lines.len(), 1, "{lines:?}");
        check_bw(&lines[0], size, iters);
        assert_eq!(lines[0]["bw_unit"], "MB/sec");
    }
}

#[test]
fn put_bw_cpu_sweep_multi_qp_bidir() {
    // Every size of -a, 2 QPs each way, with slots reused (more iterations than fit at 8 MiB).
    let lines = json_lines(
        PUT_BW,
        &[
            "--loopback",
            "--initiator",
            "cpu",
            "--json",
            "-a",
            "-n",
            "12",
            "-q",
            "2",
            "--bidir",
            "--report-gbits",
            "--batch",
            "4",
            "-Q",
            "5",
        ],
    );
    assert_eq!(lines.len(), 23);
    for (e, v) in (1..=23).zip(&lines) {
        check_bw(v, 1 << e, 12);
        assert_eq!(v["qps"], 2);
        assert_eq!(v["bidir"], true);
        assert_eq!(v["bw_unit"], "Gb/sec");
    }
}

#[test]
fn put_bw_table_says_what_it_resolved() {
    let out = run(
        PUT_BW,
        &["--loopback", "-s", "64", "-n", "100", "--db", "bf"],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    for want in [
        "#bytes",
        "#iterations",
        "BW peak[MB/sec]",
        "BW average[MB/sec]",
        "MsgRate[Mpps]",
        "Device",
        "GPU",
        "Initiator",
        "Doorbell        : blueflame",
        "Rings",
        "Buffers",
    ] {
        assert!(stdout.contains(want), "no {want:?} in:\n{stdout}");
    }
    // Without --initiator the choice is automatic and says why.
    assert!(stdout.contains("(auto:"), "{stdout}");
    let row = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("64 "))
        .unwrap_or_else(|| panic!("no row for 64 B in:\n{stdout}"));
    let cols: Vec<f64> = row
        .split_whitespace()
        .map(|c| c.parse().expect("numeric column"))
        .collect();
    assert_eq!(cols.len(), 5, "{row}");
    assert!(cols[2..].iter().all(|&x| x > 0.0), "{row}");
}

#[test]
fn write_lat_cpu_smoke() {
    for extra in [
        &["-s", "2"][..],
        &["-s", "4097", "--signal"],
        &["-s", "65536"],
    ] {
        let mut args = vec!["--loopback", "--initiator", "cpu", "--json", "-n", "200"];
        args.extend_from_slice(extra);
        let lines = json_lines(WRITE_LAT, &args);
        assert_eq!(lines.len(), 1, "{lines:?}");
        let v = &lines[0];
        assert_eq!(v["test"], "write_lat");
        assert_eq!(v["validated"], true, "{v}");
        assert_eq!(v["iterations"], 200);
        let keys = ["t_min_us", "t_typical_us", "p99_us", "p99_9_us", "t_max_us"];
        let xs: Vec<f64> = keys.iter().map(|k| num(v, k)).collect();
        assert!(xs[0] > 0.0, "{v}");
        assert!(xs.windows(2).all(|w| w[0] <= w[1]), "not ordered: {v}");
        assert!(
            num(v, "t_avg_us") >= xs[0] && num(v, "t_stdev_us") >= 0.0,
            "{v}"
        );
    }
}

#[test]
fn write_lat_table() {
    let out = run(
        WRITE_LAT,
        &["--loopback", "--initiator", "cpu", "-n", "100", "-s", "8"],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    for want in [
        "t_min[usec]",
        "t_max[usec]",
        "t_typical[usec]",
        "t_avg[usec]",
        "t_stdev[usec]",
        "99% percentile[usec]",
        "99.9% percentile[usec]",
    ] {
        assert!(stdout.contains(want), "no {want:?} in:\n{stdout}");
    }
}

#[test]
fn bad_arguments_are_usage_errors() {
    let cases: &[(&str, &[&str])] = &[
        (PUT_BW, &["--loopback", "--scope", "galaxy"]),
        (PUT_BW, &["--loopback", "-s", "0"]),
        (PUT_BW, &["--loopback", "-s", "12Q"]),
        (PUT_BW, &["--loopback", "-s", "64", "-a"]),
        (PUT_BW, &["--loopback", "-n", "0"]),
        (PUT_BW, &["--loopback", "-q", "0"]),
        (PUT_BW, &["--loopback", "--threads", "2000"]),
        (PUT_BW, &["--loopback", "--db", "doorknocker"]),
        (PUT_BW, &["--loopback", "--initiator", "fpga"]),
        (
            PUT_BW,
            &["--loopback", "--initiator", "cpu", "--scope", "warp"],
        ),
        (
            PUT_BW,
            &["--loopback", "--initiator", "cpu", "--db", "proxy"],
        ),
        (PUT_BW, &["somehost", "--loopback"]),
        (PUT_BW, &["--no-such-option"]),
        (WRITE_LAT, &["--loopback", "--mem", "disk"]),
        (WRITE_LAT, &["--loopback", "--bidir"]),
        (
            WRITE_LAT,
            &["--loopback", "--initiator", "cpu", "--db", "proxy"],
        ),
        // The wire options belong to the server/client roles.
        (PUT_BW, &["--loopback", "--loss", "1"]),
        (PUT_BW, &["--loopback", "--wire-port", "5000"]),
        (PUT_BW, &["127.0.0.1", "--loss", "101"]),
        (PUT_BW, &["127.0.0.1", "--loss", "lots"]),
        // write_lat's kernel runs both sides: the GPU initiator needs --loopback.
        (WRITE_LAT, &["127.0.0.1", "--initiator", "gpu"]),
        (WRITE_LAT, &["--initiator", "gpu"]),
    ];
    for (bin, args) in cases {
        let out = run(bin, args);
        let stderr = text(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{bin} {args:?}: expected a usage error, got {}:\n{stderr}",
            out.status
        );
        assert!(stderr.contains("error:"), "{args:?}: {stderr}");
    }
}

#[test]
fn gpu_memory_placements_need_the_gpu_initiator() {
    for bin in [PUT_BW, WRITE_LAT] {
        let out = run(bin, &["--loopback", "--mem", "gpu", "-n", "10"]);
        let stderr = text(&out.stderr);
        if out.status.success() {
            // A machine with a GPU: the sample runs with its buffers in GPU memory.
            let stdout = text(&out.stdout);
            assert!(stdout.contains("GPU memory (registered"), "{stdout}");
        } else {
            assert_eq!(out.status.code(), Some(1), "{stderr}");
            assert!(
                stderr.contains("--mem gpu") && stderr.contains("need a GPU"),
                "{stderr}"
            );
        }
        let out = run(
            bin,
            &[
                "--loopback",
                "--rings",
                "gpu",
                "--initiator",
                "cpu",
                "-n",
                "10",
            ],
        );
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("--rings gpu") && stderr.contains("GPU initiator only"),
            "{stderr}"
        );
    }
    // Both keep their buffers (write_lat: and signal words) in GPU memory with the GPU initiator
    // only: the CPU initiator reaches them through host pointers, so --mem gpu with it is refused
    // before anything runs, on any machine.
    for bin in [PUT_BW, WRITE_LAT] {
        let out = run(
            bin,
            &[
                "--loopback",
                "--mem",
                "gpu",
                "--initiator",
                "cpu",
                "-n",
                "10",
            ],
        );
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("--mem gpu")
                && stderr.contains("need a GPU and the GPU initiator")
                && stderr.contains("--initiator cpu"),
            "{stderr}"
        );
        assert!(out.stdout.is_empty(), "{bin}: {}", text(&out.stdout));
    }
}

#[test]
fn cpu_initiator_refuses_gpu_only_options_when_chosen_automatically() {
    // On a machine without a GPU the automatic choice is the CPU; GPU options then fail clearly
    // (on a GPU machine the same command runs on the GPU).
    let out = run(
        PUT_BW,
        &["--loopback", "--scope", "warp", "-n", "10", "-s", "64"],
    );
    if !out.status.success() {
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("--scope") && stderr.contains("GPU initiator"),
            "{stderr}"
        );
    }
}

#[test]
fn client_without_server_fails_within_its_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let t = std::time::Instant::now();
    let out = run(PUT_BW, &["127.0.0.1", "-p", &port, "--timeout", "1"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(t.elapsed() < std::time::Duration::from_secs(20));
    assert!(
        text(&out.stderr).contains("rendezvous"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn error_completion_is_decoded_and_fails_the_run() {
    let out = run(
        PUT_BW,
        &[
            "--loopback",
            "--initiator",
            "cpu",
            "-s",
            "64",
            "-n",
            "50",
            "--inject",
            "bad-rkey",
        ],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("carries an error") && stderr.contains("REMOTE_ACCESS"),
        "{stderr}"
    );
}

#[test]
fn validation_failure_fails_the_run() {
    let out = run(
        PUT_BW,
        &[
            "--loopback",
            "--initiator",
            "cpu",
            "--json",
            "-s",
            "4096",
            "-n",
            "50",
            "--inject",
            "corrupt",
        ],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("validation failed"), "{stderr}");
    let v: Value = serde_json::from_str(text(&out.stdout).trim()).expect("one JSON line");
    assert_eq!(v["validated"], false, "{v}");
}
