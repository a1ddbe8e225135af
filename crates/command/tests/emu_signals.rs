//! Stopping `gpuverbs emu` stops what it runs: SIGTERM, SIGHUP, SIGINT and SIGQUIT sent to the
//! launcher by another process (`kill`, `timeout`) reach the program, whose exit status the
//! launcher then reports, and no program outlives its launcher.

mod emu_util;
use emu_util::*;

use std::process::Stdio;
use std::time::{Duration, Instant};

/// Whether process `pid` still exists (a zombie counts as gone: it runs nothing).
fn alive(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    !stat.is_empty() && !stat.contains(") Z ")
}

#[test]
fn a_signal_to_the_launcher_reaches_the_program() {
    for (sig, name) in [(libc::SIGTERM, "TERM"), (libc::SIGINT, "INT")] {
        let dir = tmp(&format!("signals-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        let pidfile = dir.join("pid");
        let script = format!("echo $$ > {}; exec sleep 60", pidfile.display());
        let mut c = emu("127.0.191.1", None, &["sh", "-c", &script]);
        let mut launcher = c.stdout(Stdio::null()).spawn().unwrap();
        let t = Instant::now();
        let pid = loop {
            if let Some(p) = std::fs::read_to_string(&pidfile)
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok())
            {
                break p;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the program never started"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        // SAFETY: kill(2) on the launcher this test started.
        assert_eq!(unsafe { libc::kill(launcher.id() as i32, sig) }, 0);
        let status = loop {
            if let Some(s) = launcher.try_wait().unwrap() {
                break s;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "SIG{name}: the launcher did not end"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(status.code(), Some(128 + sig), "SIG{name}: {status:?}");
        assert!(!alive(pid), "SIG{name}: the program outlived its launcher");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
