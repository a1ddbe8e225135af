//! Socket addresses as the ucma commands carry them (`sockaddr_in`, `sockaddr_in6`,
//! `sockaddr_ib`, in a 28-byte or 128-byte field), and the CMA's private-data header that a
//! REQ carries the addresses in. The emulated devices are IPv4 (RoCE v2 GIDs `::ffff:a.b.c.d`);
//! an IPv6 address is taken when it is the unspecified one or IPv4-mapped.

use crate::uaccess::Errno;
use std::net::Ipv4Addr;

/// `AF_INET`.
pub const AF_INET: u16 = 2;
/// `AF_INET6`.
pub const AF_INET6: u16 = 10;
/// `AF_IB`.
pub const AF_IB: u16 = 27;

/// One address of an id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addr {
    /// Family (0 while unset).
    pub family: u16,
    /// The IPv4 address (also of an IPv4-mapped IPv6 one); unspecified for "any".
    pub ip: Ipv4Addr,
    /// Port (host order).
    pub port: u16,
    /// `AF_IB`: the GID, service ID and its mask.
    pub gid: [u8; 16],
    /// `AF_IB` service ID.
    pub sid: u64,
    /// `AF_IB` service ID mask.
    pub sid_mask: u64,
}

impl Default for Addr {
    fn default() -> Self {
        Self {
            family: 0,
            ip: Ipv4Addr::UNSPECIFIED,
            port: 0,
            gid: [0; 16],
            sid: 0,
            sid_mask: 0,
        }
    }
}

impl Addr {
    /// An `AF_INET` address.
    pub fn v4(ip: Ipv4Addr, port: u16) -> Self {
        Self {
            family: AF_INET,
            ip,
            port,
            ..Self::default()
        }
    }

    /// Whether it names no particular address.
    pub fn is_any(&self) -> bool {
        match self.family {
            AF_IB => self.gid == [0; 16],
            _ => self.ip.is_unspecified(),
        }
    }

    /// The RoCE v2 GID of the address.
    pub fn gid(&self) -> [u8; 16] {
        match self.family {
            AF_IB => self.gid,
            _ => verbs::Gid::from_ipv4(self.ip).0,
        }
    }

    /// Bytes of its socket address (`rdma_addr_size`): 16, 28 or 48; 0 when unset.
    pub fn size(&self) -> usize {
        match self.family {
            AF_INET => 16,
            AF_INET6 => 28,
            AF_IB => 48,
            _ => 0,
        }
    }

    /// Its socket address, `size()` bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; self.size()];
        if b.is_empty() {
            return b;
        }
        b[..2].copy_from_slice(&self.family.to_ne_bytes());
        match self.family {
            AF_INET => {
                b[2..4].copy_from_slice(&self.port.to_be_bytes());
                b[4..8].copy_from_slice(&self.ip.octets());
            }
            AF_INET6 => {
                b[2..4].copy_from_slice(&self.port.to_be_bytes());
                if !self.ip.is_unspecified() {
                    b[8..24].copy_from_slice(&verbs::Gid::from_ipv4(self.ip).0);
                }
            }
            _ => {
                b[2..4].copy_from_slice(&0xffffu16.to_be_bytes());
                b[8..24].copy_from_slice(&self.gid);
                b[24..32].copy_from_slice(&self.sid.to_be_bytes());
                b[32..40].copy_from_slice(&self.sid_mask.to_be_bytes());
            }
        }
        b
    }
}

/// Parses a socket address of at most `b.len()` bytes. Unknown families: EAFNOSUPPORT; an
/// IPv6 address that is neither unspecified nor IPv4-mapped: EADDRNOTAVAIL (no emulated
/// device has it); too few bytes for the family: EINVAL.
pub fn parse(b: &[u8]) -> Result<Addr, Errno> {
    if b.len() < 2 {
        return Err(Errno::EINVAL);
    }
    let family = u16::from_ne_bytes([b[0], b[1]]);
    let need = match family {
        AF_INET => 8,
        AF_INET6 => 24,
        AF_IB => 40,
        _ => return Err(Errno(libc::EAFNOSUPPORT)),
    };
    if b.len() < need {
        return Err(Errno::EINVAL);
    }
    let port = u16::from_be_bytes([b[2], b[3]]);
    match family {
        AF_INET => Ok(Addr::v4(Ipv4Addr::new(b[4], b[5], b[6], b[7]), port)),
        AF_INET6 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&b[8..24]);
            let ip = if a == [0; 16] {
                Ipv4Addr::UNSPECIFIED
            } else {
                verbs::Gid(a).to_ipv4().ok_or(Errno(libc::EADDRNOTAVAIL))?
            };
            Ok(Addr {
                family,
                ip,
                port,
                ..Addr::default()
            })
        }
        _ => {
            let mut gid = [0u8; 16];
            gid.copy_from_slice(&b[8..24]);
            let sid = u64::from_be_bytes(b[24..32].try_into().unwrap_or([0; 8]));
            let sid_mask = u64::from_be_bytes(b[32..40].try_into().unwrap_or([0; 8]));
            Ok(Addr {
                family,
                ip: verbs::Gid(gid).to_ipv4().unwrap_or(Ipv4Addr::UNSPECIFIED),
                port: (sid & 0xffff) as u16,
                gid,
                sid,
                sid_mask,
            })
        }
    }
}

/// Bytes of the CMA header at the start of a REQ's private data.
pub const CMA_HDR_LEN: usize = 36;

/// The CMA header (`struct cma_hdr`): version 0, IP version in the high nibble, the
/// requester's port, then source and destination addresses (IPv4 in the last 4 bytes of
/// each 16).
pub fn cma_hdr(src: &Addr, dst: &Addr) -> [u8; CMA_HDR_LEN] {
    let mut h = [0u8; CMA_HDR_LEN];
    h[1] = 4 << 4;
    h[2..4].copy_from_slice(&src.port.to_be_bytes());
    h[16..20].copy_from_slice(&src.ip.octets());
    h[32..36].copy_from_slice(&dst.ip.octets());
    h
}

/// The requester's and the responder's addresses in a CMA header, if it is one (version 0,
/// IPv4 or IPv4-mapped IPv6); the responder's port is the service ID's.
pub fn parse_cma_hdr(p: &[u8], port: u16) -> Option<(Addr, Addr)> {
    if p.len() < CMA_HDR_LEN || p[0] != 0 {
        return None;
    }
    let sport = u16::from_be_bytes([p[2], p[3]]);
    let ip = |at: usize| -> Option<Ipv4Addr> {
        match p[1] >> 4 {
            4 => Some(Ipv4Addr::new(
                p[at + 12],
                p[at + 13],
                p[at + 14],
                p[at + 15],
            )),
            6 => {
                let mut a = [0u8; 16];
                a.copy_from_slice(&p[at..at + 16]);
                verbs::Gid(a).to_ipv4()
            }
            _ => None,
        }
    };
    Some((Addr::v4(ip(4)?, sport), Addr::v4(ip(20)?, port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_read_back_and_strange_ones_are_refused() {
        let a = Addr::v4(Ipv4Addr::new(127, 0, 0, 2), 7174);
        assert_eq!(parse(&a.encode()), Ok(a));
        let mut v6 = vec![0u8; 28];
        v6[..2].copy_from_slice(&AF_INET6.to_ne_bytes());
        assert!(parse(&v6).unwrap().is_any());
        v6[8] = 0xfe;
        assert_eq!(parse(&v6), Err(Errno(libc::EADDRNOTAVAIL)));
        assert_eq!(parse(&[9, 0, 0, 0]), Err(Errno(libc::EAFNOSUPPORT)));
        assert_eq!(parse(&[2]), Err(Errno::EINVAL));
        assert_eq!(parse(&AF_IB.to_ne_bytes()), Err(Errno::EINVAL));
        for n in 0..60 {
            let _ = parse(&vec![0x1b; n]);
        }
    }

    #[test]
    fn the_cma_header_carries_both_addresses() {
        let src = Addr::v4(Ipv4Addr::new(127, 0, 0, 2), 40000);
        let dst = Addr::v4(Ipv4Addr::new(127, 0, 0, 1), 7174);
        let h = cma_hdr(&src, &dst);
        assert_eq!(parse_cma_hdr(&h, 7174), Some((src, dst)));
        assert_eq!(parse_cma_hdr(&h[..20], 7174), None);
    }
}
