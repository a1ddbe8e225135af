//! The soft NIC on the wire: RC traffic as RoCEv2 packets over UDP, with RC reliability.
//!
//! A device opened with [`crate::DeviceConfig::wire`] binds a UDP socket and runs an I/O
//! thread next to its engine. A QP whose peer is reached over the wire (see
//! [`crate::Device::add_peer`] for how a GID becomes a UDP address) hands each WQE, once the
//! shared local checks passed, to its requester transport ([`requester`]): the message gets a
//! PSN range, is segmented to the path MTU and sent within a window; it completes (CQE in
//! order, exactly as in-process) when its ACK, READ response or atomic ACK arrives. Incoming
//! requests run through the same responder checks as in-process requests
//! ([`crate::responder`]). This folder is the RC protocol's behaviour, above the QP: the
//! requester side (`requester`), the responder side (`responder`) and the I/O thread
//! (`transport`), which the engine hands work to and which never call the engine; a DC
//! target's side (`dct`) runs the responder per initiator. Below the
//! QP are the datagrams and the UDP port they leave by ([`crate::net`]: formats and ICRC, IPv4
//! identifications, the socket, captures) and the per-QP RC state the QP holds
//! (`rc_state`). `docs/wire.md` is the full description.

mod dct;
pub(crate) mod requester;
pub(crate) mod responder;
pub(crate) mod transport;

// The formats and the port's settings were first published here; they stand in `net` now.
pub use crate::net::{
    packet, roce_mtu, route_mtu, Capture, WireConfig, WireError, WireFaults, ROCE_OVERHEAD,
};
