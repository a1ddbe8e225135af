//! The RDMA netlink socket under `gpuverbs emu`: iproute2's `rdma` shows the emulated devices
//! (`dev`, `link`, `resource`, `statistic`, `system`), libibverbs lists them with netlink
//! answered (it asks for the device dump and each device's `uverbs` character device before it
//! looks at sysfs, and checks the character device's number against the device file's), and a
//! program's own objects show in the resource summary while they live (pyverbs opens them, then
//! asks netlink from the same process through a raw socket, and checks the `uverbs` character
//! device against `stat` of the device file).
//!
//! Needs Debian's iproute2, ibverbs-utils and python3-pyverbs (CI installs them).

use std::io::Write;
use std::time::Duration;

mod emu_util;
use emu_util::*;

/// `ARGS…` under `gpuverbs emu --devices 2 --ip IP`.
fn emu2(ip: &str, args: &[&str]) -> std::process::Command {
    let mut c = std::process::Command::new(GPUVERBS);
    c.env("GPUVERBS_PRELOAD", preload())
        .args(["emu", "--devices", "2", "--ip", ip, "--"])
        .args(args);
    c
}

/// `rdma ARGS…` under two emulated devices: its output, after asserting success.
fn rdma(ip: &str, args: &[&str]) -> String {
    need("rdma", "iproute2");
    let mut all = vec!["rdma"];
    all.extend_from_slice(args);
    run(emu2(ip, &all), Duration::from_secs(60), &all.join(" "))
}

#[test]
fn rdma_shows_the_emulated_devices_links_resources_and_counters() {
    let dev = rdma("127.0.181.1", &["dev", "show"]);
    for i in 0..2 {
        // the node GUID sysfs shows for the device, under the same settings
        let path = format!("/sys/class/infiniband/mlx5_{i}/node_guid");
        let guid = run(
            emu2("127.0.181.1", &["cat", &path]),
            Duration::from_secs(60),
            "cat",
        );
        let guid = guid.trim();
        let line = format!(
            "{i}: mlx5_{i}: node_type ca fw 0.1.0 (gpuverbs soft NIC) node_guid {guid} \
             sys_image_guid {guid}"
        );
        assert!(dev.contains(&line), "rdma dev:\n{dev}\nwants: {line}");
    }

    let link = rdma("127.0.181.2", &["link", "show"]);
    for i in 0..2 {
        let line = format!("link mlx5_{i}/1 state ACTIVE physical_state LINK_UP netdev lo");
        assert!(link.contains(&line), "rdma link:\n{link}");
    }
    let one = rdma("127.0.181.3", &["link", "show", "mlx5_1/1"]);
    assert_eq!(
        one.trim(),
        "link mlx5_1/1 state ACTIVE physical_state LINK_UP netdev lo"
    );

    let res = rdma("127.0.181.4", &["-j", "resource", "show"]);
    let res: serde_json::Value = serde_json::from_str(res.trim()).expect("rdma -j resource: JSON");
    let res = res.as_array().expect("one object per device");
    assert_eq!(res.len(), 2);
    for (i, d) in res.iter().enumerate() {
        assert_eq!(d["ifname"], format!("mlx5_{i}"));
        for k in ["pd", "cq", "qp", "cm_id", "mr", "ctx", "srq"] {
            // the tool's own process holds nothing
            assert_eq!(d[k], 0, "{k} of mlx5_{i}: {d}");
        }
    }

    let stat = rdma("127.0.181.5", &["statistic", "show", "link", "mlx5_0/1"]);
    assert!(
        stat.starts_with("link mlx5_0/1 ")
            && stat.contains("wqes_executed 0")
            && stat.contains("rx_packets 0"),
        "rdma statistic:\n{stat}"
    );
    let sys = rdma("127.0.181.6", &["system", "show"]);
    assert!(sys.contains("netns shared"), "rdma system:\n{sys}");
}

#[test]
fn libibverbs_lists_the_devices_with_netlink_answered() {
    need("ibv_devices", "ibverbs-utils");
    let out = run(
        emu2("127.0.181.7", &["ibv_devices"]),
        Duration::from_secs(60),
        "ibv_devices",
    );
    let guid = run(
        emu2(
            "127.0.181.7",
            &["cat", "/sys/class/infiniband/mlx5_1/node_guid"],
        ),
        Duration::from_secs(60),
        "cat",
    );
    let line = format!("mlx5_1          \t{}", guid.trim().replace(':', ""));
    assert!(
        out.contains("mlx5_0") && out.contains(&line),
        "ibv_devices:\n{out}\nwants: {line}"
    );
}

/// A pyverbs program opens a context, PD, CQ and QP on mlx5_0, then asks the RDMA netlink
/// socket (a raw `AF_NETLINK` socket of its own, as `rdma` would from the same process) for the
/// resource summary, and again after closing them; then asks for the rdma_cm character device
/// (the emulated connection manager's, whose device file has its number).
const LIVE: &str = r#"
import socket, struct
from pyverbs.device import Context
from pyverbs.pd import PD
from pyverbs.cq import CQ
from pyverbs.qp import QP, QPInitAttr, QPCap
import pyverbs.enums as e

NLDEV = 5
def request(op, flags, attrs):
    body = b''.join(struct.pack('=HH', 4 + len(p), t) + p + b'\0' * (-len(p) % 4) for t, p in attrs)
    return struct.pack('=IHHII', 16 + len(body), (NLDEV << 10) | op, 1 | flags, 1, 0) + body

def ask(op, flags, attrs):
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 20)
    s.bind((0, 0))
    s.send(request(op, flags, attrs))
    msgs = []
    while True:
        d = s.recv(65536)
        while len(d) >= 16:
            ln, ty, fl, seq, pid = struct.unpack('=IHHII', d[:16])
            msgs.append((ty, d[16:ln]))
            d = d[(ln + 3) & ~3:]
        if msgs and (msgs[-1][0] in (2, 3) or not flags & 0x300):
            break
    s.close()
    return msgs

def attrs(b):
    out = {}
    while len(b) >= 4:
        ln, t = struct.unpack('=HH', b[:4])
        out.setdefault(t & 0x3fff, []).append(b[4:ln])
        b = b[(ln + 3) & ~3:]
    return out

def summary():
    (ty, body), = [m for m in ask(9, 0, [(1, struct.pack('=I', 0))])]
    assert ty == (NLDEV << 10) | 9, ty
    out = {}
    for entry in attrs(attrs(body)[15][0])[16]:
        a = attrs(entry)
        out[a[17][0].rstrip(b'\0').decode()] = struct.unpack('=Q', a[18][0])[0]
    return out

before = summary()
ctx = Context(name='mlx5_0')
pd = PD(ctx)
cq = CQ(ctx, 16)
qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap(max_send_wr=4, max_recv_wr=4)))
live = summary()
qp.close(); cq.close(); pd.close(); ctx.close()
after = summary()
print('before', sorted(before.items()))
print('live', sorted(live.items()))
print('after', sorted(after.items()))
assert live['ctx'] == before['ctx'] + 1 and live['pd'] == before['pd'] + 1, live
assert live['cq'] == before['cq'] + 1 and live['qp'] == before['qp'] + 1, live
assert after == before, after

# the uverbs chardev, as libibverbs decodes it: the device file whose st_rdev it checks
import os
(ty, body), = ask(15, 0, [(1, struct.pack('=I', 0)), (69, b'uverbs\0')])
a = attrs(body)
assert a[70][0] == b'uverbs0\0', a[70]
cdev = struct.unpack('=Q', a[72][0])[0]
major, minor = (cdev & 0xfff00) >> 8, (cdev & 0xff) | ((cdev >> 12) & 0xfff00)
st = os.stat('/dev/infiniband/uverbs0')
assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor), (major, minor, st)
assert struct.unpack('=I', a[73][0])[0] == 1  # RDMA_DRIVER_MLX5

# the rdma_cm chardev: a device's, none (ucma has no per-device node: EOPNOTSUPP); the
# global one, as librdmacm asks for it: the emulated connection manager's, whose device file
# has that number
(ty, body), = ask(15, 0, [(1, struct.pack('=I', 0)), (69, b'rdma_cm\0')])
assert ty == 2 and struct.unpack('=i', body[:4])[0] == -95, (ty, body[:4])
(ty, body), = ask(15, 0, [(69, b'rdma_cm\0')])
a = attrs(body)
assert a[70][0] == b'rdma_cm\0', a[70]
assert struct.unpack('=Q', a[71][0])[0] == 4  # RDMA_USER_CM_ABI_VERSION
cdev = struct.unpack('=Q', a[72][0])[0]
major, minor = (cdev & 0xfff00) >> 8, (cdev & 0xff) | ((cdev >> 12) & 0xfff00)
fd = os.open('/dev/infiniband/rdma_cm', os.O_RDWR)
st = os.fstat(fd)
os.close(fd)
assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor), (major, minor, st)
print('ok')
"#;

#[test]
fn a_programs_live_objects_show_in_the_resource_summary() {
    need("python3", "python3");
    let file = tmp("emu_netlink_live.py");
    std::fs::File::create(&file)
        .and_then(|mut f| f.write_all(LIVE.as_bytes()))
        .unwrap();
    let py = file.to_string_lossy();
    let out = run(
        emu2("127.0.181.8", &["/usr/bin/python3", &py]),
        Duration::from_secs(60),
        "pyverbs + netlink",
    );
    assert!(out.trim_end().ends_with("ok"), "{out}");
    assert!(
        out.contains("('ctx', 1)") && out.contains("('qp', 1)"),
        "{out}"
    );
}
