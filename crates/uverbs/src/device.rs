//! The emulated devices of this process: one soft NIC per `mlx5_N`, each with a RoCEv2 wire
//! port on its own address, opened when a program first opens the device, and the attributes
//! the kernel reports for it (QUERY_DEVICE, QUERY_PORT).

use crate::abi;
use crate::config::{DeviceIdentity, EmuConfig};
use crate::uaccess::Errno;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// Largest SQ in blocks and RQ in WQEs.
pub const MAX_QP_WR: u32 = 32768;
/// Largest CQ.
pub const MAX_CQE: u32 = (1 << 22) - 1;
/// Scatter/gather entries per WQE.
pub const MAX_SGE: u32 = 30;
/// Data segments per SRQ WQE (512-byte WQEs: the next segment and 31 data segments).
pub const MAX_SRQ_SGE: u32 = 31;
/// Largest SRQ (WQEs, one less than its ring).
pub const MAX_SRQ_WR: u32 = MAX_QP_WR - 1;
/// Outstanding READs / atomics per QP.
pub const MAX_RD_ATOM: u32 = 16;
/// `IB_MTU_4096`.
pub const MTU_4096: u8 = 5;

/// One emulated device.
pub struct EmuDevice {
    /// What it shows.
    pub id: DeviceIdentity,
    static_uars: bool,
    soft: Mutex<Option<Arc<softnic::Device>>>,
    /// XRC domains opened with a file, by its inode (device, inode number): every context
    /// that opens the same file shares the domain, as the kernel's per-device inode table.
    xrcds: Mutex<HashMap<(u64, u64), Weak<softnic::Xrcd>>>,
}

impl EmuDevice {
    fn new(id: DeviceIdentity, static_uars: bool) -> Self {
        Self {
            id,
            static_uars,
            soft: Mutex::new(None),
            xrcds: Mutex::default(),
        }
    }

    /// Whether the device offers static UAR pages only (no dynamic UAR allocation).
    pub fn static_uars(&self) -> bool {
        self.static_uars
    }

    /// The soft NIC behind the device, started (with its wire port) on first use.
    pub fn soft(&self) -> Result<Arc<softnic::Device>, Errno> {
        let mut s = self.soft.lock();
        if let Some(d) = &*s {
            return Ok(d.clone());
        }
        let wire = softnic::WireConfig {
            default_port: self.id.port,
            ..softnic::WireConfig::new((self.id.ip, self.id.port).into())
        };
        let d = softnic::Device::open(softnic::DeviceConfig {
            name: self.id.name.clone(),
            gid: Some(verbs::Gid::from_ipv4(self.id.ip)),
            completion_only: false,
            wire: Some(wire),
            engine_threads: 1,
        })
        .map_err(|e| {
            crate::complain(format_args!(
                "{}: cannot start the soft NIC on {}:{}: {e}",
                self.id.name, self.id.ip, self.id.port
            ));
            Errno::ENODEV
        })?;
        let d = Arc::new(d);
        *s = Some(d.clone());
        Ok(d)
    }

    /// OPEN_XRCD's domain for the file of inode `inode` (`None`: no file, a domain of its
    /// own): the open one of that inode, unless `excl`; a new one when `create` (and none is
    /// open). EINVAL otherwise, as the kernel's `ib_uverbs_open_xrcd`.
    pub fn xrcd_for(
        &self,
        soft: &softnic::Device,
        inode: Option<(u64, u64)>,
        create: bool,
        excl: bool,
    ) -> Result<Arc<softnic::Xrcd>, Errno> {
        let Some(key) = inode else {
            return Ok(soft.alloc_xrcd());
        };
        let mut t = self.xrcds.lock();
        t.retain(|_, w| w.strong_count() > 0);
        match t.get(&key).and_then(Weak::upgrade) {
            Some(_) if excl => Err(Errno::EINVAL),
            Some(x) => Ok(x),
            None if !create => Err(Errno::EINVAL),
            None => {
                let x = soft.alloc_xrcd();
                t.insert(key, Arc::downgrade(&x));
                Ok(x)
            }
        }
    }

    /// The soft NIC, if it was started.
    pub fn started(&self) -> Option<Arc<softnic::Device>> {
        self.soft.lock().clone()
    }

    /// QUERY_DEVICE's answer.
    pub fn attr(&self) -> abi::QueryDeviceResp {
        abi::QueryDeviceResp {
            fw_ver: 1 << 16,
            node_guid: self.id.node_guid.to_be(),
            sys_image_guid: self.id.node_guid.to_be(),
            max_mr_size: u64::MAX,
            page_size_cap: 0xffff_f000,
            vendor_id: 0x02c9,
            vendor_part_id: crate::sysfs::PCI_DEVICE as u32,
            hw_ver: 0,
            max_qp: 1 << 18,
            max_qp_wr: MAX_QP_WR,
            // RESIZE_MAX_WR | BAD_PKEY_CNTR | BAD_QKEY_CNTR | CHANGE_PHY_PORT
            // | PORT_ACTIVE_EVENT | SYS_IMAGE_GUID | RC_RNR_NAK_GEN | MEM_WINDOW
            // | XRC | BLOCK_MULTICAST_LOOPBACK (no multicast at all) | MEM_WINDOW_TYPE_2B
            device_cap_flags: 0x1
                | 0x2
                | 0x4
                | 0x20
                | 0x400
                | 0x800
                | 0x1000
                | 1 << 17
                | 1 << 20
                | 1 << 22
                | 1 << 24,
            max_sge: MAX_SGE,
            max_sge_rd: MAX_SGE,
            max_cq: 1 << 24,
            max_cqe: MAX_CQE,
            max_mr: 1 << 24,
            max_mw: 1 << 24,
            max_pd: 1 << 24,
            max_qp_rd_atom: MAX_RD_ATOM,
            max_res_rd_atom: MAX_RD_ATOM << 18,
            max_qp_init_rd_atom: MAX_RD_ATOM,
            atomic_cap: 1, // IB_ATOMIC_HCA
            max_ah: i32::MAX as u32,
            max_srq: 1 << 23,
            max_srq_wr: MAX_SRQ_WR,
            max_srq_sge: MAX_SRQ_SGE,
            max_pkeys: 1,
            local_ca_ack_delay: 16,
            phys_port_cnt: 1,
            ..Default::default()
        }
    }

    /// QUERY_PORT's answer for port 1.
    pub fn port(&self) -> abi::QueryPortResp {
        abi::QueryPortResp {
            // IB_PORT_CM_SUP | IB_PORT_IP_BASED_GIDS
            port_cap_flags: 0x0001_0000 | 0x0400_0000,
            max_msg_sz: 1 << 30,
            gid_tbl_len: 1,
            pkey_tbl_len: 1,
            state: 4, // ACTIVE
            max_mtu: MTU_4096,
            // as mlx5_ib: the netdev's MTU less the RoCE headers, at most the port's
            active_mtu: crate::netdev::active_ib_mtu(self.id.netdev.mtu).min(MTU_4096),
            max_vl_num: 1,
            active_width: 2,  // 4X
            active_speed: 32, // EDR
            phys_state: 5,    // LinkUp
            link_layer: 2,    // Ethernet
            ..Default::default()
        }
    }
}

/// The process's devices.
pub struct Devices {
    /// The settings they came from.
    pub cfg: EmuConfig,
    devs: Vec<EmuDevice>,
}

impl Devices {
    /// The devices `cfg` describes (none started yet).
    pub fn new(cfg: EmuConfig) -> Self {
        let devs = (0..cfg.devices)
            .map(|i| EmuDevice::new(cfg.device(i), cfg.static_uars))
            .collect();
        Self { cfg, devs }
    }

    /// The device whose character device is `path`.
    pub fn by_cdev(&self, path: &[u8]) -> Option<&EmuDevice> {
        self.devs
            .iter()
            .find(|d| d.id.cdev_path().as_bytes() == path)
    }

    /// Device `i`.
    pub fn get(&self, i: u32) -> Option<&EmuDevice> {
        self.devs.get(i as usize)
    }

    /// Every device.
    pub fn iter(&self) -> impl Iterator<Item = &EmuDevice> {
        self.devs.iter()
    }
}
