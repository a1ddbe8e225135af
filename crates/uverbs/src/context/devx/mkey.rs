//! DEVX mkeys: CREATE_MKEY of an indirect (KLM) mkey, as `mlx5dv_create_mkey` sends it —
//! created free, given its layout later by UMR WQEs on a QP — and its destruction. Direct
//! mkeys (MTT or PA translation, umem-backed) and signature or crypto mkeys (a BSF) are
//! refused with a line naming what the emulated device lacks.

use super::{lacks, out, refuse, syndrome, Refused};
use crate::context::Context;
use prm::cmd::{self, create_mkey_in as mi, create_mkey_out, mkc, mkc_access_mode, status, MKC_AT};

/// An mkey made with CREATE_MKEY.
pub(in crate::context) struct DevxMkey {
    /// Its key (index << 8 | `mkey_7_0`).
    pub key: u32,
    /// The handle of its PD.
    pub pd: u32,
}

/// CREATE_MKEY's in-mailbox up to the end of the mkey context.
const CREATE_MKEY_IN: usize = MKC_AT as usize + 64;

impl Context {
    /// CREATE_MKEY. Returns the mkey and the out-mailbox (its index).
    pub(super) fn devx_create_mkey(&self, input: &[u8]) -> Result<(DevxMkey, Vec<u8>), Refused> {
        if input.len() < CREATE_MKEY_IN {
            return refuse(status::BAD_INP_LEN, syndrome::INPUT_LENGTH);
        }
        let f = |field: cmd::Field| cmd::get(input, field.at(MKC_AT));
        let mode = f(mkc::ACCESS_MODE_4_2) << 2 | f(mkc::ACCESS_MODE_1_0);
        if mode != mkc_access_mode::KLMS {
            return lacks(&format!(
                "mkeys of access mode {mode} (only indirect KLM mkeys are created through DEVX)"
            ));
        }
        if f(mkc::BSF_EN) != 0 {
            return lacks("signature and crypto mkeys (bsf_en)");
        }
        if cmd::get(input, mi::MKEY_UMEM_VALID) != 0 {
            return refuse(status::BAD_PARAM, syndrome::UMEM);
        }
        if f(mkc::FREE) == 0 || f(mkc::UMR_EN) == 0 {
            // without a translation in the mailbox, only a UMR can give an indirect mkey a
            // layout: one created valid, or not UMR-enabled, could never be used
            return lacks("an indirect mkey created valid or without umr_en");
        }
        let entries = f(mkc::TRANSLATIONS_OCTWORD_SIZE) as u32;
        if entries == 0 {
            return refuse(status::BAD_PARAM, syndrome::ATTRIBUTE);
        }
        let bit = |field, a: verbs::Access| if f(field) != 0 { a.0 } else { 0 };
        let access = verbs::Access(
            bit(mkc::LW, verbs::Access::LOCAL_WRITE)
                | bit(mkc::RR, verbs::Access::REMOTE_READ)
                | bit(mkc::RW, verbs::Access::REMOTE_WRITE)
                | bit(mkc::A, verbs::Access::REMOTE_ATOMIC),
        );
        let soft = self.soft().map_err(|_| Refused {
            status: status::INT_ERR,
            syndrome: 0,
        })?;
        let o = self.objs.lock();
        let (pd_handle, pd) = super::pd_by_number(&o, f(mkc::PD) as u32)?;
        let key = soft.create_indirect(softnic::IndirectConfig {
            pd,
            variant: f(mkc::MKEY_7_0) as u8,
            qpn: f(mkc::QPN) as u32,
            max_entries: entries,
            remote_invalidate: f(mkc::EN_RINVAL) != 0,
            access,
            start: f(mkc::START_ADDR),
        });
        let mut out_box = out(16);
        cmd::set(&mut out_box, create_mkey_out::MKEY_INDEX, (key >> 8).into());
        Ok((DevxMkey { key, pd: pd_handle }, out_box))
    }
}
