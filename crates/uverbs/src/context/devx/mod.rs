//! The mlx5 driver's ioctl methods, as mlx5_ib serves them: DEVX (PRM commands passed to the
//! device: queries in `general.rs`, CQ, QP and DC target objects in `cq.rs`, `qp.rs` and
//! `dct.rs`), DEVX umems
//! (`umem.rs`) and UAR pages allocated on demand (`uar.rs`). This file holds the dispatch
//! ([`Context::ioctl`]), the objects' tables and what every PRM command shares: its mailboxes,
//! and a failed command's answer (the out-mailbox's status and syndrome, and EREMOTEIO).
//!
//! Core objects (verbs through ioctl) stay ENOTTY but for REG_DMABUF_MR, so that libibverbs
//! keeps its `write()` command path.

mod cq;
mod dct;
mod general;
mod mkey;
mod qp;
mod uar;
mod umem;

pub(super) use cq::DevxCq;
pub(super) use dct::DevxDct;
pub(super) use mkey::DevxMkey;
pub(super) use qp::DevxQp;
pub(super) use umem::Umem;

use super::Context;
use crate::abi::{self, mlx5_ioctl as m};
use crate::ioctl::Call;
use crate::uaccess::Errno;
use prm::cmd::{self, cmd_out, status};

/// The EQ number QUERY_EQN answers for completion vector 0 (the only one).
pub(super) const EQN: u32 = 7;

/// A PRM command the device refused: the status and syndrome its out-mailbox carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Refused {
    pub status: u8,
    pub syndrome: u32,
}

/// What a PRM command's handler returns: its out-mailbox, or the device's refusal.
pub(super) type Fw = Result<Vec<u8>, Refused>;

/// Syndromes of the refusals (firmware syndromes are opaque numbers; these name the check that
/// failed, so that a log line leads to it).
pub(super) mod syndrome {
    pub const OPCODE: u32 = 0x6c_0001;
    pub const INPUT_LENGTH: u32 = 0x6c_0002;
    pub const CAP_TYPE: u32 = 0x6c_0003;
    pub const INDEX: u32 = 0x6c_0004;
    pub const PORT: u32 = 0x6c_0005;
    pub const UMEM: u32 = 0x6c_0010;
    pub const UMEM_RANGE: u32 = 0x6c_0011;
    pub const UAR: u32 = 0x6c_0012;
    pub const EQN: u32 = 0x6c_0013;
    pub const CQ_SIZE: u32 = 0x6c_0015;
    pub const FEATURE: u32 = 0x6c_0016;
    pub const PD: u32 = 0x6c_0021;
    pub const CQN: u32 = 0x6c_0022;
    pub const SRQN: u32 = 0x6c_0023;
    pub const QP_SIZE: u32 = 0x6c_0024;
    pub const QP_STATE: u32 = 0x6c_0025;
    pub const ATTRIBUTE: u32 = 0x6c_0027;
}

/// A refusal with `status` and `syndrome`.
pub(super) fn refuse<T>(status: u8, syndrome: u32) -> Result<T, Refused> {
    Err(Refused { status, syndrome })
}

/// A refusal of a parameter, with one line on stderr naming what the emulated device lacks.
pub(super) fn lacks<T>(what: &str) -> Result<T, Refused> {
    crate::complain(format_args!(
        "{what}: not implemented by the emulated device (PRM status BAD_PARAM)"
    ));
    refuse(status::BAD_PARAM, syndrome::FEATURE)
}

/// The PD a mailbox names by number (`pdn`): its handle and the soft NIC's id; BAD_PARAM with
/// the PD syndrome when the context has none of that number.
pub(super) fn pd_by_number(o: &super::Objects, pdn: u32) -> Result<(u32, softnic::PdId), Refused> {
    o.pds
        .iter()
        .find(|(_, p)| p.id.0 == pdn)
        .map(|(h, p)| (*h, p.id))
        .ok_or(Refused {
            status: status::BAD_PARAM,
            syndrome: syndrome::PD,
        })
}

/// An out-mailbox of `len` bytes with status OK.
pub(super) fn out(len: usize) -> Vec<u8> {
    vec![0u8; len.max(16)]
}

/// A command's in-mailbox (attribute `id`): at least the 16-byte command header (EINVAL).
pub(super) fn mailbox(call: &Call, id: u16) -> Result<Vec<u8>, Errno> {
    let b = call.input(id)?;
    if b.len() < 16 {
        return Err(Errno::EINVAL);
    }
    Ok(b)
}

/// Room for the out-mailbox (attribute `id`): at least the 16-byte header (EINVAL).
pub(super) fn out_room(call: &Call, id: u16) -> Result<usize, Errno> {
    let n = call.out_len(id)?;
    if n < 16 {
        return Err(Errno::EINVAL);
    }
    Ok(n)
}

/// Hands a command's result to the application: the out-mailbox, and EREMOTEIO with the
/// status and syndrome filled in when the device refused it (as mlx5_ib does).
pub(super) fn answer(call: &Call, id: u16, room: usize, r: Fw) -> Result<(), Errno> {
    match r {
        Ok(mut o) => {
            o.resize(room, 0);
            call.output(id, &o)
        }
        Err(e) => {
            let mut o = vec![0u8; room];
            cmd::set(&mut o, cmd_out::STATUS, e.status.into());
            cmd::set(&mut o, cmd_out::SYNDROME, e.syndrome.into());
            call.output(id, &o)?;
            Err(Errno::EREMOTEIO)
        }
    }
}

/// A DEVX object.
pub(super) enum DevxObj {
    Cq(DevxCq),
    Qp(DevxQp),
    Dct(DevxDct),
    Mkey(DevxMkey),
}

impl DevxObj {
    /// Tears the object down in the soft NIC (context close).
    pub(super) fn destroy(&self, soft: &softnic::Device) {
        match self {
            Self::Cq(c) => {
                let _ = soft.destroy_cq(&c.soft);
            }
            Self::Qp(q) => soft.destroy_qp(&q.soft),
            Self::Dct(d) => soft.destroy_qp(&d.soft),
            Self::Mkey(m) => {
                let _ = soft.destroy_indirect(m.key);
            }
        }
    }
}

impl Context {
    /// One `RDMA_VERBS_IOCTL` call on the device file.
    pub fn ioctl(&self, call: &Call) -> Result<(), Errno> {
        use abi::ioctl as core;
        match (call.object, call.method) {
            // mlx5_ib's driver method on the core device object
            (core::OBJECT_DEVICE, m::device::QUERY_PORT) => return self.mlx5_query_port(call),
            // ibv_import_device: a context shared through a second fd is not emulated
            (core::OBJECT_DEVICE, core::METHOD_QUERY_CONTEXT) => {
                crate::complain(format_args!(
                    "importing a device context (ibv_import_device) is not emulated (EOPNOTSUPP)"
                ));
                return Err(Errno::EOPNOTSUPP);
            }
            _ => {}
        }
        let core_method =
            (call.object, call.method) == (core::OBJECT_MR, core::METHOD_REG_DMABUF_MR);
        if call.object < 0x1000 && !core_method {
            // core objects: libibverbs then uses the write() commands
            return Err(Errno::ENOTTY);
        }
        if self.soft.lock().is_none() {
            return Err(Errno::EINVAL);
        }
        match (call.object, call.method) {
            (core::OBJECT_MR, core::METHOD_REG_DMABUF_MR) => self.reg_dmabuf_mr(call),
            (m::OBJECT_DEVX, m::devx::OTHER) => self.devx_other(call),
            (m::OBJECT_DEVX, m::devx::QUERY_UAR) => self.devx_query_uar(call),
            (m::OBJECT_DEVX, m::devx::QUERY_EQN) => self.devx_query_eqn(call),
            (m::OBJECT_DEVX_OBJ, m::obj::CREATE) => self.devx_obj_create(call),
            (m::OBJECT_DEVX_OBJ, m::obj::DESTROY) => self.devx_obj_destroy(call),
            (m::OBJECT_DEVX_OBJ, m::obj::MODIFY) => self.devx_obj_modify(call),
            (m::OBJECT_DEVX_OBJ, m::obj::QUERY) => self.devx_obj_query(call),
            (m::OBJECT_DEVX_UMEM, m::umem::REG) => self.umem_reg(call),
            (m::OBJECT_DEVX_UMEM, m::umem::DEREG) => self.umem_dereg(call),
            (m::OBJECT_UAR, m::uar::ALLOC) => self.uar_alloc(call),
            (m::OBJECT_UAR, m::uar::DESTROY) => self.uar_destroy(call),
            (o, meth) => {
                crate::complain(format_args!(
                    "mlx5 ioctl object {o:#x} method {meth:#x} is not served (EPROTONOSUPPORT)"
                ));
                Err(Errno::EPROTONOSUPPORT)
            }
        }
    }

    /// OBJ_CREATE: a CQ, an RC QP or DC initiator, a DC target or an indirect mkey from its
    /// PRM command.
    fn devx_obj_create(&self, call: &Call) -> Result<(), Errno> {
        use m::obj as a;
        call.only(&[a::HANDLE, a::CMD_IN, a::CMD_OUT])?;
        let input = mailbox(call, a::CMD_IN)?;
        let room = out_room(call, a::CMD_OUT)?;
        if !self.objs.lock().devx {
            return Err(Errno::EINVAL);
        }
        let opcode = cmd::get(&input, cmd::cmd_in::OPCODE) as u16;
        let made = match opcode {
            cmd::op::CREATE_CQ => self
                .devx_create_cq(&input)
                .map(|(c, o)| (DevxObj::Cq(c), o)),
            cmd::op::CREATE_QP => self
                .devx_create_qp(&input)
                .map(|(q, o)| (DevxObj::Qp(q), o)),
            cmd::op::CREATE_MKEY => self
                .devx_create_mkey(&input)
                .map(|(m, o)| (DevxObj::Mkey(m), o)),
            cmd::op::CREATE_DCT => self
                .devx_create_dct(&input)
                .map(|(d, o)| (DevxObj::Dct(d), o)),
            op if is_create(op) => lacks(&format!("PRM object creation {op:#x}")),
            _ => return Err(Errno::EINVAL),
        };
        let (obj, o) = match made {
            Ok(x) => x,
            Err(e) => return answer(call, a::CMD_OUT, room, Err(e)),
        };
        let soft = self.soft()?;
        let mut objs = self.objs.lock();
        let h = objs.handle();
        let done =
            answer(call, a::CMD_OUT, room, Ok(o)).and_then(|_| call.new_handle(a::HANDLE, h));
        if let Err(e) = done {
            obj.destroy(&soft);
            objs.unuse(&obj);
            return Err(e);
        }
        objs.devx_objs.insert(h, obj);
        Ok(())
    }

    /// OBJ_DESTROY: the object goes, unless another one still uses it.
    fn devx_obj_destroy(&self, call: &Call) -> Result<(), Errno> {
        use m::obj as a;
        call.only(&[a::HANDLE])?;
        let h = call.handle(a::HANDLE)?;
        let soft = self.soft()?;
        let mut o = self.objs.lock();
        let obj = o.devx_objs.get(&h).ok_or(Errno::EINVAL)?;
        if let DevxObj::Cq(c) = obj {
            if o.cq_in_use(c.soft.cqn()) {
                // the firmware refuses DESTROY_CQ while a QP reports to it
                return Err(Errno::EBUSY);
            }
        }
        let obj = o.devx_objs.remove(&h).expect("present");
        obj.destroy(&soft);
        o.unuse(&obj);
        Ok(())
    }

    /// OBJ_MODIFY: a QP transition on a DEVX QP.
    fn devx_obj_modify(&self, call: &Call) -> Result<(), Errno> {
        use m::obj as a;
        call.only(&[a::HANDLE, a::CMD_IN, a::CMD_OUT])?;
        let h = call.handle(a::HANDLE)?;
        let input = mailbox(call, a::CMD_IN)?;
        let room = out_room(call, a::CMD_OUT)?;
        let opcode = cmd::get(&input, cmd::cmd_in::OPCODE) as u16;
        if opcode == cmd::op::MODIFY_CQ {
            // mlx5_ib passes it on; the soft NIC has no moderation or CQ modification
            return answer(
                call,
                a::CMD_OUT,
                room,
                lacks("MODIFY_CQ (CQ moderation and resizing through DEVX)"),
            );
        }
        if opcode == cmd::op::ARM_DCT_FOR_KEY_VIOLATION {
            return answer(
                call,
                a::CMD_OUT,
                room,
                lacks("DC key violation events (ARM_DCT_FOR_KEY_VIOLATION)"),
            );
        }
        if opcode == cmd::op::DRAIN_DCT {
            let r = {
                let mut o = self.objs.lock();
                let Some(DevxObj::Dct(d)) = o.devx_objs.get_mut(&h) else {
                    return Err(Errno::EINVAL);
                };
                if cmd::get(&input, cmd::obj::CQN) as u32 != d.soft.qpn() {
                    return Err(Errno::EINVAL);
                }
                d.drain()
            };
            return answer(call, a::CMD_OUT, room, r);
        }
        if !qp::is_transition(opcode) {
            return Err(Errno::EINVAL);
        }
        let r = {
            let mut o = self.objs.lock();
            let Some(DevxObj::Qp(q)) = o.devx_objs.get_mut(&h) else {
                return Err(Errno::EINVAL);
            };
            if cmd::get(&input, cmd::modify_qp_in::QPN) as u32 != q.soft.qpn() {
                return Err(Errno::EINVAL);
            }
            self.devx_modify_qp(q, opcode, &input)
        };
        answer(call, a::CMD_OUT, room, r)
    }

    /// OBJ_QUERY: QUERY_QP, QUERY_CQ or QUERY_DCT of a DEVX object.
    fn devx_obj_query(&self, call: &Call) -> Result<(), Errno> {
        use m::obj as a;
        call.only(&[a::HANDLE, a::CMD_IN, a::CMD_OUT])?;
        let h = call.handle(a::HANDLE)?;
        let input = mailbox(call, a::CMD_IN)?;
        let room = out_room(call, a::CMD_OUT)?;
        let opcode = cmd::get(&input, cmd::cmd_in::OPCODE) as u16;
        let number = cmd::get(&input, cmd::obj::CQN) as u32;
        let o = self.objs.lock();
        // (a verbs object's handle, as `mlx5dv_devx_qp_query` passes, is not served: EINVAL)
        let r = match (opcode, o.devx_objs.get(&h)) {
            (cmd::op::QUERY_QP, Some(DevxObj::Qp(q))) if number == q.soft.qpn() => q.query(),
            (cmd::op::QUERY_CQ, Some(DevxObj::Cq(c))) if number == c.soft.cqn() => c.query(),
            (cmd::op::QUERY_DCT, Some(DevxObj::Dct(d))) if number == d.soft.qpn() => d.query(),
            _ => return Err(Errno::EINVAL),
        };
        answer(call, a::CMD_OUT, room, r)
    }
}

/// Whether `op` is a creation command mlx5_ib passes to the device through OBJ_CREATE
/// (`devx_is_obj_create_cmd`; CREATE_CQ and CREATE_QP are served, the rest refused by the
/// device).
fn is_create(op: u16) -> bool {
    use cmd::op::*;
    const OTHERS: [u16; 24] = [
        0x600, // CREATE_PSV
        0x705, // CREATE_XRC_SRQ
        0x717, // CREATE_XRQ
        0x771, // ALLOC_Q_COUNTER
        0x782, // CREATE_SCHEDULING_ELEMENT
        0x806, // ATTACH_TO_MCG
        0x80e, // ALLOC_XRCD
        0x816, // ALLOC_TRANSPORT_DOMAIN
        0x827, // ADD_VXLAN_UDP_DPORT
        0x829, // SET_L2_TABLE_ENTRY
        0x900, // CREATE_TIR
        0x904, // CREATE_SQ
        0x908, // CREATE_RQ
        0x912, // CREATE_TIS
        0x916, // CREATE_RQT
        0x930, // CREATE_FLOW_TABLE
        0x933, // CREATE_FLOW_GROUP
        0x936, // SET_FLOW_TABLE_ENTRY
        0x939, // ALLOC_FLOW_COUNTER
        0x93d, // ALLOC_PACKET_REFORMAT_CONTEXT
        0x940, // ALLOC_MODIFY_HEADER_CONTEXT
        CREATE_RMP, CREATE_SRQ, ALLOC_PD,
    ];
    matches!(
        op,
        CREATE_CQ | CREATE_QP | CREATE_DCT | CREATE_MKEY | CREATE_GENERAL_OBJECT
    ) || OTHERS.contains(&op)
}

impl super::Objects {
    /// Whether a QP (verbs or DEVX) reports to CQ `cqn`.
    pub(super) fn cq_in_use(&self, cqn: u32) -> bool {
        let verbs = self.qps.values().any(|q| {
            let c = |h: &u32| self.cqs.get(h).is_some_and(|c| c.soft.cqn() == cqn);
            c(&q.send_cq) || c(&q.recv_cq)
        });
        verbs
            || self.devx_objs.values().any(|x| match x {
                DevxObj::Qp(q) => q.send_cqn == cqn || q.recv_cqn == cqn,
                DevxObj::Dct(d) => d.cqn == cqn,
                DevxObj::Cq(_) | DevxObj::Mkey(_) => false,
            })
    }

    /// Whether a DEVX QP or mkey is built on PD `pd_handle`.
    pub(super) fn pd_in_use_by_devx(&self, pd_handle: u32) -> bool {
        self.devx_objs.values().any(|x| match x {
            DevxObj::Qp(q) => q.pd == pd_handle,
            DevxObj::Dct(d) => d.pd == pd_handle,
            DevxObj::Mkey(m) => m.pd == pd_handle,
            DevxObj::Cq(_) => false,
        })
    }

    /// Whether a DEVX QP or DC target takes its receives from SRQ `srqn`.
    pub(super) fn srq_in_use_by_devx(&self, srqn: u32) -> bool {
        self.devx_objs.values().any(|x| match x {
            DevxObj::Qp(q) => q.srqn == Some(srqn),
            DevxObj::Dct(d) => d.srqn == srqn,
            DevxObj::Cq(_) | DevxObj::Mkey(_) => false,
        })
    }

    /// Releases the umems a destroyed object held.
    pub(super) fn unuse(&mut self, obj: &DevxObj) {
        let ids: &[u32] = match obj {
            DevxObj::Cq(c) => &c.umems,
            DevxObj::Qp(q) => &q.umems,
            DevxObj::Dct(_) | DevxObj::Mkey(_) => &[],
        };
        for id in ids {
            if let Some(u) = self.umems.values_mut().find(|u| u.id == *id) {
                u.users -= 1;
            }
        }
    }

    /// A CQ of this context by number, verbs or DEVX.
    pub(super) fn cq_by_number(&self, cqn: u32) -> Option<std::sync::Arc<softnic::Cq>> {
        self.cqs
            .values()
            .map(|c| &c.soft)
            .chain(self.devx_objs.values().filter_map(|x| match x {
                DevxObj::Cq(c) => Some(&c.soft),
                DevxObj::Qp(_) | DevxObj::Dct(_) | DevxObj::Mkey(_) => None,
            }))
            .find(|c| c.cqn() == cqn)
            .cloned()
    }
}
