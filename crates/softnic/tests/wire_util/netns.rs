//! Network namespaces, veth pairs and packet capture for the wire tests that need root.
//!
//! Everything is made by the test and removed when its guard drops. Where namespaces cannot
//! be made (not root, no iproute2), [`privileged`] says so: the test is skipped with the
//! reason printed, except under CI (`CI=true`, which runs as root), where it fails.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

/// Whether this process can make network namespaces. When it cannot: under CI a panic with
/// the reason, otherwise a printed note and `false` (the caller returns: skipped).
pub fn privileged(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let why = if !root {
        Some("not root".to_string())
    } else {
        ip(&["-V"]).err().map(|e| format!("iproute2 missing ({e})"))
    };
    match why {
        None => true,
        Some(why) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{test}: needs network namespaces (root and iproute2), and CI=true: {why}");
            }
            eprintln!("note: {test} skipped: needs network namespaces (root and iproute2): {why}");
            false
        }
    }
}

/// Network namespaces made by a test, deleted on drop.
pub struct Netns {
    pub names: Vec<String>,
}

fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "gv{tag}{}x{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

impl Netns {
    /// One namespace with its loopback up.
    pub fn single() -> Result<Self, String> {
        let ns = Self {
            names: vec![unique("L")],
        };
        ip(&["netns", "add", &ns.names[0]])?;
        ip(&["-n", &ns.names[0], "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Two namespaces joined by a veth pair `veth0` (in the first, `10.<net>.<sub>.1/24`) and
    /// `veth0` (in the second, `.2/24`), both with link MTU `mtu`.
    pub fn pair(sub: u8, mtu: u32) -> Result<Self, String> {
        let ns = Self {
            names: vec![unique("A"), unique("B")],
        };
        let (a, b) = (&ns.names[0], &ns.names[1]);
        let (va, vb) = (unique("va"), unique("vb"));
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        ip(&["link", "set", &va, "netns", a])?;
        ip(&["link", "set", &vb, "netns", b])?;
        ip(&["-n", a, "link", "set", &va, "name", "veth0"])?;
        ip(&["-n", b, "link", "set", &vb, "name", "veth0"])?;
        let mtu = mtu.to_string();
        for (name, host) in [(a, 1), (b, 2)] {
            let addr = format!("10.234.{sub}.{host}/24");
            ip(&["-n", name, "addr", "add", &addr, "dev", "veth0"])?;
            ip(&["-n", name, "link", "set", "veth0", "mtu", &mtu])?;
            ip(&["-n", name, "link", "set", "veth0", "up"])?;
            ip(&["-n", name, "link", "set", "lo", "up"])?;
        }
        Ok(ns)
    }

    /// The address of host `host` (1 or 2) of a [`Netns::pair`] made with `sub`.
    pub fn addr(sub: u8, host: u8) -> std::net::Ipv4Addr {
        std::net::Ipv4Addr::new(10, 234, sub, host)
    }

    /// Makes the kernel segment every segmented send before `dev` of namespace `i` sees it
    /// (`gso_max_segs 1`), so a capture there shows the datagrams a wire would carry, not the
    /// coalesced buffers of a segmented send.
    pub fn segment_in_software(&self, i: usize, dev: &str) -> Result<(), String> {
        ip(&[
            "-n",
            &self.names[i],
            "link",
            "set",
            dev,
            "gso_max_segs",
            "1",
        ])
    }

    /// Runs `f` on a thread inside namespace `i`: sockets it makes (and threads it starts)
    /// belong there.
    pub fn run<T: Send>(&self, i: usize, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/var/run/netns/{}", self.names[i]);
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = std::fs::File::open(&path).expect("namespace file");
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
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// One captured IPv4 packet (from the IP header on) and whether it was outgoing.
#[derive(Clone, Debug)]
pub struct Frame {
    pub outgoing: bool,
    pub ip: Vec<u8>,
}

/// An AF_PACKET capture of the IPv4 packets of one interface, read by a thread of its own.
pub struct Sniffer {
    stop: Arc<AtomicBool>,
    frames: Arc<Mutex<Vec<Frame>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sniffer {
    /// Starts capturing on `dev`; call from a thread inside the interface's namespace.
    pub fn start(dev: &str) -> Self {
        // ETH_P_ALL: a socket of one protocol is not shown outgoing frames
        let eth_p_all = (libc::ETH_P_ALL as u16).to_be();
        let eth_p_ip = (libc::ETH_P_IP as u16).to_be();
        // SAFETY: plain socket creation; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM, eth_p_all as i32) };
        assert!(fd >= 0, "AF_PACKET: {}", std::io::Error::last_os_error());
        // SAFETY: fd is a fresh socket this function owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let name = std::ffi::CString::new(dev).unwrap();
        // SAFETY: name is a NUL-terminated string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert!(ifindex != 0, "no interface {dev}");
        // SAFETY: sockaddr_ll is plain data; zeroed is valid.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = eth_p_all;
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: sll is a live sockaddr_ll whose size is passed along.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, 0, "bind AF_PACKET: {}", std::io::Error::last_os_error());
        let big: libc::c_int = 64 << 20;
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 20_000,
        };
        // SAFETY: option values are live locals of the sizes passed.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                &big as *const libc::c_int as *const libc::c_void,
                4,
            );
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const libc::timeval as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            );
        }
        let stop = Arc::new(AtomicBool::new(false));
        let frames = Arc::new(Mutex::new(Vec::new()));
        let (s, f) = (stop.clone(), frames.clone());
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 17];
            // drain what is queued after the stop too
            let mut idle_after_stop = 0;
            while idle_after_stop < 2 {
                // SAFETY: sockaddr_ll is plain data.
                let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
                // SAFETY: buf and from are live and their sizes passed along.
                let n = unsafe {
                    libc::recvfrom(
                        fd.as_raw_fd(),
                        buf.as_mut_ptr() as *mut libc::c_void,
                        buf.len(),
                        0,
                        &mut from as *mut libc::sockaddr_ll as *mut libc::sockaddr,
                        &mut len,
                    )
                };
                if n < 0 {
                    if s.load(Ordering::Acquire) {
                        idle_after_stop += 1;
                    }
                    continue;
                }
                if from.sll_protocol != eth_p_ip {
                    continue;
                }
                f.lock().unwrap().push(Frame {
                    outgoing: from.sll_pkttype == libc::PACKET_OUTGOING,
                    ip: buf[..n as usize].to_vec(),
                });
            }
        });
        Self {
            stop,
            frames,
            thread: Some(thread),
        }
    }

    /// Stops the capture (after what is queued has been read) and returns the frames.
    pub fn finish(mut self) -> Vec<Frame> {
        std::thread::sleep(Duration::from_millis(50));
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.join().expect("capture thread");
        }
        std::mem::take(&mut *self.frames.lock().unwrap())
    }
}

impl Drop for Sniffer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// CRC-32 (IEEE 802.3, reflected, as zlib's), table-driven; the tests' own, independent of
/// the soft NIC's.
pub fn crc32(parts: &[&[u8]]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let t = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xedb8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    let mut c = !0u32;
    for p in parts {
        for &b in *p {
            c = t[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
        }
    }
    !c
}

/// The ICRC of a RoCEv2-over-IPv4 packet as it is on the wire (`ip`: the IPv4 header
/// through the ICRC), by the IBTA rule: CRC-32 over 8 bytes of 0xFF, the IPv4 header with
/// TOS, TTL and header checksum all ones, the UDP header with checksum all ones, the BTH with
/// its byte 4 (FECN, BECN, reserved) all ones, and the rest up to the ICRC. Returns (computed,
/// the ICRC the frame carries), or `None` when the frame is too short.
pub fn wire_icrc(ip: &[u8]) -> Option<(u32, u32)> {
    let ihl = (ip.first()? & 0xf) as usize * 4;
    if ip.len() < ihl + 8 + 12 + 4 {
        return None;
    }
    let mut iph = ip[..ihl].to_vec();
    iph[1] = 0xff;
    iph[8] = 0xff;
    iph[10] = 0xff;
    iph[11] = 0xff;
    let mut udp = ip[ihl..ihl + 8].to_vec();
    udp[6] = 0xff;
    udp[7] = 0xff;
    let payload = &ip[ihl + 8..];
    let mut bth = payload[..12].to_vec();
    bth[4] = 0xff;
    let rest = &payload[12..payload.len() - 4];
    let got = u32::from_le_bytes(payload[payload.len() - 4..].try_into().ok()?);
    Some((crc32(&[&[0xff; 8], &iph, &udp, &bth, rest]), got))
}
