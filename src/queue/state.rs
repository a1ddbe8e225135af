//! A QP's queue state as memory and the device hold it, from which a new poster continues:
//! the CPU initiator here ([`Qp::cpu_initiator`]); a GPU export and the CPU proxy above.

use super::poster::Poster;
use super::qp::Qp;
use crate::backend::geometry::{CqGeometry, QpGeometry};
use crate::Error;
use std::sync::Arc;

/// A QP's queue state as memory and the device hold it, from which a new poster continues.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct QueueState {
    /// The producer index (64-bit): the CPU-proxy word when it is at or ahead of the doorbell
    /// record's 16 bits (a kernel's producer not yet rung, or rung), else those 16 bits.
    pub sq_pi: u64,
    /// Blocks before `sq_pi` that the device has not executed yet.
    pub sq_in_flight: u16,
    /// The RQ head (doorbell record, receive word).
    pub rq_head: u16,
    /// The RQ consumer index (receives consumed), `None` where it cannot be known (an
    /// rdma-core QP whose receive CQ is its send CQ).
    pub rq_consumer: Option<u32>,
    /// Send and receive CQ consumer indexes (their CQ doorbell records, 24 bits).
    pub scq_ci: u32,
    pub rcq_ci: u32,
    /// The last word (wqe_counter, signature, op_own) of the send CQ's slot 0 when it holds
    /// a CQE (for a collapsed CQ).
    pub scq_slot0: Option<u32>,
}

impl Qp {
    /// The queue's state as memory and the device hold it (where a new poster continues):
    /// the producer from the doorbell record and the CPU-proxy word, the RQ head from the
    /// record, the CQ consumer indexes from their records; what the device has executed from
    /// its own consumer indexes where it shows them (a software device), else from the
    /// completions taken ([`QueueState::inferred`]).
    pub(crate) fn queue_state(&self) -> QueueState {
        let g = self.geometry();
        let sq_pi = g.sq_producer();
        let rq_head = g.dbrec.word(0) as u16;
        let (scq_ci, rcq_ci) = (self.send_cq.consumer_index(), self.recv_cq.consumer_index());
        let Some(p) = self.dev.progress() else {
            return QueueState::inferred(self, &g, sq_pi, rq_head);
        };
        let in_flight = (sq_pi as u16).wrapping_sub(p.sq_consumed);
        let scq_slot0 = self
            .send_cq
            .geometry()
            .ring
            .load_u32_acquire(prm::cqe::CQE_TAIL_OFFSET)
            .ok()
            .filter(|t| t.to_ne_bytes()[3] >> 4 != prm::cqe::CqeOpcode::Invalid as u8);
        QueueState {
            sq_pi,
            sq_in_flight: if u32::from(in_flight) <= g.sq_blocks {
                in_flight
            } else {
                0
            },
            rq_head,
            rq_consumer: Some(p.rq_consumed),
            scq_ci,
            rcq_ci,
            scq_slot0,
        }
    }
}

impl QueueState {
    /// The queue state of a QP whose device does not show its consumer indexes (an rdma-core
    /// QP without DEVX queries), from memory alone: the SQ blocks not yet retired counted from
    /// the last requester completion the send CQ holds for this QP (RC completes in order:
    /// every WQE up to the end of that one is done; the blocks after it stay taken until a
    /// later completion retires them). Receives: every consumed receive's completion is taken
    /// (what [`crate::gpu`]'s export requires), so the RQ's consumer index is the receive
    /// CQ's.
    fn inferred(qp: &Qp, g: &QpGeometry<'_>, sq_pi: u64, rq_head: u16) -> Self {
        use std::sync::atomic::Ordering::Acquire;
        let (scq_ci, rcq_ci) = (qp.send_cq.consumer_index(), qp.recv_cq.consumer_index());
        let scq = qp.send_cq.geometry();
        // the CQEs of the QP's run before its creation or last RESET do not count
        let since = qp.reset_at_scq_ci.load(Acquire);
        let unretired = match last_req_end(&scq, g, scq_ci, since) {
            Some(end) => (sq_pi as u16).wrapping_sub(end),
            // no completion seen: all of the SQ that was posted may be in flight
            None => (sq_pi.min(u64::from(g.sq_blocks))) as u16,
        };
        Self {
            sq_pi,
            sq_in_flight: if u32::from(unretired) <= g.sq_blocks {
                unretired
            } else {
                0
            },
            rq_head,
            // the receive CQ's CQEs are the receives' when it is not the send CQ too; on a
            // shared CQ the newest receive completion taken says how many were (RC consumes
            // receives in order)
            rq_consumer: if Arc::ptr_eq(&qp.send_cq.dev, &qp.recv_cq.dev) {
                match newest_of_qp(&scq, g.qpn, true, scq_ci, since) {
                    Newest::Counter(c) => Some(u32::from(c.wrapping_add(1))),
                    Newest::NoneSinceReset => Some(0),
                    Newest::Unknown => None,
                }
            } else {
                Some(rcq_ci)
            },
            scq_ci,
            rcq_ci,
            scq_slot0: None,
        }
    }
}

/// What a look back over the CQEs taken from a CQ found for one QP.
enum Newest {
    /// The WQE counter of the newest completion of the kind asked for.
    Counter(u16),
    /// None among all the CQEs taken since the QP was created or last reset.
    NoneSinceReset,
    /// Cannot be told (the CQ has wrapped past them, or its ring could not be read).
    Unknown,
}

/// The newest requester (`responder` false) or responder completion of QP `qpn` among the
/// CQEs taken from `cq` so far (its consumer index `ci`), looking back at most one ring and
/// not before `since` (the consumer index when the QP was created or last reset).
fn newest_of_qp(cq: &CqGeometry<'_>, qpn: u32, responder: bool, ci: u32, since: u32) -> Newest {
    let mask = cq.ncqe as usize - 1;
    let collapsed = cq.collapsed;
    let fresh = ci.wrapping_sub(since) & 0xff_ffff;
    // a collapsed CQ holds its newest CQE in slot 0 only
    let window = if collapsed { 1 } else { cq.ncqe.min(ci) };
    for k in 1..=window.min(fresh) {
        let n = ci - k;
        let mut b = [0u8; prm::CQE_SIZE];
        let slot = if collapsed { 0 } else { n as usize & mask };
        // CQEs before the consumer index are no longer written by the device (until it
        // wraps, which the owner check below tells); a ring in GPU memory is read with a copy
        if cq.ring.try_read(slot * prm::CQE_SIZE, &mut b).is_err() {
            return Newest::Unknown;
        }
        let cqe: prm::Cqe64 = bytemuck::cast(b);
        if !collapsed && u32::from(cqe.op_own & 1) != (n / cq.ncqe) & 1 {
            return Newest::Unknown;
        }
        match (cqe.decode(), responder) {
            (
                prm::Completion::Req {
                    qpn: q,
                    wqe_counter,
                    ..
                },
                false,
            )
            | (
                prm::Completion::Resp {
                    qpn: q,
                    wqe_counter,
                    ..
                },
                true,
            ) if q == qpn => return Newest::Counter(wqe_counter),
            (prm::Completion::Error(e), r) if e.responder == r && e.qpn == qpn => {
                return Newest::Counter(e.wqe_counter)
            }
            _ => {}
        }
    }
    if fresh <= window {
        Newest::NoneSinceReset
    } else {
        Newest::Unknown
    }
}

/// The SQ index just past the WQE of the newest requester completion of QP `q` taken from
/// `cq` (see [`newest_of_qp`]).
fn last_req_end(cq: &CqGeometry<'_>, q: &QpGeometry<'_>, ci: u32, since: u32) -> Option<u16> {
    let Newest::Counter(counter) = newest_of_qp(cq, q.qpn, false, ci, since) else {
        return None;
    };
    let slot = counter as usize & (q.sq_blocks as usize - 1);
    // the WQE's control segment says how many blocks it took
    let mut c = [0u8; 16];
    q.sq.try_read(slot * prm::WQEBB, &mut c).ok()?;
    let ctrl: prm::wqe::CtrlSeg = bytemuck::pod_read_unaligned(&c);
    let blocks = prm::wqe::blocks_for_ds(ctrl.ds().max(1)) as u16;
    Some(counter.wrapping_add(blocks))
}

impl Qp {
    /// A CPU initiator on this QP (it takes the QP's CQs for itself). It is the QP's one
    /// poster until it is dropped, and it continues from the queue's state ([`Poster`]).
    ///
    /// # Panics
    /// When [`Qp::try_cpu_initiator`] fails: the QP or one of its CQs has its rings in GPU
    /// memory, or the QP already has a poster.
    pub fn cpu_initiator(&self, mode: verbs::initiator::RingMode) -> verbs::initiator::Initiator {
        match self.try_cpu_initiator(mode) {
            Ok(i) => i,
            Err(e) => panic!("Qp::cpu_initiator: {e}"),
        }
    }

    /// A CPU initiator on this QP, or an error: [`Error::PosterBusy`] while another poster
    /// (CPU initiator, GPU export, CPU proxy) holds the QP; `Error::InvalidArgument`
    /// when the QP or one of its CQs has its rings in GPU memory ([`RingPlacement::Gpu`](crate::RingPlacement::Gpu)):
    /// the CPU writes WQEs and polls CQEs with host stores and loads, which GPU memory does
    /// not take (drive such a QP from a kernel). The initiator holds the QP until it is
    /// dropped; it starts where the queue is: the producer index last rung, the SQ space the
    /// device has not executed yet, the CQ consumer indexes (and owner parity) in the CQ
    /// doorbell records. A [`verbs::DoorbellMode::NoDbr`] QP is refused
    /// (`Error::Unsupported`): the CPU initiator writes the send doorbell record, which such a
    /// QP never has written (drive it from a kernel).
    pub fn try_cpu_initiator(
        &self,
        mode: verbs::initiator::RingMode,
    ) -> Result<verbs::initiator::Initiator, Error> {
        if self.doorbell == verbs::DoorbellMode::NoDbr {
            return Err(Error::Unsupported(format!(
                "QP {:#x} is rung without a send doorbell record (DoorbellMode::NoDbr); the CPU \
                 initiator writes that record: drive the QP from a kernel",
                self.qpn()
            )));
        }
        let claim = self.posters.claim(Poster::CpuInitiator)?;
        let (g, scq, rcq) = (
            self.geometry(),
            self.send_cq.geometry(),
            self.recv_cq.geometry(),
        );
        let st = self.queue_state();
        let rq_consumer = match st.rq_consumer {
            _ if st.rq_head == 0 => 0,
            Some(c) => c,
            None => {
                return Err(Error::InvalidArgument(format!(
                    "QP {:#x}: receives were posted and its receive CQ is its send CQ: a new \
                     poster cannot tell which receives were consumed (use a CQ of its own for \
                     the receives)",
                    g.qpn
                )))
            }
        };
        let (sq, rq, send, recv) = cpu_geometry(&g, &scq, &rcq).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "QP {:#x} or one of its CQs has its rings in GPU memory: the CPU cannot post or \
                 poll there (drive it from a kernel)",
                g.qpn
            ))
        })?;
        let keep: Arc<dyn std::any::Any + Send + Sync> =
            Arc::new((g.keep.clone(), scq.keep.clone(), rcq.keep.clone()));
        // SAFETY: the geometry is the backend's for this live QP and its CQs, all host memory
        // (checked), kept alive by `keep`; the claim makes the initiator the QP's only poster
        // and its CQs' only poller.
        let ini = unsafe {
            verbs::initiator::Initiator::from_geometry(
                sq,
                rq,
                send,
                recv,
                mode,
                keep,
                g.kick.clone(),
            )
        };
        let mut ini = match &g.poster_hooks {
            Some(h) => ini.with_device(h()),
            None => ini,
        };
        ini.resume_at(verbs::initiator::QueueStart {
            sq_pi: st.sq_pi as u16,
            sq_unfinished: st.sq_in_flight,
            rq_head: st.rq_head,
            rq_outstanding: st.rq_head.wrapping_sub(rq_consumer as u16),
        });
        Ok(ini.with_guard(Box::new(claim)))
    }
}

/// The CPU initiator's view of a QP and its CQs, when every ring, record and register is host
/// memory (a CPU cannot store into GPU memory).
fn cpu_geometry(
    g: &QpGeometry<'_>,
    scq: &CqGeometry<'_>,
    rcq: &CqGeometry<'_>,
) -> Option<(
    verbs::initiator::SqGeometry,
    verbs::initiator::RqGeometry,
    verbs::initiator::CqGeometry,
    verbs::initiator::CqGeometry,
)> {
    let host = |b: &verbs::DmaBuf| b.is_host().then(|| b.as_ptr());
    let cq = |c: &CqGeometry<'_>| {
        Some(verbs::initiator::CqGeometry {
            ring: host(c.ring)?,
            ncqe: c.ncqe,
            dbrec: c.dbrec.host()?,
            collapsed: c.collapsed,
        })
    };
    let dbrec = g.dbrec.host()?;
    let rq_ring = match g.rq {
        Some(r) => host(r)?,
        None => std::ptr::null_mut(),
    };
    Some((
        verbs::initiator::SqGeometry {
            ring: host(g.sq)?,
            blocks: g.sq_blocks,
            dbrec,
            bf_reg: g.db_reg.host()?,
            qpn: g.qpn,
        },
        verbs::initiator::RqGeometry {
            ring: rq_ring,
            wqes: g.rq_wqes,
            stride: g.rq_stride,
            dbrec,
        },
        cq(scq)?,
        cq(rcq)?,
    ))
}
