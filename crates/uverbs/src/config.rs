//! What an emulated process is told by its launcher (`gpuverbs emu`) through the environment:
//! its address, its UDP port and how many devices it has, and the identity each device shows.

use std::net::Ipv4Addr;

/// Base IPv4 address of the process's emulated devices (device `k` has `ip + k`).
pub const ENV_IP: &str = "GPUVERBS_EMU_IP";
/// UDP port every emulated device binds and assumes for its peers (RoCEv2's 4791 by default).
pub const ENV_PORT: &str = "GPUVERBS_EMU_PORT";
/// Number of emulated devices (`mlx5_0` …).
pub const ENV_DEVICES: &str = "GPUVERBS_EMU_DEVICES";

/// How the devices hand out UAR pages: `dynamic` (the default: as a kernel with dynamic UAR
/// allocation answers a library that asks for it; UAR pages are allocated per QP and for DEVX
/// with the UAR ioctl) or `static` (a fixed set of BlueFlame registers given at GET_CONTEXT, as
/// older kernels do).
pub const ENV_UARS: &str = "GPUVERBS_EMU_UARS";

/// When set, the emulation reports every ioctl call (object, method, result) on stderr.
pub const ENV_TRACE: &str = "GPUVERBS_EMU_TRACE";

/// When set, the emulated process writes its soft NICs' counters to this file at exit (one
/// line per started device: `mlx5_0 wqes=… bad_doorbells=… stale_wqes=… cq_overruns=…
/// error_cqes=… carried_turns=… carry_calls=… answer_looks=… answers_found=…
/// errors=[Syndrome:count,…]`).
pub const ENV_COUNTERS: &str = "GPUVERBS_EMU_COUNTERS";

/// When set (a folder), the emulated process appends every uverbs command it is given — each
/// `write()` command and each ioctl's header with its attributes — to `<folder>/<pid>.stream`,
/// as records of a kind byte (0 write, 1 ioctl), a 2-byte big-endian length and the bytes: the
/// seed format of the `uverbs` fuzz target. Each QP destroyed also leaves the distinct WQEs
/// its SQ ring holds then (as the program's library wrote them; WQE index cleared) in
/// `<folder>/wqe-<hash>.bin`, a control byte 0 and the WQE: the seed format of the `wqe` fuzz
/// target.
pub const ENV_RECORD: &str = "GPUVERBS_EMU_RECORD";

/// The RoCEv2 UDP port.
pub const ROCE_PORT: u16 = 4791;
/// Most devices one process may emulate.
pub const MAX_DEVICES: u32 = 16;
/// Major number of the uverbs character devices (as Linux assigns them).
pub const UVERBS_MAJOR: u32 = 231;
/// Minor number of `uverbs0`.
pub const UVERBS_BASE_MINOR: u32 = 192;
/// The RDMA connection manager's character device (`/dev/infiniband/rdma_cm`, the ucma
/// module's misc device: major 10, a minor the kernel picks; this one for the emulation).
pub const RDMA_CM_RDEV: (u32, u32) = (10, 58);
/// The ucma ABI version (`RDMA_USER_CM_ABI_VERSION`).
pub const RDMA_CM_ABI: u64 = 4;

/// A bad launcher setting.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A variable that does not parse.
    #[error("{var}={value:?}: {why}")]
    Bad {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        why: &'static str,
    },
}

/// The emulation's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmuConfig {
    /// Address of device 0.
    pub ip: Ipv4Addr,
    /// UDP port of every device.
    pub port: u16,
    /// Number of devices.
    pub devices: u32,
    /// Static UAR pages only (no dynamic UAR allocation), as older kernels.
    pub static_uars: bool,
}

impl Default for EmuConfig {
    fn default() -> Self {
        Self {
            ip: Ipv4Addr::LOCALHOST,
            port: ROCE_PORT,
            devices: 1,
            static_uars: false,
        }
    }
}

impl EmuConfig {
    /// Checks the settings.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |var, value: String, why| Err(ConfigError::Bad { var, value, why });
        if self.devices == 0 || self.devices > MAX_DEVICES {
            return bad(ENV_DEVICES, self.devices.to_string(), "must be 1..=16");
        }
        if self.ip.is_unspecified() || self.ip.is_multicast() || self.ip.is_broadcast() {
            return bad(ENV_IP, self.ip.to_string(), "must be a unicast address");
        }
        if u32::from(self.ip).checked_add(self.devices - 1).is_none() {
            return bad(
                ENV_IP,
                self.ip.to_string(),
                "too high for that many devices",
            );
        }
        if self.port == 0 {
            return bad(
                ENV_PORT,
                "0".into(),
                "must be a fixed port (peers find it by GID)",
            );
        }
        Ok(())
    }

    /// Reads the settings from the environment (defaults for unset variables).
    pub fn from_env() -> Result<Self, ConfigError> {
        let mut c = Self::default();
        if let Ok(v) = std::env::var(ENV_IP) {
            c.ip = v.parse().map_err(|_| ConfigError::Bad {
                var: ENV_IP,
                value: v.clone(),
                why: "not an IPv4 address",
            })?;
        }
        if let Ok(v) = std::env::var(ENV_PORT) {
            c.port = v.parse().map_err(|_| ConfigError::Bad {
                var: ENV_PORT,
                value: v.clone(),
                why: "not a UDP port",
            })?;
        }
        if let Ok(v) = std::env::var(ENV_DEVICES) {
            c.devices = v.parse().map_err(|_| ConfigError::Bad {
                var: ENV_DEVICES,
                value: v.clone(),
                why: "not a number",
            })?;
        }
        c.static_uars = static_uars_from_env()?;
        c.validate()?;
        Ok(c)
    }

    /// The variables that carry these settings.
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        vec![
            (ENV_IP, self.ip.to_string()),
            (ENV_PORT, self.port.to_string()),
            (ENV_DEVICES, self.devices.to_string()),
            (
                ENV_UARS,
                if self.static_uars {
                    "static"
                } else {
                    "dynamic"
                }
                .into(),
            ),
        ]
    }

    /// Device `index`'s identity.
    pub fn device(&self, index: u32) -> DeviceIdentity {
        let ip = Ipv4Addr::from(u32::from(self.ip) + index);
        let o = ip.octets();
        DeviceIdentity {
            index,
            name: format!("mlx5_{index}"),
            ip,
            port: self.port,
            // a locally administered EUI-64 made from the address, unique per device
            node_guid: u64::from_be_bytes([0x02, 0x9c, 0xa5, 0xff, o[0], o[1], o[2], o[3]]),
            netdev: crate::netdev::of(ip),
        }
    }
}

/// Whether [`ENV_UARS`] asks for static UAR pages (unset: dynamic).
pub fn static_uars_from_env() -> Result<bool, ConfigError> {
    match std::env::var(ENV_UARS).as_deref() {
        Err(_) | Ok("dynamic") => Ok(false),
        Ok("static") => Ok(true),
        Ok(v) => Err(ConfigError::Bad {
            var: ENV_UARS,
            value: v.to_string(),
            why: "must be dynamic or static",
        }),
    }
}

/// What one emulated device shows: name, address, GUID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceIdentity {
    /// Index (`uverbsN`, `mlx5_N`).
    pub index: u32,
    /// Device name.
    pub name: String,
    /// Its address (its GID is the IPv4-mapped form).
    pub ip: Ipv4Addr,
    /// Its UDP port.
    pub port: u16,
    /// Node GUID (host order).
    pub node_guid: u64,
    /// The interface that holds its address: its port's netdev.
    pub netdev: crate::netdev::Netdev,
}

impl DeviceIdentity {
    /// The GID at index 0 (RoCE v2, IPv4-mapped).
    pub fn gid(&self) -> [u8; 16] {
        verbs::Gid::from_ipv4(self.ip).0
    }
    /// `/dev/infiniband/uverbsN`.
    pub fn cdev_path(&self) -> String {
        format!("/dev/infiniband/uverbs{}", self.index)
    }
    /// The character device number libibverbs expects (`major:minor` in sysfs).
    pub fn rdev(&self) -> (u32, u32) {
        (UVERBS_MAJOR, UVERBS_BASE_MINOR + self.index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_differ_per_device() {
        let c = EmuConfig {
            ip: Ipv4Addr::new(127, 0, 0, 5),
            port: 4791,
            devices: 2,
            static_uars: false,
        };
        c.validate().unwrap();
        let (a, b) = (c.device(0), c.device(1));
        assert_eq!(a.name, "mlx5_0");
        assert_eq!(b.ip, Ipv4Addr::new(127, 0, 0, 6));
        assert_ne!(a.node_guid, b.node_guid);
        assert_eq!(a.gid()[10..], [0xff, 0xff, 127, 0, 0, 5]);
        assert_eq!(b.rdev(), (231, 193));
    }

    #[test]
    fn bad_settings_are_refused() {
        for c in [
            EmuConfig {
                devices: 0,
                ..Default::default()
            },
            EmuConfig {
                devices: 17,
                ..Default::default()
            },
            EmuConfig {
                port: 0,
                ..Default::default()
            },
            EmuConfig {
                ip: Ipv4Addr::UNSPECIFIED,
                ..Default::default()
            },
            EmuConfig {
                ip: Ipv4Addr::new(255, 255, 255, 254),
                devices: 3,
                ..Default::default()
            },
        ] {
            assert!(c.validate().is_err(), "{c:?}");
        }
    }
}
