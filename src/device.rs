//! Device selection: which NIC backs a [`Context`], chosen automatically or by name, with the
//! choice and its reason logged and queryable.
//!
//! Backends: the soft NIC (always available) and, later, a ConnectX through rdma-core. The
//! boundary is [`Backend`]: everything above it (memory, queues, export, proxy) is shared.

use crate::Error;
use std::sync::Arc;

/// Environment variable that overrides device selection: `soft`/`softnic` (or a soft device
/// name such as `softnic0`), or an rdma-core device name such as `mlx5_0`.
pub const DEVICE_ENV: &str = "GPUVERBS_DEVICE";

/// Which kind of device backs a context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The in-process software mlx5 device.
    Soft,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Soft => "soft NIC",
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
}

/// An open device: the root of every other object (PDs, CQs, QPs keep it alive).
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

pub(crate) struct ContextInner {
    pub backend: Backend,
    pub selection: Selection,
}

/// Names rdma-core lists, or why it lists none.
fn rdma_core_devices() -> Result<Vec<String>, String> {
    let verbs = rdma_core_sys::verbs().map_err(|e| e.to_string())?;
    let mut n = 0i32;
    // SAFETY: `ibv_get_device_list` writes the count through a valid pointer and returns a
    // NULL-terminated array we free with `ibv_free_device_list`.
    let list = unsafe { (verbs.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        return Err(format!(
            "ibv_get_device_list failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: i < n entries of the list just returned; each is a live device.
        let name = unsafe { (verbs.ibv_get_device_name)(*list.add(i)) };
        if !name.is_null() {
            // SAFETY: ibv_get_device_name returns a NUL-terminated string owned by the device.
            names.push(
                unsafe { std::ffi::CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { (verbs.ibv_free_device_list)(list) };
    Ok(names)
}

impl Context {
    /// Opens a device as `req` asks, after applying [`DEVICE_ENV`] when `req` is `Auto`.
    pub fn open(req: DeviceRequest) -> Result<Self, Error> {
        let env = std::env::var(DEVICE_ENV).ok().filter(|v| !v.is_empty());
        let (req, origin) = match (req, env) {
            (DeviceRequest::Auto, Some(v)) => {
                (DeviceRequest::Named(v), format!("{DEVICE_ENV} asks for it"))
            }
            (r, _) => (r, "requested in code".to_string()),
        };
        let soft_reason = match &req {
            DeviceRequest::Auto => match rdma_core_devices() {
                Ok(names) if !names.is_empty() => format!(
                    "rdma-core lists {} but this build has no ConnectX backend",
                    names.join(", ")
                ),
                Ok(_) => "rdma-core lists no RDMA device".to_string(),
                Err(why) => format!("no rdma-core device: {why}"),
            },
            DeviceRequest::Soft => origin,
            DeviceRequest::Named(n)
                if n == "soft" || n == "softnic" || n.starts_with("softnic") =>
            {
                origin
            }
            DeviceRequest::Named(n) => return Err(Error::NoSuchDevice(n.clone())),
        };
        let name = match &req {
            DeviceRequest::Named(n) if n.starts_with("softnic") && n != "softnic" => n.clone(),
            _ => String::new(),
        };
        Self::soft(
            softnic::DeviceConfig {
                name,
                ..Default::default()
            },
            soft_reason,
        )
    }

    /// Opens a soft NIC with explicit settings (GID, name, completion-only mode).
    pub fn open_soft(cfg: softnic::DeviceConfig) -> Result<Self, Error> {
        Self::soft(
            cfg,
            "soft NIC with explicit settings, requested in code".into(),
        )
    }

    fn soft(cfg: softnic::DeviceConfig, reason: String) -> Result<Self, Error> {
        let dev = softnic::Device::open(cfg)?;
        let selection = Selection {
            kind: BackendKind::Soft,
            name: dev.name().to_string(),
            reason,
        };
        tracing::info!(device = %selection, "gpuverbs device selected");
        Ok(Self {
            inner: Arc::new(ContextInner {
                backend: Backend::Soft(Arc::new(dev)),
                selection,
            }),
        })
    }

    /// What was chosen and why.
    pub fn selection(&self) -> &Selection {
        &self.inner.selection
    }

    /// The port GID.
    pub fn gid(&self) -> softnic::Gid {
        match &self.inner.backend {
            Backend::Soft(d) => d.gid(),
        }
    }

    /// The soft device behind this context (counters, fault injection in tests).
    pub fn soft_device(&self) -> Option<&Arc<softnic::Device>> {
        match &self.inner.backend {
            Backend::Soft(d) => Some(d),
        }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context({})", self.inner.selection)
    }
}
