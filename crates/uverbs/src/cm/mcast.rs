//! Multicast joins, as `ucma.c` (`ucma_process_join`, `ucma_leave_multicast`) and `cma.c`
//! (`rdma_join_multicast`, `cma_iboe_join_multicast`, `cma_make_mc_event`) serve them on a
//! RoCE v2 port: the group's IPv4 address maps to the IPv4-mapped multicast GID
//! (`cma_iboe_set_mgid`), and the MULTICAST_JOIN event carries the address vector to it (GRH,
//! hop limit 64, the id's source GID index 0, port 1), QPN 0xFFFFFF and the id's Q_Key
//! (`RDMA_UDP_QKEY`). The kernel's IGMP join on the netdev is made by the soft NIC when
//! librdmacm attaches the id's QP (`ibv_attach_mcast`, which it calls on the event): a join
//! the host refuses fails that ATTACH_MCAST, and librdmacm reports MULTICAST_ERROR.

use super::abi::{self, event};
use super::addr::{AF_IB, AF_INET, AF_INET6};
use super::agent::{self, UDP_QKEY};
use super::{id_mut, plain_event, respond, Cm, CmFile, Queued, St};
use crate::uaccess::Errno;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// `RDMA_MC_JOIN_FLAG_FULLMEMBER`.
pub(super) const FULLMEMBER: u16 = 0;
/// `RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER`.
const SENDONLY_FULLMEMBER: u16 = 1;
/// The kernel's ENOTSUPP (524): a RoCE v2 port joins IPv4 groups only.
const ENOTSUPP: Errno = Errno(524);

/// One group an id joined.
pub(super) struct Mc {
    handle: u32,
    uid: u64,
    /// Events of the group read (LEAVE_MCAST's answer).
    reported: Arc<AtomicU32>,
}

/// A JOIN_IP_MCAST or JOIN_MCAST.
pub(super) struct Join<'a> {
    pub response: u64,
    pub uid: u64,
    pub id: u32,
    /// The socket address (at most its buffer's bytes).
    pub addr: &'a [u8],
    /// JOIN_MCAST's `addr_size` (JOIN_IP_MCAST: the family's size).
    pub addr_size: Option<u16>,
    pub join_flags: u16,
}

/// `rdma_addr_size`: the bytes of a socket address of `family` (0: unknown).
fn addr_size(family: u16) -> usize {
    match family {
        AF_INET => 16,
        AF_INET6 => 28,
        AF_IB => 48,
        _ => 0,
    }
}

/// The group's IPv4 address, checked as the kernel checks a join: an address of the size its
/// family gives (EINVAL), IPv4 only on RoCE v2 (ENOTSUPP), not 0.0.0.0 (EINVAL), and, for a
/// full member (who joins with IGMP), a multicast address (`ip_mc_join_group`: EINVAL).
fn group_of(j: &Join<'_>) -> Result<Ipv4Addr, Errno> {
    if j.addr.len() < 2 {
        return Err(Errno::EINVAL);
    }
    let family = u16::from_ne_bytes([j.addr[0], j.addr[1]]);
    let size = addr_size(family);
    let size_ok = match j.addr_size {
        Some(n) => size != 0 && n as usize == size,
        None => size != 0 && size <= 28,
    };
    if !size_ok || j.addr.len() < size {
        return Err(Errno::EINVAL);
    }
    if family != AF_INET {
        return Err(ENOTSUPP);
    }
    let ip = Ipv4Addr::new(j.addr[4], j.addr[5], j.addr[6], j.addr[7]);
    if ip.is_unspecified() || (j.join_flags == FULLMEMBER && !ip.is_multicast()) {
        return Err(Errno::EINVAL);
    }
    Ok(ip)
}

/// JOIN_IP_MCAST / JOIN_MCAST: the group's handle in the answer, and the MULTICAST_JOIN
/// event queued. A short answer room: ENOSPC; join flags other than full member or send-only
/// full member: EINVAL; an id without a device, not address-bound or resolved, or not UD:
/// EINVAL (`rdma_join_multicast`).
pub(super) fn join(cm: &Cm, file: &Arc<CmFile>, j: &Join<'_>, out: usize) -> Result<(), Errno> {
    if out < 4 {
        return Err(Errno::ENOSPC);
    }
    if j.join_flags != FULLMEMBER && j.join_flags != SENDONLY_FULLMEMBER {
        return Err(Errno::EINVAL);
    }
    let mut st = cm.st.lock();
    let handle = st.last_mc.wrapping_add(1).max(1);
    let id = id_mut(&mut st, file, j.id)?;
    if id.dev.is_none() || !matches!(id.st, St::AddrBound | St::AddrResolved) || !id.is_ud() {
        return Err(Errno::EINVAL);
    }
    let ip = group_of(j)?;
    respond(j.response, out, &handle)?;
    let mgid = verbs::Gid::from_ipv4(ip).0;
    let mut u: abi::UdParam = bytemuck::Zeroable::zeroed();
    u.qp_num = softnic::mcast::MCAST_QPN;
    u.qkey = UDP_QKEY;
    u.ah_attr = agent::ah_attr(mgid, 0);
    let mut e = plain_event(event::MULTICAST_JOIN, 0);
    e.set_ud(&u);
    e.uid = j.uid;
    e.id = handle;
    let mc = Mc {
        handle,
        uid: j.uid,
        reported: Arc::new(AtomicU32::new(0)),
    };
    id.file.push(Queued {
        resp: e,
        owner: id.handle,
        counter: id.reported.clone(),
        child: None,
        mc: Some((handle, mc.reported.clone())),
    });
    if crate::tracing() {
        crate::complain(format_args!(
            "rdma_cm: id {} joined {ip} (group {handle}, uid {:#x})",
            id.handle, mc.uid
        ));
    }
    id.mcs.push(mc);
    st.last_mc = handle;
    Ok(())
}

/// LEAVE_MCAST (its body `rdma_ucm_destroy_id`, naming the group's handle): the group's
/// unread events dropped, the events of it read in the answer. An unknown group: ENOENT;
/// another file's: EINVAL; a short answer room: ENOSPC.
pub(super) fn leave(
    cm: &Cm,
    file: &Arc<CmFile>,
    d: &abi::Destroy,
    out: usize,
) -> Result<(), Errno> {
    if out < 4 {
        return Err(Errno::ENOSPC);
    }
    let mut st = cm.st.lock();
    let id = st
        .ids
        .values_mut()
        .find(|i| i.mcs.iter().any(|m| m.handle == d.handle))
        .ok_or(Errno::ENOENT)?;
    if !Arc::ptr_eq(&id.file, file) {
        return Err(Errno::EINVAL);
    }
    let at = id
        .mcs
        .iter()
        .position(|m| m.handle == d.handle)
        .ok_or(Errno::ENOENT)?;
    let mc = id.mcs.remove(at);
    id.file.purge_mc(mc.handle);
    respond(d.response, out, &mc.reported.load(Ordering::Acquire))
}
