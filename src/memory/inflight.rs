//! The work in flight on a PD's QPs: which QPs a PD has, what a bounded wait for their WQEs
//! found still in flight ([`InFlight`]), and the watch that follows the device's progress
//! ([`Mr::deregister`](crate::Mr::deregister)(super::Mr::deregister) and a region's drop wait with it).

use crate::backend::context::Context;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;
use verbs::QpState;

/// The QPs created in a PD, as the device holds them (weakly: a destroyed QP drops out).
#[derive(Default)]
pub(crate) struct PdQps(Mutex<Vec<TrackedQp>>);

/// One QP of a PD.
#[derive(Clone)]
pub(crate) enum TrackedQp {
    Soft(Weak<softnic::Qp>),
    Mlx5(Weak<crate::backend::mlx5::Qp>),
}

impl PdQps {
    /// Records a new QP of the PD (and forgets the ones gone).
    pub(crate) fn add(&self, qp: TrackedQp) {
        let mut v = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        v.retain(|q| match q {
            TrackedQp::Soft(w) => w.strong_count() > 0,
            TrackedQp::Mlx5(w) => w.strong_count() > 0,
        });
        v.push(qp);
    }

    fn list(&self) -> Vec<TrackedQp> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A QP that still had WQEs in flight when a bounded wait for them ended
/// ([`Mr::deregister`](crate::Mr::deregister)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpInFlight {
    /// The QP number.
    pub qpn: u32,
    /// Its state when the wait ended.
    pub state: QpState,
    /// SQ blocks (64 bytes) of the WQEs posted before the wait that the device had not yet
    /// executed; `None` where the device cannot say (the mlx5 backend).
    pub blocks: Option<u32>,
}

impl std::fmt::Display for QpInFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QP {:#x} ({:?}): ", self.qpn, self.state)?;
        match self.blocks {
            Some(n) => write!(f, "{n} SQ block(s) not executed")?,
            None => f.write_str("SQ progress not observable on the mlx5 backend")?,
        }
        if matches!(self.state, QpState::Init | QpState::Rtr) {
            f.write_str(", waiting for RTS")?;
        }
        Ok(())
    }
}

/// What was still in flight when a bounded wait ended.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "memory region with lkey {lkey:#x} still has WQEs in flight after {waited:?}: {}",
    qps.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
)]
pub struct InFlight {
    /// The region's lkey.
    pub lkey: u32,
    /// How long the wait ran.
    pub waited: Duration,
    /// The QPs of the PD that still had WQEs posted before the wait in flight.
    pub qps: Vec<QpInFlight>,
}

/// One QP whose WQEs posted before a wait are watched.
pub(super) struct Watched {
    qp: TrackedQp,
    qpn: u32,
    state: QpState,
    /// Blocks still to execute (`None`: not observable).
    pub(super) blocks: Option<u32>,
    /// The consumer index last seen.
    ci: u16,
}

/// The QPs of a PD with WQEs in flight, watched until the device has executed them.
pub(super) struct SqWatch {
    dev: Option<Arc<softnic::Device>>,
    pub(super) pending: Vec<Watched>,
}

/// A live soft QP's consumer index and how many blocks rung (or published to the CPU proxy)
/// it has not executed yet; `None` for a QP that is gone (destroyed: it runs nothing more).
fn soft_progress(dev: &softnic::Device, q: &Arc<softnic::Qp>) -> Option<(u16, u32)> {
    if !dev.qp(q.qpn()).is_some_and(|d| Arc::ptr_eq(&d, q)) {
        return None;
    }
    // The finished index first: WQEs it passes meanwhile only make the wait longer. (WQEs on
    // the wire count until their answers arrive.)
    let ci = q.sq_finished();
    let pi = crate::backend::soft::sq_producer(q) as u16;
    let ahead = u32::from(pi.wrapping_sub(ci));
    // More than a ring ahead: not a producer the device will run (a record from before a
    // reset, or garbage), so nothing in flight.
    Some((ci, if ahead > q.sq_blocks() { 0 } else { ahead }))
}

impl SqWatch {
    /// The QPs of `qps` with send WQEs rung (or published to the CPU proxy) and not yet
    /// executed, now (in any state: WQEs posted in RESET, INIT or RTR run once the QP reaches
    /// RTS); with `unobservable`, also every mlx5 QP not in RESET (whose progress the device
    /// does not show).
    pub(super) fn new(ctx: &Context, qps: &PdQps, unobservable: bool) -> Self {
        let dev = ctx.soft_device().cloned();
        let mut pending = Vec::new();
        for t in qps.list() {
            match &t {
                TrackedQp::Soft(w) => {
                    let (Some(q), Some(d)) = (w.upgrade(), dev.as_ref()) else {
                        continue;
                    };
                    let Some((ci, ahead)) = soft_progress(d, &q) else {
                        continue;
                    };
                    if ahead > 0 {
                        pending.push(Watched {
                            qpn: q.qpn(),
                            qp: t.clone(),
                            state: q.state(),
                            blocks: Some(ahead),
                            ci,
                        });
                    }
                }
                TrackedQp::Mlx5(w) => {
                    let Some(q) = w.upgrade().filter(|_| unobservable) else {
                        continue;
                    };
                    let state = mlx5_state(&q);
                    if state == QpState::Reset {
                        continue;
                    }
                    pending.push(Watched {
                        qpn: q.qpn,
                        qp: t.clone(),
                        state,
                        blocks: None,
                        ci: 0,
                    });
                }
            }
        }
        Self { dev, pending }
    }

    /// Takes the device's progress into account; drops the QPs that are done: destroyed, or
    /// whose consumer index has moved past the WQEs watched, or that have nothing rung left
    /// to execute (everything before is executed, or was dropped by a reset).
    pub(super) fn poll(&mut self) {
        let dev = self.dev.clone();
        self.pending.retain_mut(|p| match &p.qp {
            TrackedQp::Soft(w) => {
                let (Some(q), Some(d)) = (w.upgrade(), dev.as_ref()) else {
                    return false;
                };
                let Some((ci, ahead)) = soft_progress(d, &q) else {
                    return false;
                };
                p.state = q.state();
                let done = u32::from(ci.wrapping_sub(p.ci));
                p.ci = ci;
                let left = p.blocks.unwrap_or(0).saturating_sub(done).min(ahead);
                p.blocks = Some(left);
                left > 0
            }
            TrackedQp::Mlx5(w) => {
                let Some(q) = w.upgrade() else { return false };
                p.state = mlx5_state(&q);
                p.state != QpState::Reset
            }
        });
    }

    pub(super) fn report(&self) -> Vec<QpInFlight> {
        self.pending
            .iter()
            .map(|p| QpInFlight {
                qpn: p.qpn,
                state: p.state,
                blocks: p.blocks,
            })
            .collect()
    }
}

/// An mlx5 QP's state (ERR when the query fails).
fn mlx5_state(q: &crate::backend::mlx5::Qp) -> QpState {
    match q.state() {
        Ok(0) => QpState::Reset,
        Ok(1) => QpState::Init,
        Ok(2) => QpState::Rtr,
        Ok(3) => QpState::Rts,
        _ => QpState::Err,
    }
}
