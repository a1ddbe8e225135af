//! The sysfs tree libibverbs scans when the kernel has no RDMA netlink (`$SYSFS_PATH`):
//! `class/infiniband_verbs/uverbsN` and `class/infiniband/mlx5_N` with the files rdma-core reads
//! (ABI versions, the cdev number, node type and GUIDs, the PCI modalias of a ConnectX-6 Dx so
//! the real libmlx5 binds, firmware and board strings that say what the device is, and per port
//! its state, link layer, GID with its type and netdev, and P_Key).
//!
//! Laid out as Linux lays it out: the device entries live under a PCI function folder
//! (`devices/pci15b3:NN/15b3:NN:00.0/{infiniband/mlx5_N, infiniband_verbs/uverbsN}`, with the
//! function's `vendor`, `device`, `class`, `modalias`, `numa_node`, `local_cpus`, ...), and
//! `class/infiniband/mlx5_N`, `class/infiniband_verbs/uverbsN`, their `device` links and
//! `bus/pci/devices/15b3:NN:00.0` are relative symbolic links to it, so that `realpath` of
//! `class/infiniband/mlx5_N/device` is the PCI function's folder. The PCI domain 0x15b3 (the
//! Mellanox vendor id) is one no real host uses, so the emulated functions never collide with a
//! real GPU's bus id. `dev/infiniband/uverbsN` are empty files, so that a listing of the folder
//! the preload library shows as `/dev/infiniband` names the device nodes.

use crate::config::{DeviceIdentity, EmuConfig};
use std::io;
use std::path::Path;

/// PCI vendor of Mellanox / NVIDIA networking.
pub const PCI_VENDOR: u16 = 0x15b3;
/// PCI device of a ConnectX-6 Dx (libmlx5's table lists it).
pub const PCI_DEVICE: u16 = 0x101d;
/// The firmware version string sysfs shows.
pub const FW_VER: &str = "0.1.0 (gpuverbs soft NIC)";
/// The board id sysfs shows.
pub const BOARD_ID: &str = "GPUVERBS_SOFTNIC";

/// The PCI domain of the emulated functions (`15b3:NN:00.0`).
pub const PCI_DOMAIN: &str = "15b3";

/// PCI bus id of device `index`'s function (`15b3:NN:00.0`: a bus of its own per device, so
/// that tools that merge the functions of one PCI device keep the devices apart).
pub fn pci_bdf(index: u32) -> String {
    format!("{PCI_DOMAIN}:{index:02x}:00.0")
}

/// The PCI function folder of device `index`, relative to the tree's root.
pub fn pci_dir(index: u32) -> String {
    format!("devices/pci{PCI_DOMAIN}:{index:02x}/{}", pci_bdf(index))
}

/// A relative symbolic link at `link` (replacing one that is there).
fn link(target: &str, link: &Path) -> io::Result<()> {
    if let Some(dir) = link.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::symlink_metadata(link) {
        Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(link)?,
        _ => {}
    }
    std::os::unix::fs::symlink(target, link)
}

/// A CPU list (`0-3,8`) as the kernel's `local_cpus` mask: 32-bit groups of hex digits,
/// the most significant first, separated by commas.
pub fn cpu_mask(list: &str) -> String {
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
            cpus.extend(a..=b.min(a + 65535));
        }
    }
    let groups = cpus.iter().max().map_or(1, |m| m / 32 + 1);
    let mut words = vec![0u32; groups];
    for c in cpus {
        words[c / 32] |= 1 << (c % 32);
    }
    words
        .iter()
        .rev()
        .map(|w| format!("{w:08x}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The host's online CPUs as a list (`0-15`), for `local_cpulist`.
fn online_cpus() -> String {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            if n == 1 {
                "0".into()
            } else {
                format!("0-{}", n - 1)
            }
        })
}

fn put(path: &Path, text: &str) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, format!("{text}\n"))
}

/// A GUID as sysfs prints it (`xxxx:xxxx:xxxx:xxxx`).
pub fn guid_text(g: u64) -> String {
    let b = g.to_be_bytes();
    format!(
        "{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
    )
}

/// A GID as sysfs prints it (eight groups of four hex digits).
pub fn gid_text(g: &[u8; 16]) -> String {
    g.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// Writes one device's entries under `root`.
pub fn write_device(root: &Path, d: &DeviceIdentity) -> io::Result<()> {
    let pci_rel = pci_dir(d.index);
    let pci = root.join(&pci_rel);
    let bdf = pci_bdf(d.index);
    let uverbs = format!("uverbs{}", d.index);
    let uv = pci.join("infiniband_verbs").join(&uverbs);
    let (maj, min) = d.rdev();
    put(&uv.join("ibdev"), &d.name)?;
    put(&uv.join("dev"), &format!("{maj}:{min}"))?;
    put(&uv.join("abi_version"), "1")?;
    let ib = pci.join("infiniband").join(&d.name);
    // class/<x>/<name> -> ../../devices/pci…/<bdf>/<x>/<name>; <name>/device -> ../../../<bdf>
    link(
        &format!("../../{pci_rel}/infiniband_verbs/{uverbs}"),
        &root.join("class/infiniband_verbs").join(&uverbs),
    )?;
    link(
        &format!("../../{pci_rel}/infiniband/{}", d.name),
        &root.join("class/infiniband").join(&d.name),
    )?;
    link(&format!("../../../{bdf}"), &uv.join("device"))?;
    link(&format!("../../../{bdf}"), &ib.join("device"))?;
    link(
        &format!("../../../{pci_rel}"),
        &root.join("bus/pci/devices").join(&bdf),
    )?;
    put(&root.join("dev/infiniband").join(&uverbs), "")?;
    // the PCI function: what topology code reads (NUMA node unknown, every CPU local)
    put(
        &pci.join("modalias"),
        &format!(
            "pci:v0000{PCI_VENDOR:04X}d0000{PCI_DEVICE:04X}sv0000{PCI_VENDOR:04X}sd00000051bc02sc00i00"
        ),
    )?;
    put(&pci.join("vendor"), &format!("0x{PCI_VENDOR:04x}"))?;
    put(&pci.join("device"), &format!("0x{PCI_DEVICE:04x}"))?;
    put(
        &pci.join("subsystem_vendor"),
        &format!("0x{PCI_VENDOR:04x}"),
    )?;
    put(&pci.join("subsystem_device"), "0x0051")?;
    put(&pci.join("class"), "0x020000")?;
    put(&pci.join("revision"), "0x00")?;
    put(&pci.join("numa_node"), "-1")?;
    let cpus = online_cpus();
    put(&pci.join("local_cpulist"), &cpus)?;
    put(&pci.join("local_cpus"), &cpu_mask(&cpus))?;
    put(&pci.join("max_link_speed"), "16.0 GT/s PCIe")?;
    put(&pci.join("max_link_width"), "16")?;
    put(&pci.join("current_link_speed"), "16.0 GT/s PCIe")?;
    put(&pci.join("current_link_width"), "16")?;
    put(&ib.join("node_type"), "1: CA")?;
    put(&ib.join("node_guid"), &guid_text(d.node_guid))?;
    put(&ib.join("sys_image_guid"), &guid_text(d.node_guid))?;
    put(&ib.join("fw_ver"), FW_VER)?;
    put(&ib.join("hca_type"), "MT4125")?;
    put(&ib.join("hw_rev"), "0x0")?;
    put(&ib.join("board_id"), BOARD_ID)?;
    put(
        &ib.join("node_desc"),
        &format!("gpuverbs soft NIC {}", d.name),
    )?;
    let port = ib.join("ports/1");
    put(&port.join("state"), "4: ACTIVE")?;
    put(&port.join("phys_state"), "5: LinkUp")?;
    put(&port.join("link_layer"), "Ethernet")?;
    put(&port.join("lid"), "0x0")?;
    put(&port.join("sm_lid"), "0x0")?;
    put(&port.join("lid_mask_count"), "0")?;
    put(&port.join("sm_sl"), "0")?;
    put(&port.join("cap_mask"), "0x00010000")?;
    put(&port.join("rate"), "100 Gb/sec (4X EDR)")?;
    put(&port.join("gids/0"), &gid_text(&d.gid()))?;
    put(&port.join("gid_attrs/types/0"), "RoCE v2")?;
    put(&port.join("gid_attrs/ndevs/0"), &d.netdev.name)?;
    if !d.netdev.loopback {
        // the PCI function's Ethernet interface, as mlx5_core registers it (a link to the
        // interface's own folder; `lo` belongs to no PCI function)
        let name = &d.netdev.name;
        link(
            &format!("/sys/class/net/{name}"),
            &pci.join("net").join(name),
        )?;
    }
    put(&port.join("pkeys/0"), "0xffff")?;
    Ok(())
}

/// Writes the whole tree for `cfg` under `root` (which should be empty or absent).
pub fn write_tree(root: &Path, cfg: &EmuConfig) -> io::Result<()> {
    put(&root.join("class/infiniband_verbs/abi_version"), "6")?;
    std::fs::create_dir_all(root.join("dev/infiniband"))?;
    for i in 0..cfg.devices {
        write_device(root, &cfg.device(i))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_has_what_libibverbs_reads() {
        let dir = std::env::temp_dir().join(format!("gv-sysfs-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = EmuConfig {
            ip: "127.0.0.9".parse().unwrap(),
            devices: 2,
            ..Default::default()
        };
        write_tree(&dir, &cfg).unwrap();
        let read = |p: &str| std::fs::read_to_string(dir.join(p)).unwrap();
        assert_eq!(read("class/infiniband_verbs/abi_version"), "6\n");
        assert_eq!(read("class/infiniband_verbs/uverbs1/ibdev"), "mlx5_1\n");
        assert_eq!(read("class/infiniband_verbs/uverbs1/dev"), "231:193\n");
        assert!(
            read("class/infiniband/mlx5_0/device/modalias").starts_with("pci:v000015B3d0000101Dsv")
        );
        assert_eq!(
            read("class/infiniband/mlx5_0/ports/1/gids/0"),
            "0000:0000:0000:0000:0000:ffff:7f00:0009\n"
        );
        assert_eq!(
            read("class/infiniband/mlx5_1/ports/1/gid_attrs/types/0"),
            "RoCE v2\n"
        );
        // Linux's layout: the class entries and `device` are links into the PCI function
        let canon = |p: &str| std::fs::canonicalize(dir.join(p)).unwrap();
        let pci1 = dir
            .canonicalize()
            .unwrap()
            .join("devices/pci15b3:01/15b3:01:00.0");
        assert_eq!(canon("class/infiniband/mlx5_1/device"), pci1);
        assert_eq!(canon("class/infiniband_verbs/uverbs1/device"), pci1);
        assert_eq!(canon("bus/pci/devices/15b3:01:00.0"), pci1);
        assert_eq!(
            canon("class/infiniband/mlx5_1"),
            pci1.join("infiniband/mlx5_1")
        );
        assert_eq!(read("class/infiniband/mlx5_0/device/vendor"), "0x15b3\n");
        assert_eq!(read("class/infiniband/mlx5_0/device/device"), "0x101d\n");
        assert_eq!(read("class/infiniband/mlx5_0/device/numa_node"), "-1\n");
        assert_eq!(read("class/infiniband/mlx5_0/device/class"), "0x020000\n");
        assert!(!read("class/infiniband/mlx5_0/device/local_cpulist")
            .trim()
            .is_empty());
        assert!(read("class/infiniband/mlx5_0/device/local_cpus")
            .trim()
            .chars()
            .all(|c| c.is_ascii_hexdigit() || c == ','));
        let mut devs: Vec<String> = std::fs::read_dir(dir.join("dev/infiniband"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        devs.sort();
        assert_eq!(devs, ["uverbs0", "uverbs1"]);
        // writing the tree again over itself works (--sysfs DIR reused)
        write_tree(&dir, &cfg).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cpu_masks() {
        assert_eq!(cpu_mask("0-15"), "0000ffff");
        assert_eq!(cpu_mask("0-3,8\n"), "0000010f");
        assert_eq!(cpu_mask("0,32-33"), "00000003,00000001");
        assert_eq!(cpu_mask(""), "00000000");
    }

    #[test]
    fn guid_and_gid_text() {
        assert_eq!(guid_text(0x0123_4567_89ab_cdef), "0123:4567:89ab:cdef");
        let mut g = [0u8; 16];
        g[15] = 1;
        assert!(gid_text(&g).ends_with(":0001"));
    }
}
