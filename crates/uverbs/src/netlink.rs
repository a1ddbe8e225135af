//! The RDMA netlink socket (`NETLINK_RDMA`, the kernel's `nldev` client) answered for the
//! emulated devices: what iproute2's `rdma` asks (`dev`, `link`, `resource`, `statistic` show)
//! and what libibverbs asks when it finds its devices through netlink (the device dump, then
//! the `uverbs` character device of each).
//!
//! Requests and answers are netlink messages (`nlmsghdr`, then `nlattr`s with no family header,
//! native byte order), as `drivers/infiniband/core/nldev.c` writes them: a dump answers one
//! message per object flagged `NLM_F_MULTI` and ends with `NLMSG_DONE`; a get answers one
//! message, then an acknowledgement when the request asked for one; what is not served is an
//! `NLMSG_ERROR` with the errno the kernel gives. Attribute and command numbers are those of
//! `<rdma/rdma_netlink.h>`.

/// `NETLINK_RDMA`, the protocol of `socket(AF_NETLINK, …, NETLINK_RDMA)`.
pub const NETLINK_RDMA: i32 = 20;
/// `RDMA_NL_NLDEV`, the client of every message served here.
const NLDEV: u16 = 5;

/// `RDMA_NLDEV_CMD_*`.
mod cmd {
    pub const GET: u16 = 1;
    pub const PORT_GET: u16 = 5;
    pub const SYS_GET: u16 = 6;
    pub const RES_GET: u16 = 9;
    pub const GET_CHARDEV: u16 = 15;
    pub const STAT_GET: u16 = 17;
}

/// `RDMA_NLDEV_ATTR_*` (and `RDMA_NLDEV_SYS_ATTR_*`; 68 is `RDMA_NLDEV_NET_NS_FD`).
mod attr {
    pub const DEV_INDEX: u16 = 1;
    pub const DEV_NAME: u16 = 2;
    pub const PORT_INDEX: u16 = 3;
    pub const CAP_FLAGS: u16 = 4;
    pub const FW_VERSION: u16 = 5;
    pub const NODE_GUID: u16 = 6;
    pub const SYS_IMAGE_GUID: u16 = 7;
    pub const PORT_STATE: u16 = 12;
    pub const PORT_PHYS_STATE: u16 = 13;
    pub const DEV_NODE_TYPE: u16 = 14;
    pub const RES_SUMMARY: u16 = 15;
    pub const RES_SUMMARY_ENTRY: u16 = 16;
    pub const RES_SUMMARY_ENTRY_NAME: u16 = 17;
    pub const RES_SUMMARY_ENTRY_CURR: u16 = 18;
    pub const NDEV_INDEX: u16 = 50;
    pub const NDEV_NAME: u16 = 51;
    pub const SYS_NETNS_MODE: u16 = 66;
    pub const DEV_PROTOCOL: u16 = 67;
    pub const CHARDEV_TYPE: u16 = 69;
    pub const CHARDEV_NAME: u16 = 70;
    pub const CHARDEV_ABI: u16 = 71;
    pub const CHARDEV: u16 = 72;
    pub const UVERBS_DRIVER_ID: u16 = 73;
    pub const STAT_HWCOUNTERS: u16 = 80;
    pub const STAT_HWCOUNTER_ENTRY: u16 = 81;
    pub const STAT_HWCOUNTER_ENTRY_NAME: u16 = 82;
    pub const STAT_HWCOUNTER_ENTRY_VALUE: u16 = 83;
}

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_MULTI: u16 = 0x2;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
/// The error message carries the request's header only.
const NLM_F_CAPPED: u16 = 0x100;
/// `RDMA_NODE_IB_CA`.
const NODE_TYPE_CA: u8 = 1;
/// `RDMA_DRIVER_MLX5`.
const DRIVER_MLX5: u32 = 1;
/// The largest datagram one read gets: answers are cut at message boundaries to fit a page,
/// as the kernel fills a dump's buffers.
const DATAGRAM: usize = 4096;

/// What one emulated device shows through netlink (one port).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NlDevice {
    /// Index (`RDMA_NLDEV_ATTR_DEV_INDEX`), the `N` of `uverbsN`.
    pub index: u32,
    pub name: String,
    pub node_guid: u64,
    pub fw_version: String,
    /// The uverbs character device, `(major, minor)`.
    pub cdev: (u32, u32),
    /// The driver's uverbs ABI version (`uverbsN/abi_version`).
    pub abi: u64,
    /// Port 1: its capability flags, state and physical state as QUERY_PORT gives them, and
    /// its network device.
    pub port_cap_flags: u64,
    pub port_state: u8,
    pub port_phys_state: u8,
    pub netdev: (u32, String),
    /// Objects of this process on the device, by the kernel's resource names.
    pub resources: Vec<(&'static str, u64)>,
    /// The device's counters, by the soft NIC's names.
    pub counters: Vec<(String, u64)>,
}

/// The answer to one datagram a program sent: the datagrams it then reads, in order.
pub fn answer(request: &[u8], portid: u32, devices: &[NlDevice]) -> Vec<Vec<u8>> {
    let mut out = Replies::default();
    let mut rest = request;
    while rest.len() >= NLMSG_HDRLEN {
        let hdr = Header::parse(rest);
        let len = hdr.len as usize;
        if len < NLMSG_HDRLEN || len > rest.len() {
            break;
        }
        let attrs = Attrs(&rest[NLMSG_HDRLEN..len]);
        answer_one(&hdr, &attrs, portid, devices, &mut out);
        rest = &rest[align(len).min(rest.len())..];
    }
    out.datagrams()
}

fn answer_one(hdr: &Header, a: &Attrs, portid: u32, devs: &[NlDevice], out: &mut Replies) {
    let (client, op) = (hdr.ty >> 10, hdr.ty & 0x3ff);
    let dump = hdr.flags & NLM_F_DUMP == NLM_F_DUMP;
    let reply = Reply { hdr, portid, dump };
    let r = if client != NLDEV {
        Err(libc::EOPNOTSUPP)
    } else {
        let chosen = |need_index: bool| -> Result<Vec<&NlDevice>, i32> {
            match a.u32(attr::DEV_INDEX) {
                Some(i) => devs
                    .iter()
                    .find(|d| d.index == i)
                    .map(|d| vec![d])
                    .ok_or(libc::EINVAL),
                None if need_index => Err(libc::EINVAL),
                None => Ok(devs.iter().collect()),
            }
        };
        let port_ok = || a.u32(attr::PORT_INDEX).is_none_or(|p| p == 1);
        match op {
            cmd::GET => chosen(!dump).map(|ds| {
                for d in ds {
                    out.push(reply.msg(|m| fill_dev(m, d)));
                }
            }),
            cmd::PORT_GET if port_ok() => {
                chosen(!dump || a.u32(attr::PORT_INDEX).is_some()).map(|ds| {
                    for d in ds {
                        out.push(reply.msg(|m| fill_port(m, d)));
                    }
                })
            }
            cmd::RES_GET => chosen(!dump).map(|ds| {
                for d in ds {
                    out.push(reply.msg(|m| fill_res(m, d)));
                }
            }),
            cmd::STAT_GET if port_ok() => chosen(!dump).map(|ds| {
                for d in ds {
                    out.push(reply.msg(|m| fill_stat(m, d)));
                }
            }),
            cmd::SYS_GET => {
                out.push(reply.msg(|m| m.u8(attr::SYS_NETNS_MODE, 1)));
                Ok(())
            }
            cmd::GET_CHARDEV => match (chosen(true), a.str(attr::CHARDEV_TYPE)) {
                // the connection manager's device is global: asked without a device (as
                // librdmacm asks), the emulated one; asked for a device's, none (ucma has no
                // per-device node)
                (_, Some(b"rdma_cm")) if a.u32(attr::DEV_INDEX).is_none() => {
                    out.push(reply.msg(fill_rdma_cm));
                    Ok(())
                }
                (Ok(ds), Some(b"uverbs")) => {
                    out.push(reply.msg(|m| fill_chardev(m, ds[0])));
                    Ok(())
                }
                (Err(e), _) => Err(e),
                // another client's device (rdma_cm, umad): none here
                (Ok(_), _) => Err(libc::EOPNOTSUPP),
            },
            cmd::PORT_GET | cmd::STAT_GET => Err(libc::EINVAL),
            _ => Err(libc::EOPNOTSUPP),
        }
    };
    match r {
        Err(e) => out.push(error(hdr, portid, -e)),
        Ok(()) if dump => {
            let mut m = Msg::new(NLMSG_DONE, NLM_F_MULTI, hdr.seq, portid);
            m.raw(&0i32.to_ne_bytes());
            out.push(m.finish());
        }
        Ok(()) if hdr.flags & NLM_F_ACK != 0 => out.push(error(hdr, portid, 0)),
        Ok(()) => {}
    }
}

fn fill_dev(m: &mut Msg, d: &NlDevice) {
    m.u32(attr::DEV_INDEX, d.index);
    m.str(attr::DEV_NAME, &d.name);
    m.u32(attr::PORT_INDEX, 1);
    // IB_DEVICE_* flags: none the tools print
    m.u64(attr::CAP_FLAGS, 0);
    m.str(attr::FW_VERSION, &d.fw_version);
    // the GUID's value (be64_to_cpu of what the device reports), as sysfs prints it
    m.u64(attr::NODE_GUID, d.node_guid);
    m.u64(attr::SYS_IMAGE_GUID, d.node_guid);
    m.u8(attr::DEV_NODE_TYPE, NODE_TYPE_CA);
    m.str(attr::DEV_PROTOCOL, "roce");
}

fn fill_port(m: &mut Msg, d: &NlDevice) {
    m.u32(attr::DEV_INDEX, d.index);
    m.str(attr::DEV_NAME, &d.name);
    m.u32(attr::PORT_INDEX, 1);
    m.u64(attr::CAP_FLAGS, d.port_cap_flags);
    // (no subnet prefix, LID, SM LID or LMC: the port is RoCE)
    m.u8(attr::PORT_STATE, d.port_state);
    m.u8(attr::PORT_PHYS_STATE, d.port_phys_state);
    m.u32(attr::NDEV_INDEX, d.netdev.0);
    m.str(attr::NDEV_NAME, &d.netdev.1);
}

fn fill_res(m: &mut Msg, d: &NlDevice) {
    m.u32(attr::DEV_INDEX, d.index);
    m.str(attr::DEV_NAME, &d.name);
    named_u64s(
        m,
        [
            attr::RES_SUMMARY,
            attr::RES_SUMMARY_ENTRY,
            attr::RES_SUMMARY_ENTRY_NAME,
            attr::RES_SUMMARY_ENTRY_CURR,
        ],
        &d.resources,
    );
}

fn fill_stat(m: &mut Msg, d: &NlDevice) {
    m.u32(attr::DEV_INDEX, d.index);
    m.str(attr::DEV_NAME, &d.name);
    m.u32(attr::PORT_INDEX, 1);
    named_u64s(
        m,
        [
            attr::STAT_HWCOUNTERS,
            attr::STAT_HWCOUNTER_ENTRY,
            attr::STAT_HWCOUNTER_ENTRY_NAME,
            attr::STAT_HWCOUNTER_ENTRY_VALUE,
        ],
        &d.counters,
    );
}

/// A table of named numbers as nldev nests them: `[table, entry, name, value]` attribute
/// types, one entry (a name and a u64) per item.
fn named_u64s<N: AsRef<str>>(
    m: &mut Msg,
    [table, entry, name, value]: [u16; 4],
    items: &[(N, u64)],
) {
    m.nest(table, |m| {
        for (n, v) in items {
            m.nest(entry, |m| {
                m.str(name, n.as_ref());
                m.u64(value, *v);
            });
        }
    });
}

/// The kernel's `huge_encode_dev` of a device number.
fn huge_encode_dev((major, minor): (u32, u32)) -> u64 {
    (minor as u64 & 0xff) | ((major as u64 & 0xfff) << 8) | ((minor as u64 & !0xff) << 12)
}

fn fill_rdma_cm(m: &mut Msg) {
    m.u64(attr::CHARDEV, huge_encode_dev(crate::config::RDMA_CM_RDEV));
    m.u64(attr::CHARDEV_ABI, crate::config::RDMA_CM_ABI);
    m.str(attr::CHARDEV_NAME, "rdma_cm");
}

fn fill_chardev(m: &mut Msg, d: &NlDevice) {
    m.u64(attr::CHARDEV, huge_encode_dev(d.cdev));
    m.u64(attr::CHARDEV_ABI, d.abi);
    m.str(attr::CHARDEV_NAME, &format!("uverbs{}", d.index));
    m.u32(attr::UVERBS_DRIVER_ID, DRIVER_MLX5);
}

/// An `NLMSG_ERROR` answering `hdr` with `err` (a negative errno, or 0: an acknowledgement).
fn error(hdr: &Header, portid: u32, err: i32) -> Vec<u8> {
    let mut m = Msg::new(NLMSG_ERROR, NLM_F_CAPPED, hdr.seq, portid);
    m.raw(&err.to_ne_bytes());
    m.raw(&hdr.bytes());
    m.finish()
}

fn align(n: usize) -> usize {
    (n + 3) & !3
}

/// A request's header.
struct Header {
    len: u32,
    ty: u16,
    flags: u16,
    seq: u32,
    pid: u32,
}

impl Header {
    fn parse(b: &[u8]) -> Self {
        let u32_at = |o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().unwrap_or_default());
        let u16_at = |o: usize| u16::from_ne_bytes(b[o..o + 2].try_into().unwrap_or_default());
        Self {
            len: u32_at(0),
            ty: u16_at(4),
            flags: u16_at(6),
            seq: u32_at(8),
            pid: u32_at(12),
        }
    }
    fn bytes(&self) -> [u8; NLMSG_HDRLEN] {
        let mut b = [0u8; NLMSG_HDRLEN];
        b[0..4].copy_from_slice(&self.len.to_ne_bytes());
        b[4..6].copy_from_slice(&self.ty.to_ne_bytes());
        b[6..8].copy_from_slice(&self.flags.to_ne_bytes());
        b[8..12].copy_from_slice(&self.seq.to_ne_bytes());
        b[12..16].copy_from_slice(&self.pid.to_ne_bytes());
        b
    }
}

/// A request's attributes.
struct Attrs<'a>(&'a [u8]);

impl<'a> Attrs<'a> {
    /// The payload of the first attribute of type `ty`.
    fn get(&self, ty: u16) -> Option<&'a [u8]> {
        let mut rest = self.0;
        while rest.len() >= 4 {
            let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
            let t = u16::from_ne_bytes([rest[2], rest[3]]) & 0x3fff;
            if len < 4 || len > rest.len() {
                return None;
            }
            if t == ty {
                return Some(&rest[4..len]);
            }
            rest = &rest[align(len).min(rest.len())..];
        }
        None
    }
    fn u32(&self, ty: u16) -> Option<u32> {
        let p = self.get(ty)?;
        Some(u32::from_ne_bytes(p.get(..4)?.try_into().ok()?))
    }
    /// A string attribute without its terminating NUL.
    fn str(&self, ty: u16) -> Option<&'a [u8]> {
        let p = self.get(ty)?;
        Some(p.split(|&c| c == 0).next().unwrap_or(p))
    }
}

/// How one request's answers are addressed.
struct Reply<'a> {
    hdr: &'a Header,
    portid: u32,
    dump: bool,
}

impl Reply<'_> {
    /// One answer message of the request's type, filled by `f`.
    fn msg(&self, f: impl FnOnce(&mut Msg)) -> Vec<u8> {
        let flags = if self.dump { NLM_F_MULTI } else { 0 };
        let mut m = Msg::new(self.hdr.ty, flags, self.hdr.seq, self.portid);
        f(&mut m);
        m.finish()
    }
}

/// One netlink message being written.
struct Msg(Vec<u8>);

impl Msg {
    fn new(ty: u16, flags: u16, seq: u32, pid: u32) -> Self {
        let h = Header {
            len: 0,
            ty,
            flags,
            seq,
            pid,
        };
        Self(h.bytes().to_vec())
    }
    fn raw(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn attr(&mut self, ty: u16, payload: &[u8]) {
        let len = 4 + payload.len();
        self.0.extend_from_slice(&(len as u16).to_ne_bytes());
        self.0.extend_from_slice(&ty.to_ne_bytes());
        self.0.extend_from_slice(payload);
        self.0.resize(align(self.0.len()), 0);
    }
    fn u8(&mut self, ty: u16, v: u8) {
        self.attr(ty, &[v]);
    }
    fn u32(&mut self, ty: u16, v: u32) {
        self.attr(ty, &v.to_ne_bytes());
    }
    fn u64(&mut self, ty: u16, v: u64) {
        self.attr(ty, &v.to_ne_bytes());
    }
    fn str(&mut self, ty: u16, s: &str) {
        let mut b = s.as_bytes().to_vec();
        b.push(0);
        self.attr(ty, &b);
    }
    /// A nested attribute holding what `f` writes.
    fn nest(&mut self, ty: u16, f: impl FnOnce(&mut Self)) {
        let start = self.0.len();
        self.attr(ty, &[]);
        f(self);
        let len = (self.0.len() - start) as u16;
        self.0[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }
    fn finish(mut self) -> Vec<u8> {
        let len = self.0.len() as u32;
        self.0[0..4].copy_from_slice(&len.to_ne_bytes());
        self.0
    }
}

/// Answer messages, packed into datagrams of at most [`DATAGRAM`] bytes (a message larger than
/// that goes alone).
#[derive(Default)]
struct Replies(Vec<Vec<u8>>);

impl Replies {
    fn push(&mut self, m: Vec<u8>) {
        match self.0.last_mut() {
            Some(d) if d.len() + m.len() <= DATAGRAM => d.extend_from_slice(&m),
            _ => self.0.push(m),
        }
    }
    fn datagrams(self) -> Vec<Vec<u8>> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(index: u32) -> NlDevice {
        NlDevice {
            index,
            name: format!("mlx5_{index}"),
            node_guid: 0x0002_c903_0000_0000 + index as u64,
            fw_version: "0.1.0".into(),
            cdev: (231, 192 + index),
            abi: 1,
            port_cap_flags: 0x0401_0000,
            port_state: 4,
            port_phys_state: 5,
            netdev: (1, "lo".into()),
            resources: vec![("pd", 2), ("qp", 3)],
            counters: vec![("wqes_executed".into(), 7)],
        }
    }

    fn request(op: u16, flags: u16, seq: u32, attrs: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut m = Msg::new((NLDEV << 10) | op, 1 | flags, seq, 0);
        for (t, p) in attrs {
            m.attr(*t, p);
        }
        m.finish()
    }

    /// Every message of the answer: (type, flags, seq, pid, attributes).
    fn messages(dgrams: &[Vec<u8>]) -> Vec<(u16, u16, u32, u32, Vec<u8>)> {
        let mut v = Vec::new();
        for d in dgrams {
            let mut rest = &d[..];
            while rest.len() >= NLMSG_HDRLEN {
                let h = Header::parse(rest);
                let len = h.len as usize;
                assert!(len >= NLMSG_HDRLEN && len <= rest.len(), "bad length {len}");
                v.push((
                    h.ty,
                    h.flags,
                    h.seq,
                    h.pid,
                    rest[NLMSG_HDRLEN..len].to_vec(),
                ));
                rest = &rest[align(len).min(rest.len())..];
            }
        }
        v
    }

    #[test]
    fn a_device_dump_names_every_device_then_ends() {
        let devs = [dev(0), dev(1)];
        let ans = answer(&request(cmd::GET, NLM_F_DUMP, 7, &[]), 42, &devs);
        let msgs = messages(&ans);
        assert_eq!(msgs.len(), 3);
        for (k, (ty, flags, seq, pid, body)) in msgs[..2].iter().enumerate() {
            assert_eq!(*ty, (NLDEV << 10) | cmd::GET);
            assert_eq!((*flags & NLM_F_MULTI, *seq, *pid), (NLM_F_MULTI, 7, 42));
            let a = Attrs(body);
            assert_eq!(a.u32(attr::DEV_INDEX), Some(k as u32));
            assert_eq!(a.str(attr::DEV_NAME), Some(format!("mlx5_{k}").as_bytes()));
            assert_eq!(a.u32(attr::PORT_INDEX), Some(1));
            assert_eq!(a.get(attr::DEV_NODE_TYPE), Some(&[NODE_TYPE_CA][..]));
            let guid = u64::from_ne_bytes(a.get(attr::NODE_GUID).unwrap().try_into().unwrap());
            assert_eq!(guid, devs[k].node_guid);
        }
        assert_eq!(msgs[2].0, NLMSG_DONE);
    }

    #[test]
    fn the_uverbs_chardev_is_the_emulated_device_file() {
        let ans = answer(
            &request(
                cmd::GET_CHARDEV,
                0,
                3,
                &[
                    (attr::DEV_INDEX, 1u32.to_ne_bytes().to_vec()),
                    (attr::CHARDEV_TYPE, b"uverbs\0".to_vec()),
                ],
            ),
            9,
            &[dev(0), dev(1)],
        );
        let msgs = messages(&ans);
        assert_eq!(msgs.len(), 1);
        let a = Attrs(&msgs[0].4);
        assert_eq!(a.str(attr::CHARDEV_NAME), Some(&b"uverbs1"[..]));
        let cdev = u64::from_ne_bytes(a.get(attr::CHARDEV).unwrap().try_into().unwrap());
        // libibverbs' decoding of huge_encode_dev
        let (major, minor) = (
            (cdev & 0xfff00) >> 8,
            (cdev & 0xff) | ((cdev >> 12) & 0xfff00),
        );
        assert_eq!((major, minor), (231, 193));
        assert_eq!(a.u32(attr::UVERBS_DRIVER_ID), Some(DRIVER_MLX5));
    }

    #[test]
    fn what_is_not_served_is_an_error_with_the_kernels_errno() {
        let devs = [dev(0)];
        let cases = [
            // a get without a device index
            (request(cmd::GET, NLM_F_ACK, 1, &[]), -libc::EINVAL),
            // no such device
            (
                request(
                    cmd::GET,
                    0,
                    2,
                    &[(attr::DEV_INDEX, 5u32.to_ne_bytes().to_vec())],
                ),
                -libc::EINVAL,
            ),
            // the rdma_cm chardev
            (
                request(
                    cmd::GET_CHARDEV,
                    0,
                    3,
                    &[
                        (attr::DEV_INDEX, 0u32.to_ne_bytes().to_vec()),
                        (attr::CHARDEV_TYPE, b"rdma_cm\0".to_vec()),
                    ],
                ),
                -libc::EOPNOTSUPP,
            ),
            // a command that is not served (NEWLINK)
            (request(3, 0, 4, &[]), -libc::EOPNOTSUPP),
            // port 2 of a one-port device
            (
                request(
                    cmd::PORT_GET,
                    0,
                    5,
                    &[
                        (attr::DEV_INDEX, 0u32.to_ne_bytes().to_vec()),
                        (attr::PORT_INDEX, 2u32.to_ne_bytes().to_vec()),
                    ],
                ),
                -libc::EINVAL,
            ),
        ];
        for (req, err) in cases {
            let msgs = messages(&answer(&req, 1, &devs));
            assert_eq!(msgs.len(), 1, "{req:?}");
            assert_eq!(msgs[0].0, NLMSG_ERROR);
            assert_eq!(i32::from_ne_bytes(msgs[0].4[..4].try_into().unwrap()), err);
            assert_eq!(
                &msgs[0].4[4..20],
                &req[..16],
                "the request's header follows"
            );
        }
    }

    #[test]
    fn a_get_with_ack_is_answered_then_acknowledged_and_summaries_nest() {
        let msgs = messages(&answer(
            &request(
                cmd::RES_GET,
                NLM_F_ACK,
                11,
                &[(attr::DEV_INDEX, 0u32.to_ne_bytes().to_vec())],
            ),
            5,
            &[dev(0)],
        ));
        assert_eq!(msgs.len(), 2);
        assert_eq!(msgs[1].0, NLMSG_ERROR);
        assert_eq!(&msgs[1].4[..4], &0i32.to_ne_bytes());
        let summary = Attrs(&msgs[0].4).get(attr::RES_SUMMARY).unwrap().to_vec();
        let mut names = Vec::new();
        let mut rest = &summary[..];
        while rest.len() >= 4 {
            let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
            let e = Attrs(&rest[4..len]);
            let n = u64::from_ne_bytes(
                e.get(attr::RES_SUMMARY_ENTRY_CURR)
                    .unwrap()
                    .try_into()
                    .unwrap(),
            );
            names.push((
                String::from_utf8(e.str(attr::RES_SUMMARY_ENTRY_NAME).unwrap().to_vec()).unwrap(),
                n,
            ));
            rest = &rest[align(len)..];
        }
        assert_eq!(names, [("pd".to_string(), 2), ("qp".to_string(), 3)]);
    }

    #[test]
    fn a_long_dump_is_cut_into_page_sized_datagrams_at_message_boundaries() {
        let devs: Vec<_> = (0..64).map(dev).collect();
        let ans = answer(&request(cmd::PORT_GET, NLM_F_DUMP, 1, &[]), 1, &devs);
        assert!(ans.len() > 1);
        assert!(ans.iter().all(|d| d.len() <= DATAGRAM));
        let msgs = messages(&ans);
        assert_eq!(msgs.len(), 65);
        assert_eq!(msgs.last().unwrap().0, NLMSG_DONE);
    }

    #[test]
    fn bytes_that_are_not_a_message_get_no_answer_and_no_panic() {
        for junk in [
            &b""[..],
            &[1, 2, 3],
            &[0xff; 16],
            &[16, 0, 0, 0, 0xff, 0xff, 0, 0],
        ] {
            let _ = answer(junk, 1, &[dev(0)]);
        }
        let mut short_attr = request(cmd::GET, 0, 1, &[(attr::DEV_INDEX, vec![1])]);
        short_attr.truncate(short_attr.len());
        let msgs = messages(&answer(&short_attr, 1, &[dev(0)]));
        assert_eq!(msgs[0].0, NLMSG_ERROR);
    }
}
