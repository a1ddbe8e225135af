//! Layout tests: every format type and constant of this crate against rdma-core's own
//! definitions in `infiniband/mlx5dv.h`, through the -sys crate's bindgen output.

use core::mem::{offset_of, size_of};
use prm::cqe::{self, Cqe64, CqeOpcode, Syndrome};
use prm::doorbell;
use prm::wqe::{self, AtomicSeg, CtrlSeg, DataSeg, Opcode, RaddrSeg};
use rdma_core_sys as sys;

macro_rules! same_layout {
    ($ours:ty, $theirs:ty, [$(($a:ident, $b:ident)),* $(,)?]) => {{
        assert_eq!(size_of::<$ours>(), size_of::<$theirs>(), "size of {}", stringify!($ours));
        $(
            assert_eq!(
                offset_of!($ours, $a),
                offset_of!($theirs, $b),
                "offset of {}::{}",
                stringify!($ours),
                stringify!($a)
            );
        )*
    }};
}

#[test]
fn wqe_segments_match_mlx5dv() {
    same_layout!(
        CtrlSeg,
        sys::mlx5_wqe_ctrl_seg,
        [
            (opmod_idx_opcode, opmod_idx_opcode),
            (qpn_ds, qpn_ds),
            (signature, signature),
            (dci_stream_channel_id, dci_stream_channel_id),
            (fm_ce_se, fm_ce_se),
            (imm, imm),
        ]
    );
    same_layout!(
        RaddrSeg,
        sys::mlx5_wqe_raddr_seg,
        [(raddr, raddr), (rkey, rkey), (reserved, reserved)]
    );
    same_layout!(
        DataSeg,
        sys::mlx5_wqe_data_seg,
        [(byte_count, byte_count), (lkey, lkey), (addr, addr)]
    );
    same_layout!(
        AtomicSeg,
        sys::mlx5_wqe_atomic_seg,
        [(swap_add, swap_add), (compare, compare)]
    );
    assert_eq!(size_of::<sys::mlx5_wqe_inl_data_seg>(), 4);
    assert_eq!(wqe::INLINE_SEG, sys::MLX5_INLINE_SEG);
    assert_eq!(wqe::INVALID_LKEY, sys::MLX5_INVALID_LKEY);
    assert_eq!(prm::WQEBB, sys::MLX5_SEND_WQE_BB as usize);
}

#[test]
fn cqe_matches_mlx5dv() {
    same_layout!(
        Cqe64,
        sys::mlx5_cqe64,
        [
            (srqn_uidx, srqn_uidx),
            (imm_inval_pkey, imm_inval_pkey),
            (app, app),
            (app_op, app_op),
            (app_info, app_info),
            (byte_cnt, byte_cnt),
            (timestamp, timestamp),
            (sop_drop_qpn, sop_drop_qpn),
            (wqe_counter, wqe_counter),
            (signature, signature),
            (op_own, op_own),
        ]
    );
    assert_eq!(size_of::<sys::mlx5_err_cqe>(), prm::CQE_SIZE);
    assert_eq!(
        cqe::ERR_VENDOR_SYNDROME_OFFSET,
        offset_of!(sys::mlx5_err_cqe, vendor_err_synd)
    );
    assert_eq!(
        cqe::ERR_SYNDROME_OFFSET,
        offset_of!(sys::mlx5_err_cqe, syndrome)
    );
    assert_eq!(
        offset_of!(Cqe64, sop_drop_qpn),
        offset_of!(sys::mlx5_err_cqe, s_wqe_opcode_qpn)
    );
    assert_eq!(
        cqe::CQE_TAIL_OFFSET,
        offset_of!(sys::mlx5_cqe64, wqe_counter)
    );
}

#[test]
fn opcodes_match_mlx5dv() {
    let pairs = [
        (Opcode::Nop, sys::MLX5_OPCODE_NOP),
        (Opcode::RdmaWrite, sys::MLX5_OPCODE_RDMA_WRITE),
        (Opcode::RdmaWriteImm, sys::MLX5_OPCODE_RDMA_WRITE_IMM),
        (Opcode::Send, sys::MLX5_OPCODE_SEND),
        (Opcode::SendImm, sys::MLX5_OPCODE_SEND_IMM),
        (Opcode::RdmaRead, sys::MLX5_OPCODE_RDMA_READ),
        (Opcode::AtomicCs, sys::MLX5_OPCODE_ATOMIC_CS),
        (Opcode::AtomicFa, sys::MLX5_OPCODE_ATOMIC_FA),
        (Opcode::AtomicMaskedCs, sys::MLX5_OPCODE_ATOMIC_MASKED_CS),
        (Opcode::AtomicMaskedFa, sys::MLX5_OPCODE_ATOMIC_MASKED_FA),
        (Opcode::SendInval, sys::MLX5_OPCODE_SEND_INVAL),
        (Opcode::Umr, sys::MLX5_OPCODE_UMR),
    ];
    for (ours, theirs) in pairs {
        assert_eq!(ours as u32, theirs, "{ours:?}");
        assert_eq!(Opcode::from_u8(theirs as u8), Some(ours));
    }
    // WAIT (0x0f) is not in mlx5dv.h; it comes from the PRM (cross-channel WAIT).
    assert_eq!(Opcode::Wait as u8, 0x0f);
}

#[test]
fn cqe_opcodes_and_syndromes_match_mlx5dv() {
    let ops = [
        (CqeOpcode::Req, sys::MLX5_CQE_REQ),
        (CqeOpcode::RespWrImm, sys::MLX5_CQE_RESP_WR_IMM),
        (CqeOpcode::RespSend, sys::MLX5_CQE_RESP_SEND),
        (CqeOpcode::RespSendImm, sys::MLX5_CQE_RESP_SEND_IMM),
        (CqeOpcode::RespSendInv, sys::MLX5_CQE_RESP_SEND_INV),
        (CqeOpcode::ReqErr, sys::MLX5_CQE_REQ_ERR),
        (CqeOpcode::RespErr, sys::MLX5_CQE_RESP_ERR),
        (CqeOpcode::Invalid, sys::MLX5_CQE_INVALID),
    ];
    for (ours, theirs) in ops {
        assert_eq!(ours as u32, theirs, "{ours:?}");
    }
    let syndromes = [
        (
            Syndrome::LocalLength,
            sys::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR,
        ),
        (Syndrome::LocalQpOp, sys::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR),
        (Syndrome::LocalProt, sys::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR),
        (Syndrome::WrFlush, sys::MLX5_CQE_SYNDROME_WR_FLUSH_ERR),
        (Syndrome::MwBind, sys::MLX5_CQE_SYNDROME_MW_BIND_ERR),
        (Syndrome::BadResp, sys::MLX5_CQE_SYNDROME_BAD_RESP_ERR),
        (
            Syndrome::LocalAccess,
            sys::MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR,
        ),
        (
            Syndrome::RemoteInvalReq,
            sys::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR,
        ),
        (
            Syndrome::RemoteAccess,
            sys::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR,
        ),
        (Syndrome::RemoteOp, sys::MLX5_CQE_SYNDROME_REMOTE_OP_ERR),
        (
            Syndrome::TransportRetryExc,
            sys::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR,
        ),
        (
            Syndrome::RnrRetryExc,
            sys::MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR,
        ),
        (
            Syndrome::RemoteAborted,
            sys::MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR,
        ),
    ];
    assert_eq!(syndromes.len(), Syndrome::ALL.len());
    for (ours, theirs) in syndromes {
        assert_eq!(ours as u32, theirs, "{ours:?}");
    }
}

#[test]
fn ctrl_flags_and_doorbells_match_mlx5dv() {
    assert_eq!(wqe::FM_CE_SE_CQ_UPDATE as u32, sys::MLX5_WQE_CTRL_CQ_UPDATE);
    assert_eq!(wqe::FM_CE_SE_SOLICITED as u32, sys::MLX5_WQE_CTRL_SOLICITED);
    assert_eq!(wqe::FM_CE_SE_FENCE as u32, sys::MLX5_WQE_CTRL_FENCE);
    assert_eq!(
        wqe::FM_CE_SE_SMALL_FENCE as u32,
        sys::MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE
    );
    assert_eq!(doorbell::CQ_DOORBELL_OFFSET, sys::MLX5_CQ_DOORBELL as usize);
    assert_eq!(cqe::OP_OWN_INVALID >> 4, sys::MLX5_CQE_INVALID as u8);
}

#[test]
fn umr_segments_match_mlx5dv() {
    use wqe::{KlmSeg, MkeyContextSeg, UmrCtrlSeg};
    same_layout!(
        UmrCtrlSeg,
        sys::mlx5_wqe_umr_ctrl_seg,
        [
            (flags, flags),
            (klm_octowords, klm_octowords),
            (mkey_mask, mkey_mask),
            (rsvd1, rsvd1)
        ]
    );
    same_layout!(
        MkeyContextSeg,
        sys::mlx5_wqe_mkey_context_seg,
        [
            (free, free),
            (access_flags, access_flags),
            (qpn_mkey, qpn_mkey),
            (flags_pd, flags_pd),
            (start_addr, start_addr),
            (len, len),
            (translations_octword_size, translations_octword_size),
            (log_page_size, log_page_size)
        ]
    );
    same_layout!(
        KlmSeg,
        sys::mlx5_wqe_umr_klm_seg,
        [(byte_count, byte_count), (mkey, mkey), (address, address)]
    );
    let consts: [(u64, u32); 13] = [
        (
            wqe::UMR_FLAG_INLINE as u64,
            sys::MLX5_WQE_UMR_CTRL_FLAG_INLINE,
        ),
        (
            wqe::UMR_FLAG_CHECK_FREE as u64,
            sys::MLX5_WQE_UMR_CTRL_FLAG_CHECK_FREE,
        ),
        (
            wqe::UMR_FLAG_CHECK_QPN as u64,
            sys::MLX5_WQE_UMR_CTRL_FLAG_CHECK_QPN,
        ),
        (
            wqe::UMR_FLAG_TRANSLATION_OFFSET as u64,
            sys::MLX5_WQE_UMR_CTRL_FLAG_TRNSLATION_OFFSET,
        ),
        (wqe::UMR_MASK_LEN, sys::MLX5_WQE_UMR_CTRL_MKEY_MASK_LEN),
        (
            wqe::UMR_MASK_START_ADDR,
            sys::MLX5_WQE_UMR_CTRL_MKEY_MASK_START_ADDR,
        ),
        (wqe::UMR_MASK_MKEY, sys::MLX5_WQE_UMR_CTRL_MKEY_MASK_MKEY),
        (wqe::UMR_MASK_QPN, sys::MLX5_WQE_UMR_CTRL_MKEY_MASK_QPN),
        (wqe::UMR_MASK_FREE, sys::MLX5_WQE_UMR_CTRL_MKEY_MASK_FREE),
        (wqe::MKEY_FREE as u64, sys::MLX5_WQE_MKEY_CONTEXT_FREE),
        (
            wqe::MKEY_ACCESS_ATOMIC as u64,
            sys::MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_ATOMIC,
        ),
        (
            wqe::MKEY_ACCESS_REMOTE_WRITE as u64,
            sys::MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_REMOTE_WRITE,
        ),
        (
            wqe::MKEY_ACCESS_REMOTE_READ as u64,
            sys::MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_REMOTE_READ,
        ),
    ];
    for (ours, theirs) in consts {
        assert_eq!(ours, theirs as u64);
    }
    assert_eq!(
        wqe::MKEY_ACCESS_LOCAL_WRITE as u32,
        sys::MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_LOCAL_WRITE
    );
    let access = sys::MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_LOCAL_WRITE
        | sys::MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_REMOTE_READ
        | sys::MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_REMOTE_WRITE
        | sys::MLX5_WQE_UMR_CTRL_MKEY_MASK_ACCESS_ATOMIC;
    assert_eq!(wqe::UMR_MASK_ACCESS, access as u64);
}
