//! rdma-core as the doctor sees it: the libraries, their release, and each device with its
//! ports and GIDs, read through the real libibverbs (loaded at run time by
//! `rdma-core-sys`; under `gpuverbs emu` these are the emulated mlx5 devices). Also the
//! doorbell page for the trial registration: the UAR page of a CQ of an opened mlx5 context.

use crate::doctor::sysfs;
use rdma_core_sys as sys;
use std::ffi::{c_void, CStr};
use std::net::Ipv6Addr;

/// Why rdma-core could not answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RdmaProbeError {
    /// A library did not load.
    #[error("rdma-core: {0}")]
    Load(#[from] sys::LoadError),
    /// A verbs call failed.
    #[error("{call} failed: {}", std::io::Error::from_raw_os_error(*.errno))]
    Verbs {
        /// The call.
        call: &'static str,
        /// The errno it reported.
        errno: i32,
    },
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// The rdma-core libraries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Libraries {
    /// Where libibverbs was loaded from (`/proc/self/maps`).
    pub verbs_file: Option<String>,
    /// The rdma-core release its file name carries (`44.0`).
    pub release: Option<String>,
    /// libmlx5 (the mlx5 provider, which gpuverbs' backend needs): its file, or why not.
    pub mlx5: Result<String, String>,
}

/// Loads libibverbs and libmlx5 and says where they came from.
pub fn libraries() -> Result<Libraries, RdmaProbeError> {
    sys::verbs()?;
    let mlx5 = sys::mlx5dv().map(|_| ()).map_err(|e| e.to_string());
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let file = |stem: &str| sysfs::mapped_library(&maps, stem).map(|p| p.display().to_string());
    let verbs_file = file("libibverbs.so");
    let release = verbs_file
        .as_deref()
        .and_then(sysfs::rdma_core_release)
        .or_else(|| {
            file("libmlx5.so")
                .as_deref()
                .and_then(sysfs::rdma_core_release)
        });
    Ok(Libraries {
        verbs_file,
        release,
        mlx5: mlx5.map(|()| file("libmlx5.so").unwrap_or_else(|| sys::LIBMLX5.to_string())),
    })
}

/// One GID table entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gid {
    /// Index.
    pub index: u32,
    /// The GID.
    pub gid: Ipv6Addr,
    /// `IB`, `RoCE v1`, `RoCE v2` (or the raw type).
    pub kind: String,
}

/// One port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    /// Port number (1-based).
    pub num: u8,
    /// `ACTIVE`, `DOWN`, ...
    pub state: String,
    /// Whether the state is ACTIVE.
    pub active: bool,
    /// `Ethernet` or `InfiniBand`.
    pub link_layer: String,
    /// Active MTU in bytes.
    pub mtu: u32,
    /// The populated GID entries.
    pub gids: Vec<Gid>,
}

impl Port {
    /// Whether the port has a RoCE v2 GID (what gpuverbs' mlx5 backend addresses with).
    pub fn has_roce_v2(&self) -> bool {
        self.gids.iter().any(|g| g.kind == "RoCE v2")
    }
}

/// One device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// Name (`mlx5_0`).
    pub name: String,
    /// Whether libmlx5 drives it (`mlx5dv_is_supported`).
    pub mlx5: bool,
    /// Firmware version (`ibv_query_device`).
    pub fw_ver: String,
    /// Its ports, or why they could not be read.
    pub ports: Result<Vec<Port>, RdmaProbeError>,
}

fn port_state(s: sys::ibv_port_state) -> &'static str {
    match s {
        sys::IBV_PORT_NOP => "NOP",
        sys::IBV_PORT_DOWN => "DOWN",
        sys::IBV_PORT_INIT => "INIT",
        sys::IBV_PORT_ARMED => "ARMED",
        sys::IBV_PORT_ACTIVE => "ACTIVE",
        sys::IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "unknown",
    }
}

fn gid_kind(t: u32) -> String {
    match t {
        sys::IBV_GID_TYPE_IB => "IB".into(),
        sys::IBV_GID_TYPE_ROCE_V1 => "RoCE v1".into(),
        sys::IBV_GID_TYPE_ROCE_V2 => "RoCE v2".into(),
        t => format!("type {t}"),
    }
}

/// An open device context, closed on drop.
struct Open {
    v: &'static sys::IbVerbs,
    ctx: *mut sys::ibv_context,
}

impl Drop for Open {
    fn drop(&mut self) {
        // SAFETY: opened by `with_devices`, closed once; objects made on it are gone.
        unsafe { (self.v.ibv_close_device)(self.ctx) };
    }
}

/// Calls `f(name, device, opened context or the open errno)` for each listed device.
fn with_devices<T>(
    mut f: impl FnMut(&str, *mut sys::ibv_device, Result<&Open, i32>) -> T,
) -> Result<Vec<T>, RdmaProbeError> {
    let v = sys::verbs()?;
    let mut n = 0i32;
    // SAFETY: writes the count; returns a NULL-terminated list freed below.
    let list = unsafe { (v.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        return Err(RdmaProbeError::Verbs {
            call: "ibv_get_device_list",
            errno: errno(),
        });
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: i < n entries, each a live device until the list is freed.
        let dev = unsafe { *list.add(i) };
        // SAFETY: a live device; the name is NUL-terminated and owned by it.
        let name_ptr = unsafe { (v.ibv_get_device_name)(dev) };
        let name = if name_ptr.is_null() {
            format!("device {i}")
        } else {
            // SAFETY: as above.
            unsafe { CStr::from_ptr(name_ptr) }
                .to_string_lossy()
                .into_owned()
        };
        // SAFETY: opens a live device of the list.
        let ctx = unsafe { (v.ibv_open_device)(dev) };
        let opened = (!ctx.is_null()).then_some(Open { v, ctx });
        let e = errno();
        out.push(f(&name, dev, opened.as_ref().ok_or(e)));
    }
    // SAFETY: freed once; contexts opened from it were closed (dropped) above.
    unsafe { (v.ibv_free_device_list)(list) };
    Ok(out)
}

fn ports(o: &Open) -> Result<(String, Vec<Port>), RdmaProbeError> {
    let v = o.v;
    // SAFETY: zeroed plain data; ibv_query_device fills it.
    let mut da: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: live context, writable attr.
    let rc = unsafe { (v.ibv_query_device)(o.ctx, &mut da) };
    if rc != 0 {
        return Err(RdmaProbeError::Verbs {
            call: "ibv_query_device",
            errno: rc,
        });
    }
    // SAFETY: fw_ver is a NUL-terminated array the provider filled (zeroed beforehand).
    let fw = unsafe { CStr::from_ptr(da.fw_ver.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut out = Vec::new();
    for num in 1..=da.phys_port_cnt {
        // SAFETY: zeroed plain data.
        let mut pa: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, writable attr.
        let rc = unsafe { v.query_port(o.ctx, num, &mut pa) };
        if rc != 0 {
            return Err(RdmaProbeError::Verbs {
                call: "ibv_query_port",
                errno: rc,
            });
        }
        let mut gids = Vec::new();
        for i in 0..pa.gid_tbl_len.clamp(0, 256) as u32 {
            // SAFETY: zeroed plain data.
            let mut e: sys::ibv_gid_entry = unsafe { std::mem::zeroed() };
            let Some(q) = v._ibv_query_gid_ex else { break };
            // SAFETY: live context, writable entry of the size passed.
            let rc = unsafe {
                q(
                    o.ctx,
                    u32::from(num),
                    i,
                    &mut e,
                    0,
                    std::mem::size_of::<sys::ibv_gid_entry>(),
                )
            };
            if rc != 0 {
                continue; // an empty entry (ENODATA)
            }
            // SAFETY: every bit pattern of the union's raw bytes is valid.
            let raw = unsafe { e.gid.raw };
            if raw.iter().all(|&b| b == 0) {
                continue;
            }
            gids.push(Gid {
                index: i,
                gid: Ipv6Addr::from(raw),
                kind: gid_kind(e.gid_type),
            });
        }
        out.push(Port {
            num,
            state: port_state(pa.state).to_string(),
            active: pa.state == sys::IBV_PORT_ACTIVE,
            link_layer: match u32::from(pa.link_layer) {
                sys::IBV_LINK_LAYER_ETHERNET => "Ethernet".into(),
                sys::IBV_LINK_LAYER_INFINIBAND => "InfiniBand".into(),
                l => format!("link layer {l}"),
            },
            mtu: match pa.active_mtu {
                m @ 1..=5 => 128 << m,
                _ => 0,
            },
            gids,
        });
    }
    Ok((fw, out))
}

/// Every device rdma-core lists, with its ports.
pub fn devices() -> Result<Vec<Device>, RdmaProbeError> {
    let mlx5 = sys::mlx5dv().ok();
    with_devices(|name, dev, opened| {
        // SAFETY: a live device of the list.
        let is_mlx5 = mlx5.is_some_and(|dv| unsafe { (dv.mlx5dv_is_supported)(dev) });
        let (fw_ver, ports) = match opened {
            Ok(o) => match ports(o) {
                Ok((fw, p)) => (fw, Ok(p)),
                Err(e) => (String::new(), Err(e)),
            },
            Err(errno) => (
                String::new(),
                Err(RdmaProbeError::Verbs {
                    call: "ibv_open_device",
                    errno,
                }),
            ),
        };
        Device {
            name: name.to_string(),
            mlx5: is_mlx5,
            fw_ver,
            ports,
        }
    })
}

/// The doorbell (UAR) page of a CQ on an opened mlx5 context, for the trial registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DoorbellPage {
    /// The device.
    pub device: String,
    /// The page's address in this process.
    pub addr: usize,
}

/// Opens mlx5 device `name` (or the first mlx5 device), creates a one-entry CQ, finds its UAR
/// page with `mlx5dv_init_obj`, and calls `f` with it while the context and CQ are alive.
/// `Ok(None)`: no mlx5 device.
pub fn with_doorbell_page<T>(
    name: Option<&str>,
    f: impl FnOnce(&DoorbellPage) -> T,
) -> Result<Option<T>, RdmaProbeError> {
    let dv = sys::mlx5dv()?;
    let mut f = Some(f);
    let mut found: Option<Result<T, RdmaProbeError>> = None;
    with_devices(|dname, dev, opened| {
        if found.is_some() || name.is_some_and(|n| n != dname) {
            return;
        }
        // SAFETY: a live device of the list.
        if !unsafe { (dv.mlx5dv_is_supported)(dev) } {
            return;
        }
        let o = match opened {
            Ok(o) => o,
            Err(errno) => {
                found = Some(Err(RdmaProbeError::Verbs {
                    call: "ibv_open_device",
                    errno,
                }));
                return;
            }
        };
        // SAFETY: live context; a CQ without channel, destroyed below.
        let cq =
            unsafe { (o.v.ibv_create_cq)(o.ctx, 1, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if cq.is_null() {
            found = Some(Err(RdmaProbeError::Verbs {
                call: "ibv_create_cq",
                errno: errno(),
            }));
            return;
        }
        // SAFETY: zeroed plain data.
        let mut out: sys::mlx5dv_cq = unsafe { std::mem::zeroed() };
        // SAFETY: zeroed plain data.
        let mut obj: sys::mlx5dv_obj = unsafe { std::mem::zeroed() };
        obj.cq.in_ = cq;
        obj.cq.out = &mut out;
        // SAFETY: a live mlx5 CQ and a writable output struct.
        let rc = unsafe { (dv.mlx5dv_init_obj)(&mut obj, u64::from(sys::MLX5DV_OBJ_CQ)) };
        found = Some(if rc != 0 || out.cq_uar.is_null() {
            Err(RdmaProbeError::Verbs {
                call: "mlx5dv_init_obj(CQ)",
                errno: if rc != 0 { rc } else { libc::EINVAL },
            })
        } else {
            let addr = (out.cq_uar as usize) & !4095;
            let run = f.take().map(|f| {
                f(&DoorbellPage {
                    device: dname.to_string(),
                    addr,
                })
            });
            run.ok_or(RdmaProbeError::Verbs {
                call: "doorbell page",
                errno: libc::EINVAL,
            })
        });
        // SAFETY: created above, destroyed once, after `f` returned.
        unsafe { (o.v.ibv_destroy_cq)(cq) };
    })?;
    found.transpose()
}

/// The page address as a pointer (for the CUDA trial).
impl DoorbellPage {
    /// A pointer to the page.
    pub fn ptr(&self) -> *mut c_void {
        self.addr as *mut c_void
    }
}
