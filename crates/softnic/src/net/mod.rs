//! The soft NIC's network below its transports: what a RoCEv2 datagram is and how it leaves
//! and arrives. Formats and ICRC ([`packet`]); the real IPv4 identifications where a raw
//! socket shows them (`ip_ids`); the wire port, a UDP socket with fault injection, egress
//! batching and ingress (`socket`); captures of what it sends and receives ([`pcap`]); and
//! the port's settings and errors (here). Nothing in this folder knows a QP: the RC transport
//! ([`crate::wire`]) and UD ([`crate::ud`]) build on it. `docs/wire.md` is the full
//! description.

pub(crate) mod ip_ids;
pub mod packet;
pub mod pcap;
pub(crate) mod socket;

pub use socket::{roce_mtu, route_mtu, ROCE_OVERHEAD};

use pcap::PcapWriter;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

/// Settings of a device's wire port.
#[derive(Clone, Debug, PartialEq)]
pub struct WireConfig {
    /// Address and port to bind (IPv4). Port 0 lets the system pick one (see
    /// [`crate::Device::wire_addr`]). When the device has no explicit GID, its GID is the
    /// IPv4-mapped form of this address, which must then be a specific one (not `0.0.0.0`).
    pub bind: SocketAddr,
    /// UDP port assumed for a peer that is found by its GID alone (no entry added with
    /// [`crate::Device::add_peer`]): RoCEv2's 4791 by default.
    pub default_port: u16,
    /// Packets a requester may have in flight per QP (READ responses count): the send window.
    pub window: u32,
    /// Socket receive and send buffer size asked of the kernel (bytes). Above
    /// `net.core.rmem_max` it needs root (`SO_RCVBUFFORCE`); otherwise the kernel caps it.
    pub socket_buffer: usize,
    /// Packet fault injection, applied to every datagram this device sends.
    pub faults: WireFaults,
    /// Whether the I/O thread, after delivering a datagram the program may answer, looks for
    /// the answer's doorbell itself ([`crate::sched::AnswerWatch`]; on by default). Off, the
    /// engine alone finds doorbells, as before 2026-12-07.
    pub answer_watch: bool,
}

impl WireConfig {
    /// A port bound to `bind`, with the defaults: peers at 4791, a 512-packet window, 8 MiB
    /// socket buffers, no faults.
    pub fn new(bind: SocketAddr) -> Self {
        Self {
            bind,
            default_port: packet::ROCE_PORT,
            window: 512,
            socket_buffer: 8 << 20,
            faults: WireFaults::default(),
            answer_watch: true,
        }
    }

    /// A port on `127.0.0.1` with a port the system picks.
    pub fn loopback() -> Self {
        Self::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
    }
}

/// Seeded packet fault injection on a device's egress (tests, benchmarks). Probabilities are
/// per datagram, in `0.0..=1.0`, and decided in this order: drop, corrupt (one byte after
/// the BTH flipped, so the receiver's ICRC check fails), duplicate (sent twice), reorder
/// (held back and sent after the next datagram, or after at most ~1 ms of silence). `stall`
/// pauses the device's sending once, as a descheduled process would.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WireFaults {
    /// Seed of the decision sequence.
    pub seed: u64,
    /// Probability that a datagram is dropped.
    pub drop: f64,
    /// Probability that a datagram is corrupted.
    pub corrupt: f64,
    /// Probability that a datagram is sent twice.
    pub duplicate: f64,
    /// Probability that a datagram is held back behind the next one.
    pub reorder: f64,
    /// `(n, t)`: the thread sending datagram number `n` (counted from 0 since the faults were
    /// set) sleeps for `t` before it sends it, holding the device's egress (every other
    /// sender waits behind it): a scheduling pause.
    pub stall: Option<(u64, std::time::Duration)>,
}

impl WireFaults {
    /// Only loss, with probability `p`.
    pub fn loss(p: f64, seed: u64) -> Self {
        Self {
            seed,
            drop: p,
            ..Self::default()
        }
    }

    pub(crate) fn is_clean(&self) -> bool {
        self.drop <= 0.0
            && self.corrupt <= 0.0
            && self.duplicate <= 0.0
            && self.reorder <= 0.0
            && self.stall.is_none()
    }
}

/// A packet capture attached to a device ([`crate::Device::set_capture`]).
#[derive(Clone, Debug)]
pub struct Capture {
    /// Where frames go (may be shared by several devices).
    pub writer: Arc<PcapWriter>,
    /// Also capture received datagrams (every one, before any check); otherwise only what
    /// this device sends. Two devices of one process that share a writer and capture their
    /// egress give the whole conversation once.
    pub ingress: bool,
}

/// Errors of the wire port.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The socket could not be bound.
    #[error("could not bind the wire port to {addr}: {source}")]
    Bind {
        /// Address asked for.
        addr: SocketAddr,
        /// Cause.
        source: std::io::Error,
    },
    /// A socket option or query failed.
    #[error("wire socket setup failed: {0}")]
    Socket(std::io::Error),
    /// Only IPv4 is supported on the wire.
    #[error("the soft NIC's wire speaks IPv4 only (got {0})")]
    NotIpv4(SocketAddr),
    /// The device's GID is not IPv4-mapped, so it names no IPv4 endpoint.
    #[error("GID {0} is not an IPv4-mapped GID (::ffff:a.b.c.d)")]
    GidNotIpv4(crate::Gid),
    /// A wildcard bind address needs an explicit GID.
    #[error("binding {0} (wildcard) needs an explicit GID in DeviceConfig::gid")]
    WildcardNeedsGid(SocketAddr),
    /// The device has no wire port.
    #[error("this device has no wire port (DeviceConfig::wire is None)")]
    NoPort,
}
