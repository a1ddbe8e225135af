//! Debian's perftest and gpuverbs' samples side by side, each as a server and a client under
//! its own `gpuverbs emu --ip 127.0.N.x` (`-d mlx5_0` for the samples, CPU initiator), with the
//! same flags: the title, the header names they share, the column line (exactly, spacing
//! included), the address lines (perftest's format of the verb, and each side's "remote" being
//! the other's "local") and the #iterations of several QPs must be perftest's. All eight
//! tests: WRITE, READ, SEND and atomics, bandwidth and latency.
//!
//! Needs Debian's perftest (CI installs it). Addresses: 127.0.131.x .. 127.0.134.x and
//! 127.0.135.x .. 127.0.148.x.

mod common;

use common::{artifacts, free_port, in_group, serial, wait, GPUVERBS};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn emu(ip: &str, prog: &Path, args: &[&str]) -> Child {
    let (lib, _) = artifacts();
    in_group(&mut Command::new(GPUVERBS))
        .env("GPUVERBS_PRELOAD", lib)
        .env_remove("GPUVERBS_DEVICE")
        .env_remove("GPUVERBS_SOFTNIC_ADDR")
        .args(["emu", "--ip", ip, "--"])
        .arg(prog)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start under gpuverbs emu")
}

/// Whether a TCP port is in LISTEN state (/proc/net/tcp: perftest's client does not retry).
fn listening(port: u16) -> bool {
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    tcp.lines().skip(1).any(|l| {
        let f: Vec<_> = l.split_whitespace().collect();
        f.len() > 3
            && f[3] == "0A"
            && f[1]
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok())
                == Some(port)
    })
}

/// Server and client stdout of `prog args` under `127.0.net.1` / `.2`.
fn pair(prog: &Path, net: u8, args: &[&str]) -> (String, String) {
    let (sip, cip) = (format!("127.0.{net}.1"), format!("127.0.{net}.2"));
    let port = free_port();
    let mut s = vec!["-p", port.as_str()];
    s.extend_from_slice(args);
    let server = emu(&sip, prog, &s);
    let t = Instant::now();
    while !listening(port.parse().unwrap()) {
        assert!(t.elapsed() < Duration::from_secs(60), "{prog:?}: no server");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = s.clone();
    c.push(&sip);
    let client = wait(emu(&cip, prog, &c));
    let server = wait(server);
    let text = |o: &Output| {
        assert!(
            o.status.success(),
            "{prog:?} failed:\n{}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    (text(&server), text(&client))
}

fn tool(name: &str) -> PathBuf {
    let p = std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(name))
                .find(|f| f.is_file())
        })
        .unwrap_or_else(|| panic!("{name} not found: install the Debian package perftest"));
    p
}

/// The names of a header's `name : value` lines (perftest puts two on some lines, tab apart).
fn header_names(out: &str) -> Vec<String> {
    out.lines()
        .take_while(|l| !l.contains(" address: "))
        .flat_map(|l| l.split('\t'))
        .filter_map(|c| c.split_once(':').map(|(n, _)| n.trim().to_string()))
        .filter(|n| !n.is_empty())
        .collect()
}

/// The column line (the one that starts with ` #bytes`), without trailing blanks.
fn columns(out: &str) -> String {
    out.lines()
        .find(|l| l.starts_with(" #bytes"))
        .unwrap_or_else(|| panic!("no column line in:\n{out}"))
        .trim_end()
        .to_string()
}

/// The address lines as (side, values, GID), checked against perftest's format: ` local
/// address: LID 0000 QPN 0x%04x PSN 0x%06x` then, by verb, ` RKey 0x%06x VAddr 0x%014x`
/// (WRITE), ` OUT 0x%02x RKey ... VAddr ...` (READ) or nothing (SEND, atomics), and then
/// ` GID: ` and 16 decimal bytes. The values: QPN, PSN, and OUT, RKey, VAddr where there.
fn addresses(out: &str) -> Vec<(String, Vec<String>, String)> {
    let lines: Vec<&str> = out.lines().collect();
    let mut v = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if !l.contains(" address: ") {
            continue;
        }
        let f: Vec<&str> = l.split_whitespace().collect();
        let names: &[&str] = match f.len() {
            8 => &["address:", "LID", "0000", "QPN", "PSN"],
            12 => &["address:", "LID", "0000", "QPN", "PSN", "RKey", "VAddr"],
            14 => &[
                "address:", "LID", "0000", "QPN", "PSN", "OUT", "RKey", "VAddr",
            ],
            n => panic!("{n} fields: {l}"),
        };
        let named: Vec<&str> = [f[1], f[2], f[3]]
            .into_iter()
            .chain(f[4..].iter().step_by(2).copied())
            .collect();
        assert_eq!(named, names, "{l}");
        let values: Vec<&str> = f[5..].iter().step_by(2).copied().collect();
        for x in &values {
            assert!(
                x.starts_with("0x") && u64::from_str_radix(&x[2..], 16).is_ok(),
                "{l}"
            );
        }
        assert!(values[0].len() >= 6 && values[1].len() >= 3, "{l}");
        if f.len() > 8 {
            let (rkey, vaddr) = (values[values.len() - 2], values[values.len() - 1]);
            assert!(rkey.len() >= 8, "{l}");
            assert_eq!(vaddr.len(), 16, "{l}");
        }
        if f.len() == 14 {
            assert!(values[2].len() >= 4, "{l}");
        }
        let gid = lines.get(i + 1).copied().unwrap_or_default();
        let bytes: Vec<&str> = gid
            .strip_prefix(" GID: ")
            .unwrap_or_else(|| panic!("no GID line after {l}"))
            .split(':')
            .collect();
        assert_eq!(bytes.len(), 16, "{gid}");
        assert!(
            bytes
                .iter()
                .all(|b| b.len() >= 2 && b.parse::<u8>().is_ok()),
            "{gid}"
        );
        v.push((
            f[0].to_string(),
            values.iter().map(|x| x.to_string()).collect(),
            gid.to_string(),
        ));
    }
    v
}

/// The first numeric row's #iterations.
fn iterations(out: &str) -> f64 {
    out.lines()
        .filter_map(|l| {
            l.split_whitespace()
                .map(|f| f.parse::<f64>())
                .collect::<Result<Vec<_>, _>>()
                .ok()
        })
        .find(|r| r.len() >= 4)
        .unwrap_or_else(|| panic!("no row in:\n{out}"))[1]
}

/// The server's and client's outputs agree the way perftest's do: each one's local lines
/// are the other's remote lines.
fn check_sides(what: &str, server: &str, client: &str, qps: usize) {
    let (s, c) = (addresses(server), addresses(client));
    for (side, a) in [("server", &s), ("client", &c)] {
        let sides: Vec<&str> = a.iter().map(|x| x.0.as_str()).collect();
        let mut want = vec!["local"; qps];
        want.extend(vec!["remote"; qps]);
        assert_eq!(sides, want, "{what} {side}");
    }
    for k in 0..qps {
        assert_eq!(s[k].1, c[qps + k].1, "{what}: server local = client remote");
        assert_eq!(c[k].1, s[qps + k].1, "{what}: client local = server remote");
        assert_eq!(s[k].2, c[qps + k].2, "{what}: GIDs");
    }
}

#[test]
fn put_bw_prints_ib_write_bw_layout() {
    let _g = serial();
    let (_, dir) = artifacts();
    let common = ["-s", "4096", "-n", "200", "-q", "2"];
    let mut perf = vec!["-x", "0"];
    perf.extend_from_slice(&common);
    let (ps, pc) = pair(&tool("ib_write_bw"), 131, &perf);
    let mut ours = vec![
        "-d",
        "mlx5_0",
        "--initiator",
        "cpu",
        "--timeout",
        "60",
        "-x",
        "0",
    ];
    ours.extend_from_slice(&common);
    let (gs, gc) = pair(&dir.join("put_bw"), 132, &ours);

    let title = |o: &str| o.lines().nth(1).unwrap_or_default().trim().to_string();
    assert!(
        title(&gc).starts_with(&title(&pc)),
        "{}\n{}",
        title(&pc),
        title(&gc)
    );
    let names = header_names(&gc);
    for n in [
        "Device",
        "Number of qps",
        "TX depth",
        "CQ Moderation",
        "Mtu",
        "GID index",
        "Max inline data",
    ] {
        assert!(
            header_names(&pc).contains(&n.to_string()),
            "perftest: {n}\n{pc}"
        );
        assert!(names.contains(&n.to_string()), "put_bw has no {n:?}:\n{gc}");
    }
    for (p, g) in [(&pc, &gc), (&ps, &gs)] {
        assert_eq!(columns(g), columns(p), "the column line");
    }
    check_sides("ib_write_bw", &ps, &pc, 2);
    check_sides("put_bw", &gs, &gc, 2);
    // -q 2 -n 200: perftest reports 400, and so must put_bw.
    assert_eq!(iterations(&pc), 400.0, "{pc}");
    assert_eq!(iterations(&gc), iterations(&pc), "{gc}");
    assert_eq!(iterations(&gs), iterations(&ps), "{gs}");
}

#[test]
fn write_lat_prints_ib_write_lat_layout() {
    let _g = serial();
    let (_, dir) = artifacts();
    let common = ["-s", "2", "-n", "200"];
    let mut perf = vec!["-x", "0"];
    perf.extend_from_slice(&common);
    let (ps, pc) = pair(&tool("ib_write_lat"), 133, &perf);
    let mut ours = vec!["-d", "mlx5_0", "--initiator", "cpu", "--timeout", "60"];
    ours.extend_from_slice(&common);
    let (gs, gc) = pair(&dir.join("write_lat"), 134, &ours);
    for n in ["Device", "TX depth", "Mtu", "GID index", "Max inline data"] {
        assert!(
            header_names(&pc).contains(&n.to_string()),
            "perftest: {n}\n{pc}"
        );
        assert!(
            header_names(&gc).contains(&n.to_string()),
            "write_lat: {n}\n{gc}"
        );
    }
    assert_eq!(columns(&gc), columns(&pc), "the column line");
    check_sides("ib_write_lat", &ps, &pc, 1);
    check_sides("write_lat", &gs, &gc, 1);
    assert_eq!(iterations(&gc), iterations(&pc), "{gc}");
    let _ = (ps, gs);
}

#[test]
fn write_lat_duration_mode_prints_ib_write_lat_layout() {
    let _g = serial();
    let (_, dir) = artifacts();
    // perftest's duration row (#bytes, #iterations, t_avg, tps average) with CPU_Util.
    let common = ["-s", "2", "-D", "2", "--cpu_util"];
    let mut perf = vec!["-x", "0"];
    perf.extend_from_slice(&common);
    let (ps, pc) = pair(&tool("ib_write_lat"), 149, &perf);
    let mut ours = vec!["-d", "mlx5_0", "--initiator", "cpu", "--timeout", "60"];
    ours.extend_from_slice(&common);
    let (gs, gc) = pair(&dir.join("write_lat"), 150, &ours);
    assert!(columns(&pc).contains("tps average"), "{pc}");
    assert_eq!(columns(&gc), columns(&pc), "the column line");
    check_sides("ib_write_lat", &ps, &pc, 1);
    check_sides("write_lat", &gs, &gc, 1);
    for (who, o) in [("ib_write_lat", &pc), ("write_lat", &gc)] {
        assert!(iterations(o) > 0.0, "{who} ran no timed round trip:\n{o}");
    }
}

#[test]
fn send_bw_duration_mode_prints_ib_send_bw_layout() {
    let _g = serial();
    let (_, dir) = artifacts();
    let common = ["-s", "4096", "-D", "2"];
    let mut perf = vec!["-x", "0"];
    perf.extend_from_slice(&common);
    let (ps, pc) = pair(&tool("ib_send_bw"), 151, &perf);
    let mut ours = vec!["-d", "mlx5_0", "--initiator", "cpu", "--timeout", "60"];
    ours.extend_from_slice(&common);
    let (gs, gc) = pair(&dir.join("send_bw"), 152, &ours);
    assert_eq!(columns(&gc), columns(&pc), "the column line");
    assert_eq!(columns(&gs), columns(&ps), "the server's column line");
    check_sides("ib_send_bw", &ps, &pc, 1);
    check_sides("send_bw", &gs, &gc, 1);
    for (who, o) in [
        ("ib_send_bw", &pc),
        ("send_bw", &gc),
        ("send_bw server", &gs),
    ] {
        assert!(iterations(o) > 0.0, "{who} sent nothing:\n{o}");
    }
}

/// One of the READ, SEND and atomic tests beside its perftest: perftest's `tool` under
/// 127.0.`net`.x and the sample `ours` under 127.0.`net + 1`.x, with `common` flags on both.
/// `names`: header names both print (on the client; `server_names` on the server); `bw`:
/// a bandwidth test (both sides print the column line; a latency test's server prints none
/// in perftest's READ and atomic tests, so the clients are compared); `qps` of the address lines.
#[allow(clippy::too_many_arguments)]
fn compare(
    tool_name: &str,
    ours: &str,
    net: u8,
    common: &[&str],
    names: &[&str],
    server_names: &[&str],
    bw: bool,
    qps: usize,
) {
    let _g = serial();
    let (_, dir) = artifacts();
    let mut perf = vec!["-x", "0"];
    perf.extend_from_slice(common);
    let (ps, pc) = pair(&tool(tool_name), net, &perf);
    let mut mine = vec![
        "-d",
        "mlx5_0",
        "--initiator",
        "cpu",
        "--timeout",
        "60",
        "-x",
        "0",
    ];
    mine.extend_from_slice(common);
    let (gs, gc) = pair(&dir.join(ours), net + 1, &mine);

    // perftest's title (the line after the first rule: perftest's server says first that it
    // waits), then gpuverbs' test name in parentheses.
    let title = |o: &str| {
        o.lines()
            .skip_while(|l| !l.starts_with("-----"))
            .nth(1)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    for (p, g) in [(&pc, &gc), (&ps, &gs)] {
        let (pt, gt) = (title(p), title(g));
        assert_eq!(
            gt,
            format!("{pt} ({ours})"),
            "{tool_name}:\n{p}\n{ours}:\n{g}"
        );
    }
    for (p, g, want) in [(&pc, &gc, names), (&ps, &gs, server_names)] {
        for n in want {
            assert!(
                header_names(p).contains(&n.to_string()),
                "{tool_name} has no {n:?}:\n{p}"
            );
            assert!(
                header_names(g).contains(&n.to_string()),
                "{ours} has no {n:?}:\n{g}"
            );
        }
    }
    assert_eq!(columns(&gc), columns(&pc), "{ours}: the column line");
    if bw {
        assert_eq!(
            columns(&gs),
            columns(&ps),
            "{ours}: the server's column line"
        );
    }
    check_sides(tool_name, &ps, &pc, qps);
    check_sides(ours, &gs, &gc, qps);
    // The same address format: as many values per line (QPN, PSN, OUT, RKey, VAddr).
    let shape = |o: &str| addresses(o).iter().map(|a| a.1.len()).collect::<Vec<_>>();
    assert_eq!(shape(&gc), shape(&pc), "{ours}: the address lines' format");
    assert_eq!(
        shape(&gs),
        shape(&ps),
        "{ours}: the server's address lines' format"
    );
    assert_eq!(iterations(&gc), iterations(&pc), "{gc}");
}

#[test]
fn read_bw_prints_ib_read_bw_layout() {
    compare(
        "ib_read_bw",
        "read_bw",
        135,
        &["-s", "4096", "-n", "200", "-q", "2"],
        &[
            "Device",
            "Number of qps",
            "TX depth",
            "CQ Moderation",
            "Mtu",
            "GID index",
            "Outstand reads",
        ],
        &[
            "Device",
            "Number of qps",
            "Mtu",
            "GID index",
            "Outstand reads",
        ],
        true,
        2,
    );
}

#[test]
fn send_bw_prints_ib_send_bw_layout() {
    compare(
        "ib_send_bw",
        "send_bw",
        137,
        &["-s", "4096", "-n", "200", "-q", "2"],
        &[
            "Device",
            "Number of qps",
            "TX depth",
            "CQ Moderation",
            "Mtu",
            "GID index",
            "Max inline data",
        ],
        &[
            "Device",
            "Number of qps",
            "RX depth",
            "Mtu",
            "GID index",
            "Max inline data",
        ],
        true,
        2,
    );
}

#[test]
fn atomic_bw_prints_ib_atomic_bw_layout() {
    compare(
        "ib_atomic_bw",
        "atomic_bw",
        139,
        &["-n", "200", "-q", "2"],
        &[
            "Device",
            "Number of qps",
            "TX depth",
            "CQ Moderation",
            "Mtu",
            "GID index",
            "Outstand reads",
        ],
        &["Device", "Number of qps", "Outstand reads"],
        true,
        2,
    );
    compare(
        "ib_atomic_bw",
        "atomic_bw",
        141,
        &["-n", "200", "-A", "CMP_AND_SWAP"],
        &["Device", "Outstand reads"],
        &["Device"],
        true,
        1,
    );
}

#[test]
fn read_lat_prints_ib_read_lat_layout() {
    compare(
        "ib_read_lat",
        "read_lat",
        143,
        &["-s", "64", "-n", "200"],
        &["Device", "TX depth", "Mtu", "GID index", "Outstand reads"],
        &["Device", "Mtu", "Outstand reads"],
        false,
        1,
    );
}

#[test]
fn send_lat_prints_ib_send_lat_layout() {
    compare(
        "ib_send_lat",
        "send_lat",
        145,
        &["-s", "2", "-n", "200"],
        &["Device", "TX depth", "Mtu", "GID index", "Max inline data"],
        &["Device", "Mtu", "Max inline data"],
        false,
        1,
    );
}

#[test]
fn atomic_lat_prints_ib_atomic_lat_layout() {
    compare(
        "ib_atomic_lat",
        "atomic_lat",
        147,
        &["-n", "200"],
        &["Device", "TX depth", "Mtu", "GID index", "Outstand reads"],
        &["Device", "Mtu", "Outstand reads"],
        false,
        1,
    );
}
