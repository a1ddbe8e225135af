//! The PRM structures gpuverbs reads or writes, field by field (bit offset, width), with the
//! byte offset at which each structure sits inside its command's mailbox.

use super::Field;

macro_rules! layout {
    ($(#[$m:meta])* $module:ident = $prm:literal { $($name:ident: $bit:literal, $width:literal;)* }) => {
        $(#[$m])*
        #[allow(missing_docs)]
        pub mod $module {
            use super::Field;
            $(pub const $name: Field = Field::new($bit, $width);)*
            /// Every field above, with its name in rdma-core's description ("" where rdma-core
            /// has none: the layout check then skips the structure).
            pub const FIELDS: (&str, &[(&str, Field)]) = ($prm, &[$((stringify!($name), $name)),*]);
        }
    };
}

layout! {
    /// The header of every command's in-mailbox.
    cmd_in = "QueryQpIn" {
        OPCODE: 0, 16;
        UID: 16, 16;
        OP_MOD: 48, 16;
    }
}

layout! {
    /// The header of every command's out-mailbox.
    cmd_out = "QueryQpOut" {
        STATUS: 0, 8;
        SYNDROME: 32, 32;
    }
}

/// Where the capability structure starts in QUERY_HCA_CAP's out-mailbox.
pub const HCA_CAP_AT: u32 = 16;
/// QUERY_HCA_CAP's out-mailbox size (header + a 4 KiB capability page).
pub const QUERY_HCA_CAP_OUT: usize = 16 + 4096;

layout! {
    /// `cmd_hca_cap`: the general device capabilities (QUERY_HCA_CAP op_mod 0/1).
    hca_cap = "CmdHcaCap" {
        HCA_CAP_2: 32, 1;
        VHCA_ID: 48, 16;
        QP_DATA_IN_ORDER: 98, 1;
        LOG_MAX_SRQ_SZ: 128, 8;
        LOG_MAX_QP_SZ: 136, 8;
        LOG_MAX_QP: 155, 5;
        LOG_MAX_CQ_SZ: 200, 8;
        LOG_MAX_CQ: 219, 5;
        LOG_MAX_EQ: 252, 4;
        LOG_MAX_MKEY: 234, 6;
        RELAXED_ORDERING_WRITE: 232, 1;
        RELAXED_ORDERING_READ: 233, 1;
        LOG_MAX_MRW_SZ: 265, 7;
        LOG_MAX_RA_REQ_DC: 298, 6;
        LOG_MAX_RA_RES_DC: 314, 6;
        LOG_MAX_RA_REQ_QP: 330, 6;
        LOG_MAX_RA_RES_QP: 346, 6;
        END_PAD: 352, 1;
        RTS2RTS_QP_DSCP: 362, 1;
        GID_TABLE_SIZE: 368, 16;
        PKEY_TABLE_SIZE: 400, 16;
        VPORT_GROUP_MANAGER: 416, 1;
        NIC_FLOW_TABLE: 422, 1;
        PORT_TYPE: 438, 2;
        NUM_PORTS: 440, 8;
        LOG_MAX_MSG: 451, 5;
        MAX_TC: 460, 4;
        CQE_VERSION: 508, 4;
        SHO: 535, 1;
        DCT: 538, 1;
        QOS: 539, 1;
        ETH_NET_OFFLOADS: 540, 1;
        ROCE: 541, 1;
        ATOMIC: 542, 1;
        CQ_OI: 544, 1;
        CQ_RESIZE: 545, 1;
        BLOCK_LB_MC: 552, 1;
        CD: 556, 1;
        XRC: 572, 1;
        UD: 573, 1;
        UC: 574, 1;
        RC: 575, 1;
        UAR_4K: 576, 1;
        LOG_PG_SZ: 600, 8;
        LAG_TX_PORT_AFFINITY: 632, 1;
        LOG_BF_REG_SIZE: 619, 5;
        NUM_LAG_PORTS: 636, 4;
        MAX_WQE_SZ_SQ: 656, 16;
        MAX_WQE_SZ_RQ: 688, 16;
        LOG_MAX_TRANSPORT_DOMAIN: 803, 5;
        LOG_MAX_PD: 811, 5;
        LOG_MAX_XRCD: 827, 5;
        GENERAL_OBJ_TYPES: 1024, 64;
        LOG_MAX_UCTX: 1123, 5;
        CRYPTO: 1129, 1;
        LOG_MAX_UMEM: 1131, 5;
        CQE_COMPRESSION: 1471, 1;
    }
}

layout! {
    /// `atomic_caps` (QUERY_HCA_CAP op_mod 6/7).
    atomic_cap = "" {
        ATOMIC_REQ_8B_ENDIANNESS_MODE: 64, 2;
        SUPPORTED_ATOMIC_REQ_8B_ENDIANNESS_MODE_1: 70, 1;
        ATOMIC_OPERATIONS: 144, 16;
        ATOMIC_SIZE_QP: 176, 16;
        ATOMIC_SIZE_DC: 208, 16;
    }
}

layout! {
    /// `roce_cap` (QUERY_HCA_CAP op_mod 8/9).
    roce_cap = "" {
        R_ROCE_MAX_SRC_UDP_PORT: 192, 16;
        R_ROCE_MIN_SRC_UDP_PORT: 208, 16;
        ROCE_ADDRESS_TABLE_SIZE: 240, 16;
    }
}

layout! {
    /// `cmd_hca_cap_2` (QUERY_HCA_CAP op_mod 0x40/0x41).
    hca_cap_2 = "" {
        SEND_DBR_MODE_NO_DBR_EXT: 737, 1;
    }
}

/// Where the CQ context starts in CREATE_CQ's in-mailbox and QUERY_CQ's out-mailbox.
pub const CQC_AT: u32 = 16;
/// CREATE_CQ's in-mailbox without a page list (what DEVX users send).
pub const CREATE_CQ_IN: usize = 272;

layout! {
    /// `cqc`: the CQ context.
    cqc = "SwCqc" {
        STATUS: 0, 4;
        DBR_UMEM_VALID: 6, 1;
        CQE_SZ: 8, 3;
        CC: 11, 1;
        OI: 14, 1;
        CQ_PERIOD_MODE: 15, 2;
        CQE_COMPRESSION_EN: 17, 1;
        MINI_CQE_RES_FORMAT: 18, 2;
        ST: 20, 4;
        DBR_UMEM_ID: 32, 32;
        PAGE_OFFSET: 84, 6;
        LOG_CQ_SIZE: 99, 5;
        UAR_PAGE: 104, 24;
        CQ_PERIOD: 132, 12;
        CQ_MAX_COUNT: 144, 16;
        C_EQN: 184, 8;
        LOG_PAGE_SIZE: 195, 5;
        LAST_NOTIFIED_INDEX: 264, 24;
        CONSUMER_COUNTER: 328, 24;
        PRODUCER_COUNTER: 360, 24;
        DBR_ADDR: 448, 64;
    }
}

layout! {
    /// CREATE_CQ's in-mailbox (the CQ context at [`CQC_AT`]).
    create_cq_in = "CreateCqIn" {
        CQ_UMEM_OFFSET: 640, 64;
        CQ_UMEM_ID: 704, 32;
        CQ_UMEM_VALID: 736, 1;
    }
}

layout! {
    /// The object number in the out-mailbox of CREATE_CQ / CREATE_QP and the in-mailbox of
    /// the commands that name one (DESTROY_*, QUERY_*, the QP transitions).
    obj = "CreateCqOut" {
        CQN: 72, 24;
    }
}

layout! {
    /// Fields of the QP context rdma-core's description has as reserved: the send doorbell
    /// record mode, a DC initiator's stream counts (kernel `mlx5_ifc.h`).
    qpc_ext = "" {
        SEND_DBR_MODE: 128, 2;
        LOG_NUM_DCI_STREAM_CHANNELS: 995, 5;
        LOG_NUM_DCI_ERRORED_STREAMS: 1027, 5;
    }
}

/// Where the DC target context starts in CREATE_DCT's in-mailbox and QUERY_DCT's out-mailbox.
pub const DCTC_AT: u32 = 16;
/// CREATE_DCT's in-mailbox (header and context).
pub const CREATE_DCT_IN: usize = 16 + 112;
/// QUERY_DCT's out-mailbox.
pub const QUERY_DCT_OUT: usize = 16 + 112;

layout! {
    /// `dctc`: the DC target context.
    dctc = "" {
        STATE: 4, 4;
        USER_INDEX: 40, 24;
        CQN: 72, 24;
        COUNTER_SET_ID: 96, 8;
        ATOMIC_MODE: 104, 4;
        RRE: 108, 1;
        RWE: 109, 1;
        RAE: 110, 1;
        CS_RES: 136, 8;
        MIN_RNR_NAK: 147, 5;
        SRQN_XRQN: 168, 24;
        PD: 200, 24;
        TCLASS: 224, 8;
        FLOW_LABEL: 236, 20;
        DC_ACCESS_KEY: 256, 64;
        MTU: 325, 3;
        PORT: 328, 8;
        PKEY_INDEX: 336, 16;
        MY_ADDR_INDEX: 360, 8;
        HOP_LIMIT: 376, 8;
        DC_ACCESS_KEY_VIOLATION_COUNT: 384, 32;
    }
}

/// Where the QP context starts in CREATE_QP's and the transitions' in-mailboxes and in
/// QUERY_QP's out-mailbox.
pub const QPC_AT: u32 = 24;
/// Where the primary address path starts in the QP context.
pub const ADS_AT: u32 = 24;
/// The in-mailbox of CREATE_QP and of every QP transition, without a page list.
pub const QP_IN: usize = 272;
/// QUERY_QP's out-mailbox without a page list.
pub const QUERY_QP_OUT: usize = 272;

layout! {
    /// `qpc`: the QP context.
    qpc = "SwQpc" {
        STATE: 0, 4;
        ST: 8, 8;
        PM_STATE: 19, 2;
        OFFLOAD_TYPE: 24, 4;
        END_PADDING_MODE: 28, 2;
        WQ_SIGNATURE: 32, 1;
        BLOCK_LB_MC: 33, 1;
        ATOMIC_LIKE_WRITE_EN: 34, 1;
        LATENCY_SENSITIVE: 35, 1;
        DRAIN_SIGERR: 37, 1;
        PD: 40, 24;
        MTU: 64, 3;
        LOG_MSG_MAX: 67, 5;
        LOG_RQ_SIZE: 73, 4;
        LOG_RQ_STRIDE: 77, 3;
        NO_SQ: 80, 1;
        LOG_SQ_SIZE: 81, 4;
        RETRY_MODE: 86, 2;
        TS_FORMAT: 88, 2;
        DATA_IN_ORDER: 90, 1;
        COUNTER_SET_ID: 96, 8;
        UAR_PAGE: 104, 24;
        USER_INDEX: 136, 24;
        LOG_PAGE_SIZE: 163, 5;
        REMOTE_QPN: 168, 24;
        LOG_ACK_REQ_FREQ: 896, 4;
        LOG_SRA_MAX: 904, 3;
        RETRY_COUNT: 909, 3;
        RNR_RETRY: 912, 3;
        FRE: 916, 1;
        NEXT_SEND_PSN: 968, 24;
        CQN_SND: 1000, 24;
        DETH_SQPN: 1032, 24;
        LAST_ACKED_PSN: 1096, 24;
        SSN: 1128, 24;
        LOG_RRA_MAX: 1160, 3;
        ATOMIC_MODE: 1164, 4;
        RRE: 1168, 1;
        RWE: 1169, 1;
        RAE: 1170, 1;
        PAGE_OFFSET: 1172, 6;
        CD_SLAVE_RECEIVE: 1181, 1;
        CD_SLAVE_SEND: 1182, 1;
        CD_MASTER: 1183, 1;
        MIN_RNR_NAK: 1187, 5;
        NEXT_RCV_PSN: 1192, 24;
        XRCD: 1224, 24;
        CQN_RCV: 1256, 24;
        DBR_ADDR: 1280, 64;
        Q_KEY: 1344, 32;
        RQ_TYPE: 1381, 3;
        SRQN_RMPN_XRQN: 1384, 24;
        HW_SQ_WQEBB_COUNTER: 1440, 16;
        SW_SQ_WQEBB_COUNTER: 1456, 16;
        HW_RQ_COUNTER: 1472, 32;
        SW_RQ_COUNTER: 1504, 32;
        CS_REQ: 1584, 8;
        CS_RES: 1592, 8;
        DBR_UMEM_VALID: 1667, 1;
        DBR_UMEM_ID: 1824, 32;
    }
}

layout! {
    /// `ads`: an address path (the QP context's primary path at [`ADS_AT`]).
    ads = "SwAds" {
        FL: 0, 1;
        FREE_AR: 1, 1;
        PKEY_INDEX: 16, 16;
        GRH: 40, 1;
        MLID: 41, 7;
        RLID: 48, 16;
        ACK_TIMEOUT: 64, 5;
        SRC_ADDR_INDEX: 72, 8;
        LOG_RTM: 80, 4;
        STAT_RATE: 84, 4;
        HOP_LIMIT: 88, 8;
        TCLASS: 100, 8;
        FLOW_LABEL: 108, 20;
        RGID_RIP: 128, 128;
        DSCP: 266, 6;
        UDP_SPORT: 272, 16;
        ETH_PRIO: 289, 3;
        SL: 292, 4;
        VHCA_PORT_NUM: 296, 8;
        RMAC: 304, 48;
    }
}

layout! {
    /// CREATE_QP's in-mailbox (the QP context at [`QPC_AT`]).
    create_qp_in = "CreateQpIn" {
        INPUT_QPN: 72, 24;
        OPT_PARAM_MASK: 128, 32;
        WQ_UMEM_OFFSET: 2048, 64;
        WQ_UMEM_ID: 2112, 32;
        WQ_UMEM_VALID: 2144, 1;
    }
}

layout! {
    /// The in-mailbox of a QP transition (RST2INIT, INIT2RTR, ...; the QP context at
    /// [`QPC_AT`]).
    modify_qp_in = "ModifyQpIn" {
        QPN: 72, 24;
        OPT_PARAM_MASK: 128, 32;
        ECE: 160, 32;
    }
}

layout! {
    /// QUERY_QP's out-mailbox (the QP context at [`QPC_AT`]).
    query_qp_out = "QueryQpOut" {
        OPT_PARAM_MASK: 128, 32;
    }
}

/// Where the HCA vport context starts in QUERY_HCA_VPORT_CONTEXT's out-mailbox.
pub const HCA_VPORT_CONTEXT_AT: u32 = 16;

layout! {
    /// QUERY_HCA_VPORT_CONTEXT's in-mailbox.
    query_hca_vport_context_in = "QueryHcaVportContextIn" {
        OTHER_VPORT: 64, 1;
        PORT_NUM: 76, 4;
        VPORT_NUMBER: 80, 16;
    }
}

layout! {
    /// `hca_vport_context`.
    hca_vport_context = "HcaVportContext" {
        FIELD_SELECT: 0, 32;
        SM_VIRT_AWARE: 256, 1;
        HAS_SMI: 257, 1;
        HAS_RAW: 258, 1;
        PORT_PHYSICAL_STATE: 272, 4;
        VPORT_STATE_POLICY: 276, 4;
        PORT_STATE: 280, 4;
        VPORT_STATE: 284, 4;
        SYSTEM_IMAGE_GUID: 320, 64;
        PORT_GUID: 384, 64;
        NODE_GUID: 448, 64;
        CAP_MASK1: 512, 32;
        LID: 768, 16;
        INIT_TYPE_REPLY: 788, 4;
        LMC: 792, 3;
        SUBNET_TIMEOUT: 795, 5;
        SM_LID: 800, 16;
        SM_SL: 816, 4;
        QKEY_VIOLATION_COUNTER: 832, 16;
        PKEY_VIOLATION_COUNTER: 848, 16;
    }
}

/// Where the RoCE address starts in QUERY_ROCE_ADDRESS's out-mailbox.
pub const ROCE_ADDR_AT: u32 = 16;

layout! {
    /// QUERY_ROCE_ADDRESS's in-mailbox.
    query_roce_address_in = "" {
        ROCE_ADDRESS_INDEX: 64, 16;
    }
}

layout! {
    /// `roce_addr_layout`.
    roce_addr = "" {
        SOURCE_L3_ADDRESS: 0, 128;
        SOURCE_MAC: 144, 48;
        ROCE_L3_TYPE: 212, 4;
        ROCE_VERSION: 216, 8;
    }
}

/// Where the mkey context starts in CREATE_MKEY's in-mailbox.
pub const MKC_AT: u32 = 16;

layout! {
    /// `mkc`: the memory key context.
    mkc = "SwMkc" {
        FREE: 1, 1;
        ACCESS_MODE_4_2: 3, 3;
        UMR_EN: 16, 1;
        A: 17, 1;
        RW: 18, 1;
        RR: 19, 1;
        LW: 20, 1;
        LR: 21, 1;
        ACCESS_MODE_1_0: 22, 2;
        QPN: 32, 24;
        MKEY_7_0: 56, 8;
        LENGTH64: 96, 1;
        BSF_EN: 97, 1;
        EN_RINVAL: 103, 1;
        PD: 104, 24;
        START_ADDR: 128, 64;
        LEN: 192, 64;
        BSF_OCTWORD_SIZE: 256, 32;
        TRANSLATIONS_OCTWORD_SIZE: 416, 32;
    }
}

/// `mkc` access modes (`access_mode_1_0`, with `access_mode_4_2` 0).
pub mod mkc_access_mode {
    /// Physical addresses.
    pub const PA: u64 = 0;
    /// Memory translation table (a direct mkey on pages).
    pub const MTT: u64 = 1;
    /// KLM list (an indirect mkey).
    pub const KLMS: u64 = 2;
    /// KSM list (fixed-size entries).
    pub const KSM: u64 = 3;
}

layout! {
    /// CREATE_MKEY's in-mailbox (the mkey context at [`MKC_AT`]).
    create_mkey_in = "CreateMkeyIn" {
        INPUT_MKEY_INDEX: 72, 24;
        PG_ACCESS: 96, 1;
        MKEY_UMEM_VALID: 97, 1;
    }
}

layout! {
    /// CREATE_MKEY's out-mailbox.
    create_mkey_out = "CreateMkeyOut" {
        MKEY_INDEX: 72, 24;
    }
}

/// Every structure's field table, for the layout check against rdma-core.
pub const ALL: &[(&str, &[(&str, Field)])] = &[
    cmd_in::FIELDS,
    cmd_out::FIELDS,
    hca_cap::FIELDS,
    atomic_cap::FIELDS,
    roce_cap::FIELDS,
    hca_cap_2::FIELDS,
    cqc::FIELDS,
    create_cq_in::FIELDS,
    obj::FIELDS,
    qpc::FIELDS,
    ads::FIELDS,
    create_qp_in::FIELDS,
    modify_qp_in::FIELDS,
    query_qp_out::FIELDS,
    query_hca_vport_context_in::FIELDS,
    hca_vport_context::FIELDS,
    query_roce_address_in::FIELDS,
    roce_addr::FIELDS,
    mkc::FIELDS,
    create_mkey_in::FIELDS,
    create_mkey_out::FIELDS,
];
