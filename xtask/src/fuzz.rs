//! `cargo xtask fuzz [--seconds N] [--target T] [--seeds]`: the fuzz targets of `fuzz/`
//! (cargo-fuzz, libFuzzer, AddressSanitizer, on the nightly toolchain), each for `N` seconds
//! from its committed seed corpus (`fuzz/corpus/<target>/`, never written by a run: what a run
//! finds goes to `fuzz/target/corpus-run/<target>/`). One line per target; any finding (a
//! panic, a sanitizer report, an input that runs past 30 s) fails the task and names the
//! reproducer libFuzzer saved. `--seeds` regenerates the seed corpora instead.

use anyhow::{bail, Context as _, Result};
use std::path::Path;
use std::process::Command;

/// Every target, as `fuzz/Cargo.toml` lists them.
pub const TARGETS: &[&str] = &[
    "wire_rx",
    "wqe",
    "packet",
    "endpoint",
    "uverbs",
    "bootstrap",
    "netlink",
    "cm_mad",
    "mcast_rx",
];

/// Seconds an input may take before libFuzzer reports it as a hang.
const HANG_S: u32 = 30;

fn cargo_fuzz(dir: &Path) -> Command {
    let mut c = Command::new("cargo");
    c.args(["+nightly", "fuzz"]).current_dir(dir);
    c
}

pub fn run(seconds: u32, only: Option<String>, seeds: bool) -> Result<()> {
    let dir = crate::workspace_root().join("fuzz");
    let ok = cargo_fuzz(&dir)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        bail!("cargo-fuzz is not installed for the nightly toolchain: cargo install cargo-fuzz --locked");
    }
    if seeds {
        let st = Command::new("cargo")
            .args([
                "+nightly",
                "test",
                "--release",
                "--test",
                "seeds",
                "--",
                "--ignored",
            ])
            .current_dir(&dir)
            .status()?;
        if !st.success() {
            bail!("the seed generator failed");
        }
        return Ok(());
    }
    let targets: Vec<&str> = match &only {
        Some(t) if TARGETS.contains(&t.as_str()) => vec![t.as_str()],
        Some(t) => bail!("no fuzz target {t}; the targets: {}", TARGETS.join(", ")),
        None => TARGETS.to_vec(),
    };
    let st = cargo_fuzz(&dir).args(["build", "-O"]).status()?;
    if !st.success() {
        bail!("building the fuzz targets failed");
    }
    let mut failed = Vec::new();
    for t in targets {
        let found = dir.join("target").join("corpus-run").join(t);
        std::fs::create_dir_all(&found)?;
        let artifacts = dir.join("artifacts").join(t);
        std::fs::create_dir_all(&artifacts)?;
        let o = cargo_fuzz(&dir)
            .args(["run", "-O", t])
            .arg(&found)
            .arg(dir.join("corpus").join(t))
            .arg("--")
            .arg(format!("-max_total_time={seconds}"))
            .arg(format!("-timeout={HANG_S}"))
            .arg("-print_final_stats=1")
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            .output()
            .with_context(|| format!("running fuzz target {t}"))?;
        let log = String::from_utf8_lossy(&o.stderr);
        let stat = |name: &str| {
            log.lines()
                .find_map(|l| l.strip_prefix(&format!("stat::{name}:")))
                .map_or("?".to_string(), |v| v.trim().to_string())
        };
        let cov = log
            .lines()
            .rev()
            .find_map(|l| l.split(" cov: ").nth(1))
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or("?");
        if o.status.success() {
            println!(
                "fuzz {t}: {} runs in {seconds} s, coverage {cov} edges, no finding",
                stat("number_of_executed_units")
            );
        } else {
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            println!(
                "fuzz {t}: FINDING (exit {}), reproducer in {}",
                o.status,
                artifacts.display()
            );
            failed.push(t);
        }
    }
    if !failed.is_empty() {
        bail!("fuzz targets with findings: {}", failed.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_target_of_the_fuzz_crate_is_run() {
        let manifest =
            std::fs::read_to_string(crate::workspace_root().join("fuzz/Cargo.toml")).unwrap();
        let bins: Vec<&str> = manifest
            .split("[[bin]]")
            .skip(1)
            .filter_map(|b| b.lines().find_map(|l| l.trim().strip_prefix("name = ")))
            .map(|n| n.trim_matches('"'))
            .collect();
        assert_eq!(bins, TARGETS);
    }
}
