//! The soft NIC's room: its wire port's address ([`SOFTNIC_ADDR_ENV`]), the soft devices of
//! this process and the peer-table routes a context adds for its QPs (`docs/wire.md`,
//! "Addressing"), and a soft QP's SQ producer as its doorbell record and CPU-proxy word say.

use crate::Error;
use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// RoCEv2's UDP port: where a peer whose [`Endpoint`](crate::Endpoint) carries no `udp_port` listens.
pub const ROCE_UDP_PORT: u16 = 4791;

/// Environment variable that gives soft NICs opened by [`Context::open`](crate::Context::open) and
/// [`Context::open_wire`](crate::Context::open_wire) a wire port: `ip:port` (port 0: the system picks one) or `ip` (port
/// 4791). The IP is an IPv4 address of this host; the device's GID is its IPv4-mapped form.
pub const SOFTNIC_ADDR_ENV: &str = "GPUVERBS_SOFTNIC_ADDR";

/// Parses a [`SOFTNIC_ADDR_ENV`] value: `ip:port`, or `ip` alone for RoCEv2's port 4791.
pub fn parse_softnic_addr(v: &str) -> Result<SocketAddr, Error> {
    let v = v.trim();
    let addr = v
        .parse::<SocketAddr>()
        .or_else(|_| {
            v.parse::<IpAddr>()
                .map(|ip| SocketAddr::from((ip, ROCE_UDP_PORT)))
        })
        .map_err(|_| {
            Error::InvalidArgument(format!(
                "{SOFTNIC_ADDR_ENV}={v:?} is not an IPv4 address with an optional port \
                 (e.g. 10.0.0.1:4791, 127.0.0.1:0)"
            ))
        })?;
    if !addr.is_ipv4() {
        return Err(Error::InvalidArgument(format!(
            "{SOFTNIC_ADDR_ENV}={v:?}: the soft NIC's wire speaks IPv4 only"
        )));
    }
    Ok(addr)
}

/// Peer-table entries a context added for its QPs ([`route`]).
pub(crate) type Routes = Mutex<HashMap<softnic::Gid, Route>>;

/// A peer-table entry of this context's device, and the QPs connected through it.
pub(crate) struct Route {
    addr: SocketAddr,
    qps: Vec<Weak<softnic::Qp>>,
}

/// The soft devices of contexts of this process (to tell a peer of this process from one in
/// another process when an endpoint names a UDP address).
static DEVICES: Mutex<Vec<Weak<softnic::Device>>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records a soft device opened for a context (for [`devices_with`]).
pub(crate) fn register(dev: &Arc<softnic::Device>) {
    let mut reg = lock(&DEVICES);
    reg.retain(|w| w.strong_count() > 0);
    reg.push(Arc::downgrade(dev));
}

/// Live devices of this process's contexts with GID `gid`, and whether one of them listens on
/// `addr`.
fn devices_with(gid: softnic::Gid, addr: SocketAddr) -> (usize, bool) {
    let mut reg = lock(&DEVICES);
    reg.retain(|w| w.strong_count() > 0);
    let mut n = 0;
    let mut at = false;
    for d in reg.iter().filter_map(Weak::upgrade) {
        if d.gid() == gid {
            n += 1;
            at |= d.wire_addr() == Some(addr);
        }
    }
    (n, at)
}

/// The body of [`Context::route_to`](super::context::Context) on a soft device `dev`: the
/// route from `qp` to the peer `remote` (GID `gid`, listening on UDP `to`), recorded in
/// `routes`.
pub(crate) fn route(
    dev: &softnic::Device,
    routes: &Routes,
    qp: &Arc<softnic::Qp>,
    gid: softnic::Gid,
    to: SocketAddr,
    remote: &dyn fmt::Display,
    remote_gid: &dyn fmt::Display,
) -> Result<(), Error> {
    let (same_gid, listens) = devices_with(gid, to);
    // softnic's rule 2: a GID that names exactly one device of this process is reached by
    // a function call; anything else needs the wire and a peer-table entry.
    let in_process = listens && same_gid == 1;
    if !in_process && dev.wire_addr().is_none() {
        return Err(Error::Unsupported(format!(
            "QP {:#x} of {}: the peer ({remote}) listens on UDP {to}, {}, and this soft NIC \
             has no wire port: open it with {SOFTNIC_ADDR_ENV}=ip:port or \
             Context::open_wire",
            qp.qpn(),
            dev.name(),
            if listens {
                "a device of this process whose GID other devices share"
            } else {
                "not a device of this process"
            }
        )));
    }
    let mut routes = lock(routes);
    if let Some(r) = routes.get_mut(&gid) {
        // QPs that are gone (destroyed: RESET) or failed (ERR) send nothing more.
        r.qps.retain(|w| {
            w.upgrade().is_some_and(|q| {
                !Arc::ptr_eq(&q, qp)
                    && !matches!(q.state(), softnic::QpState::Reset | softnic::QpState::Err)
            })
        });
        if r.addr == to {
            r.qps.push(Arc::downgrade(qp));
            return Ok(());
        }
        if let Some(q) = r.qps.iter().find_map(Weak::upgrade) {
            return Err(Error::Unsupported(format!(
                "QP {:#x} of {}: GID {} is routed to UDP {} for QP {:#x}, which is still \
                 alive; one soft NIC sends a GID to one UDP address, so this peer at {to} \
                 needs a QP of another context",
                qp.qpn(),
                dev.name(),
                remote_gid,
                r.addr,
                q.qpn()
            )));
        }
    }
    if in_process {
        // An entry left by QPs that are gone would take precedence over the local path.
        dev.remove_peer(&gid);
    } else {
        dev.add_peer(gid, to)?;
        tracing::debug!(device = dev.name(), %gid, %to, qpn = qp.qpn(), "wire peer added");
    }
    routes.insert(
        gid,
        Route {
            addr: to,
            qps: vec![Arc::downgrade(qp)],
        },
    );
    Ok(())
}

/// A soft QP's send producer index (64-bit): the CPU-proxy word when a kernel wrote it ahead
/// of the doorbell record's 16 bits (its WQEs not rung yet, the proxy will), else those 16
/// bits, as the 64-bit value at or below the word.
pub(crate) fn sq_producer(qp: &softnic::Qp) -> u64 {
    use std::sync::atomic::Ordering::Acquire;
    let rec = qp.ctrl_page();
    let sq16 = u32::from_be(rec.atomic_u32(qp.dbrec_offset() + 4).load(Acquire)) as u16;
    producer_from(sq16, rec.atomic_u64(qp.proxy_offset()).load(Acquire))
}

/// The 64-bit producer from the doorbell record's 16 bits and the CPU-proxy word.
pub(crate) fn producer_from(sq16: u16, proxy: u64) -> u64 {
    proxy
        .checked_sub(u64::from((proxy as u16).wrapping_sub(sq16)))
        .unwrap_or(u64::from(sq16))
}

/// A soft QP's geometry: its rings, the doorbell record and CPU-proxy word of its control page
/// (or the record it was given), its register on its UAR page, and a kick that wakes its
/// device's engine (a no-op once the device is gone: the geometry does not keep it alive).
pub(crate) fn qp_geometry<'a>(
    dev: Option<&Arc<softnic::Device>>,
    q: &'a Arc<softnic::Qp>,
) -> super::geometry::QpGeometry<'a> {
    use super::geometry::{Kick, Place, QpGeometry};
    let kick = dev.map(|d| {
        let dev = Arc::downgrade(d);
        Arc::new(move || {
            if let Some(d) = dev.upgrade() {
                d.kick();
            }
        }) as Kick
    });
    let hooks_qp = q.clone();
    QpGeometry {
        qpn: q.qpn(),
        sq: q.sq_ring(),
        sq_blocks: q.sq_blocks(),
        rq: Some(q.rq_ring()),
        rq_wqes: q.rq_wqes(),
        rq_stride: q.rq_stride(),
        max_inline: q.max_inline(),
        dbrec: Place::Buf(q.dbrec_page(), q.dbrec_offset()),
        db_reg: Place::Buf(q.uar(), q.bf_offset()),
        db_reg_io: false,
        proxy_word: Some(Place::Buf(q.ctrl_page(), q.proxy_offset())),
        kick,
        poster_hooks: Some(Arc::new(move || {
            softnic::initiator::device_hooks(&hooks_qp)
        })),
        keep: q.clone(),
    }
}

/// A soft CQ's geometry (the soft NIC overwrites or fails a CQ it overruns, by its mode).
pub(crate) fn cq_geometry(c: &Arc<softnic::Cq>) -> super::geometry::CqGeometry<'_> {
    super::geometry::CqGeometry {
        ring: c.ring(),
        ncqe: c.ncqe(),
        dbrec: super::geometry::Place::Buf(c.dbrec(), 0),
        collapsed: c.mode() == verbs::CqMode::Collapsed,
        never_overwrites: false,
        keep: c.clone(),
    }
}
