//! The soft NIC behind the seam: its device, PDs, CQs and QPs as [`DeviceOps`], [`PdOps`],
//! [`CqOps`] and [`QpOps`], and the soft objects the soft controls reach through them.

use super::super::geometry::{CqGeometry, Kick, Place, QpGeometry};
use super::super::seam::{
    CqOps, CqSpec, DctOps, DctSpec, DeviceOps, GpuRings, PdOps, Progress, QpOps, QpSpec,
    Registration, Remote,
};
use super::super::ConnectOptions;
use super::route::{route, Routes};
use crate::Error;
use std::any::Any;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use verbs::{Access, DeviceMemory, DoorbellMode, Gid, Modify, QpState};

/// A soft NIC, and the peer-table routes its context added for its QPs.
pub(crate) struct SoftDevice {
    pub(crate) dev: Arc<softnic::Device>,
    routes: Arc<Routes>,
}

impl SoftDevice {
    pub(crate) fn new(dev: Arc<softnic::Device>) -> Self {
        Self {
            dev,
            routes: Arc::default(),
        }
    }
}

/// The soft device of a context's device, when it is a soft NIC.
pub(crate) fn device_of(d: &dyn DeviceOps) -> Option<&Arc<softnic::Device>> {
    d.as_any().downcast_ref::<SoftDevice>().map(|s| &s.dev)
}

/// The soft QP of a QP, when it is a soft NIC's.
pub(crate) fn qp_of(q: &dyn QpOps) -> Option<&Arc<softnic::Qp>> {
    q.as_any().downcast_ref::<SoftQp>().map(|s| &s.qp)
}

/// The soft CQ of a CQ, when it is a soft NIC's.
pub(crate) fn cq_of(c: &dyn CqOps) -> Option<&Arc<softnic::Cq>> {
    c.as_any().downcast_ref::<SoftCq>().map(|s| &s.0)
}

impl DeviceOps for SoftDevice {
    fn gid(&self) -> Gid {
        self.dev.gid()
    }
    fn gid_index(&self) -> u8 {
        0
    }
    fn mtu(&self) -> u32 {
        4096
    }
    fn wire_addr(&self) -> Option<SocketAddr> {
        self.dev.wire_addr()
    }
    fn auto_doorbell(&self, rings_on_gpu: bool) -> (DoorbellMode, &'static str) {
        if rings_on_gpu {
            (
                DoorbellMode::BlueFlame,
                "auto: BlueFlame, the SQ ring being GPU memory: the soft NIC's engine (a CPU \
                 thread) reads a ring there by a copy per doorbell, while a single WQE rides \
                 the register (host memory) to it",
            )
        } else {
            (
                DoorbellMode::GpuDoorbell,
                "auto: the soft NIC's doorbell page is host memory that maps into any GPU",
            )
        }
    }
    fn rings_for_kernels(&self) -> (bool, &'static str) {
        (
            false,
            "auto: host memory, where the soft NIC's engine (a CPU thread) reads them fastest",
        )
    }
    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>, Error> {
        Ok(Arc::new(SoftPd {
            dev: self.dev.clone(),
            routes: self.routes.clone(),
            id: self.dev.alloc_pd(),
        }))
    }
    fn create_cq(&self, spec: &CqSpec<'_>) -> Result<Arc<dyn CqOps>, Error> {
        let ring = match spec.gpu {
            Some(g) => Some(g.ring_buffer((spec.depth as usize).saturating_mul(prm::CQE_SIZE))?),
            None => None,
        };
        let cq = self.dev.create_cq(softnic::CqConfig {
            ncqe: spec.depth,
            mode: spec.mode,
            init: spec.init,
            ring,
            dbrec: None,
            cqe_size: Default::default(),
        })?;
        Ok(Arc::new(SoftCq(cq)))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A PD of a soft NIC.
struct SoftPd {
    dev: Arc<softnic::Device>,
    routes: Arc<Routes>,
    id: softnic::PdId,
}

impl fmt::Debug for SoftPd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.id)
    }
}

/// A soft region, deregistered when dropped.
struct SoftMr {
    dev: Arc<softnic::Device>,
    key: u32,
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        if let Err(e) = self.dev.dereg(self.key) {
            tracing::warn!(key = self.key, error = %e, "deregistration failed");
        }
    }
}

impl SoftPd {
    fn registration(&self, info: softnic::MrInfo) -> Registration {
        Registration {
            lkey: info.key,
            rkey: info.key,
            gpu_path: None,
            handle: Box::new(SoftMr {
                dev: self.dev.clone(),
                key: info.key,
            }),
        }
    }
}

impl PdOps for SoftPd {
    unsafe fn reg_host(&self, addr: u64, len: u64, access: Access) -> Result<Registration, Error> {
        // SAFETY: forwarded contract (the handle deregisters before the memory goes).
        let info = unsafe { self.dev.reg_host(self.id, addr, len, access)? };
        Ok(self.registration(info))
    }

    fn reg_gpu(
        &self,
        gpu: &dyn GpuRings,
        dptr: u64,
        len: u64,
        access: Access,
    ) -> Result<Registration, Error> {
        self.reg_device_memory(gpu.memory(), dptr, len, access)
    }

    fn reg_device_memory(
        &self,
        mem: Arc<dyn DeviceMemory>,
        dptr: u64,
        len: u64,
        access: Access,
    ) -> Result<Registration, Error> {
        let info = self.dev.reg_device(self.id, dptr, len, access, mem)?;
        Ok(self.registration(info))
    }

    fn create_qp(
        &self,
        spec: &QpSpec<'_>,
        send_cq: &Arc<dyn CqOps>,
        recv_cq: &Arc<dyn CqOps>,
    ) -> Result<Arc<dyn QpOps>, Error> {
        let cfg = self.qp_config(spec, send_cq, recv_cq)?;
        let qp = self.dev.create_qp(cfg)?;
        Ok(self.wrap(qp))
    }

    fn create_dci(
        &self,
        spec: &QpSpec<'_>,
        send_cq: &Arc<dyn CqOps>,
    ) -> Result<Arc<dyn QpOps>, Error> {
        let cfg = self.qp_config(spec, send_cq, send_cq)?;
        let qp = self.dev.create_dci(cfg)?;
        Ok(self.wrap(qp))
    }

    /// A DC target on an SRQ of its own (the host API posts no receives: a SEND to it gets
    /// RNR), in RTR.
    fn create_dct(&self, t: &DctSpec<'_>) -> Result<Arc<dyn DctOps>, Error> {
        let Some(cq) = cq_of(&**t.cq) else {
            return Err(Error::InvalidArgument(
                "the DC target's CQ belongs to another device".into(),
            ));
        };
        let srq = self
            .dev
            .create_srq(softnic::SrqConfig::new(self.id, 2, 1))?;
        let dct = self.dev.create_dct(softnic::DctConfig {
            pd: self.id,
            cq: cq.clone(),
            srq: srq.clone(),
            key: t.key,
            user_index: None,
        })?;
        let up = dct
            .modify(Modify::Init { access: t.access })
            .and_then(|()| {
                dct.modify(Modify::RtrDc {
                    mtu: t.mtu,
                    min_rnr_timer: t.min_rnr_timer,
                })
            });
        let made = Arc::new(SoftDct {
            dev: self.dev.clone(),
            dct,
            srq,
        });
        match up {
            Ok(()) => Ok(made),
            Err(e) => {
                made.destroy();
                Err(e.into())
            }
        }
    }
}

impl SoftPd {
    /// The soft NIC's QP config for `spec` on these CQs (rings in a GPU's memory when given).
    fn qp_config(
        &self,
        spec: &QpSpec<'_>,
        send_cq: &Arc<dyn CqOps>,
        recv_cq: &Arc<dyn CqOps>,
    ) -> Result<softnic::QpConfig, Error> {
        let (Some(scq), Some(rcq)) = (cq_of(&**send_cq), cq_of(&**recv_cq)) else {
            return Err(Error::InvalidArgument(
                "the QP's CQs belong to another device".into(),
            ));
        };
        let (sq_ring, rq_ring) = match spec.gpu {
            Some(g) => {
                let sq = (spec.sq_blocks as usize).saturating_mul(prm::WQEBB);
                let rq = (spec.rq_wqes as usize).saturating_mul(spec.rq_stride() as usize);
                (Some(g.ring_buffer(sq)?), Some(g.ring_buffer(rq)?))
            }
            None => (None, None),
        };
        Ok(softnic::QpConfig {
            pd: self.id,
            send_cq: scq.clone(),
            recv_cq: rcq.clone(),
            sq_blocks: spec.sq_blocks,
            rq_wqes: spec.rq_wqes,
            max_recv_sge: spec.max_recv_sge,
            max_inline: spec.max_inline,
            doorbell: spec.doorbell,
            sq_ring,
            rq_ring,
            rq_stride: None,
            dbrec: None,
            uar: None,
            user_index: None,
            cross_channel: spec.cross_channel,
        })
    }

    fn wrap(&self, qp: Arc<softnic::Qp>) -> Arc<dyn QpOps> {
        Arc::new(SoftQp {
            dev: self.dev.clone(),
            routes: self.routes.clone(),
            qp,
        })
    }
}

/// RTR → RTS with the first PSN `psn` and `o`'s timers and retry counts.
fn to_rts(q: &softnic::Qp, psn: u32, o: &ConnectOptions) -> Result<(), Error> {
    q.modify(Modify::Rts(verbs::RtsAttr {
        sq_psn: psn,
        timeout: o.timeout,
        retry_cnt: o.retry_cnt,
        rnr_retry: o.rnr_retry,
    }))?;
    Ok(())
}

/// A DC target of a soft NIC, with the SRQ it stands on (destroyed by [`DctOps::destroy`]).
struct SoftDct {
    dev: Arc<softnic::Device>,
    dct: Arc<softnic::Qp>,
    srq: Arc<softnic::Srq>,
}

impl fmt::Debug for SoftDct {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "soft DCT {:#x}", self.dct.qpn())
    }
}

impl DctOps for SoftDct {
    fn number(&self) -> u32 {
        self.dct.qpn()
    }
    fn state(&self) -> QpState {
        self.dct.state()
    }
    fn destroy(&self) {
        self.dev.destroy_qp(&self.dct);
        let _ = self.dev.destroy_srq(&self.srq);
    }
}

/// A CQ of a soft NIC.
struct SoftCq(Arc<softnic::Cq>);

impl fmt::Debug for SoftCq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "soft CQ {:#x}", self.0.cqn())
    }
}

impl CqOps for SoftCq {
    fn cqn(&self) -> u32 {
        self.0.cqn()
    }
    fn depth(&self) -> u32 {
        self.0.ncqe()
    }
    /// The soft NIC overwrites or fails a CQ it overruns, by its mode.
    fn geometry(&self) -> CqGeometry<'_> {
        let c = &self.0;
        CqGeometry {
            ring: c.ring(),
            ncqe: c.ncqe(),
            dbrec: Place::Buf(c.dbrec(), 0),
            collapsed: c.mode() == verbs::CqMode::Collapsed,
            never_overwrites: false,
            keep: c.clone(),
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A QP of a soft NIC (destroyed by [`QpOps::destroy`]).
struct SoftQp {
    dev: Arc<softnic::Device>,
    routes: Arc<Routes>,
    qp: Arc<softnic::Qp>,
}

impl fmt::Debug for SoftQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "soft QP {:#x}", self.qp.qpn())
    }
}

impl QpOps for SoftQp {
    fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    fn state(&self) -> QpState {
        self.qp.state()
    }

    fn connect(&self, remote: &Remote<'_>, psn: u32, o: &ConnectOptions) -> Result<(), Error> {
        if let Some(to) = remote.udp {
            route(
                &self.dev,
                &self.routes,
                &self.qp,
                remote.gid,
                to,
                remote.shown,
                &remote.gid,
            )?;
        }
        let q = &self.qp;
        q.modify(Modify::Init { access: o.access })?;
        q.modify(Modify::Rtr(verbs::RtrAttr {
            remote_gid: remote.gid,
            remote_qpn: remote.qpn,
            rq_psn: remote.psn,
            mtu: remote.mtu,
            min_rnr_timer: o.min_rnr_timer,
            selective_repeat: remote.selective_repeat,
        }))?;
        to_rts(q, psn, o)
    }

    fn modify(&self, m: Modify) -> Result<(), Error> {
        Ok(self.qp.modify(m)?)
    }

    fn ready_dc(&self, mtu: u32, psn: u32, o: &ConnectOptions) -> Result<(), Error> {
        let q = &self.qp;
        if !q.is_dci() {
            return Err(Error::InvalidArgument(format!(
                "QP {:#x} is not a DC initiator",
                q.qpn()
            )));
        }
        q.modify(Modify::Init {
            access: Access::NONE,
        })?;
        q.modify(Modify::RtrDc {
            mtu,
            min_rnr_timer: o.min_rnr_timer,
        })?;
        to_rts(q, psn, o)
    }

    fn reach(&self, gid: Gid, udp: SocketAddr, shown: &dyn fmt::Display) -> Result<(), Error> {
        route(&self.dev, &self.routes, &self.qp, gid, udp, shown, &gid)
    }

    /// Its rings, the doorbell record and CPU-proxy word of its control page (or the record it
    /// was given), its register on its UAR page, and a kick that wakes the device's engine (a
    /// no-op once the device is gone: the geometry does not keep it alive).
    fn geometry(&self) -> QpGeometry<'_> {
        let q = &self.qp;
        let dev = Arc::downgrade(&self.dev);
        let kick: Kick = Arc::new(move || {
            if let Some(d) = dev.upgrade() {
                d.kick();
            }
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
            kick: Some(kick),
            poster_hooks: Some(Arc::new(move || {
                softnic::initiator::device_hooks(&hooks_qp)
            })),
            keep: q.clone(),
        }
    }

    fn progress(&self) -> Option<Progress> {
        Some(Progress {
            sq_consumed: self.qp.sq_consumer(),
            sq_finished: self.qp.sq_finished(),
            rq_consumed: self.qp.rq_consumer(),
        })
    }

    fn is_live(&self) -> bool {
        self.dev
            .qp(self.qp.qpn())
            .is_some_and(|d| Arc::ptr_eq(&d, &self.qp))
    }

    fn destroy(&self) {
        self.dev.destroy_qp(&self.qp)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
