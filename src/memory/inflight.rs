//! The work in flight on a PD's QPs: which QPs a PD has, what a bounded wait for their WQEs
//! found still in flight ([`InFlight`]), and the watch that follows the device's progress
//! ([`Mr::deregister`](crate::Mr::deregister)(super::Mr::deregister) and a region's drop wait with it).

use crate::backend::seam::QpOps;
use std::sync::{Mutex, PoisonError, Weak};
use std::time::Duration;
use verbs::QpState;

/// The QPs created in a PD, as the device holds them (weakly: a destroyed QP drops out).
#[derive(Default)]
pub(crate) struct PdQps(Mutex<Vec<TrackedQp>>);

/// One QP of a PD.
pub(crate) type TrackedQp = Weak<dyn QpOps>;

impl PdQps {
    /// Records a new QP of the PD (and forgets the ones gone).
    pub(crate) fn add(&self, qp: TrackedQp) {
        let mut v = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        v.retain(|q| q.strong_count() > 0);
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
    pub(super) pending: Vec<Watched>,
}

/// What can be seen of a QP's send WQEs in flight.
enum Seen {
    /// Destroyed: it runs nothing more.
    Gone,
    /// Its finished index, and how many blocks rung (or published to the CPU proxy) it has not
    /// finished yet.
    Progress(u16, u32),
    /// The device does not show its progress (a NIC).
    Unobservable,
}

/// What can be seen of QP `q`'s send WQEs in flight now.
fn seen(q: &dyn QpOps) -> Seen {
    if !q.is_live() {
        return Seen::Gone;
    }
    let Some(p) = q.progress() else {
        return Seen::Unobservable;
    };
    // The finished index first: WQEs it passes meanwhile only make the wait longer. (WQEs on
    // the wire count until their answers arrive.)
    let ci = p.sq_finished;
    let g = q.geometry();
    let pi = g.sq_producer() as u16;
    let ahead = u32::from(pi.wrapping_sub(ci));
    // More than a ring ahead: not a producer the device will run (a record from before a
    // reset, or garbage), so nothing in flight.
    Seen::Progress(ci, if ahead > g.sq_blocks { 0 } else { ahead })
}

impl SqWatch {
    /// The QPs of `qps` with send WQEs rung (or published to the CPU proxy) and not yet
    /// executed, now (in any state: WQEs posted in RESET, INIT or RTR run once the QP reaches
    /// RTS); with `unobservable`, also every QP not in RESET whose progress the device does
    /// not show (mlx5).
    pub(super) fn new(qps: &PdQps, unobservable: bool) -> Self {
        let mut pending = Vec::new();
        for t in qps.list() {
            let Some(q) = t.upgrade() else { continue };
            let (blocks, ci) = match seen(&*q) {
                Seen::Progress(ci, ahead) if ahead > 0 => (Some(ahead), ci),
                Seen::Unobservable if unobservable => (None, 0),
                _ => continue,
            };
            let state = q.state();
            if blocks.is_none() && state == QpState::Reset {
                continue;
            }
            pending.push(Watched {
                qpn: q.qpn(),
                qp: t.clone(),
                state,
                blocks,
                ci,
            });
        }
        Self { pending }
    }

    /// Takes the device's progress into account; drops the QPs that are done: destroyed, or
    /// whose consumer index has moved past the WQEs watched, or that have nothing rung left
    /// to execute (everything before is executed, or was dropped by a reset).
    pub(super) fn poll(&mut self) {
        self.pending.retain_mut(|p| {
            let Some(q) = p.qp.upgrade() else {
                return false;
            };
            match seen(&*q) {
                Seen::Gone => false,
                Seen::Progress(ci, ahead) => {
                    p.state = q.state();
                    let done = u32::from(ci.wrapping_sub(p.ci));
                    p.ci = ci;
                    let left = p.blocks.unwrap_or(0).saturating_sub(done).min(ahead);
                    p.blocks = Some(left);
                    left > 0
                }
                Seen::Unobservable => {
                    p.state = q.state();
                    p.state != QpState::Reset
                }
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
