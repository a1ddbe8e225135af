//! The GPU <-> NIC distance: NCCL's path types between two PCI functions.

use std::fmt;

use super::pci::{Bdf, PciPath};

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
