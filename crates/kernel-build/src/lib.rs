//! Build-script helper: compiles CUDA kernels that use the gpuverbs device API into one fatbin.
//!
//! gpuverbs itself compiles `kernels/src/*.cu` with this crate, and so can any crate whose kernels
//! include `<gpuverbs/qp.cuh>`. In the user crate's `Cargo.toml`:
//!
//! ```toml
//! [build-dependencies]
//! # a path into the gpuverbs tree, or the same git dependency as gpuverbs
//! gpuverbs-kernel-build = { path = "../gpuverbs/crates/kernel-build" }
//! ```
//!
//! and in its `build.rs`'s `main`:
//!
//! ```no_run
//! println!("cargo::rerun-if-changed=build.rs");
//! let built = gpuverbs_kernel_build::Kernels::new()
//!     .sources_from_dir("kernels")
//!     .include_gpuverbs()
//!     .out_name("mykernels")
//!     .build();
//! match built {
//!     Ok(Some(_fatbin)) => {} // $OUT_DIR/mykernels.fatbin
//!     Ok(None) => {}          // no nvcc: an empty $OUT_DIR/mykernels.fatbin, and a warning
//!     Err(e) => {
//!         eprintln!("error: {e}");
//!         std::process::exit(1);
//!     }
//! }
//! ```
//!
//! The crate then embeds the fatbin with
//! `include_bytes!(concat!(env!("OUT_DIR"), "/mykernels.fatbin"))` and loads it with the CUDA
//! driver (`cuModuleLoadData`). The file always exists after [`Kernels::build`] returns `Ok`; it is
//! empty when the kernels were not built.
//!
//! # The gpuverbs headers
//!
//! [`Kernels::include_gpuverbs`] adds gpuverbs' `kernels/include` to the include path. This crate
//! does not carry a copy of the headers: it finds them next to itself, at
//! `<this crate>/../../kernels/include`, i.e. in the gpuverbs source tree it was built from. That
//! works for a path or git dependency on gpuverbs (both check out the whole tree); a copy of this
//! crate alone (e.g. from a registry) has no headers, and `build` then fails with
//! [`BuildError::GpuverbsHeadersMissing`].
//!
//! # Finding nvcc
//!
//! In this order (see [`NvccSearch`]):
//! 1. `$NVCC` (a path to the nvcc executable, or a bare name looked up on `$PATH`); when set it
//!    must name an executable, or the build fails;
//! 2. `$CUDA_HOME/bin/nvcc`, then `$CUDA_PATH/bin/nvcc`;
//! 3. `nvcc` on `$PATH`;
//! 4. a project-local venv filled by gpuverbs' `cargo xtask setup-cuda`:
//!    `.cuda/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc` (newest Python first). By default
//!    the `.cuda` directories of the building crate's directory and its ancestors (nearest first),
//!    then the gpuverbs tree's `.cuda`; [`Kernels::cuda_venv`] replaces that list;
//! 5. `/usr/local/cuda/bin/nvcc` (the toolkit installer's default prefix).
//!
//! Without nvcc the build still succeeds: [`Kernels::build`] writes an empty fatbin, prints a
//! `cargo:warning` and returns `Ok(None)`. With `GPUVERBS_REQUIRE_NVCC=1` (or
//! [`Kernels::require_nvcc`]) a missing nvcc is an error. When nvcc exists, any nvcc failure is an
//! error carrying nvcc's output: kernels never disappear silently. nvcc's warnings are passed on
//! as `cargo:warning` lines.
//!
//! # Compilation
//!
//! All sources become one translation unit: a generated `$OUT_DIR/<name>-unity.cu` includes each
//! of them (`nvcc -fatbin` takes one input). File-local helpers must therefore be `static` (or
//! `GPUVERBS_DEVICE`) or live in a namespace named after their file. nvcc runs with [`NVCC_FLAGS`]:
//! C++17, line info, sm_80 and sm_90 SASS plus compute_90 PTX (which newer GPUs JIT).
//!
//! # Rebuilds
//!
//! `build` prints `cargo::rerun-if-changed` for every source, every file under the source and
//! include directories (and the directories themselves, so new files count), and the nvcc found;
//! and `cargo::rerun-if-env-changed` for [`WATCHED_ENV`]. Printing any `rerun-if-changed` turns
//! off cargo's default of rerunning on any change in the package, so a build script should also
//! print `cargo::rerun-if-changed=build.rs`. The `.cuda` venv is not watched (watching a missing
//! path reruns the script on every build): after `cargo xtask setup-cuda`, touch the build script
//! (gpuverbs' own is touched by that command).

#![warn(missing_docs)]

use std::env;
use std::ffi::{OsStr, OsString};
use std::fmt::{self, Write as _};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

/// nvcc flags besides inputs, outputs and include directories: a fatbin of sm_80 and sm_90 SASS,
/// plus compute_90 PTX so that newer GPUs can JIT the kernels.
pub const NVCC_FLAGS: &[&str] = &[
    "-fatbin",
    "-std=c++17",
    "-lineinfo",
    "-gencode",
    "arch=compute_80,code=sm_80",
    "-gencode",
    "arch=compute_90,code=[sm_90,compute_90]",
];

/// The environment variable that turns a missing nvcc into a build error.
pub const REQUIRE_NVCC_ENV: &str = "GPUVERBS_REQUIRE_NVCC";

/// Environment variables that change what a build does (`cargo::rerun-if-env-changed`).
pub const WATCHED_ENV: &[&str] = &[
    "NVCC",
    "CUDA_HOME",
    "CUDA_PATH",
    "PATH",
    REQUIRE_NVCC_ENV,
    // nvcc itself reads these; a change must recompile the kernels.
    "NVCC_CCBIN",
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
];

/// First four bytes of a fatbin (`0xBA55ED50`, little-endian).
const FATBIN_MAGIC: u32 = 0xBA55_ED50;

/// Root of the gpuverbs source tree this crate was built from (`<this crate>/../..`).
pub fn gpuverbs_root() -> PathBuf {
    let me = Path::new(env!("CARGO_MANIFEST_DIR"));
    // `crates/kernel-build` -> the tree root; `parent()` twice keeps the path free of `..`.
    me.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| me.join("..").join(".."))
}

/// gpuverbs' public CUDA include directory (`<gpuverbs tree>/kernels/include`), which holds
/// `gpuverbs/gpuverbs.cuh`, `gpuverbs/qp.cuh` (with its layer headers) and `gpuverbs/desc.h`. It
/// exists only when this crate comes with the gpuverbs source tree (path or git dependency).
pub fn gpuverbs_include_dir() -> PathBuf {
    gpuverbs_root().join("kernels").join("include")
}

/// Whether `GPUVERBS_REQUIRE_NVCC` is set to something other than empty, `0`, `false`, `no`,
/// `off`.
pub fn require_nvcc_from_env() -> bool {
    env_flag(REQUIRE_NVCC_ENV)
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why a kernel build failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum BuildError {
    /// A variable cargo sets for build scripts is missing (and no override was given).
    Env {
        /// `OUT_DIR` or `CARGO_MANIFEST_DIR`.
        var: &'static str,
    },
    /// `NVCC` (or [`Kernels::nvcc`]) names something that is not an executable file.
    NvccInvalid {
        /// What it was set to.
        value: PathBuf,
    },
    /// nvcc was not found and a build without kernels is not allowed.
    NvccRequired {
        /// What was searched, in order.
        searched: String,
    },
    /// There is nothing to compile.
    NoSources {
        /// The directories searched for `*.cu` files.
        dirs: Vec<PathBuf>,
    },
    /// A source given with [`Kernels::source`] does not exist.
    SourceMissing {
        /// The path.
        path: PathBuf,
    },
    /// [`Kernels::include_gpuverbs`] was asked for, but the gpuverbs source tree is not next to
    /// this crate.
    GpuverbsHeadersMissing {
        /// Where the headers were expected.
        path: PathBuf,
    },
    /// The output name is empty or contains a path separator.
    InvalidOutName {
        /// The name.
        name: String,
    },
    /// nvcc could not be started.
    NvccSpawn {
        /// The nvcc.
        nvcc: PathBuf,
        /// Why.
        error: io::Error,
    },
    /// nvcc failed.
    NvccFailed {
        /// The output name being built.
        name: String,
        /// nvcc's exit status.
        status: ExitStatus,
        /// The command line.
        command: String,
        /// nvcc's stdout.
        stdout: String,
        /// nvcc's stderr.
        stderr: String,
    },
    /// nvcc succeeded but its output is not a fatbin.
    NotAFatbin {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: usize,
        /// Its first bytes.
        head: Vec<u8>,
    },
    /// A file operation failed.
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why.
        error: io::Error,
    },
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Env { var } => write!(
                f,
                "{var} is not set: gpuverbs-kernel-build runs in a cargo build script (or give \
                 Kernels::out_dir / Kernels::manifest_dir)"
            ),
            Self::NvccInvalid { value } => write!(
                f,
                "NVCC is set to `{}`, which is not an executable file",
                value.display()
            ),
            Self::NvccRequired { searched } => write!(
                f,
                "{REQUIRE_NVCC_ENV} is set but the CUDA kernels cannot be built: nvcc not found \
                 (searched: {searched}).\nInstall the pinned CUDA 13.0 compiler with `cargo xtask \
                 setup-cuda` (in the gpuverbs tree), or point NVCC / CUDA_HOME at an nvcc."
            ),
            Self::NoSources { dirs } => {
                write!(f, "no CUDA sources to compile (no *.cu files in")?;
                if dirs.is_empty() {
                    write!(f, " any directory: none was given")?;
                }
                for d in dirs {
                    write!(f, " {}", d.display())?;
                }
                write!(f, ")")
            }
            Self::SourceMissing { path } => {
                write!(f, "CUDA source {} does not exist", path.display())
            }
            Self::GpuverbsHeadersMissing { path } => write!(
                f,
                "the gpuverbs device headers are not at {}: include_gpuverbs() needs the gpuverbs \
                 source tree next to gpuverbs-kernel-build (a path or git dependency)",
                path.display()
            ),
            Self::InvalidOutName { name } => write!(
                f,
                "invalid output name `{name}`: it must be non-empty and contain no path separator"
            ),
            Self::NvccSpawn { nvcc, error } => {
                write!(f, "failed to run nvcc ({}): {error}", nvcc.display())
            }
            Self::NvccFailed {
                name,
                status,
                command,
                stdout,
                stderr,
            } => write!(
                f,
                "nvcc failed to compile the CUDA kernels `{name}` ({status}).\ncommand: \
                 {command}\n--- nvcc stdout ---\n{stdout}\n--- nvcc stderr ---\n{stderr}"
            ),
            Self::NotAFatbin { path, len, head } => write!(
                f,
                "nvcc output {} is not a fatbin (size {len}, first bytes {head:02x?})",
                path.display()
            ),
            Self::Io { what, path, error } => {
                write!(f, "cannot {what} {}: {error}", path.display())
            }
        }
    }
}

impl std::error::Error for BuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::NvccSpawn { error, .. } | Self::Io { error, .. } => Some(error),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Finding nvcc
// ---------------------------------------------------------------------------------------------

/// Which rule found nvcc.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NvccOrigin {
    /// [`Kernels::nvcc`].
    Explicit,
    /// `$NVCC`.
    NvccEnv,
    /// `$CUDA_HOME/bin`.
    CudaHome,
    /// `$CUDA_PATH/bin`.
    CudaPath,
    /// `$PATH`.
    Path,
    /// The `.cuda` venv at this path.
    Venv(PathBuf),
    /// A toolkit prefix such as `/usr/local/cuda`.
    System(PathBuf),
}

/// An nvcc executable and how it was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nvcc {
    /// The executable.
    pub path: PathBuf,
    /// The rule that found it.
    pub origin: NvccOrigin,
}

/// Where to look for nvcc, in order. [`NvccSearch::from_env`] fills it from the environment;
/// tests (or unusual build scripts) can fill it by hand.
#[derive(Clone, Debug, Default)]
pub struct NvccSearch {
    /// `$NVCC`: a path, or a bare name looked up on `path`. Empty counts as unset.
    pub nvcc: Option<OsString>,
    /// `$CUDA_HOME`.
    pub cuda_home: Option<OsString>,
    /// `$CUDA_PATH`.
    pub cuda_path: Option<OsString>,
    /// `$PATH`.
    pub path: Option<OsString>,
    /// `.cuda` venv directories (each holding `lib/python3.*/site-packages/nvidia/cu13/bin/nvcc`).
    pub venvs: Vec<PathBuf>,
    /// Toolkit prefixes (each holding `bin/nvcc`).
    pub prefixes: Vec<PathBuf>,
}

impl NvccSearch {
    /// The environment's `NVCC`, `CUDA_HOME`, `CUDA_PATH`, `PATH`, the given venvs, and
    /// `/usr/local/cuda`.
    pub fn from_env(venvs: Vec<PathBuf>) -> Self {
        Self {
            nvcc: env::var_os("NVCC"),
            cuda_home: env::var_os("CUDA_HOME"),
            cuda_path: env::var_os("CUDA_PATH"),
            path: env::var_os("PATH"),
            venvs,
            prefixes: vec![PathBuf::from("/usr/local/cuda")],
        }
    }

    /// Finds nvcc. `Ok(Err(searched))` when there is none (`searched` lists what was looked at);
    /// `Err` when `NVCC` is set to something that is not an executable.
    pub fn find(&self) -> Result<Result<Nvcc, String>, BuildError> {
        let found = |path: PathBuf, origin: NvccOrigin| Ok(Ok(Nvcc { path, origin }));
        let mut searched: Vec<String> = Vec::new();

        if let Some(nvcc) = self.nvcc.as_ref().filter(|v| !v.is_empty()) {
            let nvcc = PathBuf::from(nvcc);
            // A bare name (`NVCC=nvcc`) is looked up on PATH.
            let resolved = if nvcc.components().count() == 1 {
                search_path(self.path.as_deref(), nvcc.as_os_str())
            } else {
                Some(nvcc.clone())
            };
            return match resolved {
                Some(p) if is_executable(&p) => found(p, NvccOrigin::NvccEnv),
                _ => Err(BuildError::NvccInvalid { value: nvcc }),
            };
        }
        searched.push("$NVCC (unset)".into());

        for (var, value, origin) in [
            ("CUDA_HOME", &self.cuda_home, NvccOrigin::CudaHome),
            ("CUDA_PATH", &self.cuda_path, NvccOrigin::CudaPath),
        ] {
            match value.as_ref().filter(|v| !v.is_empty()) {
                Some(root) => {
                    let p = PathBuf::from(root).join("bin").join(nvcc_file_name());
                    if is_executable(&p) {
                        return found(p, origin);
                    }
                    searched.push(format!("${var}/bin/nvcc = {} (missing)", p.display()));
                }
                None => searched.push(format!("${var} (unset)")),
            }
        }

        if let Some(p) = search_path(self.path.as_deref(), nvcc_file_name().as_ref()) {
            return found(p, NvccOrigin::Path);
        }
        searched.push("PATH".into());

        for venv in &self.venvs {
            if let Some(p) = find_venv_nvcc(venv) {
                return found(p, NvccOrigin::Venv(venv.clone()));
            }
            searched.push(format!(
                "{}/python3.*/site-packages/nvidia/cu13/bin/nvcc",
                venv.join("lib").display()
            ));
        }

        for prefix in &self.prefixes {
            let p = prefix.join("bin").join(nvcc_file_name());
            if is_executable(&p) {
                return found(p, NvccOrigin::System(prefix.clone()));
            }
            searched.push(p.display().to_string());
        }

        Ok(Err(searched.join(", ")))
    }
}

/// `<venv>/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc` (the layout of the pinned CUDA
/// wheels that `cargo xtask setup-cuda` installs), newest Python first.
pub fn find_venv_nvcc(venv: &Path) -> Option<PathBuf> {
    let mut pythons: Vec<(u32, PathBuf)> = fs::read_dir(venv.join("lib"))
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name();
            let minor = name.to_str()?.strip_prefix("python3.")?;
            // Unparsable minors (`python3.x`) sort first, i.e. are tried last.
            Some((minor.parse().unwrap_or(0), e.path()))
        })
        .collect();
    // Numeric order: python3.12 is newer than python3.9.
    pythons.sort();
    pythons.into_iter().rev().find_map(|(_, py)| {
        let p = py
            .join("site-packages")
            .join("nvidia")
            .join("cu13")
            .join("bin")
            .join(nvcc_file_name());
        is_executable(&p).then_some(p)
    })
}

fn search_path(path: Option<&OsStr>, name: &OsStr) -> Option<PathBuf> {
    env::split_paths(path?)
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

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

/// What [`Kernels::compile`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The fatbin was written.
    Built {
        /// `$OUT_DIR/<name>.fatbin`.
        fatbin: PathBuf,
        /// The nvcc command line run (`{:?}` of the command).
        command: String,
        /// The nvcc used.
        nvcc: Nvcc,
    },
    /// No nvcc: an empty fatbin was written.
    NvccNotFound {
        /// What was searched, in order.
        searched: String,
    },
    /// nvcc exists but there were no sources: an empty fatbin was written.
    NoSources {
        /// The source directories searched.
        dirs: Vec<PathBuf>,
    },
}

/// A set of CUDA sources compiled into one fatbin (see the crate docs).
#[derive(Clone, Debug)]
pub struct Kernels {
    sources: Vec<PathBuf>,
    source_dirs: Vec<PathBuf>,
    includes: Vec<PathBuf>,
    include_gpuverbs: bool,
    out_name: String,
    out_dir: Option<PathBuf>,
    manifest_dir: Option<PathBuf>,
    nvcc: Option<PathBuf>,
    search: Option<NvccSearch>,
    nvcc_args: Vec<OsString>,
    venvs: Option<Vec<PathBuf>>,
    require_nvcc: Option<bool>,
    cargo_directives: bool,
}

impl Default for Kernels {
    fn default() -> Self {
        Self::new()
    }
}

impl Kernels {
    /// No sources yet; output name `kernels` (`$OUT_DIR/kernels.fatbin`).
    pub fn new() -> Self {
        Self {
            sources: Vec::new(),
            source_dirs: Vec::new(),
            includes: Vec::new(),
            include_gpuverbs: false,
            out_name: "kernels".into(),
            out_dir: None,
            manifest_dir: None,
            nvcc: None,
            search: None,
            nvcc_args: Vec::new(),
            venvs: None,
            require_nvcc: None,
            cargo_directives: true,
        }
    }

    /// Adds one source file. Relative paths are relative to the crate (`CARGO_MANIFEST_DIR`).
    pub fn source(mut self, path: impl AsRef<Path>) -> Self {
        self.sources.push(path.as_ref().to_path_buf());
        self
    }

    /// Adds several source files.
    pub fn sources<P: AsRef<Path>>(mut self, paths: impl IntoIterator<Item = P>) -> Self {
        self.sources
            .extend(paths.into_iter().map(|p| p.as_ref().to_path_buf()));
        self
    }

    /// Adds every `*.cu` file directly in `dir` (sorted by name; subdirectories are not searched
    /// for sources, only watched). The whole directory is watched, so adding a file rebuilds.
    pub fn sources_from_dir(mut self, dir: impl AsRef<Path>) -> Self {
        self.source_dirs.push(dir.as_ref().to_path_buf());
        self
    }

    /// Adds an include directory (`-I`). Every file under it is watched.
    pub fn include(mut self, dir: impl AsRef<Path>) -> Self {
        self.includes.push(dir.as_ref().to_path_buf());
        self
    }

    /// Adds gpuverbs' `kernels/include` ([`gpuverbs_include_dir`]), so that kernels can
    /// `#include <gpuverbs/qp.cuh>`. Needs the gpuverbs source tree (see the crate docs).
    pub fn include_gpuverbs(mut self) -> Self {
        self.include_gpuverbs = true;
        self
    }

    /// Names the output: `$OUT_DIR/<name>.fatbin` (and `$OUT_DIR/<name>-unity.cu`).
    pub fn out_name(mut self, name: impl Into<String>) -> Self {
        self.out_name = name.into();
        self
    }

    /// Writes the outputs here instead of `$OUT_DIR`.
    pub fn out_dir(mut self, dir: impl AsRef<Path>) -> Self {
        self.out_dir = Some(dir.as_ref().to_path_buf());
        self
    }

    /// Resolves relative paths (and the default venv search) from here instead of
    /// `$CARGO_MANIFEST_DIR`.
    pub fn manifest_dir(mut self, dir: impl AsRef<Path>) -> Self {
        self.manifest_dir = Some(dir.as_ref().to_path_buf());
        self
    }

    /// Uses this nvcc instead of searching (it must be an executable file).
    pub fn nvcc(mut self, path: impl AsRef<Path>) -> Self {
        self.nvcc = Some(path.as_ref().to_path_buf());
        self
    }

    /// Searches for nvcc exactly as `search` says, instead of [`NvccSearch::from_env`] with the
    /// venvs of [`Kernels::cuda_venv`] (or the default list).
    pub fn nvcc_search(mut self, search: NvccSearch) -> Self {
        self.search = Some(search);
        self
    }

    /// Passes an extra argument to nvcc (after [`NVCC_FLAGS`], before the include directories),
    /// e.g. `-DMY_OPTION=1`.
    pub fn nvcc_arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.nvcc_args.push(arg.as_ref().to_os_string());
        self
    }

    /// Searches this `.cuda` venv directory (instead of the default list; call again to add
    /// more). Relative paths are relative to the crate.
    pub fn cuda_venv(mut self, venv: impl AsRef<Path>) -> Self {
        self.venvs
            .get_or_insert_with(Vec::new)
            .push(venv.as_ref().to_path_buf());
        self
    }

    /// Whether a missing nvcc is an error for [`Kernels::build`] (default:
    /// `GPUVERBS_REQUIRE_NVCC`).
    pub fn require_nvcc(mut self, require: bool) -> Self {
        self.require_nvcc = Some(require);
        self
    }

    /// Whether to print `cargo::` directives (rerun-if-changed, rerun-if-env-changed, warnings).
    /// On by default; off for use outside build scripts.
    pub fn cargo_directives(mut self, on: bool) -> Self {
        self.cargo_directives = on;
        self
    }

    /// Where the fatbin goes: `<out dir>/<name>.fatbin`.
    pub fn fatbin_path(&self) -> Result<PathBuf, BuildError> {
        self.check_out_name()?;
        Ok(self.resolved_out_dir()?.join(self.fatbin_file_name()))
    }

    /// Compiles, or explains why not ([`Outcome`]); a missing nvcc is not an error here (nor is
    /// `GPUVERBS_REQUIRE_NVCC` consulted). Whatever the outcome, the fatbin file exists afterwards
    /// (empty unless built).
    pub fn compile(&self) -> Result<Outcome, BuildError> {
        self.check_out_name()?;
        let base = self.resolved_manifest_dir()?;
        let out_dir = self.resolved_out_dir()?;
        let fatbin_path = out_dir.join(self.fatbin_file_name());

        let mut sources = Vec::new();
        for s in &self.sources {
            let p = absolute(&base, s);
            if !p.is_file() {
                return Err(BuildError::SourceMissing { path: p });
            }
            sources.push(p);
        }
        let source_dirs: Vec<PathBuf> = self
            .source_dirs
            .iter()
            .map(|d| absolute(&base, d))
            .collect();
        for d in &source_dirs {
            for p in list_files(d, Some("cu")) {
                if !sources.contains(&p) {
                    sources.push(p);
                }
            }
        }
        let mut includes: Vec<PathBuf> = self.includes.iter().map(|d| absolute(&base, d)).collect();
        if self.include_gpuverbs {
            let dir = gpuverbs_include_dir();
            if !dir.join("gpuverbs").join("qp.cuh").is_file() {
                return Err(BuildError::GpuverbsHeadersMissing { path: dir });
            }
            if !includes.contains(&dir) {
                includes.push(dir);
            }
        }

        if self.cargo_directives {
            for var in WATCHED_ENV {
                println!("cargo::rerun-if-env-changed={var}");
            }
            // Directories: cargo scans them recursively, so adding, removing or editing any file
            // reruns the build script.
            for dir in source_dirs.iter().chain(&includes) {
                println!("cargo::rerun-if-changed={}", dir.display());
            }
            let mut watched: Vec<PathBuf> = Vec::new();
            let files = includes
                .iter()
                .chain(&source_dirs)
                .flat_map(|dir| list_files(dir, None))
                .chain(sources.iter().cloned());
            for file in files {
                if !watched.contains(&file) {
                    println!("cargo::rerun-if-changed={}", file.display());
                    watched.push(file);
                }
            }
        }

        let nvcc = match &self.nvcc {
            Some(p) => {
                let p = absolute(&base, p);
                if !is_executable(&p) {
                    return Err(BuildError::NvccInvalid { value: p });
                }
                Nvcc {
                    path: p,
                    origin: NvccOrigin::Explicit,
                }
            }
            None => match self
                .search
                .clone()
                .unwrap_or_else(|| NvccSearch::from_env(self.resolved_venvs(&base)))
                .find()?
            {
                Ok(nvcc) => nvcc,
                Err(searched) => {
                    write_file(&fatbin_path, &[])?;
                    return Ok(Outcome::NvccNotFound { searched });
                }
            },
        };
        if self.cargo_directives {
            println!("cargo::rerun-if-changed={}", nvcc.path.display());
        }
        if sources.is_empty() {
            write_file(&fatbin_path, &[])?;
            return Ok(Outcome::NoSources { dirs: source_dirs });
        }

        let command = self.run_nvcc(&nvcc.path, &sources, &includes, &out_dir, &fatbin_path)?;
        Ok(Outcome::Built {
            fatbin: fatbin_path,
            command,
            nvcc,
        })
    }

    /// Compiles (see [`Kernels::compile`]) with the policy a user crate wants:
    /// - `Ok(Some(fatbin))`: built;
    /// - `Ok(None)`: no nvcc and none required: an empty fatbin, and a `cargo:warning` saying so;
    /// - `Err(NvccRequired)`: no nvcc but `GPUVERBS_REQUIRE_NVCC` (or [`Kernels::require_nvcc`]);
    /// - `Err(NoSources)`: nvcc found but nothing to compile;
    /// - any other error: nvcc or I/O failed.
    pub fn build(&self) -> Result<Option<PathBuf>, BuildError> {
        match self.compile()? {
            Outcome::Built { fatbin, .. } => Ok(Some(fatbin)),
            Outcome::NoSources { dirs } => Err(BuildError::NoSources { dirs }),
            Outcome::NvccNotFound { searched } => {
                let require = self.require_nvcc.unwrap_or_else(require_nvcc_from_env);
                if require {
                    return Err(BuildError::NvccRequired { searched });
                }
                if self.cargo_directives {
                    println!(
                        "cargo::warning=gpuverbs-kernel-build: CUDA kernels `{}` were NOT built: \
                         nvcc not found (searched: {}). The fatbin is empty. Run `cargo xtask \
                         setup-cuda` in the gpuverbs tree (or set NVCC / CUDA_HOME) and rebuild \
                         (touch build.rs to force the rebuild if nvcc appeared without a PATH \
                         change).",
                        self.out_name,
                        one_line(&searched)
                    );
                }
                Ok(None)
            }
        }
    }

    /// Writes the unity file and runs nvcc on it; returns the command line.
    fn run_nvcc(
        &self,
        nvcc: &Path,
        sources: &[PathBuf],
        includes: &[PathBuf],
        out_dir: &Path,
        fatbin_path: &Path,
    ) -> Result<String, BuildError> {
        let unity_path = out_dir.join(format!("{}-unity.cu", self.out_name));
        write_file(
            &unity_path,
            unity_source(&self.out_name, sources).as_bytes(),
        )?;

        let tmp_path = out_dir.join(format!("{}.tmp", self.fatbin_file_name()));
        let _ = fs::remove_file(&tmp_path);

        let mut cmd = Command::new(nvcc);
        cmd.args(NVCC_FLAGS).args(&self.nvcc_args);
        for inc in includes {
            cmd.arg("-I").arg(inc);
        }
        cmd.arg("-o").arg(&tmp_path).arg(&unity_path);
        let command = format!("{cmd:?}");

        let output = cmd.output().map_err(|error| BuildError::NvccSpawn {
            nvcc: nvcc.to_path_buf(),
            error,
        })?;
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        if !output.status.success() {
            return Err(BuildError::NvccFailed {
                name: self.out_name.clone(),
                status: output.status,
                command,
                stdout,
                stderr,
            });
        }
        // Surface compiler warnings: they concern the kernels being built.
        if self.cargo_directives {
            for line in stdout.lines().chain(stderr.lines()) {
                if !line.trim().is_empty() {
                    println!("cargo::warning=nvcc: {line}");
                }
            }
        }
        let fatbin = fs::read(&tmp_path).map_err(|error| BuildError::Io {
            what: "read nvcc's output",
            path: tmp_path.clone(),
            error,
        })?;
        if fatbin.len() < 16 || fatbin[..4] != FATBIN_MAGIC.to_le_bytes() {
            return Err(BuildError::NotAFatbin {
                len: fatbin.len(),
                head: fatbin[..fatbin.len().min(8)].to_vec(),
                path: tmp_path,
            });
        }
        fs::rename(&tmp_path, fatbin_path).map_err(|error| BuildError::Io {
            what: "move the fatbin to",
            path: fatbin_path.to_path_buf(),
            error,
        })?;
        Ok(command)
    }

    fn fatbin_file_name(&self) -> String {
        format!("{}.fatbin", self.out_name)
    }

    fn check_out_name(&self) -> Result<(), BuildError> {
        let n = &self.out_name;
        if n.is_empty() || n.contains(['/', '\\']) || n == "." || n == ".." {
            return Err(BuildError::InvalidOutName { name: n.clone() });
        }
        Ok(())
    }

    fn resolved_out_dir(&self) -> Result<PathBuf, BuildError> {
        match &self.out_dir {
            Some(d) => Ok(d.clone()),
            None => env::var_os("OUT_DIR")
                .map(PathBuf::from)
                .ok_or(BuildError::Env { var: "OUT_DIR" }),
        }
    }

    fn resolved_manifest_dir(&self) -> Result<PathBuf, BuildError> {
        match &self.manifest_dir {
            Some(d) => Ok(d.clone()),
            None => env::var_os("CARGO_MANIFEST_DIR")
                .map(PathBuf::from)
                .ok_or(BuildError::Env {
                    var: "CARGO_MANIFEST_DIR",
                }),
        }
    }

    /// The venvs to search: the explicit list, or the `.cuda` directories that exist in the
    /// crate's directory and its ancestors (nearest first), then the gpuverbs tree's `.cuda`.
    fn resolved_venvs(&self, base: &Path) -> Vec<PathBuf> {
        if let Some(v) = &self.venvs {
            return v.iter().map(|p| absolute(base, p)).collect();
        }
        default_venvs(base, &gpuverbs_root())
    }
}

/// `.cuda` directories that exist in `start` and its ancestors (nearest first), then
/// `<gpuverbs_root>/.cuda` (whether it exists or not: that is where `cargo xtask setup-cuda`
/// puts it).
fn default_venvs(start: &Path, gpuverbs_root: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = start
        .ancestors()
        .map(|d| d.join(".cuda"))
        .filter(|d| d.is_dir())
        .collect();
    let tree = gpuverbs_root.join(".cuda");
    if !out.contains(&tree) {
        out.push(tree);
    }
    out
}

/// The generated translation unit: one `#include` of each source, in order.
pub fn unity_source(name: &str, sources: &[PathBuf]) -> String {
    let mut unity = format!(
        "// Generated by gpuverbs-kernel-build for `{}`: every kernel source, one translation \
         unit.\n",
        one_line(name)
    );
    for src in sources {
        let _ = writeln!(
            unity,
            "#include \"{}\"",
            c_string_escape(&src.display().to_string())
        );
    }
    unity
}

fn absolute(base: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// Files directly or recursively under `dir` (sorted), optionally only those with extension `ext`
/// (then only directly in `dir`).
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
                // Sources are the `*.cu` files directly in the directory; everything else
                // (headers, subdirectories) is only watched.
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

/// Writes only when different, so that an unchanged file keeps its mtime.
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), BuildError> {
    if fs::read(path).is_ok_and(|old| old == bytes) {
        return Ok(());
    }
    fs::write(path, bytes).map_err(|error| BuildError::Io {
        what: "write",
        path: path.to_path_buf(),
        error,
    })
}

fn c_string_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// `s` with line breaks replaced by spaces (for `cargo::` directives, which are one line each).
pub fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

#[cfg(test)]
mod tests;
