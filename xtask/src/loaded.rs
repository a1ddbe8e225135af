//! `cargo xtask loaded`: the timing-sensitive suites again, on a machine made busy on purpose.
//!
//! A use-after-free that needs an engine thread to be descheduled at the wrong moment, or a
//! wire test whose timers assume a thread runs within some milliseconds, passes on an idle
//! machine and fails on a user's busy one (issue 42 was found that way). This job starts one
//! busy loop per core, then runs, beside them:
//! - the AddressSanitizer subset of `cargo xtask sanitize` (prm, the soft NIC incl. its
//!   teardown tests, the host API, the emulation);
//! - the soft NIC's wire suites and teardown tests (plain build).
//!
//! The busy loops stop when the job ends, whether it passed or not. CI runs it after
//! `cargo xtask sanitize`.

use anyhow::{bail, Context as _, Result};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// The soft NIC's suites that depend on timing: every wire suite and the teardown tests.
const TIMED: &[&str] = &[
    "wire_ops",
    "wire_errors",
    "wire_forgery",
    "wire_malformed",
    "wire_security",
    "wire_recovery",
    "wire_bulk",
    "wire_capture",
    "wire_pcap",
    "wire_process",
    "wire_netns",
    "devmem_wire",
    "teardown",
    "engines",
    "carried",
];

/// Busy loops, one per core, until dropped.
struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    fn start() -> Self {
        let n = std::thread::available_parallelism().map_or(2, |n| n.get());
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                })
            })
            .collect();
        println!("loaded: {n} busy loops started (one per core)");
        Self { stop, threads }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

pub fn run() -> Result<()> {
    let root = crate::workspace_root();
    // build first, unloaded: the job is about running the tests, not compiling them
    let mut build = Command::new("cargo");
    build
        .args(["test", "--no-run", "-q", "-p", "gpuverbs-softnic"])
        .args(TIMED.iter().map(|t| format!("--test={t}")))
        .current_dir(&root);
    if !build.status().context("cargo test --no-run")?.success() {
        bail!("building the soft NIC's timed suites failed");
    }
    crate::sanitize::asan_build(&root)?;
    let _load = Load::start();
    let t = Instant::now();
    crate::sanitize::asan(&root, false)?;
    let mut c = Command::new("cargo");
    c.args(["test", "-q", "-p", "gpuverbs-softnic"])
        .args(TIMED.iter().map(|t| format!("--test={t}")))
        .current_dir(&root);
    let st = c.status().context("cargo test -p gpuverbs-softnic")?;
    if !st.success() {
        bail!("the soft NIC's timed suites failed under load ({st})");
    }
    println!(
        "loaded: AddressSanitizer subset and {} timed suites passed beside busy loops ({:.0?})",
        TIMED.len(),
        t.elapsed()
    );
    Ok(())
}
