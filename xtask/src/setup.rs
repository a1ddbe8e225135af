//! `cargo xtask setup`: everything the README's test command needs on a fresh Debian machine —
//! the Debian packages below (installed with apt-get when missing; root needed only then) and
//! the pinned CUDA compiler wheels (`setup-cuda`). `.ci/run` calls it too, so the README and CI
//! cannot drift apart; a test checks that the list names every package the tests ask for.

use std::process::Command;

use anyhow::{bail, Context as _, Result};

/// The Debian packages the build and the tests need, each with what needs it.
pub const PACKAGES: &[(&str, &str)] = &[
    (
        "libibverbs-dev",
        "rdma-core headers: the -sys crate's layout checks and `cargo xtask bindings`",
    ),
    (
        "libibverbs1",
        "libibverbs, loaded at run time by the mlx5 backend",
    ),
    (
        "gcc",
        "cc, which builds the emulation's C probes (emu_cuda.rs, emu_no_sq.rs)",
    ),
    (
        "ibverbs-providers",
        "libmlx5, which drives the emulated devices",
    ),
    (
        "libclang-dev",
        "bindgen, for `cargo xtask bindings --check` and rsmpi's mpi-sys (feature `mpi`)",
    ),
    (
        "ibverbs-utils",
        "ibv_devices, ibv_devinfo, ibv_rc_pingpong (crates/command/tests/emu.rs)",
    ),
    (
        "perftest",
        "ib_write_bw, ib_write_lat, ib_send_bw, ... (emu.rs, perftest_parity.rs)",
    ),
    (
        "rdmacm-utils",
        "rping, ucmatose, udaddy, rdma_server / rdma_client, rstream: librdmacm's programs on \
         the emulated connection manager (emu_cm.rs)",
    ),
    (
        "libfabric-bin",
        "fi_pingpong: libfabric's verbs provider (MSG, verbs;ofi_rxm RDM, DGRAM) on the \
         emulated devices (emu_fabric.rs)",
    ),
    (
        "qperf",
        "qperf -cm1 rc_bw / rc_lat over the emulated connection manager (emu_cm.rs)",
    ),
    (
        "ucx-utils",
        "ucx_info, ucx_perftest: UCX 1.13 on the emulated device (emu_ucx.rs)",
    ),
    (
        "openmpi-bin",
        "mpirun: Open MPI 4.1 over UCX on the emulated device (emu_mpi.rs), and the 2-rank \
         job of the MPI bootstrap (tests/mpi_exchange.rs)",
    ),
    (
        "libopenmpi-dev",
        "mpicc, which builds emu_mpi.rs's ping-pong and which rsmpi (feature `mpi`) builds with",
    ),
    ("python3", "/usr/bin/python3, which runs pyverbs (emu.rs)"),
    ("python3-pyverbs", "pyverbs (emu.rs)"),
    ("rdma-core", "pyverbs' own tests, which emu.rs runs"),
    (
        "python3-scapy",
        "the PRM structures of pyverbs' DEVX tests and the layout check (emu.rs, devx.rs)",
    ),
    (
        "python3-venv",
        "the venv `setup-cuda` installs the CUDA wheels into",
    ),
    (
        "python3-numpy",
        "NumPy arrays registered by the Python package's tests (`cargo xtask python`)",
    ),
    (
        "python3-torch",
        "torch CPU tensors (DLPack) and gloo process groups for the Python package's tests",
    ),
    (
        "python3-pytest",
        "runs the Python package's tests (`cargo xtask python`)",
    ),
    (
        "mypy",
        "stubtest: the Python package's type stubs (`cargo xtask python`)",
    ),
    (
        "valgrind",
        "memcheck on the emulation under libmlx5 (`cargo xtask sanitize`)",
    ),
    (
        "iproute2",
        "`ip`: network namespaces and veth pairs (softnic's wire_netns, wire_capture)",
    ),
];

/// Installs what is missing of [`PACKAGES`], then the CUDA wheels; says what it did.
pub fn setup() -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .map(|(p, _)| *p)
        .filter(|p| !installed(p))
        .collect();
    if missing.is_empty() {
        println!(
            "setup: the {} Debian packages are installed already",
            PACKAGES.len()
        );
    } else {
        println!("setup: installing {}", missing.join(" "));
        for (p, why) in PACKAGES.iter().filter(|(p, _)| missing.contains(p)) {
            println!("  {p}: {why}");
        }
        if !is_root() {
            bail!(
                "installing Debian packages needs root: run `sudo apt-get install -y {}` (or \
                 this command as root), then `cargo xtask setup` again",
                missing.join(" ")
            );
        }
        apt(&["update", "-qq"])?;
        let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
        args.extend(&missing);
        apt(&args)?;
        let still: Vec<&str> = missing.iter().copied().filter(|p| !installed(p)).collect();
        if !still.is_empty() {
            bail!(
                "apt-get ran but these are still missing: {}",
                still.join(" ")
            );
        }
    }
    crate::cuda::setup_cuda()?;
    println!("setup: done; `cargo test --workspace` runs every CPU test");
    Ok(())
}

/// Whether Debian package `p` is installed (`dpkg -s`).
fn installed(p: &str) -> bool {
    Command::new("dpkg")
        .args(["-s", p])
        .output()
        .is_ok_and(|o| {
            o.status.success()
                && String::from_utf8_lossy(&o.stdout).contains("Status: install ok installed")
        })
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn apt(args: &[&str]) -> Result<()> {
    let st = Command::new("apt-get")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("running apt-get")?;
    if !st.success() {
        bail!("apt-get {} failed ({st})", args.join(" "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Debian packages the tests name when a tool is missing: `need("TOOL", "PACKAGE")`
    /// and "install the Debian package PACKAGE".
    fn asked_for(src: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = src;
        while let Some(i) = rest.find("need(\"") {
            rest = &rest[i + 6..];
            let Some(q) = rest.find("\", \"") else { break };
            let pkg: String = rest[q + 4..].chars().take_while(|c| *c != '"').collect();
            out.push(pkg);
        }
        let mut rest = src;
        let key = "install the Debian package ";
        while let Some(i) = rest.find(key) {
            rest = &rest[i + key.len()..];
            let pkg: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || "+-.".contains(*c))
                .collect();
            if !pkg.is_empty() {
                out.push(pkg);
            }
        }
        out
    }

    fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if p.is_dir() && !name.starts_with('.') && name != "target" {
                rust_files(&p, out);
            } else if name.ends_with(".rs") {
                out.push(p);
            }
        }
    }

    #[test]
    fn the_list_covers_every_package_the_tests_ask_for() {
        let root = crate::workspace_root();
        let mut files = Vec::new();
        for d in ["tests", "crates", "samples"] {
            rust_files(&root.join(d), &mut files);
        }
        let mut asked = std::collections::BTreeSet::new();
        for f in &files {
            let src = std::fs::read_to_string(f).unwrap();
            for p in asked_for(&src) {
                asked.insert((p, f.display().to_string()));
            }
        }
        assert!(
            asked.iter().any(|(p, _)| p == "perftest"),
            "the scan found the tests' package names: {asked:?}"
        );
        let listed: Vec<&str> = PACKAGES.iter().map(|(p, _)| *p).collect();
        let missing: Vec<_> = asked
            .iter()
            .filter(|(p, _)| !listed.contains(&p.as_str()))
            .collect();
        assert!(
            missing.is_empty(),
            "asked for by tests, not set up: {missing:?}"
        );
    }

    #[test]
    fn the_scan_reads_both_forms() {
        let src = r#"need("ib_write_bw", "perftest"); panic!("x not found: install the Debian package ibverbs-utils");"#;
        assert_eq!(asked_for(src), ["perftest", "ibverbs-utils"]);
    }
}
