//! The CPU initiator (`verbs::initiator`) on a soft-NIC QP: its geometry read off the QP, the
//! queue's state taken over from memory and the device, and what only this device offers a
//! poster (CQ overrun probes, sleeping until the engine writes a CQE, the engine's turn, and
//! waking the engine at each doorbell instead of having it poll).

pub use verbs::initiator::*;

use crate::qp::Qp;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Marks a soft QP as posted to by a CPU initiator that wakes its engine (so the engine need
/// not poll for its doorbells), until dropped.
struct KickingPoster(Arc<Qp>);

impl KickingPoster {
    fn new(qp: &Arc<Qp>) -> Self {
        qp.kicking_poster.store(true, Ordering::Relaxed);
        Self(qp.clone())
    }
}

impl Drop for KickingPoster {
    fn drop(&mut self) {
        self.0.kicking_poster.store(false, Ordering::Relaxed);
    }
}

/// The constructors of an [`Initiator`] on a soft-NIC QP.
pub trait SoftQpInitiator: Sized {
    /// An initiator for a soft-NIC QP (its CQs must not be polled by anyone else). It
    /// continues from the queue's state as the memory and the device hold it, so it may follow
    /// an earlier poster (another initiator, a kernel, the CPU proxy) that has stopped: its
    /// producer index is the doorbell record's send word (the last producer rung), the SQ
    /// space not yet executed by the device stays taken, the RQ head is the record's receive
    /// word, and each CQ poller starts at the consumer index in its CQ doorbell record (owner
    /// parity included). WQEs written but never rung by the earlier poster are overwritten.
    ///
    /// # Panics
    /// When a ring of the QP or of its CQs is in device memory (a CPU cannot store into GPU
    /// memory) or a CQ has 128-byte entries; [`SoftQpInitiator::try_for_soft_qp`] returns
    /// that as an error.
    fn for_soft_qp(dev: &crate::Device, qp: &Arc<Qp>, mode: RingMode) -> Self {
        match Self::try_for_soft_qp(dev, qp, mode) {
            Ok(i) => i,
            Err(e) => panic!("{e}"),
        }
    }

    /// An initiator for a soft-NIC QP, or [`crate::Error::InvalidArgument`] when a ring of the
    /// QP or of its CQs is in device memory: the CPU initiator writes WQEs and polls CQEs with
    /// host loads and stores, which GPU-resident rings do not allow (drive such a QP from a
    /// kernel), or a CQ has 128-byte entries (its poller reads 64-byte CQEs).
    fn try_for_soft_qp(
        dev: &crate::Device,
        qp: &Arc<Qp>,
        mode: RingMode,
    ) -> Result<Self, crate::Error>;
}

impl SoftQpInitiator for Initiator {
    fn try_for_soft_qp(
        dev: &crate::Device,
        qp: &Arc<Qp>,
        mode: RingMode,
    ) -> Result<Self, crate::Error> {
        let on_device = !qp.sq_ring().is_host()
            || !qp.rq_ring().is_host()
            || !qp.send_cq().ring().is_host()
            || !qp.recv_cq().ring().is_host();
        if on_device {
            return Err(crate::Error::InvalidArgument(
                "the CPU initiator cannot drive a QP whose rings (SQ, RQ or CQ) are in device \
                 memory: drive it from a GPU kernel",
            ));
        }
        if qp.send_cq().cqe_size() != crate::CqeSize::B64
            || qp.recv_cq().cqe_size() != crate::CqeSize::B64
        {
            return Err(crate::Error::InvalidArgument(
                "the CPU initiator polls CQs of 64-byte CQEs only",
            ));
        }
        Ok(for_host_rings(dev, qp, mode))
    }
}

/// The ring geometry of a soft QP whose rings are all host memory.
fn geometry(qp: &Qp) -> (SqGeometry, RqGeometry, CqGeometry, CqGeometry) {
    let cq_geom = |cq: &crate::Cq| CqGeometry {
        ring: cq.ring().as_ptr(),
        ncqe: cq.ncqe(),
        dbrec: cq.dbrec().as_ptr(),
        collapsed: cq.mode() == crate::CqMode::Collapsed,
    };
    // SAFETY: offsets inside the QP's own pages (its doorbell record's: the control page, or
    // the external record it was given).
    let (dbrec, bf) = unsafe {
        (
            qp.dbrec_page().as_ptr().add(qp.dbrec_offset()),
            qp.uar().as_ptr().add(prm::doorbell::BF_OFFSET),
        )
    };
    let sq = SqGeometry {
        ring: qp.sq_ring().as_ptr(),
        blocks: qp.sq_blocks(),
        dbrec,
        bf_reg: bf,
        qpn: qp.qpn(),
    };
    let rq = RqGeometry {
        ring: qp.rq_ring().as_ptr(),
        wqes: qp.rq_wqes(),
        stride: qp.rq_stride(),
        dbrec,
    };
    (sq, rq, cq_geom(qp.send_cq()), cq_geom(qp.recv_cq()))
}

fn for_host_rings(dev: &crate::Device, qp: &Arc<Qp>, mode: RingMode) -> Initiator {
    let (sq, rq, scq, rcq) = geometry(qp);
    let shared = dev.shared().clone();
    let wake: Arc<dyn Fn() + Send + Sync> = Arc::new(move || shared.kick());
    // SAFETY: all pointers come from buffers of `qp` (and its CQs), kept alive by the Arc
    // handed over as keep-alive (memory a QP was given from elsewhere stays valid while the
    // QP is not destroyed, `DmaBuf::from_external`'s contract).
    let ini = unsafe { Initiator::from_geometry(sq, rq, scq, rcq, mode, qp.clone(), Some(wake)) };
    let mut ini = ini.with_device(device_hooks(qp));
    ini.resume_at(queue_start(qp));
    ini
}

/// What the soft NIC tells and does for a CPU poster of `qp`, while the hooks live: CQ
/// overrun probes, sleeping until the engine writes a CQE, the engine's turn, and a guard that
/// has the engine take this poster's doorbells from its wake-ups instead of polling for them.
pub fn device_hooks(qp: &Arc<Qp>) -> DeviceHooks {
    let probe = |cq: &Arc<crate::Cq>| -> Arc<dyn Fn() -> bool + Send + Sync> {
        let cq = cq.clone();
        Arc::new(move || cq.is_overrun())
    };
    let waiter = |cq: &Arc<crate::Cq>| -> CqWait {
        let cq = cq.clone();
        Arc::new(move |consumed, t| cq.wait_beyond(consumed, t))
    };
    let sleepable = |cq: &Arc<crate::Cq>| cq.mode() != crate::CqMode::Collapsed;
    let turn = qp.clone();
    DeviceHooks {
        cq_error: Some([probe(qp.send_cq()), probe(qp.recv_cq())]),
        wait_cq: (sleepable(qp.send_cq()) && sleepable(qp.recv_cq()))
            .then(|| [waiter(qp.send_cq()), waiter(qp.recv_cq())]),
        engine_turn: Some(Arc::new(move || turn.engine_turn.load(Ordering::Relaxed))),
        guard: Some(Box::new(KickingPoster::new(qp))),
    }
}

/// The queue's state as the QP's memory and the device hold it (see
/// [`SoftQpInitiator::for_soft_qp`]).
fn queue_start(qp: &Qp) -> QueueStart {
    let rec = qp.dbrec_page();
    let word = |i: usize| {
        u32::from_be(
            rec.atomic_u32(qp.dbrec_offset() + 4 * i)
                .load(Ordering::Acquire),
        )
    };
    let (rq_head, sq_pi) = (word(0) as u16, word(1) as u16);
    QueueStart {
        sq_pi,
        // blocks the device has not executed yet belong to WQEs still in flight
        sq_unfinished: sq_pi.wrapping_sub(qp.sq_consumer()),
        rq_head,
        rq_outstanding: rq_head.wrapping_sub(qp.rq_consumer() as u16),
    }
}
