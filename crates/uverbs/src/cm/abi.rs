//! The ucma ABI (`<rdma/rdma_user_cm.h>`, ABI version 4): what librdmacm writes to
//! `/dev/infiniband/rdma_cm` — a `struct rdma_ucm_cmd_hdr` and one command struct — and the
//! responses it reads back. Layouts are checked against the sizes the header gives. Those the
//! uverbs ABI already has are taken from [`crate::abi`]: `struct rdma_ucm_destroy_id` is
//! [`Destroy`] (`ib_uverbs_destroy_cq`'s shape: a response pointer, the id's handle, 4 reserved
//! bytes), and INIT_QP_ATTR's mask bits are [`crate::abi::qp_attr`]'s.

use crate::abi::AhAttr;
pub use crate::abi::Destroy;
use bytemuck::{Pod, Zeroable};

/// Commands (`RDMA_USER_CM_CMD_*`).
pub mod cmd {
    /// CREATE_ID.
    pub const CREATE_ID: u32 = 0;
    /// DESTROY_ID.
    pub const DESTROY_ID: u32 = 1;
    /// BIND_IP.
    pub const BIND_IP: u32 = 2;
    /// RESOLVE_IP.
    pub const RESOLVE_IP: u32 = 3;
    /// RESOLVE_ROUTE.
    pub const RESOLVE_ROUTE: u32 = 4;
    /// QUERY_ROUTE.
    pub const QUERY_ROUTE: u32 = 5;
    /// CONNECT.
    pub const CONNECT: u32 = 6;
    /// LISTEN.
    pub const LISTEN: u32 = 7;
    /// ACCEPT.
    pub const ACCEPT: u32 = 8;
    /// REJECT.
    pub const REJECT: u32 = 9;
    /// DISCONNECT.
    pub const DISCONNECT: u32 = 10;
    /// INIT_QP_ATTR.
    pub const INIT_QP_ATTR: u32 = 11;
    /// GET_EVENT.
    pub const GET_EVENT: u32 = 12;
    /// GET_OPTION.
    pub const GET_OPTION: u32 = 13;
    /// SET_OPTION.
    pub const SET_OPTION: u32 = 14;
    /// NOTIFY.
    pub const NOTIFY: u32 = 15;
    /// JOIN_IP_MCAST.
    pub const JOIN_IP_MCAST: u32 = 16;
    /// LEAVE_MCAST.
    pub const LEAVE_MCAST: u32 = 17;
    /// MIGRATE_ID.
    pub const MIGRATE_ID: u32 = 18;
    /// QUERY.
    pub const QUERY: u32 = 19;
    /// BIND.
    pub const BIND: u32 = 20;
    /// RESOLVE_ADDR.
    pub const RESOLVE_ADDR: u32 = 21;
    /// JOIN_MCAST.
    pub const JOIN_MCAST: u32 = 22;
}

/// `enum rdma_ucm_port_space`.
pub mod ps {
    /// IPoIB.
    pub const IPOIB: u16 = 0x0002;
    /// Native IB.
    pub const IB: u16 = 0x013f;
    /// TCP-like (RC).
    pub const TCP: u16 = 0x0106;
    /// UDP-like (UD).
    pub const UDP: u16 = 0x0111;
}

/// QUERY options.
pub mod query {
    /// Addresses, device, port, P_Key.
    pub const ADDR: u32 = 0;
    /// Path records.
    pub const PATH: u32 = 1;
    /// GIDs as `sockaddr_ib`.
    pub const GID: u32 = 2;
}

/// `enum rdma_cm_event_type`.
pub mod event {
    /// Address resolved.
    pub const ADDR_RESOLVED: u32 = 0;
    /// Address resolution failed.
    pub const ADDR_ERROR: u32 = 1;
    /// Route resolved.
    pub const ROUTE_RESOLVED: u32 = 2;
    /// A connection request on a listener.
    pub const CONNECT_REQUEST: u32 = 4;
    /// A REP on a connecting id (the program moves its QP and accepts).
    pub const CONNECT_RESPONSE: u32 = 5;
    /// The peer did not answer.
    pub const UNREACHABLE: u32 = 7;
    /// The peer rejected.
    pub const REJECTED: u32 = 8;
    /// Connected.
    pub const ESTABLISHED: u32 = 9;
    /// Disconnected.
    pub const DISCONNECTED: u32 = 10;
    /// A multicast join completed (its address vector, Q_Key and QPN 0xFFFFFF).
    pub const MULTICAST_JOIN: u32 = 12;
}

/// `struct rdma_ucm_cmd_hdr`.
pub const HDR_LEN: usize = 8;

// `crate::abi`'s `pod!` but for `Default`, which arrays of over 32 bytes (addresses, private
// data) do not have.
macro_rules! pod {
    ($(#[$m:meta])* $name:ident [$size:expr] { $($(#[$fm:meta])* $f:ident : $t:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Pod, Zeroable)]
        pub struct $name { $($(#[$fm])* pub $f: $t),* }
        const _: () = assert!(std::mem::size_of::<$name>() == $size);
    };
}

pod!(
    /// `struct rdma_ucm_create_id`.
    CreateId[24] { uid: u64, response: u64, ps: u16, qp_type: u8, reserved: [u8; 5] }
);
pod!(
    /// `struct rdma_ucm_bind_ip`.
    BindIp[40] { response: u64, addr: [u8; 28], id: u32 }
);
pod!(
    /// `struct rdma_ucm_bind`.
    Bind[136] { id: u32, addr_size: u16, reserved: u16, addr: [u8; 128] }
);
pod!(
    /// `struct rdma_ucm_resolve_ip`.
    ResolveIp[64] { src_addr: [u8; 28], dst_addr: [u8; 28], id: u32, timeout_ms: u32 }
);
pod!(
    /// `struct rdma_ucm_resolve_addr`.
    ResolveAddr[272] {
        id: u32, timeout_ms: u32, src_size: u16, dst_size: u16, reserved: u32,
        src_addr: [u8; 128], dst_addr: [u8; 128],
    }
);
pod!(
    /// `struct rdma_ucm_resolve_route`, `rdma_ucm_listen`, `rdma_ucm_notify`: an id and a
    /// 32-bit value.
    IdAnd32[8] { id: u32, value: u32 }
);
pod!(
    /// `struct rdma_ucm_query`, `rdma_ucm_init_qp_attr`, `rdma_ucm_migrate_id`: a response
    /// pointer, an id and a 32-bit value (option, QP state, fd).
    RespIdAnd32[16] { response: u64, id: u32, value: u32 }
);
pod!(
    /// `struct ib_user_path_rec`.
    UserPathRec[64] {
        dgid: [u8; 16], sgid: [u8; 16], dlid: u16, slid: u16, raw_traffic: u32,
        flow_label: u32, reversible: u32, mtu: u32, pkey: u16, hop_limit: u8,
        traffic_class: u8, numb_path: u8, sl: u8, mtu_selector: u8, rate_selector: u8,
        rate: u8, packet_life_time_selector: u8, packet_life_time: u8, preference: u8,
    }
);
pod!(
    /// `struct rdma_ucm_query_route_resp`.
    QueryRouteResp[208] {
        node_guid: u64, ib_route: [UserPathRec; 2], src_addr: [u8; 28], dst_addr: [u8; 28],
        num_paths: u32, port_num: u8, reserved: [u8; 3], ibdev_index: u32, reserved1: u32,
    }
);
pod!(
    /// `struct rdma_ucm_query_addr_resp`.
    QueryAddrResp[280] {
        node_guid: u64, port_num: u8, reserved: u8, pkey: u16, src_size: u16, dst_size: u16,
        src_addr: [u8; 128], dst_addr: [u8; 128], ibdev_index: u32, reserved1: u32,
    }
);
pod!(
    /// `struct rdma_ucm_conn_param`.
    ConnParam[272] {
        qp_num: u32, qkey: u32, private_data: [u8; 256], private_data_len: u8, srq: u8,
        responder_resources: u8, initiator_depth: u8, flow_control: u8, retry_count: u8,
        rnr_retry_count: u8, valid: u8,
    }
);
pod!(
    /// `struct rdma_ucm_ud_param`.
    UdParam[304] {
        qp_num: u32, qkey: u32, ah_attr: AhAttr, private_data: [u8; 256],
        private_data_len: u8, reserved: [u8; 7],
    }
);
pod!(
    /// `struct rdma_ucm_connect` (the ECE fields last; librdmacm 44 sends them).
    Connect[288] { conn_param: ConnParam, id: u32, reserved: u32, ece_vendor_id: u32, ece_attr_mod: u32 }
);
pod!(
    /// `struct rdma_ucm_accept`.
    Accept[296] {
        uid: u64, conn_param: ConnParam, id: u32, reserved: u32, ece_vendor_id: u32,
        ece_attr_mod: u32,
    }
);
pod!(
    /// `struct rdma_ucm_reject`.
    Reject[264] {
        id: u32, private_data_len: u8, reason: u8, reserved: [u8; 2], private_data: [u8; 256],
    }
);
pod!(
    /// `struct rdma_ucm_event_resp`: the connection (or UD) parameters are one union, kept
    /// here as bytes (its first 272 are a [`ConnParam`], all 304 a [`UdParam`]).
    EventResp[336] {
        uid: u64, id: u32, event: u32, status: u32, param: [u8; 256], param_tail: [u8; 48],
        reserved: u32, ece_vendor_id: u32, ece_attr_mod: u32,
    }
);
pod!(
    /// `struct rdma_ucm_join_ip_mcast`.
    JoinIpMcast[48] { response: u64, uid: u64, addr: [u8; 28], id: u32 }
);
pod!(
    /// `struct rdma_ucm_join_mcast`.
    JoinMcast[152] {
        response: u64, uid: u64, id: u32, addr_size: u16, join_flags: u16, addr: [u8; 128],
    }
);
pod!(
    /// `struct rdma_ucm_set_option`.
    SetOption[24] { optval: u64, id: u32, level: u32, optname: u32, optlen: u32 }
);
pod!(
    /// `struct ib_uverbs_qp_attr`: INIT_QP_ATTR's answer.
    QpAttr[144] {
        qp_attr_mask: u32, qp_state: u32, cur_qp_state: u32, path_mtu: u32,
        path_mig_state: u32, qkey: u32, rq_psn: u32, sq_psn: u32, dest_qp_num: u32,
        qp_access_flags: u32, ah_attr: AhAttr, alt_ah_attr: AhAttr, max_send_wr: u32,
        max_recv_wr: u32, max_send_sge: u32, max_recv_sge: u32, max_inline_data: u32,
        pkey_index: u16, alt_pkey_index: u16, en_sqd_async_notify: u8, sq_draining: u8,
        max_rd_atomic: u8, max_dest_rd_atomic: u8, min_rnr_timer: u8, port_num: u8,
        timeout: u8, retry_cnt: u8, rnr_retry: u8, alt_port_num: u8, alt_timeout: u8,
        reserved: [u8; 5],
    }
);

impl EventResp {
    /// Sets the union's bytes from a connection's parameters.
    pub fn set_conn(&mut self, c: &ConnParam) {
        let b = bytemuck::bytes_of(c);
        self.param.copy_from_slice(&b[..256]);
        self.param_tail = [0; 48];
        self.param_tail[..16].copy_from_slice(&b[256..]);
    }
    /// Sets the union's bytes from UD parameters.
    pub fn set_ud(&mut self, u: &UdParam) {
        let b = bytemuck::bytes_of(u);
        self.param.copy_from_slice(&b[..256]);
        self.param_tail.copy_from_slice(&b[256..]);
    }
}
