//! The rdma-core side every mlx5 object shares: the loaded libraries, an open device (its
//! port, RoCE v2 GID and limits, and the DEVX resources its DEVX objects share: the
//! completion EQ and a non-cached UAR page), a protection domain, and how calls report
//! failures.

use crate::Error;
use rdma_core_sys as sys;
use std::ffi::CStr;
use std::sync::Arc;

pub(super) fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

pub(super) fn verbs_err(call: &'static str, errno: i32, detail: String) -> Error {
    Error::Verbs {
        call,
        errno,
        detail,
    }
}

/// The loaded libraries.
pub(super) struct Libs {
    pub verbs: &'static sys::IbVerbs,
    pub dv: &'static sys::Mlx5Dv,
}

fn libs() -> Result<Libs, Error> {
    let load = |e: sys::LoadError| Error::Unsupported(format!("rdma-core: {e}"));
    Ok(Libs {
        verbs: sys::verbs().map_err(load)?,
        dv: sys::mlx5dv().map_err(load)?,
    })
}

/// The RoCE v2 GID index of a port: the first RoCE v2 GID whose address is IPv4-mapped (what
/// perftest's `-x` selects by hand), else the first RoCE v2 one. `None` on InfiniBand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GidChoice {
    pub index: u8,
    pub gid: [u8; 16],
}

/// Picks the GID: entries `(index, gid, is RoCE v2)`.
pub(crate) fn choose_gid(entries: &[(u8, [u8; 16], bool)]) -> Option<GidChoice> {
    let v4 = |g: &[u8; 16]| g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff;
    let pick = |want_v4: bool| {
        entries
            .iter()
            .find(|(_, g, v2)| *v2 && g.iter().any(|&b| b != 0) && (!want_v4 || v4(g)))
            .map(|&(index, gid, _)| GidChoice { index, gid })
    };
    pick(true).or_else(|| pick(false))
}

/// An open rdma-core device (one port used: 1).
pub(crate) struct Device {
    pub(super) libs: Libs,
    pub(super) ctx: *mut sys::ibv_context,
    pub name: String,
    pub port: u8,
    pub gid: GidChoice,
    /// Active MTU in bytes.
    pub mtu: u32,
    pub max_rd_atomic: u8,
    /// DEVX resources, made on first use ([`devx`]).
    devx: std::sync::Mutex<Option<Shared>>,
}

// SAFETY: an ibv_context may be used from any thread (libibverbs locks what it shares); the
// pointer is owned by this value and closed once, in drop.
unsafe impl Send for Device {}
// SAFETY: as above: every call through `&Device` is a thread-safe verbs call.
unsafe impl Sync for Device {}

/// The rdma-core devices listed, by name.
pub(crate) fn device_names() -> Result<Vec<String>, Error> {
    let l = libs()?;
    let mut n = 0i32;
    // SAFETY: writes the count through a valid pointer; returns a NULL-terminated array that
    // is freed below.
    let list = unsafe { (l.verbs.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        return Err(verbs_err("ibv_get_device_list", errno(), String::new()));
    }
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: i < n entries of the list; each is a live device.
        let p = unsafe { (l.verbs.ibv_get_device_name)(*list.add(i)) };
        if !p.is_null() {
            // SAFETY: a NUL-terminated name owned by the device.
            names.push(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
        }
    }
    // SAFETY: the list from ibv_get_device_list, freed once.
    unsafe { (l.verbs.ibv_free_device_list)(list) };
    Ok(names)
}

fn mtu_bytes(m: sys::ibv_mtu) -> u32 {
    match m {
        1..=5 => 128 << m,
        _ => 1024,
    }
}

pub(super) fn mtu_enum(bytes: u32) -> sys::ibv_mtu {
    match bytes {
        0..=256 => 1,
        257..=512 => 2,
        513..=1024 => 3,
        1025..=2048 => 4,
        _ => 5,
    }
}

impl Device {
    /// Opens device `name`, port 1, and picks its RoCE v2 GID.
    pub(crate) fn open(name: &str) -> Result<Arc<Self>, Error> {
        let libs = libs()?;
        let v = libs.verbs;
        let mut n = 0i32;
        // SAFETY: as in device_names.
        let list = unsafe { (v.ibv_get_device_list)(&mut n) };
        if list.is_null() {
            return Err(verbs_err("ibv_get_device_list", errno(), String::new()));
        }
        let mut ctx = std::ptr::null_mut();
        let mut open_errno = 0;
        for i in 0..n.max(0) as usize {
            // SAFETY: i < n live devices.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a live device's NUL-terminated name.
            let dn = unsafe { CStr::from_ptr((v.ibv_get_device_name)(dev)) };
            if dn.to_bytes() == name.as_bytes() {
                // SAFETY: opens a live device of the list (before the list is freed).
                ctx = unsafe { (v.ibv_open_device)(dev) };
                open_errno = errno();
                break;
            }
        }
        // SAFETY: freed once; the context stays valid after the list is freed.
        unsafe { (v.ibv_free_device_list)(list) };
        if ctx.is_null() {
            return Err(if open_errno == 0 {
                Error::NoSuchDevice(name.to_string())
            } else {
                verbs_err("ibv_open_device", open_errno, name.to_string())
            });
        }
        let mut dev = Self {
            libs,
            ctx,
            name: name.to_string(),
            port: 1,
            gid: GidChoice {
                index: 0,
                gid: [0; 16],
            },
            mtu: 1024,
            max_rd_atomic: 1,
            devx: std::sync::Mutex::new(None),
        };
        // SAFETY: `dv.mlx5dv_is_supported` takes the context's device; refuses non-mlx5.
        if !unsafe { (dev.libs.dv.mlx5dv_is_supported)((*ctx).device) } {
            return Err(Error::Unsupported(format!(
                "{name} is not an mlx5 (ConnectX) device"
            )));
        }
        // SAFETY: a zeroed port_attr is valid; query_port fills it.
        let mut pa: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, writable attr.
        let rc = unsafe { v.query_port(ctx, dev.port, &mut pa) };
        if rc != 0 {
            return Err(verbs_err("ibv_query_port", rc, format!("{name} port 1")));
        }
        if pa.state != sys::IBV_PORT_ACTIVE {
            return Err(Error::Unsupported(format!(
                "{name} port 1 is not ACTIVE (state {})",
                pa.state
            )));
        }
        if pa.link_layer as u32 != sys::IBV_LINK_LAYER_ETHERNET {
            return Err(Error::Unsupported(format!(
                "{name} port 1 is InfiniBand (LID addressing); this backend speaks RoCE"
            )));
        }
        dev.mtu = mtu_bytes(pa.active_mtu);
        let mut entries = Vec::new();
        for i in 0..pa.gid_tbl_len.clamp(0, 256) as u32 {
            // SAFETY: zeroed gid entry is valid plain data.
            let mut e: sys::ibv_gid_entry = unsafe { std::mem::zeroed() };
            let rc = match v._ibv_query_gid_ex {
                // SAFETY: live context, writable entry of the size given.
                Some(f) => unsafe {
                    f(
                        ctx,
                        1,
                        i,
                        &mut e,
                        0,
                        std::mem::size_of::<sys::ibv_gid_entry>(),
                    )
                },
                None => -1,
            };
            if rc == 0 {
                // SAFETY: reading the raw bytes of the union is always valid.
                let raw = unsafe { e.gid.raw };
                entries.push((i as u8, raw, e.gid_type == sys::IBV_GID_TYPE_ROCE_V2));
            }
        }
        dev.gid = choose_gid(&entries)
            .ok_or_else(|| Error::Unsupported(format!("{name} port 1 has no RoCE v2 GID")))?;
        // SAFETY: zeroed device attr is valid; query fills it.
        let mut da: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, writable attr.
        let rc = unsafe { (v.ibv_query_device)(ctx, &mut da) };
        if rc != 0 {
            return Err(verbs_err("ibv_query_device", rc, name.to_string()));
        }
        dev.max_rd_atomic = da.max_qp_rd_atom.clamp(1, 16) as u8;
        tracing::debug!(
            device = name,
            gid_index = dev.gid.index,
            mtu = dev.mtu,
            "mlx5 device opened"
        );
        Ok(Arc::new(dev))
    }

    /// Allocates a PD.
    pub(crate) fn alloc_pd(self: &Arc<Self>) -> Result<Arc<Pd>, Error> {
        // SAFETY: live context.
        let pd = unsafe { (self.libs.verbs.ibv_alloc_pd)(self.ctx) };
        if pd.is_null() {
            return Err(verbs_err("ibv_alloc_pd", errno(), self.name.clone()));
        }
        Ok(Arc::new(Pd {
            dev: self.clone(),
            pd,
        }))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let shared = self.devx.lock().ok().and_then(|mut s| s.take());
        if let Some(s) = shared {
            s.free(self);
        }
        // SAFETY: every child object holds an Arc of the device, so none is alive; closed once.
        unsafe { (self.libs.verbs.ibv_close_device)(self.ctx) };
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pub dev: Arc<Device>,
    pub(super) pd: *mut sys::ibv_pd,
}

// SAFETY: a PD pointer is used only in verbs calls, which are thread-safe.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: children hold an Arc of the PD; deallocated once.
        let rc = unsafe { (self.dev.libs.verbs.ibv_dealloc_pd)(self.pd) };
        if rc != 0 {
            tracing::warn!(errno = rc, "ibv_dealloc_pd failed");
        }
    }
}

/// The verbs access flags of a host-API access set.
pub(super) fn ibv_access(a: verbs::Access) -> u32 {
    let mut f = 0;
    for (bit, flag) in [
        (verbs::Access::LOCAL_WRITE, sys::IBV_ACCESS_LOCAL_WRITE),
        (verbs::Access::REMOTE_WRITE, sys::IBV_ACCESS_REMOTE_WRITE),
        (verbs::Access::REMOTE_READ, sys::IBV_ACCESS_REMOTE_READ),
        (verbs::Access::REMOTE_ATOMIC, sys::IBV_ACCESS_REMOTE_ATOMIC),
    ] {
        if a.contains(bit) {
            f |= flag;
        }
    }
    f
}

/// What RTR needs to know of the peer.
pub(crate) struct Remote {
    pub gid: [u8; 16],
    pub qpn: u32,
    pub psn: u32,
    pub mtu: u32,
}

/// The device's DEVX resources shared by its objects: the completion EQ and a non-cached UAR
/// page (its doorbell register at `reg`).
pub(crate) struct Shared {
    pub eqn: u32,
    uar: Uar,
}

/// A UAR page from `mlx5dv_devx_alloc_uar`.
pub(crate) struct Uar {
    uar: *mut sys::mlx5dv_devx_uar,
    pub page_id: u32,
    /// The doorbell (first BlueFlame) register: page + 0x800.
    pub reg: *mut u8,
}

// SAFETY: the UAR handle is only passed to libmlx5 (thread-safe) and freed once by its owner;
// the register is written by one poster at a time.
unsafe impl Send for Uar {}
// SAFETY: as above.
unsafe impl Sync for Uar {}

impl Uar {
    pub(super) fn alloc(dev: &Device, bf: bool) -> Result<Self, Error> {
        let kind = if bf {
            sys::MLX5DV_UAR_ALLOC_TYPE_BF
        } else {
            sys::MLX5DV_UAR_ALLOC_TYPE_NC
        };
        // SAFETY: live context.
        let uar = unsafe { (dev.libs.dv.mlx5dv_devx_alloc_uar)(dev.ctx, kind) };
        if uar.is_null() {
            return Err(verbs_err(
                "mlx5dv_devx_alloc_uar",
                errno(),
                format!("{} page", if bf { "BlueFlame" } else { "non-cached" }),
            ));
        }
        // SAFETY: a live UAR libmlx5 just returned.
        let (page_id, reg) = unsafe { ((*uar).page_id, (*uar).reg_addr.cast()) };
        Ok(Self { uar, page_id, reg })
    }

    /// Frees the page (the device's context must still be open).
    pub(super) fn free(&self, dev: &Device) {
        // SAFETY: allocated on this context, freed once by its owner.
        unsafe { (dev.libs.dv.mlx5dv_devx_free_uar)(self.uar) };
    }
}

impl Shared {
    /// Frees the shared UAR (from the device's drop, before the context closes).
    pub(crate) fn free(&self, dev: &Device) {
        self.uar.free(dev);
    }
}

/// `Some(f)` of an optional libmlx5 entry point, or an error naming it.
pub(super) fn entry<T>(f: Option<T>, name: &str) -> Result<T, Error> {
    f.ok_or_else(|| Error::Unsupported(format!("{name} is not in this libmlx5")))
}

impl Device {
    /// The device's DEVX resources, made on first use: QUERY_EQN of vector 0 and a
    /// non-cached UAR page.
    pub(crate) fn devx(&self) -> Result<(u32, u32, *mut u8), Error> {
        let mut s = self
            .devx
            .lock()
            .map_err(|_| Error::Unsupported("the DEVX state lock is poisoned".into()))?;
        if let Some(s) = &*s {
            return Ok((s.eqn, s.uar.page_id, s.uar.reg));
        }
        let query = entry(self.libs.dv.mlx5dv_devx_query_eqn, "mlx5dv_devx_query_eqn")?;
        let mut eqn = 0u32;
        // SAFETY: live context, writable out value.
        let rc = unsafe { query(self.ctx, 0, &mut eqn) };
        if rc != 0 {
            return Err(verbs_err(
                "mlx5dv_devx_query_eqn",
                rc,
                format!("{}: DEVX (a context opened for it) is needed", self.name),
            ));
        }
        let uar = Uar::alloc(self, false)?;
        let r = (eqn, uar.page_id, uar.reg);
        *s = Some(Shared { eqn, uar });
        Ok(r)
    }
}

impl Device {
    /// Whether the device makes QPs without a send doorbell record: QUERY_HCA_CAP of
    /// `cmd_hca_cap_2` (current values), its `send_dbr_mode_no_dbr_ext` bit (a ConnectX-8 sets
    /// it). A device that cannot answer the query (no cap2, no DEVX) has none.
    pub(crate) fn no_dbr_ext(&self) -> bool {
        use prm::cmd::{self, cap, hca_cap_2, op};
        let Some(general) = self.libs.dv.mlx5dv_devx_general_cmd else {
            return false;
        };
        let mut input = [0u8; 16];
        cmd::set(
            &mut input,
            cmd::cmd_in::OPCODE,
            u64::from(op::QUERY_HCA_CAP),
        );
        cmd::set(
            &mut input,
            cmd::cmd_in::OP_MOD,
            u64::from(cap::GENERAL_2 << 1 | cap::CURRENT),
        );
        let mut out = vec![0u8; cmd::QUERY_HCA_CAP_OUT];
        // SAFETY: a live context; in and out are buffers of the lengths given.
        let rc = unsafe {
            general(
                self.ctx,
                input.as_ptr().cast(),
                input.len(),
                out.as_mut_ptr().cast(),
                out.len(),
            )
        };
        rc == 0
            && cmd::get(
                &out,
                hca_cap_2::SEND_DBR_MODE_NO_DBR_EXT.at(cmd::HCA_CAP_AT),
            ) == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_choice_prefers_ipv4_mapped_roce_v2() {
        let mut v4 = [0u8; 16];
        v4[10] = 0xff;
        v4[11] = 0xff;
        v4[12..].copy_from_slice(&[10, 0, 0, 1]);
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        ll[15] = 1;
        let table = [(0, ll, false), (1, ll, true), (2, v4, false), (3, v4, true)];
        assert_eq!(choose_gid(&table), Some(GidChoice { index: 3, gid: v4 }));
        assert_eq!(
            choose_gid(&[(0, ll, false), (1, ll, true)]),
            Some(GidChoice { index: 1, gid: ll })
        );
        assert_eq!(choose_gid(&[(0, ll, false), (2, [0; 16], true)]), None);
        assert_eq!(mtu_enum(4096), 5);
        assert_eq!(mtu_bytes(3), 1024);
    }
}
