//! DEVX QPs: CREATE_QP (RC, and DC initiators: `st` DCI; the WQ and the doorbell record in umems; an RQ of its own, on a
//! verbs SRQ, or none; CQs and PD of the context, verbs or DEVX), the transitions RST2INIT,
//! INIT2INIT, INIT2RTR, RTR2RTS, RTS2RTS, 2ERR and 2RST, QUERY_QP, and destroy. A transition
//! the QP's state does not allow gets BAD_QP_STATE, as from the firmware.

use super::DevxObj;
use super::{lacks, out, refuse, syndrome, Fw, Refused};
use crate::context::Context;
use prm::cmd::{
    self, ads, create_qp_in as ci, modify_qp_in as mi, op, qp_state, qpc, qpc_ext, rq_type, st,
};
use prm::cmd::{status, Field, ADS_AT, QPC_AT};
use std::sync::Arc;

/// Bytes of the QP context.
const QPC_LEN: usize = 232;
/// `opt_param_mask` bits that carry the remote rights (RRE, RAE, RWE).
const OPTPAR_RIGHTS: u64 = 1 << 1 | 1 << 2 | 1 << 3;

/// A QP made with CREATE_QP.
pub(in crate::context) struct DevxQp {
    pub soft: Arc<softnic::Qp>,
    pub umems: Vec<u32>,
    pub send_cqn: u32,
    pub recv_cqn: u32,
    pub pd: u32,
    pub srqn: Option<u32>,
    pub uar_page: u32,
    /// The QP context as created and as the transitions changed it (QUERY_QP answers it).
    qpc: Vec<u8>,
}

/// Whether `opcode` is a QP transition OBJ_MODIFY passes on.
pub(super) fn is_transition(opcode: u16) -> bool {
    matches!(
        opcode,
        op::RST2INIT_QP
            | op::INIT2INIT_QP
            | op::INIT2RTR_QP
            | op::RTR2RTS_QP
            | op::RTS2RTS_QP
            | op::SQERR2RTS_QP
            | op::SQD_RTS_QP
            | op::QP_2ERR
            | op::QP_2RST
    )
}

/// The fields of the QP context (and its primary path) each transition sets.
fn carried(opcode: u16) -> (&'static [Field], &'static [Field]) {
    match opcode {
        op::RST2INIT_QP | op::INIT2INIT_QP => (
            &[
                qpc::RWE,
                qpc::RRE,
                qpc::RAE,
                qpc::ATOMIC_MODE,
                qpc::PM_STATE,
            ],
            &[ads::VHCA_PORT_NUM, ads::PKEY_INDEX],
        ),
        op::INIT2RTR_QP => (
            &[
                qpc::MTU,
                qpc::LOG_MSG_MAX,
                qpc::REMOTE_QPN,
                qpc::NEXT_RCV_PSN,
                qpc::MIN_RNR_NAK,
                qpc::LOG_RRA_MAX,
            ],
            &[
                ads::RGID_RIP,
                ads::RMAC,
                ads::UDP_SPORT,
                ads::HOP_LIMIT,
                ads::SRC_ADDR_INDEX,
                ads::GRH,
                ads::TCLASS,
                ads::FLOW_LABEL,
                ads::DSCP,
                ads::SL,
                ads::VHCA_PORT_NUM,
            ],
        ),
        op::RTR2RTS_QP => (
            &[
                qpc::NEXT_SEND_PSN,
                qpc::RETRY_COUNT,
                qpc::RNR_RETRY,
                qpc::LOG_SRA_MAX,
                qpc::LOG_ACK_REQ_FREQ,
            ],
            &[ads::ACK_TIMEOUT],
        ),
        op::RTS2RTS_QP => (&[qpc::MIN_RNR_NAK], &[ads::ACK_TIMEOUT]),
        _ => (&[], &[]),
    }
}

/// Copies field `f` (any width, byte arrays too) from `src` into `dst`.
fn copy_field(dst: &mut [u8], src: &[u8], f: Field) {
    if f.width <= 64 {
        cmd::set(dst, f, cmd::get(src, f));
    } else {
        let (a, n) = (f.byte(), (f.width / 8) as usize);
        let from = cmd::bytes(src, f);
        if from.len() == n && a + n <= dst.len() {
            dst[a..a + n].copy_from_slice(from);
        }
    }
}

fn soft_state(q: &softnic::Qp) -> u8 {
    match q.state() {
        verbs::QpState::Reset => qp_state::RST,
        verbs::QpState::Init => qp_state::INIT,
        verbs::QpState::Rtr => qp_state::RTR,
        verbs::QpState::Rts => qp_state::RTS,
        verbs::QpState::Err => qp_state::ERR,
    }
}

impl DevxQp {
    /// QUERY_QP: the context, with the state the QP is in.
    pub fn query(&self) -> Fw {
        let mut o = out(cmd::QUERY_QP_OUT);
        o[QPC_AT as usize..QPC_AT as usize + QPC_LEN].copy_from_slice(&self.qpc);
        cmd::set(&mut o, qpc::STATE.at(QPC_AT), soft_state(&self.soft).into());
        // a QP not yet given a path MTU reports the port's (4096), as a ConnectX reports a
        // valid one for a fresh QP (GPUNetIO reads it right after CREATE_QP)
        if cmd::get(&o, qpc::MTU.at(QPC_AT)) == 0 {
            cmd::set(&mut o, qpc::MTU.at(QPC_AT), 5);
        }
        Ok(o)
    }
}

/// What a CREATE_QP's context asks for, checked before any object is touched: the service
/// type, the doorbell mode, the queue sizes and where receives come from; what the emulated
/// device does not have is refused with a line (streams, scatter to CQE, cross-channel
/// slaves). A cross-channel master (`cd_master`) may post WAIT on any CQ of the device.
struct QpShape {
    dci: bool,
    cd_master: bool,
    no_dbr: bool,
    sq_blocks: u32,
    rq_wqes: u32,
    rq_stride: u32,
    srqn: Option<u32>,
}

fn qp_shape(input: &[u8]) -> Result<QpShape, Refused> {
    let f = |field: Field| cmd::get(input, field.at(QPC_AT));
    let dci = match f(qpc::ST) as u8 {
        st::RC => false,
        st::DCI => true,
        s => return lacks(&format!("QP service type {s:#x} (RC and DCI only)")),
    };
    if f(qpc_ext::LOG_NUM_DCI_STREAM_CHANNELS) != 0 || f(qpc_ext::LOG_NUM_DCI_ERRORED_STREAMS) != 0
    {
        return lacks("DCI streams (log_num_dci_stream_channels)");
    }
    // send_dbr_mode 1 (NO_DBR_EXT): doorbells at the page's DBR-less register carry the
    // producer index, and nothing reads a send doorbell record (as on a ConnectX-8)
    let no_dbr = match f(qpc_ext::SEND_DBR_MODE) {
        0 => false,
        1 => true,
        m => return lacks(&format!("send_dbr_mode {m}")),
    };
    if f(qpc::CS_REQ) != 0 || f(qpc::CS_RES) != 0 {
        return lacks("scatter to CQE (cs_req / cs_res)");
    }
    if f(qpc::CD_SLAVE_SEND) != 0 || f(qpc::CD_SLAVE_RECEIVE) != 0 {
        return lacks("cross-channel slave QPs (cd_slave_send / cd_slave_receive)");
    }
    if f(qpc::LOG_MSG_MAX) > 30 {
        return refuse(status::BAD_PARAM, syndrome::QP_SIZE);
    }
    let log_sq = f(qpc::LOG_SQ_SIZE) as u32;
    let sq_blocks = match f(qpc::NO_SQ) {
        1 => 0,
        _ if log_sq > 15 => return refuse(status::BAD_PARAM, syndrome::QP_SIZE),
        _ => 1u32 << log_sq,
    };
    let (rq_wqes, rq_stride, srqn) = match f(qpc::RQ_TYPE) as u8 {
        rq_type::REGULAR => {
            let (log_rq, log_stride) = (f(qpc::LOG_RQ_SIZE) as u32, f(qpc::LOG_RQ_STRIDE) as u32);
            if log_rq > 15 || log_stride > 5 {
                return refuse(status::BAD_PARAM, syndrome::QP_SIZE);
            }
            (1u32 << log_rq, 16u32 << log_stride, None)
        }
        rq_type::SRQ => (0, 16, Some(f(qpc::SRQN_RMPN_XRQN) as u32)),
        rq_type::ZERO_SIZE => (0, 16, None),
        _ => return refuse(status::BAD_PARAM, syndrome::ATTRIBUTE),
    };
    Ok(QpShape {
        dci,
        cd_master: f(qpc::CD_MASTER) != 0,
        no_dbr,
        sq_blocks,
        rq_wqes,
        rq_stride,
        srqn,
    })
}

impl Context {
    /// CREATE_QP. Returns the QP and the out-mailbox (its number).
    pub(super) fn devx_create_qp(&self, input: &[u8]) -> Result<(DevxQp, Vec<u8>), Refused> {
        let f = |field: Field| cmd::get(input, field.at(QPC_AT));
        if input.len() < ci::WQ_UMEM_VALID.end() {
            return refuse(status::BAD_INP_LEN, syndrome::INPUT_LENGTH);
        }
        let QpShape {
            dci,
            cd_master,
            no_dbr,
            sq_blocks,
            rq_wqes,
            rq_stride,
            srqn,
        } = qp_shape(input)?;
        let soft = self.soft().map_err(|_| Refused {
            status: status::INT_ERR,
            syndrome: 0,
        })?;
        let mut o = self.objs.lock();
        let (pd_handle, pd) = super::pd_by_number(&o, f(qpc::PD) as u32)?;
        let cq = |o: &crate::context::Objects, n: u32| {
            o.cq_by_number(n).ok_or(Refused {
                status: status::BAD_PARAM,
                syndrome: syndrome::CQN,
            })
        };
        let (send_cqn, recv_cqn) = (f(qpc::CQN_SND) as u32, f(qpc::CQN_RCV) as u32);
        let send_cq = cq(&o, send_cqn)?;
        // a QP without an RQ may name no receive CQ; its responder completions have none
        let recv_cq = match (rq_wqes, srqn) {
            (0, None) if recv_cqn == 0 => send_cq.clone(),
            _ => cq(&o, recv_cqn)?,
        };
        let srq = match srqn {
            Some(n) => Some(
                o.srqs
                    .values()
                    .find(|s| s.soft.srqn() == n)
                    .map(|s| s.soft.clone())
                    .ok_or(Refused {
                        status: status::BAD_PARAM,
                        syndrome: syndrome::SRQN,
                    })?,
            ),
            None => None,
        };
        let uar_page = f(qpc::UAR_PAGE) as u32;
        let (page, _bf) = self.uar_page(&o, uar_page).ok_or(Refused {
            status: status::BAD_PARAM,
            syndrome: syndrome::UAR,
        })?;
        // mlx5_ib makes every DEVX QP umem-backed (wq_umem_valid, dbr_umem_valid = 1)
        let wq_umem = cmd::get(input, ci::WQ_UMEM_ID) as u32;
        let dbr_umem = f(qpc::DBR_UMEM_ID) as u32;
        let wq_off = cmd::get(input, ci::WQ_UMEM_OFFSET);
        let rq_bytes = rq_wqes as usize * rq_stride as usize;
        let sq_bytes = sq_blocks as usize * prm::WQEBB;
        let wq = o.umem(wq_umem)?;
        let rq_ring = match rq_bytes {
            0 => None,
            n => Some(wq.slice(wq_off, n)?),
        };
        let sq_ring = match sq_bytes {
            0 => None,
            n => Some(wq.slice(wq_off + rq_bytes as u64, n)?),
        };
        // a doorbell record in GPU memory: the SQ producer comes from the doorbells, the RQ
        // head is read with a copy
        let dbrec = o.umem(dbr_umem)?.slice(f(qpc::DBR_ADDR), 8)?;
        let cfg = softnic::QpConfig {
            pd,
            send_cq,
            recv_cq,
            // a QP without an SQ (no_sq) gets one block nobody announces
            sq_blocks: sq_blocks.max(1),
            rq_wqes,
            max_recv_sge: (rq_stride / 16).min(32),
            max_inline: prm::wqe::MAX_INLINE_SEND as u32,
            doorbell: verbs::DoorbellMode::Auto,
            sq_ring,
            rq_ring,
            rq_stride: Some(rq_stride),
            dbrec: Some(dbrec),
            uar: Some(match no_dbr {
                true => softnic::qp::UarRegister {
                    page,
                    offset: prm::doorbell::DBR_LESS_OFFSET,
                    registers: 1,
                },
                false => softnic::qp::UarRegister {
                    page,
                    offset: prm::doorbell::BF_OFFSET,
                    registers: softnic::qp::MAX_REGISTERS,
                },
            }),
            user_index: Some(f(qpc::USER_INDEX) as u32),
            cross_channel: cd_master,
        };
        let made = match &srq {
            // an initiator takes no receives (UCX names the interface's SRQ all the same)
            _ if dci => soft.create_dci(cfg),
            Some(s) => soft.create_qp_on_srq(cfg, s),
            None => soft.create_qp(cfg),
        };
        let qp = made.map_err(|_| Refused {
            status: status::BAD_PARAM,
            syndrome: syndrome::QP_SIZE,
        })?;
        o.umem(wq_umem)?.users += 1;
        o.umem(dbr_umem)?.users += 1;
        let mut out_box = out(16);
        cmd::set(&mut out_box, cmd::obj::CQN, qp.qpn().into());
        let mut ctx = vec![0u8; QPC_LEN];
        let given = &input[QPC_AT as usize..(QPC_AT as usize + QPC_LEN).min(input.len())];
        ctx[..given.len()].copy_from_slice(given);
        Ok((
            DevxQp {
                soft: qp,
                umems: vec![wq_umem, dbr_umem],
                send_cqn,
                recv_cqn,
                pd: pd_handle,
                srqn,
                uar_page,
                qpc: ctx,
            },
            out_box,
        ))
    }

    /// One QP transition.
    pub(super) fn devx_modify_qp(&self, q: &mut DevxQp, opcode: u16, input: &[u8]) -> Fw {
        use verbs::Modify;
        if input.len() < mi::OPT_PARAM_MASK.end() + QPC_LEN {
            return refuse(status::BAD_INP_LEN, syndrome::INPUT_LENGTH);
        }
        let ctx = &input[QPC_AT as usize..];
        let g = |field: Field| cmd::get(ctx, field);
        let p = |field: Field| cmd::get(ctx, field.at(ADS_AT));
        let opt = cmd::get(input, mi::OPT_PARAM_MASK);
        let cur = soft_state(&q.soft);
        let need = |s: u8| {
            if cur == s {
                Ok(())
            } else {
                refuse(status::BAD_QP_STATE, syndrome::QP_STATE)
            }
        };
        let rights = || {
            let mut a = verbs::Access::NONE;
            for (bit, right) in [
                (qpc::RWE, verbs::Access::REMOTE_WRITE),
                (qpc::RRE, verbs::Access::REMOTE_READ),
                (qpc::RAE, verbs::Access::REMOTE_ATOMIC),
            ] {
                if g(bit) == 1 {
                    a = a | right;
                }
            }
            a
        };
        let port_ok = p(ads::VHCA_PORT_NUM) <= 1;
        let step = match opcode {
            op::RST2INIT_QP => {
                need(qp_state::RST)?;
                if !port_ok || p(ads::PKEY_INDEX) != 0 {
                    return refuse(status::BAD_PARAM, syndrome::PORT);
                }
                Some(Modify::Init { access: rights() })
            }
            op::INIT2INIT_QP => {
                need(qp_state::INIT)?;
                (opt & OPTPAR_RIGHTS != 0).then(|| Modify::Init { access: rights() })
            }
            op::INIT2RTR_QP => {
                need(qp_state::INIT)?;
                let mtu = g(qpc::MTU) as u32;
                if !(1..=5).contains(&mtu) || g(qpc::LOG_RRA_MAX) > 4 || !port_ok {
                    return refuse(status::BAD_PARAM, syndrome::ATTRIBUTE);
                }
                if q.soft.is_dci() {
                    // no peer: each WQE names its target
                    return self.step(
                        q,
                        opcode,
                        ctx,
                        Some(Modify::RtrDc {
                            mtu: 128 << mtu,
                            min_rnr_timer: g(qpc::MIN_RNR_NAK) as u8,
                        }),
                    );
                }
                let mut gid = [0u8; 16];
                gid.copy_from_slice(cmd::bytes(ctx, ads::RGID_RIP.at(ADS_AT)));
                let gid = verbs::Gid(gid);
                if gid.to_ipv4().is_none() {
                    return lacks(
                        "a destination GID that is not IPv4-mapped (RoCE v2 over IPv4 only)",
                    );
                }
                Some(Modify::Rtr(verbs::RtrAttr {
                    remote_gid: gid,
                    remote_qpn: g(qpc::REMOTE_QPN) as u32,
                    rq_psn: g(qpc::NEXT_RCV_PSN) as u32,
                    mtu: 128 << mtu,
                    min_rnr_timer: g(qpc::MIN_RNR_NAK) as u8,
                    selective_repeat: false,
                }))
            }
            op::RTR2RTS_QP => {
                need(qp_state::RTR)?;
                if g(qpc::LOG_SRA_MAX) > 4 {
                    return refuse(status::BAD_PARAM, syndrome::ATTRIBUTE);
                }
                Some(Modify::Rts(verbs::RtsAttr {
                    sq_psn: g(qpc::NEXT_SEND_PSN) as u32,
                    timeout: p(ads::ACK_TIMEOUT) as u8,
                    retry_cnt: g(qpc::RETRY_COUNT) as u8,
                    rnr_retry: g(qpc::RNR_RETRY) as u8,
                }))
            }
            op::RTS2RTS_QP => {
                need(qp_state::RTS)?;
                None
            }
            op::QP_2ERR => Some(Modify::Err),
            op::QP_2RST => {
                if let Ok(s) = self.soft() {
                    s.drain_errored(&q.soft);
                }
                Some(Modify::Reset)
            }
            // the soft NIC's QPs never stop in SQE or SQD
            _ => return refuse(status::BAD_QP_STATE, syndrome::QP_STATE),
        };
        self.step(q, opcode, ctx, step)
    }

    /// Moves the soft QP by `step` (none: attributes only) and keeps the fields the
    /// transition carries in the QP's context.
    fn step(&self, q: &mut DevxQp, opcode: u16, ctx: &[u8], step: Option<verbs::Modify>) -> Fw {
        if let Some(s) = step {
            if q.soft.modify(s).is_err() {
                return refuse(status::BAD_PARAM, syndrome::ATTRIBUTE);
            }
        }
        let (fields, path) = carried(opcode);
        for &f in fields {
            copy_field(&mut q.qpc, ctx, f);
        }
        for &f in path {
            copy_field(&mut q.qpc, ctx, f.at(ADS_AT));
        }
        Ok(out(16))
    }
}

impl crate::context::Objects {
    /// Whether a CQ or QP of this context rings doorbells on UAR page `page_id`.
    pub(in crate::context) fn uar_in_use(&self, page_id: u32) -> bool {
        self.qps.values().any(|q| q.uar_page == Some(page_id))
            || self.cqs.values().any(|c| c.uar_page == Some(page_id))
            || self.devx_objs.values().any(|x| match x {
                DevxObj::Qp(q) => q.uar_page == page_id,
                DevxObj::Cq(c) => c.uar_page == page_id,
                DevxObj::Dct(_) | DevxObj::Mkey(_) => false,
            })
    }
}
