//! `gpuverbs emu` with UD QPs: the distro's ibv_ud_pingpong and perftest's `-c UD` send and
//! latency tests between two emulated processes, each with its own address (127.0.140.x ..
//! 127.0.149.x, TCP ports 19400..19499, used by no other test); both sides must exit 0 with
//! their result, and the soft NICs' counters must show no sanitizer complaint.
//!
//! Needs Debian's ibverbs-utils and perftest (CI installs them); a missing tool fails the test
//! with the package to install.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

const GPUVERBS: &str = env!("CARGO_BIN_EXE_gpuverbs");

/// One heavy test at a time: the machine has two cores.
fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|e| e.into_inner())
}

/// Builds the preload library next to the gpuverbs binary (`cargo test` builds binaries but
/// not cdylibs of other packages), once per test process.
fn preload() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let dir = Path::new(GPUVERBS).parent().unwrap().to_path_buf();
        let release = dir.file_name().is_some_and(|n| n == "release");
        let mut c = Command::new(option_env!("CARGO").unwrap_or("cargo"));
        c.args(["build", "-q", "-p", "gpuverbs-uverbs-preload"]);
        if release {
            c.arg("--release");
        }
        if let Some(target) = dir.parent() {
            c.env("CARGO_TARGET_DIR", target);
        }
        let st = c.status().expect("run cargo to build the preload library");
        assert!(st.success(), "building gpuverbs-uverbs-preload failed");
        let p = dir.join("libgpuverbs_uverbs_preload.so");
        assert!(p.is_file(), "{} missing after the build", p.display());
        p
    })
    .clone()
}

fn need(tool: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        || Path::new(tool).is_file();
    assert!(
        found,
        "{tool} not found: install the Debian package {package}"
    );
}

fn emu(ip: &str, counters: Option<&Path>, args: &[&str]) -> Command {
    let mut c = Command::new(GPUVERBS);
    c.env("GPUVERBS_PRELOAD", preload());
    if let Some(f) = counters {
        c.env("GPUVERBS_EMU_COUNTERS", f);
    }
    c.args(["emu", "--ip", ip, "--"]).args(args);
    // a group of its own: a timeout kills the launcher and the tool it started together
    c.process_group(0);
    c
}

fn wait(mut child: Child, limit: Duration, what: &str) -> Output {
    let t = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t.elapsed() > limit {
            // The launcher's whole group (it and the tool it runs, which holds the pipes too);
            // a child not started in a group of its own is killed alone.
            // SAFETY: plain system call on a process group this test started.
            if unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) } != 0 {
                let _ = child.kill();
            }
            let o = child.wait_with_output().unwrap();
            panic!(
                "{what} did not finish in {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run(mut c: Command, limit: Duration, what: &str) -> String {
    let child = c
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let o = wait(child, limit, what);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{what} failed ({}):\n{text}", o.status);
    text
}

/// Whether a TCP port is in LISTEN state (from /proc/net/tcp, without connecting to it).
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

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("gv-emu-ud-{}-{name}", std::process::id()))
}

/// The counters file must show a clean run: no bad doorbell, stale WQE, CQ overrun or error
/// completion, and (for an active side) WQEs executed; `polled`: the program's empty completion
/// polls carried the device at least once (the emulation's poll wrappers are in place).
fn check_counters(path: &Path, what: &str, active: bool, polled: bool) {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{what}: no counters ({e})"));
    let line = text
        .lines()
        .next()
        .unwrap_or_else(|| panic!("{what}: empty counters"));
    let val = |k: &str| -> u64 {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{k}=")).map(|v| v.parse().unwrap()))
            .unwrap_or_else(|| panic!("{what}: no {k} in {line:?}"))
    };
    assert!(
        !active || val("wqes") > 0,
        "{what}: no WQE executed: {line}"
    );
    assert!(
        !polled || val("carried_turns") > 0,
        "{what}: its polls never carried the device: {line}"
    );
    for k in ["bad_doorbells", "stale_wqes", "cq_overruns", "error_cqes"] {
        assert_eq!(val(k), 0, "{what}: sanitizer complaint: {line}");
    }
    let _ = std::fs::remove_file(path);
}

/// A perftest (or ibv_rc_pingpong) server and client on one host, each under its own
/// `gpuverbs emu` with its own address. Returns the client's output.
fn pair(
    tool: &str,
    net: u8,
    tcp_port: u16,
    args: &[&str],
    extra_client: &[&str],
) -> (String, String) {
    // 127.0.140.x .. 127.0.149.x are this file's
    assert!((140..150).contains(&net));
    let (sip, cip) = (format!("127.0.{net}.1"), format!("127.0.{net}.2"));
    let (sc, cc) = (
        tmp(&format!("{tool}-{net}-s")),
        tmp(&format!("{tool}-{net}-c")),
    );
    let port = tcp_port.to_string();
    let mut sargs = vec![tool, "-p", &port];
    sargs.extend_from_slice(args);
    let server = emu(&sip, Some(&sc), &sargs)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !listening(tcp_port) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{tool} server never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut cargs = sargs.clone();
    cargs.extend_from_slice(extra_client);
    cargs.push(&sip);
    let client = run(
        emu(&cip, Some(&cc), &cargs),
        Duration::from_secs(120),
        &format!("{tool} client"),
    );
    let so = wait(server, Duration::from_secs(30), &format!("{tool} server"));
    let stext =
        String::from_utf8_lossy(&so.stdout).to_string() + &String::from_utf8_lossy(&so.stderr);
    assert!(so.status.success(), "{tool} server failed:\n{stext}");
    // the client always posts; a passive server (WRITE, READ targets) may execute nothing
    // a client that busy-polls (no -e) carries its device in its empty polls
    let polled = !args.contains(&"-e") && !extra_client.contains(&"-e");
    check_counters(&cc, &format!("{tool} client"), true, polled);
    check_counters(&sc, &format!("{tool} server"), false, false);
    (client, stext)
}

/// The numeric rows of a perftest table (lines that start with the message size).
fn rows(out: &str) -> Vec<Vec<f64>> {
    out.lines()
        .map(|l| {
            l.split_whitespace()
                .map(|f| f.parse::<f64>())
                .collect::<Result<Vec<_>, _>>()
        })
        .filter_map(|r| r.ok())
        .filter(|r| r.len() >= 4)
        .collect()
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
            assert!(out.contains("200 iters in"), "size {size}:\n{out}");
            assert!(
                out.contains(&format!(
                    "{} bytes in",
                    2 * 200 * size.parse::<usize>().unwrap()
                )),
                "size {size}:\n{out}"
            );
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
