//! The ucma `write()` commands, each answered as `drivers/infiniband/core/ucma.c` (over
//! `cma.c`) answers it: the same errno for the same mistake (a short command EINVAL, a short
//! response ENOSPC, an unknown id ENOENT, another file's id EINVAL, a command out of turn
//! EINVAL), the same events.

use super::abi::{self, cmd, event, ps, query, EventResp, UserPathRec};
use super::addr::{self, Addr, AF_IB};
use super::agent::{self, PACKET_LIFETIME};
use super::{id_mut, plain_event, respond, Cm, CmFile, Id, St, State};
use crate::uaccess::{copy_from_user, copy_to_user, Errno};
use bytemuck::Pod;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The largest backlog a listener gets (the kernel's `max_backlog` default).
const MAX_BACKLOG: u32 = 1024;

/// Runs command `c` with its body and the response room `out`.
pub(super) fn run(
    cm: &'static Cm,
    file: &Arc<CmFile>,
    c: u32,
    body: &[u8],
    out: usize,
    file_of: &dyn Fn(RawFd) -> Option<Arc<CmFile>>,
) -> Result<(), Errno> {
    match c {
        cmd::CREATE_ID => create_id(cm, file, read(body)?, out),
        cmd::DESTROY_ID => {
            let d: abi::Destroy = read(body)?;
            if out < 4 {
                return Err(Errno::ENOSPC);
            }
            id_mut(&mut cm.st.lock(), file, d.handle)?;
            let n = cm.destroy(d.handle).ok_or(Errno::ENOENT)?;
            respond(d.response, out, &n)
        }
        cmd::BIND_IP => {
            let b: abi::BindIp = read(body)?;
            bind(cm, file, b.id, addr::parse(&b.addr)?)
        }
        cmd::BIND => {
            let b: abi::Bind = read(body)?;
            let n = (b.addr_size as usize).min(b.addr.len());
            bind(cm, file, b.id, addr::parse(&b.addr[..n])?)
        }
        cmd::RESOLVE_IP => {
            let r: abi::ResolveIp = read(body)?;
            let src = optional(&r.src_addr)?;
            resolve_addr(cm, file, r.id, src, addr::parse(&r.dst_addr)?)
        }
        cmd::RESOLVE_ADDR => {
            let r: abi::ResolveAddr = read(body)?;
            let n = (r.src_size as usize).min(r.src_addr.len());
            let src = optional(&r.src_addr[..n])?;
            let n = (r.dst_size as usize).min(r.dst_addr.len());
            resolve_addr(cm, file, r.id, src, addr::parse(&r.dst_addr[..n])?)
        }
        cmd::RESOLVE_ROUTE => {
            let r: abi::IdAnd32 = read(body)?;
            let mut st = cm.st.lock();
            let id = id_mut(&mut st, file, r.id)?;
            if id.st != St::AddrResolved {
                return Err(Errno::EINVAL);
            }
            id.st = St::RouteResolved;
            id.event(plain_event(event::ROUTE_RESOLVED, 0), None);
            Ok(())
        }
        cmd::QUERY_ROUTE => {
            let q: abi::RespIdAnd32 = read(body)?;
            query_route(cm, file, &q, out)
        }
        cmd::QUERY => {
            let q: abi::RespIdAnd32 = read(body)?;
            match q.value {
                query::ADDR | query::GID => query_addr(cm, file, &q, out),
                query::PATH => query_path(cm, file, &q, out),
                _ => Err(Errno::ENOSYS),
            }
        }
        cmd::LISTEN => {
            let l: abi::IdAnd32 = read(body)?;
            listen(cm, file, l.id, l.value)
        }
        cmd::CONNECT => {
            // the ECE fields at the end are optional (older libraries)
            let c: abi::Connect = read_padded(body, 280)?;
            if c.conn_param.valid == 0 {
                return Err(Errno::EINVAL);
            }
            let mut st = cm.st.lock();
            id_mut(&mut st, file, c.id)?;
            cm.connect(&mut st, c.id, &c.conn_param)
        }
        cmd::ACCEPT => {
            let a: abi::Accept = read_padded(body, 288)?;
            let mut st = cm.st.lock();
            id_mut(&mut st, file, a.id)?;
            cm.accept(&mut st, a.id, &a)
        }
        cmd::REJECT => {
            let r: abi::Reject = read(body)?;
            let mut st = cm.st.lock();
            id_mut(&mut st, file, r.id)?;
            cm.reject(&mut st, r.id, &r)
        }
        cmd::DISCONNECT => {
            let id = u32::from_ne_bytes(read::<[u8; 4]>(body)?);
            let mut st = cm.st.lock();
            id_mut(&mut st, file, id)?;
            cm.disconnect(&mut st, id)
        }
        cmd::INIT_QP_ATTR => {
            let q: abi::RespIdAnd32 = read(body)?;
            if out < std::mem::size_of::<abi::QpAttr>() {
                return Err(Errno::ENOSPC);
            }
            // IB_QPS_ERR is the last state
            if q.value > 6 {
                return Err(Errno::EINVAL);
            }
            let mut st = cm.st.lock();
            let a = cm.init_qp_attr(id_mut(&mut st, file, q.id)?, q.value)?;
            respond(q.response, out, &a)
        }
        cmd::GET_EVENT => get_event(cm, file, read::<[u8; 8]>(body)?, out),
        cmd::SET_OPTION => set_option(cm, file, &read(body)?),
        cmd::NOTIFY => {
            let n: abi::IdAnd32 = read(body)?;
            let mut st = cm.st.lock();
            if id_mut(&mut st, file, n.id)?.dev.is_none() {
                return Err(Errno::EINVAL);
            }
            cm.notify(&mut st, n.id, n.value)
        }
        cmd::MIGRATE_ID => migrate(cm, file, &read(body)?, out, file_of),
        cmd::JOIN_IP_MCAST => {
            let j: abi::JoinIpMcast = read(body)?;
            let join = super::mcast::Join {
                response: j.response,
                uid: j.uid,
                id: j.id,
                addr: &j.addr,
                addr_size: None,
                join_flags: super::mcast::FULLMEMBER,
            };
            super::mcast::join(cm, file, &join, out)
        }
        cmd::JOIN_MCAST => {
            let j: abi::JoinMcast = read(body)?;
            let join = super::mcast::Join {
                response: j.response,
                uid: j.uid,
                id: j.id,
                addr: &j.addr,
                addr_size: Some(j.addr_size),
                join_flags: j.join_flags,
            };
            super::mcast::join(cm, file, &join, out)
        }
        cmd::LEAVE_MCAST => super::mcast::leave(cm, file, &read(body)?, out),
        // the kernel's ucma has no GET_OPTION
        cmd::GET_OPTION => Err(Errno::ENOSYS),
        _ => Err(Errno::EINVAL),
    }
}

/// A command struct from the body: EINVAL when the body is shorter.
fn read<T: Pod>(body: &[u8]) -> Result<T, Errno> {
    let n = std::mem::size_of::<T>();
    if body.len() < n {
        return Err(Errno::EINVAL);
    }
    Ok(bytemuck::pod_read_unaligned(&body[..n]))
}

/// A command struct of which at least `min` bytes came (the rest zero).
fn read_padded<T: Pod>(body: &[u8], min: usize) -> Result<T, Errno> {
    if body.len() < min {
        return Err(Errno::EINVAL);
    }
    let mut v: T = bytemuck::Zeroable::zeroed();
    let b = bytemuck::bytes_of_mut(&mut v);
    let n = b.len().min(body.len());
    b[..n].copy_from_slice(&body[..n]);
    Ok(v)
}

/// An optional source address (family 0: none).
fn optional(b: &[u8]) -> Result<Option<Addr>, Errno> {
    if b.len() < 2 || u16::from_ne_bytes([b[0], b[1]]) == 0 {
        return Ok(None);
    }
    addr::parse(b).map(Some)
}

fn create_id(
    cm: &'static Cm,
    file: &Arc<CmFile>,
    c: abi::CreateId,
    out: usize,
) -> Result<(), Errno> {
    if out < 4 {
        return Err(Errno::ENOSPC);
    }
    let qp_type = match c.ps {
        ps::TCP => agent::QPT_RC,
        ps::UDP | ps::IPOIB => agent::QPT_UD,
        ps::IB if c.qp_type == agent::QPT_RC || c.qp_type == agent::QPT_UD => c.qp_type,
        _ => return Err(Errno::EINVAL),
    };
    let h = {
        let mut st = cm.st.lock();
        let h = st.next_id;
        st.next_id = st.next_id.wrapping_add(1);
        st.ids
            .insert(h, Id::new(h, file.clone(), c.uid, c.ps, qp_type));
        h
    };
    respond(c.response, out, &h).inspect_err(|_| {
        cm.destroy(h);
    })
}

/// Binds id `h` (BIND, BIND_IP).
fn bind(cm: &'static Cm, file: &Arc<CmFile>, h: u32, a: Addr) -> Result<(), Errno> {
    let mut st = cm.st.lock();
    if id_mut(&mut st, file, h)?.st != St::Idle {
        return Err(Errno::EINVAL);
    }
    do_bind(cm, &mut st, h, a)
}

/// Binds an idle id to `a`: its device (when the address is a device's), its port (one picked
/// when 0). A loopback address that no emulated device has binds no device, as the unspecified
/// address does: the kernel's CMA takes every loopback address (127/8, `::1`) for "any"
/// (`cma_any_addr`), so that an id bound to `localhost` listens on every device (libfabric's
/// verbs provider binds `localhost` when it is given no address).
fn do_bind(cm: &Cm, st: &mut State, h: u32, mut a: Addr) -> Result<(), Errno> {
    let want = a.gid();
    let dev = match cm.devices.iter().find(|d| d.id.gid() == want) {
        _ if a.is_any() => None,
        Some(d) => Some(d.id.index),
        None if a.family != AF_IB && a.ip.is_loopback() => None,
        None => return Err(Errno(libc::EADDRNOTAVAIL)),
    };
    // an address that binds no device holds its port for every address
    let wild = dev.is_none();
    let ps = st.ids.get(&h).ok_or(Errno::ENOENT)?.ps;
    let in_use = |st: &State, port: u16, a: &Addr, reuse: bool| {
        st.ids.values().any(|o| {
            o.handle != h
                && o.ps == ps
                && o.holds_port
                && o.src.port == port
                && !(reuse && o.reuseaddr)
                && (wild || o.src.is_any() || o.dev.is_none() || o.src.ip == a.ip)
        })
    };
    let reuse = st.ids.get(&h).is_some_and(|i| i.reuseaddr);
    if a.port == 0 {
        let start = 32768 + (std::process::id() % 28000) as u16;
        let port = (0..28000u16)
            .map(|k| 32768 + (start - 32768 + k) % 28000)
            .find(|p| !in_use(st, *p, &a, false))
            .ok_or(Errno(libc::EADDRNOTAVAIL))?;
        a.port = port;
    } else if in_use(st, a.port, &a, reuse) {
        return Err(Errno(libc::EADDRINUSE));
    }
    if a.family == AF_IB {
        a.sid = (a.sid & a.sid_mask) | a.port as u64;
        a.sid_mask = u64::MAX;
    }
    let id = st.ids.get_mut(&h).ok_or(Errno::ENOENT)?;
    id.src = a;
    id.dst = Addr {
        family: a.family,
        ..Addr::default()
    };
    id.dev = dev;
    id.holds_port = true;
    id.st = St::AddrBound;
    Ok(())
}

/// RESOLVE_IP, RESOLVE_ADDR: the device the destination is reached from, at once
/// (ADDR_RESOLVED).
fn resolve_addr(
    cm: &'static Cm,
    file: &Arc<CmFile>,
    h: u32,
    src: Option<Addr>,
    mut dst: Addr,
) -> Result<(), Errno> {
    if dst.family == AF_IB {
        return Err(Errno::EINVAL);
    }
    let mut st = cm.st.lock();
    match id_mut(&mut st, file, h)?.st {
        St::Idle => {
            let a = src.unwrap_or(Addr {
                family: dst.family,
                ..Addr::default()
            });
            do_bind(cm, &mut st, h, a)?;
        }
        St::AddrBound => {}
        _ => return Err(Errno::EINVAL),
    }
    let id = id_mut(&mut st, file, h)?;
    if id.src.family != dst.family {
        return Err(Errno::EINVAL);
    }
    // bound to no device (any, or a loopback address): the source becomes the device's
    let wild = id.dev.is_none();
    let dev = match id.dev {
        Some(d) => d,
        None => cm
            .devices
            .iter()
            .find(|d| d.id.ip == dst.ip)
            .map_or(0, |d| d.id.index),
    };
    let ip = cm.devices.get(dev).ok_or(Errno::ENODEV)?.id.ip;
    if dst.is_any() {
        dst.ip = ip;
    }
    id.dev = Some(dev);
    if wild {
        id.src.ip = ip;
    }
    id.dst = dst;
    id.st = St::AddrResolved;
    match cm.ensure_agent(&mut st, dev) {
        Ok(()) => {
            let id = id_mut(&mut st, file, h)?;
            id.event(plain_event(event::ADDR_RESOLVED, 0), None);
        }
        Err(e) => {
            let id = id_mut(&mut st, file, h)?;
            id.st = St::AddrBound;
            id.event(plain_event(event::ADDR_ERROR, -e.0), None);
        }
    }
    Ok(())
}

fn listen(cm: &'static Cm, file: &Arc<CmFile>, h: u32, backlog: u32) -> Result<(), Errno> {
    let mut st = cm.st.lock();
    match id_mut(&mut st, file, h)?.st {
        St::AddrBound => {}
        St::Idle => do_bind(cm, &mut st, h, Addr::v4(std::net::Ipv4Addr::UNSPECIFIED, 0))?,
        _ => return Err(Errno::EINVAL),
    }
    let id = id_mut(&mut st, file, h)?;
    id.backlog = if backlog > 0 && backlog < MAX_BACKLOG {
        backlog
    } else {
        MAX_BACKLOG
    };
    id.st = St::Listen;
    let devs: Vec<u32> = match id.dev {
        Some(d) => vec![d],
        None => cm.devices.iter().map(|d| d.id.index).collect(),
    };
    for d in devs {
        if let Err(e) = cm.ensure_agent(&mut st, d) {
            crate::complain(format_args!(
                "rdma_cm: device {d} cannot take connection requests: {e}"
            ));
        }
    }
    Ok(())
}

/// The path of an id with a route (the kernel's `cma_resolve_iboe_route`).
fn path(cm: &Cm, id: &Id) -> Option<UserPathRec> {
    if !matches!(id.st, St::RouteResolved | St::Connect | St::Disconnect) {
        return None;
    }
    let dev = cm.devices.get(id.dev?)?;
    Some(UserPathRec {
        dgid: id.dst.gid(),
        sgid: dev.id.gid(),
        dlid: 0,
        slid: 0,
        raw_traffic: 0,
        flow_label: ((id.src.port as u32 * 31 + id.dst.port as u32) & 0xf_ffff).to_be(),
        reversible: 1,
        mtu: cm.path_mtu(dev.id.index) as u32,
        pkey: 0xffff,
        hop_limit: agent::HOP_LIMIT,
        traffic_class: id.tos,
        numb_path: 1,
        sl: 0,
        mtu_selector: 2,
        rate_selector: 2,
        rate: 0,
        packet_life_time_selector: 2,
        packet_life_time: PACKET_LIFETIME,
        preference: 0,
    })
}

fn query_route(
    cm: &'static Cm,
    file: &Arc<CmFile>,
    q: &abi::RespIdAnd32,
    out: usize,
) -> Result<(), Errno> {
    // up to the device index is required (older kernels' size)
    if out < 200 {
        return Err(Errno::ENOSPC);
    }
    let mut st = cm.st.lock();
    let id = id_mut(&mut st, file, q.id)?;
    let mut r: abi::QueryRouteResp = bytemuck::Zeroable::zeroed();
    let fit = |a: &Addr| {
        let mut b = [0u8; 28];
        let e = a.encode();
        let n = e.len().min(28);
        b[..n].copy_from_slice(&e[..n]);
        b
    };
    r.src_addr = fit(&id.src);
    r.dst_addr = fit(&id.dst);
    if let Some(dev) = id.dev.and_then(|d| cm.devices.get(d)) {
        r.node_guid = dev.id.node_guid.to_be();
        r.port_num = 1;
        r.ibdev_index = dev.id.index;
        match path(cm, id) {
            Some(p) => {
                r.ib_route[0] = p;
                r.num_paths = 1;
            }
            None => {
                r.ib_route[0].sgid = id.src.gid();
                r.ib_route[0].dgid = id.dst.gid();
                r.ib_route[0].pkey = 0xffff;
            }
        }
    }
    let b = bytemuck::bytes_of(&r);
    copy_to_user(q.response, &b[..out.min(b.len())])
}

/// QUERY ADDR and GID: the addresses (as socket addresses, or as `sockaddr_ib` with the GIDs),
/// the device, port and P_Key.
fn query_addr(
    cm: &'static Cm,
    file: &Arc<CmFile>,
    q: &abi::RespIdAnd32,
    out: usize,
) -> Result<(), Errno> {
    if out < std::mem::size_of::<abi::QueryAddrResp>() {
        return Err(Errno::ENOSPC);
    }
    let mut st = cm.st.lock();
    let id = id_mut(&mut st, file, q.id)?;
    let mut r: abi::QueryAddrResp = bytemuck::Zeroable::zeroed();
    let (src, dst) = if q.value == query::GID {
        let sid = |a: &Addr| (id.ps as u64) << 16 | a.port as u64;
        let as_ib = |a: &Addr, sid: u64| Addr {
            family: AF_IB,
            gid: if a.family == 0 { [0; 16] } else { a.gid() },
            sid,
            ..Addr::default()
        };
        let (s, d) = if id.src.family == AF_IB {
            (id.src, id.dst)
        } else {
            (as_ib(&id.src, sid(&id.src)), as_ib(&id.dst, sid(&id.dst)))
        };
        let mut s = s;
        s.sid_mask = 0;
        (s, d)
    } else {
        (id.src, id.dst)
    };
    let put = |to: &mut [u8; 128], a: &Addr| -> u16 {
        let e = a.encode();
        to[..e.len()].copy_from_slice(&e);
        e.len() as u16
    };
    r.src_size = put(&mut r.src_addr, &src);
    r.dst_size = put(&mut r.dst_addr, &dst);
    if let Some(dev) = id.dev.and_then(|d| cm.devices.get(d)) {
        r.node_guid = dev.id.node_guid.to_be();
        r.port_num = 1;
        r.pkey = 0xffff;
        r.ibdev_index = dev.id.index;
    }
    respond(q.response, out, &r)
}

/// QUERY PATH: the path records (one, once the route is resolved) as SA records.
fn query_path(
    cm: &'static Cm,
    file: &Arc<CmFile>,
    q: &abi::RespIdAnd32,
    out: usize,
) -> Result<(), Errno> {
    if out < 8 {
        return Err(Errno::ENOSPC);
    }
    let mut st = cm.st.lock();
    let id = id_mut(&mut st, file, q.id)?;
    let mut r = vec![0u8; 8];
    if let Some(p) = path(cm, id).filter(|_| out >= 8 + 72) {
        r[..4].copy_from_slice(&1u32.to_ne_bytes());
        // IB_PATH_GMP | IB_PATH_PRIMARY | IB_PATH_BIDIRECTIONAL
        let flags: u32 = 1 | 2 | (1 << 3) | (1 << 5);
        r.extend_from_slice(&flags.to_ne_bytes());
        r.extend_from_slice(&[0; 4]);
        r.extend_from_slice(&sa_path_record(&p));
    }
    copy_to_user(q.response, &r)
}

/// A path as the SA's 64-byte PathRecord (`ib_sa_pack_path`).
fn sa_path_record(p: &UserPathRec) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[8..24].copy_from_slice(&p.dgid);
    b[24..40].copy_from_slice(&p.sgid);
    let fl = u32::from_be(p.flow_label);
    b[44..48].copy_from_slice(&((fl & 0xf_ffff) << 8 | p.hop_limit as u32).to_be_bytes());
    b[48] = p.traffic_class;
    b[49] = 0x80 | 1; // reversible, one path
    b[50..52].copy_from_slice(&0xffffu16.to_be_bytes());
    b[52..54].copy_from_slice(&(p.sl as u16 & 0xf).to_be_bytes());
    b[54] = 2 << 6 | (p.mtu as u8 & 0x3f);
    b[55] = 2 << 6 | (p.rate & 0x3f);
    b[56] = 2 << 6 | (p.packet_life_time & 0x3f);
    b
}

fn get_event(cm: &'static Cm, file: &Arc<CmFile>, resp: [u8; 8], out: usize) -> Result<(), Errno> {
    let size = std::mem::size_of::<EventResp>();
    // without the reserved word and the ECE fields (older libraries)
    if out < size - 12 {
        return Err(Errno::ENOSPC);
    }
    // the program may sleep here: its threads stop carrying the devices
    for d in cm.devices.iter() {
        if let Some(s) = d.started() {
            s.carry_end();
        }
    }
    let e = file.next()?;
    if let Some(child) = e.child {
        let mut st = cm.st.lock();
        if let Some(c) = st.ids.get_mut(&child) {
            c.visible = true;
            let l = c.listener.take();
            if let Some(l) = l.and_then(|l| st.ids.get_mut(&l)) {
                l.pending = l.pending.saturating_sub(1);
            }
        }
    }
    let b = bytemuck::bytes_of(&e.resp);
    copy_to_user(u64::from_ne_bytes(resp), &b[..out.min(size)])
}

fn set_option(cm: &'static Cm, file: &Arc<CmFile>, o: &abi::SetOption) -> Result<(), Errno> {
    if o.optlen > 4096 {
        return Err(Errno::EINVAL);
    }
    let mut v = vec![0u8; o.optlen as usize];
    copy_from_user(o.optval, &mut v)?;
    let mut st = cm.st.lock();
    let id = id_mut(&mut st, file, o.id)?;
    let int = || -> Result<i32, Errno> {
        let b: [u8; 4] = v.as_slice().try_into().map_err(|_| Errno::EINVAL)?;
        Ok(i32::from_ne_bytes(b))
    };
    match (o.level, o.optname) {
        // RDMA_OPTION_ID_TOS
        (0, 0) if v.len() == 1 => id.tos = v[0],
        // RDMA_OPTION_ID_REUSEADDR
        (0, 1) => {
            let reuse = int()? != 0;
            if (reuse && id.st != St::Listen) || id.st == St::Idle {
                id.reuseaddr = reuse;
            } else {
                return Err(Errno::EINVAL);
            }
        }
        // RDMA_OPTION_ID_AFONLY
        (0, 2) => {
            int()?;
            if !matches!(id.st, St::Idle | St::AddrBound) {
                return Err(Errno::EINVAL);
            }
        }
        // RDMA_OPTION_ID_ACK_TIMEOUT
        (0, 3) if v.len() == 1 && !id.is_ud() => id.ack_timeout = Some(v[0]),
        (0, 0..=3) => return Err(Errno::EINVAL),
        // RDMA_OPTION_IB_PATH: a path from elsewhere (ibacm) resolves the route
        (1, 1) => {
            if v.is_empty() || v.len() % 72 != 0 || id.st != St::AddrResolved {
                return Err(Errno::EINVAL);
            }
            id.st = St::RouteResolved;
            id.event(plain_event(event::ROUTE_RESOLVED, 0), None);
        }
        _ => return Err(Errno::ENOSYS),
    }
    Ok(())
}

/// MIGRATE_ID, written on the new file: the id (named with its current file's fd) and its
/// unread events move here.
fn migrate(
    cm: &'static Cm,
    file: &Arc<CmFile>,
    m: &abi::RespIdAnd32,
    out: usize,
    file_of: &dyn Fn(RawFd) -> Option<Arc<CmFile>>,
) -> Result<(), Errno> {
    if out < 4 {
        return Err(Errno::ENOSPC);
    }
    let old = file_of(m.value as RawFd).ok_or(Errno::EINVAL)?;
    let mut st = cm.st.lock();
    let id = id_mut(&mut st, &old, m.id)?;
    if !Arc::ptr_eq(&old, file) {
        id.file = file.clone();
        // the events wait on the new file now (old file's lock first: one mover at a time,
        // under the manager's lock)
        let mut from = old.q.lock();
        let mut moved = Vec::new();
        from.retain(|e| {
            let mine = e.owner == m.id;
            if mine {
                moved.push(super::Queued {
                    resp: e.resp,
                    owner: e.owner,
                    counter: e.counter.clone(),
                    child: e.child,
                    mc: e.mc.clone(),
                });
            }
            !mine
        });
        for _ in 0..moved.len() {
            old.take_token();
        }
        drop(from);
        for e in moved {
            file.push(e);
        }
    }
    let n = id.reported.load(Ordering::Acquire);
    respond(m.response, out, &n)
}
