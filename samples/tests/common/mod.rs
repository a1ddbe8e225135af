//! What the samples' command-line tests share: a sample's command with the device choice of
//! the environment cleared, running it, its output as text, a free TCP port, and a bounded
//! wait for a child.
// Each test file uses some of these.
#![allow(dead_code)]

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `bin args`, without GPUVERBS_DEVICE / GPUVERBS_SOFTNIC_ADDR, its output captured.
pub fn command(bin: &str, args: &[&str]) -> Command {
    let mut c = Command::new(bin);
    c.args(args)
        .env_remove("GPUVERBS_DEVICE")
        .env_remove("GPUVERBS_SOFTNIC_ADDR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `bin args` to its end.
pub fn run(bin: &str, args: &[&str]) -> Output {
    command(bin, args).output().expect("run the sample")
}

/// Runs `bin args`, expects success, returns its stdout.
pub fn ok(bin: &str, args: &[&str]) -> String {
    let o = run(bin, args);
    assert!(
        o.status.success(),
        "{bin} {args:?} failed:\n{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    text(&o.stdout)
}

/// A TCP port nothing listens on now.
pub fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string()
}

/// Waits for a child, killing it after `limit` (a hung side must not hang the test); its
/// output and how long it took.
pub fn wait(mut child: Child, limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    while child.try_wait().expect("poll the child").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = start.elapsed();
    (child.wait_with_output().expect("child output"), took)
}
