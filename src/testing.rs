//! Set-up shared by the host crate's unit tests: two soft NICs of this process with a PD, a CQ
//! and a QP each.

use crate::{Access, ConnectOptions, Context, CqOptions, DeviceRequest, Pd, Qp, QpOptions};

/// Two soft NICs of this process, a PD and a QP (its CQ for both queues) on each; the QPs
/// start in RESET (`connect` them).
pub(crate) struct SoftPair {
    pub a: Context,
    pub pa: Pd,
    pub pb: Pd,
    pub qa: Qp,
    pub qb: Qp,
}

pub(crate) fn soft_pair() -> SoftPair {
    let (a, b) = (
        Context::open(DeviceRequest::Soft).unwrap(),
        Context::open(DeviceRequest::Soft).unwrap(),
    );
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (ca, cb) = (
        a.create_cq(CqOptions::default()).unwrap(),
        b.create_cq(CqOptions::default()).unwrap(),
    );
    let qa = pa.create_qp(QpOptions::new(&ca, &ca)).unwrap();
    let qb = pb.create_qp(QpOptions::new(&cb, &cb)).unwrap();
    SoftPair { a, pa, pb, qa, qb }
}

impl SoftPair {
    /// Connects the two QPs to each other, granting the peer `access`.
    pub fn connect(&self, access: Access) {
        let o = ConnectOptions {
            access,
            ..Default::default()
        };
        self.qa.connect(&self.qb.endpoint(), o).unwrap();
        self.qb.connect(&self.qa.endpoint(), o).unwrap();
    }
}
