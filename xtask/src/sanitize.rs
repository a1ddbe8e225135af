//! `cargo xtask sanitize [--full]`: the unsafe code under a memory checker.
//!
//! - **AddressSanitizer** (nightly `-Zsanitizer=address`, LeakSanitizer included, target folder
//!   `target/asan`): the unit and integration tests of `prm`, the soft NIC, the host API and
//!   the emulation (`uverbs`). By default a bounded subset (what CI runs); `--full` every test
//!   of those four crates.
//! - **valgrind memcheck** on the emulation as a real program uses it: the distro's
//!   `ibv_rc_pingpong` and perftest's `ib_{write,read,atomic,send}_bw`, server and client each
//!   under `gpuverbs emu` and valgrind, libmlx5 driving the emulated device; any memcheck
//!   error fails (`--error-exitcode`), apart from the ones `xtask/valgrind.supp` names (in the
//!   tools' own code, not ours).
//!
//! ThreadSanitizer is not run: it needs a standard library built with it (`-Zbuild-std`,
//! which needs the `rust-src` component this image's nightly lacks and cannot fetch); forced
//! with `-Cunsafe-allow-abi-mismatch=sanitizer` it reports races inside the uninstrumented
//! standard library (the test harness's channels) and cannot see fence-ordered device memory
//! (docs/reliability.md).

use anyhow::{bail, Context as _, Result};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The CI subset: (package, test targets; `--lib` always).
const SUBSET: &[(&str, &[&str])] = &[
    ("gpuverbs-prm", &["--tests"]),
    (
        "gpuverbs-softnic",
        &[
            "--test=ops",
            "--test=rings",
            "--test=errors",
            "--test=srq",
            "--test=windows",
            "--test=indirect",
            "--test=engines",
            "--test=wire_ops",
            "--test=wire_errors",
            "--test=wire_forgery",
            "--test=wire_malformed",
            "--test=wire_security",
            "--test=teardown",
        ],
    ),
    (
        "gpuverbs",
        &["--test=host_api", "--test=posters", "--test=proxy"],
    ),
    ("gpuverbs-uverbs", &["--tests"]),
];

/// The tools memcheck runs under the emulation (the client adds the server's address), each
/// with its arguments ([`tool_args`]).
const TOOLS: &[&str] = &[
    "ibv_rc_pingpong",
    "ib_write_bw",
    "ib_read_bw",
    "ib_atomic_bw",
    "ib_send_bw",
];

/// `tool`'s command line: a few iterations on the emulated `mlx5_0`, GID 0. valgrind runs a
/// process's threads one at a time, many times slower: perftest's QPs get a 4 s ACK timeout
/// (`-u 20`) so that a slowed peer is not taken for a lost one.
fn tool_args(tool: &str) -> Vec<&str> {
    let mut v = vec![tool, "-d", "mlx5_0"];
    if tool == "ibv_rc_pingpong" {
        v.extend(["-g", "0", "-n", "50"]);
    } else {
        v.extend(["-x", "0", "-n", "200", "-u", "20"]);
    }
    v
}

pub fn run(full: bool) -> Result<()> {
    let root = crate::workspace_root();
    asan(&root, full)?;
    memcheck(&root)?;
    Ok(())
}

/// The ASan test command of `pkg` (its CI subset `tests`, or every test with `full`).
fn asan_cmd(root: &Path, pkg: &str, tests: &[&str], full: bool) -> Result<Command> {
    let mut c = Command::new("cargo");
    c.args(["+nightly", "test", "--target", host_target()?.as_str()])
        .args(["-p", pkg, "--lib"])
        .current_dir(root)
        .env("RUSTFLAGS", "-Zsanitizer=address")
        .env("CARGO_TARGET_DIR", root.join("target/asan"))
        // a test that asks for an impossible allocation expects the allocator's null,
        // as glibc's malloc gives it, not ASan's abort
        .env("ASAN_OPTIONS", "allocator_may_return_null=1:detect_leaks=1");
    if full {
        c.arg("--tests");
    } else {
        c.args(tests);
    }
    Ok(c)
}

/// Builds the ASan subset's test binaries without running them.
pub(crate) fn asan_build(root: &Path) -> Result<()> {
    for (pkg, tests) in SUBSET {
        let st = asan_cmd(root, pkg, tests, false)?
            .arg("--no-run")
            .status()?;
        if !st.success() {
            bail!("building {pkg}'s tests under AddressSanitizer failed ({st})");
        }
    }
    Ok(())
}

pub(crate) fn asan(root: &Path, full: bool) -> Result<()> {
    for (pkg, tests) in SUBSET {
        let mut c = asan_cmd(root, pkg, tests, full)?;
        let t = Instant::now();
        let o = c
            .output()
            .with_context(|| format!("cargo +nightly test -p {pkg}"))?;
        let out = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        let passed: u64 = out
            .lines()
            .filter_map(|l| l.strip_prefix("test result: ok. "))
            .filter_map(|l| l.split(' ').next()?.parse::<u64>().ok())
            .sum();
        if !o.status.success() || out.contains("ERROR: AddressSanitizer") {
            eprintln!("{out}");
            bail!("AddressSanitizer: {pkg} failed ({})", o.status);
        }
        println!(
            "asan {pkg}: {passed} tests passed, no report ({:.0?})",
            t.elapsed()
        );
    }
    Ok(())
}

/// The host's target triple (a sanitizer build needs `--target`, so that build scripts and
/// proc macros are built without it).
fn host_target() -> Result<String> {
    let o = Command::new("rustc").arg("-vV").output()?;
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .context("rustc -vV names no host")
}

fn memcheck(root: &Path) -> Result<()> {
    if Command::new("valgrind").arg("--version").output().is_err() {
        bail!("valgrind is not installed (cargo xtask setup installs it)");
    }
    let st = Command::new("cargo")
        .args([
            "build",
            "-q",
            "-p",
            "gpuverbs-command",
            "-p",
            "gpuverbs-uverbs-preload",
        ])
        .current_dir(root)
        .status()?;
    if !st.success() {
        bail!("building gpuverbs and its preload library failed");
    }
    let bin = root.join("target/debug");
    let supp = root.join("xtask/valgrind.supp");
    let under = |ip: &str, tool: &[&str], server: Option<&str>| -> Result<Child> {
        let mut c = Command::new(bin.join("gpuverbs"));
        c.env(
            "GPUVERBS_PRELOAD",
            bin.join("libgpuverbs_uverbs_preload.so"),
        )
        .args([
            "emu",
            "--ip",
            ip,
            "--",
            "valgrind",
            "-q",
            "--error-exitcode=99",
        ])
        .arg(format!("--suppressions={}", supp.display()))
        .args(tool)
        .args(server)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        Ok(c.spawn()?)
    };
    for &name in TOOLS {
        let tool = &tool_args(name)[..];
        let t = Instant::now();
        let server = under("127.0.95.1", tool, None)?;
        // the server listens on 18515 (both tools' default) before the client connects
        let deadline = Instant::now() + Duration::from_secs(60);
        while !listening(18515) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let client = under("127.0.95.2", tool, Some("127.0.0.1"))?;
        let c = client.wait_with_output()?;
        let s = server.wait_with_output()?;
        for (who, o) in [("server", &s), ("client", &c)] {
            if !o.status.success() {
                eprintln!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                );
                bail!(
                    "memcheck: {} {who} under gpuverbs emu failed ({}: 99 is a memcheck error)",
                    tool[0],
                    o.status
                );
            }
        }
        println!(
            "memcheck {}: server and client clean ({:.0?})",
            tool[0],
            t.elapsed()
        );
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tools_get_their_arguments() {
        assert_eq!(
            tool_args("ib_read_bw"),
            [
                "ib_read_bw",
                "-d",
                "mlx5_0",
                "-x",
                "0",
                "-n",
                "200",
                "-u",
                "20"
            ]
        );
        assert_eq!(
            tool_args("ibv_rc_pingpong"),
            ["ibv_rc_pingpong", "-d", "mlx5_0", "-g", "0", "-n", "50"]
        );
    }
}
