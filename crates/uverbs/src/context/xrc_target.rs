//! XRC target QPs shared by handles: CREATE_QP's (`qp.rs`) and OPEN_QP's (`xrc.rs`), in any
//! context of the device; the soft QP goes with the last handle, as the kernel's shared QPs.

use parking_lot::Mutex;
use std::sync::{Arc, Weak};

/// An XRC target of a device, shared by the handles on it (CREATE_QP's and OPEN_QP's, in any
/// context): the soft QP is destroyed when the last one goes, as the kernel's shared QPs.
pub(super) struct TgtShare {
    dev: Arc<softnic::Device>,
    qp: Arc<softnic::Qp>,
}

/// Every XRC target some handle holds, for OPEN_QP.
static TGTS: Mutex<Vec<Weak<TgtShare>>> = Mutex::new(Vec::new());

impl TgtShare {
    /// The share of a new XRC target `qp` of `dev`.
    pub(super) fn register(dev: Arc<softnic::Device>, qp: Arc<softnic::Qp>) -> Arc<Self> {
        let s = Arc::new(Self { dev, qp });
        let mut t = TGTS.lock();
        t.retain(|w| w.strong_count() > 0);
        t.push(Arc::downgrade(&s));
        s
    }

    /// The XRC target numbered `qpn` of `dev` in domain `xrcd`, while some handle holds it.
    pub(super) fn find(
        dev: &Arc<softnic::Device>,
        xrcd: &Arc<softnic::Xrcd>,
        qpn: u32,
    ) -> Option<Arc<Self>> {
        let t = TGTS.lock();
        t.iter().filter_map(Weak::upgrade).find(|s| {
            Arc::ptr_eq(&s.dev, dev)
                && s.qp.qpn() == qpn
                && s.qp.xrcd().is_some_and(|x| Arc::ptr_eq(x, xrcd))
        })
    }

    /// The soft QP.
    pub(super) fn qp(&self) -> &Arc<softnic::Qp> {
        &self.qp
    }
}

impl Drop for TgtShare {
    fn drop(&mut self) {
        self.dev.destroy_qp(&self.qp);
    }
}
