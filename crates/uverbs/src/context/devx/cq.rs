//! DEVX CQs: CREATE_CQ with the ring and the doorbell record in umems (64- or 128-byte
//! CQEs, `cqe_sz` 0 or 1; collapsed `cc`, overrun-ignore `oi` or overrun-detect), QUERY_CQ,
//! and destroy.

use super::{lacks, out, refuse, syndrome, Fw, Refused, EQN};
use crate::context::Context;
use crate::device::MAX_CQE;
use prm::cmd::{self, cqc, create_cq_in as ci, status, CQC_AT};
use std::sync::Arc;

/// A CQ made with CREATE_CQ.
pub(in crate::context) struct DevxCq {
    pub soft: Arc<softnic::Cq>,
    /// The umems it is built on (ring, doorbell record).
    pub umems: Vec<u32>,
    /// Its UAR page.
    pub uar_page: u32,
    /// The CQ context as created (QUERY_CQ answers it).
    cqc: Vec<u8>,
}

impl DevxCq {
    /// QUERY_CQ: the context as created, with the producer counter.
    pub fn query(&self) -> Fw {
        let mut o = out(CQC_AT as usize + 64);
        o[CQC_AT as usize..].copy_from_slice(&self.cqc);
        let produced = self.soft.produced() & 0xff_ffff;
        cmd::set(&mut o, cqc::PRODUCER_COUNTER.at(CQC_AT), produced.into());
        Ok(o)
    }
}

impl Context {
    /// CREATE_CQ. Returns the CQ and the out-mailbox (its number).
    pub(super) fn devx_create_cq(&self, input: &[u8]) -> Result<(DevxCq, Vec<u8>), Refused> {
        let f = |field: prm::cmd::Field| cmd::get(input, field.at(CQC_AT));
        if input.len() < ci::CQ_UMEM_VALID.end() {
            return refuse(status::BAD_INP_LEN, syndrome::INPUT_LENGTH);
        }
        // cqe_sz: 0 = 64 bytes, 1 = 128 bytes, 2 = 128 bytes padded (cqe_128_always, which
        // this device does not report), others reserved
        let size = match f(cqc::CQE_SZ) {
            0 => verbs::CqeSize::B64,
            1 => verbs::CqeSize::B128,
            2 => return lacks("padded 128-byte CQEs (cqe_sz 2)"),
            _ => return refuse(status::BAD_PARAM, syndrome::FEATURE),
        };
        if f(cqc::CQE_COMPRESSION_EN) != 0 {
            return lacks("CQE compression");
        }
        let log = f(cqc::LOG_CQ_SIZE) as u32;
        if (1u32 << log.min(31)) - 1 > MAX_CQE || log > 22 {
            return refuse(status::BAD_PARAM, syndrome::CQ_SIZE);
        }
        let ncqe = 1u32 << log;
        if f(cqc::C_EQN) as u32 != EQN {
            return refuse(status::BAD_PARAM, syndrome::EQN);
        }
        let uar_page = f(cqc::UAR_PAGE) as u32;
        let mode = match (f(cqc::CC), f(cqc::OI)) {
            (1, _) => verbs::CqMode::Collapsed,
            (_, 1) => verbs::CqMode::OverrunIgnore,
            _ => verbs::CqMode::OverrunDetect,
        };
        let soft = self.soft().map_err(|_| Refused {
            status: status::INT_ERR,
            syndrome: 0,
        })?;
        let mut o = self.objs.lock();
        if self.uar_page(&o, uar_page).is_none() {
            return refuse(status::BAD_PARAM, syndrome::UAR);
        }
        // mlx5_ib makes every DEVX CQ umem-backed (cq_umem_valid, dbr_umem_valid = 1)
        let ring_umem = cmd::get(input, ci::CQ_UMEM_ID) as u32;
        let dbr_umem = f(cqc::DBR_UMEM_ID) as u32;
        let ring = o.umem(ring_umem)?.slice(
            cmd::get(input, ci::CQ_UMEM_OFFSET),
            ncqe as usize * size.bytes(),
        )?;
        // the doorbell record may be GPU memory too (read with a copy when the mode needs it)
        let dbrec = o.umem(dbr_umem)?.slice(f(cqc::DBR_ADDR), 8)?;
        let cq = soft
            .create_cq(softnic::CqConfig {
                ncqe,
                mode,
                init: verbs::CqInit::Untouched,
                ring: Some(ring),
                dbrec: Some(dbrec),
                cqe_size: size,
            })
            .map_err(|_| Refused {
                status: status::BAD_PARAM,
                syndrome: syndrome::UMEM_RANGE,
            })?;
        o.umem(ring_umem)?.users += 1;
        o.umem(dbr_umem)?.users += 1;
        let mut out_box = out(16);
        cmd::set(&mut out_box, cmd::obj::CQN, cq.cqn().into());
        let mut ctx = input[CQC_AT as usize..].to_vec();
        ctx.resize(64, 0);
        Ok((
            DevxCq {
                soft: cq,
                umems: vec![ring_umem, dbr_umem],
                uar_page,
                cqc: ctx,
            },
            out_box,
        ))
    }
}

impl crate::context::Objects {
    /// The umem with id `id` (BAD_PARAM when there is none).
    pub(super) fn umem(&mut self, id: u32) -> Result<&mut super::Umem, Refused> {
        self.umems.values_mut().find(|u| u.id == id).ok_or(Refused {
            status: status::BAD_PARAM,
            syndrome: syndrome::UMEM,
        })
    }
}
