//! The perftest-style samples from the outside: `put_bw` and `write_lat` run in loopback with the
//! CPU initiator (CI has no GPU), their JSON is checked, and bad arguments, unsupported
//! placements, a missing server and failures on purpose give clear errors and non-zero exit
//! codes, never a panic. The server/client roles (two processes) are in `remote_cli.rs`; what the
//! server does before a client comes (waiting, `-p 0`, a port in use) is here. Every child is
//! killed after a bound, on 127.0.0.1 only.

use serde_json::Value;
use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

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
    // --rings auto (the default) without a GPU for the rings: host memory, and why
    let why = v["rings_reason"].as_str().unwrap_or_default();
    assert!(why.starts_with("auto: host memory, no GPU given"), "{v}");
    assert_eq!(v["mem"], "host", "{v}");
    assert!(v["doorbell"].is_string() && v["device"].is_string(), "{v}");
    // Other processes' CPU during the timed run (null when it was too short to tell).
    let o = v
        .get("other_cpu_cores")
        .unwrap_or_else(|| panic!("no other_cpu_cores in {v}"));
    assert!(o.is_null() || o.as_f64().is_some_and(|x| x >= 0.0), "{v}");
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
fn put_bw_reg_cache_reports_cold_and_warm_registrations() {
    let args = [
        "--loopback",
        "--initiator",
        "cpu",
        "--json",
        "-s",
        "4096",
        "-n",
        "100",
    ];
    // Without the flag: no report (and the rest as before).
    let plain = json_lines(PUT_BW, &args);
    assert_eq!(plain.len(), 1);
    check_bw(&plain[0], 4096, 100);
    assert!(plain[0].get("reg_cache").is_none(), "{}", plain[0]);
    // With it, both directions: every buffer registered once cold (a miss), once warm (a hit).
    let mut with = args.to_vec();
    with.extend(["--reg-cache", "--bidir"]);
    let lines = json_lines(PUT_BW, &with);
    assert_eq!(lines.len(), 1);
    check_bw(&lines[0], 4096, 100);
    let r = &lines[0]["reg_cache"];
    let buffers = r["buffers"].as_array().unwrap_or_else(|| panic!("{r}"));
    assert_eq!(buffers.len(), 4, "src and dst on sides A and B: {r}");
    assert_eq!(
        (r["hits"].as_u64(), r["misses"].as_u64()),
        (Some(4), Some(4)),
        "{r}"
    );
    for b in buffers {
        assert!(b["cold_ns"].as_u64().is_some_and(|n| n > 0), "{b}");
        assert!(b["warm_ns"].as_u64().is_some(), "{b}");
        assert!(b["bytes"].as_u64().is_some_and(|n| n >= 4096), "{b}");
    }
    assert!(
        r["cold_ns"].as_u64().is_some() && r["warm_ns"].as_u64().is_some(),
        "{r}"
    );
    // and the table's header says so
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
            "--reg-cache",
        ],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let line = stdout
        .lines()
        .find(|l| l.contains("Reg cache"))
        .unwrap_or_else(|| panic!("no Reg cache line in:\n{stdout}"));
    assert!(
        line.contains("cold") && line.contains("hits 2, misses 2"),
        "{line}"
    );
    let plain = run(
        PUT_BW,
        &["--loopback", "--initiator", "cpu", "-s", "64", "-n", "50"],
    );
    assert!(!text(&plain.stdout).contains("Reg cache"));
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

/// A server started with `args` (stderr read line by line on a thread).
struct Server {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Server {
    fn start(bin: &str, args: &[&str]) -> Self {
        let mut child = Command::new(bin)
            .args(args)
            .env_remove("GPUVERBS_DEVICE")
            .env_remove("GPUVERBS_SOFTNIC_ADDR")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the server");
        let err = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The first stderr line containing `want` (within 60 s).
    fn line(&mut self, want: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.contains(want) {
                        return l;
                    }
                }
                Err(_) => {
                    let _ = self.child.kill();
                    panic!("no stderr line with {want:?}; saw {:?}", self.seen);
                }
            }
        }
    }

    /// The port the server says it listens on.
    fn port(&mut self) -> String {
        let l = self.line("waiting for a client on port ");
        let rest = &l[l.find("on port ").expect("port") + 8..];
        let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
        assert!(port.parse::<u16>().is_ok_and(|p| p != 0), "{l}");
        port
    }

    /// Waits up to `limit` for the exit (killing it after), and returns the status and the
    /// stderr lines not yet read.
    fn finish(mut self, limit: Duration) -> (std::process::ExitStatus, String) {
        let start = Instant::now();
        while self.child.try_wait().expect("poll").is_none() && start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let status = self.child.wait().expect("wait");
        let mut rest = self.seen.join("\n");
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
            rest.push('\n');
            rest.push_str(&l);
        }
        (status, rest)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn server_waits_for_a_client_without_a_limit_and_says_its_port() {
    for bin in [PUT_BW, WRITE_LAT] {
        // -p 0: the system picks the port, and the server prints it.
        let mut server = Server::start(bin, &["-p", "0", "-s", "64", "-n", "20", "--json"]);
        let port = server.port();
        assert!(
            server
                .seen
                .last()
                .is_some_and(|l| l.contains("no time limit")),
            "{:?}",
            server.seen
        );
        // Past the old 10-s default the server still waits.
        std::thread::sleep(Duration::from_secs(11));
        assert!(
            server.child.try_wait().expect("poll").is_none(),
            "{bin}: the server gave up: {:?}",
            server.seen
        );
        let client = run(
            bin,
            &["127.0.0.1", "-p", &port, "-s", "64", "-n", "20", "--json"],
        );
        assert!(
            client.status.success(),
            "{bin} client: {}",
            text(&client.stderr)
        );
        let (status, err) = server.finish(Duration::from_secs(60));
        assert!(status.success(), "{bin} server: {status}: {err}");
    }
}

#[test]
fn server_with_timeout_gives_up_and_client_needs_a_port() {
    let mut server = Server::start(PUT_BW, &["-p", "0", "--timeout", "1"]);
    let port = server.port();
    assert!(
        server
            .seen
            .last()
            .is_some_and(|l| l.contains("--timeout 1")),
        "{:?}",
        server.seen
    );
    let (status, err) = server.finish(Duration::from_secs(60));
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("timed out") && err.contains(&port), "{err}");
    let out = run(PUT_BW, &["127.0.0.1", "-p", "0", "--timeout", "1"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("-p 0"), "{}", text(&out.stderr));
}

#[test]
fn an_error_is_printed_once() {
    // A port that is taken: the bind error names its cause once.
    let taken = std::net::TcpListener::bind("0.0.0.0:0").expect("bind a port");
    let port = taken.local_addr().expect("addr").port().to_string();
    for bin in [PUT_BW, WRITE_LAT] {
        let out = run(bin, &["-p", &port, "--timeout", "1"]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert_eq!(stderr.matches("error:").count(), 1, "{stderr}");
        assert_eq!(
            stderr.matches("Address already in use").count(),
            1,
            "{stderr}"
        );
    }
}

#[test]
fn cpu_header_does_not_talk_about_gpu_mapping() {
    for (bin, extra) in [
        (PUT_BW, &["--db", "auto"][..]),
        (PUT_BW, &["--db", "bf"]),
        (WRITE_LAT, &["--db", "gpu"]),
    ] {
        let mut args = vec!["--loopback", "--initiator", "cpu", "-s", "8", "-n", "20"];
        args.extend_from_slice(extra);
        let out = run(bin, &args);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
        let field = |name: &str| -> String {
            let l = stdout
                .lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap_or_else(|| panic!("no {name} line in:\n{stdout}"));
            l[l.find(':').expect("a colon") + 1..].trim().to_string()
        };
        let rings = field("Rings");
        assert!(
            rings.starts_with("host memory (auto: host memory, no GPU given"),
            "{rings}"
        );
        let db = field("Doorbell");
        assert!(db.contains("the CPU initiator writes"), "{db}");
        for gpu_talk in ["GPU", "map", "kernel"] {
            assert!(!db.contains(gpu_talk), "{gpu_talk:?} in {db:?}");
        }
        // The JSON says the same.
        args.push("--json");
        let v = &json_lines(bin, &args)[0];
        let why = v["doorbell_reason"].as_str().expect("a reason");
        assert!(
            why.contains("the CPU initiator writes") && !why.contains("GPU"),
            "{v}"
        );
    }
}

#[test]
fn no_progress_lines_when_stderr_is_not_a_terminal() {
    // A sweep of a few seconds (progress starts after 2 s on a terminal); here stderr is a pipe.
    let out = run(
        PUT_BW,
        &["--loopback", "--initiator", "cpu", "-a", "-n", "50"],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(!stderr.contains("sizes done"), "{stderr}");
    assert!(
        !stdout.contains("sizes done") && !stdout.contains('\r'),
        "{stdout}"
    );
    // The table: one row per size, one after the other.
    let lines: Vec<&str> = stdout.lines().collect();
    let head = lines
        .iter()
        .position(|l| l.contains("#bytes"))
        .expect("table head");
    for (k, e) in (1..=23).enumerate() {
        let row = lines[head + 1 + k];
        assert!(
            row.split_whitespace().next() == Some(&(1u64 << e).to_string()),
            "row {k}: {row:?} in\n{stdout}"
        );
    }
}

#[test]
fn other_processes_cpu_is_reported_and_warned_about() {
    // Busy threads of this (other) process during a run: the header, the JSON and a warning
    // say so.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hogs: Vec<_> = (0..2)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            })
        })
        .collect();
    let outs: Vec<Output> = [PUT_BW, WRITE_LAT]
        .iter()
        .map(|bin| {
            run(
                bin,
                &[
                    "--loopback",
                    "--initiator",
                    "cpu",
                    "-s",
                    "8",
                    "-n",
                    "20000",
                    "--json",
                ],
            )
        })
        .collect();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for h in hogs {
        h.join().expect("hog");
    }
    for out in outs {
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{stderr}");
        let other = stderr
            .lines()
            .find(|l| l.trim_start().starts_with("Other CPU"))
            .unwrap_or_else(|| panic!("no Other CPU line in {stderr}"));
        assert!(other.contains("cores used by other processes"), "{other}");
        assert!(stderr.contains("warning: other processes used"), "{stderr}");
        let v: Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
        let o = &v["other_cpu_cores"];
        assert!(o.is_null() || o.as_f64().is_some_and(|x| x >= 0.0), "{v}");
    }
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
    // The write arrived (with one bit flipped): the message must not say it never did.
    assert!(
        stderr.contains("1 of 4096 bytes differ: the write arrived with wrong bytes")
            && !stderr.contains("never arrived"),
        "{stderr}"
    );
    let v: Value = serde_json::from_str(text(&out.stdout).trim()).expect("one JSON line");
    assert_eq!(v["validated"], false, "{v}");
}

#[test]
fn echo_without_a_gpu_says_it_needs_one() {
    // The echo server is a kernel: without a GPU (CI) the sample fails at once and says why;
    // on a GPU machine it runs and checks every answer (docs/benchmarks.md).
    let out = run(env!("CARGO_BIN_EXE_echo"), &["-n", "10", "-s", "64"]);
    if !out.status.success() {
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("echo needs a GPU"), "{stderr}");
    } else {
        let stdout = text(&out.stdout);
        assert!(stdout.contains("the kernel echoed 10 messages"), "{stdout}");
    }
}

#[test]
fn kv_transfer_without_a_gpu_says_it_needs_one() {
    // Both sides are kernels: without a GPU (CI) the sample fails at once and says why; on a
    // GPU machine it runs and checks every block (docs/benchmarks.md).
    let out = run(
        env!("CARGO_BIN_EXE_kv_transfer"),
        &["--blocks", "8", "--batch", "4"],
    );
    if !out.status.success() {
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("kv_transfer needs a GPU"), "{stderr}");
    } else {
        let stdout = text(&out.stdout);
        assert!(stdout.contains("every block checked"), "{stdout}");
    }
}
