//! An open device, [`Context`]: which device backs it (chosen automatically, by name or by
//! [`DEVICE_ENV`], with the reason logged and queryable), opened in its room, behind the seam
//! ([`DeviceOps`]) that everything above (memory, queues, export, proxy) calls.

use super::seam::DeviceOps;
use super::soft::{self, parse_softnic_addr, SOFTNIC_ADDR_ENV};
use super::{mlx5, BackendKind, DeviceRequest, Selection, DEVICE_ENV};
use crate::Error;
use std::net::SocketAddr;
use std::sync::Arc;
use verbs::Gid;

/// An open device: the root of every other object (PDs, CQs, QPs keep it alive).
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

pub(crate) struct ContextInner {
    pub device: Arc<dyn DeviceOps>,
    pub selection: Selection,
}

/// Names rdma-core lists, or why it lists none.
fn rdma_core_devices() -> Result<Vec<String>, Error> {
    mlx5::device_names()
}

/// Why the soft NIC, when rdma-core cannot list devices: in words, not as an error (a machine
/// without RDMA is the ordinary case here, not a failure).
fn no_rdma_device(e: &Error) -> String {
    match e {
        Error::Verbs {
            call: "ibv_get_device_list",
            errno,
            ..
        } if *errno == libc::ENOSYS => {
            "auto: no RDMA device (the kernel has no RDMA support)".to_string()
        }
        e => format!("auto: no RDMA device (rdma-core: {e})"),
    }
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
                Ok(_) => "auto: rdma-core lists no RDMA device".to_string(),
                Err(e) => no_rdma_device(&e),
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
            crate::soft::DeviceConfig {
                name,
                wire: wire.map(crate::soft::WireConfig::new),
                ..Default::default()
            },
            soft_reason,
            &wire_origin,
        )
    }

    /// Opens a soft NIC with explicit settings (GID, name, completion-only mode, wire port).
    /// [`DEVICE_ENV`] and [`SOFTNIC_ADDR_ENV`] do not apply.
    pub fn open_soft(cfg: crate::soft::DeviceConfig) -> Result<Self, Error> {
        Self::soft(
            cfg,
            "soft NIC with explicit settings, requested in code".into(),
            "requested in code",
        )
    }

    /// Opens rdma-core device `name` with the ConnectX backend.
    fn mlx5(name: &str, reason: String) -> Result<Self, Error> {
        let dev = mlx5::Device::open(name)?;
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
                device: Arc::new(mlx5::Mlx5Device(dev)),
                selection,
            }),
        })
    }

    /// Opens the soft device; `reason` says why a soft NIC, `wire_origin` why its wire port.
    fn soft(
        cfg: crate::soft::DeviceConfig,
        reason: String,
        wire_origin: &str,
    ) -> Result<Self, Error> {
        let dev = Arc::new(crate::soft::Device::open(cfg)?);
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
        soft::register(&dev);
        Ok(Self {
            inner: Arc::new(ContextInner {
                device: Arc::new(soft::SoftDevice::new(dev)),
                selection,
            }),
        })
    }

    /// The bound UDP address of the device's wire port (with the port the system picked), or
    /// `None` when the device reaches peers of this process only.
    pub fn wire_addr(&self) -> Option<SocketAddr> {
        self.inner.device.wire_addr()
    }

    /// The UDP port an endpoint of this context carries ([`Endpoint::udp_port`](crate::Endpoint::udp_port)).
    pub(crate) fn udp_port(&self) -> Option<u16> {
        self.wire_addr().map(|a| a.port())
    }

    /// What was chosen and why.
    pub fn selection(&self) -> &Selection {
        &self.inner.selection
    }

    /// The port GID.
    pub fn gid(&self) -> Gid {
        self.inner.device.gid()
    }

    /// The index of [`Context::gid`] in the port's GID table: the RoCE v2 GID an rdma-core
    /// device's QPs use (its `sgid_index`); 0 on the soft NIC, which has one GID.
    pub fn gid_index(&self) -> u8 {
        self.inner.device.gid_index()
    }

    /// The path MTU the device offers (bytes): the port's active MTU on rdma-core devices,
    /// 4096 on the soft NIC.
    pub fn mtu(&self) -> u32 {
        self.inner.device.mtu()
    }

    /// The soft device behind this context (counters, fault injection in tests).
    pub fn soft_device(&self) -> Option<&Arc<crate::soft::Device>> {
        soft::device_of(&*self.inner.device)
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context({})", self.inner.selection)
    }
}
