//! What the two-process tests under `gpuverbs emu` share: the `gpuverbs` binary, the preload
//! library and the samples built beside it, one pair of processes at a time, a free TCP port,
//! and a bounded wait for a child.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

pub const GPUVERBS: &str = env!("CARGO_BIN_EXE_gpuverbs");

/// How long one side may run before the test kills it (a hung side must not hang CI).
pub const LIMIT: Duration = Duration::from_secs(240);

/// One pair of processes at a time: the machine has two cores.
pub fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|e| e.into_inner())
}

/// `cargo build` of more artifacts into the target folder of this test's binaries.
fn build(what: &[&str]) {
    let dir = Path::new(GPUVERBS).parent().unwrap().to_path_buf();
    let mut c = Command::new(option_env!("CARGO").unwrap_or("cargo"));
    c.args(["build", "-q"]).args(what);
    if dir.file_name().is_some_and(|n| n == "release") {
        c.arg("--release");
    }
    if let Some(target) = dir.parent() {
        c.env("CARGO_TARGET_DIR", target);
    }
    assert!(c.status().unwrap().success(), "cargo build {what:?} failed");
}

/// The perftest-style samples the tests run.
pub const SAMPLES: [&str; 8] = [
    "put_bw",
    "write_lat",
    "read_bw",
    "send_bw",
    "atomic_bw",
    "read_lat",
    "send_lat",
    "atomic_lat",
];

/// The preload library and the perftest-style samples ([`SAMPLES`]), built once per test
/// process; the samples' folder.
pub fn artifacts() -> &'static (PathBuf, PathBuf) {
    static A: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    A.get_or_init(|| {
        build(&["-p", "gpuverbs-uverbs-preload"]);
        let mut samples = vec!["-p", "gpuverbs-samples"];
        for b in SAMPLES {
            samples.extend(["--bin", b]);
        }
        build(&samples);
        let dir = Path::new(GPUVERBS).parent().unwrap().to_path_buf();
        let lib = dir.join("libgpuverbs_uverbs_preload.so");
        assert!(lib.is_file(), "{} missing after the build", lib.display());
        (lib, dir)
    })
}

/// A TCP port nobody listens on now.
pub fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string()
}

/// The child's output, killing it first if it runs past [`LIMIT`]: its whole process group
/// (children are started in a group of their own, [`in_group`]: `gpuverbs emu` and the tool
/// it runs, which holds the output pipes too), so a hung side fails the test instead of
/// hanging it.
pub fn wait(mut child: Child) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("poll the child").is_none() {
        if start.elapsed() > LIMIT {
            // SAFETY: plain system call on the process group this test started.
            if unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) } != 0 {
                let _ = child.kill();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("child output")
}

/// Starts `c` in a process group of its own (what [`wait`] kills on a timeout).
pub fn in_group(c: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    c.process_group(0)
}
