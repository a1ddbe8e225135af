//! The soft NIC's room: the soft NIC behind the seam ([`ops`]), the controls a user of the soft
//! device has ([`controls`], the crate's `soft` module), its wire port's address ([`addr`]), and
//! the soft devices of this process and the peer-table routes a context adds for its QPs
//! ([`route`]).

mod addr;
pub mod controls;
mod ops;
mod route;

pub use addr::{parse_softnic_addr, ROCE_UDP_PORT, SOFTNIC_ADDR_ENV};
pub(crate) use ops::{cq_of, device_of, qp_of, SoftDevice};
pub(crate) use route::register;
