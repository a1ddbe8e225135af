//! Where a process sits in a multi-process job ([`JobConfig`]), as a launcher's environment
//! describes it, and the bootstrap's defaults.

use super::error::{BootstrapError, Result};
use std::fmt;
use std::time::Duration;

/// Default largest frame payload: 1 MiB.
pub const DEFAULT_MAX_FRAME: usize = 1 << 20;

/// Default timeout of connect/accept and of every frame read or write: 30 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Environment variable (milliseconds) that overrides [`DEFAULT_TIMEOUT`] in
/// [`JobConfig::from_env`].
pub const TIMEOUT_ENV: &str = "GPUVERBS_BOOTSTRAP_TIMEOUT_MS";

// ---------------------------------------------------------------------------------------------
// Job configuration
// ---------------------------------------------------------------------------------------------

/// Where a process sits in a multi-process job, as a launcher describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobConfig {
    /// This process's rank, `0..world_size`.
    pub rank: u32,
    /// Number of processes.
    pub world_size: u32,
    /// Host name or address of rank 0 (rank 0 listens on it).
    pub master_addr: String,
    /// Port rank 0 listens on.
    pub master_port: u16,
    /// Connect/accept and per-frame timeout.
    pub timeout: Duration,
    /// Largest frame payload.
    pub max_frame: usize,
}

/// (rank variable, size variable) of the launchers, in the order they are tried.
const LAUNCHER_VARS: [(&str, &str); 3] = [
    ("RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
];

impl JobConfig {
    /// Read the process environment; see [`JobConfig::from_lookup`].
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|var| std::env::var_os(var).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Build from variables given by `lookup` (the environment, or a map in tests):
    ///
    /// - rank and size from the first pair that has its rank variable set: `RANK`/`WORLD_SIZE`
    ///   (torchrun), `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE` (Open MPI),
    ///   `PMI_RANK`/`PMI_SIZE` (MPICH, Intel MPI, Slurm PMI);
    /// - `MASTER_ADDR` and `MASTER_PORT` (1..65535), required when the size is above 1;
    /// - optional [`TIMEOUT_ENV`] in milliseconds (default [`DEFAULT_TIMEOUT`]).
    ///
    /// Missing or invalid values are errors naming the variable.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |var: &'static str| lookup(var).map(|v| (var, v));
        let (rank_var, size_var, rank_val) = match LAUNCHER_VARS
            .iter()
            .find_map(|&(r, s)| get(r).map(|(_, v)| (r, s, v)))
        {
            Some(found) => found,
            None => {
                // A size without a rank names the missing rank variable of that launcher.
                let var = LAUNCHER_VARS
                    .iter()
                    .find(|(_, s)| lookup(s).is_some())
                    .map_or("RANK", |&(r, _)| r);
                return Err(BootstrapError::MissingEnv {
                    var,
                    hint: " (nor OMPI_COMM_WORLD_RANK or PMI_RANK): start the job with torchrun \
                           or mpirun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT",
                });
            }
        };
        let size_val = lookup(size_var).ok_or(BootstrapError::MissingEnv {
            var: size_var,
            hint: "",
        })?;
        let rank: u32 = parse_var(rank_var, &rank_val)?;
        let world_size: u32 = parse_var(size_var, &size_val)?;
        if world_size == 0 {
            return Err(invalid(
                size_var,
                &size_val,
                "the world size must be at least 1",
            ));
        }
        if rank >= world_size {
            return Err(invalid(
                rank_var,
                &rank_val,
                format!("rank must be below {size_var}={world_size}"),
            ));
        }
        let (master_addr, master_port) = if world_size > 1 {
            let addr = lookup("MASTER_ADDR").ok_or(BootstrapError::MissingEnv {
                var: "MASTER_ADDR",
                hint: " (host name or address of rank 0)",
            })?;
            let addr = addr.trim().to_string();
            if addr.is_empty() {
                return Err(invalid("MASTER_ADDR", &addr, "empty"));
            }
            let port_val = lookup("MASTER_PORT").ok_or(BootstrapError::MissingEnv {
                var: "MASTER_PORT",
                hint: " (TCP port rank 0 listens on)",
            })?;
            let port: u16 = parse_var("MASTER_PORT", &port_val)?;
            if port == 0 {
                return Err(invalid(
                    "MASTER_PORT",
                    &port_val,
                    "port 0 cannot be agreed on; pick a fixed port",
                ));
            }
            (addr, port)
        } else {
            (
                lookup("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
                0,
            )
        };
        let timeout = match lookup(TIMEOUT_ENV) {
            None => DEFAULT_TIMEOUT,
            Some(v) => {
                let ms: u64 = parse_var(TIMEOUT_ENV, &v)?;
                if ms == 0 {
                    return Err(invalid(TIMEOUT_ENV, &v, "must be at least 1 ms"));
                }
                Duration::from_millis(ms)
            }
        };
        Ok(Self {
            rank,
            world_size,
            master_addr,
            master_port,
            timeout,
            max_frame: DEFAULT_MAX_FRAME,
        })
    }

    /// `master_addr:master_port`, with brackets around an IPv6 literal.
    pub fn master_socket_addr(&self) -> String {
        let a = self
            .master_addr
            .trim_start_matches('[')
            .trim_end_matches(']');
        if a.contains(':') {
            format!("[{a}]:{}", self.master_port)
        } else {
            format!("{a}:{}", self.master_port)
        }
    }
}

fn invalid(var: &'static str, value: &str, reason: impl Into<String>) -> BootstrapError {
    BootstrapError::InvalidEnv {
        var,
        value: value.to_string(),
        reason: reason.into(),
    }
}

fn parse_var<T: std::str::FromStr>(var: &'static str, value: &str) -> Result<T>
where
    T::Err: fmt::Display,
{
    value
        .trim()
        .parse()
        .map_err(|e: T::Err| invalid(var, value, e.to_string()))
}
