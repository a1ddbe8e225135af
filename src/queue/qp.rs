//! RC queue pairs: their options, the device's QP behind each, creation, state transitions,
//! endpoints and connection.

use super::cq::Cq;
use super::poster::Posters;
use super::ring::{placement_of, resolve, RingPlacement};
use crate::backend::seam::{GpuRings, QpOps, QpSpec, Remote};
use crate::backend::ConnectOptions;
use crate::endpoint::Endpoint;
use crate::gpu::Gpu;
use crate::memory::Pd;
use crate::Error;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use verbs::{Access, DoorbellMode, Modify, QpState};

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
    /// A cross-channel master (a ConnectX's `cd_master`): the QP may post WAIT WQEs on other
    /// QPs' CQs, as a companion QP does ([`Pd::create_companion`]). On a ConnectX only DEVX
    /// QPs can ask for it (the mlx5 backend then makes the QP with DEVX).
    pub cross_channel: bool,
}

impl QpOptions {
    /// Defaults: 256-block SQ, 256-entry RQ of 1 SGE, 256 bytes inline, automatic ring
    /// placement and doorbell mode.
    pub fn new(send_cq: &Cq, recv_cq: &Cq) -> Self {
        Self {
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            sq_blocks: 256,
            rq_wqes: 256,
            max_recv_sge: 1,
            max_inline: 256,
            placement: RingPlacement::Auto,
            doorbell: DoorbellMode::Auto,
            cross_channel: false,
        }
    }
}

/// An RC queue pair. Dropping it destroys the device QP (peers see it vanish).
#[derive(Debug)]
pub struct Qp {
    pub(crate) pd: Pd,
    pub(crate) dev: Arc<dyn QpOps>,
    pub(crate) send_cq: Cq,
    pub(crate) recv_cq: Cq,
    pub(crate) doorbell: DoorbellMode,
    pub(crate) doorbell_reason: String,
    /// Why its rings are where they are.
    pub(crate) placement_reason: String,
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

impl Pd {
    /// Creates an RC QP in RESET, its rings in host memory ([`RingPlacement::Gpu`] needs
    /// [`Pd::create_qp_on`]).
    pub fn create_qp(&self, o: QpOptions) -> Result<Qp, Error> {
        self.create_qp_with(o, None)
    }

    /// Creates an RC QP in RESET for `gpu`'s kernels, its SQ and RQ rings placed as
    /// `o.placement` says: in `gpu`'s memory for [`RingPlacement::Gpu`], and for
    /// [`RingPlacement::Auto`] where the device wants them (the doorbell record, the CPU-proxy
    /// word and the doorbell register stay in host memory). Its CQs are placed by their own
    /// options.
    pub fn create_qp_on(&self, gpu: &Arc<Gpu>, o: QpOptions) -> Result<Qp, Error> {
        self.create_qp_with(o, Some(gpu as &dyn GpuRings))
    }

    /// Creates a companion QP: the QP on which the NIC itself moves completion counters
    /// (`put_counter` and its kin in the device API, as DOCA GPUNetIO's companion QP). It is
    /// a cross-channel master (a ConnectX's `cd_master`, so it may post WAIT on any QP's send
    /// CQ), has no RQ, and is connected to itself (loopback), so that the fetch-add it posts
    /// after each WAIT lands in this device's own memory: a counter registered with
    /// REMOTE_ATOMIC in this PD. One companion may serve many QPs of the PD (a group); its
    /// send CQ (`o.send_cq`) must be its own. `gpu`: as [`Pd::create_qp_on`] (`None`: host
    /// rings). Export it with [`crate::Gpu::export_qp`] as any QP and pass both descriptors
    /// to the counter calls.
    pub fn create_companion(&self, gpu: Option<&Arc<Gpu>>, mut o: QpOptions) -> Result<Qp, Error> {
        o.cross_channel = true;
        o.rq_wqes = 0;
        let qp = self.create_qp_with(o, gpu.map(|g| g as &dyn GpuRings))?;
        let access =
            Access(Access::REMOTE_ATOMIC.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0);
        let c = ConnectOptions {
            access,
            ..ConnectOptions::default()
        };
        qp.connect(&qp.endpoint(), c)?;
        Ok(qp)
    }

    /// Creates an RC QP for `gpu`'s kernels (`None`: no GPU given), its rings placed as asked.
    pub(super) fn create_qp_with(
        &self,
        o: QpOptions,
        gpu: Option<&dyn GpuRings>,
    ) -> Result<Qp, Error> {
        let device = &*self.ctx.inner.device;
        let (gpu, placement_reason) = resolve(o.placement, gpu, device, "Pd::create_qp_on")?;
        let (mode, reason) = self.doorbell_of(o.doorbell, gpu.is_some());
        let spec = QpSpec {
            sq_blocks: o.sq_blocks,
            rq_wqes: o.rq_wqes,
            max_recv_sge: o.max_recv_sge,
            max_inline: o.max_inline,
            doorbell: mode,
            gpu,
            cross_channel: o.cross_channel,
        };
        let dev = self.dev.create_qp(&spec, &o.send_cq.dev, &o.recv_cq.dev)?;
        self.finish_qp(o, dev, (mode, reason), placement_reason)
    }

    /// The doorbell mode a QP's options ask for, resolved for rings where `rings_on_gpu`
    /// says, and why.
    pub(super) fn doorbell_of(
        &self,
        asked: DoorbellMode,
        rings_on_gpu: bool,
    ) -> (DoorbellMode, String) {
        match asked {
            DoorbellMode::Auto => {
                let (mode, why) = self.ctx.inner.device.auto_doorbell(rings_on_gpu);
                (mode, why.to_string())
            }
            m => (m, "requested".to_string()),
        }
    }

    /// Registers a new device QP with the PD and wraps it.
    pub(super) fn finish_qp(
        &self,
        o: QpOptions,
        dev: Arc<dyn QpOps>,
        (mode, reason): (DoorbellMode, String),
        placement_reason: String,
    ) -> Result<Qp, Error> {
        tracing::debug!(qpn = dev.qpn(), ?mode, %reason, "QP created");
        self.qps.add(Arc::downgrade(&dev));
        // the host API keeps the CPU-proxy word of a QP whose device has none
        let proxy_word = dev
            .geometry()
            .proxy_word
            .is_none()
            .then(|| crate::HostBuffer::new(64));
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
            placement_reason,
            psn: AtomicU32::new(psn),
            reset_at_scq_ci: AtomicU32::new(created_at),
            posters: Arc::default(),
            proxy_word,
        })
    }
}

impl Qp {
    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.dev.qpn()
    }
    /// State (on the mlx5 backend as QUERY_QP reports it; ERR when the query fails).
    pub fn state(&self) -> QpState {
        self.dev.state()
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
    pub fn soft(&self) -> Option<&Arc<crate::soft::raw::Qp>> {
        crate::backend::soft::qp_of(&*self.dev)
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
        let local = self.endpoint();
        let r = Remote {
            gid: remote.gid().into(),
            qpn: remote.qpn(),
            psn: remote.psn(),
            mtu: remote.common_mtu(&local),
            udp: remote.udp_port().and(remote.udp_addr()),
            selective_repeat: remote.selective_repeat() && local.selective_repeat(),
            shown: remote,
        };
        self.dev.connect(&r, self.psn(), &o)
    }

    /// A raw state transition (illegal ones are errors). On the mlx5 backend only RESET and
    /// ERR (the others take attributes: [`Qp::connect`]).
    ///
    /// RESET starts the queues afresh, as a device and libmlx5 do: producer and consumer
    /// indexes 0, the doorbell record and the CPU-proxy word cleared; the CQs keep their
    /// consumer indexes (a new poster continues there), and completions of the QP's earlier
    /// run that nobody took stay in them ([`Qp::recover`] takes them first).
    pub fn modify(&self, m: Modify) -> Result<(), Error> {
        self.dev.modify(m)?;
        if m == Modify::Reset {
            self.after_reset();
        }
        Ok(())
    }

    /// The host's part of a reset: the CPU-proxy word back to 0 (a kernel's producer starts
    /// there again) and the send CQ's consumer index noted (the CQEs before it are the earlier
    /// run's).
    fn after_reset(&self) {
        if let Some(w) = self.geometry().proxy_word {
            w.store_u64(0);
        }
        let ci = self.send_cq.consumer_index();
        self.reset_at_scq_ci.store(ci, Ordering::Release);
    }

    /// The first PSN of the send queue (the one [`Qp::endpoint`] carries).
    pub fn psn(&self) -> u32 {
        self.psn.load(Ordering::Acquire)
    }

    /// Where its SQ and RQ rings live (never `Auto`: what it became).
    pub fn placement(&self) -> RingPlacement {
        placement_of(self.dev.geometry().sq)
    }

    /// Why its rings are there ("requested", or what `RingPlacement::Auto` chose and why).
    pub fn placement_reason(&self) -> &str {
        &self.placement_reason
    }
}

impl Qp {
    /// The QP's geometry, as its backend made it (with the host API's CPU-proxy word of an
    /// rdma-core QP).
    pub(crate) fn geometry(&self) -> crate::backend::geometry::QpGeometry<'_> {
        let mut g = self.dev.geometry();
        if let Some(w) = &self.proxy_word {
            g.proxy_word = Some(crate::backend::geometry::Place::Buf(&w.buf, 0));
            g.keep = Arc::new((g.keep, w.buf.clone()));
        }
        g
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // (an rdma-core QP is destroyed when the last holder, maybe an initiator, lets go)
        self.dev.destroy();
    }
}
