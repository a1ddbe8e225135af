//! perftest's flags on `put_bw` and the latency tests (CPU initiator, loopback, soft NIC): -D, -l,
//! -I, --output, --cpu_util, -F, -x, -i, -R, --use_cuda(_dmabuf), the #iterations of several
//! QPs and the address lines. No timed assertion: -D is checked by what it reports.

use serde_json::Value;

mod common;
use common::{ok, run, text};

const PUT_BW: &str = env!("CARGO_BIN_EXE_put_bw");
const WRITE_LAT: &str = env!("CARGO_BIN_EXE_write_lat");

fn json(bin: &str, args: &[&str]) -> Vec<Value> {
    let mut a = args.to_vec();
    a.push("--json");
    ok(bin, &a)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

const CPU: [&str; 3] = ["--loopback", "--initiator", "cpu"];

fn with(extra: &[&'static str]) -> Vec<&'static str> {
    CPU.iter().chain(extra).copied().collect()
}

/// The numeric rows of a table.
fn rows(out: &str) -> Vec<Vec<f64>> {
    out.lines()
        .filter_map(|l| {
            l.split_whitespace()
                .map(|f| f.parse::<f64>())
                .collect::<Result<Vec<_>, _>>()
                .ok()
        })
        .filter(|r| r.len() >= 4)
        .collect()
}

#[test]
fn duration_runs_until_it_ends_and_reports_the_iterations() {
    let v = json(PUT_BW, &with(&["-s", "4096", "-D", "1", "-q", "2"]));
    assert_eq!(v.len(), 1, "{v:?}");
    let v = &v[0];
    assert_eq!(v["duration_s"], 1, "{v}");
    assert_eq!(v["validated"], true, "{v}");
    let iters = v["iterations"].as_u64().unwrap();
    assert!(iters > 0, "{v}");
    assert_eq!(v["iterations_reported"].as_u64(), Some(2 * iters), "{v}");
    assert!(v["time_s"].as_f64().unwrap() > 0.0, "{v}");
    // The table: one row, its #iterations the QPs' together; CPU_Util with --cpu_util.
    let out = ok(PUT_BW, &with(&["-s", "64", "-D", "1", "--cpu_util"]));
    assert!(
        out.lines()
            .any(|l| l.trim_end().ends_with("MsgRate[Mpps]    CPU_Util[%]")),
        "{out}"
    );
    let r = rows(&out);
    assert_eq!(r.len(), 1, "{out}");
    assert!(r[0].len() == 6 && r[0][1] > 0.0, "{out}");
    assert!((0.0..=100.0).contains(&r[0][5]), "{out}");
}

#[test]
fn latency_duration_prints_perftests_duration_row() {
    // WRITE: the timed round trips, their mean half round trip and rate; every byte checked
    // against what each side sent (side A may have one more in flight when time ran out).
    let v = json(WRITE_LAT, &with(&["-s", "64", "-D", "1"]));
    assert_eq!(v.len(), 1, "{v:?}");
    let v = &v[0];
    assert_eq!(
        (v["duration_s"].as_u64(), v["validated"].as_bool()),
        (Some(1), Some(true)),
        "{v}"
    );
    let n = v["iterations"].as_u64().unwrap();
    let (t_avg, tps, secs) = (
        v["t_avg_us"].as_f64().unwrap(),
        v["tps_average"].as_f64().unwrap(),
        v["time_s"].as_f64().unwrap(),
    );
    assert!(n > 0 && t_avg > 0.0 && tps > 0.0 && secs > 0.0, "{v}");
    // perftest's arithmetic: t_avg is the span over the round trips, halved; tps their rate.
    assert!(
        (t_avg - secs * 1e6 / n as f64 / 2.0).abs() < 1e-6 * t_avg.max(1.0),
        "{v}"
    );
    assert!((tps - n as f64 / secs).abs() < 1e-6 * tps, "{v}");
    let sent: Vec<u64> = serde_json::from_value(v["sent"].clone()).unwrap();
    let warmup = v["warmup"].as_u64().unwrap();
    assert!(sent[0] >= warmup + n && sent[0] <= warmup + n + 1, "{v}");
    assert!(sent[1] + 1 >= sent[0] && sent[1] <= sent[0], "{v}");
    // The table: perftest's duration columns, CPU_Util with --cpu_util; SEND, READ, atomics.
    for bin in [
        WRITE_LAT,
        env!("CARGO_BIN_EXE_send_lat"),
        env!("CARGO_BIN_EXE_atomic_lat"),
    ] {
        let out = ok(bin, &with(&["-D", "1", "--cpu_util"]));
        assert!(
            out.lines().any(|l| l.trim_end()
                == " #bytes        #iterations       t_avg[usec]    tps average    CPU_Util[%]"),
            "{out}"
        );
        let r = rows(&out);
        assert_eq!(r.len(), 1, "{out}");
        assert!(r[0].len() == 5 && r[0][1] > 0.0 && r[0][2] > 0.0, "{out}");
        assert!((0.0..=100.0).contains(&r[0][4]), "{out}");
    }
    let v = &json(env!("CARGO_BIN_EXE_read_lat"), &with(&["-D", "1"]))[0];
    assert_eq!(v["validated"], true, "{v}");
    assert!(v["iterations"].as_u64().unwrap() > 0, "{v}");
}

#[test]
fn cpu_util_without_duration_warns_like_perftest() {
    for bin in [PUT_BW, WRITE_LAT] {
        let o = run(bin, &with(&["-n", "50", "--cpu_util"]));
        assert!(o.status.success(), "{}", text(&o.stderr));
        assert!(text(&o.stderr).contains("works only with Duration mode"));
        assert!(!text(&o.stdout).contains("CPU_Util"));
    }
}

#[test]
fn several_qps_report_iterations_times_qps() {
    let out = ok(PUT_BW, &with(&["-s", "1024", "-n", "100", "-q", "2"]));
    let r = rows(&out);
    assert_eq!(r.len(), 1, "{out}");
    assert_eq!(
        r[0][1], 200.0,
        "-q 2 -n 100 reports 200, as perftest:\n{out}"
    );
}

#[test]
fn output_prints_only_the_number() {
    for (bin, units) in [
        (PUT_BW, "bandwidth"),
        (PUT_BW, "message_rate"),
        (WRITE_LAT, "latency"),
    ] {
        let out = ok(bin, &with(&["-n", "100", "--output", units]));
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 1, "{bin} --output {units}:\n{out}");
        let (int, frac) = lines[0].split_once('.').expect("a decimal");
        assert!(int.parse::<u64>().is_ok() && frac.len() == 6, "{out}");
        assert!(lines[0].parse::<f64>().unwrap() > 0.0, "{out}");
    }
    // Every size: one line each.
    let out = ok(
        PUT_BW,
        &with(&["-a", "-n", "20", "--output", "bandwidth"])[..],
    );
    assert_eq!(out.lines().count(), 23, "{out}");
}

#[test]
fn inline_size_sends_small_messages_inline() {
    let v = &json(PUT_BW, &with(&["-s", "64", "-n", "300", "-I", "64"]))[0];
    assert_eq!(v["inline_size"], 64, "{v}");
    assert_eq!(v["inline_wqes"], 300, "every timed WQE inline: {v}");
    assert_eq!(v["validated"], true, "{v}");
    let v = &json(PUT_BW, &with(&["-s", "128", "-n", "300", "-I", "64"]))[0];
    assert_eq!(v["inline_wqes"], 0, "larger than -I: gathered: {v}");
    let v = &json(PUT_BW, &with(&["-s", "64", "-n", "300"]))[0];
    assert_eq!(
        v["inline_wqes"], 0,
        "perftest's default for write_bw is 0: {v}"
    );
    // write_lat: perftest's default 220 sends its 2-byte messages inline; -I 0 does not.
    let v = &json(WRITE_LAT, &with(&["-n", "100"]))[0];
    assert_eq!(
        (v["inline_size"].as_u64(), v["inline"].as_bool()),
        (Some(220), Some(true))
    );
    assert_eq!(v["validated"], true, "{v}");
    let v = &json(WRITE_LAT, &with(&["-n", "100", "-I", "0"]))[0];
    assert_eq!(v["inline"], false, "{v}");
    let v = &json(WRITE_LAT, &with(&["-n", "100", "-s", "200", "--signal"]))[0];
    assert_eq!(
        (v["inline"].as_bool(), v["validated"].as_bool()),
        (Some(true), Some(true))
    );
}

#[test]
fn post_list_is_perftests_l_with_its_default() {
    let v = &json(PUT_BW, &with(&["-n", "100"]))[0];
    assert_eq!(v["post_list"], 1, "perftest's default: {v}");
    let v = &json(PUT_BW, &with(&["-n", "100", "-l", "8"]))[0];
    assert_eq!(v["post_list"], 8, "{v}");
    let v = &json(PUT_BW, &with(&["-n", "100", "--batch", "4"]))[0];
    assert_eq!(v["post_list"], 4, "--batch is an alias: {v}");
    let out = ok(PUT_BW, &with(&["-n", "100", "--post_list", "8"]));
    assert!(out.contains(" Post List       : 8"), "{out}");
}

#[test]
fn accepted_perftest_flags() {
    // -F is ignored (as perftest's concerns its cycle counter); -x 0 and -i 1 are the soft
    // NIC's GID index and port.
    for bin in [PUT_BW, WRITE_LAT] {
        let out = ok(bin, &with(&["-n", "50", "-F", "-x", "0", "-i", "1"]));
        assert_eq!(rows(&out).len(), 1, "{out}");
        assert!(out.contains(" GID index       : 0"), "{out}");
    }
}

#[test]
fn address_lines_are_perftests() {
    let out = ok(PUT_BW, &with(&["-n", "50", "-q", "2"]));
    let addr: Vec<&str> = out.lines().filter(|l| l.contains(" address: ")).collect();
    assert_eq!(addr.len(), 4, "{out}");
    assert!(addr[..2]
        .iter()
        .all(|l| l.starts_with(" local address: LID 0000 QPN 0x")));
    assert!(addr[2..]
        .iter()
        .all(|l| l.starts_with(" remote address: LID 0000 QPN 0x")));
    for l in &addr {
        let f: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(f.len(), 12, "{l}");
        assert_eq!(
            [f[2], f[4], f[6], f[8], f[10]],
            ["LID", "QPN", "PSN", "RKey", "VAddr"]
        );
        assert!(
            f[5].len() >= 6 && f[9].len() >= 8 && f[11].len() == 16,
            "{l}"
        );
    }
    let gids: Vec<&str> = out.lines().filter(|l| l.starts_with(" GID: ")).collect();
    assert_eq!(gids.len(), 4, "{out}");
    // The soft NIC's GID ::ffff:127.x.y.z in perftest's decimal bytes.
    assert!(
        gids[0].starts_with(" GID: 00:00:00:00:00:00:00:00:00:00:255:255:127:"),
        "{}",
        gids[0]
    );
    let out = ok(WRITE_LAT, &with(&["-n", "50"]));
    assert_eq!(out.matches(" address: LID 0000 QPN ").count(), 2, "{out}");
}

#[test]
fn flags_that_cannot_apply_are_refused_with_a_reason() {
    let cases: &[(&str, &[&str], &str)] = &[
        (PUT_BW, &["-R"], "-R (rdma_cm): not supported"),
        (WRITE_LAT, &["-R"], "-R (rdma_cm): not supported"),
        (PUT_BW, &["-x", "5"], "-x 5: gpuverbs uses the RoCE v2 GID"),
        (WRITE_LAT, &["-i", "2"], "-i 2: gpuverbs drives port 1"),
        (
            PUT_BW,
            &["--use_cuda_dmabuf"],
            "--use_cuda_dmabuf: needs GPU payload",
        ),
        (
            PUT_BW,
            &["--output", "latency"],
            "can be bandwidth or message_rate",
        ),
        (WRITE_LAT, &["--output", "bandwidth"], "can be latency"),
    ];
    for (bin, args, why) in cases {
        let mut a = vec!["--loopback"];
        a.extend_from_slice(args);
        let o = run(bin, &a);
        assert!(!o.status.success(), "{bin} {a:?} succeeded");
        let err = text(&o.stderr);
        assert!(err.contains(why), "{bin} {a:?}: no {why:?} in:\n{err}");
        assert!(
            err.lines().filter(|l| l.contains("error")).count() == 1,
            "{err}"
        );
    }
    // The soft NIC has no dma-buf path (no GPU needed: the device check comes first).
    for bin in [PUT_BW, WRITE_LAT] {
        let o = run(bin, &["--loopback", "--use_cuda=0", "--use_cuda_dmabuf"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(
            text(&o.stderr).contains("does not apply to the soft NIC"),
            "{}",
            text(&o.stderr)
        );
    }
    // Usage errors (exit 2): -D with -a or -n; -I with a warp or block scope (their calls
    // gather).
    for args in [
        &["--initiator", "cpu", "-D", "1", "-a"][..],
        &["--initiator", "cpu", "-D", "1", "-n", "5"],
        &["--initiator", "gpu", "-I", "64", "--scope", "warp"],
        &["-I", "64", "--scope", "block"],
    ] {
        let mut a = vec!["--loopback"];
        a.extend_from_slice(args);
        assert_eq!(run(PUT_BW, &a).status.code(), Some(2), "{a:?}");
    }
    for args in [&["-D", "1", "-a"][..], &["-D", "1", "-n", "5"]] {
        let mut a = vec!["--loopback"];
        a.extend_from_slice(args);
        assert_eq!(run(WRITE_LAT, &a).status.code(), Some(2), "write_lat {a:?}");
    }
}
