//! Device selection: which NIC backs a [`Context`], chosen automatically or by name, with the
//! choice and its reason logged and queryable.
//!
//! Backends: the soft NIC (always available) and a ConnectX through rdma-core's libibverbs and
//! libmlx5 (`crate::mlx5`; run here on the emulated device of `gpuverbs emu`). The boundary is
//! [`Backend`]: everything above it (memory, queues, export, proxy) is shared.
//!
//! A soft NIC reaches QPs of soft NICs in other processes and on other hosts when it has a
//! *wire port* (RoCEv2 over UDP, `docs/wire.md`): [`SOFTNIC_ADDR_ENV`], [`Context::open_wire`],
//! or [`Context::open_soft`] with `wire: Some(..)`. Its endpoints then carry the UDP port
//! ([`crate::Endpoint::udp_port`]), and `Qp::connect` fills the device's peer table from the
//! peer's endpoint ([`Context::wire_addr`], `docs/host-api.md`).

use crate::endpoint::Endpoint;
use crate::Error;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// Environment variable that overrides device selection: `soft`/`softnic` (or a soft device
/// name such as `softnic0`), or an rdma-core device name such as `mlx5_0`.
pub const DEVICE_ENV: &str = "GPUVERBS_DEVICE";

/// Environment variable that gives soft NICs opened by [`Context::open`] and
/// [`Context::open_wire`] a wire port: `ip:port` (port 0: the system picks one) or `ip` (port
/// 4791). The IP is an IPv4 address of this host; the device's GID is its IPv4-mapped form.
pub const SOFTNIC_ADDR_ENV: &str = "GPUVERBS_SOFTNIC_ADDR";

/// Parses a [`SOFTNIC_ADDR_ENV`] value: `ip:port`, or `ip` alone for RoCEv2's port 4791.
pub fn parse_softnic_addr(v: &str) -> Result<SocketAddr, Error> {
    let v = v.trim();
    let addr = v
        .parse::<SocketAddr>()
        .or_else(|_| {
            v.parse::<IpAddr>()
                .map(|ip| SocketAddr::from((ip, crate::endpoint::ROCE_UDP_PORT)))
        })
        .map_err(|_| {
            Error::InvalidArgument(format!(
                "{SOFTNIC_ADDR_ENV}={v:?} is not an IPv4 address with an optional port \
                 (e.g. 10.0.0.1:4791, 127.0.0.1:0)"
            ))
        })?;
    if !addr.is_ipv4() {
        return Err(Error::InvalidArgument(format!(
            "{SOFTNIC_ADDR_ENV}={v:?}: the soft NIC's wire speaks IPv4 only"
        )));
    }
    Ok(addr)
}

/// Which kind of device backs a context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The in-process software mlx5 device.
    Soft,
    /// An mlx5 (ConnectX) device through rdma-core.
    Mlx5,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Soft => "soft NIC",
            Self::Mlx5 => "mlx5",
        })
    }
}

/// What was chosen, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Backend kind.
    pub kind: BackendKind,
    /// Device name.
    pub name: String,
    /// Why this device.
    pub reason: String,
}

impl std::fmt::Display for Selection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} ({})", self.kind, self.name, self.reason)
    }
}

/// How to pick a device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DeviceRequest {
    /// The best available (a ConnectX when rdma-core lists one and the backend exists, else the
    /// soft NIC); [`DEVICE_ENV`] overrides.
    #[default]
    Auto,
    /// A soft NIC.
    Soft,
    /// A device by name (`softnic*` or an rdma-core name).
    Named(String),
}

/// The device behind a context.
pub(crate) enum Backend {
    Soft(Arc<softnic::Device>),
    Mlx5(Arc<crate::mlx5::Device>),
}

/// An open device: the root of every other object (PDs, CQs, QPs keep it alive).
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

pub(crate) struct ContextInner {
    pub backend: Backend,
    pub selection: Selection,
    /// Peer-table entries this context added for its QPs ([`Context::route_to`]).
    routes: Mutex<HashMap<softnic::Gid, Route>>,
}

/// A peer-table entry of this context's device, and the QPs connected through it.
struct Route {
    addr: SocketAddr,
    qps: Vec<Weak<softnic::Qp>>,
}

/// The soft devices of contexts of this process (to tell a peer of this process from one in
/// another process when an endpoint names a UDP address).
static DEVICES: Mutex<Vec<Weak<softnic::Device>>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Live devices of this process's contexts with GID `gid`, and whether one of them listens on
/// `addr`.
fn devices_with(gid: softnic::Gid, addr: SocketAddr) -> (usize, bool) {
    let mut reg = lock(&DEVICES);
    reg.retain(|w| w.strong_count() > 0);
    let mut n = 0;
    let mut at = false;
    for d in reg.iter().filter_map(Weak::upgrade) {
        if d.gid() == gid {
            n += 1;
            at |= d.wire_addr() == Some(addr);
        }
    }
    (n, at)
}

/// Names rdma-core lists, or why it lists none.
fn rdma_core_devices() -> Result<Vec<String>, String> {
    crate::mlx5::device_names().map_err(|e| e.to_string())
}

/// A non-empty environment variable.
fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl Context {
    /// Opens a device as `req` asks, after applying [`DEVICE_ENV`] when `req` is `Auto`. A soft
    /// NIC gets a wire port when [`SOFTNIC_ADDR_ENV`] says where (otherwise it reaches peers of
    /// this process only).
    pub fn open(req: DeviceRequest) -> Result<Self, Error> {
        Self::open_with(req, None)
    }

    /// Opens a device as `req` asks (as [`Context::open`] does); a soft NIC gets a wire port
    /// bound to `bind` (port 0: the system picks one; [`Context::wire_addr`] says which), or
    /// where [`SOFTNIC_ADDR_ENV`] says when it is set. Its GID is the IPv4-mapped bind
    /// address, which must therefore be a specific IPv4 address of this host.
    pub fn open_wire(req: DeviceRequest, bind: SocketAddr) -> Result<Self, Error> {
        Self::open_with(req, Some(bind))
    }

    fn open_with(req: DeviceRequest, bind: Option<SocketAddr>) -> Result<Self, Error> {
        let env = env_var(DEVICE_ENV);
        let (req, origin) = match (req, env) {
            (DeviceRequest::Auto, Some(v)) => {
                (DeviceRequest::Named(v), format!("{DEVICE_ENV} asks for it"))
            }
            (r, _) => (r, "requested in code".to_string()),
        };
        let soft_reason = match &req {
            DeviceRequest::Auto => match rdma_core_devices() {
                Ok(names) if !names.is_empty() => {
                    let pick = names
                        .iter()
                        .find(|n| n.starts_with("mlx5"))
                        .unwrap_or(&names[0])
                        .clone();
                    let why = format!("auto: rdma-core lists {}", names.join(", "));
                    return Self::mlx5(&pick, why);
                }
                Ok(_) => "rdma-core lists no RDMA device".to_string(),
                Err(why) => format!("no rdma-core device: {why}"),
            },
            DeviceRequest::Soft => origin,
            DeviceRequest::Named(n)
                if n == "soft" || n == "softnic" || n.starts_with("softnic") =>
            {
                origin
            }
            DeviceRequest::Named(n) => {
                let names = rdma_core_devices().unwrap_or_default();
                if !names.contains(n) {
                    return Err(Error::NoSuchDevice(n.clone()));
                }
                return Self::mlx5(n, origin);
            }
        };
        let name = match &req {
            DeviceRequest::Named(n) if n.starts_with("softnic") && n != "softnic" => n.clone(),
            _ => String::new(),
        };
        let (wire, wire_origin) = match (env_var(SOFTNIC_ADDR_ENV), bind) {
            (Some(v), _) => (
                Some(parse_softnic_addr(&v)?),
                format!("{SOFTNIC_ADDR_ENV} asks for it"),
            ),
            (None, Some(b)) => (Some(b), "requested in code".to_string()),
            (None, None) => (None, String::new()),
        };
        Self::soft(
            softnic::DeviceConfig {
                name,
                wire: wire.map(softnic::WireConfig::new),
                ..Default::default()
            },
            soft_reason,
            &wire_origin,
        )
    }

    /// Opens a soft NIC with explicit settings (GID, name, completion-only mode, wire port).
    /// [`DEVICE_ENV`] and [`SOFTNIC_ADDR_ENV`] do not apply.
    pub fn open_soft(cfg: softnic::DeviceConfig) -> Result<Self, Error> {
        Self::soft(
            cfg,
            "soft NIC with explicit settings, requested in code".into(),
            "requested in code",
        )
    }

    /// Opens rdma-core device `name` with the ConnectX backend.
    fn mlx5(name: &str, reason: String) -> Result<Self, Error> {
        let dev = crate::mlx5::Device::open(name)?;
        let selection = Selection {
            kind: BackendKind::Mlx5,
            name: dev.name.clone(),
            reason: format!(
                "{reason}; GID index {} ({}), MTU {}",
                dev.gid.index,
                std::net::Ipv6Addr::from(dev.gid.gid),
                dev.mtu
            ),
        };
        tracing::info!(device = %selection, "gpuverbs device selected");
        Ok(Self {
            inner: Arc::new(ContextInner {
                backend: Backend::Mlx5(dev),
                selection,
                routes: Mutex::default(),
            }),
        })
    }

    /// Opens the soft device; `reason` says why a soft NIC, `wire_origin` why its wire port.
    fn soft(cfg: softnic::DeviceConfig, reason: String, wire_origin: &str) -> Result<Self, Error> {
        let dev = Arc::new(softnic::Device::open(cfg)?);
        let reason = match dev.wire_addr() {
            Some(a) => format!("{reason}; soft NIC on UDP {a} ({wire_origin})"),
            None => reason,
        };
        let selection = Selection {
            kind: BackendKind::Soft,
            name: dev.name().to_string(),
            reason,
        };
        tracing::info!(device = %selection, "gpuverbs device selected");
        {
            let mut reg = lock(&DEVICES);
            reg.retain(|w| w.strong_count() > 0);
            reg.push(Arc::downgrade(&dev));
        }
        Ok(Self {
            inner: Arc::new(ContextInner {
                backend: Backend::Soft(dev),
                selection,
                routes: Mutex::default(),
            }),
        })
    }

    /// The bound UDP address of the device's wire port (with the port the system picked), or
    /// `None` when the device reaches peers of this process only.
    pub fn wire_addr(&self) -> Option<SocketAddr> {
        match &self.inner.backend {
            Backend::Soft(d) => d.wire_addr(),
            Backend::Mlx5(_) => None,
        }
    }

    /// The UDP port an endpoint of this context carries ([`Endpoint::udp_port`]).
    pub(crate) fn udp_port(&self) -> Option<u16> {
        self.wire_addr().map(|a| a.port())
    }

    /// Makes the route from `qp` (of this context, about to be connected) to `remote` work,
    /// following the soft NIC's routing rules (`docs/wire.md`, "Addressing"):
    ///
    /// - `remote` carries no UDP port: nothing to do (a device of this process with that GID,
    ///   else, on the wire, the GID's address at port 4791).
    /// - `remote`'s UDP address is the wire port of the only device of this process with that
    ///   GID: the in-process path (no peer-table entry for that GID).
    /// - otherwise this device needs a wire port (else [`Error::Unsupported`]: it could not
    ///   reach the peer), and its peer table gets `GID → UDP address` (several devices of one
    ///   host share its GID; the port tells them apart).
    ///
    /// A device routes a GID to one place: connecting to a peer with the same GID at another
    /// UDP address while a QP connected to the first is still alive (not destroyed, not in
    /// ERR) is [`Error::Unsupported`] (open another context for it). Nothing changes on error.
    pub(crate) fn route_to(&self, qp: &Arc<softnic::Qp>, remote: &Endpoint) -> Result<(), Error> {
        let Backend::Soft(dev) = &self.inner.backend else {
            // a real NIC routes by GID (IP) itself
            return Ok(());
        };
        let (Some(_), Some(to)) = (remote.udp_port(), remote.udp_addr()) else {
            return Ok(());
        };
        let gid = softnic::Gid::from(remote.gid());
        let (same_gid, listens) = devices_with(gid, to);
        // softnic's rule 2: a GID that names exactly one device of this process is reached by
        // a function call; anything else needs the wire and a peer-table entry.
        let in_process = listens && same_gid == 1;
        if !in_process && dev.wire_addr().is_none() {
            return Err(Error::Unsupported(format!(
                "QP {:#x} of {}: the peer ({remote}) listens on UDP {to}, {}, and this soft NIC \
                 has no wire port: open it with {SOFTNIC_ADDR_ENV}=ip:port or \
                 Context::open_wire",
                qp.qpn(),
                dev.name(),
                if listens {
                    "a device of this process whose GID other devices share"
                } else {
                    "not a device of this process"
                }
            )));
        }
        let mut routes = lock(&self.inner.routes);
        if let Some(r) = routes.get_mut(&gid) {
            // QPs that are gone (destroyed: RESET) or failed (ERR) send nothing more.
            r.qps.retain(|w| {
                w.upgrade().is_some_and(|q| {
                    !Arc::ptr_eq(&q, qp)
                        && !matches!(q.state(), softnic::QpState::Reset | softnic::QpState::Err)
                })
            });
            if r.addr == to {
                r.qps.push(Arc::downgrade(qp));
                return Ok(());
            }
            if let Some(q) = r.qps.iter().find_map(Weak::upgrade) {
                return Err(Error::Unsupported(format!(
                    "QP {:#x} of {}: GID {} is routed to UDP {} for QP {:#x}, which is still \
                     alive; one soft NIC sends a GID to one UDP address, so this peer at {to} \
                     needs a QP of another context",
                    qp.qpn(),
                    dev.name(),
                    remote.gid(),
                    r.addr,
                    q.qpn()
                )));
            }
        }
        if in_process {
            // An entry left by QPs that are gone would take precedence over the local path.
            dev.remove_peer(&gid);
        } else {
            dev.add_peer(gid, to)?;
            tracing::debug!(device = dev.name(), %gid, %to, qpn = qp.qpn(), "wire peer added");
        }
        routes.insert(
            gid,
            Route {
                addr: to,
                qps: vec![Arc::downgrade(qp)],
            },
        );
        Ok(())
    }

    /// What was chosen and why.
    pub fn selection(&self) -> &Selection {
        &self.inner.selection
    }

    /// The port GID.
    pub fn gid(&self) -> softnic::Gid {
        match &self.inner.backend {
            Backend::Soft(d) => d.gid(),
            Backend::Mlx5(d) => softnic::Gid(d.gid.gid),
        }
    }

    /// The index of [`Context::gid`] in the port's GID table: the RoCE v2 GID an rdma-core
    /// device's QPs use (its `sgid_index`); 0 on the soft NIC, which has one GID.
    pub fn gid_index(&self) -> u8 {
        match &self.inner.backend {
            Backend::Soft(_) => 0,
            Backend::Mlx5(d) => d.gid.index,
        }
    }

    /// The path MTU the device offers (bytes): the port's active MTU on rdma-core devices,
    /// 4096 on the soft NIC.
    pub fn mtu(&self) -> u32 {
        match &self.inner.backend {
            Backend::Soft(_) => 4096,
            Backend::Mlx5(d) => d.mtu,
        }
    }

    /// The soft device behind this context (counters, fault injection in tests).
    pub fn soft_device(&self) -> Option<&Arc<softnic::Device>> {
        match &self.inner.backend {
            Backend::Soft(d) => Some(d),
            Backend::Mlx5(_) => None,
        }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context({})", self.inner.selection)
    }
}
