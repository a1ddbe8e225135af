//! Unit tests of the sysfs readers, on fixture trees in temporary folders.

use super::*;
use std::fs;

/// A fixture tree in a fresh temporary folder, removed on drop.
struct Tree(PathBuf);

impl Tree {
    fn new(tag: &str) -> Self {
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let d = std::env::temp_dir().join(format!(
            "gv-doctor-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        Tree(d)
    }

    fn sys(&self) -> Sys {
        Sys::at(&self.0)
    }

    fn put(&self, rel: &str, text: &str) {
        let p = self.0.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }

    fn put_bytes(&self, rel: &str, bytes: &[u8]) {
        let p = self.0.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, bytes).unwrap();
    }

    /// A PCI function at `devpath` (`pci0000:00/0000:00:01.0/...`), linked from
    /// `sys/bus/pci/devices`.
    fn pci(&self, devpath: &str, vendor: u16, class: u32, numa: i32) -> Bdf {
        let dir = self.0.join("sys/devices").join(devpath);
        fs::create_dir_all(&dir).unwrap();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        fs::write(dir.join("vendor"), format!("0x{vendor:04x}\n")).unwrap();
        fs::write(dir.join("device"), "0x2335\n").unwrap();
        fs::write(dir.join("class"), format!("0x{class:06x}\n")).unwrap();
        fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
        let links = self.0.join("sys/bus/pci/devices");
        fs::create_dir_all(&links).unwrap();
        std::os::unix::fs::symlink(&dir, links.join(&name)).unwrap();
        Bdf::parse(&name).unwrap()
    }

    fn bridge(&self, devpath: &str, numa: i32) -> Bdf {
        self.pci(devpath, 0x8086, 0x060400, numa)
    }

    fn gpu(&self, devpath: &str, numa: i32) -> Bdf {
        self.pci(devpath, VENDOR_NVIDIA, 0x030200, numa)
    }

    fn nic(&self, devpath: &str, numa: i32, ibdev: &str) -> Bdf {
        let b = self.pci(devpath, VENDOR_MELLANOX, 0x020000, numa);
        let ib = self.0.join("sys/class/infiniband").join(ibdev);
        fs::create_dir_all(&ib).unwrap();
        std::os::unix::fs::symlink(self.0.join("sys/devices").join(devpath), ib.join("device"))
            .unwrap();
        b
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn dist(t: &Tree, gpu: Bdf, nic: &str) -> Distance {
    let s = t.sys();
    let g = pci_device(&s, gpu).unwrap();
    let n = rdma_pci_device(&s, nic).unwrap();
    distance(
        (g.path.as_ref().unwrap(), g.numa_node),
        (n.path.as_ref().unwrap(), n.numa_node),
    )
}

#[test]
fn bdf_parse_and_print() {
    let b = Bdf::parse("0000:65:00.0").unwrap();
    assert_eq!(b.to_string(), "0000:65:00.0");
    assert_eq!(
        Bdf::parse("00000000:C1:1F.7").unwrap().to_string(),
        "0000:c1:1f.7"
    );
    assert_eq!(Bdf::parse("0001:02:03.1\0").unwrap().domain, 1);
    for bad in [
        "",
        "65:00.0",
        "0000:65:00",
        "0000:65:20.0",
        "0000:65:00.8",
        "x:65:00.0",
    ] {
        assert_eq!(Bdf::parse(bad), None, "{bad}");
    }
}

#[test]
fn same_switch_is_pix() {
    let t = Tree::new("pix");
    t.bridge("pci0000:00/0000:00:01.0", 0);
    t.bridge("pci0000:00/0000:00:01.0/0000:01:00.0", 0);
    t.bridge("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0", 0);
    t.bridge("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0", 0);
    let g = t.gpu(
        "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0",
        0,
    );
    t.nic(
        "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:06:00.0",
        0,
        "mlx5_0",
    );
    let d = dist(&t, g, "mlx5_0");
    assert_eq!(d.kind, PathType::Pix, "{d:?}");
    let names: Vec<String> = d.bridges.iter().map(Bdf::to_string).collect();
    assert_eq!(names, ["0000:01:00.0", "0000:02:08.0", "0000:02:10.0"]);
    // functions of one device (GPU and NIC behind one downstream port) are PIX too
    let t2 = Tree::new("pix2");
    t2.bridge("pci0000:00/0000:00:02.0", 0);
    let g2 = t2.gpu("pci0000:00/0000:00:02.0/0000:03:00.0", 0);
    t2.nic("pci0000:00/0000:00:02.0/0000:03:00.1", 0, "mlx5_1");
    assert_eq!(dist(&t2, g2, "mlx5_1").kind, PathType::Pix);
}

#[test]
fn nested_switches_are_pxb() {
    let t = Tree::new("pxb");
    let rp = "pci0000:00/0000:00:01.0";
    let us = format!("{rp}/0000:01:00.0");
    let g = t.gpu(
        &format!("{us}/0000:02:08.0/0000:03:00.0/0000:04:00.0/0000:05:00.0"),
        0,
    );
    t.nic(&format!("{us}/0000:02:10.0/0000:06:00.0"), 0, "mlx5_0");
    let d = dist(&t, g, "mlx5_0");
    assert_eq!(d.kind, PathType::Pxb, "{d:?}");
}

#[test]
fn separate_root_ports_are_phb() {
    let t = Tree::new("phb");
    let g = t.gpu("pci0000:00/0000:00:01.0/0000:01:00.0", 0);
    t.nic("pci0000:00/0000:00:03.0/0000:02:00.0", 0, "mlx5_0");
    let d = dist(&t, g, "mlx5_0");
    assert_eq!(d.kind, PathType::Phb, "{d:?}");
    assert_eq!(d.bridges.len(), 2);
    // a flat virtual machine: both directly on the host bridge
    let t2 = Tree::new("phb2");
    let g2 = t2.gpu("pci0000:00/0000:00:05.0", -1);
    t2.nic("pci0000:00/0000:00:06.0", -1, "mlx5_0");
    let d2 = dist(&t2, g2, "mlx5_0");
    assert_eq!(d2.kind, PathType::Phb);
    assert!(d2.bridges.is_empty());
}

#[test]
fn other_socket_is_sys_same_node_is_node() {
    let t = Tree::new("sys");
    let g = t.gpu("pci0000:00/0000:00:01.0/0000:01:00.0", 0);
    t.nic("pci0000:80/0000:80:01.0/0000:81:00.0", 1, "mlx5_0");
    t.nic("pci0000:40/0000:40:01.0/0000:41:00.0", 0, "mlx5_1");
    t.nic("pci0000:c0/0000:c0:01.0/0000:c1:00.0", -1, "mlx5_2");
    let d = dist(&t, g, "mlx5_0");
    assert_eq!(d.kind, PathType::Sys, "{d:?}");
    assert!(d.reason.contains("NUMA nodes 0 and 1"), "{}", d.reason);
    assert_eq!(dist(&t, g, "mlx5_1").kind, PathType::Node);
    assert_eq!(dist(&t, g, "mlx5_2").kind, PathType::Sys);
    assert_eq!(pci_device(&t.sys(), g).unwrap().numa_node, Some(0));
    assert_eq!(rdma_pci_device(&t.sys(), "mlx5_2").unwrap().numa_node, None);
}

#[test]
fn device_lists() {
    let t = Tree::new("lists");
    t.bridge("pci0000:00/0000:00:01.0", 0);
    let g = t.gpu("pci0000:00/0000:00:01.0/0000:01:00.0", 0);
    t.pci(
        "pci0000:00/0000:00:01.0/0000:01:00.1",
        VENDOR_NVIDIA,
        0x040300,
        0,
    ); // audio
    let n = t.nic("pci0000:00/0000:00:02.0", 0, "mlx5_0");
    let s = t.sys();
    assert_eq!(
        nvidia_gpus(&s).iter().map(|d| d.bdf).collect::<Vec<_>>(),
        [g]
    );
    assert_eq!(
        mellanox_nics(&s).iter().map(|d| d.bdf).collect::<Vec<_>>(),
        [n]
    );
    // an emulated device: `device` is a plain folder, not on a PCI bus
    t.put("sys/class/infiniband/mlx5_9/device/vendor", "0x15b3");
    assert_eq!(rdma_pci_device(&s, "mlx5_9"), None);
    t.put("sys/class/infiniband/mlx5_9/board_id", "GPUVERBS_SOFTNIC\n");
    assert_eq!(
        rdma_attr(&s, "mlx5_9", "board_id").as_deref(),
        Some("GPUVERBS_SOFTNIC")
    );
}

/// A configuration space with an AER capability then ACS with `ctrl`.
fn config_with_acs(ctrl: u16) -> Vec<u8> {
    let mut c = vec![0u8; 4096];
    // AER (ID 1, version 2) at 0x100, next 0x148
    c[0x100..0x104].copy_from_slice(&(0x0001u32 | 2 << 16 | 0x148 << 20).to_le_bytes());
    // ACS (ID 0xd, version 1) at 0x148, last
    c[0x148..0x14c].copy_from_slice(&(0x000du32 | 1 << 16).to_le_bytes());
    c[0x14c..0x14e].copy_from_slice(&0x005fu16.to_le_bytes());
    c[0x14e..0x150].copy_from_slice(&ctrl.to_le_bytes());
    c
}

#[test]
fn acs_parsing() {
    let on = config_with_acs(
        AcsControl::SOURCE_VALIDATION
            | AcsControl::REQ_REDIRECT
            | AcsControl::CMPLT_REDIRECT
            | AcsControl::UPSTREAM_FORWARDING,
    );
    match parse_acs(&on) {
        Acs::Present(c) => {
            assert!(c.redirects_p2p());
            assert_eq!(c.to_string(), "SrcValid+ReqRedir+CmpltRedir+UpstreamFwd");
        }
        other => panic!("{other:?}"),
    }
    match parse_acs(&config_with_acs(0)) {
        Acs::Present(c) => {
            assert!(!c.redirects_p2p());
            assert_eq!(c.to_string(), "none enabled");
        }
        other => panic!("{other:?}"),
    }
    // AER only
    let mut aer = vec![0u8; 4096];
    aer[0x100..0x104].copy_from_slice(&(0x0001u32 | 2 << 16).to_le_bytes());
    assert_eq!(parse_acs(&aer), Acs::Absent);
    assert_eq!(parse_acs(&[0u8; 4096]), Acs::Absent);
    // a non-root read of config gives 64 bytes
    assert_eq!(parse_acs(&[0u8; 64]), Acs::Unreadable);
    // a loop in the list ends
    let mut lp = vec![0u8; 4096];
    lp[0x100..0x104].copy_from_slice(&(0x0001u32 | 0x100 << 20).to_le_bytes());
    assert_eq!(parse_acs(&lp), Acs::Absent);

    let t = Tree::new("acs");
    let b = t.bridge("pci0000:00/0000:00:01.0", 0);
    t.put_bytes("sys/devices/pci0000:00/0000:00:01.0/config", &on);
    assert!(matches!(acs(&t.sys(), b), Acs::Present(c) if c.redirects_p2p()));
    assert_eq!(
        acs(&t.sys(), Bdf::parse("0000:09:00.0").unwrap()),
        Acs::Unreadable
    );
}

#[test]
fn iommu_modes() {
    let off = Tree::new("iommu-off");
    off.put("proc/cmdline", "quiet console=ttyS0");
    let i = iommu(&off.sys(), &[]);
    assert_eq!(i.mode, IommuMode::Off);
    assert!(i.cmdline.is_empty());

    let t = Tree::new("iommu-on");
    t.put("sys/class/iommu/dmar0/x", "");
    t.put("sys/class/iommu/dmar1/x", "");
    t.put("sys/kernel/iommu_groups/7/type", "DMA-FQ");
    t.put("proc/cmdline", "BOOT_IMAGE=/vmlinuz intel_iommu=on quiet");
    let g = t.gpu("pci0000:00/0000:00:01.0", 0);
    std::os::unix::fs::symlink(
        t.0.join("sys/kernel/iommu_groups/7"),
        t.0.join("sys/devices/pci0000:00/0000:00:01.0/iommu_group"),
    )
    .unwrap();
    let i = iommu(&t.sys(), &[g]);
    assert_eq!(i.mode, IommuMode::Translated, "{i:?}");
    assert_eq!(i.units, ["dmar0", "dmar1"]);
    assert_eq!(i.groups, 1);
    assert_eq!(i.cmdline, ["intel_iommu=on"]);
    assert_eq!(i.domains, [(g, "DMA-FQ".to_string())]);

    t.put("sys/kernel/iommu_groups/7/type", "identity");
    assert_eq!(iommu(&t.sys(), &[g]).mode, IommuMode::Passthrough);
    // no device asked about: the command line decides
    t.put("proc/cmdline", "intel_iommu=on iommu=pt");
    assert_eq!(iommu(&t.sys(), &[]).mode, IommuMode::Passthrough);
    t.put("proc/cmdline", "intel_iommu=on");
    assert_eq!(iommu(&t.sys(), &[]).mode, IommuMode::Unknown);
    assert_eq!(
        iommu_cmdline("amd_iommu=off iommu.passthrough=1 -- iommu=pt"),
        ["amd_iommu=off", "iommu.passthrough=1"]
    );
}

#[test]
fn nvidia_module_versions() {
    let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue Jul 22 12:34:56 UTC 2025\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n";
    let m = parse_nvidia_version(open).unwrap();
    assert!(m.open);
    assert_eq!(m.version.as_deref(), Some("580.65.06"));
    let prop = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n";
    let m = parse_nvidia_version(prop).unwrap();
    assert!(!m.open);
    assert_eq!(m.version.as_deref(), Some("535.104.05"));
    assert_eq!(parse_nvidia_version("garbage"), None);

    let t = Tree::new("nv");
    assert_eq!(nvidia_module(&t.sys()), None);
    assert_eq!(peer_mapping_override(&t.sys()), PeerMapping::Unknown);
    t.put("proc/driver/nvidia/version", open);
    assert!(nvidia_module(&t.sys()).unwrap().open);
    t.put(
        "proc/driver/nvidia/params",
        "ResmanDebugLevel: 4294967295\nRegistryDwords: \"\"\nEnableMSI: 1\n",
    );
    assert_eq!(peer_mapping_override(&t.sys()), PeerMapping::NotSet);
    t.put(
        "proc/driver/nvidia/params",
        "RegistryDwords: \"RMUseSwI2c=0x01;PeerMappingOverride=1;\"\n",
    );
    assert_eq!(peer_mapping_override(&t.sys()), PeerMapping::Set(1));
    assert_eq!(
        parse_peer_mapping_override("RegistryDwords: \"peermappingoverride=0x0\""),
        Some(0)
    );
}

#[test]
fn peermem_present_or_not() {
    let t = Tree::new("peermem");
    let p = peermem(&t.sys());
    assert!(!p.loaded());
    t.put("sys/module/nvidia_peermem/version", "580.65.06\n");
    let p = peermem(&t.sys());
    assert!(p.loaded());
    assert_eq!(p.nvidia_peermem.as_deref(), Some("580.65.06"));
    fs::remove_dir_all(t.0.join("sys/module/nvidia_peermem")).unwrap();
    fs::create_dir_all(t.0.join("sys/module/nvidia_peermem")).unwrap();
    assert_eq!(
        peermem(&t.sys()).nvidia_peermem.as_deref(),
        Some("no version file")
    );
    fs::remove_dir_all(t.0.join("sys/module/nvidia_peermem")).unwrap();
    t.put("sys/kernel/mm/memory_peers/nv_mem/version", "1.3-0\n");
    let p = peermem(&t.sys());
    assert!(p.loaded());
    assert_eq!(
        p.memory_peers,
        [("nv_mem".to_string(), "1.3-0".to_string())]
    );
}

#[test]
fn memlock_and_libraries() {
    let limits = "Limit                     Soft Limit           Hard Limit           Units     \nMax locked memory         8388608              unlimited            bytes     \nMax file locks            unlimited            unlimited            locks     \n";
    assert_eq!(
        parse_memlock(limits),
        Some((Limit::Bytes(8 << 20), Limit::Unlimited))
    );
    assert_eq!(Limit::Bytes(8 << 20).to_string(), "8 MiB");
    assert_eq!(Limit::Bytes(65536).to_string(), "64 KiB");
    assert_eq!(Limit::Bytes(1000).to_string(), "1000 bytes");
    assert_eq!(parse_memlock("nothing"), None);
    assert_eq!(
        rdma_core_release("libibverbs.so.1.14.44.0").as_deref(),
        Some("44.0")
    );
    assert_eq!(
        rdma_core_release("/usr/lib/libmlx5.so.1.25.50.0").as_deref(),
        Some("50.0")
    );
    assert_eq!(rdma_core_release("libibverbs.so.1"), None);
    let maps = "7f00-7f10 r--p 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0\n7f20-7f30 r-xp 00000000 08:01 124 /usr/lib/x86_64-linux-gnu/libmlx5.so.1.24.44.0\n7f40-7f50 rw-p 00000000 00:00 0\n";
    assert_eq!(
        mapped_library(maps, "libmlx5.so").unwrap(),
        PathBuf::from("/usr/lib/x86_64-linux-gnu/libmlx5.so.1.24.44.0")
    );
    assert_eq!(mapped_library(maps, "libcuda.so"), None);
}

#[test]
fn bar_sizes() {
    let res = "0x00000000fa000000 0x00000000faffffff 0x0000000000040200\n0x0000238000000000 0x0000239fffffffff 0x000000000014220c\n0x0000000000000000 0x0000000000000000 0x0000000000000000\n0x000023a000000000 0x000023a001ffffff 0x000000000014220c\n";
    let s = parse_bar_sizes(res);
    assert_eq!(s, [16 << 20, 128 << 30, 0, 32 << 20]);
    let t = Tree::new("bar");
    let g = t.gpu("pci0000:00/0000:00:01.0", 0);
    t.put("sys/devices/pci0000:00/0000:00:01.0/resource", res);
    assert_eq!(bar_size(&t.sys(), g, 1), Some(128 << 30));
    assert_eq!(bar_size(&t.sys(), g, 2), None);
}
