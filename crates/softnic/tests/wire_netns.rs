//! Two soft devices in two network namespaces joined by a veth pair (made by the test, removed
//! after it): each binds its namespace's address at the RoCEv2 port 4791, with GIDs from those
//! addresses. 16 MiB of WRITEs at 1% loss (MTU 4096 on a 9000-byte veth, segmentation offload
//! included), a READ back, an atomic. Both devices live in this process (on threads that
//! entered the namespaces), so a peer-table entry sends them over the wire instead of the
//! in-process path. Skipped, with a note, where namespaces cannot be made (not root, no `ip`); a failure
//! then under CI (`CI=true`).

mod common;
mod wire_util;

use common::*;
use prm::wqe::Op;
use softnic::{Access, Device, DeviceConfig, WireConfig, WireFaults};
use std::process::Command;
use wire_util::*;

struct Netns {
    names: [String; 2],
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success())
}

impl Netns {
    /// Two namespaces `gvwA<pid>`, `gvwB<pid>` with a veth pair (MTU 9000) addressed
    /// `10.233.<n>.1/24` and `.2/24`.
    fn make(n: u8) -> Option<Self> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        let pid = std::process::id();
        let names = [format!("gvwA{pid}"), format!("gvwB{pid}")];
        let ns = Self { names };
        let [a, b] = &ns.names;
        let (va, vb) = (format!("gva{pid}"), format!("gvb{pid}"));
        let ok = ip(&["netns", "add", a])
            && ip(&["netns", "add", b])
            && ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])
            && ip(&["link", "set", &va, "netns", a])
            && ip(&["link", "set", &vb, "netns", b]);
        if !ok {
            return None;
        }
        for (name, dev, host) in [(a, &va, 1), (b, &vb, 2)] {
            let addr = format!("10.233.{n}.{host}/24");
            let ok = ip(&["-n", name, "addr", "add", &addr, "dev", dev])
                && ip(&["-n", name, "link", "set", dev, "mtu", "9000"])
                && ip(&["-n", name, "link", "set", dev, "up"])
                && ip(&["-n", name, "link", "set", "lo", "up"]);
            if !ok {
                return None;
            }
        }
        Some(ns)
    }

    /// Runs `f` on a thread inside namespace `i`: sockets it makes belong there.
    fn run<T: Send>(&self, i: usize, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/var/run/netns/{}", self.names[i]);
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = std::fs::File::open(&path).expect("namespace file");
                use std::os::fd::AsRawFd;
                // SAFETY: the fd is an open namespace file; setns changes only this thread.
                let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .expect("namespace thread")
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            ip(&["netns", "del", n]);
        }
    }
}

#[test]
fn two_namespaces_over_veth() {
    let _s = serial();
    if !wire_util::netns::privileged("two_namespaces_over_veth") {
        return;
    }
    let n = (std::process::id() % 200) as u8 + 20;
    let ns = Netns::make(n).expect("network namespaces and a veth pair");
    let open = |i: usize, host: u8| {
        ns.run(i, || {
            let dev = Device::open(DeviceConfig {
                wire: Some(WireConfig {
                    faults: WireFaults::loss(0.01, host as u64),
                    ..WireConfig::new(([10, 233, n, host], 4791).into())
                }),
                ..Default::default()
            })
            .unwrap();
            let pd = dev.alloc_pd();
            Node { dev, pd }
        })
    };
    let (a, b) = (open(0, 1), open(1, 2));
    assert_ne!(a.dev.gid(), b.dev.gid());
    // the peers' real addresses, at the RoCEv2 port
    for (x, y, host) in [(&a, &b, 2), (&b, &a, 1)] {
        x.dev
            .add_peer(y.dev.gid(), ([10, 233, n, host], 4791).into())
            .unwrap();
    }
    let (ea, eb) = connect_mtu(&a, &wire_opts(), &b, &wire_opts(), 4096);
    let mut p = Pair { a, b, ea, eb };
    const SIZE: usize = 16 << 20;
    let src = p.a.buf(SIZE, Access::NONE);
    fill_random(&src, 0x4e7);
    let dst = p.b.buf(SIZE, ALL_REMOTE);
    let took = bulk_write(&mut p, &src, &dst, 1 << 20, 16);
    assert!(dst.bytes() == src.bytes(), "bytes differ across the veth");
    let back = p.a.buf(1 << 20, Access::LOCAL_WRITE);
    let i = p.ea.go(
        &Op::Read {
            remote: dst.remote(SIZE - (1 << 20)),
            local: &[back.sge(0, 1 << 20)],
        },
        SIG,
    );
    p.ea.expect_req(0x10, i);
    assert!(back.bytes() == src.read(SIZE - (1 << 20), 1 << 20));
    let res = p.a.buf(8, Access::LOCAL_WRITE);
    let old = dst.u64_at(8);
    let i = p.ea.go(
        &Op::FetchAdd {
            remote: dst.remote(8),
            add: 1,
            result: res.sge(0, 8),
        },
        SIG,
    );
    p.ea.expect_req(0x12, i);
    assert_eq!((res.u64_at(0), dst.u64_at(8)), (old, old.wrapping_add(1)));
    let c = p.a.dev.counters().wire;
    assert!(
        c.tx_packets >= (SIZE / 4096) as u64 && c.injected_drops > 0,
        "{c:?}"
    );
    eprintln!(
        "veth: 16 MiB in {took:?}, {} packets, {} retransmitted",
        c.tx_packets, c.retransmits
    );
    drop(p);
    drop(ns);
}
