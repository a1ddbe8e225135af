//! Process limits and loaded libraries: the locked-memory limit, rdma-core's release.

use std::fmt;
use std::path::{Path, PathBuf};

use super::Sys;

/// A resource limit value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// No limit.
    Unlimited,
    /// Bytes.
    Bytes(u64),
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unlimited => f.write_str("unlimited"),
            Self::Bytes(b) if b % (1 << 30) == 0 && *b > 0 => write!(f, "{} GiB", b >> 30),
            Self::Bytes(b) if b % (1 << 20) == 0 && *b > 0 => write!(f, "{} MiB", b >> 20),
            Self::Bytes(b) if b % (1 << 10) == 0 && *b > 0 => write!(f, "{} KiB", b >> 10),
            Self::Bytes(b) => write!(f, "{b} bytes"),
        }
    }
}

/// The locked-memory limit (soft, hard) from `/proc/<pid>/limits`.
pub fn parse_memlock(limits: &str) -> Option<(Limit, Limit)> {
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))?;
    let mut it = line["Max locked memory".len()..].split_whitespace();
    let val = |t: Option<&str>| match t? {
        "unlimited" => Some(Limit::Unlimited),
        n => n.parse().ok().map(Limit::Bytes),
    };
    Some((val(it.next())?, val(it.next())?))
}

/// This process's locked-memory limit.
pub fn memlock(sys: &Sys) -> Option<(Limit, Limit)> {
    parse_memlock(&sys.read("proc/self/limits")?)
}

/// The rdma-core release a library file name carries: `libibverbs.so.1.14.44.0` → `44.0`
/// (rdma-core names its libraries `<soname>.<ABI minor>.<release>`).
pub fn rdma_core_release(file: &str) -> Option<String> {
    let (_, tail) = file.rsplit_once(".so.")?;
    let parts: Vec<&str> = tail.split('.').collect();
    if parts.len() < 4 || !parts.iter().all(|p| p.bytes().all(|b| b.is_ascii_digit())) {
        return None;
    }
    Some(parts[2..].join("."))
}

/// The file a loaded library was mapped from, from `/proc/self/maps` text.
pub fn mapped_library(maps: &str, stem: &str) -> Option<PathBuf> {
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(stem))
        })
        .map(PathBuf::from)
}
