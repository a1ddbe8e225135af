//! Shared receive queues: CREATE_SRQ, CREATE_XSRQ (basic and XRC SRQs), MODIFY_SRQ, QUERY_SRQ
//! and DESTROY_SRQ.

use super::{unsupported, user_buf, Context, Created, Io};
use crate::abi;
use crate::device::{MAX_QP_WR, MAX_SRQ_SGE};
use crate::uaccess::Errno;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

pub(super) struct SrqObj {
    pub(super) soft: Arc<softnic::Srq>,
    pub(super) pd: u32,
    /// An XRC SRQ's domain and CQ (handles).
    pub(super) xrc: Option<(u32, u32)>,
    key: u64,
    async_reported: Arc<AtomicU32>,
}

impl Context {
    pub(super) fn create_srq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::CreateSrq = io.core()?;
        self.new_srq(io, r, None)
    }

    /// CREATE_XSRQ: a basic SRQ, or an XRC SRQ of an XRC domain whose receives complete on a
    /// CQ of its own (tag-matching SRQs: EOPNOTSUPP).
    pub(super) fn create_xsrq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        const IB_SRQT_BASIC: u32 = 0;
        const IB_SRQT_XRC: u32 = 1;
        let x: abi::CreateXsrq = io.core()?;
        let r = abi::CreateSrq {
            response: x.response,
            user_handle: x.user_handle,
            pd_handle: x.pd_handle,
            max_wr: x.max_wr,
            max_sge: x.max_sge,
            srq_limit: x.srq_limit,
        };
        match x.srq_type {
            IB_SRQT_BASIC => self.new_srq(io, r, None),
            IB_SRQT_XRC => self.new_srq(io, r, Some((x.xrcd_handle, x.cq_handle))),
            _ => Err(unsupported("tag-matching SRQs")),
        }
    }

    /// A new SRQ on the provider's ring and doorbell record; an XRC SRQ when `xrc` names its
    /// domain and CQ (handles).
    fn new_srq(
        &self,
        io: &Io<'_>,
        r: abi::CreateSrq,
        xrc: Option<(u32, u32)>,
    ) -> Result<Created, Errno> {
        let u: abi::Mlx5CreateSrq = io.udata()?;
        if io.udata.len() < 24 {
            return Err(Errno::EINVAL);
        }
        // MLX5_SRQ_FLAG_SIGNATURE is the only flag
        if u.flags & !1 != 0 || u.reserved0 != 0 || u.reserved1 != 0 {
            return Err(Errno::EINVAL);
        }
        let cqe_version = *self.cqe_version.lock();
        if (cqe_version == 0 && u.uidx != 0) || u.uidx > 0xff_ffff {
            return Err(Errno::EINVAL);
        }
        if r.max_wr >= MAX_QP_WR || r.max_sge > MAX_SRQ_SGE {
            return Err(Errno::EINVAL);
        }
        let wqes = (r.max_wr + 1).next_power_of_two().max(2);
        let stride = (16 + 16 * r.max_sge).max(32).next_power_of_two();
        if r.srq_limit >= wqes {
            return Err(Errno::EINVAL);
        }
        let ring = user_buf(u.buf_addr, (wqes * stride) as usize)?;
        let dbrec = user_buf(u.db_addr, 8)?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let pd = o.pds.get(&r.pd_handle).ok_or(Errno::EINVAL)?.id;
        let cfg = softnic::SrqConfig {
            pd,
            wqes,
            stride,
            ring: Some(ring),
            dbrec: Some(dbrec),
            limit: r.srq_limit,
        };
        let srq = match xrc {
            None => soft.create_srq(cfg),
            Some((xh, ch)) => {
                let x = softnic::XrcSrqConfig {
                    xrcd: o.xrcds.get(&xh).ok_or(Errno::EINVAL)?.soft.clone(),
                    cq: o.cqs.get(&ch).ok_or(Errno::EINVAL)?.soft.clone(),
                    // mlx5_ib: the SRQ's CQEs carry its user index under CQE version 1
                    user_index: (cqe_version == 1).then_some(u.uidx),
                };
                soft.create_xrc_srq(cfg, x)
            }
        }
        .map_err(|_| Errno::EINVAL)?;
        let h = o.handle();
        let reply = io
            .reply(&abi::CreateSrqResp {
                srq_handle: h,
                max_wr: wqes - 1,
                max_sge: srq.max_sge(),
                srqn: srq.srqn(),
            })
            .and_then(|_| {
                io.ureply(&abi::Mlx5CreateSrqResp {
                    srqn: srq.srqn(),
                    reserved: 0,
                })
            });
        if let Err(e) = reply {
            let _ = soft.destroy_srq(&srq);
            return Err(e);
        }
        let key = crate::next_key();
        let async_reported: Arc<AtomicU32> = Arc::default();
        srq.set_event_handler(Some(self.event_handler(
            r.user_handle,
            key,
            async_reported.clone(),
        )));
        o.srqs.insert(
            h,
            SrqObj {
                soft: srq,
                pd: r.pd_handle,
                xrc,
                key,
                async_reported,
            },
        );
        Ok(Created::Nothing)
    }

    pub(super) fn modify_srq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ModifySrq = io.core()?;
        let o = self.objs.lock();
        let s = o.srqs.get(&r.srq_handle).ok_or(Errno::EINVAL)?;
        use abi::srq_attr::*;
        // mlx5_ib cannot resize an SRQ
        if r.attr_mask & !(MAX_WR | LIMIT) != 0 || r.attr_mask & MAX_WR != 0 {
            return Err(Errno::EINVAL);
        }
        if r.attr_mask & LIMIT != 0 {
            s.soft.set_limit(r.srq_limit).map_err(|_| Errno::EINVAL)?;
        }
        Ok(Created::Nothing)
    }

    pub(super) fn query_srq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::QuerySrq = io.core()?;
        let o = self.objs.lock();
        let s = o.srqs.get(&r.srq_handle).ok_or(Errno::EINVAL)?;
        io.reply(&abi::QuerySrqResp {
            max_wr: s.soft.wqes() - 1,
            max_sge: s.soft.max_sge(),
            srq_limit: s.soft.limit(),
            reserved: 0,
        })?;
        Ok(Created::Nothing)
    }

    pub(super) fn destroy_srq(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Destroy = io.core()?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let srqn = o.srqs.get(&r.handle).ok_or(Errno::EINVAL)?.soft.srqn();
        if o.qps.values().any(|q| q.srq == Some(r.handle)) || o.srq_in_use_by_devx(srqn) {
            return Err(Errno::EBUSY);
        }
        let s = o.srqs.remove(&r.handle).ok_or(Errno::EINVAL)?;
        soft.destroy_srq(&s.soft).map_err(|_| Errno::EBUSY)?;
        self.purge_async(s.key);
        io.reply(&abi::DestroySrqResp {
            events_reported: s.async_reported.load(Ordering::Acquire),
        })?;
        Ok(Created::Nothing)
    }
}
