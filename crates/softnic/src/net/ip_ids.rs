//! The real IPv4 identifications of received datagrams, for the ICRC check. The ICRC covers
//! the identification, which a UDP socket never shows. Soft NICs send identifications 0..63
//! (see [`super::packet::icrc_ip_id`]); a NIC that numbers its IPv4 identifications (a
//! hardware RoCE NIC may) needs the real header. Where the process may open a raw IPv4
//! socket (`CAP_NET_RAW`), a copy of every datagram to the device's UDP ports comes with its
//! IPv4 header: the identification is taken from there. The raw socket is opened at the
//! first datagram whose ICRC fits no identification 0..63 (a soft NIC peer never costs the
//! copies), so the datagrams before it are dropped as corrupted and resent by the peer.
//! Where it may not, only 0..63 are accepted (`docs/wire.md`). Part of [`crate::net`], used
//! by the port's ingress (`socket`).

use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Identifications remembered (the newest), enough for a window of packets from each of a
/// few peers.
const REMEMBERED: usize = 8192;

/// What identifies a datagram: its source address and port, destination port and BTH.
type Key = (Ipv4Addr, u16, u16, [u8; 12]);

/// A raw IPv4 socket that sees the datagrams to a set of UDP ports, and the identifications it
/// saw.
pub(crate) struct IpIds {
    fd: OwnedFd,
    seen: HashMap<Key, u16>,
    order: VecDeque<Key>,
    buf: Vec<u8>,
}

impl IpIds {
    /// A raw socket for UDP datagrams to `ip` at `ports`; `None` where the process may not
    /// open one.
    pub(crate) fn open(ip: Ipv4Addr, ports: &[u16]) -> Option<Self> {
        // SAFETY: plain socket(2) call; the descriptor is checked, then owned.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_UDP) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let prog = filter(ip, ports);
        let fprog = libc::sock_fprog {
            len: prog.len() as u16,
            filter: prog.as_ptr() as *mut libc::sock_filter,
        };
        // SAFETY: `fprog` points to `prog`, both live for the call (the kernel copies them).
        let ok = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                (&fprog as *const libc::sock_fprog).cast(),
                std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
            )
        } == 0;
        if !ok {
            // unfiltered it would copy every UDP datagram of the host
            return None;
        }
        Some(Self {
            fd,
            seen: HashMap::new(),
            order: VecDeque::new(),
            buf: vec![0; 1 << 16],
        })
    }

    /// The identification of the IPv4 packet that carried the datagram (or began the
    /// coalesced run) from `src:sport` to `dport` whose BTH is `bth`, if the raw socket saw it.
    pub(crate) fn lookup(
        &mut self,
        src: Ipv4Addr,
        sport: u16,
        dport: u16,
        bth: &[u8],
    ) -> Option<u16> {
        self.drain();
        let bth: [u8; 12] = bth.get(..12)?.try_into().ok()?;
        self.seen.get(&(src, sport, dport, bth)).copied()
    }

    /// Reads what the raw socket holds.
    fn drain(&mut self) {
        loop {
            // SAFETY: `buf` is live and writable for its length during the call.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr().cast(),
                    self.buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                return;
            }
            if let Some((key, id)) = parse(&self.buf[..n as usize]) {
                if self.seen.insert(key, id).is_none() {
                    self.order.push_back(key);
                }
                while self.order.len() > REMEMBERED {
                    if let Some(old) = self.order.pop_front() {
                        self.seen.remove(&old);
                    }
                }
            }
        }
    }
}

/// The key and identification of an IPv4 packet as a raw socket reads it (header included).
fn parse(p: &[u8]) -> Option<(Key, u16)> {
    let ihl = (*p.first()? as usize & 0xf) * 4;
    if p.len() < ihl + 8 + 12 || ihl < 20 || p[9] != 17 {
        return None;
    }
    let id = u16::from_be_bytes([p[4], p[5]]);
    let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
    let udp = &p[ihl..];
    let sport = u16::from_be_bytes([udp[0], udp[1]]);
    let dport = u16::from_be_bytes([udp[2], udp[3]]);
    let bth: [u8; 12] = udp[8..20].try_into().ok()?;
    Some(((src, sport, dport, bth), id))
}

/// A classic BPF program over an IPv4 packet: UDP to `ip` at one of `ports`, whole; all else
/// dropped. Layout: 0 load the protocol, 1 not UDP → drop, 2 load the destination, 3 not `ip`
/// → drop, 4 X = header length, 5 load the UDP destination port, 6.. one test per port (a
/// match → accept), then drop (`6 + n`) and accept (`7 + n`). Jumps count from the next
/// instruction.
fn filter(ip: Ipv4Addr, ports: &[u16]) -> Vec<libc::sock_filter> {
    const LD_B_ABS: u16 = 0x30;
    const LD_W_ABS: u16 = 0x20;
    const LDX_B_MSH: u16 = 0xb1;
    const LD_H_IND: u16 = 0x48;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    let op = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let n = ports.len().min(200) as u8;
    let drop = 6 + n;
    let mut v = vec![
        op(LD_B_ABS, 0, 0, 9),
        op(JEQ_K, 0, drop - 2, 17),
        op(LD_W_ABS, 0, 0, 16),
        op(JEQ_K, 0, drop - 4, u32::from(ip)),
        op(LDX_B_MSH, 0, 0, 0),
        op(LD_H_IND, 0, 0, 2),
    ];
    for (i, p) in ports.iter().take(n as usize).enumerate() {
        v.push(op(JEQ_K, n - i as u8, 0, *p as u32));
    }
    v.push(op(RET_K, 0, 0, 0));
    v.push(op(RET_K, 0, 0, 0xffff));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_raw_ipv4_udp_packet() {
        let mut p = vec![0u8; 20 + 8 + 16];
        p[0] = 0x45;
        p[4..6].copy_from_slice(&4242u16.to_be_bytes());
        p[9] = 17;
        p[12..16].copy_from_slice(&[10, 0, 0, 2]);
        p[20..22].copy_from_slice(&50000u16.to_be_bytes());
        p[22..24].copy_from_slice(&4791u16.to_be_bytes());
        p[28..40].copy_from_slice(&[7; 12]);
        let ((src, sport, dport, bth), id) = parse(&p).unwrap();
        assert_eq!(
            (src, sport, dport, bth, id),
            (Ipv4Addr::new(10, 0, 0, 2), 50000, 4791, [7; 12], 4242)
        );
        p[9] = 6;
        assert!(parse(&p).is_none());
        assert!(parse(&p[..30]).is_none());
        assert!(parse(&[]).is_none());
    }
}
