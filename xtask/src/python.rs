//! `cargo xtask python`: builds the Python package (`python/`, PyO3 + maturin, abi3 for
//! CPython 3.11+) and installs it with `pip install ./python` into a virtual environment (`target/py-venv`, on
//! the system's Python with Debian's NumPy, pytest and mypy), runs its tests on the soft NIC
//! and checks its type stubs against the compiled module (mypy's stubtest); first its own
//! workspace's `cargo fmt --check` and clippy.

use anyhow::{bail, Context as _, Result};
use std::process::Command;

fn run(c: &mut Command, what: &str) -> Result<()> {
    let st = c.status().with_context(|| format!("running {what}"))?;
    if !st.success() {
        bail!("{what} failed ({st})");
    }
    Ok(())
}

pub fn run_all() -> Result<()> {
    let root = crate::workspace_root();
    let venv = root.join("target/py-venv");
    let py = venv.join("bin/python");
    if !py.is_file() {
        run(
            Command::new("/usr/bin/python3")
                .args(["-m", "venv", "--system-site-packages"])
                .arg(&venv),
            "python3 -m venv",
        )?;
    }
    if !venv.join("bin/maturin").is_file() {
        run(
            Command::new(&py).args(["-m", "pip", "install", "-q", "maturin>=1.5,<2"]),
            "pip install maturin",
        )?;
    }
    // its own workspace: the product's fmt and clippy steps do not reach it
    run(
        Command::new("cargo")
            .args(["fmt", "--check", "--manifest-path"])
            .arg(root.join("python/Cargo.toml")),
        "cargo fmt --check (python/)",
    )?;
    run(
        Command::new("cargo")
            .args(["clippy", "-q", "--all-targets", "--manifest-path"])
            .arg(root.join("python/Cargo.toml"))
            .args(["--", "-D", "warnings"]),
        "cargo clippy (python/)",
    )?;
    // `pip install ./python`, as a user would (maturin as its build backend, the one in the
    // environment rather than a download, so cargo's build cache in python/target is reused)
    run(
        Command::new(&py)
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--force-reinstall",
                "--no-deps",
                "--no-build-isolation",
            ])
            .arg(root.join("python"))
            // maturin's build backend runs the `maturin` binary it finds on PATH
            .env("PATH", {
                let mut p = std::ffi::OsString::from(venv.join("bin"));
                p.push(":");
                p.push(std::env::var_os("PATH").unwrap_or_default());
                p
            }),
        "pip install ./python",
    )?;
    // the tests import the installed package, not the source tree
    run(
        Command::new(&py)
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
            .arg(root.join("python/tests"))
            .current_dir(std::env::temp_dir()),
        "pytest python/tests",
    )?;
    run(
        Command::new(&py)
            .args(["-m", "mypy.stubtest", "gpuverbs"])
            .current_dir(std::env::temp_dir()),
        "mypy stubtest gpuverbs",
    )?;
    println!("python: pip install ./python built it, tests passed, stubs match");
    Ok(())
}
