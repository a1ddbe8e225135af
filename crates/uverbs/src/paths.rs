//! The absolute paths under which an emulated process finds its devices: programs that look
//! for RDMA devices without libibverbs' `$SYSFS_PATH` (UCX, NCCL, topology code) open, stat,
//! list and `realpath` `/sys/class/infiniband…` and `/dev/infiniband` themselves. The preload
//! library rewrites those paths to the same paths in the emulated tree ([`crate::sysfs`]):
//!
//! | absolute path | in the tree (`$SYSFS_PATH`) |
//! |---|---|
//! | `/sys/class/infiniband[/…]` | `class/infiniband[/…]` |
//! | `/sys/class/infiniband_verbs[/…]` | `class/infiniband_verbs[/…]` |
//! | `/sys/devices/pci15b3:…` | `devices/pci15b3:…` (the emulated PCI functions) |
//! | `/sys/bus/pci/devices/15b3:…` | `bus/pci/devices/15b3:…` |
//! | `/dev/infiniband[/…]` | `dev/infiniband[/…]` (lists `uverbsN`) |
//!
//! and maps a resolved path inside the tree back ([`unmap`]), so that `realpath` answers
//! `/sys/devices/pci15b3:00/15b3:00:00.0` as the kernel would. The device nodes themselves
//! (`/dev/infiniband/uverbsN`) are answered by the emulation (a character device) before any
//! rewriting.
//!
//! A host that has real RDMA devices keeps its real paths unless [`ENV_SYSFS`] says `replace`
//! ([`SysfsMode`]).

use crate::config::ConfigError;
use std::sync::OnceLock;

/// How the absolute sysfs and `/dev/infiniband` paths are treated: `auto` (the default: shown
/// from the emulated tree unless the host has real RDMA devices in `/sys/class/infiniband`),
/// `replace` (always from the emulated tree, hiding the host's devices) or `keep` (never
/// rewritten: only libibverbs, through `$SYSFS_PATH`, sees the emulated devices).
pub const ENV_SYSFS: &str = "GPUVERBS_EMU_SYSFS";

/// The variable libibverbs reads for the sysfs root (the launcher points it at the tree).
pub const ENV_SYSFS_PATH: &str = "SYSFS_PATH";

/// What [`ENV_SYSFS`] asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SysfsMode {
    /// Rewrite unless the host has real RDMA devices.
    Auto,
    /// Always rewrite.
    Replace,
    /// Never rewrite.
    Keep,
}

impl SysfsMode {
    /// Parses the variable's value (unset or empty: [`SysfsMode::Auto`]).
    pub fn parse(v: Option<&str>) -> Result<Self, ConfigError> {
        match v {
            None | Some("") | Some("auto") => Ok(Self::Auto),
            Some("replace") => Ok(Self::Replace),
            Some("keep") => Ok(Self::Keep),
            Some(v) => Err(ConfigError::Bad {
                var: ENV_SYSFS,
                value: v.to_string(),
                why: "must be auto, replace or keep",
            }),
        }
    }

    /// Whether the paths are rewritten; `host_has_devices` is asked only in auto mode.
    pub fn rewrites(self, host_has_devices: impl FnOnce() -> bool) -> bool {
        match self {
            Self::Auto => !host_has_devices(),
            Self::Replace => true,
            Self::Keep => false,
        }
    }
}

/// `(absolute prefix, how many leading bytes the tree drops, whether the prefix must end a
/// path component)`: `/sys/x` is `x` under the root, `/dev/x` is `dev/x`.
const MAP: [(&[u8], usize, bool); 5] = [
    (b"/sys/class/infiniband", 4, true),
    (b"/sys/class/infiniband_verbs", 4, true),
    (b"/sys/devices/pci15b3:", 4, false),
    (b"/sys/bus/pci/devices/15b3:", 4, false),
    (b"/dev/infiniband", 0, true),
];

/// The cheap test every hook makes first: whether a path starting with these bytes can be one
/// of ours (`/s…` or `/d…`).
#[inline]
pub fn maybe_ours(first: u8, second: u8) -> bool {
    first == b'/' && (second == b's' || second == b'd')
}

/// How many bytes of `path` the tree drops, when `path` is under one of the prefixes.
pub fn matches(path: &[u8]) -> Option<usize> {
    MAP.iter().find_map(|&(prefix, drop, whole)| {
        let rest = path.strip_prefix(prefix)?;
        (!whole || rest.is_empty() || rest[0] == b'/').then_some(drop)
    })
}

/// What a path becomes.
#[derive(Debug, PartialEq, Eq)]
pub enum Rewrite {
    /// Not one of ours: use it as it is.
    Untouched,
    /// Written to the buffer: this many bytes, then a NUL.
    Mapped(usize),
    /// The rewritten path does not fit (ENAMETOOLONG).
    TooLong,
}

/// Rewrites `path` to the same path under `root` into `out` (NUL-terminated).
pub fn rewrite(path: &[u8], root: &[u8], out: &mut [u8]) -> Rewrite {
    let Some(drop) = matches(path) else {
        return Rewrite::Untouched;
    };
    let tail = &path[drop..];
    let n = root.len() + tail.len();
    if n + 1 > out.len() {
        return Rewrite::TooLong;
    }
    out[..root.len()].copy_from_slice(root);
    out[root.len()..n].copy_from_slice(tail);
    out[n] = 0;
    Rewrite::Mapped(n)
}

/// A resolved path inside the tree (`canon_root` is the root's own resolved path) as the
/// absolute path it stands for: `<root>/dev/…` is `/dev/…`, anything else `<root>/x` is
/// `/sys/x`. `None` when `resolved` is outside the tree.
pub fn unmap(resolved: &[u8], canon_root: &[u8]) -> Option<Vec<u8>> {
    let rest = resolved.strip_prefix(canon_root)?;
    if !(rest.is_empty() || rest[0] == b'/') {
        return None;
    }
    let dev = rest == b"/dev" || rest.starts_with(b"/dev/");
    let mut v = Vec::with_capacity(rest.len() + 4);
    if !dev {
        v.extend_from_slice(b"/sys");
    }
    v.extend_from_slice(rest);
    Some(v)
}

/// Whether the host has RDMA devices of its own (an entry in `/sys/class/infiniband`). Read with
/// raw system calls: the preload library's hooks of `opendir` and `open` may be what asks.
pub fn host_has_rdma_devices() -> bool {
    const DIR: &[u8] = b"/sys/class/infiniband\0";
    // SAFETY: plain system calls on a NUL-terminated path and our own buffer; the fd is closed.
    unsafe {
        let fd = libc::syscall(
            libc::SYS_openat,
            libc::AT_FDCWD,
            DIR.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return false;
        }
        let mut buf = [0u64; 512];
        let mut found = false;
        loop {
            let n = libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), 4096usize);
            if n <= 0 {
                break;
            }
            let bytes = std::slice::from_raw_parts(buf.as_ptr() as *const u8, n as usize);
            let mut off = 0;
            while off + 19 < bytes.len() {
                // struct linux_dirent64: ino 8, off 8, reclen 2, type 1, name
                let reclen = u16::from_ne_bytes([bytes[off + 16], bytes[off + 17]]) as usize;
                let name = &bytes[off + 19..(off + reclen).min(bytes.len())];
                let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
                if name != b"." && name != b".." {
                    found = true;
                }
                if reclen == 0 {
                    break;
                }
                off += reclen;
            }
            if found {
                break;
            }
        }
        libc::syscall(libc::SYS_close, fd);
        found
    }
}

/// The process's rewriting: the tree's root as given and as resolved.
#[derive(Debug)]
pub struct Rewriter {
    /// `$SYSFS_PATH` as given.
    pub root: Vec<u8>,
    /// `$SYSFS_PATH` resolved (what `realpath` of a path in the tree starts with).
    pub canon_root: Vec<u8>,
}

static REWRITER: OnceLock<Option<Rewriter>> = OnceLock::new();

thread_local! {
    static SETTING_UP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The process's rewriting, set up on first use: `None` when the paths stay as they are (no
/// `$SYSFS_PATH`, [`SysfsMode::Keep`], a host with RDMA devices in auto mode, a bad setting
/// (one line on stderr), or a call made while setting it up).
pub fn rewriter() -> Option<&'static Rewriter> {
    if let Some(r) = REWRITER.get() {
        return r.as_ref();
    }
    if SETTING_UP.with(|s| s.replace(true)) {
        // a hook reached from the setup itself (resolving the root): leave that path alone
        return None;
    }
    let r = REWRITER.get_or_init(|| {
        use std::os::unix::ffi::OsStrExt as _;
        let root = std::env::var_os(ENV_SYSFS_PATH).filter(|v| !v.is_empty())?;
        let mode = match SysfsMode::parse(std::env::var(ENV_SYSFS).ok().as_deref()) {
            Ok(m) => m,
            Err(e) => {
                crate::complain(format_args!("absolute device paths left alone: {e}"));
                return None;
            }
        };
        if !mode.rewrites(host_has_rdma_devices) {
            return None;
        }
        let mut root = root.as_bytes().to_vec();
        while root.len() > 1 && root.ends_with(b"/") {
            root.pop();
        }
        let canon_root = std::fs::canonicalize(std::ffi::OsStr::from_bytes(&root))
            .map(|p| p.as_os_str().as_bytes().to_vec())
            .unwrap_or_else(|_| root.clone());
        Some(Rewriter { root, canon_root })
    });
    SETTING_UP.with(|s| s.set(false));
    r.as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rw(p: &str) -> Option<String> {
        let mut out = [0u8; 64];
        match rewrite(p.as_bytes(), b"/tmp/t", &mut out) {
            Rewrite::Untouched => None,
            Rewrite::Mapped(n) => {
                assert_eq!(out[n], 0);
                Some(String::from_utf8(out[..n].to_vec()).unwrap())
            }
            Rewrite::TooLong => Some("TOO LONG".into()),
        }
    }

    #[test]
    fn paths_under_the_prefixes_are_rewritten() {
        assert_eq!(
            rw("/sys/class/infiniband").unwrap(),
            "/tmp/t/class/infiniband"
        );
        assert_eq!(
            rw("/sys/class/infiniband/mlx5_0/ports/1/state").unwrap(),
            "/tmp/t/class/infiniband/mlx5_0/ports/1/state"
        );
        assert_eq!(
            rw("/sys/class/infiniband_verbs/uverbs1/dev").unwrap(),
            "/tmp/t/class/infiniband_verbs/uverbs1/dev"
        );
        assert_eq!(
            rw("/sys/devices/pci15b3:00/15b3:00:00.0").unwrap(),
            "/tmp/t/devices/pci15b3:00/15b3:00:00.0"
        );
        assert_eq!(
            rw("/sys/bus/pci/devices/15b3:01:00.0/vendor").unwrap(),
            "/tmp/t/bus/pci/devices/15b3:01:00.0/vendor"
        );
        assert_eq!(rw("/dev/infiniband").unwrap(), "/tmp/t/dev/infiniband");
        assert_eq!(rw("/dev/infiniband/").unwrap(), "/tmp/t/dev/infiniband/");
        assert_eq!(
            rw("/dev/infiniband/umad0").unwrap(),
            "/tmp/t/dev/infiniband/umad0"
        );
        assert_eq!(
            rw("/sys/class/infiniband/0123456789012345678901234567890123456789012"),
            Some("TOO LONG".into())
        );
    }

    #[test]
    fn other_paths_are_untouched() {
        for p in [
            "/sys/class/net",
            "/sys/class/net/lo/address",
            "/sys/class/infinibandX",
            "/sys/class/infiniband_mad/umad0",
            "/sys/class",
            "/sys/devices/pci0000:00/0000:00:01.0",
            "/sys/bus/pci/devices/0000:00:01.0",
            "/dev/infinibandx",
            "/dev/null",
            "sys/class/infiniband",
            "class/infiniband",
            "",
            "/",
        ] {
            assert_eq!(rw(p), None, "{p}");
        }
        assert!(maybe_ours(b'/', b's') && maybe_ours(b'/', b'd'));
        assert!(!maybe_ours(b'/', b'u') && !maybe_ours(b's', b'y') && !maybe_ours(0, 0));
    }

    #[test]
    fn resolved_paths_map_back() {
        let u = |p: &str| unmap(p.as_bytes(), b"/tmp/t").map(|v| String::from_utf8(v).unwrap());
        assert_eq!(
            u("/tmp/t/devices/pci15b3:00/15b3:00:00.0").unwrap(),
            "/sys/devices/pci15b3:00/15b3:00:00.0"
        );
        assert_eq!(
            u("/tmp/t/class/infiniband").unwrap(),
            "/sys/class/infiniband"
        );
        assert_eq!(
            u("/tmp/t/dev/infiniband/uverbs0").unwrap(),
            "/dev/infiniband/uverbs0"
        );
        assert_eq!(u("/tmp/t/devices").unwrap(), "/sys/devices");
        assert_eq!(u("/tmp/t").unwrap(), "/sys");
        assert_eq!(u("/tmp/tx/class"), None);
        assert_eq!(u("/usr/lib"), None);
    }

    #[test]
    fn modes() {
        assert_eq!(SysfsMode::parse(None).unwrap(), SysfsMode::Auto);
        assert_eq!(
            SysfsMode::parse(Some("replace")).unwrap(),
            SysfsMode::Replace
        );
        assert_eq!(SysfsMode::parse(Some("keep")).unwrap(), SysfsMode::Keep);
        assert!(SysfsMode::parse(Some("yes")).is_err());
        assert!(SysfsMode::Auto.rewrites(|| false));
        assert!(!SysfsMode::Auto.rewrites(|| true));
        assert!(SysfsMode::Replace.rewrites(|| panic!("not asked")));
        assert!(!SysfsMode::Keep.rewrites(|| panic!("not asked")));
        // this machine's answer (no panic, whatever it is)
        let _ = host_has_rdma_devices();
    }
}
