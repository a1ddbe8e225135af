//! The samples' server/client roles on the mlx5 backend: `put_bw` and `write_lat` as two
//! processes, each under its own `gpuverbs emu --ip 127.0.N.1` / `127.0.N.2`, `-d mlx5_0` on
//! both, so the real libibverbs + libmlx5 drive the emulated ConnectX of each process and the
//! two talk RoCE v2 between the emulated ports, as perftest's server and client do in
//! `emu.rs`. The endpoints exchanged over the TCP bootstrap carry the ports' GIDs
//! (`::ffff:127.0.N.x`); every byte is validated by the receiving side; the JSON says backend
//! `mlx5`; the soft NICs behind the emulated devices report no sanitizer complaint. The soft
//! NIC's own options (`--wire-port`, `--loss`, `--pcap`, GPUVERBS_SOFTNIC_ADDR) are refused on
//! an rdma-core device, by both sides.
//!
//! Addresses: 127.0.121.x .. 127.0.129.x (emu.rs, mlx5_backend.rs and doctor.rs use others).

mod common;

use common::{artifacts, free_port, in_group, serial, wait, GPUVERBS};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("gv-mlx5-samples-{}-{name}", std::process::id()))
}

/// A TCP port nobody listens on now (the server binds it on all addresses).
/// `bin args` under `gpuverbs emu --ip ip`, its soft NICs' counters written to `counters`.
fn emu(ip: &str, counters: &Path, env: &[(&str, &str)], bin: &str, args: &[&str]) -> Command {
    let (lib, dir) = artifacts();
    let mut c = Command::new(GPUVERBS);
    in_group(&mut c);
    c.env("GPUVERBS_PRELOAD", lib)
        .env("GPUVERBS_EMU_COUNTERS", counters)
        .env_remove("GPUVERBS_DEVICE")
        .env_remove("GPUVERBS_SOFTNIC_ADDR")
        .envs(env.iter().copied())
        .args(["emu", "--ip", ip, "--"])
        .arg(dir.join(bin))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Waits for a child, killing it after [`LIMIT`].
/// One side of a run.
struct Side {
    out: Output,
    counters: PathBuf,
}

impl Side {
    fn stderr(&self) -> String {
        text(&self.out.stderr)
    }
    fn all(&self) -> String {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            text(&self.out.stdout),
            self.stderr()
        )
    }
}

/// How each side of a pair is started: extra arguments and environment.
#[derive(Default, Clone, Copy)]
struct Role<'a> {
    args: &'a [&'a str],
    env: &'a [(&'a str, &'a str)],
}

/// `bin` as server under `gpuverbs emu --ip 127.0.net.1` and as client under `127.0.net.2`
/// (`common` on both, then each role's own), meeting over TCP on a free port.
fn pair(bin: &str, net: u8, common: &[&str], server: Role, client: Role) -> (Side, Side) {
    let (sip, cip) = (format!("127.0.{net}.1"), format!("127.0.{net}.2"));
    let port = free_port();
    let (sc, cc) = (
        tmp(&format!("{bin}-{net}-server")),
        tmp(&format!("{bin}-{net}-client")),
    );
    let mut s: Vec<&str> = vec!["-p", &port, "--timeout", "60"];
    s.extend_from_slice(common);
    s.extend_from_slice(server.args);
    let server_child = emu(&sip, &sc, server.env, bin, &s)
        .spawn()
        .expect("start the server");
    // The client retries its connection until the server listens (--timeout).
    let mut c: Vec<&str> = vec![&sip, "-p", &port, "--timeout", "60"];
    c.extend_from_slice(common);
    c.extend_from_slice(client.args);
    let client_child = emu(&cip, &cc, client.env, bin, &c)
        .spawn()
        .expect("start the client");
    let client = Side {
        out: wait(client_child),
        counters: cc,
    };
    let server = Side {
        out: wait(server_child),
        counters: sc,
    };
    for (role, side) in [("server", &server), ("client", &client)] {
        assert!(
            !side.stderr().contains("panicked"),
            "{bin} {role} panicked:\n{}",
            side.all()
        );
    }
    (server, client)
}

/// The counters file of a side's emulated devices must show a clean run: no bad doorbell,
/// stale WQE, CQ overrun or error completion, and (for a side that posts) WQEs executed.
fn check_counters(side: &Side, what: &str, posts: bool) {
    let path = &side.counters;
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{what}: no counters ({e})"));
    let _ = std::fs::remove_file(path);
    let line = text
        .lines()
        .find(|l| l.starts_with("mlx5_0 "))
        .unwrap_or_else(|| panic!("{what}: no mlx5_0 counters in {text:?}"));
    let val = |k: &str| -> u64 {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{k}=")).map(|v| v.parse().unwrap()))
            .unwrap_or_else(|| panic!("{what}: no {k} in {line:?}"))
    };
    assert!(!posts || val("wqes") > 0, "{what}: no WQE executed: {line}");
    for k in ["bad_doorbells", "stale_wqes", "cq_overruns", "error_cqes"] {
        assert_eq!(val(k), 0, "{what}: sanitizer complaint: {line}");
    }
}

/// Both sides succeeded: their JSON records (one per size).
fn records(bin: &str, server: &Side, client: &Side) -> (Vec<Value>, Vec<Value>) {
    let lines = |role: &str, side: &Side| -> Vec<Value> {
        assert!(
            side.out.status.success(),
            "{bin} {role} failed ({}):\n{}",
            side.out.status,
            side.all()
        );
        text(&side.out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect()
    };
    (lines("server", server), lines("client", client))
}

fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("{k} is not a number in {v}"))
}

/// What both sides' records of a run must show: the test, the mlx5 backend on `mlx5_0`
/// (selected as `why` says), the validation, the roles and GIDs of the two emulated ports,
/// no soft-NIC wire, and the same numbers on both sides (both print the same row).
fn check_rows(
    test: &str,
    net: u8,
    (server, client): (&[Value], &[Value]),
    why: [&str; 2],
    numbers: &[&str],
) {
    assert_eq!(server.len(), client.len(), "{server:?}\n{client:?}");
    assert!(!server.is_empty());
    let gid = |host: u8| format!("::ffff:127.0.{net}.{host}");
    for (s, c) in server.iter().zip(client) {
        for (v, role, me, peer, why) in [(s, "server", 1, 2, why[0]), (c, "client", 2, 1, why[1])] {
            assert_eq!(v["test"], test, "{v}");
            assert_eq!(v["backend"], "mlx5", "{v}");
            let dev = v["device"].as_str().unwrap_or_default();
            assert!(
                dev.starts_with("mlx5 mlx5_0 (") && dev.contains(why),
                "{role}: {dev}"
            );
            assert!(dev.contains(&gid(me)), "{role}'s GID in {dev}");
            assert_eq!(v["validated"], true, "{v}");
            assert_eq!(v["initiator"], "cpu", "{v}");
            assert_eq!(v["role"], role, "{v}");
            assert_eq!(v["gid"], gid(me), "{v}");
            assert_eq!(v["peer_gid"], gid(peer), "{v}");
            // No soft NIC of the sample's own: no wire port, no loss, no wire counters.
            for k in ["wire_addr", "peer_wire_addr", "loss_pct", "wire"] {
                assert!(v[k].is_null(), "{role}: {k} in {v}");
            }
        }
        for k in ["bytes", "iterations", "warmup"] {
            assert_eq!(s[k], c[k], "{k}: {s}\n{c}");
        }
        for k in numbers {
            let (x, y) = (num(s, k), num(c, k));
            assert!(x.is_finite() && x > 0.0, "{k} = {x} in {s}");
            assert!((x - y).abs() <= 1e-9 * x.abs().max(1.0), "{k}: {x} vs {y}");
        }
    }
}

/// The header's line `name` (on stderr with --json).
fn header_line(side: &Side, name: &str) -> String {
    let err = side.stderr();
    err.lines()
        .find(|l| l.trim_start().starts_with(name))
        .map(|l| l[l.find(':').expect("a colon") + 1..].trim().to_string())
        .unwrap_or_else(|| panic!("no {name} line in:\n{err}"))
}

const D: Role = Role {
    args: &["-d", "mlx5_0"],
    env: &[],
};

#[test]
fn put_bw_server_and_client_on_mlx5_validate_every_byte() {
    let _g = serial();
    let by_name = "requested in code";
    for (net, size, iters) in [(121, "8", "300"), (122, "64K", "100"), (123, "1M", "16")] {
        let common = ["--initiator", "cpu", "--json", "-s", size, "-n", iters];
        let (s, c) = pair("put_bw", net, &common, D, D);
        let rows = records("put_bw", &s, &c);
        check_rows(
            "put_bw",
            net,
            (&rows.0, &rows.1),
            [by_name, by_name],
            &["bw_peak", "bw_average", "msg_rate_mpps", "time_s"],
        );
        assert_eq!(rows.0.len(), 1, "{:?}", rows.0);
        let v = &rows.1[0];
        assert_eq!(v["bytes"].as_u64(), Some(parse_size(size)), "{v}");
        assert_eq!(v["iterations"], iters.parse::<u64>().unwrap(), "{v}");
        assert!(num(v, "bw_peak") >= num(v, "bw_average"), "{v}");
        for (side, role) in [(&s, "server"), (&c, "client")] {
            let (me, peer) = if role == "server" { (1, 2) } else { (2, 1) };
            assert_eq!(
                header_line(side, "Wire"),
                format!(
                    "RoCE v2 from port 1 of mlx5_0 (GID ::ffff:127.0.{net}.{me} -> \
                     ::ffff:127.0.{net}.{peer})"
                ),
                "{role}"
            );
            assert!(
                header_line(side, "Device").starts_with("mlx5 mlx5_0"),
                "{role}"
            );
        }
        check_counters(&c, "put_bw client", true);
        // The server only receives: the WRITEs need no WQE of its own.
        check_counters(&s, "put_bw server", false);
    }
}

#[test]
fn put_bw_bidirectional_on_mlx5_chosen_by_env_and_auto() {
    let _g = serial();
    // The server's device from GPUVERBS_DEVICE, the client's by Auto (rdma-core lists the
    // emulated mlx5_0): both are the mlx5 backend; two QPs each way, both sides writing.
    let server = Role {
        args: &[],
        env: &[("GPUVERBS_DEVICE", "mlx5_0")],
    };
    let common = [
        "--initiator",
        "cpu",
        "--json",
        "-s",
        "4096",
        "-n",
        "200",
        "-q",
        "2",
        "--bidir",
    ];
    let (s, c) = pair("put_bw", 124, &common, server, Role::default());
    let rows = records("put_bw", &s, &c);
    check_rows(
        "put_bw",
        124,
        (&rows.0, &rows.1),
        [
            "GPUVERBS_DEVICE asks for it",
            "auto: rdma-core lists mlx5_0",
        ],
        &["bw_peak", "bw_average", "msg_rate_mpps"],
    );
    let v = &rows.1[0];
    assert_eq!(
        (v["qps"].as_u64(), v["bidir"].as_bool()),
        (Some(2), Some(true))
    );
    check_counters(&c, "put_bw client", true);
    check_counters(&s, "put_bw server", true);
}

#[test]
fn write_lat_server_and_client_on_mlx5() {
    let _g = serial();
    let by_name = "requested in code";
    for (net, extra) in [(125, &["-s", "2"][..]), (126, &["-s", "4097", "--signal"])] {
        let mut common = vec!["--initiator", "cpu", "--json", "-n", "100"];
        common.extend_from_slice(extra);
        let (s, c) = pair("write_lat", net, &common, D, D);
        let rows = records("write_lat", &s, &c);
        check_rows(
            "write_lat",
            net,
            (&rows.0, &rows.1),
            [by_name, by_name],
            &["t_min_us", "t_typical_us", "t_avg_us", "p99_us", "t_max_us"],
        );
        assert_eq!(rows.0.len(), 1, "{:?}", rows.0);
        let v = &rows.1[0];
        assert_eq!(v["bytes"].as_u64(), Some(parse_size(extra[1])), "{v}");
        assert_eq!(v["signal"], extra.contains(&"--signal"), "{v}");
        assert!(num(v, "t_min_us") <= num(v, "t_typical_us"), "{v}");
        assert!(num(v, "t_typical_us") <= num(v, "t_max_us"), "{v}");
        // Both sides send (the ping and the pong).
        check_counters(&c, "write_lat client", true);
        check_counters(&s, "write_lat server", true);
    }
}

#[test]
fn soft_nic_options_are_refused_on_mlx5_by_both_sides() {
    let _g = serial();
    let pcap = tmp("refused.pcap");
    let _ = std::fs::remove_file(&pcap);
    let pcap_s = pcap.to_str().unwrap();
    for bin in ["put_bw", "write_lat"] {
        let server = Role {
            args: &["-d", "mlx5_0", "--wire-port", "5000", "--pcap", pcap_s],
            env: &[],
        };
        let client = Role {
            args: &["-d", "mlx5_0", "--loss", "1"],
            env: &[("GPUVERBS_SOFTNIC_ADDR", "127.0.0.1:0")],
        };
        let common = ["--initiator", "cpu", "-s", "64", "-n", "20"];
        let (s, c) = pair(bin, 127, &common, server, client);
        let (se, ce) = (s.stderr(), c.stderr());
        assert_eq!(s.out.status.code(), Some(1), "{bin} server:\n{}", s.all());
        assert_eq!(c.out.status.code(), Some(1), "{bin} client:\n{}", c.all());
        // Each side names what it was given, and the device that cannot honour it.
        assert!(
            se.contains("server (open the device): --wire-port, --pcap belong to the soft NIC")
                && se.contains("rdma-core device mlx5_0"),
            "{bin} server:\n{se}"
        );
        assert!(
            ce.contains(
                "client (open the device): --loss, GPUVERBS_SOFTNIC_ADDR belong to the soft NIC"
            ) && ce.contains("GID ::ffff:127.0.127.2"),
            "{bin} client:\n{ce}"
        );
        // Nothing ran: no table, no capture.
        assert!(s.out.stdout.is_empty() && c.out.stdout.is_empty(), "{bin}");
        assert!(!pcap.exists(), "{bin}: {} was written", pcap.display());
        let _ = std::fs::remove_file(&s.counters);
        let _ = std::fs::remove_file(&c.counters);
    }
    // One side alone at fault: the other is told why and fails too.
    let (s, c) = pair(
        "put_bw",
        128,
        &["--initiator", "cpu", "-s", "64", "-n", "20"],
        D,
        Role {
            args: &["-d", "mlx5_0", "--loss", "0"],
            env: &[],
        },
    );
    assert_eq!(c.out.status.code(), Some(1), "client:\n{}", c.all());
    assert!(
        c.stderr().contains("--loss belongs to the soft NIC"),
        "{}",
        c.all()
    );
    assert_eq!(s.out.status.code(), Some(1), "server:\n{}", s.all());
    assert!(
        s.stderr()
            .contains("the client failed (open the device): --loss belongs to the soft NIC"),
        "server:\n{}",
        s.all()
    );
    let _ = std::fs::remove_file(&s.counters);
    let _ = std::fs::remove_file(&c.counters);
}

/// `-s` sizes of these tests.
fn parse_size(s: &str) -> u64 {
    match s.strip_suffix('K').or(s.strip_suffix('M')) {
        Some(n) if s.ends_with('K') => n.parse::<u64>().unwrap() << 10,
        Some(n) => n.parse::<u64>().unwrap() << 20,
        None => s.parse().unwrap(),
    }
}
