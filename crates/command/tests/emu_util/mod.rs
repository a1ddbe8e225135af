//! What the tests that run third-party programs under `gpuverbs emu` share (emu.rs, emu_ud.rs,
//! emu_ucx.rs, emu_mpi.rs, emu_paths.rs): the preload library, a tool's Debian package, a
//! `gpuverbs emu` command per address, bounded waits that kill a hung process group, the soft
//! NICs' counters check, a perftest-style server/client pair, perftest's table rows and the lane
//! UCX reports. `serial` and `GPUVERBS` are common/mod.rs's (included here, so a test file
//! declares `mod emu_util;` only, not `mod common;` as well: that would be a second lock).

#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

#[path = "../common/mod.rs"]
mod common;

#[allow(unused_imports)] // not every test file takes the lock
pub use common::{serial, GPUVERBS};

/// Builds the preload library next to the gpuverbs binary (`cargo test` builds binaries but
/// not cdylibs of other packages), once per test process.
pub fn preload() -> PathBuf {
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

pub fn need(tool: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        || Path::new(tool).is_file();
    assert!(
        found,
        "{tool} not found: install the Debian package {package}"
    );
}

/// Whether the emulated processes a test starts offer static UAR pages only (the mode of older
/// kernels) instead of dynamic UAR allocation; changed only under [`serial`].
pub static STATIC_UARS: AtomicBool = AtomicBool::new(false);

pub fn emu(ip: &str, counters: Option<&Path>, args: &[&str]) -> Command {
    let mut c = Command::new(GPUVERBS);
    c.env("GPUVERBS_PRELOAD", preload());
    if STATIC_UARS.load(Ordering::Relaxed) {
        c.env("GPUVERBS_EMU_UARS", "static");
    }
    if let Some(f) = counters {
        c.env("GPUVERBS_EMU_COUNTERS", f);
    }
    c.args(["emu", "--ip", ip, "--"]).args(args);
    // a group of its own: a timeout kills the launcher and the tool it started together
    c.process_group(0);
    c
}

pub fn wait(mut child: Child, limit: Duration, what: &str) -> Output {
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

pub fn run(mut c: Command, limit: Duration, what: &str) -> String {
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
pub fn listening(port: u16) -> bool {
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

pub fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("gv-emu-{}-{name}", std::process::id()))
}

/// The counters file must show a clean run: no bad doorbell, stale WQE, CQ overrun or error
/// completion, and (for an active side) WQEs executed; `polled`: the program's empty completion
/// polls offered to carry the device at least once (the emulation's poll wrappers are in place;
/// whether a turn found work depends on who got there first: on a loaded machine the device's
/// own threads may take everything).
pub fn check_counters(path: &Path, what: &str, active: bool, polled: bool) {
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
        !polled || val("carry_calls") > 0,
        "{what}: its polls never offered to carry the device: {line}"
    );
    for k in ["bad_doorbells", "stale_wqes", "cq_overruns", "error_cqes"] {
        assert_eq!(val(k), 0, "{what}: sanitizer complaint: {line}");
    }
    let _ = std::fs::remove_file(path);
}

/// The counters file must show a clean run: no bad doorbell, stale WQE or CQ overrun, and no
/// error completion but flushes (a connection's end moves its QP to ERR, which flushes the
/// receives still posted, as on a ConnectX); `active`: WQEs were executed.
pub fn check_counters_flush_ok(path: &Path, what: &str, active: bool) {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{what}: no counters ({e})"));
    let line = text.lines().next().unwrap_or_default();
    let val = |k: &str| -> u64 {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(&format!("{k}=")).map(|v| v.parse().unwrap()))
            .unwrap_or_else(|| panic!("{what}: no {k} in {line:?}"))
    };
    assert!(
        !active || val("wqes") > 0,
        "{what}: no WQE executed: {line}"
    );
    for k in ["bad_doorbells", "stale_wqes", "cq_overruns"] {
        assert_eq!(val(k), 0, "{what}: sanitizer complaint: {line}");
    }
    let errors = line
        .split("errors=[")
        .nth(1)
        .unwrap_or("")
        .trim_end_matches(']');
    assert!(
        errors
            .split(',')
            .filter(|e| !e.is_empty())
            .all(|e| e.starts_with("WrFlush:")),
        "{what}: error completions other than flushes: {line}"
    );
    let _ = std::fs::remove_file(path);
}

/// A perftest (or ibv_rc_pingpong) server and client on one host, each under its own
/// `gpuverbs emu` with its own address. Returns the client's output.
pub fn pair(
    tool: &str,
    net: u8,
    tcp_port: u16,
    args: &[&str],
    extra_client: &[&str],
) -> (String, String) {
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
pub fn rows(out: &str) -> Vec<Vec<f64>> {
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

/// Both sides' endpoint used `lane` (as UCX's info log names it: `tag(rc_mlx5/mlx5_0:1)`).
pub fn used(lane: &str, client: &str, server: &str) {
    for (side, out) in [("client", client), ("server", server)] {
        assert!(
            out.lines()
                .any(|l| l.contains("ep_cfg[") && l.contains(lane)),
            "{side} did not use {lane}:\n{out}"
        );
    }
}

/// Checks an rdma-core pingpong's output: `iters` iterations of `size` bytes each way.
pub fn check_pingpong(out: &str, iters: usize, size: &str) {
    assert!(
        out.contains(&format!("{iters} iters in")),
        "size {size}:\n{out}"
    );
    let bytes = 2 * iters * size.parse::<usize>().unwrap();
    assert!(
        out.contains(&format!("{bytes} bytes in")),
        "size {size}:\n{out}"
    );
    assert!(!out.contains("mismatch"), "size {size}:\n{out}");
}
