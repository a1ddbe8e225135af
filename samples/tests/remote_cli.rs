//! The server/client roles of `put_bw` and `write_lat` as two processes on 127.0.0.1: each
//! opens a soft NIC with a wire port (RoCEv2 over UDP), they meet over the TCP bootstrap, and
//! every byte is validated by the receiving side, which reports to the other. CPU initiator
//! (CI has no GPU), ephemeral ports.

use serde_json::Value;
use std::process::Output;
use std::time::Duration;

mod common;
use common::{command, free_port, text, wait};

const PUT_BW: &str = env!("CARGO_BIN_EXE_put_bw");
const WRITE_LAT: &str = env!("CARGO_BIN_EXE_write_lat");

/// Runs `bin` as server and as client (with `args` on both, plus the server's address for the
/// client) and returns (server, client).
fn pair(bin: &str, server_args: &[&str], client_args: &[&str]) -> (Output, Output) {
    let port = free_port();
    let mut s: Vec<&str> = vec!["-p", &port, "--timeout", "30"];
    s.extend_from_slice(server_args);
    let server = command(bin, &s).spawn().expect("start the server");
    let mut c: Vec<&str> = vec!["127.0.0.1", "-p", &port, "--timeout", "30"];
    c.extend_from_slice(client_args);
    let client = command(bin, &c).spawn().expect("start the client");
    let limit = Duration::from_secs(240);
    let client = wait(client, limit).0;
    let server = wait(server, limit).0;
    for (role, out) in [("server", &server), ("client", &client)] {
        let stderr = text(&out.stderr);
        assert!(!stderr.contains("panicked"), "{role} panicked:\n{stderr}");
    }
    (server, client)
}

/// Both sides succeed; returns their JSON lines.
fn json_pair(bin: &str, args: &[&str]) -> (Vec<Value>, Vec<Value>) {
    let (server, client) = pair(bin, args, args);
    let lines = |role: &str, out: &Output| -> Vec<Value> {
        assert!(
            out.status.success(),
            "{role} failed ({}):\nstdout:\n{}\nstderr:\n{}",
            out.status,
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect()
    };
    (lines("server", &server), lines("client", &client))
}

fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("{k} is not a number in {v}"))
}

/// The fields both sides must print alike, and those that say who they are.
fn check_rows(test: &str, server: &[Value], client: &[Value], numbers: &[&str]) {
    assert_eq!(server.len(), client.len());
    for (s, c) in server.iter().zip(client) {
        for v in [s, c] {
            assert_eq!(v["test"], test, "{v}");
            assert_eq!(v["validated"], true, "{v}");
            assert_eq!(v["initiator"], "cpu", "{v}");
            let dev = v["device"].as_str().unwrap();
            assert!(dev.contains("soft NIC on UDP 127.0.0.1:"), "{dev}");
            assert_eq!(v["backend"], "soft", "{v}");
            assert_eq!(v["gid"], "::ffff:127.0.0.1", "{v}");
            assert_eq!(v["peer_gid"], "::ffff:127.0.0.1", "{v}");
        }
        assert_eq!(
            (s["role"].as_str(), c["role"].as_str()),
            (Some("server"), Some("client"))
        );
        // Each side's wire port is the other's peer.
        assert_eq!(s["wire_addr"], c["peer_wire_addr"], "{s}\n{c}");
        assert_eq!(c["wire_addr"], s["peer_wire_addr"], "{s}\n{c}");
        assert_ne!(s["wire_addr"], c["wire_addr"]);
        for k in ["bytes", "iterations", "warmup"] {
            assert_eq!(s[k], c[k], "{k}");
        }
        for k in numbers {
            let (x, y) = (num(s, k), num(c, k));
            assert!(x.is_finite() && x > 0.0, "{k} = {x} in {s}");
            assert!((x - y).abs() <= 1e-9 * x.abs().max(1.0), "{k}: {x} vs {y}");
        }
    }
}

#[test]
fn put_bw_server_and_client_validate_every_size() {
    for (size, iters) in [
        ("2", "300"),
        ("4096", "200"),
        ("65536", "100"),
        ("1M", "16"),
    ] {
        let (s, c) = json_pair(
            PUT_BW,
            &["--initiator", "cpu", "--json", "-s", size, "-n", iters],
        );
        assert_eq!(s.len(), 1, "{s:?}");
        check_rows(
            "put_bw",
            &s,
            &c,
            &["bw_peak", "bw_average", "msg_rate_mpps"],
        );
        assert!(num(&c[0], "bw_peak") >= num(&c[0], "bw_average"));
        // The client sent the data over UDP; the server only answered.
        let (sw, cw) = (&s[0]["wire"], &c[0]["wire"]);
        let iters: f64 = iters.parse().unwrap();
        assert!(num(cw, "tx_packets") >= iters, "{cw}");
        assert!(num(sw, "tx_packets") >= 1.0, "{sw}");
        assert_eq!(s[0]["doorbell"], "gpu-doorbell", "{}", s[0]);
    }
}

#[test]
fn put_bw_sweep_bidirectional_multi_qp_across_processes() {
    // Every size of -a, 2 QPs each way, both sides writing, slots reused.
    let (s, c) = json_pair(
        PUT_BW,
        &[
            "--initiator",
            "cpu",
            "--json",
            "-a",
            "-n",
            "6",
            "-q",
            "2",
            "--bidir",
            "--batch",
            "4",
            "-Q",
            "3",
        ],
    );
    assert_eq!(s.len(), 23);
    check_rows("put_bw", &s, &c, &["bw_average", "msg_rate_mpps"]);
    for (e, v) in (1..=23).zip(&c) {
        assert_eq!(v["bytes"].as_u64(), Some(1 << e));
        assert_eq!(
            (v["qps"].as_u64(), v["bidir"].as_bool()),
            (Some(2), Some(true))
        );
    }
}

#[test]
fn put_bw_at_one_percent_loss_still_validates() {
    let (s, c) = json_pair(
        PUT_BW,
        &[
            "--initiator",
            "cpu",
            "--json",
            "-s",
            "256K",
            "-n",
            "64",
            "--loss",
            "1",
        ],
    );
    check_rows("put_bw", &s, &c, &["bw_average"]);
    let cw = &c[0]["wire"];
    assert_eq!(c[0]["loss_pct"], 1.0);
    // 64 writes of 64 packets each (and the warm-up): about 40 drops expected.
    assert!(num(cw, "injected_drops") >= 5.0, "{cw}");
    assert!(num(cw, "retransmits") >= num(cw, "injected_drops"), "{cw}");
}

#[test]
fn write_lat_server_and_client() {
    for extra in [&["-s", "2"][..], &["-s", "4097", "--signal"]] {
        let mut args = vec!["--initiator", "cpu", "--json", "-n", "100"];
        args.extend_from_slice(extra);
        let (s, c) = json_pair(WRITE_LAT, &args);
        assert_eq!(s.len(), 1);
        check_rows(
            "write_lat",
            &s,
            &c,
            &["t_min_us", "t_typical_us", "t_avg_us", "p99_us", "t_max_us"],
        );
        let v = &c[0];
        assert!(num(v, "t_min_us") <= num(v, "t_typical_us"), "{v}");
        assert!(num(v, "t_typical_us") <= num(v, "t_max_us"), "{v}");
    }
}

#[test]
fn duration_across_processes() {
    // -D: each side of a latency test stops on its own clock; both print side A's duration
    // row and check their receive buffer against what the other sent (which both report).
    for (bin, test) in [
        (WRITE_LAT, "write_lat"),
        (env!("CARGO_BIN_EXE_send_lat"), "send_lat"),
        (env!("CARGO_BIN_EXE_atomic_lat"), "atomic_lat"),
    ] {
        let args = ["--initiator", "cpu", "--json", "-D", "1"];
        let (s, c) = json_pair(bin, &args);
        assert_eq!(s.len(), 1);
        check_rows(test, &s, &c, &["t_avg_us", "tps_average", "time_s"]);
        assert_eq!(s[0]["sent"], c[0]["sent"], "{}\n{}", s[0], c[0]);
        assert!(num(&c[0], "iterations") > 0.0, "{}", c[0]);
    }
    // send_bw: the server's receivers take what the client's duration posted, told after it.
    let args = ["--initiator", "cpu", "--json", "-D", "1", "-s", "4096"];
    let (s, c) = json_pair(env!("CARGO_BIN_EXE_send_bw"), &args);
    check_rows("send_bw", &s, &c, &["bw_average", "msg_rate_mpps"]);
    assert!(num(&c[0], "iterations") > 0.0, "{}", c[0]);
}

#[test]
fn a_validation_failure_on_the_server_fails_both() {
    let args = [
        "--initiator",
        "cpu",
        "-s",
        "4096",
        "-n",
        "50",
        "--inject",
        "corrupt",
        "--json",
    ];
    let (server, client) = pair(PUT_BW, &args, &args);
    for (role, out) in [("server", &server), ("client", &client)] {
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{role}: {stderr}");
        assert!(
            stderr.contains("validation failed at 4096 B")
                && stderr.contains("(checked by the server)"),
            "{role}: {stderr}"
        );
        let v: Value = serde_json::from_str(text(&out.stdout).trim()).expect("one JSON line");
        assert_eq!(v["validated"], false, "{role}: {v}");
    }
}

#[test]
fn an_error_completion_on_the_client_fails_both() {
    let args = [
        "--initiator",
        "cpu",
        "-s",
        "64",
        "-n",
        "50",
        "--inject",
        "bad-rkey",
    ];
    let (server, client) = pair(PUT_BW, &args, &args);
    let (se, ce) = (text(&server.stderr), text(&client.stderr));
    assert_eq!(client.status.code(), Some(1), "{ce}");
    assert!(
        ce.contains("carries an error") && ce.contains("REMOTE_ACCESS"),
        "{ce}"
    );
    assert_eq!(server.status.code(), Some(1), "{se}");
    assert!(
        se.contains("the client failed") && se.contains("REMOTE_ACCESS"),
        "{se}"
    );
}

#[test]
fn a_device_that_does_not_open_fails_both() {
    // The client asks for a device nobody lists: it says so, and the server is told why.
    let (server, client) = pair(
        PUT_BW,
        &["--initiator", "cpu", "-s", "64", "-n", "20"],
        &[
            "--initiator",
            "cpu",
            "-s",
            "64",
            "-n",
            "20",
            "-d",
            "mlx5_77",
        ],
    );
    let (se, ce) = (text(&server.stderr), text(&client.stderr));
    assert_eq!(client.status.code(), Some(1), "{ce}");
    assert!(
        ce.contains("client (open the device)") && ce.contains("mlx5_77"),
        "{ce}"
    );
    assert_eq!(server.status.code(), Some(1), "{se}");
    assert!(
        se.contains("the client failed (open the device)") && se.contains("mlx5_77"),
        "{se}"
    );
}

#[test]
fn different_parameters_are_refused_by_both() {
    let (server, client) = pair(
        PUT_BW,
        &["--initiator", "cpu", "-s", "4096"],
        &["--initiator", "cpu", "-s", "8192"],
    );
    for (role, out) in [("server", &server), ("client", &client)] {
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{role}: {stderr}");
        assert!(stderr.contains("parameters differ"), "{role}: {stderr}");
    }
}

#[test]
fn put_bw_and_write_lat_take_a_path_mtu() {
    // -m 1024 on both sides: every 256 KiB write is 256 packets of 1 KiB
    let args = [
        "--initiator",
        "cpu",
        "--json",
        "-s",
        "256K",
        "-n",
        "16",
        "--warmup",
        "1",
        "-m",
        "1024",
    ];
    let (server, client) = pair(PUT_BW, &args, &args);
    for (role, out) in [("server", &server), ("client", &client)] {
        assert!(out.status.success(), "{role}: {}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.lines()
                .any(|l| l.starts_with(" Mtu") && l.ends_with(": 1024[B]")),
            "{role}:\n{err}"
        );
    }
    let c: Value = serde_json::from_str(text(&client.stdout).lines().next().unwrap()).unwrap();
    let cw = &c["wire"];
    assert!(
        num(cw, "tx_packets") - num(cw, "retransmits") >= (16 * 256) as f64,
        "{cw}"
    );
    // only one side asks: the smaller MTU wins on both
    let (server, client) = pair(
        WRITE_LAT,
        &["--initiator", "cpu", "-s", "4097", "-n", "20", "-m", "512"],
        &["--initiator", "cpu", "-s", "4097", "-n", "20"],
    );
    for (role, out) in [("server", &server), ("client", &client)] {
        assert!(out.status.success(), "{role}: {}", text(&out.stderr));
        let all = text(&out.stdout) + &text(&out.stderr);
        assert!(
            all.lines()
                .any(|l| l.starts_with(" Mtu") && l.ends_with(": 512[B]")),
            "{role}:\n{all}"
        );
    }
    // not an MTU of IBTA's: a usage error
    let out = command(PUT_BW, &["--initiator", "cpu", "-m", "1500", "--loopback"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

/// The frames of a pcap file written by the soft NIC: (IPv4 header, UDP header, payload).
fn pcap_frames(path: &std::path::Path) -> Vec<([u8; 20], [u8; 8], Vec<u8>)> {
    let data = std::fs::read(path).unwrap();
    assert_eq!(&data[..4], &0xa1b2_c3d4u32.to_le_bytes(), "pcap magic");
    assert_eq!(u32::from_le_bytes(data[20..24].try_into().unwrap()), 101);
    let mut at = 24;
    let mut out = Vec::new();
    while at < data.len() {
        let incl = u32::from_le_bytes(data[at + 8..at + 12].try_into().unwrap()) as usize;
        let f = &data[at + 16..at + 16 + incl];
        at += 16 + incl;
        out.push((
            f[..20].try_into().unwrap(),
            f[20..28].try_into().unwrap(),
            f[28..].to_vec(),
        ));
    }
    out
}

#[test]
fn put_bw_and_write_lat_write_a_pcap() {
    use gpuverbs::soft::packet;
    let dir = std::env::temp_dir().join(format!("gpuverbs-pcap-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for bin in [PUT_BW, WRITE_LAT] {
        let (sp, cp) = (dir.join("server.pcap"), dir.join("client.pcap"));
        let common = [
            "--initiator",
            "cpu",
            "-s",
            "8K",
            "-n",
            "20",
            "--warmup",
            "2",
        ];
        let mut s: Vec<&str> = common.to_vec();
        s.extend(["--pcap", sp.to_str().unwrap()]);
        let mut c: Vec<&str> = common.to_vec();
        c.extend(["--pcap", cp.to_str().unwrap()]);
        let (server, client) = pair(bin, &s, &c);
        for (role, out, path) in [("server", &server, &sp), ("client", &client, &cp)] {
            let err = text(&out.stderr);
            assert!(out.status.success(), "{bin} {role}: {err}");
            let frames = pcap_frames(path);
            let line = format!("pcap: {} frames in {}", frames.len(), path.display());
            assert!(err.contains(&line), "{bin} {role}: no `{line}` in\n{err}");
            // 22 writes of 8 KiB at MTU 4096 each way, ACKs: sent and received
            assert!(frames.len() >= 44, "{bin} {role}: {} frames", frames.len());
            let mut ops = std::collections::BTreeSet::new();
            for (i, (ip, udp, payload)) in frames.iter().enumerate() {
                let (body, icrc) = payload.split_at(payload.len() - 4);
                assert_eq!(
                    packet::icrc_with_headers(ip, udp, body).to_le_bytes(),
                    icrc,
                    "{bin} {role}: ICRC of frame {i}"
                );
                ops.insert(packet::parse(payload).expect("RoCEv2").bth.opcode);
            }
            // both directions: WRITEs one way, ACKs the other
            assert!(
                ops.contains(&packet::opcode::ACK) && ops.iter().any(|&o| o <= 0x0b),
                "{bin} {role}: {ops:?}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
