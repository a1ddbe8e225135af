//! PCIe Access Control Services: the ACS capability of a bridge's configuration space.

use std::fmt;

use super::pci::Bdf;
use super::Sys;

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
