//! libfabric 1.17's verbs provider on the emulated devices: `fi_pingpong` over `verbs` (MSG
//! endpoints, connected through the emulated rdma_cm), `verbs;ofi_rxm` (RDM over MSG) and
//! `verbs` DGRAM (UD), each byte checked (`-c`), server and client under their own
//! `gpuverbs emu`.
//!
//! The verbs provider offers MSG endpoints only for devices whose address it finds on an
//! interface that is up and not a loopback one (`vrb_getifaddrs` skips `IFF_LOOPBACK`), as a
//! ConnectX's RoCE netdev is. So the two sides run as two hosts: two network namespaces joined
//! by a veth pair (made here, removed after), each emulated device on its namespace's `veth0`
//! address — the device's netdev is `veth0` (sysfs, netlink), its active MTU 1024 (the veth's
//! 1500, as mlx5_ib computes it). Needs root and iproute2 for the namespaces: skipped with a note
//! without them, a failure under CI (`CI=true`, which runs as root). Needs Debian's libfabric-bin.
//! On the default loopback address (127.0.226.1, no namespace) the provider offers no MSG
//! endpoint, as on any host whose RDMA netdev is a loopback interface.

mod emu_util;
use emu_util::*;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn ip(args: &[&str]) -> Result<(), String> {
    match Command::new("ip").args(args).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("ip {}: {e}", args.join(" "))),
    }
}

/// Whether namespaces can be made here; not: a note (and `false`), or under CI a failure.
fn privileged(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let why = if unsafe { libc::geteuid() } != 0 {
        Some("not root".to_string())
    } else {
        ip(&["-V"]).err()
    };
    let Some(why) = why else { return true };
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test}: needs network namespaces (root and iproute2), and CI=true: {why}");
    }
    eprintln!("note: {test} skipped: needs network namespaces (root and iproute2): {why}");
    false
}

/// Two namespaces, each with `veth0` (`10.236.<sub>.1/24`, `.2/24`), joined; deleted on drop.
struct Hosts {
    names: [String; 2],
}

impl Hosts {
    fn new(sub: u8) -> Result<Self, String> {
        let pid = std::process::id();
        let h = Self {
            names: [format!("gvfA{pid}x{sub}"), format!("gvfB{pid}x{sub}")],
        };
        let (va, vb) = (format!("gvfa{pid}x{sub}"), format!("gvfb{pid}x{sub}"));
        for n in &h.names {
            ip(&["netns", "add", n])?;
        }
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        for (k, (n, v)) in h.names.iter().zip([&va, &vb]).enumerate() {
            ip(&["link", "set", v, "netns", n])?;
            ip(&["-n", n, "link", "set", v, "name", "veth0"])?;
            let addr = format!("{}/24", Self::addr(sub, k));
            ip(&["-n", n, "addr", "add", &addr, "dev", "veth0"])?;
            ip(&["-n", n, "link", "set", "veth0", "up"])?;
            ip(&["-n", n, "link", "set", "lo", "up"])?;
        }
        Ok(h)
    }

    fn addr(sub: u8, k: usize) -> String {
        format!("10.236.{sub}.{}", k + 1)
    }

    /// `gpuverbs emu --ip <host k's address> -- args` inside host `k`, in a process group of
    /// its own (`ip netns exec` runs the launcher in its own process, not a child).
    fn emu(&self, sub: u8, k: usize, counters: &std::path::Path, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[k], GPUVERBS, "emu", "--ip"])
            .arg(Self::addr(sub, k))
            .arg("--")
            .args(args)
            .env("GPUVERBS_PRELOAD", preload())
            .env("GPUVERBS_EMU_COUNTERS", counters)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        c
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// Whether process `pid`'s network namespace has a TCP socket listening on `port`.
fn listening_in(pid: u32, port: u16) -> bool {
    let tcp = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    let want = format!(":{port:04X}");
    tcp.lines().skip(1).any(|l| {
        let f: Vec<_> = l.split_whitespace().collect();
        f.len() > 3 && f[3] == "0A" && f[1].ends_with(&want)
    })
}

/// fi_pingpong's control port (its default).
const CTRL_PORT: u16 = 47592;

/// Runs `fi_pingpong <args> -c` as server in host 1 and client (to host 1) in host 2; both
/// must exit 0 with clean counters. Returns the client's output.
fn pingpong(sub: u8, args: &[&str]) -> String {
    let hosts = Hosts::new(sub).unwrap_or_else(|e| panic!("network namespaces: {e}"));
    let (sc, cc) = (tmp(&format!("fab-{sub}-s")), tmp(&format!("fab-{sub}-c")));
    let mut sargs = vec!["fi_pingpong"];
    sargs.extend(args);
    sargs.push("-c");
    let mut cargs = sargs.clone();
    let server_ip = Hosts::addr(sub, 0);
    cargs.push(&server_ip);
    let srv = hosts.emu(sub, 0, &sc, &sargs).spawn().unwrap();
    let t = Instant::now();
    while !listening_in(srv.id(), CTRL_PORT) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "fi_pingpong {args:?} server never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let cli = hosts.emu(sub, 1, &cc, &cargs).spawn().unwrap();
    let what = format!("fi_pingpong {args:?}");
    let co = wait(cli, Duration::from_secs(120), &format!("{what} client"));
    let so = wait(srv, Duration::from_secs(30), &format!("{what} server"));
    let text = |o: &std::process::Output| {
        String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr)
    };
    let (c, s) = (text(&co), text(&so));
    assert!(
        co.status.success() && so.status.success(),
        "{what}: client {}, server {}\nclient:\n{c}\nserver:\n{s}",
        co.status,
        so.status
    );
    check_counters_flush_ok(&cc, &format!("{what} client"), true);
    check_counters_flush_ok(&sc, &format!("{what} server"), true);
    c
}

/// The sizes of the result rows (`bytes #sent #ack ...`), each with every transfer acknowledged.
fn sizes(out: &str, iters: &str) -> Vec<String> {
    out.lines()
        .map(str::split_whitespace)
        .filter_map(|mut f| {
            let (size, sent, ack) = (f.next()?, f.next()?, f.next()?);
            (sent == iters && ack == format!("={iters}")).then(|| size.to_string())
        })
        .collect()
}

#[test]
fn fi_pingpong_verbs_msg_rdm_and_dgram() {
    need("fi_pingpong", "libfabric-bin");
    if !privileged("fi_pingpong_verbs_msg_rdm_and_dgram") {
        return;
    }
    let _g = serial();
    // MSG: RC QPs connected through the emulated rdma_cm (the server binds `localhost`, which
    // the CMA takes for any address), 64 B .. 1 MiB
    let out = pingpong(1, &["-p", "verbs", "-e", "msg", "-I", "20"]);
    assert_eq!(
        sizes(&out, "20"),
        ["64", "256", "1k", "4k", "64k", "1m"],
        "{out}"
    );
    // RDM: ofi_rxm over verbs MSG endpoints (eager and rendezvous sizes)
    let out = pingpong(2, &["-p", "verbs;ofi_rxm", "-e", "rdm", "-I", "20"]);
    assert_eq!(
        sizes(&out, "20"),
        ["64", "256", "1k", "4k", "64k", "1m"],
        "{out}"
    );
    // DGRAM: UD up to the port's active MTU (1024 on a 1500-byte netdev)
    let out = pingpong(3, &["-p", "verbs", "-e", "dgram", "-I", "50"]);
    assert_eq!(sizes(&out, "50"), ["64", "256", "1k"], "{out}");
}

/// On the emulation's default loopback address the device's netdev is `lo`, which the verbs
/// provider skips (as on any host): no MSG endpoint (`fi_getinfo: -61`, ENODATA), DGRAM still
/// offered. Needs no namespace.
#[test]
fn on_a_loopback_address_the_verbs_provider_offers_no_msg_endpoint() {
    need("fi_info", "libfabric-bin");
    let _g = serial();
    let fi_info = |ep: &str| {
        let child = emu("127.0.226.1", None, &["fi_info", "-p", "verbs", "-t", ep])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let o = wait(child, Duration::from_secs(30), "fi_info");
        let text =
            String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        (o.status.code(), text)
    };
    let (code, text) = fi_info("FI_EP_MSG");
    assert_eq!(code, Some(61), "{text}");
    assert!(text.contains("fi_getinfo: -61"), "{text}");
    let (code, text) = fi_info("FI_EP_DGRAM");
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("domain: mlx5_0-dgram"), "{text}");
}
