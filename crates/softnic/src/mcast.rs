//! UD multicast, as a RoCE ConnectX serves it: UD QPs attach to a multicast GID
//! ([`Device::attach_mcast`], the verbs' `ibv_attach_mcast`) and a UD send whose address
//! vector names a multicast GID goes to the group.
//!
//! - **The group's address.** A RoCE v2 multicast GID over IPv4 is the IPv4-mapped group
//!   address `::ffff:a.b.c.d` with `a.b.c.d` in 224.0.0.0/4 (Linux's `cma_iboe_set_mgid` for
//!   `IB_GID_TYPE_ROCE_UDP_ENCAP`); on the wire the datagram is one RoCEv2 packet to that
//!   address, UDP port 4791, destination QP 0xFFFFFF (IBTA's multicast QPN). Other multicast
//!   GIDs (`ff..`) reach this process's devices only.
//! - **Joining.** When the first QP of a device with a wire port attaches to an IPv4 group,
//!   the device opens a socket bound to the group's address and port 4791 and joins the group
//!   on its own interface (`IP_ADD_MEMBERSHIP` with the port's address: the IGMP join a RoCE
//!   host's kernel makes on the netdev, `cma_igmp_send`); the last detach closes it (leaves).
//!   A thread of the device reads that socket (`group`).
//! - **Sending** (`ud`). A device with a wire port sends the packet once, on its interface
//!   (`IP_MULTICAST_IF`, loop on): every joined port of this host and of the link gets it,
//!   the sender's own included (a ConnectX loops multicast back to its port: the sending QP
//!   gets its own datagram when attached, unless it was created with
//!   `IBV_QP_CREATE_BLOCK_SELF_MCAST_LB`, [`McastAttach::block_self_loopback`]). Devices of
//!   this process without a wire port get the datagram by a function call.
//! - **Receiving** (`ud`). Every QP of the device attached to the group gets the datagram,
//!   checked as a unicast UD datagram is (state, Q_Key, a posted receive). A datagram for a
//!   group no QP of the device is attached to is dropped and counted (`wire.rx_unknown_qp`;
//!   in process: `ud_unready_drops` of the sending device when no device's QP is attached).

pub use crate::group::{group_ipv4, is_multicast, McastAttach, MCAST_QPN};
use crate::net::packet::{self, Flow, Packet, MASK24};
use crate::{Device, Error, Gid};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

impl Device {
    /// Attaches UD QP `qp` to multicast group `mgid` (`ibv_attach_mcast`). Attaching again
    /// is a no-op (as uverbs answers it). A GID that is not multicast or a QP that is not UD:
    /// `InvalidArgument`; a join the host refuses: `Wire`.
    pub fn attach_mcast(
        &self,
        qp: &Arc<crate::Qp>,
        mgid: Gid,
        how: McastAttach,
    ) -> Result<(), Error> {
        crate::group::attach(self.shared(), qp, mgid, how, crate::ud::on_group_packet)
    }

    /// Detaches `qp` from `mgid` (`ibv_detach_mcast`); the device leaves the group with its
    /// last QP. Not attached: `InvalidArgument`.
    pub fn detach_mcast(&self, qp: &Arc<crate::Qp>, mgid: Gid) -> Result<(), Error> {
        crate::group::detach(self.shared(), qp, mgid)
    }

    /// Detaches `qp` from every group (its destruction: uverbs detaches what it left).
    pub fn detach_all_mcast(&self, qp: &Arc<crate::Qp>) {
        crate::group::detach_all(self.shared(), qp)
    }
}

/// The wire receive path of multicast datagrams, for fuzzing: `d` as if it arrived from
/// `from` for `group` at `dev`.
#[doc(hidden)]
pub fn fuzz_receive(dev: &Device, group: Ipv4Addr, from: SocketAddr, d: &[u8]) {
    crate::ud::on_group_packet(dev.shared(), group, from, d);
}

/// The packet a multicast send puts on the wire, for tests and fuzz seeds: a UD SEND_ONLY
/// from `src_qpn` with `qkey` and `payload` to QP 0xFFFFFF, sealed for `flow`.
#[doc(hidden)]
pub fn encode_datagram(flow: &Flow, src_qpn: u32, qkey: u32, payload: &[u8]) -> Vec<u8> {
    let p = Packet {
        bth: packet::Bth {
            opcode: packet::opcode::UD_SEND_ONLY,
            mig_req: true,
            pkey: packet::DEFAULT_PKEY,
            dest_qp: MCAST_QPN & MASK24,
            ..packet::Bth::default()
        },
        deth: Some(packet::Deth {
            qkey,
            src_qp: src_qpn,
        }),
        payload,
        ..Packet::default()
    };
    let mut buf = Vec::new();
    let _ = packet::encode(&p, flow, &mut buf);
    buf
}
