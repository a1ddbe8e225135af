//! Port GIDs.

/// A 16-byte port GID (IPv4-mapped for soft devices: `::ffff:a.b.c.d`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The IPv4-mapped GID of an address.
    pub fn from_ipv4(a: std::net::Ipv4Addr) -> Self {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&a.octets());
        Self(g)
    }

    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn to_ipv4(&self) -> Option<std::net::Ipv4Addr> {
        let g = &self.0;
        (g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff)
            .then(|| std::net::Ipv4Addr::new(g[12], g[13], g[14], g[15]))
    }
}

impl std::fmt::Display for Gid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", std::net::Ipv6Addr::from(self.0))
    }
}
