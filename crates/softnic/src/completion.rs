//! Writing CQEs on behalf of a QP: a completion (late when fault injection asks), the
//! WR_FLUSH CQE of a send WQE, and the counting of CQEs a CQ refused.

use crate::counters::Counters;
use crate::cq::{Cq, CqError};
use crate::event::AsyncEvent;
use crate::qp::Qp;
use crate::shared::Shared;
use prm::cqe::{Cqe64, ErrorCqe};
use prm::Syndrome;
use std::time::{Duration, Instant};

/// Counts a CQE the CQ refused.
pub(crate) fn count_cq_error(c: &Counters, e: CqError) {
    match e {
        CqError::Overrun(_) => Counters::add(&c.cq_overruns, 1),
        CqError::DeviceMemory(_) => Counters::add(&c.devmem_errors, 1),
        CqError::Failed(_) | CqError::Destroyed(_) => {}
    }
}

/// Writes a CQE to `cq` on behalf of `qp`, `delay` late when fault injection asks.
pub(crate) fn push_cqe_delayed(
    dev: &Shared,
    qp: &Qp,
    delay: Option<Duration>,
    cq: &Cq,
    cqe: Cqe64,
) {
    let due = delay.map(|d| Instant::now() + d);
    match cq.push(qp.stamp(cqe), due) {
        Ok(()) => Counters::add(&dev.counters.cqes, 1),
        Err(e) => {
            count_cq_error(&dev.counters, e);
            qp.fatal(AsyncEvent::QpFatal);
        }
    }
}

/// Writes the WR_FLUSH CQE of the WQE at `idx`.
pub(crate) fn flush_cqe(dev: &Shared, qp: &Qp, delay: Option<Duration>, opcode: u8, idx: u16) {
    dev.counters.error(Syndrome::WrFlush);
    let e = ErrorCqe {
        responder: false,
        syndrome: Syndrome::WrFlush as u8,
        vendor_syndrome: 0,
        wqe_opcode: opcode,
        qpn: qp.qpn,
        wqe_counter: idx,
    };
    push_cqe_delayed(dev, qp, delay, &qp.send_cq, Cqe64::error(&e, 0));
}
