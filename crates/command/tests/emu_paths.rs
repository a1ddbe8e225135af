//! `gpuverbs emu` shows its devices under the absolute paths a library finds them by, not only
//! through libibverbs' `$SYSFS_PATH`: `access`/`stat` of `/dev/infiniband/uverbsN`, listings of
//! `/dev/infiniband` and `/sys/class/infiniband`, sysfs files, `realpath` of a device's
//! `device` link (a PCI function folder with `vendor`), and `syscall(SYS_mmap, …)` of a device
//! file; paths outside stay as they are. A Python script (`/usr/bin/python3`, ctypes for the libc
//! calls Python itself does not make) checks each under `gpuverbs emu --devices 2`.
//!
//! Needs Debian's python3 and libibverbs1 + ibverbs-providers (CI installs them).

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod emu_util;
use emu_util::*;

/// Runs `script` with /usr/bin/python3 under `gpuverbs emu --devices 2 --ip IP` (each test an
/// address of its own, 127.0.170.x..127.0.179.x, so that tests running at once do not share a
/// wire port) and the given extra environment; its output, after asserting success within a
/// minute.
fn run_script(ip: &str, script: &str, env: &[(&str, &str)]) -> String {
    assert!(
        Path::new("/usr/bin/python3").is_file(),
        "/usr/bin/python3 not found: install the Debian package python3"
    );
    let mut file = tempfile_path("emu_paths.py");
    std::fs::File::create(&file)
        .and_then(|mut f| f.write_all(script.as_bytes()))
        .unwrap();
    let mut c = Command::new(GPUVERBS);
    c.env("GPUVERBS_PRELOAD", preload())
        .envs(env.iter().copied())
        .args([
            "emu",
            "--devices",
            "2",
            "--ip",
            ip,
            "--",
            "/usr/bin/python3",
        ])
        .arg(&file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = c.spawn().unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(60) {
            // SAFETY: plain system call on the process group this test started.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let _ = std::fs::remove_file(&file);
    file.pop();
    assert!(
        o.status.success(),
        "the script failed ({}):\n{text}",
        o.status
    );
    text
}

fn tempfile_path(name: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("gv-{}-{n}-{name}", std::process::id()))
}

/// The checks, in the emulated process. argv[1]: the host's /sys/class/net listing, `|`-joined.
const CHECKS: &str = r#"
import ctypes, os, stat, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.access.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.realpath.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.realpath.restype = ctypes.c_char_p
libc.syscall.restype = ctypes.c_long
libc.syscall.argtypes = [ctypes.c_long] * 7
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

def check(what, ok):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        sys.exit(1)

for n in (0, 1):
    p = b"/dev/infiniband/uverbs%d" % n
    check("access %s R_OK|W_OK" % p.decode(), libc.access(p, os.R_OK | os.W_OK) == 0)
    check("os.access %s" % p.decode(), os.access(p, os.R_OK | os.W_OK))
check("access uverbs2 (no such device) fails", libc.access(b"/dev/infiniband/uverbs2", os.F_OK) != 0)
st = os.stat("/dev/infiniband/uverbs0")
check("stat uverbs0 is a char device 231:192",
      stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 231 and os.minor(st.st_rdev) == 192)
check("lstat uverbs1 is a char device", stat.S_ISCHR(os.lstat("/dev/infiniband/uverbs1").st_mode))
check("listdir /dev/infiniband", sorted(os.listdir("/dev/infiniband")) == ["uverbs0", "uverbs1"])
check("listdir /sys/class/infiniband", sorted(os.listdir("/sys/class/infiniband")) == ["mlx5_0", "mlx5_1"])
check("listdir /sys/class/infiniband_verbs has uverbs0, uverbs1",
      {"uverbs0", "uverbs1"} <= set(os.listdir("/sys/class/infiniband_verbs")))
with open("/sys/class/infiniband/mlx5_0/ports/1/state") as f:
    check("read mlx5_0 port 1 state", f.read().strip() == "4: ACTIVE")
with open("/sys/class/infiniband_verbs/uverbs1/ibdev") as f:
    check("read uverbs1/ibdev", f.read().strip() == "mlx5_1")
dev = "/sys/class/infiniband/mlx5_0/device"
py = os.path.realpath(dev)
c = libc.realpath(dev.encode(), None).decode()
print("realpath:", py, c)
check("os.path.realpath == libc realpath", py == c)
check("realpath is a PCI function folder", os.path.basename(py) == "15b3:00:00.0")
for d in (py, c, dev):
    with open(os.path.join(d, "vendor")) as f:
        check("vendor of %s" % d, f.read().strip() == "0x15b3")
with open(os.path.join(py, "numa_node")) as f:
    check("numa_node -1", f.read().strip() == "-1")
check("local_cpulist readable", len(open(os.path.join(py, "local_cpulist")).read().strip()) > 0)
check("realpath of mlx5_1/device differs",
      os.path.realpath("/sys/class/infiniband/mlx5_1/device") == "/sys/devices/pci15b3:01/15b3:01:00.0")
check("/sys/bus/pci/devices/15b3:00:00.0 is the same folder",
      os.path.realpath("/sys/bus/pci/devices/15b3:00:00.0") == py)

# the raw system call mmap of a device file: static UAR page 0 of a context libmlx5 opened
ibv = ctypes.CDLL("libibverbs.so.1")
ibv.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
ibv.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
ibv.ibv_open_device.restype = ctypes.c_void_p
ibv.ibv_open_device.argtypes = [ctypes.c_void_p]
ibv.ibv_close_device.argtypes = [ctypes.c_void_p]
num = ctypes.c_int()
devs = ibv.ibv_get_device_list(ctypes.byref(num))
check("two devices", num.value == 2)
ctx = ibv.ibv_open_device(devs[0])
check("ibv_open_device", bool(ctx))
# struct ibv_context: device pointer, ibv_context_ops (32 pointers), then cmd_fd (rdma-core 44)
fd = ctypes.c_int.from_address(ctx + 8 + 32 * 8).value
check("cmd_fd %d is the device (fstat: char device)" % fd, stat.S_ISCHR(os.fstat(fd).st_mode))
PROT_RW, MAP_SHARED = 3, 1
addr = libc.syscall(9, 0, 4096, PROT_RW, MAP_SHARED, fd, 0)
check("syscall(SYS_mmap, fd, offset 0) maps (got %#x)" % (addr & (2**64 - 1)), addr not in (-1, 0))
ctypes.c_uint32.from_address(addr).value  # the page is there
bad = libc.syscall(9, 0, 4096, PROT_RW, MAP_SHARED, fd, 4095)
check("a misaligned offset: -1 and EINVAL", bad == -1 and ctypes.get_errno() == 22)
check("munmap", libc.munmap(addr, 4096) == 0)
check("syscall(SYS_getpid) goes through", libc.syscall(39, 0, 0, 0, 0, 0, 0) == os.getpid())
ibv.ibv_close_device(ctx)

net = sorted(os.listdir("/sys/class/net"))
check("/sys/class/net untouched", "|".join(net) == sys.argv[1])
check("/sys/class untouched (has net)", "net" in os.listdir("/sys/class"))
print("all checks passed")
"#;

fn host_net() -> String {
    let mut v: Vec<String> = std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v.join("|")
}

#[test]
fn devices_under_absolute_paths() {
    // replace: the same answers on a CI host that has RDMA devices of its own
    let script = CHECKS.replace("sys.argv[1]", &format!("{:?}", host_net()));
    let out = run_script(
        "127.0.170.1",
        &script,
        &[
            ("GPUVERBS_EMU_SYSFS", "replace"),
            ("GPUVERBS_EMU_UARS", "static"),
        ],
    );
    assert!(out.contains("all checks passed"), "{out}");
}

#[test]
fn keep_leaves_the_host_paths() {
    let host = Path::new("/sys/class/infiniband").exists();
    let script = format!(
        "import os, sys\n\
         seen = os.path.exists('/sys/class/infiniband')\n\
         print('seen', seen)\n\
         sys.exit(0 if seen == {} else 1)\n",
        if host { "True" } else { "False" }
    );
    let out = run_script("127.0.171.1", &script, &[("GPUVERBS_EMU_SYSFS", "keep")]);
    assert!(out.contains("seen"), "{out}");
}

#[test]
fn a_shell_cds_into_the_emulated_tree() {
    // ibstatus (infiniband-diags) does `cd /sys/class/infiniband` and reads relative paths
    let out = run(
        emu(
            "127.0.172.1",
            None,
            &[
                "sh",
                "-c",
                "cd /sys/class/infiniband && ls && cat mlx5_0/ports/1/state",
            ],
        ),
        Duration::from_secs(60),
        "cd into the emulated sysfs",
    );
    assert!(out.contains("mlx5_0") && out.contains("ACTIVE"), "{out}");
}
