//! The network interface an emulated device's port sits on: its RoCE netdev. On a host with a
//! ConnectX the RoCE port's netdev is the Ethernet interface of the same PCI function, the one
//! that holds the addresses the port's GIDs are made from; programs find it through sysfs
//! (`device/net/<name>`, `gid_attrs/ndevs`), RDMA netlink and `getifaddrs`, and the port's active
//! MTU follows its MTU. The emulated device's GID is made from its address (`--ip`), so its
//! netdev is the interface that holds that address — a veth or dummy interface where the user
//! gave it one, `lo` for the loopback addresses the emulation uses by default.

use std::ffi::CStr;
use std::net::Ipv4Addr;

/// The interface of an address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Netdev {
    /// Interface name (`lo`, `veth0`, ...).
    pub name: String,
    /// Interface index (0 when the kernel has none by that name).
    pub index: u32,
    /// Its MTU (bytes of an IP datagram).
    pub mtu: u32,
    /// Whether it is a loopback interface: not a RoCE port's netdev (sysfs shows no
    /// `device/net` entry for it, as no PCI function owns `lo`).
    pub loopback: bool,
}

impl Netdev {
    /// The loopback interface (what a 127/8 address that no interface holds is routed to).
    fn lo() -> Self {
        Self {
            name: "lo".into(),
            index: index_of("lo").unwrap_or(1),
            mtu: mtu_of("lo").unwrap_or(65536),
            loopback: true,
        }
    }
}

/// The interface index of `name`.
fn index_of(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: `c` is a NUL-terminated string that lives across the call.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// The MTU of interface `name` (`SIOCGIFMTU`, which answers in the caller's network namespace
/// whatever sysfs shows).
fn mtu_of(name: &str) -> Option<u32> {
    let b = name.as_bytes();
    if b.len() >= libc::IFNAMSIZ {
        return None;
    }
    // SAFETY: a plain socket call; the fd is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: ifreq is plain data; zero is a valid value of every field.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b) {
        *d = *s as libc::c_char;
    }
    // SAFETY: `fd` is an open socket, `req` a live ifreq with a NUL-terminated name
    // (IFNAMSIZ bytes, the name shorter); SIOCGIFMTU writes only `ifru_mtu`.
    let r = unsafe { libc::ioctl(fd, libc::SIOCGIFMTU, &mut req) };
    // SAFETY: `fd` was opened above and is closed once.
    unsafe { libc::close(fd) };
    // SAFETY: SIOCGIFMTU succeeded, so the union holds the MTU.
    let mtu = unsafe { req.ifr_ifru.ifru_mtu };
    (r == 0 && mtu > 0).then_some(mtu as u32)
}

/// The interface that holds `ip` (`getifaddrs`); `lo` when none does (a loopback address the
/// host routes to `lo`, or an address this host does not have, which the device cannot bind).
pub fn of(ip: Ipv4Addr) -> Netdev {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a list we free below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Netdev::lo();
    }
    let mut found = None;
    let mut p = list;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr of the family it names.
        if unsafe { (*ifa.ifa_addr).sa_family } as i32 != libc::AF_INET {
            continue;
        }
        // SAFETY: an AF_INET address is a sockaddr_in.
        let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        if Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)) == ip {
            // SAFETY: ifa_name is a NUL-terminated string of the list.
            let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
                .to_string_lossy()
                .into_owned();
            found = Some((name, ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0));
            break;
        }
    }
    // SAFETY: `list` came from getifaddrs and is freed once; no reference into it survives.
    unsafe { libc::freeifaddrs(list) };
    match found {
        Some((name, loopback)) => Netdev {
            index: index_of(&name).unwrap_or(0),
            mtu: mtu_of(&name).unwrap_or(1500),
            name,
            loopback,
        },
        None => Netdev::lo(),
    }
}

/// The RoCE MTU (IB MTU enum: 1 = 256 .. 5 = 4096) a port on a netdev of `mtu` bytes
/// reports active, as the kernel's `iboe_get_mtu` computes it: the largest IB MTU that fits
/// once the GRH, UDP, BTH, the largest extended headers and the ICRC are taken off.
pub fn active_ib_mtu(mtu: u32) -> u8 {
    const OVERHEAD: u32 = 40 + 8 + 12 + 28 + 4 + 4;
    let room = mtu.saturating_sub(OVERHEAD);
    match room {
        4096.. => 5,
        2048.. => 4,
        1024.. => 3,
        512.. => 2,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_addresses_are_on_lo_and_mtus_map_as_the_kernel_maps_them() {
        let n = of(Ipv4Addr::new(127, 0, 0, 1));
        assert!(n.loopback, "{n:?}");
        assert_eq!(of(Ipv4Addr::new(127, 0, 231, 9)).name, n.name);
        assert_eq!(active_ib_mtu(1500), 3);
        assert_eq!(active_ib_mtu(9000), 5);
        assert_eq!(active_ib_mtu(65536), 5);
        assert_eq!(active_ib_mtu(4096 + 95), 4);
        assert_eq!(active_ib_mtu(4096 + 96), 5);
        assert_eq!(active_ib_mtu(0), 1);
    }
}
