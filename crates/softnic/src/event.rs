//! Affiliated asynchronous events: what a ConnectX reports on its event queue about one QP,
//! CQ or SRQ (the kernel turns them into `ibv_get_async_event` events). The soft NIC calls
//! the handler its owner set on the object, from whichever thread noticed the event (the
//! engine, the wire's I/O thread); the handler must not call back into the device.

use parking_lot::Mutex;
use std::sync::Arc;

/// One asynchronous event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AsyncEvent {
    /// The CQ overran or a CQE could not be written: the CQ is in error (`IBV_EVENT_CQ_ERR`).
    CqError,
    /// A QP went to ERR for a reason no completion reports: it wrote to a CQ in error, or its
    /// responder failed in a way that is not a NAK class of its own (`IBV_EVENT_QP_FATAL`).
    QpFatal,
    /// The responder detected an invalid request (NAK invalid request) with no receive
    /// completion to report it (`IBV_EVENT_QP_REQ_ERR`).
    QpRequestError,
    /// The responder detected a remote access violation (NAK remote access error) with no
    /// receive completion to report it (`IBV_EVENT_QP_ACCESS_ERR`).
    QpAccessError,
    /// A QP attached to an SRQ is in ERR and will take no more receive WQEs from it
    /// (`IBV_EVENT_QP_LAST_WQE_REACHED`).
    LastWqeReached,
    /// The SRQ's count of posted receive WQEs dropped below its armed limit; the limit is
    /// disarmed (`IBV_EVENT_SRQ_LIMIT_REACHED`).
    SrqLimitReached,
}

/// Receives an object's events.
pub type EventHandler = Arc<dyn Fn(AsyncEvent) + Send + Sync>;

/// The handler slot of one object.
#[derive(Default)]
pub(crate) struct EventSlot(Mutex<Option<EventHandler>>);

impl EventSlot {
    pub fn set(&self, h: Option<EventHandler>) {
        *self.0.lock() = h;
    }

    /// Delivers `e` to the handler, if one is set.
    pub fn raise(&self, e: AsyncEvent) {
        tracing::debug!(event = ?e, "async event");
        let h = self.0.lock().clone();
        if let Some(h) = h {
            h(e);
        }
    }
}
