//! DEVX DC targets: CREATE_DCT (a target on a verbs SRQ, with a CQ and PD of the context,
//! created active as the firmware creates it: it takes requests at once), QUERY_DCT,
//! DRAIN_DCT and destroy. The soft NIC's DC target does the work
//! (docs/softnic.md, "DC initiators and targets").

use super::{lacks, out, refuse, syndrome, Fw, Refused};
use crate::context::Context;
use prm::cmd::{self, dctc, obj, status, Field, CREATE_DCT_IN, DCTC_AT, QUERY_DCT_OUT};
use std::sync::Arc;

/// Bytes of the DC target context.
const DCTC_LEN: usize = 112;
/// `dctc.state` of a drained target.
const DRAINED: u64 = 2;

/// A DC target made with CREATE_DCT.
pub(in crate::context) struct DevxDct {
    pub soft: Arc<softnic::Qp>,
    pub cqn: u32,
    pub pd: u32,
    pub srqn: u32,
    /// The context as created (QUERY_DCT answers it, with the state).
    dctc: Vec<u8>,
    drained: bool,
}

impl DevxDct {
    /// QUERY_DCT: the context, active or drained.
    pub fn query(&self) -> Fw {
        let mut o = out(QUERY_DCT_OUT);
        o[DCTC_AT as usize..DCTC_AT as usize + DCTC_LEN].copy_from_slice(&self.dctc);
        let state = if self.drained { DRAINED } else { 0 };
        cmd::set(&mut o, dctc::STATE.at(DCTC_AT), state);
        Ok(o)
    }

    /// DRAIN_DCT: the target takes no request any more (what it answered stays answered).
    /// The DCT_DRAINED event is not raised: DEVX event channels are not served.
    pub fn drain(&mut self) -> Fw {
        let _ = self.soft.modify(verbs::Modify::Err);
        self.drained = true;
        Ok(out(16))
    }
}

impl Context {
    /// CREATE_DCT. Returns the target and the out-mailbox (its number).
    pub(super) fn devx_create_dct(&self, input: &[u8]) -> Result<(DevxDct, Vec<u8>), Refused> {
        if input.len() < CREATE_DCT_IN {
            return refuse(status::BAD_INP_LEN, syndrome::INPUT_LENGTH);
        }
        let f = |field: Field| cmd::get(input, field.at(DCTC_AT));
        if f(dctc::CS_RES) != 0 {
            return lacks("scatter to CQE on a DC target (cs_res)");
        }
        let mtu = f(dctc::MTU) as u32;
        if !(1..=5).contains(&mtu) || f(dctc::MIN_RNR_NAK) > 31 {
            return refuse(status::BAD_PARAM, syndrome::ATTRIBUTE);
        }
        if f(dctc::PORT) > 1 || f(dctc::PKEY_INDEX) != 0 || f(dctc::MY_ADDR_INDEX) != 0 {
            return refuse(status::BAD_PARAM, syndrome::PORT);
        }
        let soft = self.soft().map_err(|_| Refused {
            status: status::INT_ERR,
            syndrome: 0,
        })?;
        let o = self.objs.lock();
        let (pd_handle, pd) = super::pd_by_number(&o, f(dctc::PD) as u32)?;
        let cqn = f(dctc::CQN) as u32;
        let cq = o.cq_by_number(cqn).ok_or(Refused {
            status: status::BAD_PARAM,
            syndrome: syndrome::CQN,
        })?;
        let srqn = f(dctc::SRQN_XRQN) as u32;
        let srq = o
            .srqs
            .values()
            .find(|s| s.soft.srqn() == srqn)
            .map(|s| s.soft.clone())
            .ok_or(Refused {
                status: status::BAD_PARAM,
                syndrome: syndrome::SRQN,
            })?;
        drop(o);
        let dct = soft
            .create_dct(softnic::DctConfig {
                pd,
                cq,
                srq,
                key: f(dctc::DC_ACCESS_KEY),
                user_index: Some(f(dctc::USER_INDEX) as u32),
            })
            .map_err(|_| Refused {
                status: status::BAD_PARAM,
                syndrome: syndrome::ATTRIBUTE,
            })?;
        let mut rights = verbs::Access::NONE;
        for (bit, right) in [
            (dctc::RWE, verbs::Access::REMOTE_WRITE),
            (dctc::RRE, verbs::Access::REMOTE_READ),
            (dctc::RAE, verbs::Access::REMOTE_ATOMIC),
        ] {
            if f(bit) == 1 {
                rights = rights | right;
            }
        }
        let up = dct
            .modify(verbs::Modify::Init { access: rights })
            .and_then(|()| {
                dct.modify(verbs::Modify::RtrDc {
                    mtu: 128 << mtu,
                    min_rnr_timer: f(dctc::MIN_RNR_NAK) as u8,
                })
            });
        if up.is_err() {
            soft.destroy_qp(&dct);
            return refuse(status::BAD_PARAM, syndrome::ATTRIBUTE);
        }
        let mut out_box = out(16);
        cmd::set(&mut out_box, obj::CQN, dct.qpn().into());
        let at = DCTC_AT as usize;
        Ok((
            DevxDct {
                soft: dct,
                cqn,
                pd: pd_handle,
                srqn,
                dctc: input[at..at + DCTC_LEN].to_vec(),
                drained: false,
            },
            out_box,
        ))
    }
}
