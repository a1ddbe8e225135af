//! Open MPI (Debian 12's 4.1.4, packages openmpi-bin and libopenmpi-dev) with its UCX PML on
//! the emulated device (issue 30): mpi_pingpong.c, built with mpicc, runs as two ranks under
//! one `mpirun`, each rank under its own `gpuverbs emu` with its own address (127.0.160.x ..
//! 127.0.169.x, used by no other test) and its own counters file. Rank 0 sends a patterned
//! buffer, rank 1 checks every byte, adds one and sends it back, rank 0 checks (8 B .. 1 MiB,
//! 50 round trips each). mpirun must exit 0 with rank 0's "pingpong ok", both ranks' UCX must
//! report the lane it was given (rc_mlx5, then rc_verbs: a fall-back to another transport fails
//! the test), and both soft NICs' counters must show WQEs executed and no sanitizer complaint.
//!
//! The UCX variables go into each rank's own `env` in its MPMD part: Open MPI 4.1.4 applies
//! `-x` to the first app context only, so rank 1 would run with UCX's defaults.
//!
//! Needs Debian's openmpi-bin and libopenmpi-dev (CI installs them); a missing tool fails the
//! test with the package to install.

mod emu_util;
use emu_util::*;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// mpi_pingpong.c built with mpicc into a folder of this test's; the binary.
fn build(dir: &Path) -> PathBuf {
    need("mpicc", "libopenmpi-dev");
    std::fs::create_dir_all(dir).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mpi_pingpong.c");
    let bin = dir.join("mpi_pingpong");
    let mut c = Command::new("mpicc");
    c.args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(&src);
    run(c, Duration::from_secs(120), "mpicc mpi_pingpong.c");
    bin
}

/// Rank 0 and rank 1 of mpi_pingpong under `mpirun` (UCX PML, UCX limited to `tls` on mlx5_0
/// port 1), rank N under `gpuverbs emu --ip 127.0.net.(N+1)`; both ranks' output, from
/// mpirun's `--tag-output` lines.
fn pingpong(tls: &str, net: u8) -> (String, String) {
    need("mpirun", "openmpi-bin");
    // 127.0.160.x .. 127.0.169.x are this file's
    assert!((160..170).contains(&net));
    let dir = tmp(&format!("mpi-{net}"));
    let bin = build(&dir);
    let counters: Vec<PathBuf> = (0..2).map(|r| dir.join(format!("counters-{r}"))).collect();
    let mut c = Command::new("mpirun");
    c.env("GPUVERBS_PRELOAD", preload())
        .current_dir(&dir)
        .args(["--allow-run-as-root", "--oversubscribe", "--tag-output"])
        .args(["--mca", "pml", "ucx", "--mca", "btl", "self"])
        .args(["-x", "GPUVERBS_PRELOAD"]);
    for (rank, file) in counters.iter().enumerate() {
        if rank > 0 {
            c.arg(":");
        }
        c.args(["-np", "1", "env"])
            .arg(format!("GPUVERBS_EMU_COUNTERS={}", file.display()))
            .args([
                "UCX_NET_DEVICES=mlx5_0:1",
                &format!("UCX_TLS={tls}"),
                "UCX_LOG_LEVEL=info",
                // UCX logs to stdout by default, which rank 1 may not flush before it exits
                "UCX_LOG_FILE=stderr",
            ])
            .arg(GPUVERBS)
            .args(["emu", "--ip", &format!("127.0.{net}.{}", rank + 1), "--"])
            .arg(&bin);
    }
    let out = run(c, Duration::from_secs(180), &format!("mpirun over {tls}"));
    let rank = |r: u8| -> String {
        let tag = format!("[1,{r}]<");
        out.lines()
            .filter(|l| l.starts_with(&tag))
            .map(|l| format!("{l}\n"))
            .collect()
    };
    let (r0, r1) = (rank(0), rank(1));
    assert!(
        r0.lines().any(|l| l.contains(":pingpong ok")),
        "no \"pingpong ok\" from rank 0:\n{out}"
    );
    for (r, file) in counters.iter().enumerate() {
        check_counters(file, &format!("{tls}: rank {r}"), true, false);
    }
    let _ = std::fs::remove_dir_all(&dir);
    (r0, r1)
}

#[test]
fn mpi_pingpong_over_rc_mlx5() {
    let _g = serial();
    let (r0, r1) = pingpong("rc_mlx5,ud_mlx5,self", 160);
    // `used` names rank 0 the client, rank 1 the server
    used("tag(rc_mlx5/mlx5_0:1)", &r0, &r1);
}

#[test]
fn mpi_pingpong_over_rc_verbs() {
    let _g = serial();
    let (r0, r1) = pingpong("rc_verbs,ud_verbs,self", 161);
    used("tag(rc_verbs/mlx5_0:1)", &r0, &r1);
}
