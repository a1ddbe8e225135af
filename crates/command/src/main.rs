//! `gpuverbs`: the project's command-line tool.
//!
//! `gpuverbs emu [--ip A] [--port P] [--devices N] -- COMMAND ARGS...` runs COMMAND with soft
//! NICs that the distro's real libibverbs and libmlx5 see as ConnectX devices (`mlx5_0`, ...):
//! it writes a sysfs tree for them, preloads the uverbs emulation, runs the command, passes
//! its exit status through and removes the tree. `--print-env` prints the variables instead,
//! for scripts.
//!
//! `gpuverbs doctor [--json] [--gpu]` checks this machine (CUDA driver and GPUs, nvidia-peermem,
//! rdma-core and its devices, PCIe distance, ACS, IOMMU, BAR1, memlock, trial registrations)
//! and says what gpuverbs would choose and what runs here; the exit status is the worst
//! check's: 0 ok or not applicable, 1 warn, 3 fail (docs/doctor.md). A machine without a GPU
//! is checked for its CPU paths; `--gpu` says a GPU is wanted, so its absence fails.
//!
//! `gpuverbs plot bw|lat FILE.json... -o OUT.svg [--label NAME]... [--title T] [--field F]`
//! draws the samples' `--json` rows (put_bw: bandwidth, write_lat: latency) against message
//! size, one series per file.

use anyhow::{bail, Context as _};
use clap::{Args, Parser, Subcommand};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use uverbs::config::{EmuConfig, ROCE_PORT};

/// The file name of the preload library.
const PRELOAD: &str = "libgpuverbs_uverbs_preload.so";
/// Overrides where the preload library is looked for.
const ENV_PRELOAD: &str = "GPUVERBS_PRELOAD";

#[derive(Parser)]
#[command(name = "gpuverbs", version, about = "gpuverbs tools")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a program on emulated ConnectX devices (soft NICs under the real rdma-core).
    Emu(Emu),
    /// Check this machine: what gpuverbs will do here, and why.
    Doctor(Doctor),
    /// Plot the samples' `--json` output (bandwidth or latency against message size) as SVG.
    Plot(Plot),
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum PlotKind {
    /// put_bw rows: `bw_average` [MB/s], log scale.
    Bw,
    /// write_lat rows: `t_typical_us` [us].
    Lat,
}

#[derive(Args)]
struct Plot {
    /// What the files hold.
    kind: PlotKind,
    /// The samples' `--json` output files, one series each.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// The SVG to write.
    #[arg(short, long)]
    out: PathBuf,
    /// Names of the series, in file order (default: the file names).
    #[arg(long)]
    label: Vec<String>,
    /// Title (default: the kind).
    #[arg(long)]
    title: Option<String>,
    /// Plot this field of the rows instead (e.g. `bw_peak`, `p99_us`).
    #[arg(long)]
    field: Option<String>,
}

fn plot(a: Plot) -> anyhow::Result<ExitCode> {
    use gpuverbs_command::plot::{plot_files, PlotSpec};
    let mut spec = match a.kind {
        PlotKind::Bw => PlotSpec::bandwidth(a.title.as_deref().unwrap_or("put_bw: bandwidth")),
        PlotKind::Lat => PlotSpec::latency(a.title.as_deref().unwrap_or("write_lat: latency")),
    };
    if let Some(f) = a.field {
        spec.y_label = f.clone();
        spec.field = f;
    }
    let series = plot_files(&spec, &a.files, &a.label, &a.out)?;
    eprintln!(
        "gpuverbs plot: {} ({} series, {} points)",
        a.out.display(),
        series.len(),
        series.iter().map(|s| s.points.len()).sum::<usize>()
    );
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
struct Doctor {
    /// Print `{"checks": [{"name", "status", "detail"}, ...], "runs_here": "..."}` instead of text.
    #[arg(long)]
    json: bool,
    /// You mean to use a GPU (GPU-initiated networking): a missing CUDA driver or GPU is then a
    /// failure. Without it, a machine with no GPU is checked for what runs there (the soft NIC
    /// or an rdma-core device, with the CPU initiator).
    #[arg(long)]
    gpu: bool,
}

fn doctor(a: Doctor) -> anyhow::Result<ExitCode> {
    use std::io::Write as _;
    let report = gpuverbs_command::doctor::run(gpuverbs_command::doctor::Options { gpu: a.gpu });
    let text = if a.json {
        report.to_json() + "\n"
    } else {
        report.to_text()
    };
    std::io::stdout()
        .write_all(text.as_bytes())
        .context("cannot write the report")?;
    Ok(ExitCode::from(report.exit_code()))
}

#[derive(Args)]
struct Emu {
    /// Address of the first device (its RoCE v2 GID is the IPv4-mapped form); device k gets
    /// this address plus k. Give each process of a job its own.
    #[arg(long, default_value = "127.0.0.1")]
    ip: Ipv4Addr,
    /// UDP port the devices bind and expect their peers on.
    #[arg(long, default_value_t = ROCE_PORT)]
    port: u16,
    /// Number of devices (mlx5_0 ...).
    #[arg(long, default_value_t = 1)]
    devices: u32,
    /// Print the environment (shell `export` lines) instead of running a command; the sysfs
    /// tree is written to --sysfs (or a new temporary folder) and left for the caller.
    #[arg(long)]
    print_env: bool,
    /// Where to write the sysfs tree (default: a new temporary folder).
    #[arg(long)]
    sysfs: Option<PathBuf>,
    /// The command and its arguments.
    #[arg(last = true)]
    command: Vec<String>,
}

fn preload_path() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os(ENV_PRELOAD) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{ENV_PRELOAD}={} is not a file", p.display());
        }
        return Ok(p);
    }
    let exe = std::env::current_exe().context("cannot find the gpuverbs executable")?;
    let dir = exe.parent().context("the executable has no folder")?;
    for d in [dir.to_path_buf(), dir.join("../lib")] {
        let p = d.join(PRELOAD);
        if p.is_file() {
            return Ok(p.canonicalize().unwrap_or(p));
        }
    }
    bail!(
        "{PRELOAD} not found next to {} (build the workspace, or set {ENV_PRELOAD})",
        exe.display()
    )
}

fn fresh_dir() -> anyhow::Result<PathBuf> {
    let base = std::env::temp_dir();
    for i in 0..1000u32 {
        let d = base.join(format!("gpuverbs-emu-{}-{i}", std::process::id()));
        match std::fs::create_dir(&d) {
            Ok(()) => return Ok(d),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot create {}", d.display())),
        }
    }
    bail!("no free temporary folder name in {}", base.display())
}

/// The environment of an emulated process.
fn environment(cfg: &EmuConfig, sysfs: &Path, lib: &Path) -> Vec<(String, String)> {
    let mut preload = lib.display().to_string();
    if let Ok(old) = std::env::var("LD_PRELOAD") {
        if !old.is_empty() {
            preload = format!("{preload} {old}");
        }
    }
    let mut env = vec![
        ("LD_PRELOAD".to_string(), preload),
        ("SYSFS_PATH".to_string(), sysfs.display().to_string()),
    ];
    env.extend(cfg.to_env().into_iter().map(|(k, v)| (k.to_string(), v)));
    env
}

fn emu(a: Emu) -> anyhow::Result<ExitCode> {
    let cfg = EmuConfig {
        ip: a.ip,
        port: a.port,
        devices: a.devices,
        static_uars: uverbs::config::static_uars_from_env()?,
    };
    cfg.validate()?;
    let lib = preload_path()?;
    if a.print_env {
        if !a.command.is_empty() {
            bail!("--print-env takes no command");
        }
        let dir = match a.sysfs {
            Some(d) => d,
            None => fresh_dir()?,
        };
        uverbs::sysfs::write_tree(&dir, &cfg)
            .with_context(|| format!("cannot write the sysfs tree in {}", dir.display()))?;
        for (k, v) in environment(&cfg, &dir, &lib) {
            println!("export {k}='{v}'");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let Some((prog, args)) = a.command.split_first() else {
        bail!("no command given: gpuverbs emu [OPTIONS] -- COMMAND [ARGS...]");
    };
    let (dir, owned) = match a.sysfs {
        Some(d) => (d, false),
        None => (fresh_dir()?, true),
    };
    let run = || -> anyhow::Result<ExitCode> {
        uverbs::sysfs::write_tree(&dir, &cfg)
            .with_context(|| format!("cannot write the sysfs tree in {}", dir.display()))?;
        catch_signals();
        let mut child = std::process::Command::new(prog)
            .args(args)
            .envs(environment(&cfg, &dir, &lib))
            .spawn()
            .with_context(|| format!("cannot run {prog}"))?;
        forward_signals_to(child.id());
        let status = child
            .wait()
            .with_context(|| format!("waiting for {prog}"))?;
        use std::os::unix::process::ExitStatusExt as _;
        let code = match (status.code(), status.signal()) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => 1,
        };
        Ok(ExitCode::from(code.clamp(0, 255) as u8))
    };
    let r = run();
    if owned {
        let _ = std::fs::remove_dir_all(&dir);
    }
    r
}

/// The process `gpuverbs emu` runs (0: none yet), for [`forward_signal`].
static CHILD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
/// A signal that came before the process was started (0: none), sent on once it is.
static PENDING: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// From now on SIGTERM, SIGHUP, SIGINT and SIGQUIT are caught ([`forward_signal`]): installed
/// before the command starts, so that one sent in between (the command may already have shown
/// itself to whoever sends it) is held and sent on by [`forward_signals_to`] instead of
/// killing this process and leaving the command running.
fn catch_signals() {
    for sig in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT, libc::SIGQUIT] {
        // SAFETY: a zeroed sigaction with an SA_SIGINFO handler of the matching signature;
        // the handler only loads and stores atomics and calls kill(2), all async-signal-safe.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = forward_signal as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// From now on SIGTERM, SIGHUP, SIGINT and SIGQUIT sent to this process by another one
/// (`kill`, `timeout`) go on to `pid`, so that stopping `gpuverbs emu` stops what it runs, as
/// stopping a program started without it would; one held since [`catch_signals`] goes now. A
/// signal the kernel sends once the command runs (a terminal's ^C, which reaches the whole
/// process group, the child included) is not sent twice: this process then just waits for the
/// child.
fn forward_signals_to(pid: u32) {
    use std::sync::atomic::Ordering;
    CHILD.store(pid as i32, Ordering::SeqCst);
    let held = PENDING.swap(0, Ordering::SeqCst);
    if held > 0 {
        // SAFETY: kill(2) on the child this process started.
        unsafe { libc::kill(pid as i32, held) };
    }
}

extern "C" fn forward_signal(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    use std::sync::atomic::Ordering;
    let pid = CHILD.load(Ordering::SeqCst);
    if pid <= 0 {
        // no command yet (whoever sent it, it did not reach one): held for it
        PENDING.store(sig, Ordering::SeqCst);
        return;
    }
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let from_a_process = !info.is_null() && unsafe { (*info).si_code } <= 0;
    if from_a_process {
        // SAFETY: kill(2) on the child's pid, async-signal-safe.
        unsafe { libc::kill(pid, sig) };
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Emu(a) => emu(a),
        Cmd::Doctor(a) => doctor(a),
        Cmd::Plot(a) => plot(a),
    };
    match r {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpuverbs: {e:#}");
            ExitCode::from(2)
        }
    }
}
