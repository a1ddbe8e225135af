//! What a device's handle, its engine, its wire transport and its in-process peers share:
//! the object tables (QPs, CQs, memory regions), counters, the wire port and its peer table,
//! and the process-wide registry through which soft devices find each other by GID.

use crate::counters::Counters;
use crate::cq::Cq;
use crate::mem::MrTable;
use crate::net::socket::Port;
use crate::qp::Qp;
use crate::{Error, Gid};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// State shared by the device handle, its engine and peers.
pub(crate) struct Shared {
    pub name: String,
    pub completion_only: bool,
    pub gid: Gid,
    pub mrs: Arc<MrTable>,
    pub counters: Arc<Counters>,
    pub qps: RwLock<HashMap<u32, Arc<Qp>>>,
    pub cqs: RwLock<HashMap<u32, Arc<Cq>>>,
    /// Bumped whenever the QP or CQ set changes, so the engine refreshes its snapshot.
    pub generation: AtomicU64,
    pub next_qpn: AtomicU32,
    pub next_cqn: AtomicU32,
    pub next_srqn: AtomicU32,
    pub next_pd: AtomicU32,
    pub shutdown: AtomicBool,
    /// An engine saw a doorbell of a QP whose poster does not wake it (a GPU's, the uverbs
    /// emulation's): the engines keep their sleeps short for a while ([`crate::engine`]).
    pub polled_doorbell: AtomicBool,
    /// The engine threads (QP `q` belongs to thread `q.qpn % len`).
    pub engines: OnceLock<Vec<Thread>>,
    /// The wire port, if any.
    pub port: Option<Arc<Port>>,
    /// GID → UDP address of wire peers ([`Device::add_peer`]).
    pub peers: RwLock<HashMap<Gid, SocketAddr>>,
    /// When a thread of the program last carried the device ([`crate::Device::progress`]) in
    /// a polling loop (its previous turn less than [`STEADY`] before), in nanoseconds after
    /// `epoch` (0: never). See [`Shared::carried`].
    pub carried_at: AtomicU64,
    /// When a thread of the program last gave the device a turn, loop or not (0: never).
    pub last_turn: AtomicU64,
    /// When the wire I/O thread last found the doorbell that answered a datagram it delivered
    /// ([`crate::sched::AnswerWatch`]; 0: never). See [`Shared::answering`].
    pub answered_at: AtomicU64,
    pub epoch: Instant,
}

/// How long after a program's thread last carried the device its own threads keep from
/// spinning.
const CARRIED_FOR: Duration = Duration::from_millis(1);

/// How long after the I/O thread's watch last found an answer's doorbell the engine keeps its
/// sleeps long ([`crate::engine`]).
const ANSWERING_FOR: Duration = Duration::from_millis(1);

/// Turns of the program's threads this close together are a polling loop: what carries the
/// device. A lone poll (an event handler's, a program that polls now and then while its main
/// loop reads CQ memory, as UCX's `rc_mlx5` does) carries nothing, and must not make the
/// device's own threads step back for [`CARRIED_FOR`].
const STEADY: Duration = Duration::from_micros(100);

impl Shared {
    /// Notes that a thread of the program gives the device a turn now.
    pub fn carry(&self) {
        let t = self.epoch.elapsed().as_nanos().max(1) as u64;
        let prev = self.last_turn.swap(t, Ordering::Relaxed);
        if prev != 0 && t.saturating_sub(prev) < STEADY.as_nanos() as u64 {
            self.carried_at.store(t, Ordering::Relaxed);
        }
    }
    /// A thread of the program carried the device within [`CARRIED_FOR`]: the device's own
    /// threads (engine, wire I/O) then sleep instead of spinning when idle, which would only
    /// take the core from that thread (a program polling on every core of a small machine).
    pub fn carried(&self) -> bool {
        let t = self.carried_at.load(Ordering::Relaxed);
        t != 0 && self.epoch.elapsed().as_nanos() as u64 - t < CARRIED_FOR.as_nanos() as u64
    }
    /// Notes that the I/O thread's watch found an answer's doorbell now.
    pub fn answered(&self) {
        let t = self.epoch.elapsed().as_nanos().max(1) as u64;
        self.answered_at.store(t, Ordering::Relaxed);
    }
    /// The I/O thread found an answer's doorbell within [`ANSWERING_FOR`]: the program's
    /// doorbells answer what it receives, and the engine need not look for them often.
    pub fn answering(&self) -> bool {
        let t = self.answered_at.load(Ordering::Relaxed);
        t != 0 && self.epoch.elapsed().as_nanos() as u64 - t < ANSWERING_FOR.as_nanos() as u64
    }
    pub fn qp(&self, qpn: u32) -> Option<Arc<Qp>> {
        self.qps.read().get(&qpn).cloned()
    }
    pub fn cq(&self, cqn: u32) -> Option<Arc<Cq>> {
        self.cqs.read().get(&cqn).cloned()
    }
    pub fn snapshot(&self) -> (Vec<Arc<Qp>>, Vec<Arc<Cq>>) {
        let mut qps: Vec<_> = self.qps.read().values().cloned().collect();
        qps.sort_by_key(|q| q.qpn);
        (qps, self.cqs.read().values().cloned().collect())
    }
    pub fn kick(&self) {
        for t in self.engines.get().into_iter().flatten() {
            t.unpark();
        }
    }
    pub fn port(&self) -> Option<&Arc<Port>> {
        self.port.as_ref()
    }
    pub fn peer_addr(&self, gid: &Gid) -> Option<SocketAddr> {
        self.port.as_ref()?;
        self.peers.read().get(gid).copied()
    }
}

/// Live devices: GID, whether it has a wire port, the device.
static REGISTRY: Mutex<Vec<(Gid, bool, Weak<Shared>)>> = Mutex::new(Vec::new());
pub(crate) static NEXT_DEVICE: AtomicU32 = AtomicU32::new(1);

/// Finds the live soft device with this GID, when exactly one has it (wire devices may share
/// a GID: several ports on one host address; such a GID names no in-process peer).
pub(crate) fn lookup(gid: &Gid) -> Option<Arc<Shared>> {
    let reg = REGISTRY.lock();
    let mut live = reg
        .iter()
        .filter(|(g, _, w)| g == gid && w.strong_count() > 0);
    match (live.next(), live.next()) {
        (Some((_, _, w)), None) => w.upgrade(),
        _ => None,
    }
}

/// Enters a new device in the registry. In-process peers are found by GID: it must name one
/// device, unless every device holding it has a wire port (several UDP ports on one host
/// address).
pub(crate) fn register(shared: &Arc<Shared>, wire: bool) -> Result<(), Error> {
    let gid = shared.gid;
    let mut reg = REGISTRY.lock();
    reg.retain(|(_, _, w)| w.strong_count() > 0);
    if reg.iter().any(|(g, w2, _)| *g == gid && !(wire && *w2)) {
        return Err(Error::GidInUse(gid));
    }
    reg.push((gid, wire, Arc::downgrade(shared)));
    Ok(())
}

/// Removes a device from the registry (and any dead entries).
pub(crate) fn unregister(shared: &Arc<Shared>) {
    let mut reg = REGISTRY.lock();
    reg.retain(|(_, _, w)| !std::ptr::eq(w.as_ptr(), Arc::as_ptr(shared)) && w.strong_count() > 0);
}
