//! What two peers tell each other to connect an RC QP: a serializable, versioned, validated
//! [`Endpoint`] (GID, QPN, initial PSN, path MTU, device name, and the UDP port of a soft NIC on
//! the wire), and the separate [`RemoteMemory`] descriptor (address, length, rkey, and the
//! registration's generation) that an application hands out on purpose.
//!
//! # Capabilities
//!
//! An rkey grants remote access to memory, so it never travels by accident: an [`Endpoint`] has
//! no key field at all, and a [`RemoteMemory`] is only made by the explicit
//! [`RemoteMemory::export_mr`] / [`RemoteMemory::export_rkey`] (or decoded from what a peer
//! chose to send).
//!
//! # Wire format
//!
//! Both types encode as a JSON object carrying a version `"v"`: an endpoint `"v": 1`
//! ([`WIRE_VERSION`]), a memory descriptor `"v": 2` ([`REMOTE_MEMORY_WIRE_VERSION`]). Decoding
//! reads the version first, so a peer of another version gets
//! [`EndpointError::UnsupportedVersion`] rather than a confusing missing-field message; every
//! value is then range-checked. Unknown extra fields are ignored (a version bump is needed only
//! when a field changes meaning or becomes required).
//!
//! ```json
//! {"v":1,"gid":"::ffff:127.1.0.1","qpn":256,"psn":1193046,"mtu":1024,"device":"softnic:soft0"}
//! {"v":1,"gid":"::ffff:10.0.0.1","qpn":4352,"psn":77,"mtu":4096,"device":"softnic2","udp_port":40123}
//! {"v":2,"addr":140737488355328,"len":65536,"rkey":4660,"generation":7}
//! ```
//!
//! `generation` (version 2 of the memory descriptor, required there): the registration's
//! generation ([`crate::Mr::generation`]), which tells a descriptor of one registration from
//! one of an earlier registration of the same memory (whose rkey is dead). It is a version
//! bump, not an optional field, because a version-1 reader would drop it silently and treat
//! descriptors of two registrations as the same; a version-1 reader refuses a version-2
//! descriptor with a clear version error instead. This build still reads version 1
//! descriptors, as generation 0 ("unknown": no registration has generation 0).
//!
//! `udp_port` (optional, added within version 1): the UDP port where the QP's soft NIC listens
//! for RoCEv2 packets ([`Endpoint::udp_port`]); the address is the GID's IPv4 address. Absent
//! (every endpoint written before it existed, a device without a wire port, hardware) means the
//! RoCEv2 default: the peer is found by its GID alone, in this process or at UDP
//! [`ROCE_UDP_PORT`] (4791). It is written only when present, so an endpoint without it encodes
//! exactly as before, and v1 endpoints without it decode as before. It is an optional field of
//! version 1 rather than a version 2: its absence keeps the meaning it always had (GID alone,
//! port 4791), and builds before it had no wire path in the host API, so no earlier reader can
//! misroute an endpoint that carries it.
//!
//! `selective_repeat` (optional, added within version 1, written only when true): the QP's soft
//! NIC takes part in selective repeat ([`Endpoint::selective_repeat`]). A connection uses it
//! only when both endpoints say so; a reader that does not know the field ignores it and never
//! says it, so such a pair goes back N as before.
//!
//! Both types also implement serde's `Serialize`/`Deserialize` with the same format and checks,
//! so they can be sent with [`crate::bootstrap::Bootstrap::exchange`] directly, alone or inside
//! tuples and structs.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

/// The wire version of an [`Endpoint`] this build writes and the only one it reads.
pub const WIRE_VERSION: u32 = 1;

/// The wire version of a [`RemoteMemory`] this build writes (it also reads version 1, as
/// generation 0).
pub const REMOTE_MEMORY_WIRE_VERSION: u32 = 2;

/// Largest 24-bit value (QPN and PSN are 24-bit fields in the BTH).
pub const MAX_24BIT: u32 = 0x00ff_ffff;

/// Longest device name an [`Endpoint`] carries, in bytes.
pub const MAX_DEVICE_NAME: usize = 256;

/// Path MTUs an RC QP may use, in bytes (IBTA: 256, 512, 1024, 2048, 4096).
pub const VALID_MTUS: [u32; 5] = [256, 512, 1024, 2048, 4096];

pub use crate::backend::soft::ROCE_UDP_PORT;

/// Errors of building, encoding or decoding an [`Endpoint`] or a [`RemoteMemory`].
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The bytes are not JSON of the expected shape (or a field has the wrong type).
    #[error("cannot decode {what}: {source}")]
    Decode {
        /// `"endpoint"` or `"remote memory descriptor"`.
        what: &'static str,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// The object has no `"v"` field (or it is not an unsigned integer).
    #[error("{what} has no version field \"v\"")]
    MissingVersion {
        /// `"endpoint"` or `"remote memory descriptor"`.
        what: &'static str,
    },
    /// The peer speaks another wire version.
    #[error("{what} has wire version {found}; this build speaks version {supported}")]
    UnsupportedVersion {
        /// `"endpoint"` or `"remote memory descriptor"`.
        what: &'static str,
        /// The version in the message.
        found: u64,
        /// The version this build writes: [`WIRE_VERSION`] or [`REMOTE_MEMORY_WIRE_VERSION`].
        supported: u32,
    },
    /// QPN is not a 24-bit number of an ordinary QP (0 and 1 are the special QPs).
    #[error("QPN {0:#x} out of range (RC QPNs are 0x2..=0xffffff)")]
    QpnOutOfRange(u32),
    /// PSN does not fit in 24 bits.
    #[error("PSN {0:#x} out of range (PSNs are 24-bit: 0..=0xffffff)")]
    PsnOutOfRange(u32),
    /// Path MTU is not one of 256, 512, 1024, 2048, 4096.
    #[error("path MTU {0} is invalid (one of 256, 512, 1024, 2048, 4096)")]
    InvalidMtu(u32),
    /// The device name is longer than [`MAX_DEVICE_NAME`] bytes or contains control characters.
    #[error("device name invalid ({reason}): {name:?}")]
    InvalidDeviceName {
        /// The offending name (as received).
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A UDP port that cannot name a wire peer: port 0, or a GID that is not IPv4-mapped (the
    /// soft NIC's wire speaks IPv4 only; its GID is `::ffff:a.b.c.d`).
    #[error("UDP port {port} invalid for GID {gid}: {reason}")]
    InvalidUdpPort {
        /// The port.
        port: u16,
        /// The endpoint's GID.
        gid: Gid,
        /// What is wrong.
        reason: &'static str,
    },
    /// `addr + len` does not fit in 64 bits.
    #[error("remote memory range {addr:#x} + {len:#x} overflows 64 bits")]
    RangeOverflow {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A sub-range lies outside its parent range.
    #[error(
        "sub-range offset {offset:#x} + length {len:#x} exceeds the {parent_len:#x}-byte region"
    )]
    OutOfBounds {
        /// Offset within the region.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Length of the region.
        parent_len: u64,
    },
}

/// Result alias of this module.
pub type Result<T, E = EndpointError> = std::result::Result<T, E>;

// ---------------------------------------------------------------------------------------------
// GID
// ---------------------------------------------------------------------------------------------

/// A 16-byte port GID. Serialized as its IPv6 text form (e.g. `"::ffff:127.1.0.1"` for a soft
/// device, `"fe80::..."` for a link-local RoCE GID), the form `ibv_devinfo -v` and `show_gids`
/// print, which round-trips every 16-byte value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The raw 16 bytes (network order).
    pub const fn bytes(&self) -> [u8; 16] {
        self.0
    }

    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`), the form of every soft NIC
    /// GID and of RoCEv2 GIDs of IPv4 addresses.
    pub fn to_ipv4(&self) -> Option<Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }
}

impl From<verbs::Gid> for Gid {
    fn from(g: verbs::Gid) -> Self {
        Self(g.0)
    }
}

impl From<Gid> for verbs::Gid {
    fn from(g: Gid) -> Self {
        verbs::Gid(g.0)
    }
}

impl From<[u8; 16]> for Gid {
    fn from(b: [u8; 16]) -> Self {
        Self(b)
    }
}

impl From<Ipv6Addr> for Gid {
    fn from(a: Ipv6Addr) -> Self {
        Self(a.octets())
    }
}

impl From<Gid> for Ipv6Addr {
    fn from(g: Gid) -> Self {
        Ipv6Addr::from(g.0)
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Ipv6Addr::from(self.0), f)
    }
}

impl FromStr for Gid {
    type Err = std::net::AddrParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ipv6Addr::from_str(s).map(Self::from)
    }
}

impl Serialize for Gid {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Gid {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<str>::deserialize(d)?;
        s.parse()
            .map_err(|e| D::Error::custom(format!("invalid GID {s:?}: {e}")))
    }
}

// ---------------------------------------------------------------------------------------------
// Endpoint
// ---------------------------------------------------------------------------------------------

/// The minimal description of one RC QP that its peer needs to connect to it (perftest's
/// "local address" line): port GID, QPN, the PSN of the first packet it sends, the path MTU, the
/// device name for diagnostics and, for a soft NIC on the wire, the UDP port it listens on. It
/// never carries an rkey (see [`RemoteMemory`]).
///
/// Values are checked when built ([`Endpoint::new`]) and when decoded, so an `Endpoint` in hand
/// is always in range.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    gid: Gid,
    qpn: u32,
    psn: u32,
    mtu: u32,
    device: String,
    udp_port: Option<u16>,
    selective_repeat: bool,
}

/// Version 1 wire form of an [`Endpoint`] (`udp_port` optional: absent in endpoints of
/// devices without a wire port, and in every endpoint written before it was added).
#[derive(Serialize, Deserialize)]
struct EndpointV1 {
    v: u32,
    gid: Gid,
    qpn: u32,
    psn: u32,
    mtu: u32,
    device: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    udp_port: Option<u16>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    selective_repeat: bool,
}

const ENDPOINT: &str = "endpoint";
const REMOTE_MEMORY: &str = "remote memory descriptor";

impl Endpoint {
    /// Build an endpoint, checking QPN (`2..=0xffffff`), PSN (24 bits), MTU (256..4096, a power
    /// of two) and device name (at most [`MAX_DEVICE_NAME`] bytes, no control characters). It
    /// carries no UDP port (see [`Endpoint::with_udp_port`]).
    pub fn new(
        gid: impl Into<Gid>,
        qpn: u32,
        psn: u32,
        mtu: u32,
        device: impl Into<String>,
    ) -> Result<Self> {
        let ep = Self {
            gid: gid.into(),
            qpn,
            psn,
            mtu,
            device: device.into(),
            udp_port: None,
            selective_repeat: false,
        };
        ep.validate()?;
        Ok(ep)
    }

    /// The same endpoint, saying that its soft NIC listens for RoCEv2 packets on UDP `port` at
    /// the GID's IPv4 address (`None`: says nothing, the peer is found by its GID alone).
    /// Fails for port 0 and for a GID that is not IPv4-mapped.
    pub fn with_udp_port(mut self, port: Option<u16>) -> Result<Self> {
        self.udp_port = port;
        self.validate()?;
        Ok(self)
    }

    /// The same endpoint, saying whether its QP's responder holds packets that arrive behind a
    /// gap and its requester resends only what a sequence NAK names (soft NICs on the wire say
    /// so). Both ends must say it for a connection to use selective repeat
    /// ([`verbs::RtrAttr::selective_repeat`]); an endpoint written without it says no.
    pub fn with_selective_repeat(mut self, on: bool) -> Self {
        self.selective_repeat = on;
        self
    }

    /// Check every field. Always passes for a value in hand ([`Endpoint::new`] and decoding
    /// both call it); public so callers can state the invariant in their own checks.
    pub fn validate(&self) -> Result<()> {
        if !(2..=MAX_24BIT).contains(&self.qpn) {
            return Err(EndpointError::QpnOutOfRange(self.qpn));
        }
        if self.psn > MAX_24BIT {
            return Err(EndpointError::PsnOutOfRange(self.psn));
        }
        if !VALID_MTUS.contains(&self.mtu) {
            return Err(EndpointError::InvalidMtu(self.mtu));
        }
        if self.device.len() > MAX_DEVICE_NAME {
            return Err(EndpointError::InvalidDeviceName {
                name: self.device.clone(),
                reason: "longer than 256 bytes",
            });
        }
        if self.device.chars().any(char::is_control) {
            return Err(EndpointError::InvalidDeviceName {
                name: self.device.clone(),
                reason: "contains control characters",
            });
        }
        if let Some(port) = self.udp_port {
            let reason = if port == 0 {
                "port 0 is no port"
            } else if self.gid.to_ipv4().is_none() {
                "a UDP port needs an IPv4-mapped GID (::ffff:a.b.c.d): the wire speaks IPv4"
            } else {
                ""
            };
            if !reason.is_empty() {
                return Err(EndpointError::InvalidUdpPort {
                    port,
                    gid: self.gid,
                    reason,
                });
            }
        }
        Ok(())
    }

    /// The port GID.
    pub fn gid(&self) -> Gid {
        self.gid
    }
    /// The QP number (24 bits).
    pub fn qpn(&self) -> u32 {
        self.qpn
    }
    /// The PSN of the first packet this QP sends (its SQ PSN; the peer's expected RQ PSN).
    pub fn psn(&self) -> u32 {
        self.psn
    }
    /// The path MTU in bytes.
    pub fn mtu(&self) -> u32 {
        self.mtu
    }
    /// The device name/kind, for diagnostics only (e.g. `"softnic:soft0"`, `"mlx5_0"`).
    pub fn device(&self) -> &str {
        &self.device
    }
    /// The UDP port the QP's soft NIC listens on, when the endpoint says (a soft NIC with a wire
    /// port always does). `None`: the RoCEv2 default, [`ROCE_UDP_PORT`], for a wire peer; or a
    /// peer in the same process, found by its GID.
    pub fn udp_port(&self) -> Option<u16> {
        self.udp_port
    }
    /// Whether the QP takes part in selective repeat ([`Endpoint::with_selective_repeat`]).
    pub fn selective_repeat(&self) -> bool {
        self.selective_repeat
    }
    /// Where RoCEv2 packets for this QP go: the GID's IPv4 address and [`Endpoint::udp_port`]
    /// (4791 when absent). `None` for a GID that is not IPv4-mapped.
    pub fn udp_addr(&self) -> Option<SocketAddr> {
        let ip = self.gid.to_ipv4()?;
        Some(SocketAddr::from((
            ip,
            self.udp_port.unwrap_or(ROCE_UDP_PORT),
        )))
    }

    /// A random 24-bit initial PSN, as perftest draws one (`lrand48() & 0xffffff`), so that a
    /// restarted QP does not accept stale packets of an earlier incarnation.
    pub fn random_psn() -> u32 {
        use std::collections::hash_map::RandomState;
        use std::hash::{BuildHasher, Hasher};
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        (h.finish() as u32) & MAX_24BIT
    }

    /// The INIT→RTR attributes that connect a local QP to this (remote) endpoint:
    /// remote GID and QPN, expected PSN = this endpoint's initial PSN, and this endpoint's MTU.
    /// Use the smaller of both sides' MTUs when they differ (see [`Endpoint::common_mtu`]).
    pub fn rtr_attr(&self, min_rnr_timer: u8) -> verbs::RtrAttr {
        verbs::RtrAttr {
            remote_gid: self.gid.into(),
            remote_qpn: self.qpn,
            rq_psn: self.psn,
            mtu: self.mtu,
            min_rnr_timer,
            selective_repeat: false,
        }
    }

    /// The path MTU both ends support (the smaller one).
    pub fn common_mtu(&self, other: &Endpoint) -> u32 {
        self.mtu.min(other.mtu)
    }

    /// Encode (JSON, [`WIRE_VERSION`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        // Serializing a struct of integers and strings into a Vec cannot fail.
        serde_json::to_vec(&self.to_wire()).expect("serializing an endpoint cannot fail")
    }

    /// Decode and validate (version first, then fields, then ranges).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let value: Value =
            serde_json::from_slice(bytes).map_err(|source| EndpointError::Decode {
                what: ENDPOINT,
                source,
            })?;
        Self::from_value(value)
    }

    fn from_value(value: Value) -> Result<Self> {
        check_version(&value, ENDPOINT, &[WIRE_VERSION], WIRE_VERSION)?;
        let w: EndpointV1 =
            serde_json::from_value(value).map_err(|source| EndpointError::Decode {
                what: ENDPOINT,
                source,
            })?;
        Ok(Self::new(w.gid, w.qpn, w.psn, w.mtu, w.device)?
            .with_udp_port(w.udp_port)?
            .with_selective_repeat(w.selective_repeat))
    }

    fn to_wire(&self) -> EndpointV1 {
        EndpointV1 {
            v: WIRE_VERSION,
            gid: self.gid,
            qpn: self.qpn,
            psn: self.psn,
            mtu: self.mtu,
            device: self.device.clone(),
            udp_port: self.udp_port,
            selective_repeat: self.selective_repeat,
        }
    }
}

impl fmt::Display for Endpoint {
    /// perftest style: `GID ::ffff:127.1.0.1 QPN 0x000100 PSN 0x123456 MTU 1024 (softnic:soft0)`,
    /// with ` UDP 40123` before the device name when the endpoint carries a UDP port.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GID {} QPN {:#08x} PSN {:#08x} MTU {}",
            self.gid, self.qpn, self.psn, self.mtu
        )?;
        if let Some(p) = self.udp_port {
            write!(f, " UDP {p}")?;
        }
        write!(f, " ({})", self.device)
    }
}

impl Serialize for Endpoint {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_wire().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Endpoint {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Self::from_value(Value::deserialize(d)?).map_err(D::Error::custom)
    }
}

// ---------------------------------------------------------------------------------------------
// Remote memory
// ---------------------------------------------------------------------------------------------

/// A window of a peer's registered memory that this side may access with RDMA: start address
/// (in the peer's address space), length, rkey, and the generation of the registration it
/// belongs to ([`crate::Mr::generation`]; 0 when unknown).
///
/// It is a capability: there is deliberately no `Default`, no public fields and no implicit
/// conversion from a memory region. The only ways to get one are [`RemoteMemory::export_mr`]
/// and [`RemoteMemory::export_rkey`], which the owner of the memory calls when it decides to
/// share it, and decoding what a peer sent.
///
/// A descriptor outlives nothing: once its region is deregistered (and the memory perhaps
/// registered again, with a new rkey and a new generation), a peer that still uses it gets a
/// REMOTE_ACCESS error completion.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteMemory {
    addr: u64,
    len: u64,
    rkey: u32,
    generation: u32,
}

/// Version 1 wire form of a [`RemoteMemory`] (read only: generation 0).
#[derive(Deserialize)]
struct RemoteMemoryV1 {
    addr: u64,
    len: u64,
    rkey: u32,
}

/// Version 2 wire form of a [`RemoteMemory`].
#[derive(Serialize, Deserialize)]
struct RemoteMemoryV2 {
    v: u32,
    addr: u64,
    len: u64,
    rkey: u32,
    generation: u32,
}

impl RemoteMemory {
    /// Export `len` bytes at `addr` under `rkey` to a peer. Call this only for memory you mean to
    /// expose; the result grants the rights the key was registered with. Fails when
    /// `addr + len` overflows.
    /// Its generation is 0 ("unknown"); [`RemoteMemory::export_mr`] carries the region's.
    pub fn export_rkey(addr: u64, len: u64, rkey: u32) -> Result<Self> {
        Self::export_rkey_generation(addr, len, rkey, 0)
    }

    /// As [`RemoteMemory::export_rkey`], with the registration's generation.
    pub fn export_rkey_generation(addr: u64, len: u64, rkey: u32, generation: u32) -> Result<Self> {
        if addr.checked_add(len).is_none() {
            return Err(EndpointError::RangeOverflow { addr, len });
        }
        Ok(Self {
            addr,
            len,
            rkey,
            generation,
        })
    }

    /// Export the whole of region `mr` (address, length, rkey, generation) to a peer. Call this
    /// only for memory you mean to expose; the result grants the rights the region was
    /// registered with ([`RemoteMemory::slice`] narrows the window, not the rights).
    pub fn export_mr(mr: &crate::Mr) -> Self {
        // A registered range never overflows (every backend checks it).
        Self {
            addr: mr.addr(),
            len: mr.len(),
            rkey: mr.rkey().0,
            generation: mr.generation(),
        }
    }

    /// Start address (peer's address space).
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// The generation of the registration ([`crate::Mr::generation`]); 0 when unknown (made
    /// by [`RemoteMemory::export_rkey`], or decoded from a version-1 descriptor).
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// The sub-window `[offset, offset + len)` (same key and generation).
    pub fn slice(&self, offset: u64, len: u64) -> Result<Self> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(Self {
                addr: self.addr + offset,
                len,
                ..*self
            }),
            _ => Err(EndpointError::OutOfBounds {
                offset,
                len,
                parent_len: self.len,
            }),
        }
    }

    /// Encode (JSON, [`REMOTE_MEMORY_WIRE_VERSION`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&self.to_wire()).expect("serializing integers cannot fail")
    }

    /// Decode and validate (version 2, or version 1 as generation 0).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let value: Value =
            serde_json::from_slice(bytes).map_err(|source| EndpointError::Decode {
                what: REMOTE_MEMORY,
                source,
            })?;
        Self::from_value(value)
    }

    fn from_value(value: Value) -> Result<Self> {
        let v = check_version(
            &value,
            REMOTE_MEMORY,
            &[1, REMOTE_MEMORY_WIRE_VERSION],
            REMOTE_MEMORY_WIRE_VERSION,
        )?;
        let decode = |source| EndpointError::Decode {
            what: REMOTE_MEMORY,
            source,
        };
        if v == 1 {
            let w: RemoteMemoryV1 = serde_json::from_value(value).map_err(decode)?;
            return Self::export_rkey(w.addr, w.len, w.rkey);
        }
        let w: RemoteMemoryV2 = serde_json::from_value(value).map_err(decode)?;
        Self::export_rkey_generation(w.addr, w.len, w.rkey, w.generation)
    }

    fn to_wire(self) -> RemoteMemoryV2 {
        RemoteMemoryV2 {
            v: REMOTE_MEMORY_WIRE_VERSION,
            addr: self.addr,
            len: self.len,
            rkey: self.rkey,
            generation: self.generation,
        }
    }
}

impl fmt::Debug for RemoteMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteMemory")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .field("generation", &self.generation)
            .finish()
    }
}

impl fmt::Display for RemoteMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "addr {:#x} len {} rkey {:#x} generation {}",
            self.addr, self.len, self.rkey, self.generation
        )
    }
}

impl Serialize for RemoteMemory {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_wire().serialize(s)
    }
}

impl<'de> Deserialize<'de> for RemoteMemory {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Self::from_value(Value::deserialize(d)?).map_err(D::Error::custom)
    }
}

/// Read `"v"` before anything else: one of `readable`, else an error that names `current`.
fn check_version(value: &Value, what: &'static str, readable: &[u32], current: u32) -> Result<u32> {
    let v = value
        .get("v")
        .and_then(Value::as_u64)
        .ok_or(EndpointError::MissingVersion { what })?;
    match readable.iter().find(|&&r| u64::from(r) == v) {
        Some(&r) => Ok(r),
        None => Err(EndpointError::UnsupportedVersion {
            what,
            found: v,
            supported: current,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_text_round_trip() {
        let g = Gid::from(verbs::Gid::from_ipv4(std::net::Ipv4Addr::new(127, 1, 0, 1)));
        assert_eq!(g.to_string(), "::ffff:127.1.0.1");
        assert_eq!(g.to_string().parse::<Gid>().unwrap(), g);
        let raw = Gid([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(raw.to_string().parse::<Gid>().unwrap(), raw);
        assert_eq!(verbs::Gid::from(raw).0, raw.0);
    }

    #[test]
    fn rtr_attr_uses_peer_psn() {
        let ep = Endpoint::new(Gid([1; 16]), 0x123, 0x456, 2048, "x").unwrap();
        let a = ep.rtr_attr(12);
        assert_eq!(a.remote_qpn, 0x123);
        assert_eq!(a.rq_psn, 0x456);
        assert_eq!(a.mtu, 2048);
        assert_eq!(a.remote_gid.0, [1; 16]);
    }

    #[test]
    fn selective_repeat_is_optional_in_v1() {
        let v1 = br#"{"v":1,"gid":"::ffff:10.0.0.1","qpn":256,"psn":5,"mtu":1024,"device":"d"}"#;
        let ep = Endpoint::from_bytes(v1).unwrap();
        assert!(!ep.selective_repeat(), "absent: go-back-N");
        let sr = ep.clone().with_selective_repeat(true);
        let bytes = sr.to_bytes();
        assert!(std::str::from_utf8(&bytes)
            .unwrap()
            .ends_with(r#","selective_repeat":true}"#));
        assert_eq!(Endpoint::from_bytes(&bytes).unwrap(), sr);
        assert_eq!(sr.with_selective_repeat(false).to_bytes(), v1.to_vec());
    }

    #[test]
    fn udp_port_is_optional_in_v1() {
        let gid = Gid::from(verbs::Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 1)));
        let v1 = br#"{"v":1,"gid":"::ffff:10.0.0.1","qpn":256,"psn":5,"mtu":1024,"device":"d"}"#;
        let ep = Endpoint::from_bytes(v1).unwrap();
        assert_eq!(ep.udp_port(), None);
        assert_eq!(ep.udp_addr(), Some("10.0.0.1:4791".parse().unwrap()));
        assert_eq!(ep.to_bytes(), v1.to_vec(), "written exactly as before");
        let wired = ep.clone().with_udp_port(Some(40123)).unwrap();
        let bytes = wired.to_bytes();
        assert!(std::str::from_utf8(&bytes)
            .unwrap()
            .contains(r#""udp_port":40123"#));
        let back = Endpoint::from_bytes(&bytes).unwrap();
        assert_eq!(back, wired);
        assert_eq!(back.udp_addr(), Some("10.0.0.1:40123".parse().unwrap()));
        assert!(wired.to_string().contains("UDP 40123"), "{wired}");
        assert!(matches!(
            ep.clone().with_udp_port(Some(0)),
            Err(EndpointError::InvalidUdpPort { port: 0, .. })
        ));
        let v6 = Endpoint::new(Gid([0xfe; 16]), 2, 0, 1024, "").unwrap();
        assert!(matches!(
            v6.with_udp_port(Some(4791)),
            Err(EndpointError::InvalidUdpPort { port: 4791, .. })
        ));
        let bad = br#"{"v":1,"gid":"::ffff:10.0.0.1","qpn":256,"psn":5,"mtu":1024,"device":"d","udp_port":0}"#;
        assert!(matches!(
            Endpoint::from_bytes(bad),
            Err(EndpointError::InvalidUdpPort { .. })
        ));
        let big = br#"{"v":1,"gid":"::ffff:10.0.0.1","qpn":256,"psn":5,"mtu":1024,"device":"d","udp_port":70000}"#;
        assert!(matches!(
            Endpoint::from_bytes(big),
            Err(EndpointError::Decode { .. })
        ));
        assert_eq!(gid.to_ipv4(), Some(Ipv4Addr::new(10, 0, 0, 1)));
    }

    #[test]
    fn remote_memory_v2_carries_the_generation_and_v1_still_decodes() {
        let m = RemoteMemory::export_rkey_generation(0x1000, 4096, 0x1234, 7).unwrap();
        let bytes = m.to_bytes();
        assert_eq!(
            std::str::from_utf8(&bytes).unwrap(),
            r#"{"v":2,"addr":4096,"len":4096,"rkey":4660,"generation":7}"#
        );
        let back = RemoteMemory::from_bytes(&bytes).unwrap();
        assert_eq!((back, back.generation()), (m, 7));
        assert_eq!(m.slice(16, 32).unwrap().generation(), 7);
        // a version-1 descriptor (every earlier build's) is generation 0, "unknown"
        let v1 = br#"{"v":1,"addr":4096,"len":4096,"rkey":4660}"#;
        let old = RemoteMemory::from_bytes(v1).unwrap();
        assert_eq!(
            (old.addr(), old.len(), old.rkey(), old.generation()),
            (4096, 4096, 0x1234, 0)
        );
        assert_ne!(old, m, "generations differ");
        // version 2 requires the field
        let missing = br#"{"v":2,"addr":4096,"len":4096,"rkey":4660}"#;
        assert!(matches!(
            RemoteMemory::from_bytes(missing),
            Err(EndpointError::Decode { .. })
        ));
        // and the versions beyond are refused by number
        let v3 = br#"{"v":3,"addr":4096,"len":4096,"rkey":4660,"generation":1}"#;
        assert!(matches!(
            RemoteMemory::from_bytes(v3),
            Err(EndpointError::UnsupportedVersion {
                found: 3,
                supported: 2,
                ..
            })
        ));
        // an endpoint stays version 1 and does not read a memory descriptor
        assert!(Endpoint::from_bytes(&bytes).is_err());
        // through serde, the same
        let via: RemoteMemory = serde_json::from_slice(v1).unwrap();
        assert_eq!(via.generation(), 0);
        assert!(m.to_string().contains("generation 7"), "{m}");
    }

    #[test]
    fn random_psn_is_24_bit() {
        for _ in 0..100 {
            assert!(Endpoint::random_psn() <= MAX_24BIT);
        }
    }
}
