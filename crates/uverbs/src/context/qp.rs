//! Queue pairs (RC, UC, UD, XRC initiators and targets, and DC initiators and targets:
//! `mlx5dv_create_qp`'s `IBV_QPT_DRIVER` QPs): CREATE_QP, EX_CREATE_QP, MODIFY_QP,
//! EX_MODIFY_QP, QUERY_QP and DESTROY_QP, with the BlueFlame register each QP with a send queue
//! gets; ATTACH_MCAST and DETACH_MCAST (UD multicast).

use super::{
    ib_access, unsupported, user_buf, Context, Created, Io, Objects, BFREGS_PER_UAR, BF_REG_SIZE,
    GROSS_BFREGS_PER_UAR,
};
use crate::abi::{self, access, qp_attr};
use crate::device::{MAX_QP_WR, MAX_RD_ATOM, MAX_SGE};
use crate::uaccess::{check_mapped, Errno};
use prm::doorbell::BF_OFFSET;
use softnic::Transport;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use verbs::DmaBuf;

/// What QUERY_QP reports back: the attributes last set.
#[derive(Clone, Copy, Default)]
struct QpAttrs {
    access: u32,
    pkey_index: u16,
    port: u8,
    dest: abi::QpDest,
    path_mtu: u8,
    dest_qpn: u32,
    rq_psn: u32,
    sq_psn: u32,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    min_rnr_timer: u8,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    qkey: u32,
}

pub(super) struct QpObj {
    pub(super) soft: Arc<softnic::Qp>,
    pub(super) pd: u32,
    pub(super) srq: Option<u32>,
    key: u64,
    async_reported: Arc<AtomicU32>,
    pub(super) send_cq: u32,
    pub(super) recv_cq: u32,
    caps: abi::CreateQpResp,
    sq_sig_all: u8,
    attrs: QpAttrs,
    /// Its static BlueFlame register, or the dynamically allocated UAR page it rings.
    bfreg: Option<u32>,
    pub(super) uar_page: Option<u32>,
    /// An XRC target's share: the soft QP is destroyed with its last handle, in any context
    /// (the creator's, or one OPEN_QP made).
    pub(super) tgt: Option<Arc<super::xrc_target::TgtShare>>,
    /// A handle OPEN_QP made (it gets no async events; the creator's handle does).
    opened: bool,
    /// Created with IB_UVERBS_QP_CREATE_BLOCK_MULTICAST_LOOPBACK (its own multicast
    /// datagrams do not come back to it).
    mc_block_self: bool,
}

impl QpObj {
    /// A handle on an XRC target another handle created (OPEN_QP), in domain `xrcd_handle`.
    pub(super) fn opened(
        share: Arc<super::xrc_target::TgtShare>,
        xrcd_handle: u32,
        h: u32,
    ) -> Self {
        let soft = share.qp().clone();
        QpObj {
            caps: abi::CreateQpResp {
                qp_handle: h,
                qpn: soft.qpn(),
                ..Default::default()
            },
            soft,
            pd: xrcd_handle,
            srq: None,
            key: crate::next_key(),
            async_reported: Arc::default(),
            send_cq: 0,
            recv_cq: 0,
            sq_sig_all: 0,
            attrs: QpAttrs::default(),
            bfreg: None,
            uar_page: None,
            tgt: Some(share),
            opened: true,
            mc_block_self: false,
        }
    }
}

/// `v` when it is at most `max` (a QP attribute in range), else EINVAL.
fn at_most(v: u8, max: u8) -> Result<u8, Errno> {
    if v > max {
        return Err(Errno::EINVAL);
    }
    Ok(v)
}

fn mtu_bytes(m: u8) -> Option<u32> {
    (1..=5).contains(&m).then(|| 128u32 << m)
}

impl Context {
    /// CREATE_QP (the legacy command).
    pub(super) fn legacy_create_qp(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::CreateQp = io.core()?;
        let ex = abi::ExCreateQp {
            user_handle: r.user_handle,
            pd_handle: r.pd_handle,
            send_cq_handle: r.send_cq_handle,
            recv_cq_handle: r.recv_cq_handle,
            srq_handle: r.srq_handle,
            max_send_wr: r.max_send_wr,
            max_recv_wr: r.max_recv_wr,
            max_send_sge: r.max_send_sge,
            max_recv_sge: r.max_recv_sge,
            max_inline_data: r.max_inline_data,
            sq_sig_all: r.sq_sig_all,
            qp_type: r.qp_type,
            is_srq: r.is_srq,
            ..Default::default()
        };
        self.create_qp(io, &ex, false)
    }

    /// EX_CREATE_QP.
    pub(super) fn ex_create_qp(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ExCreateQp = io.core()?;
        // IB_UVERBS_QP_CREATE_BLOCK_MULTICAST_LOOPBACK (the device reports the block_lb_mc
        // capability, as mlx5_ib requires): the QP's own multicast datagrams do not come back
        // to it; any other flag is not served
        if r.comp_mask != 0 || r.create_flags & !BLOCK_MULTICAST_LOOPBACK != 0 {
            return Err(unsupported("EX_CREATE_QP with create flags or RSS"));
        }
        self.create_qp(io, &r, true)
    }

    /// MODIFY_QP (the legacy command).
    pub(super) fn legacy_modify_qp(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ModifyQp = io.core()?;
        self.modify_qp(&r, io.uresp.1).map(|_| Created::Nothing)
    }

    /// EX_MODIFY_QP.
    pub(super) fn ex_modify_qp(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::ExModifyQp = io.core()?;
        if r.base.attr_mask & qp_attr::RATE_LIMIT != 0 {
            return Err(unsupported("EX_MODIFY_QP rate limit"));
        }
        let dctn = self.modify_qp(&r.base, io.uresp.1)?;
        // as the kernel's uverbs_response: as much of the answer as the caller has room for
        // (none is fine), a bad pointer EFAULT
        io.reply_prefix(&abi::ExModifyQpResp {
            comp_mask: 0,
            response_length: 8,
        })?;
        if let Some(dctn) = dctn {
            // mlx5_ib_modify_dct: the DCT's number, in as much of the answer as fits
            let response_length = if io.uresp.1 < 16 { 8 } else { 16 };
            io.ureply(&abi::Mlx5ModifyQpResp {
                response_length,
                dctn,
                ..Default::default()
            })?;
        }
        Ok(Created::Nothing)
    }

    /// Picks a BlueFlame register for a new QP as mlx5_ib does: a dedicated low-latency one
    /// while any is free, else the least used of the shared ones (never register 0, which
    /// the provider uses without BlueFlame). Returns the index in the non-fast-path numbering.
    fn alloc_bfreg(o: &mut Objects) -> u32 {
        let total = o.bfreg_use.len() as u32;
        let first_ll = total - o.low_latency;
        if let Some(i) = (first_ll..total).find(|&i| o.bfreg_use[i as usize] == 0) {
            o.bfreg_use[i as usize] += 1;
            return i;
        }
        let i = (1..first_ll.max(2).min(total))
            .min_by_key(|&i| o.bfreg_use[i as usize])
            .unwrap_or(0);
        o.bfreg_use[i as usize] += 1;
        i
    }

    /// CREATE_QP and EX_CREATE_QP: the provider's request checked, the soft QP created on the
    /// provider's rings and a doorbell register, the answer written, the QP recorded.
    fn create_qp(&self, io: &Io<'_>, r: &abi::ExCreateQp, ex: bool) -> Result<Created, Errno> {
        let u: abi::Mlx5CreateQp = io.udata()?;
        let shape = QpShape::check(io, r, &u)?;
        let soft = self.soft()?;
        let cqe_version = *self.cqe_version.lock();
        let user_index = (cqe_version == 1).then_some(u.uidx & 0xff_ffff);
        let mut o = self.objs.lock();
        if shape.transport == Transport::XrcTgt {
            // no rings, no doorbell, no CQs: a responder of the XRC domain `pd_handle` names
            let xrcd = o.xrcds.get(&r.pd_handle).ok_or(Errno::EINVAL)?.soft.clone();
            let sqp = soft.create_xrc_tgt(&xrcd).map_err(|_| Errno::EINVAL)?;
            return self.record_qp(&mut o, io, (r, ex), sqp, &shape, (None, None));
        }
        let xrc_ini = shape.transport == Transport::XrcIni;
        let parents = QpParents::find(&o, r, shape.srq_handle, xrc_ini)?;
        if let Transport::Dct { key } = shape.transport {
            // no rings, no doorbell: a responder on the SRQ (mlx5_ib: srq and recv_cq needed)
            let srq = parents.srq.ok_or(Errno::EINVAL)?;
            let cfg = softnic::DctConfig {
                pd: parents.pd,
                cq: parents.recv_cq,
                srq,
                key,
                user_index,
            };
            let sqp = soft.create_dct(cfg).map_err(|_| Errno::EINVAL)?;
            return self.record_qp(&mut o, io, (r, ex), sqp, &shape, (None, None));
        }
        let (rq_ring, sq_ring, dbrec) = shape.rings(&u)?;
        let QpParents {
            pd,
            send_cq,
            recv_cq,
            srq,
        } = parents;
        if o.dynamic_uars && !shape.dyn_page {
            return Err(Errno::EINVAL);
        }
        let (bfreg, uar) = self.qp_register(&mut o, shape.dyn_page, u.bfreg_index)?;
        let release = |o: &mut Objects| {
            if let Some(b) = bfreg {
                o.bfreg_use[b as usize] -= 1;
            }
        };
        let cfg = softnic::QpConfig {
            pd,
            send_cq,
            recv_cq,
            // a QP without an SQ gets one block nobody announces (a doorbell finds nothing)
            sq_blocks: u.sq_wqe_count.max(1),
            rq_wqes: shape.rq_wqe_count,
            max_recv_sge: (shape.rq_stride / 16).min(32),
            max_inline: prm::wqe::MAX_INLINE_SEND as u32,
            doorbell: verbs::DoorbellMode::Auto,
            sq_ring,
            rq_ring,
            rq_stride: Some(shape.rq_stride),
            dbrec: Some(dbrec),
            uar: Some(uar),
            user_index,
            cross_channel: false,
        };
        let created = match (&srq, shape.transport) {
            (_, Transport::Ud) => soft.create_ud_qp(cfg, srq.as_ref()),
            (_, Transport::Uc) => soft.create_uc_qp(cfg, srq.as_ref()),
            (_, Transport::Dci) => soft.create_dci(cfg),
            (_, Transport::XrcIni) => soft.create_xrc_ini(cfg),
            (Some(s), _) => soft.create_qp_on_srq(cfg, s),
            (None, _) => soft.create_qp(cfg),
        };
        let sqp = match created {
            Ok(q) => q,
            Err(_) => {
                release(&mut o);
                return Err(Errno::EINVAL);
            }
        };
        let page = shape.dyn_page.then_some(u.bfreg_index);
        let recorded = self.record_qp(&mut o, io, (r, ex), sqp, &shape, (bfreg, page));
        if recorded.is_err() {
            release(&mut o);
        }
        recorded
    }

    /// Answers a CREATE_QP for the new soft QP `sqp` (with its BlueFlame register and UAR
    /// page, if any) and records it; the soft QP is destroyed when the answer cannot be
    /// written.
    fn record_qp(
        &self,
        o: &mut Objects,
        io: &Io<'_>,
        (r, ex): (&abi::ExCreateQp, bool),
        sqp: Arc<softnic::Qp>,
        shape: &QpShape,
        (bfreg, uar_page): (Option<u32>, Option<u32>),
    ) -> Result<Created, Errno> {
        let soft = self.soft()?;
        let h = o.handle();
        let caps = create_qp_caps(r, h, sqp.qpn(), shape.srq_handle.is_some());
        if let Err(e) = reply_create_qp(io, caps, ex, bfreg) {
            soft.destroy_qp(&sqp);
            return Err(e);
        }
        let key = crate::next_key();
        let async_reported: Arc<AtomicU32> = Arc::default();
        let tgt = (sqp.transport() == Transport::XrcTgt)
            .then(|| super::xrc_target::TgtShare::register(soft.clone(), sqp.clone()));
        sqp.set_event_handler(Some(self.event_handler(
            r.user_handle,
            key,
            async_reported.clone(),
        )));
        o.qps.insert(
            h,
            QpObj {
                soft: sqp,
                pd: r.pd_handle,
                srq: shape.srq_handle,
                key,
                async_reported,
                send_cq: r.send_cq_handle,
                recv_cq: r.recv_cq_handle,
                caps,
                sq_sig_all: r.sq_sig_all,
                attrs: QpAttrs::default(),
                bfreg,
                uar_page,
                tgt,
                opened: false,
                mc_block_self: r.create_flags & BLOCK_MULTICAST_LOOPBACK != 0,
            },
        );
        Ok(Created::Nothing)
    }

    /// The doorbell register of a new QP: both registers of the UAR page the provider names
    /// (dynamic UARs: the doorbell's QPN says whose it is), or a BlueFlame register of the
    /// context's static pages; with the register's index in the latter case.
    fn qp_register(
        &self,
        o: &mut Objects,
        dyn_page: bool,
        bfreg_index: u32,
    ) -> Result<(Option<u32>, softnic::qp::UarRegister), Errno> {
        Ok(if dyn_page {
            let (page, _) = self.uar_page(o, bfreg_index).ok_or(Errno::EINVAL)?;
            // the page's two registers: the doorbell's QPN says whose it is
            let reg = softnic::qp::UarRegister {
                page,
                offset: BF_OFFSET,
                registers: softnic::qp::MAX_REGISTERS,
            };
            (None, reg)
        } else {
            let uars = self.uars.lock();
            let uars = uars.as_ref().ok_or(Errno::EINVAL)?;
            let bfreg = Self::alloc_bfreg(o);
            let page = uars.pages[(bfreg / BFREGS_PER_UAR) as usize].buf.clone();
            let offset = BF_OFFSET + (bfreg % BFREGS_PER_UAR) as usize * BF_REG_SIZE as usize;
            let reg = softnic::qp::UarRegister {
                page,
                offset,
                registers: 1,
            };
            (Some(bfreg), reg)
        })
    }

    /// MODIFY_QP and EX_MODIFY_QP: the transition and its attributes checked as the kernel
    /// checks them, the soft QP moved, and the attributes kept for QUERY_QP. A DC target's
    /// move to RTR needs `room` for the provider's answer (at least 8 bytes) and returns the
    /// target's number for it.
    fn modify_qp(&self, m: &abi::ModifyQp, room: usize) -> Result<Option<u32>, Errno> {
        use qp_attr::*;
        use verbs::QpState as S;
        let mut o = self.objs.lock();
        let q = o.qps.get_mut(&m.qp_handle).ok_or(Errno::EINVAL)?;
        let cur = match q.soft.state() {
            S::Reset => 0u8,
            S::Init => 1,
            S::Rtr => 2,
            S::Rts => 3,
            S::Err => 6,
        };
        if m.attr_mask & CUR_STATE != 0 && m.cur_qp_state != cur {
            return Err(Errno::EINVAL);
        }
        let new = if m.attr_mask & STATE != 0 {
            m.qp_state
        } else {
            cur
        };
        let transport = q.soft.transport();
        let (req, opt) = transition_attrs(transport, cur, new)?;
        let given = m.attr_mask & !STATE;
        if given & req != req || given & !(req | opt | CUR_STATE) != 0 {
            return Err(Errno::EINVAL);
        }
        if given & ALT_PATH != 0 || given & PATH_MIG_STATE != 0 {
            return Err(unsupported("alternate paths (APM)"));
        }
        let dc = matches!(transport, Transport::Dci | Transport::Dct { .. });
        let a = take_path_attrs(m, given, q.attrs, dc)?;
        let mut a = take_transport_attrs(m, given, a)?;
        let dct = matches!(transport, Transport::Dct { .. });
        if dct && new == 2 && room < 8 {
            return Err(Errno::EINVAL);
        }
        let step = soft_transition(transport, cur, new, &a)?;
        if let Some(s) = step {
            if matches!(s, verbs::Modify::Reset) {
                // RESET returns only once the device is done with the QP (libmlx5 then
                // removes the QP's CQEs from its CQs): the flush of an errored QP completes first
                self.soft()?.drain_errored(&q.soft);
            }
            q.soft.modify(s).map_err(|_| Errno::EINVAL)?;
        }
        if transport == Transport::Ud && given & QKEY != 0 && new != 0 {
            q.soft.set_qkey(a.qkey).map_err(|_| Errno::EINVAL)?;
        }
        if new == 0 {
            a = QpAttrs::default();
        }
        q.attrs = a;
        Ok((dct && new == 2).then(|| q.soft.qpn()))
    }

    pub(super) fn query_qp(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::QueryQp = io.core()?;
        let o = self.objs.lock();
        let q = o.qps.get(&r.qp_handle).ok_or(Errno::EINVAL)?;
        // mlx5_ib_dct_query_qp: a DC target answers in RTR only
        if q.soft.dct_key().is_some() && q.soft.state() != verbs::QpState::Rtr {
            return Err(Errno::EINVAL);
        }
        let a = q.attrs;
        let state = match q.soft.state() {
            verbs::QpState::Reset => 0,
            verbs::QpState::Init => 1,
            verbs::QpState::Rtr => 2,
            verbs::QpState::Rts => 3,
            verbs::QpState::Err => 6,
        };
        // mlx5_ib reports the receive queue as allocated: its WQE count and the data
        // segments a WQE holds (libmlx5 fills in the send side itself); none on an SRQ
        let (max_recv_wr, max_recv_sge) = match (q.srq, q.soft.rq_wqes()) {
            (None, n) if n > 0 => (n, q.soft.max_recv_sge()),
            _ => (q.caps.max_recv_wr, q.caps.max_recv_sge),
        };
        io.reply(&abi::QueryQpResp {
            dest: a.dest,
            max_send_wr: q.caps.max_send_wr,
            max_recv_wr,
            max_send_sge: q.caps.max_send_sge,
            max_recv_sge,
            max_inline_data: q.caps.max_inline_data,
            rq_psn: a.rq_psn,
            sq_psn: a.sq_psn,
            qkey: a.qkey,
            dest_qp_num: a.dest_qpn,
            qp_access_flags: a.access,
            pkey_index: a.pkey_index,
            qp_state: state,
            cur_qp_state: state,
            path_mtu: a.path_mtu,
            path_mig_state: 2, // IB_MIG_ARMED as mlx5 reports
            max_rd_atomic: a.max_rd_atomic,
            max_dest_rd_atomic: a.max_dest_rd_atomic,
            min_rnr_timer: a.min_rnr_timer,
            port_num: a.port,
            timeout: a.timeout,
            retry_cnt: a.retry_cnt,
            rnr_retry: a.rnr_retry,
            sq_sig_all: q.sq_sig_all,
            ..Default::default()
        })?;
        Ok(Created::Nothing)
    }

    pub(super) fn destroy_qp(&self, io: &Io<'_>) -> Result<Created, Errno> {
        let r: abi::Destroy = io.core()?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let q = o.qps.remove(&r.handle).ok_or(Errno::EINVAL)?;
        crate::record_wqes(&q.soft);
        // an XRC target goes with its last handle (`xrc_target::TgtShare`), the creator's handle takes
        // its events with it
        if q.tgt.is_none() {
            if q.soft.is_ud() {
                finish_rung(&soft);
            }
            // uverbs detaches what the QP left attached
            soft.detach_all_mcast(&q.soft);
            soft.destroy_qp(&q.soft);
        }
        if !q.opened {
            q.soft.set_event_handler(None);
        }
        if let Some(b) = q.bfreg {
            o.bfreg_use[b as usize] -= 1;
        }
        self.purge_async(q.key);
        io.reply(&abi::DestroyQpResp {
            events_reported: q.async_reported.load(Ordering::Acquire),
        })?;
        Ok(Created::Nothing)
    }
}

impl Context {
    /// ATTACH_MCAST (`ibv_attach_mcast`) and DETACH_MCAST, as uverbs and `ib_attach_mcast`
    /// answer them: an unknown QP, a GID that is not multicast, a QP that is not UD: EINVAL;
    /// attaching again: 0; detaching what is not attached: EINVAL. The soft NIC joins the
    /// group's IPv4 address on its interface with the QP's first attach (`softnic::mcast`);
    /// a join the host refuses is the errno it gave (librdmacm then reports
    /// RDMA_CM_EVENT_MULTICAST_ERROR).
    pub(super) fn attach_mcast(&self, io: &Io<'_>, attach: bool) -> Result<Created, Errno> {
        let r: abi::AttachMcast = io.core()?;
        let soft = self.soft()?;
        let (qp, block) = {
            let o = self.objs.lock();
            let q = o.qps.get(&r.qp_handle).ok_or(Errno::EINVAL)?;
            (q.soft.clone(), q.mc_block_self)
        };
        let gid = softnic::Gid(r.gid);
        let res = if attach {
            let how = softnic::mcast::McastAttach {
                block_self_loopback: block,
            };
            soft.attach_mcast(&qp, gid, how)
        } else {
            soft.detach_mcast(&qp, gid)
        };
        res.map_err(|e| match e {
            softnic::Error::Wire(softnic::WireError::Socket(io)) => {
                crate::complain(format_args!(
                    "ATTACH_MCAST {gid}: the group join failed: {io}"
                ));
                Errno(io.raw_os_error().unwrap_or(libc::EADDRNOTAVAIL))
            }
            _ => Errno::EINVAL,
        })?;
        Ok(Created::Nothing)
    }
}

/// Runs, on the caller's thread, what a UD QP's program rang before DESTROY_QP (at most
/// 50 ms): a ConnectX has sent those datagrams microseconds after the doorbell, long before
/// the command's firmware round trip, and programs count on it (mckey's sender posts its
/// datagrams unsignaled and destroys its QP at once).
fn finish_rung(soft: &softnic::Device) {
    let end = std::time::Instant::now() + std::time::Duration::from_millis(50);
    while soft.progress() && std::time::Instant::now() < end {}
    soft.carry_end();
}

/// IB_UVERBS_QP_CREATE_BLOCK_MULTICAST_LOOPBACK.
const BLOCK_MULTICAST_LOOPBACK: u32 = 1 << 1;

/// What a CREATE_QP asks for, checked as mlx5_ib checks it: the QP's type, its SRQ, how its
/// doorbell register is named, and its rings' geometry.
struct QpShape {
    /// RC, UD, or a DC initiator or target (`IBV_QPT_DRIVER` with `MLX5_QP_FLAG_TYPE_DCI` or
    /// `_DCT`; a target's access key from the provider's `access_key`).
    transport: Transport,
    srq_handle: Option<u32>,
    /// The provider names a UAR page of its own (dynamic UARs).
    dyn_page: bool,
    /// Receive WQEs (0 on an SRQ).
    rq_wqe_count: u32,
    rq_stride: u32,
}

impl QpShape {
    /// Checks the core command `r` and the provider's part `u` (`io`'s udata).
    fn check(io: &Io<'_>, r: &abi::ExCreateQp, u: &abi::Mlx5CreateQp) -> Result<Self, Errno> {
        if io.udata.len() < 32 {
            return Err(Errno::EINVAL);
        }
        let transport = Self::transport(io, r, u)?;
        let srq_handle = (r.is_srq != 0).then_some(r.srq_handle);
        use abi::mlx5_qp_flag as f;
        let known = f::SIGNATURE
            | f::SCATTER_CQE
            | f::BFREG_INDEX
            | f::UAR_PAGE_INDEX
            | f::ALLOW_SCATTER_CQE
            | f::TYPE_DCI
            | f::TYPE_DCT;
        if u.flags & !known != 0 {
            return Err(unsupported(
                "mlx5 QP creation flags (DCI streams, tunnel offloads, ...)",
            ));
        }
        match transport {
            // mlx5_ib's check_qp_attr: a target needs an SRQ and a receive CQ, and takes the
            // rest of its shape from nobody (no rings, no doorbell)
            Transport::Dct { .. } if srq_handle.is_none() => return Err(Errno::EINVAL),
            // an XRC target has no queues, CQs or PD of its own (mlx5_ib's create_xrc_tgt_qp)
            Transport::Dct { .. } | Transport::XrcTgt => {
                return Ok(Self {
                    transport,
                    srq_handle,
                    dyn_page: false,
                    rq_wqe_count: 0,
                    rq_stride: 16,
                })
            }
            // an initiator has no receive side
            Transport::Dci if r.max_recv_wr != 0 || r.max_recv_sge != 0 => {
                return Err(Errno::EINVAL)
            }
            _ => {}
        }
        // BFREG_INDEX names a register of libmlx5's "dynamic" static pages, which this kernel
        // does not offer (num_dyn_bfregs 0); UAR_PAGE_INDEX names a page from the UAR ioctl,
        // which dynamic-UAR mode requires
        let dyn_page = u.flags & f::UAR_PAGE_INDEX != 0;
        if u.flags & f::BFREG_INDEX != 0 {
            return Err(Errno::EINVAL);
        }
        if r.max_send_wr > MAX_QP_WR
            || r.max_recv_wr > MAX_QP_WR
            || r.max_send_sge > MAX_SGE
            || r.max_recv_sge > MAX_SGE
        {
            return Err(Errno::EINVAL);
        }
        let pow2 = |n: u32| n == 0 || n.is_power_of_two();
        // a QP on an SRQ has no RQ (the provider allocates none), nor has an XRC initiator
        // (the kernel clears its receive capacities)
        let rq_wqe_count = if srq_handle.is_some() || transport == Transport::XrcIni {
            0
        } else {
            u.rq_wqe_count
        };
        // no SQ (max_send_wr 0) is a QP that only receives, as mlx5_ib creates it (no_sq)
        if !pow2(u.sq_wqe_count)
            || u.sq_wqe_count > MAX_QP_WR
            || !pow2(rq_wqe_count)
            || rq_wqe_count > MAX_QP_WR
        {
            return Err(Errno::EINVAL);
        }
        let rq_stride = 1u32
            .checked_shl(u.rq_wqe_shift)
            .filter(|&s| (16..=512).contains(&s));
        let rq_stride = match (rq_wqe_count, rq_stride) {
            (0, _) => 16,
            (_, Some(s)) => s,
            (_, None) => return Err(Errno::EINVAL),
        };
        Ok(Self {
            transport,
            srq_handle,
            dyn_page,
            rq_wqe_count,
            rq_stride,
        })
    }

    /// The transport a CREATE_QP asks for: RC and UD by type; a DC initiator or target by
    /// `IBV_QPT_DRIVER` and exactly one of the DC flags, as mlx5_ib's `process_vendor_flags`
    /// reads them (a target's request must reach the access key: 48 bytes of driver data).
    fn transport(
        io: &Io<'_>,
        r: &abi::ExCreateQp,
        u: &abi::Mlx5CreateQp,
    ) -> Result<Transport, Errno> {
        const IBV_QPT_RC: u8 = 2;
        const IBV_QPT_UC: u8 = 3;
        const IBV_QPT_UD: u8 = 4;
        const IBV_QPT_XRC_SEND: u8 = 9;
        const IBV_QPT_XRC_RECV: u8 = 10;
        const IBV_QPT_DRIVER: u8 = 0xff;
        use abi::mlx5_qp_flag as f;
        Ok(match r.qp_type {
            IBV_QPT_RC => Transport::Rc,
            IBV_QPT_UC => Transport::Uc,
            IBV_QPT_UD => Transport::Ud,
            IBV_QPT_XRC_SEND => Transport::XrcIni,
            IBV_QPT_XRC_RECV => Transport::XrcTgt,
            IBV_QPT_DRIVER => match (u.flags & f::TYPE_DCI != 0, u.flags & f::TYPE_DCT != 0) {
                (true, false) => Transport::Dci,
                (false, true) if io.udata.len() >= 48 => Transport::Dct { key: u.sq_buf_addr },
                _ => return Err(Errno::EINVAL),
            },
            _ => return Err(unsupported("QP types other than RC, UC, UD, XRC and DC")),
        })
    }

    /// The provider's rings (the RQ first, then the SQ, in one buffer) and doorbell record.
    fn rings(
        &self,
        u: &abi::Mlx5CreateQp,
    ) -> Result<(Option<DmaBuf>, Option<DmaBuf>, DmaBuf), Errno> {
        let rq_bytes = self.rq_wqe_count as usize * self.rq_stride as usize;
        let sq_bytes = u.sq_wqe_count as usize * prm::WQEBB;
        check_mapped(u.buf_addr, (rq_bytes + sq_bytes) as u64)?;
        let rq_ring = if rq_bytes > 0 {
            Some(user_buf(u.buf_addr, rq_bytes)?)
        } else {
            None
        };
        let sq_ring = match sq_bytes {
            0 => None,
            n => Some(user_buf(u.buf_addr + rq_bytes as u64, n)?),
        };
        let dbrec = user_buf(u.db_addr, 8)?;
        Ok((rq_ring, sq_ring, dbrec))
    }
}

/// The objects a new QP hangs off, found by the handles of its CREATE_QP.
struct QpParents {
    pd: softnic::PdId,
    send_cq: Arc<softnic::Cq>,
    recv_cq: Arc<softnic::Cq>,
    srq: Option<Arc<softnic::Srq>>,
}

impl QpParents {
    /// Looks the PD, the CQs and the SRQ up; EINVAL for a handle that names none. An XRC
    /// initiator has no receive CQ (the library names none): its send CQ stands in.
    fn find(
        o: &Objects,
        r: &abi::ExCreateQp,
        srq_handle: Option<u32>,
        xrc_ini: bool,
    ) -> Result<Self, Errno> {
        let pd = o.pds.get(&r.pd_handle).ok_or(Errno::EINVAL)?.id;
        let scq = o
            .cqs
            .get(&r.send_cq_handle)
            .ok_or(Errno::EINVAL)?
            .soft
            .clone();
        let rcq = match xrc_ini {
            true => scq.clone(),
            false => o
                .cqs
                .get(&r.recv_cq_handle)
                .ok_or(Errno::EINVAL)?
                .soft
                .clone(),
        };
        let srq = match srq_handle {
            Some(h) => Some(o.srqs.get(&h).ok_or(Errno::EINVAL)?.soft.clone()),
            None => None,
        };
        Ok(Self {
            pd,
            send_cq: scq,
            recv_cq: rcq,
            srq,
        })
    }
}

/// The capacities CREATE_QP reports for QP handle `h`: those asked for (mlx5_ib: a QP without
/// an RQ reports no receive capacity).
fn create_qp_caps(r: &abi::ExCreateQp, h: u32, qpn: u32, on_srq: bool) -> abi::CreateQpResp {
    let caps = abi::CreateQpResp {
        qp_handle: h,
        qpn,
        max_send_wr: r.max_send_wr,
        max_recv_wr: r.max_recv_wr,
        max_send_sge: r.max_send_sge,
        max_recv_sge: r.max_recv_sge,
        max_inline_data: r.max_inline_data,
        reserved: 0,
    };
    if on_srq {
        // mlx5_ib: a QP without an RQ reports no receive capacity
        abi::CreateQpResp {
            max_recv_wr: 0,
            max_recv_sge: 0,
            ..caps
        }
    } else {
        caps
    }
}

/// Writes CREATE_QP's answer (EX_CREATE_QP's when `ex`) and the provider's, which names the
/// QP's BlueFlame register in the gross numbering (or none: the library chose the page).
fn reply_create_qp(
    io: &Io<'_>,
    caps: abi::CreateQpResp,
    ex: bool,
    bfreg: Option<u32>,
) -> Result<(), Errno> {
    let gross = match bfreg {
        Some(b) => b / BFREGS_PER_UAR * GROSS_BFREGS_PER_UAR + b % BFREGS_PER_UAR,
        // MLX5_IB_INVALID_BFREG: the library chose the page itself
        None => 0x8000_0000,
    };
    let reply = if ex {
        io.reply(&abi::ExCreateQpResp {
            base: caps,
            comp_mask: 0,
            response_length: 40,
        })
    } else {
        io.reply(&caps)
    };
    reply.and_then(|_| {
        io.ureply(&abi::Mlx5CreateQpResp {
            bfreg_index: gross,
            ..Default::default()
        })
    })
}

/// ib_modify_qp_is_ok for RC, UC, UD and XRC, mlx5_ib's `modify_dci_qp_is_ok` for a DC initiator
/// and `mlx5_ib_modify_dct`'s exact masks for a DC target (RESET → INIT → RTR, nothing else):
/// the attributes the move from state `cur` to `new` requires and those it allows (IB state
/// numbers); EINVAL for a move that is not one.
fn transition_attrs(transport: Transport, cur: u8, new: u8) -> Result<(u32, u32), Errno> {
    use qp_attr::*;
    Ok(match (cur, new) {
        _ if matches!(transport, Transport::Dct { .. }) => match (cur, new) {
            (0, 1) => (PKEY_INDEX | PORT | ACCESS_FLAGS, 0),
            (1, 2) => (MIN_RNR_TIMER | AV | PATH_MTU, 0),
            _ => return Err(Errno::EINVAL),
        },
        (_, 0) | (_, 6) => (0, 0),
        _ if transport == Transport::Dci => match (cur, new) {
            (0, 1) => (PKEY_INDEX | PORT, 0),
            (1, 1) => (0, PKEY_INDEX | PORT),
            (1, 2) => (PATH_MTU, PKEY_INDEX | AV),
            (2, 3) => (
                TIMEOUT | RETRY_CNT | RNR_RETRY | MAX_QP_RD_ATOMIC | SQ_PSN,
                MIN_RNR_TIMER,
            ),
            (3, 3) => (0, MIN_RNR_TIMER),
            _ => return Err(Errno::EINVAL),
        },
        _ if transport == Transport::Uc => match (cur, new) {
            (0, 1) => (PKEY_INDEX | PORT | ACCESS_FLAGS, 0),
            (1, 1) => (0, PKEY_INDEX | PORT | ACCESS_FLAGS),
            (1, 2) => (
                AV | PATH_MTU | DEST_QPN | RQ_PSN,
                ALT_PATH | ACCESS_FLAGS | PKEY_INDEX,
            ),
            (2, 3) => (SQ_PSN, CUR_STATE | ALT_PATH | ACCESS_FLAGS | PATH_MIG_STATE),
            (3, 3) => (0, CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE),
            _ => return Err(Errno::EINVAL),
        },
        _ if transport == Transport::XrcIni => match (cur, new) {
            (0, 1) => (PKEY_INDEX | PORT | ACCESS_FLAGS, 0),
            (1, 1) => (0, PKEY_INDEX | PORT | ACCESS_FLAGS),
            (1, 2) => (
                AV | PATH_MTU | DEST_QPN | RQ_PSN,
                ALT_PATH | ACCESS_FLAGS | PKEY_INDEX,
            ),
            (2, 3) => (
                TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC,
                CUR_STATE | ALT_PATH | ACCESS_FLAGS | PATH_MIG_STATE,
            ),
            (3, 3) => (0, CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE),
            _ => return Err(Errno::EINVAL),
        },
        // an XRC target moves as RC but for RTR→RTS: timeout and SQ PSN only
        (2, 3) if transport == Transport::XrcTgt => (
            TIMEOUT | SQ_PSN,
            CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE,
        ),
        _ if transport == Transport::Ud => match (cur, new) {
            (0, 1) => (PKEY_INDEX | PORT | QKEY, 0),
            (1, 1) => (0, PKEY_INDEX | PORT | QKEY),
            (1, 2) => (0, PKEY_INDEX | QKEY),
            (2, 3) => (SQ_PSN, CUR_STATE | QKEY),
            (3, 3) => (0, CUR_STATE | QKEY),
            _ => return Err(Errno::EINVAL),
        },
        (0, 1) => (PKEY_INDEX | PORT | ACCESS_FLAGS, 0),
        (1, 1) => (0, PKEY_INDEX | PORT | ACCESS_FLAGS),
        (1, 2) => (
            AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER,
            ALT_PATH | ACCESS_FLAGS | PKEY_INDEX,
        ),
        (2, 3) => (
            TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC,
            CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE,
        ),
        (3, 3) => (
            0,
            CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE | MIN_RNR_TIMER,
        ),
        _ => return Err(Errno::EINVAL),
    })
}

/// The port, P_Key index, access flags, address vector, path MTU and destination QPN that
/// `given` names, checked and taken into `a`. A DC QP's address vector names no peer (its
/// destination GID is not used: mlx5_ib takes only the traffic class, flow label, hop limit
/// and source GID index of a target's), so only RC's must reach an address.
fn take_path_attrs(
    m: &abi::ModifyQp,
    given: u32,
    mut a: QpAttrs,
    dc: bool,
) -> Result<QpAttrs, Errno> {
    use qp_attr::*;
    if given & PORT != 0 {
        if m.port_num != 1 {
            return Err(Errno::EINVAL);
        }
        a.port = 1;
    }
    if given & PKEY_INDEX != 0 {
        if m.pkey_index != 0 {
            return Err(Errno::EINVAL);
        }
        a.pkey_index = 0;
    }
    if given & ACCESS_FLAGS != 0 {
        if m.qp_access_flags
            & !(access::LOCAL_WRITE
                | access::REMOTE_WRITE
                | access::REMOTE_READ
                | access::REMOTE_ATOMIC
                | access::MW_BIND)
            != 0
        {
            return Err(Errno::EINVAL);
        }
        a.access = m.qp_access_flags;
    }
    if given & AV != 0 {
        // RoCE needs a GRH; the destination GID must be an address the wire can reach
        if m.dest.is_global == 0 || m.dest.sgid_index != 0 {
            return Err(Errno::EINVAL);
        }
        if !dc && verbs::Gid(m.dest.dgid).to_ipv4().is_none() {
            return Err(unsupported(
                "destination GIDs that are not IPv4-mapped (RoCE v2 over IPv4 only)",
            ));
        }
        a.dest = m.dest;
    }
    if given & PATH_MTU != 0 {
        mtu_bytes(m.path_mtu).ok_or(Errno::EINVAL)?;
        a.path_mtu = m.path_mtu;
    }
    if given & DEST_QPN != 0 {
        if m.dest_qp_num > 0xff_ffff {
            return Err(Errno::EINVAL);
        }
        a.dest_qpn = m.dest_qp_num;
    }
    Ok(a)
}

/// The PSNs, Q_Key, RDMA READ and atomic depths, timers and retry counts that `given` names,
/// checked and taken into `a`.
fn take_transport_attrs(m: &abi::ModifyQp, given: u32, mut a: QpAttrs) -> Result<QpAttrs, Errno> {
    use qp_attr::*;
    if given & RQ_PSN != 0 {
        a.rq_psn = m.rq_psn & 0xff_ffff;
    }
    if given & SQ_PSN != 0 {
        a.sq_psn = m.sq_psn & 0xff_ffff;
    }
    if given & QKEY != 0 {
        a.qkey = m.qkey;
    }
    if given & MAX_DEST_RD_ATOMIC != 0 {
        a.max_dest_rd_atomic = at_most(m.max_dest_rd_atomic, MAX_RD_ATOM as u8)?;
    }
    if given & MAX_QP_RD_ATOMIC != 0 {
        a.max_rd_atomic = at_most(m.max_rd_atomic, MAX_RD_ATOM as u8)?;
    }
    if given & MIN_RNR_TIMER != 0 {
        a.min_rnr_timer = at_most(m.min_rnr_timer, 31)?;
    }
    if given & TIMEOUT != 0 {
        a.timeout = at_most(m.timeout, 31)?;
    }
    if given & RETRY_CNT != 0 {
        a.retry_cnt = at_most(m.retry_cnt, 7)?;
    }
    if given & RNR_RETRY != 0 {
        a.rnr_retry = at_most(m.rnr_retry, 7)?;
    }
    Ok(a)
}

/// The soft QP's move from state `cur` to `new` with attributes `a` (none for a move within
/// a state that changes attributes only).
fn soft_transition(
    transport: Transport,
    cur: u8,
    new: u8,
    a: &QpAttrs,
) -> Result<Option<verbs::Modify>, Errno> {
    let rights =
        ib_access(a.access & (access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC))?;
    let ud = transport == Transport::Ud;
    let dc = matches!(transport, Transport::Dci | Transport::Dct { .. });
    Ok(match (cur, new) {
        (_, 0) => Some(verbs::Modify::Reset),
        (_, 6) => Some(verbs::Modify::Err),
        (1, 2) if dc => Some(verbs::Modify::RtrDc {
            mtu: mtu_bytes(a.path_mtu).ok_or(Errno::EINVAL)?,
            min_rnr_timer: a.min_rnr_timer,
        }),
        (_, 1) if ud => Some(verbs::Modify::InitUd { qkey: a.qkey }),
        (1, 2) if ud => Some(verbs::Modify::RtrUd),
        (_, 1) => Some(verbs::Modify::Init { access: rights }),
        (1, 2) => Some(verbs::Modify::Rtr(verbs::RtrAttr {
            remote_gid: verbs::Gid(a.dest.dgid),
            remote_qpn: a.dest_qpn,
            rq_psn: a.rq_psn,
            mtu: mtu_bytes(a.path_mtu).ok_or(Errno::EINVAL)?,
            min_rnr_timer: a.min_rnr_timer,
            selective_repeat: false,
        })),
        (_, 3) => Some(verbs::Modify::Rts(verbs::RtsAttr {
            sq_psn: a.sq_psn,
            timeout: a.timeout,
            retry_cnt: a.retry_cnt,
            rnr_retry: a.rnr_retry,
        })),
        _ => None,
    })
}
