//! PCI functions as sysfs lists them: addresses, their place in the tree, vendor lists, the
//! PCI function behind an RDMA device, BAR sizes.

use std::fmt;
use std::path::Path;

use super::{read_trim, Sys};

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
