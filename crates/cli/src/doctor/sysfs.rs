//! What `gpuverbs doctor` reads from sysfs and /proc, parsed without side effects.
//!
//! Everything takes a [`Sys`], which names the root the files are read under (`/` on a real
//! machine, a fixture tree in the tests) and where the InfiniBand classes live (libibverbs'
//! `SYSFS_PATH`, which `gpuverbs emu` points at its emulated tree). Nothing here needs
//! privileges; what only root may read (PCIe extended configuration space) is reported as
//! unreadable, never guessed.

use std::fmt;
use std::path::{Path, PathBuf};

/// Where the files are.
#[derive(Clone, Debug)]
pub struct Sys {
    /// The file-system root (`/`).
    pub root: PathBuf,
    /// The sysfs that holds `class/infiniband` (libibverbs' `SYSFS_PATH`, else `<root>/sys`).
    pub ib_sysfs: PathBuf,
}

impl Sys {
    /// This machine: `/`, and `SYSFS_PATH` for the InfiniBand classes when it is set (as
    /// libibverbs does).
    pub fn host() -> Self {
        let ib_sysfs = std::env::var_os("SYSFS_PATH")
            .filter(|v| !v.is_empty())
            .map_or_else(|| PathBuf::from("/sys"), PathBuf::from);
        Self {
            root: PathBuf::from("/"),
            ib_sysfs,
        }
    }

    /// A tree under `root` (its own `sys/` holds the InfiniBand classes too).
    pub fn at(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            ib_sysfs: root.join("sys"),
        }
    }

    /// `<root>/<rel>`.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel.trim_start_matches('/'))
    }

    fn read(&self, rel: &str) -> Option<String> {
        read_trim(&self.path(rel))
    }
}

/// A file's text, trimmed; `None` when it cannot be read.
fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

// ---------------------------------------------------------------------------------------------
// PCI
// ---------------------------------------------------------------------------------------------

/// A PCI function address (domain:bus:device.function).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bdf {
    /// PCI domain (segment).
    pub domain: u32,
    /// Bus.
    pub bus: u8,
    /// Device.
    pub dev: u8,
    /// Function.
    pub func: u8,
}

impl Bdf {
    /// Parses `0000:65:00.0` (any number of domain digits, hex, either case, as the kernel and
    /// `cuDeviceGetPCIBusId` write them).
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim().trim_end_matches('\0');
        let (domain, rest) = s.split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (dev, func) = rest.split_once('.')?;
        let hex = |t: &str, max: usize| {
            (!t.is_empty() && t.len() <= max && t.bytes().all(|b| b.is_ascii_hexdigit()))
                .then(|| u32::from_str_radix(t, 16).ok())
                .flatten()
        };
        let b = Self {
            domain: hex(domain, 8)?,
            bus: u8::try_from(hex(bus, 2)?).ok()?,
            dev: u8::try_from(hex(dev, 2)?).ok()?,
            func: u8::try_from(hex(func, 1)?).ok()?,
        };
        (b.dev < 32 && b.func < 8).then_some(b)
    }
}

impl fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.dev, self.func
        )
    }
}

/// Where a PCI function sits: its host bridge and the functions from the root port down to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciPath {
    /// The host bridge's sysfs name (`pci0000:00`).
    pub host_bridge: String,
    /// Root port first, the function itself last.
    pub chain: Vec<Bdf>,
}

impl PciPath {
    /// Parses a canonical sysfs device path (`/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0`).
    /// `None` when it is not under a PCI host bridge.
    pub fn from_sysfs(path: &Path) -> Option<Self> {
        let mut host_bridge = None;
        let mut chain = Vec::new();
        for c in path.components() {
            let c = c.as_os_str().to_string_lossy();
            if host_bridge.is_none() {
                if c.starts_with("pci") && c.contains(':') {
                    host_bridge = Some(c.to_string());
                }
            } else if let Some(b) = Bdf::parse(&c) {
                chain.push(b);
            } else {
                // below the function (e.g. a class device): the path ends here
                break;
            }
        }
        let host_bridge = host_bridge?;
        (!chain.is_empty()).then_some(Self { host_bridge, chain })
    }

    /// The function itself.
    pub fn bdf(&self) -> Bdf {
        self.chain[self.chain.len() - 1]
    }
}

impl fmt::Display for PciPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.host_bridge)?;
        for b in &self.chain {
            write!(f, "/{b}")?;
        }
        Ok(())
    }
}

/// One PCI function as sysfs shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciDevice {
    /// Its address.
    pub bdf: Bdf,
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Class code (24 bits).
    pub class: u32,
    /// NUMA node (`None` for -1 or unreadable).
    pub numa_node: Option<u32>,
    /// Its place in the tree (`None` when the sysfs path is not a PCI hierarchy).
    pub path: Option<PciPath>,
}

fn parse_hex(s: &str) -> Option<u32> {
    u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok()
}

/// Parses `numa_node`: a node number, or -1 for none.
pub fn parse_numa(s: &str) -> Option<u32> {
    s.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// Reads the PCI function whose sysfs folder is `dir` (a `/sys/bus/pci/devices/X` link or the
/// canonical folder).
pub fn pci_device_at(dir: &Path) -> Option<PciDevice> {
    let canon = dir.canonicalize().ok()?;
    let path = PciPath::from_sysfs(&canon);
    let bdf = match &path {
        Some(p) => p.bdf(),
        None => Bdf::parse(&canon.file_name()?.to_string_lossy())?,
    };
    let read = |f: &str| read_trim(&canon.join(f));
    Some(PciDevice {
        bdf,
        vendor: u16::try_from(parse_hex(&read("vendor")?)?).ok()?,
        device: u16::try_from(parse_hex(&read("device")?)?).unwrap_or(0),
        class: read("class").and_then(|c| parse_hex(&c)).unwrap_or(0),
        numa_node: read("numa_node").and_then(|n| parse_numa(&n)),
        path,
    })
}

/// The PCI function `bdf` (`/sys/bus/pci/devices/<bdf>`).
pub fn pci_device(sys: &Sys, bdf: Bdf) -> Option<PciDevice> {
    pci_device_at(&sys.path(&format!("sys/bus/pci/devices/{bdf}")))
}

/// Every PCI function sysfs lists, sorted by address.
pub fn pci_devices(sys: &Sys) -> Vec<PciDevice> {
    let mut v: Vec<PciDevice> = std::fs::read_dir(sys.path("sys/bus/pci/devices"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| pci_device_at(&e.path()))
        .collect();
    v.sort_by_key(|d| d.bdf);
    v
}

/// NVIDIA's PCI vendor ID.
pub const VENDOR_NVIDIA: u16 = 0x10de;
/// Mellanox's (NVIDIA networking) PCI vendor ID.
pub const VENDOR_MELLANOX: u16 = 0x15b3;

/// NVIDIA display / 3D controllers (GPUs), whatever driver is bound.
pub fn nvidia_gpus(sys: &Sys) -> Vec<PciDevice> {
    pci_devices(sys)
        .into_iter()
        .filter(|d| d.vendor == VENDOR_NVIDIA && d.class >> 16 == 0x03)
        .collect()
}

/// Mellanox network functions (ConnectX, BlueField), whatever driver is bound.
pub fn mellanox_nics(sys: &Sys) -> Vec<PciDevice> {
    pci_devices(sys)
        .into_iter()
        .filter(|d| d.vendor == VENDOR_MELLANOX && d.class >> 16 == 0x02)
        .collect()
}

/// The PCI function behind RDMA device `name` (`class/infiniband/<name>/device`), or `None`
/// when it has none (the emulated devices of `gpuverbs emu` are not on a PCI bus).
pub fn rdma_pci_device(sys: &Sys, name: &str) -> Option<PciDevice> {
    let d = pci_device_at(
        &sys.ib_sysfs
            .join("class/infiniband")
            .join(name)
            .join("device"),
    )?;
    d.path.is_some().then_some(d)
}

/// A sysfs attribute of RDMA device `name` (`fw_ver`, `board_id`, ...).
pub fn rdma_attr(sys: &Sys, name: &str, attr: &str) -> Option<String> {
    read_trim(&sys.ib_sysfs.join("class/infiniband").join(name).join(attr))
}

/// BAR sizes from a PCI function's `resource` file (one `start end flags` line per resource;
/// BAR i is line i, a 64-bit BAR leaves the next line zero).
pub fn parse_bar_sizes(resource: &str) -> Vec<u64> {
    resource
        .lines()
        .take(6)
        .map(|l| {
            let mut it = l
                .split_whitespace()
                .map(|t| u64::from_str_radix(t.trim_start_matches("0x"), 16).unwrap_or(0));
            let (s, e) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
            if e > s {
                e - s + 1
            } else {
                0
            }
        })
        .collect()
}

/// The size of BAR `index` of `bdf`.
pub fn bar_size(sys: &Sys, bdf: Bdf, index: usize) -> Option<u64> {
    let text = sys.read(&format!("sys/bus/pci/devices/{bdf}/resource"))?;
    parse_bar_sizes(&text)
        .get(index)
        .copied()
        .filter(|&s| s > 0)
}

// ---------------------------------------------------------------------------------------------
// GPU <-> NIC distance
// ---------------------------------------------------------------------------------------------

/// NCCL's names for the path between two PCI devices (`nvidia-smi topo -m` uses the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PathType {
    /// At most one PCIe bridge (switch) between them.
    Pix,
    /// Several PCIe bridges, without crossing the host bridge.
    Pxb,
    /// Through a PCIe host bridge (the CPU's root complex).
    Phb,
    /// Between host bridges of one NUMA node.
    Node,
    /// Across the interconnect between NUMA nodes (sockets).
    Sys,
}

impl fmt::Display for PathType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Pix => "PIX",
            Self::Pxb => "PXB",
            Self::Phb => "PHB",
            Self::Node => "NODE",
            Self::Sys => "SYS",
        })
    }
}

/// How two PCI functions are connected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Distance {
    /// The path type.
    pub kind: PathType,
    /// The bridges the path crosses below the host bridge (their ACS matters).
    pub bridges: Vec<Bdf>,
    /// Why this type.
    pub reason: String,
}

/// Classifies the path between `a` and `b` (each with its NUMA node):
///
/// - different host bridges: NODE when both report the same NUMA node, else SYS;
/// - the same host bridge but no common bridge (separate root ports): PHB;
/// - a common bridge (the deepest one shared): PIX when each side is at most one bridge
///   (a switch's downstream port) below it, else PXB.
pub fn distance(a: (&PciPath, Option<u32>), b: (&PciPath, Option<u32>)) -> Distance {
    let ((pa, na), (pb, nb)) = (a, b);
    let common = pa
        .chain
        .iter()
        .zip(&pb.chain)
        .take_while(|(x, y)| x == y)
        .count();
    let below = |p: &PciPath| p.chain[common.min(p.chain.len())..p.chain.len() - 1].to_vec();
    if pa.host_bridge != pb.host_bridge {
        let (kind, why) = match (na, nb) {
            (Some(x), Some(y)) if x == y => (
                PathType::Node,
                format!(
                    "different host bridges ({}, {}) on NUMA node {x}",
                    pa.host_bridge, pb.host_bridge
                ),
            ),
            (Some(x), Some(y)) => (
                PathType::Sys,
                format!(
                    "different host bridges ({}, {}) on NUMA nodes {x} and {y}",
                    pa.host_bridge, pb.host_bridge
                ),
            ),
            _ => (
                PathType::Sys,
                format!(
                    "different host bridges ({}, {}), NUMA node unknown",
                    pa.host_bridge, pb.host_bridge
                ),
            ),
        };
        let mut bridges = pa.chain[..pa.chain.len() - 1].to_vec();
        bridges.extend_from_slice(&pb.chain[..pb.chain.len() - 1]);
        return Distance {
            kind,
            bridges,
            reason: why,
        };
    }
    if common == 0 {
        let mut bridges = below(pa);
        bridges.extend(below(pb));
        return Distance {
            kind: PathType::Phb,
            bridges,
            reason: format!("no common PCIe bridge below host bridge {}", pa.host_bridge),
        };
    }
    let top = pa.chain[common - 1];
    let (da, db) = (pa.chain.len() - common, pb.chain.len() - common);
    let mut bridges = vec![top];
    bridges.extend(below(pa));
    bridges.extend(below(pb));
    let kind = if da <= 2 && db <= 2 {
        PathType::Pix
    } else {
        PathType::Pxb
    };
    Distance {
        kind,
        bridges,
        reason: format!(
            "common bridge {top}, then {} and {} bridge(s) down to each",
            da - 1,
            db - 1
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// ACS
// ---------------------------------------------------------------------------------------------

/// The ACS control bits of one bridge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcsControl(pub u16);

impl AcsControl {
    /// P2P Request Redirect: peer-to-peer requests go up to the root complex.
    pub const REQ_REDIRECT: u16 = 1 << 2;
    /// P2P Completion Redirect.
    pub const CMPLT_REDIRECT: u16 = 1 << 3;
    /// Source Validation.
    pub const SOURCE_VALIDATION: u16 = 1 << 0;
    /// Upstream Forwarding.
    pub const UPSTREAM_FORWARDING: u16 = 1 << 4;
    /// P2P Egress Control.
    pub const EGRESS_CONTROL: u16 = 1 << 5;

    /// Whether peer-to-peer traffic through this bridge is redirected upstream.
    pub fn redirects_p2p(self) -> bool {
        self.0 & (Self::REQ_REDIRECT | Self::CMPLT_REDIRECT | Self::EGRESS_CONTROL) != 0
    }
}

impl fmt::Display for AcsControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::SOURCE_VALIDATION, "SrcValid"),
            (1 << 1, "TransBlk"),
            (Self::REQ_REDIRECT, "ReqRedir"),
            (Self::CMPLT_REDIRECT, "CmpltRedir"),
            (Self::UPSTREAM_FORWARDING, "UpstreamFwd"),
            (Self::EGRESS_CONTROL, "EgressCtrl"),
            (1 << 6, "DirectTrans"),
        ];
        let on: Vec<&str> = names
            .iter()
            .filter(|(b, _)| self.0 & b != 0)
            .map(|(_, n)| *n)
            .collect();
        if on.is_empty() {
            f.write_str("none enabled")
        } else {
            write!(f, "{}", on.join("+"))
        }
    }
}

/// What a bridge's configuration space says about ACS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acs {
    /// The bridge has the ACS capability; these controls are set.
    Present(AcsControl),
    /// The extended configuration space was read and has no ACS capability.
    Absent,
    /// Only the first bytes could be read (the extended space needs root).
    Unreadable,
}

/// PCIe extended capability ID of ACS.
const ACS_CAP_ID: u16 = 0x000d;

/// Finds the ACS capability in a configuration-space image (`config` in sysfs).
pub fn parse_acs(config: &[u8]) -> Acs {
    if config.len() < 0x104 {
        return Acs::Unreadable;
    }
    let dword = |o: usize| {
        config
            .get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut off = 0x100usize;
    for _ in 0..128 {
        let Some(h) = dword(off) else {
            return Acs::Unreadable;
        };
        if h == 0 || h == u32::MAX {
            return Acs::Absent;
        }
        if (h & 0xffff) as u16 == ACS_CAP_ID {
            return match config.get(off + 6..off + 8) {
                Some(c) => Acs::Present(AcsControl(u16::from_le_bytes([c[0], c[1]]))),
                None => Acs::Unreadable,
            };
        }
        let next = (h >> 20) as usize & !3;
        if next < 0x100 || next <= off {
            return Acs::Absent;
        }
        off = next;
    }
    Acs::Absent
}

/// The ACS state of bridge `bdf`.
pub fn acs(sys: &Sys, bdf: Bdf) -> Acs {
    match std::fs::read(sys.path(&format!("sys/bus/pci/devices/{bdf}/config"))) {
        Ok(bytes) => parse_acs(&bytes),
        Err(_) => Acs::Unreadable,
    }
}

// ---------------------------------------------------------------------------------------------
// IOMMU
// ---------------------------------------------------------------------------------------------

/// How DMA addresses of a device are translated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IommuMode {
    /// No IOMMU is active (no `class/iommu` entries, no groups).
    Off,
    /// An IOMMU is active but passes DMA through untranslated (identity domains, `iommu=pt`).
    Passthrough,
    /// DMA is translated (DMA / DMA-FQ domains).
    Translated,
    /// An IOMMU is active; the domain type could not be read.
    Unknown,
}

impl fmt::Display for IommuMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Passthrough => "passthrough",
            Self::Translated => "translated",
            Self::Unknown => "on (domain type unknown)",
        })
    }
}

/// What the IOMMU check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Iommu {
    /// The mode.
    pub mode: IommuMode,
    /// `class/iommu` entries (dmar0, ivhd0, ...).
    pub units: Vec<String>,
    /// Number of IOMMU groups.
    pub groups: usize,
    /// The IOMMU words of the kernel command line.
    pub cmdline: Vec<String>,
    /// Domain types of the devices asked about (`iommu_group/type`).
    pub domains: Vec<(Bdf, String)>,
}

/// The IOMMU words of a kernel command line (`iommu=`, `intel_iommu=`, `amd_iommu=`,
/// `iommu.passthrough=`, `iommu.strict=`).
pub fn iommu_cmdline(cmdline: &str) -> Vec<String> {
    cmdline
        .split_whitespace()
        .take_while(|w| *w != "--")
        .filter(|w| {
            w.starts_with("iommu") || w.starts_with("intel_iommu") || w.starts_with("amd_iommu")
        })
        .map(str::to_string)
        .collect()
}

/// Reads the IOMMU state, with the domain types of `devices`.
pub fn iommu(sys: &Sys, devices: &[Bdf]) -> Iommu {
    let list = |rel: &str| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(sys.path(rel))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let units = list("sys/class/iommu");
    let groups = list("sys/kernel/iommu_groups").len();
    let cmdline = sys
        .read("proc/cmdline")
        .map(|c| iommu_cmdline(&c))
        .unwrap_or_default();
    let domains: Vec<(Bdf, String)> = devices
        .iter()
        .filter_map(|b| {
            sys.read(&format!("sys/bus/pci/devices/{b}/iommu_group/type"))
                .map(|t| (*b, t))
        })
        .collect();
    let pt_cmdline = cmdline
        .iter()
        .any(|w| w == "iommu=pt" || w == "iommu.passthrough=1" || w == "iommu.passthrough=on");
    let mode = if units.is_empty() && groups == 0 {
        IommuMode::Off
    } else if domains
        .iter()
        .any(|(_, t)| t.starts_with("DMA") || t == "unmanaged")
    {
        IommuMode::Translated
    } else if pt_cmdline || (!domains.is_empty() && domains.iter().all(|(_, t)| t == "identity")) {
        IommuMode::Passthrough
    } else {
        IommuMode::Unknown
    };
    Iommu {
        mode,
        units,
        groups,
        cmdline,
        domains,
    }
}

// ---------------------------------------------------------------------------------------------
// NVIDIA kernel modules
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Limits, libraries
// ---------------------------------------------------------------------------------------------

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// A fixture tree in a fresh temporary folder, removed on drop.
    struct Tree(PathBuf);

    impl Tree {
        fn new(tag: &str) -> Self {
            static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let d = std::env::temp_dir().join(format!(
                "gv-doctor-{tag}-{}-{}",
                std::process::id(),
                SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&d);
            fs::create_dir_all(&d).unwrap();
            Tree(d)
        }

        fn sys(&self) -> Sys {
            Sys::at(&self.0)
        }

        fn put(&self, rel: &str, text: &str) {
            let p = self.0.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        }

        fn put_bytes(&self, rel: &str, bytes: &[u8]) {
            let p = self.0.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, bytes).unwrap();
        }

        /// A PCI function at `devpath` (`pci0000:00/0000:00:01.0/...`), linked from
        /// `sys/bus/pci/devices`.
        fn pci(&self, devpath: &str, vendor: u16, class: u32, numa: i32) -> Bdf {
            let dir = self.0.join("sys/devices").join(devpath);
            fs::create_dir_all(&dir).unwrap();
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            fs::write(dir.join("vendor"), format!("0x{vendor:04x}\n")).unwrap();
            fs::write(dir.join("device"), "0x2335\n").unwrap();
            fs::write(dir.join("class"), format!("0x{class:06x}\n")).unwrap();
            fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
            let links = self.0.join("sys/bus/pci/devices");
            fs::create_dir_all(&links).unwrap();
            std::os::unix::fs::symlink(&dir, links.join(&name)).unwrap();
            Bdf::parse(&name).unwrap()
        }

        fn bridge(&self, devpath: &str, numa: i32) -> Bdf {
            self.pci(devpath, 0x8086, 0x060400, numa)
        }

        fn gpu(&self, devpath: &str, numa: i32) -> Bdf {
            self.pci(devpath, VENDOR_NVIDIA, 0x030200, numa)
        }

        fn nic(&self, devpath: &str, numa: i32, ibdev: &str) -> Bdf {
            let b = self.pci(devpath, VENDOR_MELLANOX, 0x020000, numa);
            let ib = self.0.join("sys/class/infiniband").join(ibdev);
            fs::create_dir_all(&ib).unwrap();
            std::os::unix::fs::symlink(self.0.join("sys/devices").join(devpath), ib.join("device"))
                .unwrap();
            b
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn dist(t: &Tree, gpu: Bdf, nic: &str) -> Distance {
        let s = t.sys();
        let g = pci_device(&s, gpu).unwrap();
        let n = rdma_pci_device(&s, nic).unwrap();
        distance(
            (g.path.as_ref().unwrap(), g.numa_node),
            (n.path.as_ref().unwrap(), n.numa_node),
        )
    }

    #[test]
    fn bdf_parse_and_print() {
        let b = Bdf::parse("0000:65:00.0").unwrap();
        assert_eq!(b.to_string(), "0000:65:00.0");
        assert_eq!(
            Bdf::parse("00000000:C1:1F.7").unwrap().to_string(),
            "0000:c1:1f.7"
        );
        assert_eq!(Bdf::parse("0001:02:03.1\0").unwrap().domain, 1);
        for bad in [
            "",
            "65:00.0",
            "0000:65:00",
            "0000:65:20.0",
            "0000:65:00.8",
            "x:65:00.0",
        ] {
            assert_eq!(Bdf::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn same_switch_is_pix() {
        let t = Tree::new("pix");
        t.bridge("pci0000:00/0000:00:01.0", 0);
        t.bridge("pci0000:00/0000:00:01.0/0000:01:00.0", 0);
        t.bridge("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0", 0);
        t.bridge("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0", 0);
        let g = t.gpu(
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0",
            0,
        );
        t.nic(
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:06:00.0",
            0,
            "mlx5_0",
        );
        let d = dist(&t, g, "mlx5_0");
        assert_eq!(d.kind, PathType::Pix, "{d:?}");
        let names: Vec<String> = d.bridges.iter().map(Bdf::to_string).collect();
        assert_eq!(names, ["0000:01:00.0", "0000:02:08.0", "0000:02:10.0"]);
        // functions of one device (GPU and NIC behind one downstream port) are PIX too
        let t2 = Tree::new("pix2");
        t2.bridge("pci0000:00/0000:00:02.0", 0);
        let g2 = t2.gpu("pci0000:00/0000:00:02.0/0000:03:00.0", 0);
        t2.nic("pci0000:00/0000:00:02.0/0000:03:00.1", 0, "mlx5_1");
        assert_eq!(dist(&t2, g2, "mlx5_1").kind, PathType::Pix);
    }

    #[test]
    fn nested_switches_are_pxb() {
        let t = Tree::new("pxb");
        let rp = "pci0000:00/0000:00:01.0";
        let us = format!("{rp}/0000:01:00.0");
        let g = t.gpu(
            &format!("{us}/0000:02:08.0/0000:03:00.0/0000:04:00.0/0000:05:00.0"),
            0,
        );
        t.nic(&format!("{us}/0000:02:10.0/0000:06:00.0"), 0, "mlx5_0");
        let d = dist(&t, g, "mlx5_0");
        assert_eq!(d.kind, PathType::Pxb, "{d:?}");
    }

    #[test]
    fn separate_root_ports_are_phb() {
        let t = Tree::new("phb");
        let g = t.gpu("pci0000:00/0000:00:01.0/0000:01:00.0", 0);
        t.nic("pci0000:00/0000:00:03.0/0000:02:00.0", 0, "mlx5_0");
        let d = dist(&t, g, "mlx5_0");
        assert_eq!(d.kind, PathType::Phb, "{d:?}");
        assert_eq!(d.bridges.len(), 2);
        // a flat virtual machine: both directly on the host bridge
        let t2 = Tree::new("phb2");
        let g2 = t2.gpu("pci0000:00/0000:00:05.0", -1);
        t2.nic("pci0000:00/0000:00:06.0", -1, "mlx5_0");
        let d2 = dist(&t2, g2, "mlx5_0");
        assert_eq!(d2.kind, PathType::Phb);
        assert!(d2.bridges.is_empty());
    }

    #[test]
    fn other_socket_is_sys_same_node_is_node() {
        let t = Tree::new("sys");
        let g = t.gpu("pci0000:00/0000:00:01.0/0000:01:00.0", 0);
        t.nic("pci0000:80/0000:80:01.0/0000:81:00.0", 1, "mlx5_0");
        t.nic("pci0000:40/0000:40:01.0/0000:41:00.0", 0, "mlx5_1");
        t.nic("pci0000:c0/0000:c0:01.0/0000:c1:00.0", -1, "mlx5_2");
        let d = dist(&t, g, "mlx5_0");
        assert_eq!(d.kind, PathType::Sys, "{d:?}");
        assert!(d.reason.contains("NUMA nodes 0 and 1"), "{}", d.reason);
        assert_eq!(dist(&t, g, "mlx5_1").kind, PathType::Node);
        assert_eq!(dist(&t, g, "mlx5_2").kind, PathType::Sys);
        assert_eq!(pci_device(&t.sys(), g).unwrap().numa_node, Some(0));
        assert_eq!(rdma_pci_device(&t.sys(), "mlx5_2").unwrap().numa_node, None);
    }

    #[test]
    fn device_lists() {
        let t = Tree::new("lists");
        t.bridge("pci0000:00/0000:00:01.0", 0);
        let g = t.gpu("pci0000:00/0000:00:01.0/0000:01:00.0", 0);
        t.pci(
            "pci0000:00/0000:00:01.0/0000:01:00.1",
            VENDOR_NVIDIA,
            0x040300,
            0,
        ); // audio
        let n = t.nic("pci0000:00/0000:00:02.0", 0, "mlx5_0");
        let s = t.sys();
        assert_eq!(
            nvidia_gpus(&s).iter().map(|d| d.bdf).collect::<Vec<_>>(),
            [g]
        );
        assert_eq!(
            mellanox_nics(&s).iter().map(|d| d.bdf).collect::<Vec<_>>(),
            [n]
        );
        // an emulated device: `device` is a plain folder, not on a PCI bus
        t.put("sys/class/infiniband/mlx5_9/device/vendor", "0x15b3");
        assert_eq!(rdma_pci_device(&s, "mlx5_9"), None);
        t.put("sys/class/infiniband/mlx5_9/board_id", "GPUVERBS_SOFTNIC\n");
        assert_eq!(
            rdma_attr(&s, "mlx5_9", "board_id").as_deref(),
            Some("GPUVERBS_SOFTNIC")
        );
    }

    /// A configuration space with an AER capability then ACS with `ctrl`.
    fn config_with_acs(ctrl: u16) -> Vec<u8> {
        let mut c = vec![0u8; 4096];
        // AER (ID 1, version 2) at 0x100, next 0x148
        c[0x100..0x104].copy_from_slice(&(0x0001u32 | 2 << 16 | 0x148 << 20).to_le_bytes());
        // ACS (ID 0xd, version 1) at 0x148, last
        c[0x148..0x14c].copy_from_slice(&(0x000du32 | 1 << 16).to_le_bytes());
        c[0x14c..0x14e].copy_from_slice(&0x005fu16.to_le_bytes());
        c[0x14e..0x150].copy_from_slice(&ctrl.to_le_bytes());
        c
    }

    #[test]
    fn acs_parsing() {
        let on = config_with_acs(
            AcsControl::SOURCE_VALIDATION
                | AcsControl::REQ_REDIRECT
                | AcsControl::CMPLT_REDIRECT
                | AcsControl::UPSTREAM_FORWARDING,
        );
        match parse_acs(&on) {
            Acs::Present(c) => {
                assert!(c.redirects_p2p());
                assert_eq!(c.to_string(), "SrcValid+ReqRedir+CmpltRedir+UpstreamFwd");
            }
            other => panic!("{other:?}"),
        }
        match parse_acs(&config_with_acs(0)) {
            Acs::Present(c) => {
                assert!(!c.redirects_p2p());
                assert_eq!(c.to_string(), "none enabled");
            }
            other => panic!("{other:?}"),
        }
        // AER only
        let mut aer = vec![0u8; 4096];
        aer[0x100..0x104].copy_from_slice(&(0x0001u32 | 2 << 16).to_le_bytes());
        assert_eq!(parse_acs(&aer), Acs::Absent);
        assert_eq!(parse_acs(&[0u8; 4096]), Acs::Absent);
        // a non-root read of config gives 64 bytes
        assert_eq!(parse_acs(&[0u8; 64]), Acs::Unreadable);
        // a loop in the list ends
        let mut lp = vec![0u8; 4096];
        lp[0x100..0x104].copy_from_slice(&(0x0001u32 | 0x100 << 20).to_le_bytes());
        assert_eq!(parse_acs(&lp), Acs::Absent);

        let t = Tree::new("acs");
        let b = t.bridge("pci0000:00/0000:00:01.0", 0);
        t.put_bytes("sys/devices/pci0000:00/0000:00:01.0/config", &on);
        assert!(matches!(acs(&t.sys(), b), Acs::Present(c) if c.redirects_p2p()));
        assert_eq!(
            acs(&t.sys(), Bdf::parse("0000:09:00.0").unwrap()),
            Acs::Unreadable
        );
    }

    #[test]
    fn iommu_modes() {
        let off = Tree::new("iommu-off");
        off.put("proc/cmdline", "quiet console=ttyS0");
        let i = iommu(&off.sys(), &[]);
        assert_eq!(i.mode, IommuMode::Off);
        assert!(i.cmdline.is_empty());

        let t = Tree::new("iommu-on");
        t.put("sys/class/iommu/dmar0/x", "");
        t.put("sys/class/iommu/dmar1/x", "");
        t.put("sys/kernel/iommu_groups/7/type", "DMA-FQ");
        t.put("proc/cmdline", "BOOT_IMAGE=/vmlinuz intel_iommu=on quiet");
        let g = t.gpu("pci0000:00/0000:00:01.0", 0);
        std::os::unix::fs::symlink(
            t.0.join("sys/kernel/iommu_groups/7"),
            t.0.join("sys/devices/pci0000:00/0000:00:01.0/iommu_group"),
        )
        .unwrap();
        let i = iommu(&t.sys(), &[g]);
        assert_eq!(i.mode, IommuMode::Translated, "{i:?}");
        assert_eq!(i.units, ["dmar0", "dmar1"]);
        assert_eq!(i.groups, 1);
        assert_eq!(i.cmdline, ["intel_iommu=on"]);
        assert_eq!(i.domains, [(g, "DMA-FQ".to_string())]);

        t.put("sys/kernel/iommu_groups/7/type", "identity");
        assert_eq!(iommu(&t.sys(), &[g]).mode, IommuMode::Passthrough);
        // no device asked about: the command line decides
        t.put("proc/cmdline", "intel_iommu=on iommu=pt");
        assert_eq!(iommu(&t.sys(), &[]).mode, IommuMode::Passthrough);
        t.put("proc/cmdline", "intel_iommu=on");
        assert_eq!(iommu(&t.sys(), &[]).mode, IommuMode::Unknown);
        assert_eq!(
            iommu_cmdline("amd_iommu=off iommu.passthrough=1 -- iommu=pt"),
            ["amd_iommu=off", "iommu.passthrough=1"]
        );
    }

    #[test]
    fn nvidia_module_versions() {
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue Jul 22 12:34:56 UTC 2025\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n";
        let m = parse_nvidia_version(open).unwrap();
        assert!(m.open);
        assert_eq!(m.version.as_deref(), Some("580.65.06"));
        let prop = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n";
        let m = parse_nvidia_version(prop).unwrap();
        assert!(!m.open);
        assert_eq!(m.version.as_deref(), Some("535.104.05"));
        assert_eq!(parse_nvidia_version("garbage"), None);

        let t = Tree::new("nv");
        assert_eq!(nvidia_module(&t.sys()), None);
        assert_eq!(peer_mapping_override(&t.sys()), PeerMapping::Unknown);
        t.put("proc/driver/nvidia/version", open);
        assert!(nvidia_module(&t.sys()).unwrap().open);
        t.put(
            "proc/driver/nvidia/params",
            "ResmanDebugLevel: 4294967295\nRegistryDwords: \"\"\nEnableMSI: 1\n",
        );
        assert_eq!(peer_mapping_override(&t.sys()), PeerMapping::NotSet);
        t.put(
            "proc/driver/nvidia/params",
            "RegistryDwords: \"RMUseSwI2c=0x01;PeerMappingOverride=1;\"\n",
        );
        assert_eq!(peer_mapping_override(&t.sys()), PeerMapping::Set(1));
        assert_eq!(
            parse_peer_mapping_override("RegistryDwords: \"peermappingoverride=0x0\""),
            Some(0)
        );
    }

    #[test]
    fn peermem_present_or_not() {
        let t = Tree::new("peermem");
        let p = peermem(&t.sys());
        assert!(!p.loaded());
        t.put("sys/module/nvidia_peermem/version", "580.65.06\n");
        let p = peermem(&t.sys());
        assert!(p.loaded());
        assert_eq!(p.nvidia_peermem.as_deref(), Some("580.65.06"));
        fs::remove_dir_all(t.0.join("sys/module/nvidia_peermem")).unwrap();
        fs::create_dir_all(t.0.join("sys/module/nvidia_peermem")).unwrap();
        assert_eq!(
            peermem(&t.sys()).nvidia_peermem.as_deref(),
            Some("no version file")
        );
        fs::remove_dir_all(t.0.join("sys/module/nvidia_peermem")).unwrap();
        t.put("sys/kernel/mm/memory_peers/nv_mem/version", "1.3-0\n");
        let p = peermem(&t.sys());
        assert!(p.loaded());
        assert_eq!(
            p.memory_peers,
            [("nv_mem".to_string(), "1.3-0".to_string())]
        );
    }

    #[test]
    fn memlock_and_libraries() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \nMax locked memory         8388608              unlimited            bytes     \nMax file locks            unlimited            unlimited            locks     \n";
        assert_eq!(
            parse_memlock(limits),
            Some((Limit::Bytes(8 << 20), Limit::Unlimited))
        );
        assert_eq!(Limit::Bytes(8 << 20).to_string(), "8 MiB");
        assert_eq!(Limit::Bytes(65536).to_string(), "64 KiB");
        assert_eq!(Limit::Bytes(1000).to_string(), "1000 bytes");
        assert_eq!(parse_memlock("nothing"), None);
        assert_eq!(
            rdma_core_release("libibverbs.so.1.14.44.0").as_deref(),
            Some("44.0")
        );
        assert_eq!(
            rdma_core_release("/usr/lib/libmlx5.so.1.25.50.0").as_deref(),
            Some("50.0")
        );
        assert_eq!(rdma_core_release("libibverbs.so.1"), None);
        let maps = "7f00-7f10 r--p 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0\n7f20-7f30 r-xp 00000000 08:01 124 /usr/lib/x86_64-linux-gnu/libmlx5.so.1.24.44.0\n7f40-7f50 rw-p 00000000 00:00 0\n";
        assert_eq!(
            mapped_library(maps, "libmlx5.so").unwrap(),
            PathBuf::from("/usr/lib/x86_64-linux-gnu/libmlx5.so.1.24.44.0")
        );
        assert_eq!(mapped_library(maps, "libcuda.so"), None);
    }

    #[test]
    fn bar_sizes() {
        let res = "0x00000000fa000000 0x00000000faffffff 0x0000000000040200\n0x0000238000000000 0x0000239fffffffff 0x000000000014220c\n0x0000000000000000 0x0000000000000000 0x0000000000000000\n0x000023a000000000 0x000023a001ffffff 0x000000000014220c\n";
        let s = parse_bar_sizes(res);
        assert_eq!(s, [16 << 20, 128 << 30, 0, 32 << 20]);
        let t = Tree::new("bar");
        let g = t.gpu("pci0000:00/0000:00:01.0", 0);
        t.put("sys/devices/pci0000:00/0000:00:01.0/resource", res);
        assert_eq!(bar_size(&t.sys(), g, 1), Some(128 << 30));
        assert_eq!(bar_size(&t.sys(), g, 2), None);
    }
}
