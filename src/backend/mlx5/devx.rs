//! DEVX on an rdma-core mlx5 device: CQs and RC QPs made with PRM commands
//! (`mlx5dv_devx_obj_create` of CREATE_CQ / CREATE_QP) on rings the host API placed itself —
//! in GPU memory for `RingPlacement::Gpu`, as GPUNetIO, NVSHMEM IBGDA and NCCL GIN do — and
//! registered as umems (a dma-buf of the GPU pages first, else the GPU address as
//! nvidia-peermem resolves it); doorbell records in host memory; doorbells on a UAR page of the
//! context (non-cached, or BlueFlame for a QP that asks for it); the QP transitions through
//! `mlx5dv_devx_obj_modify`. The mailboxes are laid out with `prm::cmd`.
//!
//! Not run on ConnectX hardware: run through the real libmlx5 on the emulated device
//! (`gpuverbs emu`), whose DEVX answers as mlx5_ib and the firmware do.

use super::device::{entry, errno, verbs_err, Device, Pd, Remote, Uar};
use crate::Error;
use prm::cmd::{self, ads, cqc, create_cq_in, create_qp_in, modify_qp_in, qpc, Field};
use prm::cmd::{op, ADS_AT, CQC_AT, QPC_AT};
use rdma_core_sys as sys;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use verbs::{CqMode, DmaBuf};

/// `IBV_ACCESS_LOCAL_WRITE`: what a ring's or doorbell record's umem needs (the device writes
/// CQEs, reads WQEs).
const UMEM_ACCESS: u32 = 1;

/// Memory registered for DEVX objects.
struct Umem {
    dev: Arc<Device>,
    umem: *mut sys::mlx5dv_devx_umem,
    id: u32,
}

impl Drop for Umem {
    fn drop(&mut self) {
        // SAFETY: registered on this device, deregistered once, after the objects on it.
        let rc = unsafe { (self.dev.libs.dv.mlx5dv_devx_umem_dereg)(self.umem) };
        if rc != 0 {
            tracing::warn!(errno = rc, id = self.id, "mlx5dv_devx_umem_dereg failed");
        }
    }
}

/// A DEVX object (CQ or QP) and the umems it is built on (dropped after it).
pub(crate) struct Obj {
    dev: Arc<Device>,
    obj: *mut sys::mlx5dv_devx_obj,
    _umems: Vec<Umem>,
    /// A UAR page of its own (a BlueFlame QP's).
    own_uar: Option<Uar>,
}

// SAFETY: the object and umem handles are only passed to libmlx5's DEVX calls, which are
// thread-safe; each is destroyed once, in drop.
unsafe impl Send for Obj {}
// SAFETY: as above.
unsafe impl Sync for Obj {}

impl Drop for Obj {
    fn drop(&mut self) {
        if let Some(destroy) = self.dev.libs.dv.mlx5dv_devx_obj_destroy {
            // SAFETY: created on this device, destroyed once, before its umems.
            let rc = unsafe { destroy(self.obj) };
            if rc != 0 {
                tracing::warn!(errno = rc, "mlx5dv_devx_obj_destroy failed");
            }
        }
        if let Some(u) = &self.own_uar {
            u.free(&self.dev);
        }
    }
}

/// A PRM command the device refused, or a DEVX call that failed.
fn devx_err(call: &'static str, rc: i32, out: &[u8], what: String) -> Error {
    let status = cmd::get(out, cmd::cmd_out::STATUS);
    let syndrome = cmd::get(out, cmd::cmd_out::SYNDROME);
    let detail = if status != 0 {
        format!("{what}: PRM status {status:#x}, syndrome {syndrome:#x}")
    } else {
        what
    };
    verbs_err(call, rc, detail)
}

impl Device {
    /// Registers `len` bytes at `addr` as a umem: host memory, or GPU memory (`dmabuf`: a
    /// dma-buf of its pages and the offset of `addr` in it, tried first; else the address,
    /// which nvidia-peermem resolves). An error names every attempt.
    fn umem(
        self: &Arc<Self>,
        addr: u64,
        len: usize,
        dmabuf: Option<Result<(OwnedFd, u64), String>>,
    ) -> Result<Umem, Error> {
        let mut tried = String::new();
        if let Some(d) = dmabuf {
            match (d, self.libs.dv.mlx5dv_devx_umem_reg_ex) {
                (Ok((fd, offset)), Some(reg)) => {
                    let mut umem_in = sys::mlx5dv_devx_umem_in {
                        addr: offset as *mut _,
                        size: len,
                        access: UMEM_ACCESS,
                        pgsz_bitmap: 1 << 12,
                        comp_mask: sys::MLX5DV_UMEM_MASK_DMABUF as u64,
                        dmabuf_fd: fd.as_raw_fd(),
                    };
                    // SAFETY: live context; the fd is a dma-buf of GPU pages covering the
                    // range (the kernel takes its own reference; ours closes after).
                    let u = unsafe { reg(self.ctx, &mut umem_in) };
                    if !u.is_null() {
                        // SAFETY: a live umem libmlx5 just returned.
                        let id = unsafe { (*u).umem_id };
                        return Ok(Umem {
                            dev: self.clone(),
                            umem: u,
                            id,
                        });
                    }
                    tried = format!(
                        " after the dma-buf ({})",
                        std::io::Error::from_raw_os_error(errno())
                    );
                }
                (Ok(_), None) => tried = " (no mlx5dv_devx_umem_reg_ex for a dma-buf)".into(),
                (Err(e), _) => tried = format!(" (no dma-buf: {e})"),
            }
        }
        // SAFETY: live context; the kernel pins the range (host memory, or GPU memory through
        // nvidia-peermem) or refuses it; user space does not touch it here.
        let u = unsafe {
            (self.libs.dv.mlx5dv_devx_umem_reg)(self.ctx, addr as *mut _, len, UMEM_ACCESS)
        };
        if u.is_null() {
            return Err(verbs_err(
                "mlx5dv_devx_umem_reg",
                errno(),
                format!("{len} bytes at {addr:#x}{tried}"),
            ));
        }
        // SAFETY: a live umem libmlx5 just returned.
        let id = unsafe { (*u).umem_id };
        Ok(Umem {
            dev: self.clone(),
            umem: u,
            id,
        })
    }

    /// Runs a creation command; returns the object and its out-mailbox.
    fn create(
        self: &Arc<Self>,
        input: &[u8],
        umems: Vec<Umem>,
        own_uar: Option<Uar>,
        what: String,
    ) -> Result<(Obj, Vec<u8>), Error> {
        let create = entry(
            self.libs.dv.mlx5dv_devx_obj_create,
            "mlx5dv_devx_obj_create",
        )?;
        let mut out = vec![0u8; 16];
        // SAFETY: live context; in and out are buffers of the lengths given.
        let obj = unsafe {
            create(
                self.ctx,
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        if obj.is_null() {
            if let Some(u) = &own_uar {
                u.free(self);
            }
            return Err(devx_err("mlx5dv_devx_obj_create", errno(), &out, what));
        }
        Ok((
            Obj {
                dev: self.clone(),
                obj,
                _umems: umems,
                own_uar,
            },
            out,
        ))
    }

    /// A CQ of `ncqe` 64-byte CQEs on `ring` (host or GPU memory, already filled as the
    /// consumer wants it), in `mode`, its doorbell record in `dbrec` (8 bytes of host memory).
    pub(crate) fn create_devx_cq(
        self: &Arc<Self>,
        ncqe: u32,
        mode: CqMode,
        ring: &DmaBuf,
        dmabuf: Option<Result<(OwnedFd, u64), String>>,
        dbrec: &DmaBuf,
    ) -> Result<(Obj, u32), Error> {
        let (eqn, uar_page, _) = self.devx()?;
        let ring_umem = self.umem(ring.addr(), ring.len(), dmabuf)?;
        let dbr_umem = self.umem(dbrec.addr(), dbrec.len(), None)?;
        let mut m = vec![0u8; cmd::CREATE_CQ_IN];
        let c = |f: Field| f.at(CQC_AT);
        for (f, v) in [
            (cmd::cmd_in::OPCODE, u64::from(op::CREATE_CQ)),
            (create_cq_in::CQ_UMEM_VALID, 1),
            (create_cq_in::CQ_UMEM_ID, ring_umem.id.into()),
            (c(cqc::CC), u64::from(mode == CqMode::Collapsed)),
            (c(cqc::OI), u64::from(mode == CqMode::OverrunIgnore)),
            (c(cqc::LOG_CQ_SIZE), ncqe.trailing_zeros().into()),
            (c(cqc::UAR_PAGE), uar_page.into()),
            (c(cqc::C_EQN), eqn.into()),
            (c(cqc::DBR_UMEM_VALID), 1),
            (c(cqc::DBR_UMEM_ID), dbr_umem.id.into()),
        ] {
            cmd::set(&mut m, f, v);
        }
        let (obj, out) = self.create(
            &m,
            vec![ring_umem, dbr_umem],
            None,
            format!("CREATE_CQ of {ncqe} CQEs ({mode:?})"),
        )?;
        let cqn = cmd::get(&out, cmd::obj::CQN) as u32;
        Ok((obj, cqn))
    }
}

/// The rings of a DEVX QP: the RQ then the SQ in one buffer, as the device reads them.
pub(crate) struct QpRings<'a> {
    pub wq: &'a DmaBuf,
    pub dmabuf: Option<Result<(OwnedFd, u64), String>>,
    pub sq_blocks: u32,
    pub rq_wqes: u32,
    pub rq_stride: u32,
    pub dbrec: &'a DmaBuf,
    /// A DC initiator (`st` DCI) rather than an RC QP.
    pub dci: bool,
    /// Cross-channel master (`cd_master`): may post WAIT on other QPs' CQs.
    pub cd_master: bool,
    /// No send doorbell record (`send_dbr_mode` 1, NO_DBR_EXT): the QP is rung at its page's
    /// DBR-less register (`prm::doorbell::DBR_LESS_OFFSET`).
    pub no_dbr: bool,
}

impl Pd {
    /// The PD number the device knows it by (`mlx5dv_init_obj`).
    fn pdn(&self) -> Result<u32, Error> {
        // SAFETY: zeroed out structs are valid plain data.
        let mut out: sys::mlx5dv_pd = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut obj: sys::mlx5dv_obj = unsafe { std::mem::zeroed() };
        obj.pd.in_ = self.pd;
        obj.pd.out = &mut out;
        // SAFETY: a live PD of this provider and a writable out struct.
        let rc = unsafe { (self.dev.libs.dv.mlx5dv_init_obj)(&mut obj, sys::MLX5DV_OBJ_PD as u64) };
        if rc != 0 {
            return Err(verbs_err("mlx5dv_init_obj(PD)", rc, String::new()));
        }
        Ok(out.pdn)
    }

    /// The destination MAC for `gid` (RoCE): from an address handle the provider resolves.
    fn rmac(&self, gid: [u8; 16]) -> Result<[u8; 6], Error> {
        let dev = &self.dev;
        // SAFETY: zeroed attrs are valid plain data.
        let mut a: sys::ibv_ah_attr = unsafe { std::mem::zeroed() };
        a.is_global = 1;
        a.port_num = dev.port;
        a.grh.dgid.raw = gid;
        a.grh.sgid_index = dev.gid.index;
        a.grh.hop_limit = 64;
        let create = entry(dev.libs.verbs.ibv_create_ah, "ibv_create_ah")?;
        let destroy = entry(dev.libs.verbs.ibv_destroy_ah, "ibv_destroy_ah")?;
        // SAFETY: live PD, filled attrs.
        let ah = unsafe { create(self.pd, &mut a) };
        if ah.is_null() {
            return Err(verbs_err("ibv_create_ah", errno(), "the peer's MAC".into()));
        }
        // SAFETY: zeroed out structs are valid plain data.
        let mut out: sys::mlx5dv_ah = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut obj: sys::mlx5dv_obj = unsafe { std::mem::zeroed() };
        obj.ah.in_ = ah;
        obj.ah.out = &mut out;
        // SAFETY: a live AH of this provider and a writable out struct.
        let rc = unsafe { (dev.libs.dv.mlx5dv_init_obj)(&mut obj, sys::MLX5DV_OBJ_AH as u64) };
        // SAFETY: the av lives with the AH, read before it is destroyed.
        let mac = (rc == 0 && !out.av.is_null()).then(|| unsafe { (*out.av).rmac });
        // SAFETY: created above, destroyed once.
        unsafe { destroy(ah) };
        mac.ok_or_else(|| verbs_err("mlx5dv_init_obj(AH)", rc, "the peer's MAC".into()))
    }

    /// An RC QP in RESET on `r` reporting to CQs `scqn` / `rcqn`, doorbells on the device's
    /// non-cached UAR page or (`bf`) a BlueFlame page of its own. Returns the object, its
    /// number and its doorbell register.
    pub(crate) fn devx_qp_object(
        &self,
        scqn: u32,
        rcqn: u32,
        r: QpRings<'_>,
        bf: bool,
    ) -> Result<(Obj, u32, *mut u8), Error> {
        let dev = &self.dev;
        let (_, nc_page, nc_reg) = dev.devx()?;
        let pdn = self.pdn()?;
        let own_uar = if bf {
            Some(Uar::alloc(dev, true)?)
        } else {
            None
        };
        let (uar_page, reg) = match &own_uar {
            Some(u) => (u.page_id, u.reg),
            None => (nc_page, nc_reg),
        };
        // no-DBR: the DBR-less register of the same page (`reg` is page + BF_OFFSET)
        let reg = match r.no_dbr {
            true => reg.wrapping_sub(prm::doorbell::BF_OFFSET - prm::doorbell::DBR_LESS_OFFSET),
            false => reg,
        };
        let made = (|| {
            let wq_umem = dev.umem(r.wq.addr(), r.wq.len(), r.dmabuf)?;
            let dbr_umem = dev.umem(r.dbrec.addr(), r.dbrec.len(), None)?;
            let mut m = vec![0u8; cmd::QP_IN];
            let q = |f: Field| f.at(QPC_AT);
            let log = |n: u32| u64::from(n.max(1).trailing_zeros());
            for (f, v) in [
                (cmd::cmd_in::OPCODE, u64::from(op::CREATE_QP)),
                (
                    q(qpc::ST),
                    u64::from(if r.dci { cmd::st::DCI } else { cmd::st::RC }),
                ),
                (q(qpc::PM_STATE), 3), // migrated
                (q(qpc::PD), pdn.into()),
                (q(qpc::LOG_SQ_SIZE), log(r.sq_blocks)),
                (
                    q(qpc::RQ_TYPE),
                    u64::from(if r.rq_wqes == 0 {
                        cmd::rq_type::ZERO_SIZE
                    } else {
                        cmd::rq_type::REGULAR
                    }),
                ),
                (q(qpc::LOG_RQ_SIZE), log(r.rq_wqes)),
                (q(qpc::LOG_RQ_STRIDE), log(r.rq_stride.max(16) / 16)),
                (q(qpc::UAR_PAGE), uar_page.into()),
                (q(qpc::CQN_SND), scqn.into()),
                (q(qpc::CQN_RCV), rcqn.into()),
                (q(qpc::CD_MASTER), u64::from(r.cd_master)),
                (q(cmd::qpc_ext::SEND_DBR_MODE), u64::from(r.no_dbr)),
                (q(qpc::DBR_UMEM_VALID), 1),
                (q(qpc::DBR_UMEM_ID), dbr_umem.id.into()),
                (create_qp_in::WQ_UMEM_VALID, 1),
                (create_qp_in::WQ_UMEM_ID, wq_umem.id.into()),
            ] {
                cmd::set(&mut m, f, v);
            }
            Ok::<_, Error>((m, vec![wq_umem, dbr_umem]))
        })();
        let (m, umems) = match made {
            Ok(x) => x,
            Err(e) => {
                if let Some(u) = &own_uar {
                    u.free(dev);
                }
                return Err(e);
            }
        };
        let what = format!(
            "CREATE_QP {}{}, SQ {} blocks, RQ {} x {} B",
            if r.dci { "DCI" } else { "RC" },
            if r.no_dbr { " (no DBR)" } else { "" },
            r.sq_blocks,
            r.rq_wqes,
            r.rq_stride
        );
        let (obj, out) = dev.create(&m, umems, own_uar, what)?;
        Ok((obj, cmd::get(&out, cmd::obj::CQN) as u32, reg))
    }

    /// RESET → INIT → RTR → RTS of DEVX QP `qp` (number `qpn`) towards `r`.
    pub(crate) fn connect_devx(
        &self,
        qp: &Obj,
        qpn: u32,
        access: verbs::Access,
        r: &Remote,
        sq_psn: u32,
        o: &crate::backend::ConnectOptions,
    ) -> Result<(), Error> {
        let dev = &self.dev;
        let rmac = self.rmac(r.gid)?;
        let port = u64::from(dev.port);
        let rights = |a: verbs::Access| u64::from(access.contains(a));
        let log_rd = u64::from(
            dev.max_rd_atomic
                .max(1)
                .next_power_of_two()
                .trailing_zeros(),
        );
        let q = |f: Field| f.at(QPC_AT);
        let p = |f: Field| f.at(QPC_AT + ADS_AT);
        let mtu = u64::from(mtu_code(r.mtu.min(dev.mtu)));
        let init: Vec<(Field, u64)> = vec![
            (q(qpc::PM_STATE), 3),
            (q(qpc::RWE), rights(verbs::Access::REMOTE_WRITE)),
            (q(qpc::RRE), rights(verbs::Access::REMOTE_READ)),
            (q(qpc::RAE), rights(verbs::Access::REMOTE_ATOMIC)),
            // atomics of up to 8 bytes, IBTA semantics
            (q(qpc::ATOMIC_MODE), 3),
            (p(ads::VHCA_PORT_NUM), port),
        ];
        let mut rtr: Vec<(Field, u64)> = vec![
            (q(qpc::MTU), mtu),
            (q(qpc::LOG_MSG_MAX), 30),
            (q(qpc::REMOTE_QPN), r.qpn.into()),
            (q(qpc::NEXT_RCV_PSN), u64::from(r.psn & 0xff_ffff)),
            (q(qpc::MIN_RNR_NAK), o.min_rnr_timer.into()),
            (q(qpc::LOG_RRA_MAX), log_rd),
            (p(ads::VHCA_PORT_NUM), port),
            (p(ads::SRC_ADDR_INDEX), dev.gid.index.into()),
            (p(ads::HOP_LIMIT), 64),
            (
                p(ads::RMAC),
                u64::from_be_bytes([0, 0, rmac[0], rmac[1], rmac[2], rmac[3], rmac[4], rmac[5]]),
            ),
            // a source port per QP in the RoCE range spreads QPs over ECMP paths
            (p(ads::UDP_SPORT), 0xc000 | u64::from(qpn & 0x3fff)),
        ];
        for (i, w) in r.gid.chunks(8).enumerate() {
            let f = Field::new(ads::RGID_RIP.bit + 64 * i as u32, 64);
            rtr.push((p(f), u64::from_be_bytes(w.try_into().expect("8 bytes"))));
        }
        let rts = self.rts_fields(sq_psn, o);
        up(qp, qpn, [init, rtr, rts])
    }
}

impl Pd {
    /// RTR2RTS's fields: first PSN, retry counts, outstanding reads, ACK timeout, port.
    fn rts_fields(&self, sq_psn: u32, o: &crate::backend::ConnectOptions) -> Vec<(Field, u64)> {
        let dev = &self.dev;
        let log_rd = u64::from(
            dev.max_rd_atomic
                .max(1)
                .next_power_of_two()
                .trailing_zeros(),
        );
        let q = |f: Field| f.at(QPC_AT);
        let p = |f: Field| f.at(QPC_AT + ADS_AT);
        vec![
            (q(qpc::NEXT_SEND_PSN), u64::from(sq_psn & 0xff_ffff)),
            (q(qpc::RETRY_COUNT), o.retry_cnt.into()),
            (q(qpc::RNR_RETRY), o.rnr_retry.into()),
            (q(qpc::LOG_SRA_MAX), log_rd),
            (p(ads::ACK_TIMEOUT), o.timeout.into()),
            (p(ads::VHCA_PORT_NUM), u64::from(dev.port)),
        ]
    }

    /// RESET → INIT → RTR → RTS of DEVX DC initiator `qp` (number `qpn`): the port, the path
    /// MTU (no peer: each WQE names its target), then as RC's RTS.
    pub(crate) fn connect_devx_dc(
        &self,
        qp: &Obj,
        qpn: u32,
        mtu: u32,
        sq_psn: u32,
        o: &crate::backend::ConnectOptions,
    ) -> Result<(), Error> {
        let dev = &self.dev;
        let port = u64::from(dev.port);
        let q = |f: Field| f.at(QPC_AT);
        let p = |f: Field| f.at(QPC_AT + ADS_AT);
        let init = vec![(q(qpc::PM_STATE), 3), (p(ads::VHCA_PORT_NUM), port)];
        let rtr = vec![
            (q(qpc::MTU), u64::from(mtu_code(mtu.min(dev.mtu)))),
            (q(qpc::LOG_MSG_MAX), 30),
            (q(qpc::MIN_RNR_NAK), o.min_rnr_timer.into()),
            (p(ads::VHCA_PORT_NUM), port),
        ];
        let rts = self.rts_fields(sq_psn, o);
        up(qp, qpn, [init, rtr, rts])
    }

    /// A DC target made with CREATE_DCT on CQ `cqn` and the provider's SRQ `srqn`, active at
    /// once: key, remote rights, path MTU, RNR timer, this port's GID index. Returns it and its
    /// number.
    pub(crate) fn create_devx_dct(
        &self,
        (cqn, srqn): (u32, u32),
        key: u64,
        access: verbs::Access,
        (mtu, min_rnr_timer): (u32, u8),
    ) -> Result<(Obj, u32), Error> {
        use cmd::dctc;
        let dev = &self.dev;
        dev.devx()?;
        let mut m = vec![0u8; cmd::CREATE_DCT_IN];
        let d = |f: Field| f.at(cmd::DCTC_AT);
        let rights = |a: verbs::Access| u64::from(access.contains(a));
        for (f, v) in [
            (cmd::cmd_in::OPCODE, u64::from(op::CREATE_DCT)),
            (d(dctc::PD), self.pdn()?.into()),
            (d(dctc::CQN), cqn.into()),
            (d(dctc::SRQN_XRQN), srqn.into()),
            (d(dctc::DC_ACCESS_KEY), key),
            (d(dctc::RWE), rights(verbs::Access::REMOTE_WRITE)),
            (d(dctc::RRE), rights(verbs::Access::REMOTE_READ)),
            (d(dctc::RAE), rights(verbs::Access::REMOTE_ATOMIC)),
            (d(dctc::ATOMIC_MODE), 3),
            (d(dctc::MTU), u64::from(mtu_code(mtu.min(dev.mtu)))),
            (d(dctc::MIN_RNR_NAK), min_rnr_timer.into()),
            (d(dctc::PORT), u64::from(dev.port)),
            (d(dctc::MY_ADDR_INDEX), dev.gid.index.into()),
            (d(dctc::HOP_LIMIT), 64),
        ] {
            cmd::set(&mut m, f, v);
        }
        let (obj, out) = dev.create(&m, Vec::new(), None, format!("CREATE_DCT on CQ {cqn:#x}"))?;
        Ok((obj, cmd::get(&out, cmd::obj::CQN) as u32))
    }
}

/// The PRM's path MTU code of `bytes` (256 → 1 … 4096 → 5: verbs' `ibv_mtu` numbers).
fn mtu_code(bytes: u32) -> u8 {
    super::device::mtu_enum(bytes) as u8
}

/// RST2INIT, INIT2RTR and RTR2RTS of QP `qp` with these fields.
fn up(qp: &Obj, qpn: u32, [init, rtr, rts]: [Vec<(Field, u64)>; 3]) -> Result<(), Error> {
    for (opcode, fields, name) in [
        (op::RST2INIT_QP, init, "RST2INIT"),
        (op::INIT2RTR_QP, rtr, "INIT2RTR"),
        (op::RTR2RTS_QP, rts, "RTR2RTS"),
    ] {
        modify(qp, qpn, opcode, &fields, name)?;
    }
    Ok(())
}

/// `mlx5dv_devx_obj_modify` and `_query` (the same shape).
type ObjCmd = unsafe extern "C" fn(
    *mut sys::mlx5dv_devx_obj,
    *const std::ffi::c_void,
    usize,
    *mut std::ffi::c_void,
    usize,
) -> std::ffi::c_int;

impl Obj {
    /// Runs a command on the object through `f` (`call` names it); returns the out-mailbox of
    /// `out_len` bytes, or an error with the PRM status and syndrome and `what`.
    fn run(
        &self,
        f: ObjCmd,
        call: &'static str,
        input: &[u8],
        out_len: usize,
        what: impl FnOnce() -> String,
    ) -> Result<Vec<u8>, Error> {
        let mut out = vec![0u8; out_len];
        // SAFETY: a live object; in and out are buffers of the lengths given.
        let rc = unsafe {
            f(
                self.obj,
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        if rc != 0 {
            return Err(devx_err(call, rc, &out, what()));
        }
        Ok(out)
    }
}

/// One QP transition: `opcode` with `fields` set.
fn modify(
    qp: &Obj,
    qpn: u32,
    opcode: u16,
    fields: &[(Field, u64)],
    name: &str,
) -> Result<(), Error> {
    let f = entry(
        qp.dev.libs.dv.mlx5dv_devx_obj_modify,
        "mlx5dv_devx_obj_modify",
    )?;
    let mut m = vec![0u8; cmd::QP_IN];
    cmd::set(&mut m, cmd::cmd_in::OPCODE, opcode.into());
    cmd::set(&mut m, modify_qp_in::QPN, qpn.into());
    for &(field, v) in fields {
        cmd::set(&mut m, field, v);
    }
    qp.run(f, "mlx5dv_devx_obj_modify", &m, 16, || {
        format!("QP {qpn:#x} {name}")
    })?;
    Ok(())
}

impl Obj {
    /// Moves QP `qpn` to RESET (`reset`) or ERR.
    pub(crate) fn qp_to(&self, qpn: u32, reset: bool) -> Result<(), Error> {
        let (opcode, name) = if reset {
            (op::QP_2RST, "2RST")
        } else {
            (op::QP_2ERR, "2ERR")
        };
        modify(self, qpn, opcode, &[], name)
    }

    /// QP `qpn`'s state as QUERY_QP reports it (`prm::cmd::qp_state`).
    pub(crate) fn qp_state(&self, qpn: u32) -> Result<u8, Error> {
        let f = entry(
            self.dev.libs.dv.mlx5dv_devx_obj_query,
            "mlx5dv_devx_obj_query",
        )?;
        let mut m = vec![0u8; 16];
        cmd::set(&mut m, cmd::cmd_in::OPCODE, op::QUERY_QP.into());
        cmd::set(&mut m, modify_qp_in::QPN, qpn.into());
        let out = self.run(f, "mlx5dv_devx_obj_query", &m, cmd::QUERY_QP_OUT, || {
            format!("QUERY_QP {qpn:#x}")
        })?;
        Ok(cmd::get(&out, qpc::STATE.at(QPC_AT)) as u8)
    }
}
