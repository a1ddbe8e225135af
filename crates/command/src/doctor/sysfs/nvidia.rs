//! The NVIDIA kernel modules: the driver's version and parameters, peer-memory clients.

use super::{read_trim, Sys};

/// `/proc/driver/nvidia/version`, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvidiaModule {
    /// The open kernel module (`NVIDIA UNIX Open Kernel Module`), else the proprietary one.
    pub open: bool,
    /// The driver version, e.g. `580.65.06`.
    pub version: Option<String>,
    /// The NVRM line as read.
    pub line: String,
}

/// Parses the `NVRM version:` line of `/proc/driver/nvidia/version`.
pub fn parse_nvidia_version(text: &str) -> Option<NvidiaModule> {
    let line = text
        .lines()
        .find(|l| l.starts_with("NVRM version:"))?
        .trim();
    let open = line.contains("Open Kernel Module");
    let version = line
        .split_whitespace()
        .find(|t| {
            t.contains('.')
                && t.split('.').count() >= 2
                && t.split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string);
    Some(NvidiaModule {
        open,
        version,
        line: line.to_string(),
    })
}

/// The NVIDIA kernel module, when one is loaded.
pub fn nvidia_module(sys: &Sys) -> Option<NvidiaModule> {
    parse_nvidia_version(&sys.read("proc/driver/nvidia/version")?)
}

/// The `PeerMappingOverride` setting of the NVIDIA driver, from `RegistryDwords` in
/// `/proc/driver/nvidia/params` (`Some(value)` when set there, `None` when not mentioned).
pub fn parse_peer_mapping_override(params: &str) -> Option<u32> {
    let dwords = params
        .lines()
        .find_map(|l| l.trim().strip_prefix("RegistryDwords:"))?
        .trim()
        .trim_matches('"');
    dwords.split(';').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        if !k.trim().eq_ignore_ascii_case("PeerMappingOverride") {
            return None;
        }
        let v = v.trim();
        v.strip_prefix("0x")
            .map_or_else(|| v.parse().ok(), |h| u32::from_str_radix(h, 16).ok())
    })
}

/// What the driver's parameters say about `PeerMappingOverride`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerMapping {
    /// `/proc/driver/nvidia/params` could not be read (no NVIDIA driver).
    Unknown,
    /// `RegistryDwords` does not set it.
    NotSet,
    /// Set to this value.
    Set(u32),
}

/// The driver's `PeerMappingOverride` setting.
pub fn peer_mapping_override(sys: &Sys) -> PeerMapping {
    match sys.read("proc/driver/nvidia/params") {
        None => PeerMapping::Unknown,
        Some(p) => parse_peer_mapping_override(&p).map_or(PeerMapping::NotSet, PeerMapping::Set),
    }
}

/// What provides GPU memory to the RDMA stack through peer memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerMem {
    /// `/sys/module/nvidia_peermem` exists; its `version` when it has one.
    pub nvidia_peermem: Option<String>,
    /// `/sys/kernel/mm/memory_peers/<name>/version` entries (MLNX_OFED's peer-memory clients,
    /// such as nv_peer_mem's `nv_mem`).
    pub memory_peers: Vec<(String, String)>,
}

impl PeerMem {
    /// Whether any peer-memory client for NVIDIA GPUs is loaded.
    pub fn loaded(&self) -> bool {
        self.nvidia_peermem.is_some() || !self.memory_peers.is_empty()
    }
}

/// Reads the peer-memory modules.
pub fn peermem(sys: &Sys) -> PeerMem {
    let module = sys.path("sys/module/nvidia_peermem");
    let nvidia_peermem = module.is_dir().then(|| {
        read_trim(&module.join("version")).unwrap_or_else(|| "no version file".to_string())
    });
    let mut memory_peers: Vec<(String, String)> =
        std::fs::read_dir(sys.path("sys/kernel/mm/memory_peers"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let v = read_trim(&e.path().join("version"))?;
                Some((e.file_name().to_string_lossy().into_owned(), v))
            })
            .collect();
    memory_peers.sort();
    PeerMem {
        nvidia_peermem,
        memory_peers,
    }
}
