//! The kernel's uverbs command ABI (`<rdma/ib_user_verbs.h>`) and the mlx5 driver data that
//! rides with it (`<rdma/mlx5-abi.h>`), as `#[repr(C)]` plain-old-data structs. Layouts are
//! the UAPI headers' (checked by size asserts against the Debian 12 headers, kernel UAPI as of
//! rdma-core 44); only the commands the emulation serves are here.

use bytemuck::{Pod, Zeroable};

/// `IB_USER_VERBS_CMD_FLAG_EXTENDED`: the command has an `ib_uverbs_ex_cmd_hdr`.
pub const CMD_FLAG_EXTENDED: u32 = 0x8000_0000;
/// The command number bits of `ib_uverbs_cmd_hdr::command`.
pub const CMD_MASK: u32 = 0xff;

/// Legacy (`write()`) command numbers, `enum ib_uverbs_write_cmds`.
pub mod cmd {
    pub const GET_CONTEXT: u32 = 0;
    pub const QUERY_DEVICE: u32 = 1;
    pub const QUERY_PORT: u32 = 2;
    pub const ALLOC_PD: u32 = 3;
    pub const DEALLOC_PD: u32 = 4;
    pub const CREATE_AH: u32 = 5;
    pub const DESTROY_AH: u32 = 8;
    pub const REG_MR: u32 = 9;
    pub const REREG_MR: u32 = 11;
    pub const DEREG_MR: u32 = 13;
    pub const ALLOC_MW: u32 = 14;
    pub const DEALLOC_MW: u32 = 16;
    pub const CREATE_COMP_CHANNEL: u32 = 17;
    pub const CREATE_CQ: u32 = 18;
    pub const RESIZE_CQ: u32 = 19;
    pub const DESTROY_CQ: u32 = 20;
    pub const POLL_CQ: u32 = 21;
    pub const REQ_NOTIFY_CQ: u32 = 23;
    pub const CREATE_QP: u32 = 24;
    pub const QUERY_QP: u32 = 25;
    pub const MODIFY_QP: u32 = 26;
    pub const DESTROY_QP: u32 = 27;
    pub const ATTACH_MCAST: u32 = 30;
    pub const DETACH_MCAST: u32 = 31;
    pub const CREATE_SRQ: u32 = 32;
    pub const MODIFY_SRQ: u32 = 33;
    pub const QUERY_SRQ: u32 = 34;
    pub const DESTROY_SRQ: u32 = 35;
    pub const OPEN_XRCD: u32 = 37;
    pub const CLOSE_XRCD: u32 = 38;
    pub const CREATE_XSRQ: u32 = 39;
    pub const OPEN_QP: u32 = 40;
}

/// Extended command numbers, `enum ib_uverbs_ex_write_cmds`.
pub mod ex_cmd {
    pub const QUERY_DEVICE: u32 = 1;
    pub const CREATE_CQ: u32 = 18;
    pub const CREATE_QP: u32 = 24;
    pub const MODIFY_QP: u32 = 26;
    pub const CREATE_FLOW: u32 = 50;
    pub const DESTROY_FLOW: u32 = 51;
    pub const CREATE_WQ: u32 = 52;
    pub const MODIFY_WQ: u32 = 53;
    pub const DESTROY_WQ: u32 = 54;
    pub const CREATE_RWQ_IND_TBL: u32 = 55;
    pub const DESTROY_RWQ_IND_TBL: u32 = 56;
    pub const MODIFY_CQ: u32 = 57;
}

/// The name of a legacy command, for messages.
pub fn cmd_name(c: u32) -> &'static str {
    match c {
        0 => "GET_CONTEXT",
        1 => "QUERY_DEVICE",
        2 => "QUERY_PORT",
        3 => "ALLOC_PD",
        4 => "DEALLOC_PD",
        5 => "CREATE_AH",
        6 => "MODIFY_AH",
        7 => "QUERY_AH",
        8 => "DESTROY_AH",
        9 => "REG_MR",
        10 => "REG_SMR",
        11 => "REREG_MR",
        12 => "QUERY_MR",
        13 => "DEREG_MR",
        14 => "ALLOC_MW",
        15 => "BIND_MW",
        16 => "DEALLOC_MW",
        17 => "CREATE_COMP_CHANNEL",
        18 => "CREATE_CQ",
        19 => "RESIZE_CQ",
        20 => "DESTROY_CQ",
        21 => "POLL_CQ",
        22 => "PEEK_CQ",
        23 => "REQ_NOTIFY_CQ",
        24 => "CREATE_QP",
        25 => "QUERY_QP",
        26 => "MODIFY_QP",
        27 => "DESTROY_QP",
        28 => "POST_SEND",
        29 => "POST_RECV",
        30 => "ATTACH_MCAST",
        31 => "DETACH_MCAST",
        32 => "CREATE_SRQ",
        33 => "MODIFY_SRQ",
        34 => "QUERY_SRQ",
        35 => "DESTROY_SRQ",
        36 => "POST_SRQ_RECV",
        37 => "OPEN_XRCD",
        38 => "CLOSE_XRCD",
        39 => "CREATE_XSRQ",
        40 => "OPEN_QP",
        _ => "unknown",
    }
}

/// The name of an extended command, for messages.
pub fn ex_cmd_name(c: u32) -> &'static str {
    match c {
        1 => "EX_QUERY_DEVICE",
        18 => "EX_CREATE_CQ",
        24 => "EX_CREATE_QP",
        26 => "EX_MODIFY_QP",
        50 => "EX_CREATE_FLOW",
        51 => "EX_DESTROY_FLOW",
        52 => "EX_CREATE_WQ",
        53 => "EX_MODIFY_WQ",
        54 => "EX_DESTROY_WQ",
        55 => "EX_CREATE_RWQ_IND_TBL",
        56 => "EX_DESTROY_RWQ_IND_TBL",
        57 => "EX_MODIFY_CQ",
        _ => "EX_unknown",
    }
}

macro_rules! pod {
    ($(#[$m:meta])* $name:ident [$size:expr] { $($(#[$fm:meta])* $f:ident : $t:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
        pub struct $name { $($(#[$fm])* pub $f: $t),* }
        const _: () = assert!(std::mem::size_of::<$name>() == $size);
    };
}

pod!(
    /// `struct ib_uverbs_cmd_hdr`.
    CmdHdr[8] { command: u32, in_words: u16, out_words: u16 }
);
pod!(
    /// `struct ib_uverbs_ex_cmd_hdr`.
    ExCmdHdr[16] { response: u64, provider_in_words: u16, provider_out_words: u16, cmd_hdr_reserved: u32 }
);
pod!(
    /// A command whose only field is its response pointer (GET_CONTEXT, QUERY_DEVICE,
    /// ALLOC_PD, CREATE_COMP_CHANNEL).
    RespOnly[8] { response: u64 }
);
pod!(
    /// `struct ib_uverbs_get_context_resp`.
    GetContextResp[8] { async_fd: u32, num_comp_vectors: u32 }
);
pod!(
    /// `struct ib_uverbs_query_device_resp`.
    QueryDeviceResp[176] {
        fw_ver: u64, node_guid: u64, sys_image_guid: u64, max_mr_size: u64, page_size_cap: u64,
        vendor_id: u32, vendor_part_id: u32, hw_ver: u32, max_qp: u32, max_qp_wr: u32,
        device_cap_flags: u32, max_sge: u32, max_sge_rd: u32, max_cq: u32, max_cqe: u32,
        max_mr: u32, max_pd: u32, max_qp_rd_atom: u32, max_ee_rd_atom: u32, max_res_rd_atom: u32,
        max_qp_init_rd_atom: u32, max_ee_init_rd_atom: u32, atomic_cap: u32, max_ee: u32,
        max_rdd: u32, max_mw: u32, max_raw_ipv6_qp: u32, max_raw_ethy_qp: u32, max_mcast_grp: u32,
        max_mcast_qp_attach: u32, max_total_mcast_qp_attach: u32, max_ah: u32, max_fmr: u32,
        max_map_per_fmr: u32, max_srq: u32, max_srq_wr: u32, max_srq_sge: u32, max_pkeys: u16,
        local_ca_ack_delay: u8, phys_port_cnt: u8, reserved: [u8; 4],
    }
);
pod!(
    /// `struct ib_uverbs_ex_query_device` (after the ex header).
    ExQueryDevice[8] { comp_mask: u32, reserved: u32 }
);
pod!(
    /// `struct ib_uverbs_ex_query_device_resp`.
    ExQueryDeviceResp[304] {
        base: QueryDeviceResp, comp_mask: u32, response_length: u32,
        odp_general_caps: u64, odp_rc: u32, odp_uc: u32, odp_ud: u32, odp_reserved: u32,
        timestamp_mask: u64, hca_core_clock: u64, device_cap_flags_ex: u64,
        rss_supported_qpts: u32, rss_max_tables: u32, rss_max_table_size: u32, rss_reserved: u32,
        max_wq_type_rq: u32, raw_packet_caps: u32,
        tm_max_rndv_hdr_size: u32, tm_max_num_tags: u32, tm_flags: u32, tm_max_ops: u32,
        tm_max_sge: u32, tm_reserved: u32,
        max_cq_moderation_count: u16, max_cq_moderation_period: u16, cq_mod_reserved: u32,
        max_dm_size: u64, xrc_odp_caps: u32, reserved: u32,
    }
);
pod!(
    /// `struct ib_uverbs_query_port`.
    QueryPort[16] { response: u64, port_num: u8, reserved: [u8; 7] }
);
pod!(
    /// `struct ib_uverbs_query_port_resp`.
    QueryPortResp[40] {
        port_cap_flags: u32, max_msg_sz: u32, bad_pkey_cntr: u32, qkey_viol_cntr: u32,
        gid_tbl_len: u32, pkey_tbl_len: u16, lid: u16, sm_lid: u16, state: u8, max_mtu: u8,
        active_mtu: u8, lmc: u8, max_vl_num: u8, sm_sl: u8, subnet_timeout: u8,
        init_type_reply: u8, active_width: u8, active_speed: u8, phys_state: u8,
        link_layer: u8, flags: u8, reserved: u8,
    }
);
pod!(
    /// `struct ib_uverbs_alloc_pd_resp`.
    AllocPdResp[4] { pd_handle: u32 }
);
pod!(
    /// A command naming one object (DEALLOC_PD, DEREG_MR, DEALLOC_MW, DESTROY_AH).
    Handle[4] { handle: u32 }
);
pod!(
    /// `struct ib_uverbs_attach_mcast` (DETACH_MCAST's `ib_uverbs_detach_mcast` is the same).
    AttachMcast[24] { gid: [u8; 16], qp_handle: u32, mlid: u16, reserved: u16 }
);
pod!(
    /// `struct ib_uverbs_reg_mr`.
    RegMr[40] { response: u64, start: u64, length: u64, hca_va: u64, pd_handle: u32, access_flags: u32 }
);
pod!(
    /// `struct ib_uverbs_reg_mr_resp`.
    RegMrResp[12] { mr_handle: u32, lkey: u32, rkey: u32 }
);
pod!(
    /// `struct ib_uverbs_ioctl_hdr` (the ioctl command path), then `num_attrs` attributes.
    IoctlHdr[24] {
        length: u16, object_id: u16, method_id: u16, num_attrs: u16, reserved1: u64,
        driver_id: u32, reserved2: u32,
    }
);
pod!(
    /// `struct ib_uverbs_attr`: an attribute of an ioctl command (a value of at most 8 bytes
    /// inline in `data`, else `data` points at it; an object handle; a file descriptor).
    IoctlAttr[16] { attr_id: u16, len: u16, flags: u16, attr_data: u16, data: u64 }
);

/// The ioctl command path (`<rdma/rdma_user_ioctl_cmds.h>`, `<rdma/ib_user_ioctl_cmds.h>`).
pub mod ioctl {
    /// `RDMA_VERBS_IOCTL`: `_IOWR(0x1b, 1, struct ib_uverbs_ioctl_hdr)`.
    pub const RDMA_VERBS_IOCTL: libc::c_ulong = 3 << 30 | 24 << 16 | 0x1b << 8 | 1;
    /// `UVERBS_OBJECT_MR`.
    pub const OBJECT_MR: u16 = 7;
    /// `UVERBS_METHOD_REG_DMABUF_MR`.
    pub const METHOD_REG_DMABUF_MR: u16 = 4;
    /// `UVERBS_OBJECT_DEVICE`.
    pub const OBJECT_DEVICE: u16 = 0;
    /// `UVERBS_METHOD_QUERY_CONTEXT` (what `ibv_import_device` asks of a shared fd).
    pub const METHOD_QUERY_CONTEXT: u16 = 4;
    /// `UVERBS_ATTR_F_VALID_OUTPUT`: set on an output attribute the kernel wrote.
    pub const ATTR_F_VALID_OUTPUT: u16 = 1 << 1;
    /// The attributes of REG_DMABUF_MR (`enum uverbs_attrs_reg_dmabuf_mr_cmd_attr_ids`).
    pub mod reg_dmabuf_mr {
        pub const HANDLE: u16 = 0;
        pub const PD_HANDLE: u16 = 1;
        pub const OFFSET: u16 = 2;
        pub const LENGTH: u16 = 3;
        pub const IOVA: u16 = 4;
        pub const FD: u16 = 5;
        pub const ACCESS_FLAGS: u16 = 6;
        pub const RESP_LKEY: u16 = 7;
        pub const RESP_RKEY: u16 = 8;
    }
}

/// The mlx5 driver's ioctl objects (`<rdma/mlx5_user_ioctl_cmds.h>`): DEVX, its objects and
/// umems, and dynamically allocated UARs. Driver ids start at `1 << 12`.
pub mod mlx5_ioctl {
    /// `MLX5_IB_OBJECT_DEVX`: device-wide methods.
    pub const OBJECT_DEVX: u16 = 0x1000;
    /// `MLX5_IB_OBJECT_DEVX_OBJ`: firmware objects made with PRM commands.
    pub const OBJECT_DEVX_OBJ: u16 = 0x1001;
    /// `MLX5_IB_OBJECT_DEVX_UMEM`: memory registered for firmware objects.
    pub const OBJECT_DEVX_UMEM: u16 = 0x1002;
    /// `MLX5_IB_OBJECT_UAR`: UAR pages allocated on demand.
    pub const OBJECT_UAR: u16 = 0x1008;

    /// mlx5_ib's method on the core device object (`UVERBS_OBJECT_DEVICE`):
    /// `mlx5dv_query_port`.
    pub mod device {
        /// `MLX5_IB_METHOD_QUERY_PORT`.
        pub const QUERY_PORT: u16 = 0x1000;
        /// `MLX5_IB_ATTR_QUERY_PORT_PORT_NUM` (u32 in).
        pub const PORT_NUM: u16 = 0x1000;
        /// `MLX5_IB_ATTR_QUERY_PORT` (`struct mlx5_ib_uapi_query_port` out).
        pub const PORT: u16 = 0x1001;
        /// `sizeof(struct mlx5_ib_uapi_query_port)`: flags, vport, vport_vhca_id,
        /// esw_owner_vhca_id, rsvd0, the two steering ICM addresses, reg_c0 value and mask.
        pub const PORT_LEN: usize = 40;
    }

    /// Methods of [`OBJECT_DEVX`].
    pub mod devx {
        pub const OTHER: u16 = 0x1000;
        pub const QUERY_UAR: u16 = 0x1001;
        pub const QUERY_EQN: u16 = 0x1002;
        /// OTHER's attributes.
        pub const CMD_IN: u16 = 0x1000;
        pub const CMD_OUT: u16 = 0x1001;
        /// QUERY_UAR's and QUERY_EQN's attributes (input, output).
        pub const QUERY_IN: u16 = 0x1000;
        pub const QUERY_OUT: u16 = 0x1001;
    }

    /// Methods and attributes of [`OBJECT_DEVX_OBJ`].
    pub mod obj {
        pub const CREATE: u16 = 0x1000;
        pub const DESTROY: u16 = 0x1001;
        pub const MODIFY: u16 = 0x1002;
        pub const QUERY: u16 = 0x1003;
        pub const HANDLE: u16 = 0x1000;
        pub const CMD_IN: u16 = 0x1001;
        pub const CMD_OUT: u16 = 0x1002;
    }

    /// Methods and attributes of [`OBJECT_DEVX_UMEM`].
    pub mod umem {
        pub const REG: u16 = 0x1000;
        pub const DEREG: u16 = 0x1001;
        pub const HANDLE: u16 = 0x1000;
        pub const ADDR: u16 = 0x1001;
        pub const LEN: u16 = 0x1002;
        pub const ACCESS: u16 = 0x1003;
        pub const OUT_ID: u16 = 0x1004;
        pub const PGSZ_BITMAP: u16 = 0x1005;
        pub const DMABUF_FD: u16 = 0x1006;
    }

    /// Methods and attributes of [`OBJECT_UAR`].
    pub mod uar {
        pub const ALLOC: u16 = 0x1000;
        pub const DESTROY: u16 = 0x1001;
        pub const HANDLE: u16 = 0x1000;
        pub const TYPE: u16 = 0x1001;
        pub const MMAP_OFFSET: u16 = 0x1002;
        pub const MMAP_LENGTH: u16 = 0x1003;
        pub const PAGE_ID: u16 = 0x1004;
        /// `MLX5_IB_UAPI_UAR_ALLOC_TYPE_BF`: a page with BlueFlame registers.
        pub const TYPE_BF: u64 = 0;
        /// `MLX5_IB_UAPI_UAR_ALLOC_TYPE_NC`: a non-cached page (doorbells only).
        pub const TYPE_NC: u64 = 1;
    }
}

pod!(
    /// `struct ib_uverbs_alloc_mw`.
    AllocMw[16] { response: u64, pd_handle: u32, mw_type: u8, reserved: [u8; 3] }
);
pod!(
    /// `struct ib_uverbs_alloc_mw_resp`.
    AllocMwResp[8] { mw_handle: u32, rkey: u32 }
);
pod!(
    /// `struct mlx5_ib_alloc_mw` (driver data of ALLOC_MW).
    Mlx5AllocMw[8] { comp_mask: u32, num_klms: u8, reserved1: u8, reserved2: u16 }
);
pod!(
    /// `struct ib_uverbs_rereg_mr`.
    ReregMr[48] {
        response: u64, mr_handle: u32, flags: u32, start: u64, length: u64, hca_va: u64,
        pd_handle: u32, access_flags: u32,
    }
);
pod!(
    /// `struct ib_uverbs_rereg_mr_resp`.
    ReregMrResp[8] { lkey: u32, rkey: u32 }
);
pod!(
    /// `struct ib_uverbs_create_comp_channel_resp`.
    CompChannelResp[4] { fd: u32 }
);
pod!(
    /// `struct ib_uverbs_create_cq`.
    CreateCq[32] {
        response: u64, user_handle: u64, cqe: u32, comp_vector: u32, comp_channel: i32,
        reserved: u32,
    }
);
pod!(
    /// `struct ib_uverbs_create_cq_resp`.
    CreateCqResp[8] { cq_handle: u32, cqe: u32 }
);
pod!(
    /// `struct ib_uverbs_ex_create_cq` (after the ex header).
    ExCreateCq[32] {
        user_handle: u64, cqe: u32, comp_vector: u32, comp_channel: i32, comp_mask: u32,
        flags: u32, reserved: u32,
    }
);
pod!(
    /// `struct ib_uverbs_ex_create_cq_resp`.
    ExCreateCqResp[16] { cq_handle: u32, cqe: u32, comp_mask: u32, response_length: u32 }
);
pod!(
    /// `struct ib_uverbs_resize_cq`.
    ResizeCq[16] { response: u64, cq_handle: u32, cqe: u32 }
);
pod!(
    /// `struct ib_uverbs_resize_cq_resp`.
    ResizeCqResp[8] { cqe: u32, reserved: u32 }
);
pod!(
    /// `struct mlx5_ib_resize_cq`.
    Mlx5ResizeCq[16] { buf_addr: u64, cqe_size: u16, reserved0: u16, reserved1: u32 }
);
pod!(
    /// `struct ib_uverbs_create_srq`.
    CreateSrq[32] {
        response: u64, user_handle: u64, pd_handle: u32, max_wr: u32, max_sge: u32,
        srq_limit: u32,
    }
);
pod!(
    /// `struct ib_uverbs_create_xsrq`.
    CreateXsrq[48] {
        response: u64, user_handle: u64, srq_type: u32, pd_handle: u32, max_wr: u32,
        max_sge: u32, srq_limit: u32, max_num_tags: u32, xrcd_handle: u32, cq_handle: u32,
    }
);
pod!(
    /// `struct ib_uverbs_open_qp`.
    OpenQp[32] {
        response: u64, user_handle: u64, pd_handle: u32, qpn: u32, qp_type: u8,
        reserved: [u8; 7],
    }
);
pod!(
    /// `struct ib_uverbs_open_xrcd`.
    OpenXrcd[16] { response: u64, fd: u32, oflags: u32 }
);
pod!(
    /// `struct ib_uverbs_open_xrcd_resp`.
    OpenXrcdResp[4] { xrcd_handle: u32 }
);
pod!(
    /// `struct ib_uverbs_create_srq_resp`.
    CreateSrqResp[16] { srq_handle: u32, max_wr: u32, max_sge: u32, srqn: u32 }
);
pod!(
    /// `struct ib_uverbs_modify_srq`.
    ModifySrq[16] { srq_handle: u32, attr_mask: u32, max_wr: u32, srq_limit: u32 }
);
pod!(
    /// `struct ib_uverbs_query_srq`.
    QuerySrq[16] { response: u64, srq_handle: u32, reserved: u32 }
);
pod!(
    /// `struct ib_uverbs_query_srq_resp`.
    QuerySrqResp[16] { max_wr: u32, max_sge: u32, srq_limit: u32, reserved: u32 }
);
pod!(
    /// `struct mlx5_ib_create_srq`.
    Mlx5CreateSrq[32] {
        buf_addr: u64, db_addr: u64, flags: u32, reserved0: u32, uidx: u32, reserved1: u32,
    }
);
pod!(
    /// `struct mlx5_ib_create_srq_resp`.
    Mlx5CreateSrqResp[8] { srqn: u32, reserved: u32 }
);
pod!(
    /// `struct ib_uverbs_destroy_cq` (and `_qp`, `_srq`: the same shape).
    Destroy[16] { response: u64, handle: u32, reserved: u32 }
);
pod!(
    /// `struct ib_uverbs_destroy_cq_resp`.
    DestroyCqResp[8] { comp_events_reported: u32, async_events_reported: u32 }
);
pod!(
    /// `struct ib_uverbs_destroy_qp_resp`.
    DestroyQpResp[4] { events_reported: u32 }
);
pod!(
    /// `struct ib_uverbs_destroy_srq_resp`.
    DestroySrqResp[4] { events_reported: u32 }
);
pod!(
    /// `struct ib_uverbs_create_qp`.
    CreateQp[56] {
        response: u64, user_handle: u64, pd_handle: u32, send_cq_handle: u32,
        recv_cq_handle: u32, srq_handle: u32, max_send_wr: u32, max_recv_wr: u32,
        max_send_sge: u32, max_recv_sge: u32, max_inline_data: u32, sq_sig_all: u8,
        qp_type: u8, is_srq: u8, reserved: u8,
    }
);
pod!(
    /// `struct ib_uverbs_ex_create_qp` (after the ex header).
    ExCreateQp[64] {
        user_handle: u64, pd_handle: u32, send_cq_handle: u32, recv_cq_handle: u32,
        srq_handle: u32, max_send_wr: u32, max_recv_wr: u32, max_send_sge: u32,
        max_recv_sge: u32, max_inline_data: u32, sq_sig_all: u8, qp_type: u8, is_srq: u8,
        reserved: u8, comp_mask: u32, create_flags: u32, rwq_ind_tbl_handle: u32,
        source_qpn: u32,
    }
);
pod!(
    /// `struct ib_uverbs_create_qp_resp`.
    CreateQpResp[32] {
        qp_handle: u32, qpn: u32, max_send_wr: u32, max_recv_wr: u32, max_send_sge: u32,
        max_recv_sge: u32, max_inline_data: u32, reserved: u32,
    }
);
pod!(
    /// `struct ib_uverbs_ex_create_qp_resp`.
    ExCreateQpResp[40] { base: CreateQpResp, comp_mask: u32, response_length: u32 }
);
pod!(
    /// `struct ib_uverbs_qp_dest`.
    QpDest[32] {
        dgid: [u8; 16], flow_label: u32, dlid: u16, reserved: u16, sgid_index: u8,
        hop_limit: u8, traffic_class: u8, sl: u8, src_path_bits: u8, static_rate: u8,
        is_global: u8, port_num: u8,
    }
);
pod!(
    /// `struct ib_uverbs_modify_qp` (no response pointer).
    ModifyQp[112] {
        dest: QpDest, alt_dest: QpDest, qp_handle: u32, attr_mask: u32, qkey: u32,
        rq_psn: u32, sq_psn: u32, dest_qp_num: u32, qp_access_flags: u32, pkey_index: u16,
        alt_pkey_index: u16, qp_state: u8, cur_qp_state: u8, path_mtu: u8,
        path_mig_state: u8, en_sqd_async_notify: u8, max_rd_atomic: u8,
        max_dest_rd_atomic: u8, min_rnr_timer: u8, port_num: u8, timeout: u8,
        retry_cnt: u8, rnr_retry: u8, alt_port_num: u8, alt_timeout: u8, reserved: [u8; 2],
    }
);
pod!(
    /// `struct ib_uverbs_ex_modify_qp` (after the ex header).
    ExModifyQp[120] { base: ModifyQp, rate_limit: u32, reserved: u32 }
);
pod!(
    /// `struct ib_uverbs_ex_modify_qp_resp`.
    ExModifyQpResp[8] { comp_mask: u32, response_length: u32 }
);
pod!(
    /// `struct ib_uverbs_query_qp`.
    QueryQp[16] { response: u64, qp_handle: u32, attr_mask: u32 }
);
pod!(
    /// `struct ib_uverbs_query_qp_resp`.
    QueryQpResp[128] {
        dest: QpDest, alt_dest: QpDest, max_send_wr: u32, max_recv_wr: u32,
        max_send_sge: u32, max_recv_sge: u32, max_inline_data: u32, qkey: u32, rq_psn: u32,
        sq_psn: u32, dest_qp_num: u32, qp_access_flags: u32, pkey_index: u16,
        alt_pkey_index: u16, qp_state: u8, cur_qp_state: u8, path_mtu: u8,
        path_mig_state: u8, sq_draining: u8, max_rd_atomic: u8, max_dest_rd_atomic: u8,
        min_rnr_timer: u8, port_num: u8, timeout: u8, retry_cnt: u8, rnr_retry: u8,
        alt_port_num: u8, alt_timeout: u8, sq_sig_all: u8, reserved: [u8; 5],
    }
);
pod!(
    /// `struct ib_uverbs_ah_attr`.
    AhAttr[32] {
        dgid: [u8; 16], flow_label: u32, sgid_index: u8, hop_limit: u8, traffic_class: u8,
        grh_reserved: u8, dlid: u16, sl: u8, src_path_bits: u8, static_rate: u8,
        is_global: u8, port_num: u8, reserved: u8,
    }
);
pod!(
    /// `struct ib_uverbs_create_ah`.
    CreateAh[56] { response: u64, user_handle: u64, pd_handle: u32, reserved: u32, attr: AhAttr }
);
pod!(
    /// `struct ib_uverbs_create_ah_resp`.
    CreateAhResp[4] { ah_handle: u32 }
);
pod!(
    /// `struct ib_uverbs_comp_event_desc`: what a completion channel's `read()` returns.
    CompEvent[8] { cq_handle: u64 }
);
pod!(
    /// `struct ib_uverbs_async_event_desc`: what the async fd's `read()` returns.
    AsyncEvent[16] { element: u64, event_type: u32, reserved: u32 }
);

// ---- mlx5 driver data ----

pod!(
    /// `struct mlx5_ib_alloc_ucontext_req_v2`.
    Mlx5AllocUcontextReq[32] {
        total_num_bfregs: u32, num_low_latency_bfregs: u32, flags: u32, comp_mask: u32,
        max_cqe_version: u8, reserved0: u8, reserved1: u16, reserved2: u32, lib_caps: u64,
    }
);
pod!(
    /// `struct mlx5_ib_alloc_ucontext_resp`.
    Mlx5AllocUcontextResp[72] {
        qp_tab_size: u32, bf_reg_size: u32, tot_bfregs: u32, cache_line_size: u32,
        max_sq_desc_sz: u16, max_rq_desc_sz: u16, max_send_wqebb: u32, max_recv_wr: u32,
        max_srq_recv_wr: u32, num_ports: u16, flow_action_flags: u16, comp_mask: u32,
        response_length: u32, cqe_version: u8, cmds_supp_uhw: u8, eth_min_inline: u8,
        clock_info_versions: u8, hca_core_clock_offset: u64, log_uar_size: u32,
        num_uars_per_page: u32, num_dyn_bfregs: u32, dump_fill_mkey: u32,
    }
);
pod!(
    /// `struct mlx5_ib_alloc_pd_resp`.
    Mlx5AllocPdResp[4] { pdn: u32 }
);
pod!(
    /// `struct mlx5_ib_query_device_resp` (the part the emulation fills; the rest stays 0).
    Mlx5QueryDeviceResp[104] {
        comp_mask: u32, response_length: u32, rest: [u32; 24],
    }
);
pod!(
    /// `struct mlx5_ib_create_cq`.
    Mlx5CreateCq[32] {
        buf_addr: u64, db_addr: u64, cqe_size: u32, cqe_comp_en: u8, cqe_comp_res_format: u8,
        flags: u16, uar_page_index: u16, reserved0: u16, reserved1: u32,
    }
);
pod!(
    /// `struct mlx5_ib_create_cq_resp`.
    Mlx5CreateCqResp[8] { cqn: u32, reserved: u32 }
);
pod!(
    /// `struct mlx5_ib_create_qp`.
    Mlx5CreateQp[56] {
        buf_addr: u64, db_addr: u64, sq_wqe_count: u32, rq_wqe_count: u32, rq_wqe_shift: u32,
        flags: u32, uidx: u32, bfreg_index: u32, sq_buf_addr: u64, ece_options: u32,
        reserved: u32,
    }
);
pod!(
    /// `struct mlx5_ib_modify_qp_resp`: a DC target's number, given at its move to RTR.
    Mlx5ModifyQpResp[16] { response_length: u32, dctn: u32, ece_options: u32, reserved: u32 }
);
pod!(
    /// `struct mlx5_ib_create_qp_resp`.
    Mlx5CreateQpResp[40] {
        bfreg_index: u32, ece_options: u32, comp_mask: u32, tirn: u32, tisn: u32, rqn: u32,
        sqn: u32, reserved1: u32, tir_icm_addr: u64,
    }
);
pod!(
    /// `struct mlx5_ib_create_ah_resp`.
    Mlx5CreateAhResp[16] { response_length: u32, dmac: [u8; 6], reserved: [u8; 6] }
);

/// `MLX5_QP_FLAG_*` (create-QP udata flags).
pub mod mlx5_qp_flag {
    pub const SIGNATURE: u32 = 1 << 0;
    pub const SCATTER_CQE: u32 = 1 << 1;
    pub const TUNNEL_OFFLOADS: u32 = 1 << 2;
    pub const BFREG_INDEX: u32 = 1 << 3;
    pub const TYPE_DCT: u32 = 1 << 4;
    pub const TYPE_DCI: u32 = 1 << 5;
    pub const UAR_PAGE_INDEX: u32 = 1 << 10;
    pub const DCI_STREAM: u32 = 1 << 11;
    pub const ALLOW_SCATTER_CQE: u32 = 1 << 8;
}

/// `enum ib_qp_attr_mask` bits (`IBV_QP_*`).
pub mod qp_attr {
    pub const STATE: u32 = 1 << 0;
    pub const CUR_STATE: u32 = 1 << 1;
    pub const EN_SQD_ASYNC_NOTIFY: u32 = 1 << 2;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const QKEY: u32 = 1 << 6;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const ALT_PATH: u32 = 1 << 14;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const PATH_MIG_STATE: u32 = 1 << 18;
    pub const CAP: u32 = 1 << 19;
    pub const DEST_QPN: u32 = 1 << 20;
    pub const RATE_LIMIT: u32 = 1 << 25;
}

/// `enum ib_access_flags` bits.
pub mod access {
    pub const LOCAL_WRITE: u32 = 1;
    pub const REMOTE_WRITE: u32 = 2;
    pub const REMOTE_READ: u32 = 4;
    pub const REMOTE_ATOMIC: u32 = 8;
    pub const MW_BIND: u32 = 16;
    pub const ZERO_BASED: u32 = 32;
    pub const ON_DEMAND: u32 = 64;
    pub const HUGETLB: u32 = 128;
    /// `IB_ACCESS_OPTIONAL` range (relaxed ordering and friends): may be ignored.
    pub const OPTIONAL: u32 = 0x3ff0_0000;
}

/// `enum ib_event_type` values the emulation reports on the async fd.
pub mod event {
    pub const CQ_ERR: u32 = 0;
    pub const QP_FATAL: u32 = 1;
    pub const QP_REQ_ERR: u32 = 2;
    pub const QP_ACCESS_ERR: u32 = 3;
    pub const COMM_EST: u32 = 4;
    pub const SRQ_LIMIT_REACHED: u32 = 15;
    pub const QP_LAST_WQE_REACHED: u32 = 16;
}

/// `IB_SRQ_*` attribute mask bits of MODIFY_SRQ.
pub mod srq_attr {
    pub const MAX_WR: u32 = 1 << 0;
    pub const LIMIT: u32 = 1 << 1;
}

#[cfg(test)]
mod tests {
    /// The `MLX5_QP_FLAG_*` values against `<rdma/mlx5-abi.h>` where it is installed (Debian:
    /// libibverbs-dev, or rdma-core's kernel headers): a wrong bit makes a flag the provider
    /// sends look unknown (UCX's rc_mlx5 QPs carry ALLOW_SCATTER_CQE, 1 << 8).
    #[test]
    fn mlx5_qp_flags_match_the_kernel_header() {
        use super::mlx5_qp_flag as f;
        let Ok(h) = std::fs::read_to_string("/usr/include/rdma/mlx5-abi.h") else {
            eprintln!("no /usr/include/rdma/mlx5-abi.h: skipped");
            return;
        };
        let value = |name: &str| -> u32 {
            let line = h
                .lines()
                .find(|l| {
                    l.trim_start().starts_with(&format!("{name}\t")) || {
                        let t = l.trim_start();
                        t.starts_with(name) && t[name.len()..].trim_start().starts_with('=')
                    }
                })
                .unwrap_or_else(|| panic!("{name} not in the header"));
            let shift = line.split("<<").nth(1).unwrap();
            let shift: u32 = shift.trim().trim_end_matches(',').trim().parse().unwrap();
            1 << shift
        };
        for (name, v) in [
            ("MLX5_QP_FLAG_SIGNATURE", f::SIGNATURE),
            ("MLX5_QP_FLAG_SCATTER_CQE", f::SCATTER_CQE),
            ("MLX5_QP_FLAG_TUNNEL_OFFLOADS", f::TUNNEL_OFFLOADS),
            ("MLX5_QP_FLAG_BFREG_INDEX", f::BFREG_INDEX),
            ("MLX5_QP_FLAG_TYPE_DCT", f::TYPE_DCT),
            ("MLX5_QP_FLAG_TYPE_DCI", f::TYPE_DCI),
            ("MLX5_QP_FLAG_UAR_PAGE_INDEX", f::UAR_PAGE_INDEX),
            ("MLX5_QP_FLAG_ALLOW_SCATTER_CQE", f::ALLOW_SCATTER_CQE),
        ] {
            assert_eq!(value(name), v, "{name}");
        }
    }
}
