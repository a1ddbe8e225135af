//! Where a soft NIC's wire port is: [`SOFTNIC_ADDR_ENV`] and its parser.

use crate::Error;
use std::net::{IpAddr, SocketAddr};

/// RoCEv2's UDP port: where a peer whose [`Endpoint`](crate::Endpoint) carries no `udp_port` listens.
pub const ROCE_UDP_PORT: u16 = 4791;

/// Environment variable that gives soft NICs opened by [`Context::open`](crate::Context::open) and
/// [`Context::open_wire`](crate::Context::open_wire) a wire port: `ip:port` (port 0: the system picks one) or `ip` (port
/// 4791). The IP is an IPv4 address of this host; the device's GID is its IPv4-mapped form.
pub const SOFTNIC_ADDR_ENV: &str = "GPUVERBS_SOFTNIC_ADDR";

/// Parses a [`SOFTNIC_ADDR_ENV`] value: `ip:port`, or `ip` alone for RoCEv2's port 4791.
pub fn parse_softnic_addr(v: &str) -> Result<SocketAddr, Error> {
    let v = v.trim();
    let addr = v
        .parse::<SocketAddr>()
        .or_else(|_| {
            v.parse::<IpAddr>()
                .map(|ip| SocketAddr::from((ip, ROCE_UDP_PORT)))
        })
        .map_err(|_| {
            Error::InvalidArgument(format!(
                "{SOFTNIC_ADDR_ENV}={v:?} is not an IPv4 address with an optional port \
                 (e.g. 10.0.0.1:4791, 127.0.0.1:0)"
            ))
        })?;
    if !addr.is_ipv4() {
        return Err(Error::InvalidArgument(format!(
            "{SOFTNIC_ADDR_ENV}={v:?}: the soft NIC's wire speaks IPv4 only"
        )));
    }
    Ok(addr)
}
