//! Multicast groups of this process's soft devices: which UD QPs are attached to which
//! multicast GID, and each device's socket for an IPv4 group (the join on its interface).
//! The UD data path (`ud`) sends to and takes from the groups kept here; the verbs
//! (`Device::attach_mcast`) are in `mcast`, which explains the whole.

use crate::counters::Counters;
use crate::net::packet;
use crate::net::socket::Port;
use crate::qp::Qp;
use crate::shared::Shared;
use crate::{Error, Gid, WireError};
use parking_lot::Mutex;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// The destination QPN of a multicast packet (IBTA).
pub const MCAST_QPN: u32 = 0xFF_FFFF;

/// How a QP attaches.
#[derive(Clone, Copy, Debug, Default)]
pub struct McastAttach {
    /// The QP does not take its own multicast datagrams
    /// (`IBV_QP_CREATE_BLOCK_SELF_MCAST_LB`, mlx5's `block_lb_mc`).
    pub block_self_loopback: bool,
}

/// Whether `g` is a multicast GID: `ff00::/8`, or an IPv4-mapped address in 224.0.0.0/4
/// (the kernel's `rdma_is_multicast_addr`).
pub fn is_multicast(g: &Gid) -> bool {
    g.0[0] == 0xff || group_ipv4(g).is_some()
}

/// The IPv4 group address of an IPv4-mapped multicast GID.
pub fn group_ipv4(g: &Gid) -> Option<Ipv4Addr> {
    g.to_ipv4().filter(|a| a.is_multicast())
}

/// One QP attached to one group.
pub(crate) struct Member {
    pub dev: Weak<Shared>,
    pub qp: Weak<Qp>,
    pub qpn: u32,
    pub mgid: Gid,
    pub block_self: bool,
}

impl Member {
    /// Whether it is a QP of `d`.
    pub fn of(&self, d: &Shared) -> bool {
        std::ptr::eq(self.dev.as_ptr(), d)
    }
}

/// A device's socket for one IPv4 group, read by a thread of its own.
struct Joined {
    dev: Weak<Shared>,
    mgid: Gid,
    stop: Arc<AtomicBool>,
}

/// What takes a group socket's datagrams: (device, group, source, bytes).
pub(crate) type OnGroupPacket = fn(&Shared, Ipv4Addr, SocketAddr, &[u8]);

/// Every attachment of this process.
static MEMBERS: Mutex<Vec<Member>> = Mutex::new(Vec::new());
/// Every group socket of this process.
static JOINED: Mutex<Vec<Joined>> = Mutex::new(Vec::new());
/// Ports whose sockets send multicast on their own interface.
static TX_READY: Mutex<Vec<Weak<Port>>> = Mutex::new(Vec::new());

/// Attaches `qp` of `dev` to `mgid` (again: a no-op). A device with a wire port joins an
/// IPv4 group with its first QP: its socket for the group takes the datagrams to `on_rx`.
pub(crate) fn attach(
    dev: &Arc<Shared>,
    qp: &Arc<Qp>,
    mgid: Gid,
    how: McastAttach,
    on_rx: OnGroupPacket,
) -> Result<(), Error> {
    if !is_multicast(&mgid) {
        return Err(Error::InvalidArgument("not a multicast GID"));
    }
    if !qp.is_ud() {
        return Err(Error::InvalidArgument("multicast needs a UD QP"));
    }
    let mut m = MEMBERS.lock();
    m.retain(|x| x.qp.strong_count() > 0);
    if m.iter()
        .any(|x| x.qpn == qp.qpn && x.mgid == mgid && x.of(dev))
    {
        return Ok(());
    }
    if let (Some(port), Some(group)) = (dev.port(), group_ipv4(&mgid)) {
        let mut j = JOINED.lock();
        if !j
            .iter()
            .any(|x| x.mgid == mgid && std::ptr::eq(x.dev.as_ptr(), &**dev))
        {
            let stop = join(dev, port.ip, group, on_rx)?;
            j.push(Joined {
                dev: Arc::downgrade(dev),
                mgid,
                stop,
            });
        }
    }
    m.push(Member {
        dev: Arc::downgrade(dev),
        qp: Arc::downgrade(qp),
        qpn: qp.qpn,
        mgid,
        block_self: how.block_self_loopback,
    });
    tracing::debug!(qpn = qp.qpn, %mgid, "QP attached to a multicast group");
    Ok(())
}

/// Detaches `qp` of `dev` from `mgid`; the device leaves the group with its last QP. Not
/// attached: `InvalidArgument`.
pub(crate) fn detach(dev: &Shared, qp: &Qp, mgid: Gid) -> Result<(), Error> {
    let mut m = MEMBERS.lock();
    let before = m.len();
    m.retain(|x| !(x.qpn == qp.qpn && x.mgid == mgid && x.of(dev)));
    if m.len() == before {
        return Err(Error::InvalidArgument("QP not attached to that group"));
    }
    leave_unused(&m);
    Ok(())
}

/// Detaches `qp` of `dev` from every group.
pub(crate) fn detach_all(dev: &Shared, qp: &Qp) {
    let mut m = MEMBERS.lock();
    m.retain(|x| !(x.qpn == qp.qpn && x.of(dev)) && x.qp.strong_count() > 0);
    leave_unused(&m);
}

/// The live QPs attached to `mgid` that `keep` accepts, with their devices.
pub(crate) fn members(mgid: &Gid, keep: impl Fn(&Member) -> bool) -> Vec<(Arc<Shared>, Arc<Qp>)> {
    MEMBERS
        .lock()
        .iter()
        .filter(|m| m.mgid == *mgid && keep(m))
        .filter_map(|m| Some((m.dev.upgrade()?, m.qp.upgrade()?)))
        .collect()
}

/// Closes the group sockets no attached QP needs any more (the thread sees its stop flag).
fn leave_unused(m: &[Member]) {
    JOINED.lock().retain(|j| {
        let used = j.dev.strong_count() > 0
            && m.iter()
                .any(|x| x.mgid == j.mgid && std::ptr::eq(x.dev.as_ptr(), j.dev.as_ptr()));
        if !used {
            j.stop.store(true, Ordering::Release);
        }
        used
    });
}

/// Opens device `dev`'s socket for `group` on interface address `ifaddr`, joins, and starts
/// the thread that reads it. Returns the thread's stop flag.
fn join(
    dev: &Arc<Shared>,
    ifaddr: Ipv4Addr,
    group: Ipv4Addr,
    on_rx: OnGroupPacket,
) -> Result<Arc<AtomicBool>, Error> {
    let wire = |e: std::io::Error| Error::Wire(WireError::Socket(e));
    let sock = group_socket(ifaddr, group).map_err(wire)?;
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .map_err(wire)?;
    let stop = Arc::new(AtomicBool::new(false));
    let (w, s) = (Arc::downgrade(dev), stop.clone());
    std::thread::Builder::new()
        .name(format!("{}-mc", dev.name))
        .spawn(move || rx_thread(w, sock, group, s, on_rx))?;
    Ok(stop)
}

fn setsockopt<T>(fd: i32, level: i32, name: i32, v: &T) -> std::io::Result<()> {
    // SAFETY: `v` is a live value of the option's type, passed with its size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (v as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A UDP socket bound to `group`:4791 that takes the group's datagrams arriving on the
/// interface of `ifaddr` only (SO_REUSEADDR: the other ports of this host join too;
/// IP_MULTICAST_ALL off: no datagrams of groups only another socket joined).
fn group_socket(ifaddr: Ipv4Addr, group: Ipv4Addr) -> std::io::Result<UdpSocket> {
    // SAFETY: plain system call; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a socket just made and owned by nobody else.
    let sock: UdpSocket = unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, &1i32)?;
    let addr = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: packet::ROCE_PORT.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(group).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `addr` is a live sockaddr_in passed with its size.
    let r = unsafe {
        libc::bind(
            fd,
            (&addr as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    setsockopt(fd, libc::IPPROTO_IP, libc::IP_MULTICAST_ALL, &0i32)?;
    sock.join_multicast_v4(&group, &ifaddr)?;
    Ok(sock)
}

/// Reads a group socket until the device closes or the group is left; the socket closes
/// with the thread (the kernel leaves the group then).
fn rx_thread(
    dev: Weak<Shared>,
    sock: UdpSocket,
    group: Ipv4Addr,
    stop: Arc<AtomicBool>,
    on_rx: OnGroupPacket,
) {
    let mut buf = vec![0u8; packet::MAX_DATAGRAM + 1];
    while !stop.load(Ordering::Acquire) {
        match sock.recv_from(&mut buf) {
            Ok((n, from)) => {
                let Some(d) = dev.upgrade() else { return };
                if d.shutdown.load(Ordering::Acquire) {
                    return;
                }
                if !stop.load(Ordering::Acquire) {
                    on_rx(&d, group, from, &buf[..n]);
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                if dev.strong_count() == 0 {
                    return;
                }
            }
            Err(e) => {
                let Some(d) = dev.upgrade() else { return };
                Counters::add(&d.counters.wire.rx_malformed, 1);
                tracing::debug!(%group, error = %e, "multicast socket: receive failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Makes the port's sockets send multicast on the port's own interface (not the route's),
/// with the RoCE hop limit as TTL and loopback on (the host's other joined ports, this one's
/// included, get a copy). Once per port.
pub(crate) fn enable_tx(port: &Arc<Port>) {
    let mut done = TX_READY.lock();
    done.retain(|p| p.strong_count() > 0);
    if done.iter().any(|p| std::ptr::eq(p.as_ptr(), &**port)) {
        return;
    }
    let ifaddr = libc::in_addr {
        s_addr: u32::from(port.ip).to_be(),
    };
    for p in port.pollfds() {
        let r = setsockopt(p.fd, libc::IPPROTO_IP, libc::IP_MULTICAST_IF, &ifaddr)
            .and_then(|_| setsockopt(p.fd, libc::IPPROTO_IP, libc::IP_MULTICAST_TTL, &64i32))
            .and_then(|_| setsockopt(p.fd, libc::IPPROTO_IP, libc::IP_MULTICAST_LOOP, &1i32));
        if let Err(e) = r {
            tracing::debug!(error = %e, "multicast send options refused");
        }
    }
    done.push(Arc::downgrade(port));
}
