//! DEVX OTHER (`mlx5dv_devx_general_cmd`), QUERY_EQN and QUERY_UAR: the device's answers to
//! the queries a library makes before it creates anything. The capabilities describe the soft
//! NIC truthfully: what it implements is set, everything else is 0.

use super::{answer, mailbox, out, out_room, refuse, syndrome, Fw, EQN};
use crate::abi::{self, mlx5_ioctl::devx as a};
use crate::context::{Context, GROSS_BFREGS_PER_UAR};
use crate::device::{MAX_CQE, MAX_QP_WR, MAX_RD_ATOM};
use crate::ioctl::Call;
use crate::uaccess::Errno;
use prm::cmd::{self, op, status, Field};

/// QUERY_ESW_VPORT_CONTEXT (answered without a DEVX context, as QUERY_HCA_CAP).
const QUERY_ESW_VPORT_CONTEXT: u16 = 0x752;

/// The queries mlx5_ib lets through OTHER (`devx_is_general_cmd`); anything else is EINVAL.
fn is_general(opcode: u16) -> bool {
    matches!(
        opcode,
        op::QUERY_HCA_CAP
            | op::QUERY_HCA_VPORT_CONTEXT
            | QUERY_ESW_VPORT_CONTEXT
            | op::QUERY_VPORT_STATE
            | op::QUERY_ADAPTER
            | op::QUERY_ISSI
            | op::QUERY_NIC_VPORT_CONTEXT
            | op::QUERY_ROCE_ADDRESS
            | op::QUERY_HCA_VPORT_GID
            | op::NOP
            | op::QUERY_LAG
            | 0x76f // QUERY_VNIC_ENV
            | 0x770 // QUERY_VPORT_COUNTER
            | 0x822..=0x824 // QUERY_CONG_STATUS / STATISTICS / PARAMS
    )
}

/// Writes `v` into field `f` of a structure at byte `at` of `o`.
fn put(o: &mut [u8], at: u32, f: Field, v: u64) {
    cmd::set(o, f.at(at), v);
}

impl Context {
    /// OTHER: one query command.
    pub(super) fn devx_other(&self, call: &Call) -> Result<(), Errno> {
        call.only(&[a::CMD_IN, a::CMD_OUT])?;
        let input = mailbox(call, a::CMD_IN)?;
        let room = out_room(call, a::CMD_OUT)?;
        let opcode = cmd::get(&input, cmd::cmd_in::OPCODE) as u16;
        let devx = self.objs.lock().devx;
        let without_devx = matches!(
            opcode,
            op::QUERY_HCA_CAP | op::QUERY_HCA_VPORT_CONTEXT | QUERY_ESW_VPORT_CONTEXT
        );
        if !is_general(opcode) || (!devx && !without_devx) {
            return Err(Errno::EINVAL);
        }
        let r = match opcode {
            op::QUERY_HCA_CAP => query_hca_cap(&input),
            op::QUERY_ROCE_ADDRESS => self.query_roce_address(&input),
            op::QUERY_HCA_VPORT_CONTEXT => self.query_hca_vport_context(&input),
            op::NOP => Ok(out(16)),
            _ => refuse(status::BAD_OP, syndrome::OPCODE),
        };
        answer(call, a::CMD_OUT, room, r)
    }
}

/// The answer of mlx5_ib's QUERY_PORT for the port number `port` (a u32: 4 bytes, else EINVAL)
/// into `room` bytes (at least `struct mlx5_ib_uapi_query_port`, else EINVAL): port 1 (the only
/// one; others EINVAL) of a device neither in switchdev mode nor multiport, which mlx5_ib
/// answers with every flag and field 0 (no vport, vhca id, steering ICM address or reg_c0),
/// and the rest of the room zeroed (`uverbs_copy_to_struct_or_zero`).
fn mlx5_port_info(port: &[u8], room: usize) -> Result<Vec<u8>, Errno> {
    let port: [u8; 4] = port.try_into().map_err(|_| Errno::EINVAL)?;
    if room < abi::mlx5_ioctl::device::PORT_LEN || u32::from_ne_bytes(port) != 1 {
        return Err(Errno::EINVAL);
    }
    Ok(vec![0u8; room])
}

/// QUERY_HCA_CAP: the capability page `op_mod >> 1` (current and maximum values alike).
fn query_hca_cap(input: &[u8]) -> Fw {
    use prm::cmd::{atomic_cap as at, cap, hca_cap as g, hca_cap_2 as g2, roce_cap as r};
    let op_mod = cmd::get(input, cmd::cmd_in::OP_MOD) as u16;
    let mut o = out(cmd::QUERY_HCA_CAP_OUT);
    let c = cmd::HCA_CAP_AT;
    let log2 = |n: u32| u64::from(n.next_power_of_two().trailing_zeros());
    match op_mod >> 1 {
        cap::GENERAL => {
            for (f, v) in [
                (g::HCA_CAP_2, 1),
                (g::LOG_MAX_SRQ_SZ, log2(MAX_QP_WR)),
                (g::LOG_MAX_QP_SZ, log2(MAX_QP_WR)),
                (g::LOG_MAX_QP, 18),
                (g::LOG_MAX_CQ_SZ, log2(MAX_CQE)),
                (g::LOG_MAX_CQ, 18),
                (g::LOG_MAX_MKEY, 24),
                (g::LOG_MAX_MRW_SZ, 64),
                (g::LOG_MAX_RA_REQ_QP, log2(MAX_RD_ATOM)),
                (g::LOG_MAX_RA_RES_QP, log2(MAX_RD_ATOM)),
                (g::LOG_MAX_RA_REQ_DC, log2(MAX_RD_ATOM)),
                (g::LOG_MAX_RA_RES_DC, log2(MAX_RD_ATOM)),
                (g::GID_TABLE_SIZE, 1),
                (g::PORT_TYPE, 1), // Ethernet
                (g::NUM_PORTS, 1),
                (g::LOG_MAX_MSG, 30),
                (g::CQE_VERSION, 1),
                (g::ROCE, 1),
                (g::ATOMIC, 1),
                (g::CQ_OI, 1),
                (g::CQ_RESIZE, 1),
                // no multicast at all, so a QP's own multicast is never looped back to it
                (g::BLOCK_LB_MC, 1),
                // cross-channel masters (cd_master: WAIT on any CQ; DPDK's send scheduling
                // checks this bit); the slave bits are refused at CREATE_QP
                (g::CD, 1),
                (g::RC, 1),
                // DC initiators and targets (CREATE_DCT, DCI QPs; docs/softnic.md)
                (g::DCT, 1),
                // XRC domains, SRQs and QPs through verbs (mlx5_ib reports IB_DEVICE_XRC from
                // this bit); DEVX's own XRC objects are refused (docs/emulation.md)
                (g::XRC, 1),
                (g::LOG_MAX_XRCD, 24),
                (g::LOG_PG_SZ, 12),
                (g::LOG_BF_REG_SIZE, 9), // 512-byte BlueFlame registers
                (g::MAX_WQE_SZ_SQ, (prm::MAX_WQE_BBS * prm::WQEBB) as u64),
                (g::MAX_WQE_SZ_RQ, 512),
                (g::LOG_MAX_PD, 24),
                (g::LOG_MAX_UCTX, 8),
                (g::LOG_MAX_UMEM, 24),
            ] {
                put(&mut o, c, f, v);
            }
        }
        cap::ATOMIC => {
            // compare-and-swap, fetch-and-add and their masked forms; 4 and 8 bytes on RC and DC
            put(&mut o, c, at::ATOMIC_OPERATIONS, 0xf);
            put(&mut o, c, at::ATOMIC_SIZE_QP, 0xc);
            put(&mut o, c, at::ATOMIC_SIZE_DC, 0xc);
            // the memory operand and the value returned are in host byte order (mode 1:
            // "host endianness"), as the soft NIC executes them
            put(&mut o, c, at::SUPPORTED_ATOMIC_REQ_8B_ENDIANNESS_MODE_1, 1);
            put(&mut o, c, at::ATOMIC_REQ_8B_ENDIANNESS_MODE, 1);
        }
        cap::ROCE => {
            put(&mut o, c, r::R_ROCE_MIN_SRC_UDP_PORT, 0xc000);
            put(&mut o, c, r::R_ROCE_MAX_SRC_UDP_PORT, 0xffff);
            put(&mut o, c, r::ROCE_ADDRESS_TABLE_SIZE, 1);
        }
        // of cap2, QPs rung without a send doorbell record (send_dbr_mode NO_DBR_EXT, as a
        // ConnectX-8 has them); nothing else of cap2 or of on-demand paging is implemented
        cap::GENERAL_2 => put(&mut o, c, g2::SEND_DBR_MODE_NO_DBR_EXT, 1),
        cap::ODP => {}
        // pages the firmware of a ConnectX-6 Dx knows, describing features the soft NIC
        // lacks: NIC flow tables (no steering, no packet reformat), QoS, device memory
        // (no MEMIC) and crypto. Every capability in them is 0, so a library that reads
        // them finds the feature absent (rather than a failed query)
        cap::NIC_FLOW_TABLE | cap::QOS | cap::DEVICE_MEMORY | cap::CRYPTO => {}
        _ => return refuse(status::BAD_PARAM, syndrome::CAP_TYPE),
    }
    Ok(o)
}

impl Context {
    fn query_roce_address(&self, input: &[u8]) -> Fw {
        use prm::cmd::{query_roce_address_in as q, roce_addr as r};
        if cmd::get(input, q::ROCE_ADDRESS_INDEX) != 0 {
            return refuse(status::BAD_PARAM, syndrome::INDEX);
        }
        let mut o = out(16 + 32);
        let at = cmd::ROCE_ADDR_AT as usize;
        o[at..at + 16].copy_from_slice(&self.dev.id.gid());
        put(&mut o, cmd::ROCE_ADDR_AT, r::ROCE_L3_TYPE, 0); // IPv4
        put(&mut o, cmd::ROCE_ADDR_AT, r::ROCE_VERSION, 2); // RoCE v2
        Ok(o)
    }

    fn query_hca_vport_context(&self, input: &[u8]) -> Fw {
        use prm::cmd::{hca_vport_context as v, query_hca_vport_context_in as q};
        if cmd::get(input, q::OTHER_VPORT) != 0 || cmd::get(input, q::PORT_NUM) > 1 {
            return refuse(status::BAD_PARAM, syndrome::PORT);
        }
        let mut o = out(16 + 256);
        let at = cmd::HCA_VPORT_CONTEXT_AT;
        let guid = self.dev.id.node_guid;
        for (f, val) in [
            (v::PORT_PHYSICAL_STATE, 5), // LinkUp
            (v::PORT_STATE, 4),          // Active
            (v::VPORT_STATE, 4),
            (v::SYSTEM_IMAGE_GUID, guid),
            (v::PORT_GUID, guid),
            (v::NODE_GUID, guid),
        ] {
            put(&mut o, at, f, val);
        }
        Ok(o)
    }

    /// mlx5_ib's QUERY_PORT (`mlx5dv_query_port`) on the core device object.
    pub(super) fn mlx5_query_port(&self, call: &Call) -> Result<(), Errno> {
        use crate::abi::mlx5_ioctl::device as d;
        call.only(&[d::PORT_NUM, d::PORT])?;
        let port = call.input(d::PORT_NUM)?;
        let room = call.out_len(d::PORT)?;
        let info = mlx5_port_info(&port, room)?;
        call.output(d::PORT, &info)
    }

    /// QUERY_EQN: completion vector 0 is the only one.
    pub(super) fn devx_query_eqn(&self, call: &Call) -> Result<(), Errno> {
        call.only(&[a::QUERY_IN, a::QUERY_OUT])?;
        if call.need(a::QUERY_IN)? != 0 {
            return Err(Errno::EINVAL);
        }
        call.output(a::QUERY_OUT, &EQN.to_ne_bytes())
    }

    /// QUERY_UAR: the page id of a static BlueFlame register (libmlx5's index numbering);
    /// EINVAL in dynamic-UAR mode, as mlx5_ib.
    pub(super) fn devx_query_uar(&self, call: &Call) -> Result<(), Errno> {
        call.only(&[a::QUERY_IN, a::QUERY_OUT])?;
        let idx = call.need(a::QUERY_IN)? as u32;
        if self.objs.lock().dynamic_uars {
            return Err(Errno::EINVAL);
        }
        let pages = self
            .uars
            .lock()
            .as_ref()
            .map_or(0, |u| u.pages.len() as u32);
        let page = idx / GROSS_BFREGS_PER_UAR;
        if page >= pages {
            return Err(Errno::EINVAL);
        }
        call.output(a::QUERY_OUT, &(page + 1).to_ne_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::super::Refused;
    use super::*;
    use prm::cmd::cap;

    /// A QUERY_HCA_CAP in-mailbox for `op_mod`.
    fn query(op_mod: u16) -> Vec<u8> {
        let mut i = vec![0u8; 16];
        cmd::set(&mut i, cmd::cmd_in::OPCODE, op::QUERY_HCA_CAP.into());
        cmd::set(&mut i, cmd::cmd_in::OP_MOD, op_mod.into());
        i
    }

    #[test]
    fn pages_of_absent_features_are_served_all_zero() {
        // NIC flow tables (pyverbs' reformat check), QoS, device memory (its MEMIC check) and
        // crypto: status OK, a full page, every capability 0
        for cap_type in [
            cap::NIC_FLOW_TABLE,
            cap::QOS,
            cap::DEVICE_MEMORY,
            cap::CRYPTO,
        ] {
            for current in [0, 1] {
                let o = query_hca_cap(&query(cap_type << 1 | current)).unwrap();
                assert_eq!(o.len(), cmd::QUERY_HCA_CAP_OUT, "type {cap_type:#x}");
                assert!(o.iter().all(|&b| b == 0), "type {cap_type:#x}");
            }
        }
    }

    #[test]
    fn unknown_capability_types_are_refused() {
        assert_eq!(
            query_hca_cap(&query(0x3f << 1 | 1)),
            Err(Refused {
                status: status::BAD_PARAM,
                syndrome: syndrome::CAP_TYPE
            })
        );
    }

    #[test]
    fn general_caps_advertise_the_send_wqe_size_the_context_reports() {
        let o = query_hca_cap(&query(cap::GENERAL << 1 | 1)).unwrap();
        let sz = cmd::get(&o, prm::cmd::hca_cap::MAX_WQE_SZ_SQ.at(cmd::HCA_CAP_AT));
        assert_eq!(sz, (prm::MAX_WQE_BBS * prm::WQEBB) as u64);
    }

    #[test]
    fn query_port_answers_port_1_with_zeros_and_refuses_the_rest() {
        let one = 1u32.to_ne_bytes();
        let info = mlx5_port_info(&one, 48).unwrap();
        assert_eq!(info, vec![0u8; 48]);
        // a room below struct mlx5_ib_uapi_query_port, another port, a port number not a u32
        assert_eq!(mlx5_port_info(&one, 39), Err(Errno::EINVAL));
        assert_eq!(mlx5_port_info(&2u32.to_ne_bytes(), 40), Err(Errno::EINVAL));
        assert_eq!(mlx5_port_info(&1u64.to_ne_bytes(), 40), Err(Errno::EINVAL));
    }
}
