//! The device object: identity (name, GID), the verbs that create and destroy its objects,
//! and the threads it runs: the engine and, with a wire port, the transport's I/O thread.
//! What those threads share with the handle lives in [`crate::shared`].

use crate::buffer::DmaBuf;
use crate::counters::{CounterSnapshot, Counters};
use crate::cq::{Cq, CqConfig};
use crate::devmem::DeviceMemory;
use crate::mem::{Access, IndirectConfig, MrInfo, MwInfo, MwType, PdId};
use crate::net::socket::Port;
use crate::net::{Capture, WireConfig, WireError, WireFaults};
use crate::qp::{DctConfig, Qp, QpConfig, Transport};
use crate::shared::{self, Shared};
use crate::srq::{Srq, SrqConfig, XrcSrqConfig, Xrcd};

/// The PD an XRC target stands in (it has none: its requests are checked against their XRC
/// SRQ's); no PD the device allocates has this number.
const XRC_TGT_PD: PdId = PdId(u32::MAX);
use crate::{Error, Gid};
use parking_lot::RwLock;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

/// Parameters of a new soft device.
#[derive(Clone, Debug, Default)]
pub struct DeviceConfig {
    /// Name (as `ibv_get_device_name` would show); `softnic<N>` when empty.
    pub name: String,
    /// GID; a fresh IPv4-mapped `::ffff:127.1.x.y` when `None`.
    pub gid: Option<Gid>,
    /// Completion-only mode (benchmarks): WQEs this device sends are checked and completed
    /// exactly as usual, but no payload moves and atomics leave their targets alone. It
    /// applies to the in-process path only; the wire always carries the payload.
    pub completion_only: bool,
    /// A wire port: RoCEv2 over UDP for peers in other processes or hosts. `None`: the
    /// device reaches peers of this process only. With a port and no explicit `gid`, the GID
    /// is the IPv4-mapped form of the bind address.
    pub wire: Option<WireConfig>,
    /// Engine threads (0 means 1). The QPs are divided between them by QPN (QP `q` belongs to
    /// thread `q % n`); each runs its QPs' doorbells and WQEs as a single engine does, so a
    /// QP's WQEs still run in order on one thread, and QPs on different threads run at once.
    pub engine_threads: u32,
}

/// A soft mlx5 device. Dropping it stops its engine; peers then see its QPs vanish (their
/// requests time out with TRANSPORT_RETRY_EXC, as with a dead host).
pub struct Device {
    shared: Arc<Shared>,
    engines: Vec<JoinHandle<()>>,
    io: Option<JoinHandle<()>>,
}

impl Device {
    /// Creates a device and starts its engine thread (and, with a wire port, binds its socket
    /// and starts its I/O thread).
    pub fn open(cfg: DeviceConfig) -> Result<Self, Error> {
        let n = shared::NEXT_DEVICE.fetch_add(1, Ordering::Relaxed);
        let gid = match (cfg.gid, &cfg.wire) {
            (Some(g), _) => g,
            (None, Some(w)) => match w.bind.ip() {
                std::net::IpAddr::V4(ip) if !ip.is_unspecified() => Gid::from_ipv4(ip),
                std::net::IpAddr::V4(_) => return Err(WireError::WildcardNeedsGid(w.bind).into()),
                std::net::IpAddr::V6(_) => return Err(WireError::NotIpv4(w.bind).into()),
            },
            (None, None) => {
                Gid::from_ipv4(std::net::Ipv4Addr::new(127, 1, (n >> 8) as u8, n as u8))
            }
        };
        let name = if cfg.name.is_empty() {
            format!("softnic{n}")
        } else {
            cfg.name
        };
        let counters: Arc<Counters> = Arc::default();
        let port = match cfg.wire {
            Some(w) => {
                let ip = gid.to_ipv4().ok_or(WireError::GidNotIpv4(gid))?;
                Some(Arc::new(Port::open(w, ip, counters.clone())?))
            }
            None => None,
        };
        let wire = port.is_some();
        let shared = Arc::new(Shared {
            name,
            completion_only: cfg.completion_only,
            gid,
            mrs: Arc::default(),
            counters,
            qps: RwLock::default(),
            cqs: RwLock::default(),
            generation: AtomicU64::new(0),
            // QPNs and CQNs start above the reserved range, as on hardware.
            next_qpn: AtomicU32::new(0x100 + (n & 0xff) * 0x1000),
            next_cqn: AtomicU32::new(0x80),
            next_srqn: AtomicU32::new(0x40),
            next_pd: AtomicU32::new(1),
            shutdown: AtomicBool::new(false),
            polled_doorbell: AtomicBool::new(false),
            engines: OnceLock::new(),
            port,
            peers: RwLock::default(),
            carried_at: AtomicU64::new(0),
            last_turn: AtomicU64::new(0),
            answered_at: AtomicU64::new(0),
            epoch: Instant::now(),
        });
        shared::register(&shared, wire)?;
        // The handle first: should a thread fail to start, dropping it stops the others.
        let mut dev = Self {
            shared: shared.clone(),
            engines: Vec::new(),
            io: None,
        };
        let n = cfg.engine_threads.max(1);
        for k in 0..n {
            let s = shared.clone();
            let name = if n == 1 {
                format!("{}-engine", shared.name)
            } else {
                format!("{}-engine{k}", shared.name)
            };
            dev.engines.push(
                std::thread::Builder::new()
                    .name(name)
                    .spawn(move || crate::engine::run(s, k, n))?,
            );
        }
        let _ = shared
            .engines
            .set(dev.engines.iter().map(|h| h.thread().clone()).collect());
        if let Some(port) = shared.port.clone() {
            let s = shared.clone();
            dev.io = Some(
                std::thread::Builder::new()
                    .name(format!("{}-wire", shared.name))
                    .spawn(move || crate::wire::transport::run(s, port, crate::engine::turn))?,
            );
        }
        tracing::debug!(name = %shared.name, gid = %gid, wire = ?dev.wire_addr(), "soft NIC opened");
        Ok(dev)
    }

    /// Installs (or removes, with `None`) the handler of the device's QP1: every management
    /// datagram its wire port receives goes there ([`crate::gsi`]).
    pub fn set_gsi_handler(&self, h: Option<crate::gsi::GsiHandler>) {
        crate::gsi::set_handler(&self.shared, h);
    }

    /// Sends a management datagram from the device's QP1 to QP1 of the device with GID `to`
    /// over the wire port ([`crate::gsi`]).
    pub fn send_gsi(&self, to: &Gid, mad: &[u8]) -> Result<(), Error> {
        Ok(crate::gsi::send(&self.shared, to, mad)?)
    }

    /// The bound address of the wire port (with the port the system picked), if any.
    pub fn wire_addr(&self) -> Option<SocketAddr> {
        self.shared.port.as_ref().map(|p| p.local)
    }

    /// Says where the wire peer with `gid` listens: QPs of this device connected to `gid`
    /// (RTR's `remote_gid`) send their packets to `addr`, whether or not a device of this
    /// process has that GID. Takes effect for QPs that have not yet sent anything.
    pub fn add_peer(&self, gid: Gid, addr: SocketAddr) -> Result<(), Error> {
        if self.shared.port.is_none() {
            return Err(WireError::NoPort.into());
        }
        if !addr.is_ipv4() {
            return Err(WireError::NotIpv4(addr).into());
        }
        if gid.to_ipv4().is_none() {
            return Err(WireError::GidNotIpv4(gid).into());
        }
        self.shared.peers.write().insert(gid, addr);
        Ok(())
    }

    /// Forgets a peer-table entry.
    pub fn remove_peer(&self, gid: &Gid) -> Option<SocketAddr> {
        self.shared.peers.write().remove(gid)
    }

    /// Replaces the wire port's fault injection (restarting its decision sequence from the
    /// new seed).
    pub fn set_wire_faults(&self, f: WireFaults) -> Result<(), Error> {
        let port = self.shared.port.as_ref().ok_or(WireError::NoPort)?;
        port.set_faults(f);
        Ok(())
    }

    /// Starts (or, with `None`, stops) capturing the wire port's datagrams.
    pub fn set_capture(&self, c: Option<Capture>) -> Result<(), Error> {
        let port = self.shared.port.as_ref().ok_or(WireError::NoPort)?;
        port.set_capture(c);
        Ok(())
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
    /// Does the device's pending work on the caller's thread: its QPs' doorbells and WQEs,
    /// due CQEs, and the datagrams waiting on its wire port (unless its I/O thread is taking
    /// them). For a program that polls for completions on every core it has, which leaves the
    /// device's own threads no time to run (a 2-core machine, two busy-polling processes):
    /// an empty poll that calls this carries the device itself. Returns whether anything was
    /// done; the device's threads keep running either way.
    pub fn progress(&self) -> bool {
        Counters::add(&self.shared.counters.carry_calls, 1);
        self.shared.carry();
        let sent = crate::engine::turn(&self.shared);
        let received = crate::wire::transport::poll_inline(&self.shared);
        // what arrived may be answered (a READ response, an ACK that frees a blocked WQE)
        let more = received && crate::engine::turn(&self.shared);
        let work = sent || received || more;
        if work {
            Counters::add(&self.shared.counters.carried_turns, 1);
        }
        work
    }
    /// The program's threads stop carrying the device (one is about to sleep): its own
    /// threads go back to looking for work at once.
    pub fn carry_end(&self) {
        if self.shared.carried() {
            self.shared.carried_at.store(0, Ordering::Relaxed);
            self.shared.kick();
        }
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
        check_region(addr, len, access)?;
        Ok(self.shared.mrs.insert(pd, addr, len, access, None))
    }

    /// Registers `len` bytes of host buffer `buf` from byte `offset` on. Safe: the region
    /// holds a share of the buffer, which is freed no earlier than the region is deregistered
    /// (or the device closes), so the device never reaches freed memory whatever the caller
    /// drops.
    pub fn reg_buf(
        &self,
        pd: PdId,
        buf: &Arc<DmaBuf>,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<MrInfo, Error> {
        if !buf.is_host() {
            return Err(Error::InvalidArgument(
                "reg_buf takes host memory (device memory: reg_device)",
            ));
        }
        if offset.checked_add(len).is_none_or(|e| e > buf.len()) {
            return Err(Error::InvalidArgument("range outside the buffer"));
        }
        let addr = buf.addr() + offset as u64;
        check_region(addr, len as u64, access)?;
        Ok(self
            .shared
            .mrs
            .insert_owned(pd, addr, len as u64, access, buf.clone()))
    }

    /// Registers device (GPU) memory at device address `addr`: every byte the device moves to
    /// or from the region goes through `mem` (kept with the region until it is deregistered).
    /// Safe: the engine never dereferences `addr` on the host; if the memory goes away under
    /// the region, `mem` fails and the WQE completes with an error CQE.
    pub fn reg_device(
        &self,
        pd: PdId,
        addr: u64,
        len: u64,
        access: Access,
        mem: Arc<dyn DeviceMemory>,
    ) -> Result<MrInfo, Error> {
        check_region(addr, len, access)?;
        Ok(self.shared.mrs.insert(pd, addr, len, access, Some(mem)))
    }

    /// Re-registers host region `key` in place: a new range, PD or rights under the same key.
    ///
    /// # Safety
    /// As for [`Device::reg_host`], for the new range.
    pub unsafe fn rereg_host(
        &self,
        key: u32,
        pd: PdId,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<MrInfo, Error> {
        check_region(addr, len, access)?;
        self.shared
            .mrs
            .replace(key, pd, addr, len, access)
            .ok_or(Error::NoSuchMr(key))
    }

    /// Deregisters a region. Waits for any copy in flight that uses it.
    pub fn dereg(&self, key: u32) -> Result<MrInfo, Error> {
        self.shared.mrs.remove(key).ok_or(Error::NoSuchMr(key))
    }

    /// Looks up a region.
    pub fn mr(&self, key: u32) -> Option<MrInfo> {
        self.shared.mrs.get(key)
    }

    /// Allocates a memory window in `pd`, free until a bind WQE (UMR) binds it; returns its
    /// key.
    pub fn alloc_mw(&self, pd: PdId, kind: MwType) -> u32 {
        self.shared.mrs.alloc_mw(pd, kind)
    }

    /// Frees the memory window allocated with `key` (whatever its key became through binds);
    /// peers using it get remote access errors from then on.
    pub fn dealloc_mw(&self, key: u32) -> Result<MwInfo, Error> {
        self.shared.mrs.dealloc_mw(key).ok_or(Error::NoSuchMw(key))
    }

    /// Looks up the memory window allocated with `key`.
    pub fn mw(&self, key: u32) -> Option<MwInfo> {
        self.shared.mrs.mw(key)
    }

    /// Creates an indirect mkey, free until a UMR WQE gives it a layout; returns its key.
    pub fn create_indirect(&self, cfg: IndirectConfig) -> u32 {
        self.shared.mrs.create_indirect(cfg)
    }

    /// Destroys the indirect mkey `key`. Waits for any copy in flight that uses it.
    pub fn destroy_indirect(&self, key: u32) -> Result<(), Error> {
        if self.shared.mrs.destroy_indirect(key) {
            Ok(())
        } else {
            Err(Error::NoSuchMr(key))
        }
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
        // An engine's snapshot may still hold it (delayed CQEs): fenced like a QP.
        cq.retire();
        Ok(())
    }

    /// Creates a shared receive queue.
    pub fn create_srq(&self, cfg: SrqConfig) -> Result<Arc<Srq>, Error> {
        let srqn = self.shared.next_srqn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
        Ok(Arc::new(Srq::new(srqn, cfg, self.shared.counters.clone())?))
    }

    /// Opens a new XRC domain.
    pub fn alloc_xrcd(&self) -> Arc<Xrcd> {
        Arc::new(Xrcd::new())
    }

    /// Creates an XRC SRQ: an SRQ of `x.xrcd` whose receives complete on `x.cq` (a CQ of this
    /// device), for whichever XRC target QP of the domain a request names it in.
    pub fn create_xrc_srq(&self, cfg: SrqConfig, x: XrcSrqConfig) -> Result<Arc<Srq>, Error> {
        let own = self
            .shared
            .cq(x.cq.cqn())
            .is_some_and(|c| Arc::ptr_eq(&c, &x.cq));
        if !own {
            return Err(Error::InvalidArgument("CQ does not belong to this device"));
        }
        let srqn = self.shared.next_srqn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
        let xrcd = x.xrcd.clone();
        let srq = Arc::new(Srq::new(srqn, cfg, self.shared.counters.clone())?.with_xrc(x));
        xrcd.add(&srq);
        Ok(srq)
    }

    /// Destroys an SRQ; fails while a QP still takes receives from it. An XRC SRQ leaves its
    /// domain: later requests naming it are refused.
    pub fn destroy_srq(&self, srq: &Arc<Srq>) -> Result<(), Error> {
        let used = self
            .shared
            .qps
            .read()
            .values()
            .any(|q| q.srq.as_ref().is_some_and(|s| Arc::ptr_eq(s, srq)));
        if used {
            return Err(Error::Busy("SRQ"));
        }
        if let Some(x) = srq.xrcd() {
            x.remove(srq.srqn());
        }
        srq.set_event_handler(None);
        Ok(())
    }

    /// Creates an RC QP in RESET.
    pub fn create_qp(&self, cfg: QpConfig) -> Result<Arc<Qp>, Error> {
        self.create_qp_inner(cfg, Transport::Rc, None)
    }

    /// Creates a UD QP in RESET (receives from `srq` when given). Its send queue takes UD
    /// WQEs (control segment, datagram segment, data: SEND and SEND_IMM); it sends datagrams
    /// to any UD QP and takes them from any (see docs/softnic.md, "UD QPs"). States:
    /// [`crate::Modify::InitUd`], [`crate::Modify::RtrUd`], then [`crate::Modify::Rts`].
    pub fn create_ud_qp(&self, cfg: QpConfig, srq: Option<&Arc<Srq>>) -> Result<Arc<Qp>, Error> {
        self.create_qp_inner(cfg, Transport::Ud, srq.cloned())
    }

    /// Creates a UC QP in RESET (receives from `srq` when given): connected as RC
    /// ([`crate::Modify::Init`], [`crate::Modify::Rtr`], [`crate::Modify::Rts`]), carrying SENDs
    /// and RDMA WRITEs without ACKs (docs/softnic.md, "UC QPs").
    pub fn create_uc_qp(&self, cfg: QpConfig, srq: Option<&Arc<Srq>>) -> Result<Arc<Qp>, Error> {
        self.create_qp_inner(cfg, Transport::Uc, srq.cloned())
    }

    /// Creates an RC QP in RESET whose receives come from `srq` (its own RQ, if
    /// `cfg.rq_wqes` asks for one, is never used).
    pub fn create_qp_on_srq(&self, cfg: QpConfig, srq: &Arc<Srq>) -> Result<Arc<Qp>, Error> {
        self.create_qp_inner(cfg, Transport::Rc, Some(srq.clone()))
    }

    /// Creates a DC initiator in RESET. Its send queue takes RC's operations (SEND, RDMA
    /// WRITE and READ, atomics) with an address vector after the control segment naming the
    /// target (`prm::wqe::DatagramSeg::dc`); its `recv_cq` and RQ are unused. States:
    /// [`crate::Modify::Init`], [`crate::Modify::RtrDc`], then [`crate::Modify::Rts`].
    pub fn create_dci(&self, mut cfg: QpConfig) -> Result<Arc<Qp>, Error> {
        cfg.rq_wqes = 0;
        self.create_qp_inner(cfg, Transport::Dci, None)
    }

    /// Creates a DC target in RESET: a responder on `cfg.pd` whose SENDs take receives from
    /// `cfg.srq` and complete on `cfg.cq`, open to every DC initiator that presents
    /// `cfg.key`. Its number (DCTN) comes from the QP numbers. States: [`crate::Modify::Init`]
    /// (the remote rights), then [`crate::Modify::RtrDc`], where it stays.
    pub fn create_dct(&self, cfg: DctConfig) -> Result<Arc<Qp>, Error> {
        let mut q = QpConfig::new(cfg.pd, cfg.cq.clone(), cfg.cq);
        q.sq_blocks = 1;
        q.rq_wqes = 0;
        q.max_inline = 0;
        q.user_index = cfg.user_index;
        self.create_qp_inner(q, Transport::Dct { key: cfg.key }, Some(cfg.srq))
    }

    /// Creates an XRC initiator (XRC_INI) in RESET: send only (its `recv_cq` and RQ are
    /// unused). Its WQEs carry an XRC segment after the control segment naming the target's
    /// XRC SRQ (`prm::parse::parse_xrc_wqe`). States as RC ([`crate::Modify::Init`],
    /// [`crate::Modify::Rtr`], [`crate::Modify::Rts`]); it connects to an XRC target.
    pub fn create_xrc_ini(&self, mut cfg: QpConfig) -> Result<Arc<Qp>, Error> {
        cfg.rq_wqes = 0;
        self.create_qp_with(cfg, Transport::XrcIni, None, None)
    }

    /// Creates an XRC target (XRC_TGT) of `xrcd` in RESET: a responder with no queues and no
    /// PD of its own; a request's receive comes from the XRC SRQ of `xrcd` it names and
    /// completes on that SRQ's CQ, its memory accesses checked against that SRQ's PD. States
    /// as RC; it connects to an XRC initiator. `user_index` is unused (an XRC target's
    /// completions carry their SRQ's).
    pub fn create_xrc_tgt(&self, xrcd: &Arc<Xrcd>) -> Result<Arc<Qp>, Error> {
        // a ConnectX XRC target has no CQ: the QP object needs one, which nothing writes
        let cq = self.create_cq(CqConfig {
            ncqe: 2,
            ..Default::default()
        })?;
        let mut q = QpConfig::new(XRC_TGT_PD, cq.clone(), cq.clone());
        q.sq_blocks = 1;
        q.rq_wqes = 0;
        q.max_inline = 0;
        let qp = self.create_qp_with(q, Transport::XrcTgt, None, Some(xrcd.clone()));
        if qp.is_err() {
            let _ = self.destroy_cq(&cq);
        }
        qp
    }

    fn create_qp_inner(
        &self,
        cfg: QpConfig,
        transport: Transport,
        srq: Option<Arc<Srq>>,
    ) -> Result<Arc<Qp>, Error> {
        self.create_qp_with(cfg, transport, srq, None)
    }

    fn create_qp_with(
        &self,
        cfg: QpConfig,
        transport: Transport,
        srq: Option<Arc<Srq>>,
        xrcd: Option<Arc<Xrcd>>,
    ) -> Result<Arc<Qp>, Error> {
        let own = |cq: &Arc<Cq>| {
            self.shared
                .cq(cq.cqn())
                .is_some_and(|c| Arc::ptr_eq(&c, cq))
        };
        if !own(&cfg.send_cq) || !own(&cfg.recv_cq) {
            return Err(Error::InvalidArgument("CQ does not belong to this device"));
        }
        let qpn = self.shared.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
        let mut qp = Qp::new(
            qpn,
            cfg,
            transport,
            srq,
            self.shared.mrs.clone(),
            self.shared.counters.clone(),
        )?;
        if let Some(x) = xrcd {
            qp = qp.with_xrcd(x);
        }
        let qp = Arc::new(qp);
        self.shared.qps.write().insert(qpn, qp.clone());
        self.shared.generation.fetch_add(1, Ordering::Release);
        Ok(qp)
    }

    /// Destroys a QP: the device forgets it; peers see it vanish. When this returns no thread
    /// of any device (engines, wire I/O, a peer's in-process requester, a program thread
    /// carrying the device) touches the QP's rings, doorbell record or CQ entries again, so
    /// their owner may free them.
    pub fn destroy_qp(&self, qp: &Arc<Qp>) {
        self.shared.qps.write().remove(&qp.qpn());
        self.shared.generation.fetch_add(1, Ordering::Release);
        // Handles may outlive the table entry (an engine's snapshot, the caller's Arc, a
        // peer's cached Weak): a retired QP answers nothing, so peers time out as with a
        // vanished QP, and its memory is never reached again.
        qp.retire();
        if qp.transport() == Transport::XrcTgt {
            // its private CQ (create_xrc_tgt)
            let _ = self.destroy_cq(&qp.send_cq);
        }
    }

    /// Finishes the flush of a QP in ERR now: every receive WQE and every announced send WQE
    /// gets its flush CQE before this returns (a kernel driver's move out of ERR does this
    /// before it returns, so a provider that then cleans the QP's CQEs from its CQs finds
    /// them all). No effect on a QP in another state.
    pub fn drain_errored(&self, qp: &Arc<Qp>) {
        crate::engine::drain_err(&self.shared, qp);
    }

    /// Looks a QP up by number.
    pub fn qp(&self, qpn: u32) -> Option<Arc<Qp>> {
        self.shared.qp(qpn)
    }
}

/// The checks every registration makes.
fn check_region(addr: u64, len: u64, access: Access) -> Result<(), Error> {
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
    Ok(())
}

impl Drop for Device {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.kick();
        for h in self.engines.drain(..) {
            let _ = h.join();
        }
        if let Some(h) = self.io.take() {
            if let Some(p) = &self.shared.port {
                p.wake();
            }
            let _ = h.join();
        }
        // Peers may hold (cached) handles to our QPs: none of them answers any more, and
        // no peer thread touches their memory once this returns.
        for qp in self.shared.qps.read().values() {
            qp.retire();
        }
        for cq in self.shared.cqs.read().values() {
            cq.retire();
        }
        shared::unregister(&self.shared);
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.shared.name)
            .field("gid", &self.shared.gid)
            .field("wire", &self.wire_addr())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_polling_loop_carries_the_device_and_a_lone_poll_does_not() {
        let dev = Device::open(DeviceConfig::default()).unwrap();
        let s = dev.shared();
        assert!(!s.carried());
        // one turn, as an event handler's poll: the device's threads keep their own pace
        dev.progress();
        assert!(!s.carried());
        std::thread::sleep(STEADY_GAP);
        dev.progress();
        assert!(!s.carried(), "two polls far apart are no loop");
        // a loop: turns back to back (however loaded the machine, two of a thousand are
        // close enough)
        for _ in 0..1000 {
            dev.progress();
            if s.carried() {
                break;
            }
        }
        assert!(s.carried());
        dev.carry_end();
        assert!(!s.carried());
    }

    /// Longer than what makes two turns a loop.
    const STEADY_GAP: std::time::Duration = std::time::Duration::from_millis(2);
}
