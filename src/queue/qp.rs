//! RC queue pairs: their options, the device's QP behind each, creation, state transitions,
//! endpoints and connection.

use super::cq::{Cq, CqDev};
use super::poster::Posters;
use super::ring::{needs_gpu, placement_of, DoorbellMode, RingPlacement};
use crate::backend::context::Backend;
use crate::backend::ConnectOptions;
use crate::endpoint::Endpoint;
use crate::gpu::Gpu;
use crate::memory::{Pd, PdDev};
use crate::Error;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use verbs::{DmaBuf, QpState};

/// Parameters of an RC QP.
#[derive(Clone, Debug)]
pub struct QpOptions {
    /// CQ of requester completions.
    pub send_cq: Cq,
    /// CQ of responder completions.
    pub recv_cq: Cq,
    /// SQ size in 64-byte blocks (power of two).
    pub sq_blocks: u32,
    /// RQ size in WQEs (power of two, or 0).
    pub rq_wqes: u32,
    /// SGEs per receive WQE.
    pub max_recv_sge: u32,
    /// Largest inline payload.
    pub max_inline: u32,
    /// Ring placement.
    pub placement: RingPlacement,
    /// Doorbell mode.
    pub doorbell: DoorbellMode,
}

impl QpOptions {
    /// Defaults: 256-block SQ, 256-entry RQ of 1 SGE, 256 bytes inline, host-mapped rings,
    /// automatic doorbell mode.
    pub fn new(send_cq: &Cq, recv_cq: &Cq) -> Self {
        Self {
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            sq_blocks: 256,
            rq_wqes: 256,
            max_recv_sge: 1,
            max_inline: 256,
            placement: RingPlacement::HostMapped,
            doorbell: DoorbellMode::Auto,
        }
    }
}

/// An RC queue pair. Dropping it destroys the device QP (peers see it vanish).
#[derive(Debug)]
pub struct Qp {
    pub(crate) pd: Pd,
    pub(crate) dev: QpDev,
    pub(crate) send_cq: Cq,
    pub(crate) recv_cq: Cq,
    pub(crate) doorbell: DoorbellMode,
    pub(crate) doorbell_reason: String,
    /// The send queue's first PSN (random; a new one at every [`Qp::recover`]).
    pub(crate) psn: AtomicU32,
    /// The send CQ's consumer index when the QP was created or last went to RESET: the CQEs
    /// before it are not of the QP's current run, which a new poster must not count.
    pub(crate) reset_at_scq_ci: AtomicU32,
    pub(crate) posters: Arc<Posters>,
    /// The CPU-proxy word of an mlx5 QP (a soft QP has one in its control page): the kernel
    /// stores its producer index there and the proxy turns it into doorbells.
    pub(crate) proxy_word: Option<crate::HostBuffer>,
}

/// The device's QP.
pub(crate) enum QpDev {
    Soft(Arc<softnic::Qp>),
    Mlx5(Arc<crate::backend::mlx5::Qp>),
}

impl std::fmt::Debug for QpDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Soft(q) => write!(f, "soft QP {:#x}", q.qpn()),
            Self::Mlx5(q) => write!(f, "mlx5 QP {:#x}", q.qpn),
        }
    }
}

impl Pd {
    /// Creates an RC QP in RESET, its rings in host memory ([`RingPlacement::Gpu`] needs
    /// [`Pd::create_qp_on`]).
    pub fn create_qp(&self, o: QpOptions) -> Result<Qp, Error> {
        needs_gpu(o.placement, "Pd::create_qp_on")?;
        self.create_qp_with(o, None, None)
    }

    /// Creates an RC QP in RESET whose SQ and RQ rings are placed as `o.placement` says: in
    /// `gpu`'s memory for [`RingPlacement::Gpu`] (the doorbell record, the CPU-proxy word and
    /// the doorbell register stay in host memory). Its CQs are placed by their own options.
    pub fn create_qp_on(&self, gpu: &Arc<Gpu>, o: QpOptions) -> Result<Qp, Error> {
        let rings = match (o.placement, &self.ctx.inner.backend) {
            (RingPlacement::HostMapped, _) => None,
            // a DEVX QP's WQ (RQ then SQ) is one buffer, made with the QP
            (RingPlacement::Gpu, Backend::Mlx5(_)) => None,
            (RingPlacement::Gpu, Backend::Soft(_)) => {
                let sq = (o.sq_blocks as usize).saturating_mul(prm::WQEBB);
                let rq = (o.rq_wqes as usize).saturating_mul(rq_stride(o.max_recv_sge) as usize);
                Some((gpu.ring_buffer(sq)?, gpu.ring_buffer(rq)?))
            }
        };
        let gpu = (o.placement == RingPlacement::Gpu).then_some(gpu);
        self.create_qp_with(o, rings, gpu)
    }

    pub(super) fn create_qp_with(
        &self,
        o: QpOptions,
        rings: Option<(DmaBuf, DmaBuf)>,
        gpu: Option<&Arc<Gpu>>,
    ) -> Result<Qp, Error> {
        let (sq_ring, rq_ring) = rings.unzip();
        let (mode, reason) = match o.doorbell {
            DoorbellMode::Auto => (
                DoorbellMode::GpuDoorbell,
                match &self.dev {
                    PdDev::Soft(_) => {
                        "auto: the soft NIC's doorbell page is host memory that maps into any GPU"
                    }
                    PdDev::Mlx5(_) => {
                        "auto: GPU doorbell; the UAR page is registered into the GPU at export \
                         (as I/O memory, else as plain memory; the export fails and says why \
                         when the GPU cannot map it)"
                    }
                }
                .to_string(),
            ),
            m => (m, "requested".to_string()),
        };
        let dev = match (
            &self.ctx.inner.backend,
            &self.dev,
            &o.send_cq.dev,
            &o.recv_cq.dev,
        ) {
            (Backend::Soft(d), PdDev::Soft(id), CqDev::Soft(scq), CqDev::Soft(rcq)) => {
                QpDev::Soft(d.create_qp(softnic::QpConfig {
                    pd: *id,
                    send_cq: scq.clone(),
                    recv_cq: rcq.clone(),
                    sq_blocks: o.sq_blocks,
                    rq_wqes: o.rq_wqes,
                    max_recv_sge: o.max_recv_sge,
                    max_inline: o.max_inline,
                    doorbell: if mode == DoorbellMode::BlueFlame {
                        softnic::DoorbellKind::BlueFlame
                    } else {
                        softnic::DoorbellKind::Register
                    },
                    sq_ring,
                    rq_ring,
                    rq_stride: None,
                    dbrec: None,
                    uar: None,
                    user_index: None,
                })?)
            }
            (Backend::Mlx5(_), PdDev::Mlx5(pd), CqDev::Mlx5(scq), CqDev::Mlx5(rcq)) => {
                if !o.sq_blocks.is_power_of_two()
                    || (o.rq_wqes != 0 && !o.rq_wqes.is_power_of_two())
                {
                    return Err(Error::InvalidArgument(format!(
                        "SQ of {} blocks, RQ of {} WQEs: powers of two",
                        o.sq_blocks, o.rq_wqes
                    )));
                }
                // rings in GPU memory, or CQs made with DEVX: the QP is made with DEVX too
                if gpu.is_some()
                    || scq.is_devx()
                    || rcq.is_devx()
                    || crate::backend::mlx5::devx_always()
                {
                    let stride = rq_stride(o.max_recv_sge);
                    let len =
                        o.rq_wqes as usize * stride as usize + o.sq_blocks as usize * prm::WQEBB;
                    let (wq, dmabuf) = match gpu {
                        Some(g) => {
                            let wq = g.ring_buffer(len)?;
                            let d = g.dmabuf(wq.addr(), len as u64).map_err(|e| e.to_string());
                            (wq, Some(d))
                        }
                        None => (DmaBuf::alloc(len), None),
                    };
                    // the doorbell record beside GPU rings is GPU memory too, unless the CPU
                    // proxy writes it
                    let rec = match gpu {
                        Some(g) if mode != DoorbellMode::CpuProxy => g.ring_buffer(8)?,
                        _ => DmaBuf::alloc(64),
                    };
                    let q = pd.create_devx_qp(
                        scq,
                        rcq,
                        o.sq_blocks,
                        o.rq_wqes,
                        stride,
                        wq,
                        dmabuf,
                        rec,
                        mode == DoorbellMode::BlueFlame,
                    )?;
                    return self.finish_qp(o, QpDev::Mlx5(q), mode, reason);
                }
                // libmlx5 sizes the SQ as the power of two of max_send_wr times its largest
                // WQE (ctrl + raddr + the inline data, in 64-byte blocks; versions differ in
                // what else they count): ask for as many work requests of that size as fit in
                // the blocks asked for, and fewer while the provider makes a larger SQ.
                let wqe_blocks = (32 + (4 + o.max_inline as usize).next_multiple_of(16))
                    .div_ceil(prm::WQEBB)
                    .max(1) as u32;
                let mut wrs = (o.sq_blocks / wqe_blocks).max(1);
                loop {
                    let q = pd.create_qp(scq, rcq, wrs, o.rq_wqes, o.max_recv_sge, o.max_inline)?;
                    if q.sq_blocks <= o.sq_blocks || wrs == 1 {
                        break QpDev::Mlx5(q);
                    }
                    wrs /= 2;
                }
            }
            _ => {
                return Err(Error::InvalidArgument(
                    "the QP's CQs belong to another device".into(),
                ))
            }
        };
        self.finish_qp(o, dev, mode, reason)
    }

    /// Registers a new device QP with the PD and wraps it.
    fn finish_qp(
        &self,
        o: QpOptions,
        dev: QpDev,
        mode: DoorbellMode,
        reason: String,
    ) -> Result<Qp, Error> {
        tracing::debug!(qpn = dev_qpn(&dev), ?mode, %reason, "QP created");
        self.qps.add(match &dev {
            QpDev::Soft(q) => crate::memory::TrackedQp::Soft(Arc::downgrade(q)),
            QpDev::Mlx5(q) => crate::memory::TrackedQp::Mlx5(Arc::downgrade(q)),
        });
        let dev_kind = match &dev {
            QpDev::Soft(_) => DevKind::Soft,
            QpDev::Mlx5(_) => DevKind::Mlx5,
        };
        // Random per QP (as perftest draws one), so that a QP restarted with the same QPN
        // does not take stale packets of its earlier incarnation, nor do guessed PSNs work.
        let psn = Endpoint::random_psn();
        let created_at = o.send_cq.consumer_index();
        Ok(Qp {
            pd: self.clone(),
            dev,
            send_cq: o.send_cq,
            recv_cq: o.recv_cq,
            doorbell: mode,
            doorbell_reason: reason,
            psn: AtomicU32::new(psn),
            reset_at_scq_ci: AtomicU32::new(created_at),
            posters: Arc::default(),
            proxy_word: matches!(dev_kind, DevKind::Mlx5).then(|| crate::HostBuffer::new(64)),
        })
    }
}

/// Bytes per receive WQE for `max_recv_sge` scatter entries (a power of two of 16-byte data
/// segments, as the device reads them).
fn rq_stride(max_recv_sge: u32) -> u32 {
    (max_recv_sge.clamp(1, 32) * 16).next_power_of_two()
}

enum DevKind {
    Soft,
    Mlx5,
}

fn dev_qpn(d: &QpDev) -> u32 {
    match d {
        QpDev::Soft(q) => q.qpn(),
        QpDev::Mlx5(q) => q.qpn,
    }
}

impl Qp {
    /// QP number.
    pub fn qpn(&self) -> u32 {
        dev_qpn(&self.dev)
    }
    /// State (on the mlx5 backend as QUERY_QP reports it; ERR when the query fails).
    pub fn state(&self) -> QpState {
        match &self.dev {
            QpDev::Soft(q) => q.state(),
            QpDev::Mlx5(q) => match q.state() {
                Ok(0) => QpState::Reset,
                Ok(1) => QpState::Init,
                Ok(2) => QpState::Rtr,
                Ok(3) => QpState::Rts,
                _ => QpState::Err,
            },
        }
    }
    /// The doorbell mode, as resolved, and why.
    pub fn doorbell(&self) -> (DoorbellMode, &str) {
        (self.doorbell, &self.doorbell_reason)
    }
    /// The protection domain.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }
    /// The send CQ.
    pub fn send_cq(&self) -> &Cq {
        &self.send_cq
    }
    /// The receive CQ.
    pub fn recv_cq(&self) -> &Cq {
        &self.recv_cq
    }
    /// The soft NIC's QP (rings, doorbell record, register page, fault injection): soft
    /// backend only.
    pub fn soft(&self) -> Option<&Arc<softnic::Qp>> {
        match &self.dev {
            QpDev::Soft(q) => Some(q),
            QpDev::Mlx5(_) => None,
        }
    }

    /// What the peer needs to connect to this QP (no rkey: memory travels separately, and
    /// only when the application exports it).
    pub fn endpoint(&self) -> Endpoint {
        let sel = self.pd.ctx.selection();
        Endpoint::new(
            self.pd.ctx.gid(),
            self.qpn(),
            self.psn(),
            self.pd.ctx.mtu(),
            sel.name.clone(),
        )
        .and_then(|e| e.with_udp_port(self.pd.ctx.udp_port()))
        .expect("a device's own QPN, PSN, MTU and UDP port are in range")
        // a soft NIC on the wire holds packets behind a gap and resends selectively
        .with_selective_repeat(self.pd.ctx.udp_port().is_some())
    }

    /// RESET → INIT → RTR → RTS towards `remote`, at the smaller of both MTUs.
    pub fn connect(&self, remote: &Endpoint, o: ConnectOptions) -> Result<(), Error> {
        use softnic::Modify;
        let mtu = remote.common_mtu(&self.endpoint());
        match &self.dev {
            QpDev::Soft(q) => {
                self.pd.ctx.route_to(
                    q,
                    softnic::Gid::from(remote.gid()),
                    remote.udp_port().and(remote.udp_addr()),
                    remote,
                    &remote.gid(),
                )?;
                q.modify(Modify::Init { access: o.access })?;
                let mut rtr = remote.rtr_attr(o.min_rnr_timer);
                rtr.mtu = mtu;
                rtr.selective_repeat =
                    remote.selective_repeat() && self.endpoint().selective_repeat();
                q.modify(Modify::Rtr(rtr))?;
                q.modify(Modify::Rts(softnic::RtsAttr {
                    sq_psn: self.psn(),
                    timeout: o.timeout,
                    retry_cnt: o.retry_cnt,
                    rnr_retry: o.rnr_retry,
                }))?;
            }
            QpDev::Mlx5(q) => {
                let r = crate::backend::mlx5::Remote {
                    gid: remote.gid().0,
                    qpn: remote.qpn(),
                    psn: remote.psn(),
                    mtu,
                };
                q.connect(o.access, &r, self.psn(), &o)?;
            }
        }
        Ok(())
    }

    /// A raw state transition (illegal ones are errors). On the mlx5 backend only RESET and
    /// ERR (the others take attributes: [`Qp::connect`]).
    ///
    /// RESET starts the queues afresh, as a device and libmlx5 do: producer and consumer
    /// indexes 0, the doorbell record and the CPU-proxy word cleared; the CQs keep their
    /// consumer indexes (a new poster continues there), and completions of the QP's earlier
    /// run that nobody took stay in them ([`Qp::recover`] takes them first).
    pub fn modify(&self, m: softnic::Modify) -> Result<(), Error> {
        let reset = matches!(m, softnic::Modify::Reset);
        match &self.dev {
            QpDev::Soft(q) => q.modify(m)?,
            QpDev::Mlx5(q) => match m {
                softnic::Modify::Reset => q.to_state(rdma_core_sys::IBV_QPS_RESET)?,
                softnic::Modify::Err => q.to_state(rdma_core_sys::IBV_QPS_ERR)?,
                other => {
                    return Err(Error::Unsupported(format!(
                        "{other:?} on an mlx5 QP: use Qp::connect"
                    )))
                }
            },
        }
        if reset {
            self.after_reset();
        }
        Ok(())
    }

    /// The host's part of a reset: the CPU-proxy word back to 0 (a kernel's producer starts
    /// there again) and the send CQ's consumer index noted (the CQEs before it are the earlier
    /// run's).
    fn after_reset(&self) {
        let word = match (&self.dev, &self.proxy_word) {
            (QpDev::Soft(q), _) => Some(q.ctrl_page().atomic_u64(q.proxy_offset())),
            (QpDev::Mlx5(_), Some(w)) => Some(w.atomic_u64(0)),
            (QpDev::Mlx5(_), None) => None,
        };
        if let Some(w) = word {
            w.store(0, Ordering::Release);
        }
        let ci = self.send_cq.consumer_index();
        self.reset_at_scq_ci.store(ci, Ordering::Release);
    }

    /// The first PSN of the send queue (the one [`Qp::endpoint`] carries).
    pub fn psn(&self) -> u32 {
        self.psn.load(Ordering::Acquire)
    }

    /// Where its SQ and RQ rings live.
    pub fn placement(&self) -> RingPlacement {
        match &self.dev {
            QpDev::Soft(q) => placement_of(q.sq_ring()),
            QpDev::Mlx5(q) => placement_of(&q.sq),
        }
    }
}

impl Qp {
    /// The QP's geometry, as its backend made it (with the host API's CPU-proxy word of an
    /// rdma-core QP).
    pub(crate) fn geometry(&self) -> crate::backend::geometry::QpGeometry<'_> {
        match &self.dev {
            QpDev::Soft(q) => crate::backend::soft::qp_geometry(self.pd.ctx.soft_device(), q),
            QpDev::Mlx5(q) => {
                let mut g = q.geometry();
                if let Some(w) = &self.proxy_word {
                    g.proxy_word = Some(crate::backend::geometry::Place::Buf(&w.buf, 0));
                    g.keep = Arc::new((g.keep, w.buf.clone()));
                }
                g
            }
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // (an rdma-core QP is destroyed when the last holder, maybe an initiator, lets go)
        if let (Backend::Soft(d), QpDev::Soft(q)) = (&self.pd.ctx.inner.backend, &self.dev) {
            d.destroy_qp(q)
        }
    }
}
