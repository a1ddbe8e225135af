//! DC on a ConnectX: a DC initiator made by the provider (`mlx5dv_create_qp` with
//! `MLX5DV_QP_INIT_ATTR_MASK_DC`, DCI) on host rings, or with DEVX (`st` DCI, [`super::devx`])
//! on rings the host API placed, moved to RTS with mlx5_ib's DCI attributes; a DC target (DCT)
//! on an SRQ of its own: the provider's, moved to RTR (where the kernel creates it and names its
//! number), or CREATE_DCT through DEVX when its CQ is a DEVX one. Run on the emulated device;
//! not run on hardware.

use super::device::{errno, ibv_access, mtu_enum, verbs_err};
use super::objects::{Cq, Pd, Qp};
use crate::Error;
use rdma_core_sys as sys;
use std::sync::Arc;

/// A DC target and the SRQ it stands on, destroyed in that order when dropped.
pub(crate) struct Dct {
    pd: Arc<Pd>,
    _cq: Arc<Cq>,
    /// The provider's DCT, or the DEVX object (taken in drop, before the SRQ goes).
    owner: Option<DctOwner>,
    srq: *mut sys::ibv_srq,
    pub dctn: u32,
}

enum DctOwner {
    Verbs(*mut sys::ibv_qp),
    Devx(super::devx::Obj),
}

// SAFETY: the provider's DCT and SRQ, owned by this value until drop; verbs calls on them are
// thread-safe.
unsafe impl Send for Dct {}
// SAFETY: as above.
unsafe impl Sync for Dct {}

impl Drop for Dct {
    fn drop(&mut self) {
        let v = self.pd.dev.libs.verbs;
        match self.owner.take() {
            Some(DctOwner::Verbs(qp)) => {
                // SAFETY: created in `create_dct`, destroyed once, the QP before its SRQ.
                let rc = unsafe { (v.ibv_destroy_qp)(qp) };
                if rc != 0 {
                    tracing::warn!(errno = rc, "ibv_destroy_qp (DCT) failed");
                }
            }
            // the DEVX object goes here, before the SRQ
            Some(DctOwner::Devx(obj)) => drop(obj),
            None => {}
        }
        if let Some(destroy) = v.ibv_destroy_srq {
            // SAFETY: as above; no QP uses it any more.
            let rc = unsafe { destroy(self.srq) };
            if rc != 0 {
                tracing::warn!(errno = rc, "ibv_destroy_srq failed");
            }
        }
    }
}

impl Dct {
    /// Its state as the device reports it (a DCT answers in RTR only: ERR otherwise; one made
    /// with CREATE_DCT is active, RTR, while it exists).
    pub(crate) fn state(&self) -> sys::ibv_qp_state {
        let Some(DctOwner::Verbs(qp)) = self.owner else {
            return sys::IBV_QPS_RTR;
        };
        // SAFETY: zeroed attrs are valid plain data.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut ia: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live DCT, writable attrs.
        let rc = unsafe {
            (self.pd.dev.libs.verbs.ibv_query_qp)(qp, &mut a, sys::IBV_QP_STATE as i32, &mut ia)
        };
        if rc == 0 {
            a.qp_state
        } else {
            sys::IBV_QPS_ERR
        }
    }
}

/// An `ibv_qp_init_attr_ex` for a DC QP (`IBV_QPT_DRIVER`) on `pd`, completing on `cq`.
fn dc_attr(pd: &Pd, cq: *mut sys::ibv_cq) -> sys::ibv_qp_init_attr_ex {
    // SAFETY: zeroed attrs are valid plain data.
    let mut a: sys::ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
    a.send_cq = cq;
    a.recv_cq = cq;
    a.qp_type = sys::IBV_QPT_DRIVER;
    a.comp_mask = sys::IBV_QP_INIT_ATTR_PD;
    a.pd = pd.pd;
    a
}

impl Pd {
    /// A DC initiator in RESET on `cq` (a provider CQ), with room for `max_send_wr` WQEs.
    pub(crate) fn create_dci(
        self: &Arc<Self>,
        cq: &Arc<Cq>,
        max_send_wr: u32,
        max_inline: u32,
    ) -> Result<Arc<Qp>, Error> {
        let c = cq.verbs_cq().ok_or_else(|| {
            Error::Unsupported("a DC initiator on a DEVX CQ (made with DEVX; not built yet)".into())
        })?;
        let mut a = dc_attr(self, c);
        a.cap.max_send_wr = max_send_wr.max(1);
        a.cap.max_send_sge = 1;
        a.cap.max_inline_data = max_inline;
        // SAFETY: zeroed attrs are valid plain data.
        let mut dv: sys::mlx5dv_qp_init_attr = unsafe { std::mem::zeroed() };
        dv.comp_mask = sys::MLX5DV_QP_INIT_ATTR_MASK_DC as u64;
        dv.dc_init_attr.dc_type = sys::MLX5DV_DCTYPE_DCI;
        // SAFETY: live context, CQ and PD; attrs filled above.
        let qp = unsafe { (self.dev.libs.dv.mlx5dv_create_qp)(self.dev.ctx, &mut a, &mut dv) };
        if qp.is_null() {
            return Err(verbs_err(
                "mlx5dv_create_qp",
                errno(),
                format!("DC initiator, {max_send_wr} send WRs"),
            ));
        }
        self.adopt(qp, cq, cq, a.cap.max_inline_data)
    }

    /// A DC target on `cq` (a provider CQ) and an SRQ of its own, taking requests that present
    /// `key` with the remote rights `access`, moved to RTR at path MTU `mtu`.
    pub(crate) fn create_dct(
        self: &Arc<Self>,
        cq: &Arc<Cq>,
        key: u64,
        access: verbs::Access,
        (mtu, min_rnr_timer): (u32, u8),
    ) -> Result<Dct, Error> {
        let v = self.dev.libs.verbs;
        let create_srq = v
            .ibv_create_srq
            .ok_or_else(|| Error::Unsupported("libibverbs without ibv_create_srq".into()))?;
        // SAFETY: zeroed attrs are valid plain data.
        let mut sa: sys::ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        sa.attr.max_wr = 1;
        sa.attr.max_sge = 1;
        // SAFETY: live PD, attrs filled above.
        let srq = unsafe { create_srq(self.pd, &mut sa) };
        if srq.is_null() {
            return Err(verbs_err(
                "ibv_create_srq",
                errno(),
                "for a DC target".into(),
            ));
        }
        let Some(c) = cq.verbs_cq() else {
            return self.devx_dct(cq, srq, key, access, (mtu, min_rnr_timer));
        };
        let mut a = dc_attr(self, c);
        a.srq = srq;
        // SAFETY: zeroed attrs are valid plain data.
        let mut dv: sys::mlx5dv_qp_init_attr = unsafe { std::mem::zeroed() };
        dv.comp_mask = sys::MLX5DV_QP_INIT_ATTR_MASK_DC as u64;
        dv.dc_init_attr.dc_type = sys::MLX5DV_DCTYPE_DCT;
        dv.dc_init_attr.__bindgen_anon_1.dct_access_key = key;
        // SAFETY: live context, CQ, SRQ and PD; attrs filled above.
        let qp = unsafe { (self.dev.libs.dv.mlx5dv_create_qp)(self.dev.ctx, &mut a, &mut dv) };
        if qp.is_null() {
            let e = verbs_err("mlx5dv_create_qp", errno(), "DC target".into());
            if let Some(destroy) = v.ibv_destroy_srq {
                // SAFETY: the SRQ made above, used by nothing.
                unsafe { destroy(srq) };
            }
            return Err(e);
        }
        let mut dct = Dct {
            pd: self.clone(),
            _cq: cq.clone(),
            owner: Some(DctOwner::Verbs(qp)),
            srq,
            dctn: 0,
        };
        dct_up(&dct, qp, access, mtu, min_rnr_timer)?;
        // SAFETY: a live DCT: its number is known once it is in RTR.
        dct.dctn = unsafe { (*qp).qp_num };
        Ok(dct)
    }
}

impl Pd {
    /// A DC target made with CREATE_DCT on DEVX CQ `cq` and the provider's SRQ `srq` (taken:
    /// destroyed with the target, or here on failure).
    fn devx_dct(
        self: &Arc<Self>,
        cq: &Arc<Cq>,
        srq: *mut sys::ibv_srq,
        key: u64,
        access: verbs::Access,
        mtu_rnr: (u32, u8),
    ) -> Result<Dct, Error> {
        let mut dct = Dct {
            pd: self.clone(),
            _cq: cq.clone(),
            owner: None,
            srq,
            dctn: 0,
        };
        // SAFETY: zeroed out structs are valid plain data.
        let mut out: sys::mlx5dv_srq = unsafe { std::mem::zeroed() };
        // libmlx5 fills in the SRQ number only when asked
        out.comp_mask = sys::MLX5DV_SRQ_MASK_SRQN as u64;
        // SAFETY: as above.
        let mut obj: sys::mlx5dv_obj = unsafe { std::mem::zeroed() };
        obj.srq.in_ = srq;
        obj.srq.out = &mut out;
        // SAFETY: a live SRQ of this provider and a writable out struct.
        let rc =
            unsafe { (self.dev.libs.dv.mlx5dv_init_obj)(&mut obj, sys::MLX5DV_OBJ_SRQ as u64) };
        if rc != 0 {
            return Err(verbs_err(
                "mlx5dv_init_obj(SRQ)",
                rc,
                "for a DC target".into(),
            ));
        }
        let (o, dctn) = self.create_devx_dct((cq.cqn, out.srqn), key, access, mtu_rnr)?;
        dct.owner = Some(DctOwner::Devx(o));
        dct.dctn = dctn;
        Ok(dct)
    }
}

/// A DCT to INIT (rights, port) and RTR (MTU, RNR timer, the source GID's address vector),
/// with exactly the attributes mlx5_ib takes.
fn dct_up(
    d: &Dct,
    qp: *mut sys::ibv_qp,
    access: verbs::Access,
    mtu: u32,
    min_rnr_timer: u8,
) -> Result<(), Error> {
    let dev = &d.pd.dev;
    let modify = |a: &mut sys::ibv_qp_attr, mask: u32, what: &str| {
        // SAFETY: live DCT, attr filled for `mask`.
        let rc = unsafe { (dev.libs.verbs.ibv_modify_qp)(qp, a, mask as i32) };
        match rc {
            0 => Ok(()),
            e => Err(verbs_err(
                "ibv_modify_qp",
                e,
                format!("DC target to {what}"),
            )),
        }
    };
    // SAFETY: zeroed attr is valid plain data.
    let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = sys::IBV_QPS_INIT;
    a.port_num = dev.port;
    a.qp_access_flags = ibv_access(access);
    modify(
        &mut a,
        sys::IBV_QP_STATE | sys::IBV_QP_PKEY_INDEX | sys::IBV_QP_PORT | sys::IBV_QP_ACCESS_FLAGS,
        "INIT",
    )?;
    // SAFETY: as above.
    let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = sys::IBV_QPS_RTR;
    a.path_mtu = mtu_enum(mtu.min(dev.mtu));
    a.min_rnr_timer = min_rnr_timer;
    a.ah_attr.is_global = 1;
    a.ah_attr.port_num = dev.port;
    a.ah_attr.grh.dgid.raw = dev.gid.gid;
    a.ah_attr.grh.sgid_index = dev.gid.index;
    a.ah_attr.grh.hop_limit = 64;
    modify(
        &mut a,
        sys::IBV_QP_STATE | sys::IBV_QP_AV | sys::IBV_QP_PATH_MTU | sys::IBV_QP_MIN_RNR_TIMER,
        "RTR",
    )
}

impl Qp {
    /// A DC initiator to RTS: INIT (P_Key index, port), RTR (path MTU), RTS (timeout, retry
    /// counts, first PSN, outstanding reads), mlx5_ib's DCI attributes.
    pub(crate) fn ready_dc(
        &self,
        mtu: u32,
        sq_psn: u32,
        o: &super::super::ConnectOptions,
    ) -> Result<(), Error> {
        if let Some(obj) = self.devx_obj() {
            return self.pd().connect_devx_dc(obj, self.qpn, mtu, sq_psn, o);
        }
        let dev = &self.pd().dev;
        // SAFETY: zeroed attr is valid plain data.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_INIT;
        a.port_num = dev.port;
        self.modify(
            &mut a,
            sys::IBV_QP_STATE | sys::IBV_QP_PKEY_INDEX | sys::IBV_QP_PORT,
            "INIT",
        )?;
        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::IBV_QPS_RTR;
        a.path_mtu = mtu_enum(mtu.min(dev.mtu));
        self.modify(&mut a, sys::IBV_QP_STATE | sys::IBV_QP_PATH_MTU, "RTR")?;
        self.to_rts(sq_psn, o)
    }
}
