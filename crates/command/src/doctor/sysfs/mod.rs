//! What `gpuverbs doctor` reads from sysfs and /proc, parsed without side effects.
//!
//! Everything takes a [`Sys`], which names the root the files are read under (`/` on a real
//! machine, a fixture tree in the tests) and where the InfiniBand classes live (libibverbs'
//! `SYSFS_PATH`, which `gpuverbs emu` points at its emulated tree). Nothing here needs
//! privileges; what only root may read (PCIe extended configuration space) is reported as
//! unreadable, never guessed.

mod acs;
mod iommu;
mod limits;
mod nvidia;
mod pci;
mod topology;

pub use acs::{acs, parse_acs, Acs, AcsControl};
pub use iommu::{iommu, iommu_cmdline, Iommu, IommuMode};
pub use limits::{mapped_library, memlock, parse_memlock, rdma_core_release, Limit};
pub use nvidia::{
    nvidia_module, parse_nvidia_version, parse_peer_mapping_override, peer_mapping_override,
    peermem, NvidiaModule, PeerMapping, PeerMem,
};
pub use pci::{
    bar_size, mellanox_nics, nvidia_gpus, parse_bar_sizes, parse_numa, pci_device, pci_device_at,
    pci_devices, rdma_attr, rdma_pci_device, Bdf, PciDevice, PciPath, VENDOR_MELLANOX,
    VENDOR_NVIDIA,
};
pub use topology::{distance, Distance, PathType};

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

#[cfg(test)]
mod tests;
