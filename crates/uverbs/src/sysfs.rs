//! The sysfs tree libibverbs scans when the kernel has no RDMA netlink (`$SYSFS_PATH`):
//! `class/infiniband_verbs/uverbsN` and `class/infiniband/mlx5_N` with the files rdma-core reads
//! (ABI versions, the cdev number, node type and GUIDs, the PCI modalias of a ConnectX-6 Dx so
//! the real libmlx5 binds, firmware and board strings that say what the device is, and per port
//! its state, link layer, GID with its type and netdev, and P_Key).

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
    let uv = root.join(format!("class/infiniband_verbs/uverbs{}", d.index));
    let (maj, min) = d.rdev();
    put(&uv.join("ibdev"), &d.name)?;
    put(&uv.join("dev"), &format!("{maj}:{min}"))?;
    put(&uv.join("abi_version"), "1")?;
    let ib = root.join("class/infiniband").join(&d.name);
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
    put(
        &ib.join("device/modalias"),
        &format!(
            "pci:v0000{PCI_VENDOR:04X}d0000{PCI_DEVICE:04X}sv0000{PCI_VENDOR:04X}sd00000051bc02sc00i00"
        ),
    )?;
    put(&ib.join("device/vendor"), &format!("0x{PCI_VENDOR:04x}"))?;
    put(&ib.join("device/device"), &format!("0x{PCI_DEVICE:04x}"))?;
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
    put(&port.join("gid_attrs/ndevs/0"), "lo")?;
    put(&port.join("pkeys/0"), "0xffff")?;
    Ok(())
}

/// Writes the whole tree for `cfg` under `root` (which should be empty or absent).
pub fn write_tree(root: &Path, cfg: &EmuConfig) -> io::Result<()> {
    put(&root.join("class/infiniband_verbs/abi_version"), "6")?;
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
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn guid_and_gid_text() {
        assert_eq!(guid_text(0x0123_4567_89ab_cdef), "0123:4567:89ab:cdef");
        let mut g = [0u8; 16];
        g[15] = 1;
        assert!(gid_text(&g).ends_with(":0001"));
    }
}
