//! The soft devices of this process and the peer-table routes a context adds for its QPs
//! (`docs/wire.md`, "Addressing").

use super::addr::SOFTNIC_ADDR_ENV;
use crate::Error;
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

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

/// Makes the route from `qp` (of `dev`, about to be connected) to the peer `remote` (GID
/// `gid`, listening on UDP `to`) work, following the soft NIC's routing rules (`docs/wire.md`,
/// "Addressing"), and records it in `routes` (the entries the QPs of one context added):
///
/// - `to` is the wire port of the only device of this process with that GID: the in-process
///   path (no peer-table entry for that GID).
/// - otherwise `dev` needs a wire port (else [`Error::Unsupported`]: it could not reach the
///   peer), and its peer table gets `GID → UDP address` (several devices of one host share its
///   GID; the port tells them apart).
///
/// A device routes a GID to one place: connecting to a peer with the same GID at another UDP
/// address while a QP connected to the first is still alive (not destroyed, not in ERR) is
/// [`Error::Unsupported`] (open another context for it). Nothing changes on error. A peer
/// whose endpoint carries no UDP port needs no route (a device of this process with that GID,
/// else, on the wire, the GID's address at port 4791). `remote` and `remote_gid` are how the
/// peer is shown in errors.
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
