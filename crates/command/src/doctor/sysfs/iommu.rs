//! The IOMMU: units, groups, the kernel command line and the devices' domain types.

use std::fmt;

use super::pci::Bdf;
use super::Sys;

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
