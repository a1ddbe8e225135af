//! The PCIe and IOMMU checks: the GPU <-> NIC path type, ACS on the bridges between them, the
//! IOMMU mode.

use super::{GpuRef, NA};
use crate::doctor::sysfs::{self, Acs, Bdf, IommuMode, PathType, Sys};
use crate::doctor::{Check, Status};

/// The status of a GPU–NIC path type: PIX and PXB keep GPUDirect traffic below the root
/// complex (NCCL's default GDR level is PXB); PHB, NODE and SYS cross it.
pub fn path_status(k: PathType) -> Status {
    match k {
        PathType::Pix | PathType::Pxb => Status::Ok,
        PathType::Phb | PathType::Node | PathType::Sys => Status::Warn,
    }
}

pub(super) fn topology(
    sys: &Sys,
    gpus: &[GpuRef],
    nics: &[(String, Option<sysfs::PciDevice>)],
) -> Vec<Check> {
    if gpus.is_empty() || nics.is_empty() {
        let why = match (gpus.is_empty(), nics.is_empty()) {
            (true, true) => "no GPU and no RDMA device",
            (true, false) => "no GPU",
            _ => "no RDMA device",
        };
        return vec![
            Check::new("topology", NA, why),
            Check::new("pcie.acs", NA, why),
        ];
    }
    let mut v = Vec::new();
    for g in gpus {
        let gp = g.bdf.and_then(|b| sysfs::pci_device(sys, b));
        for (nic, np) in nics {
            let name = format!("topology.{}.{nic}", g.label);
            let (Some(gp), Some(np)) = (&gp, np) else {
                let why = if gp.is_none() {
                    format!("{} has no PCI device in sysfs", g.label)
                } else {
                    format!("{nic} is not on a PCI bus (an emulated device has no PCIe path)")
                };
                v.push(Check::new(name, NA, why.clone()));
                v.push(Check::new(format!("pcie.acs.{}.{nic}", g.label), NA, why));
                continue;
            };
            let (Some(pg), Some(pn)) = (&gp.path, &np.path) else {
                v.push(Check::new(name, NA, "no PCIe hierarchy in sysfs"));
                continue;
            };
            let d = sysfs::distance((pg, gp.numa_node), (pn, np.numa_node));
            v.push(Check::new(
                name,
                path_status(d.kind),
                format!(
                    "{}: {} ({pg} ↔ {pn}){}",
                    d.kind,
                    d.reason,
                    if path_status(d.kind) == Status::Ok {
                        ""
                    } else {
                        "; GPUDirect traffic crosses the CPU's root complex (lower bandwidth; NCCL would not use GDR at its default level)"
                    }
                ),
            ));
            let acs: Vec<(Bdf, Acs)> = d
                .bridges
                .iter()
                .map(|b| (*b, sysfs::acs(sys, *b)))
                .collect();
            v.push(acs_check(&format!("pcie.acs.{}.{nic}", g.label), &acs));
        }
    }
    v
}

/// ACS on the bridges between a GPU and a NIC: redirection sends peer-to-peer traffic up to the
/// root complex (slow or broken GPUDirect RDMA); unreadable config space is a warning.
pub fn acs_check(name: &str, bridges: &[(Bdf, Acs)]) -> Check {
    if bridges.is_empty() {
        return Check::new(name, Status::Ok, "no PCIe bridge between them");
    }
    let mut status = Status::Ok;
    let parts: Vec<String> = bridges
        .iter()
        .map(|(b, a)| match a {
            Acs::Present(c) => {
                if c.redirects_p2p() {
                    status = Status::Warn;
                }
                format!("{b}: ACS {c}")
            }
            Acs::Absent => format!("{b}: no ACS capability"),
            Acs::Unreadable => {
                status = status.max(Status::Warn);
                format!("{b}: extended config space unreadable (run as root)")
            }
        })
        .collect();
    let mut detail = parts.join("; ");
    if bridges
        .iter()
        .any(|(_, a)| matches!(a, Acs::Present(c) if c.redirects_p2p()))
    {
        detail.push_str(": P2P redirect is on, GPU↔NIC traffic goes through the root complex (disable ACS on these bridges, e.g. setpci, for GPUDirect RDMA)");
    }
    Check::new(name, status, detail)
}

/// IOMMU: off or passthrough is ok; translation is a warning (GPUDirect RDMA through a
/// translating IOMMU needs ATS or identity domains and costs bandwidth).
pub fn iommu_check(i: &sysfs::Iommu) -> Check {
    let mut evidence = format!(
        "class/iommu: {}; {} IOMMU group(s); kernel command line: {}",
        if i.units.is_empty() {
            "none".to_string()
        } else {
            i.units.join(", ")
        },
        i.groups,
        if i.cmdline.is_empty() {
            "no iommu option".to_string()
        } else {
            i.cmdline.join(" ")
        }
    );
    for (b, t) in &i.domains {
        evidence.push_str(&format!("; {b} domain {t}"));
    }
    let status = match i.mode {
        IommuMode::Off | IommuMode::Passthrough => Status::Ok,
        IommuMode::Translated | IommuMode::Unknown => Status::Warn,
    };
    let advice = match i.mode {
        IommuMode::Translated => {
            ": DMA is translated; for GPUDirect RDMA use iommu=pt (or disable the IOMMU)"
        }
        IommuMode::Unknown => {
            ": cannot tell whether DMA is translated (no GPU or NIC domain to read)"
        }
        _ => "",
    };
    Check::new("iommu", status, format!("{}{advice} ({evidence})", i.mode))
}
