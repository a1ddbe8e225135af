//! Compiles every `kernels/src/*.cu` into one CUDA fatbin (sm_80 + sm_90 SASS, compute_90 PTX) that
//! `src/cuda.rs` embeds with `include_bytes!`.
//!
//! nvcc is looked up in this order:
//! 1. `$NVCC` (a path to the nvcc executable);
//! 2. `$CUDA_HOME/bin/nvcc`, then `$CUDA_PATH/bin/nvcc`;
//! 3. `nvcc` on `$PATH`;
//! 4. the project-local venv that `cargo xtask setup-cuda` fills:
//!    `.cuda/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc`;
//! 5. `/usr/local/cuda/bin/nvcc` (the toolkit installer's default prefix).
//!
//! Without nvcc the crate still builds: the embedded fatbin is empty, a `cargo:warning` says how to get
//! the kernels, and the GPU entry points return `CudaError::KernelsNotBuilt`. With
//! `GPUVERBS_REQUIRE_NVCC=1` a missing nvcc fails the build. When nvcc exists, any nvcc failure always
//! fails the build (with nvcc's output): kernels never disappear silently.
//!
//! Outputs (read by `src/cuda.rs`):
//! - `$OUT_DIR/gpuverbs-kernels.fatbin`: the fatbin, or an empty file when the kernels were not built;
//! - env `GPUVERBS_KERNELS_STATUS`: `built` or the reason they were not built;
//! - env `GPUVERBS_NVCC_COMMAND`: the nvcc command line used (empty when not built).

use std::env;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// File name of the fatbin in `OUT_DIR`; `src/cuda.rs` includes it by this name.
const FATBIN_NAME: &str = "gpuverbs-kernels.fatbin";

/// Environment variables that change what this script does.
const WATCHED_ENV: &[&str] = &[
    "NVCC",
    "CUDA_HOME",
    "CUDA_PATH",
    "PATH",
    "GPUVERBS_REQUIRE_NVCC",
    // nvcc itself reads these; a change must recompile the kernels.
    "NVCC_CCBIN",
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
];

/// nvcc flags besides inputs/outputs. sm_80 and sm_90 SASS, plus compute_90 PTX so that newer GPUs can
/// JIT the kernels.
const NVCC_FLAGS: &[&str] = &[
    "-fatbin",
    "-std=c++17",
    "-lineinfo",
    "-gencode",
    "arch=compute_80,code=sm_80",
    "-gencode",
    "arch=compute_90,code=[sm_90,compute_90]",
];

/// Fails the build with `msg` (no backtrace noise: cargo prints the script's stderr).
macro_rules! fail {
    ($($arg:tt)*) => {{
        eprintln!("error: {}", format_args!($($arg)*));
        std::process::exit(1)
    }};
}

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let kernels_src = manifest_dir.join("kernels").join("src");
    let kernels_include = manifest_dir.join("kernels").join("include");
    let fatbin_path = out_dir.join(FATBIN_NAME);

    println!("cargo::rerun-if-changed=build.rs");
    for var in WATCHED_ENV {
        println!("cargo::rerun-if-env-changed={var}");
    }
    // Directories: cargo scans them recursively, so adding, removing or editing any file reruns us.
    println!("cargo::rerun-if-changed={}", kernels_src.display());
    println!("cargo::rerun-if-changed={}", kernels_include.display());
    for file in list_files(&kernels_include, None)
        .into_iter()
        .chain(list_files(&kernels_src, None))
    {
        println!("cargo::rerun-if-changed={}", file.display());
    }

    let require_nvcc = env_flag("GPUVERBS_REQUIRE_NVCC");
    let sources = list_files(&kernels_src, Some("cu"));

    let (status, command) = match find_nvcc(&manifest_dir) {
        Err(searched) => {
            let reason = format!("nvcc not found (searched: {searched})");
            if require_nvcc {
                fail!(
                    "GPUVERBS_REQUIRE_NVCC is set but the CUDA kernels cannot be built: {reason}.\n\
                     Install the pinned CUDA 13.0 compiler with `cargo xtask setup-cuda`, or point \
                     NVCC / CUDA_HOME at an nvcc."
                );
            }
            println!(
                "cargo::warning=gpuverbs: CUDA kernels were NOT built: {reason}. GPU entry points will \
                 return CudaError::KernelsNotBuilt. To build them run `cargo xtask setup-cuda` (or set \
                 NVCC / CUDA_HOME) and rebuild (`touch build.rs` forces the rebuild if nvcc appeared \
                 without a PATH change)."
            );
            // Not watching `.cuda/` here: a missing path makes cargo rebuild gpuverbs (and all its
            // dependents) on every build. `cargo xtask setup-cuda` touches build.rs instead, and a new
            // nvcc on PATH usually comes with a PATH change (watched).
            write_file(&fatbin_path, &[]);
            (reason, String::new())
        }
        Ok(nvcc) => {
            println!("cargo::rerun-if-changed={}", nvcc.display());
            if sources.is_empty() {
                if require_nvcc {
                    fail!(
                        "GPUVERBS_REQUIRE_NVCC is set but {} has no *.cu files",
                        kernels_src.display()
                    );
                }
                write_file(&fatbin_path, &[]);
                ("no kernels/src/*.cu files".to_string(), String::new())
            } else {
                let command = compile(&nvcc, &sources, &kernels_include, &out_dir, &fatbin_path);
                ("built".to_string(), command)
            }
        }
    };

    println!(
        "cargo::rustc-env=GPUVERBS_KERNELS_STATUS={}",
        one_line(&status)
    );
    println!(
        "cargo::rustc-env=GPUVERBS_NVCC_COMMAND={}",
        one_line(&command)
    );
}

/// Compiles `sources` (as one translation unit) into `fatbin_path`. Returns the command line used.
/// Fails the build, showing nvcc's output, when nvcc fails.
fn compile(
    nvcc: &Path,
    sources: &[PathBuf],
    include: &Path,
    out_dir: &Path,
    fatbin_path: &Path,
) -> String {
    // One unity translation unit that includes every kernel source: `nvcc -fatbin` takes one input.
    // Kernel sources therefore share a translation unit: file-local helpers must be `static` or live
    // in a namespace named after the file.
    let mut unity = String::from("// Generated by gpuverbs build.rs: every kernels/src/*.cu.\n");
    for src in sources {
        let _ = writeln!(
            unity,
            "#include \"{}\"",
            c_string_escape(&src.display().to_string())
        );
    }
    let unity_path = out_dir.join("gpuverbs-kernels-unity.cu");
    write_file(&unity_path, unity.as_bytes());

    let tmp_path = out_dir.join(format!("{FATBIN_NAME}.tmp"));
    let _ = fs::remove_file(&tmp_path);

    let mut cmd = Command::new(nvcc);
    cmd.args(NVCC_FLAGS)
        .arg("-I")
        .arg(include)
        .arg("-o")
        .arg(&tmp_path)
        .arg(&unity_path);
    let command_line = format!("{cmd:?}");

    let output = match cmd.output() {
        Ok(output) => output,
        Err(e) => fail!("gpuverbs: failed to run nvcc ({}): {e}", nvcc.display()),
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        fail!(
            "gpuverbs: nvcc failed to compile the CUDA kernels ({}).\ncommand: {command_line}\n\
             --- nvcc stdout ---\n{stdout}\n--- nvcc stderr ---\n{stderr}",
            output.status
        );
    }
    // Surface compiler warnings: they concern our kernels.
    for line in stdout.lines().chain(stderr.lines()) {
        if !line.trim().is_empty() {
            println!("cargo::warning=nvcc: {line}");
        }
    }
    let fatbin = fs::read(&tmp_path).unwrap_or_else(|e| {
        fail!(
            "gpuverbs: nvcc succeeded but {} is unreadable: {e}",
            tmp_path.display()
        )
    });
    if fatbin.len() < 16 || fatbin[..4] != 0xBA55_ED50u32.to_le_bytes() {
        fail!(
            "gpuverbs: nvcc output {} is not a fatbin (size {}, first bytes {:02x?})",
            tmp_path.display(),
            fatbin.len(),
            &fatbin[..fatbin.len().min(8)]
        );
    }
    if let Err(e) = fs::rename(&tmp_path, fatbin_path) {
        fail!(
            "gpuverbs: cannot move the fatbin to {}: {e}",
            fatbin_path.display()
        );
    }
    command_line
}

/// Finds nvcc (see the module docs for the order). `Err` lists what was searched.
fn find_nvcc(manifest_dir: &Path) -> Result<PathBuf, String> {
    let mut searched: Vec<String> = Vec::new();

    if let Some(nvcc) = env::var_os("NVCC").filter(|v| !v.is_empty()) {
        let nvcc = PathBuf::from(nvcc);
        // A bare name (`NVCC=nvcc`) is looked up on PATH.
        let resolved = if nvcc.components().count() == 1 {
            search_path(nvcc.as_os_str())
        } else {
            Some(nvcc.clone())
        };
        match resolved {
            Some(p) if is_executable(&p) => return Ok(p),
            _ => fail!(
                "gpuverbs: NVCC is set to `{}`, which is not an executable file",
                nvcc.display()
            ),
        }
    }
    searched.push("$NVCC (unset)".into());

    for var in ["CUDA_HOME", "CUDA_PATH"] {
        match env::var_os(var).filter(|v| !v.is_empty()) {
            Some(root) => {
                let p = PathBuf::from(root).join("bin").join(nvcc_file_name());
                if is_executable(&p) {
                    return Ok(p);
                }
                searched.push(format!("${var}/bin/nvcc = {} (missing)", p.display()));
            }
            None => searched.push(format!("${var} (unset)")),
        }
    }

    if let Some(p) = search_path(nvcc_file_name().as_ref()) {
        return Ok(p);
    }
    searched.push("PATH".into());

    let venv_lib = manifest_dir.join(".cuda").join("lib");
    if let Some(p) = find_venv_nvcc(&venv_lib) {
        return Ok(p);
    }
    searched.push(format!(
        "{}/python3.*/site-packages/nvidia/cu13/bin/nvcc",
        venv_lib.display()
    ));

    let default = Path::new("/usr/local/cuda/bin").join(nvcc_file_name());
    if is_executable(&default) {
        return Ok(default);
    }
    searched.push(default.display().to_string());

    Err(searched.join(", "))
}

/// `<venv>/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc`, newest Python first.
fn find_venv_nvcc(venv_lib: &Path) -> Option<PathBuf> {
    let mut pythons: Vec<PathBuf> = fs::read_dir(venv_lib)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3."))
        .map(|e| e.path())
        .collect();
    pythons.sort();
    pythons.into_iter().rev().find_map(|py| {
        let p = py
            .join("site-packages")
            .join("nvidia")
            .join("cu13")
            .join("bin")
            .join(nvcc_file_name());
        is_executable(&p).then_some(p)
    })
}

fn search_path(name: &std::ffi::OsStr) -> Option<PathBuf> {
    let path: OsString = env::var_os("PATH")?;
    env::split_paths(&path)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

fn nvcc_file_name() -> &'static str {
    if cfg!(windows) {
        "nvcc.exe"
    } else {
        "nvcc"
    }
}

fn is_executable(p: &Path) -> bool {
    let Ok(meta) = fs::metadata(p) else {
        return false;
    };
    if !meta.is_file() {
        return false;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        meta.permissions().mode() & 0o111 != 0
    }
    #[cfg(not(unix))]
    {
        true
    }
}

/// Files directly or recursively under `dir` (sorted), optionally only those with extension `ext`.
fn list_files(dir: &Path, ext: Option<&str>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.filter_map(|e| e.ok()) {
            let path = entry.path();
            let Ok(ty) = entry.file_type() else { continue };
            if ty.is_dir() {
                // Kernel sources are the `*.cu` files directly in kernels/src; everything else (headers,
                // subdirectories) is only watched.
                if ext.is_none() {
                    stack.push(path);
                }
            } else if ext.is_none_or(|ext| path.extension().is_some_and(|e| e == ext)) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn env_flag(name: &str) -> bool {
    env::var(name).is_ok_and(|v| {
        let v = v.trim().to_ascii_lowercase();
        !(v.is_empty() || v == "0" || v == "false" || v == "no" || v == "off")
    })
}

fn write_file(path: &Path, bytes: &[u8]) {
    // Write only when different, so that an unchanged file keeps its mtime.
    if fs::read(path).is_ok_and(|old| old == bytes) {
        return;
    }
    fs::write(path, bytes).unwrap_or_else(|e| fail!("cannot write {}: {e}", path.display()));
}

fn c_string_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}
