//! The device object: identity (name, GID), the object tables, the engine thread, and the
//! process-wide registry through which soft devices find each other's QPs.

use crate::counters::{CounterSnapshot, Counters};
use crate::cq::{Cq, CqConfig};
use crate::mem::{Access, MemKind, MrInfo, MrTable, PdId};
use crate::qp::{Qp, QpConfig};
use crate::{Error, Gid};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::{JoinHandle, Thread};

/// Parameters of a new soft device.
#[derive(Clone, Debug, Default)]
pub struct DeviceConfig {
    /// Name (as `ibv_get_device_name` would show); `softnic<N>` when empty.
    pub name: String,
    /// GID; a fresh IPv4-mapped `::ffff:127.1.x.y` when `None`.
    pub gid: Option<Gid>,
    /// Completion-only mode (benchmarks): WQEs this device sends are checked and completed
    /// exactly as usual, but no payload moves and atomics leave their targets alone.
    pub completion_only: bool,
}

/// State shared by the device handle, its engine and peers.
pub(crate) struct Shared {
    pub name: String,
    pub completion_only: bool,
    pub gid: Gid,
    pub mrs: Arc<MrTable>,
    pub counters: Arc<Counters>,
    qps: RwLock<HashMap<u32, Arc<Qp>>>,
    cqs: RwLock<HashMap<u32, Arc<Cq>>>,
    /// Bumped whenever the QP or CQ set changes, so the engine refreshes its snapshot.
    pub generation: AtomicU64,
    next_qpn: AtomicU32,
    next_cqn: AtomicU32,
    next_pd: AtomicU32,
    pub shutdown: AtomicBool,
    pub engine: OnceLock<Thread>,
}

impl Shared {
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
        if let Some(t) = self.engine.get() {
            t.unpark();
        }
    }
}

static REGISTRY: Mutex<Vec<(Gid, Weak<Shared>)>> = Mutex::new(Vec::new());
static NEXT_DEVICE: AtomicU32 = AtomicU32::new(1);

/// Finds the live soft device with this GID.
pub(crate) fn lookup(gid: &Gid) -> Option<Arc<Shared>> {
    REGISTRY
        .lock()
        .iter()
        .find(|(g, _)| g == gid)
        .and_then(|(_, w)| w.upgrade())
}

/// A soft mlx5 device. Dropping it stops its engine; peers then see its QPs vanish (their
/// requests time out with TRANSPORT_RETRY_EXC, as with a dead host).
pub struct Device {
    shared: Arc<Shared>,
    engine: Option<JoinHandle<()>>,
}

impl Device {
    /// Creates a device and starts its engine thread.
    pub fn open(cfg: DeviceConfig) -> Result<Self, Error> {
        let n = NEXT_DEVICE.fetch_add(1, Ordering::Relaxed);
        let gid = cfg.gid.unwrap_or_else(|| {
            Gid::from_ipv4(std::net::Ipv4Addr::new(127, 1, (n >> 8) as u8, n as u8))
        });
        let name = if cfg.name.is_empty() {
            format!("softnic{n}")
        } else {
            cfg.name
        };
        let shared = Arc::new(Shared {
            name,
            completion_only: cfg.completion_only,
            gid,
            mrs: Arc::default(),
            counters: Arc::default(),
            qps: RwLock::default(),
            cqs: RwLock::default(),
            generation: AtomicU64::new(0),
            // QPNs and CQNs start above the reserved range, as on hardware.
            next_qpn: AtomicU32::new(0x100 + (n & 0xff) * 0x1000),
            next_cqn: AtomicU32::new(0x80),
            next_pd: AtomicU32::new(1),
            shutdown: AtomicBool::new(false),
            engine: OnceLock::new(),
        });
        {
            let mut reg = REGISTRY.lock();
            reg.retain(|(_, w)| w.strong_count() > 0);
            if reg.iter().any(|(g, _)| *g == gid) {
                return Err(Error::GidInUse(gid));
            }
            reg.push((gid, Arc::downgrade(&shared)));
        }
        let s = shared.clone();
        let handle = std::thread::Builder::new()
            .name(format!("{}-engine", shared.name))
            .spawn(move || crate::engine::run(s))?;
        let _ = shared.engine.set(handle.thread().clone());
        tracing::debug!(name = %shared.name, gid = %gid, "soft NIC opened");
        Ok(Self {
            shared,
            engine: Some(handle),
        })
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }
    /// Port GID.
    pub fn gid(&self) -> Gid {
        self.shared.gid
    }
    /// A copy of the counters.
    pub fn counters(&self) -> CounterSnapshot {
        self.shared.counters.snapshot()
    }
    /// Wakes the engine now (what an MMIO doorbell write does to a NIC; CPU initiators call it
    /// after ringing, GPU writers are found by the engine's polling).
    pub fn kick(&self) {
        self.shared.kick();
    }
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> PdId {
        PdId(self.shared.next_pd.fetch_add(1, Ordering::Relaxed))
    }

    /// Registers host memory.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid host memory until the region is deregistered; the
    /// device reads and writes it from its engine thread whenever work names the key.
    pub unsafe fn reg_host(
        &self,
        pd: PdId,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<MrInfo, Error> {
        if len == 0 || addr.checked_add(len).is_none() || addr == 0 {
            return Err(Error::InvalidArgument(
                "memory region must be a non-empty, non-null range",
            ));
        }
        // Remote write or atomic rights need local write, as in verbs.
        if (access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC))
            && !access.contains(Access::LOCAL_WRITE)
        {
            return Err(Error::InvalidArgument(
                "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE",
            ));
        }
        Ok(self.shared.mrs.insert(pd, addr, len, access, MemKind::Host))
    }

    /// Deregisters a region. Waits for any copy in flight that uses it.
    pub fn dereg(&self, key: u32) -> Result<MrInfo, Error> {
        self.shared.mrs.remove(key).ok_or(Error::NoSuchMr(key))
    }

    /// Looks up a region.
    pub fn mr(&self, key: u32) -> Option<MrInfo> {
        self.shared.mrs.get(key)
    }

    /// Creates a completion queue.
    pub fn create_cq(&self, cfg: CqConfig) -> Result<Arc<Cq>, Error> {
        let cqn = self.shared.next_cqn.fetch_add(1, Ordering::Relaxed);
        let cq = Arc::new(Cq::new(cqn, cfg)?);
        self.shared.cqs.write().insert(cqn, cq.clone());
        self.shared.generation.fetch_add(1, Ordering::Release);
        Ok(cq)
    }

    /// Destroys a CQ; fails while a QP still uses it.
    pub fn destroy_cq(&self, cq: &Arc<Cq>) -> Result<(), Error> {
        let used = self
            .shared
            .qps
            .read()
            .values()
            .any(|q| Arc::ptr_eq(&q.send_cq, cq) || Arc::ptr_eq(&q.recv_cq, cq));
        if used {
            return Err(Error::Busy("CQ"));
        }
        self.shared.cqs.write().remove(&cq.cqn());
        self.shared.generation.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// Creates an RC QP in RESET.
    pub fn create_qp(&self, cfg: QpConfig) -> Result<Arc<Qp>, Error> {
        let own = |cq: &Arc<Cq>| {
            self.shared
                .cq(cq.cqn())
                .is_some_and(|c| Arc::ptr_eq(&c, cq))
        };
        if !own(&cfg.send_cq) || !own(&cfg.recv_cq) {
            return Err(Error::InvalidArgument("CQ does not belong to this device"));
        }
        let qpn = self.shared.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
        let qp = Arc::new(Qp::new(
            qpn,
            cfg,
            self.shared.mrs.clone(),
            self.shared.counters.clone(),
        )?);
        self.shared.qps.write().insert(qpn, qp.clone());
        self.shared.generation.fetch_add(1, Ordering::Release);
        Ok(qp)
    }

    /// Destroys a QP: the device forgets it; peers see it vanish.
    pub fn destroy_qp(&self, qp: &Arc<Qp>) {
        self.shared.qps.write().remove(&qp.qpn());
        // Handles may outlive the table entry (the caller's Arc, a peer's cached Weak): a
        // destroyed QP answers nothing, so peers time out as with a vanished QP.
        qp.set_state(crate::qp::QpState::Reset);
        self.shared.generation.fetch_add(1, Ordering::Release);
    }

    /// Looks a QP up by number.
    pub fn qp(&self, qpn: u32) -> Option<Arc<Qp>> {
        self.shared.qp(qpn)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.kick();
        if let Some(h) = self.engine.take() {
            let _ = h.join();
        }
        // Peers may hold (cached) handles to our QPs: none of them answers any more.
        for qp in self.shared.qps.read().values() {
            qp.set_state(crate::qp::QpState::Reset);
        }
        let mut reg = REGISTRY.lock();
        reg.retain(|(_, w)| {
            !std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.shared)) && w.strong_count() > 0
        });
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.shared.name)
            .field("gid", &self.shared.gid)
            .finish()
    }
}
