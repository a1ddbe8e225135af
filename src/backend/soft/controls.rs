//! The soft NIC types a user of the soft device needs, re-exported from `softnic`:
//! soft-NIC-only controls, for the soft backend
//! ([`Context::soft_device`](crate::Context::soft_device) returns its device): opening one with
//! explicit settings ([`Context::open_soft`](crate::Context::open_soft)), fault injection,
//! engine and wire counters, packet capture, the RoCE MTU of a route. Nothing here applies to a
//! ConnectX.

pub use softnic::pcap::PcapWriter;
/// The RoCEv2 formats the soft NIC speaks on the wire (BTH and the extended headers, the
/// ICRC): for reading back what `--pcap` or [`Capture`] wrote.
pub use softnic::wire::packet;
pub use softnic::wire::{roce_mtu, route_mtu};
pub use softnic::{
    Capture, CounterSnapshot, Device, DeviceConfig, Error, Fault, Gid, WireConfig, WireCounters,
    WireFaults,
};

/// The soft NIC's own objects, driven without the host API (its PDs, CQs, QPs and DMA buffers,
/// and the ring geometry a CPU initiator is built over): for measuring the soft NIC's engine
/// itself, as `softnic_bench` does. A program on the host API does not need them.
pub mod raw {
    pub use softnic::initiator::{CqGeometry, CqPoller, RqGeometry, SoftQpInitiator, SqGeometry};
    pub use softnic::{
        Access, Cq, CqConfig, CqMode, DmaBuf, DoorbellMode, Modify, MrInfo, PdId, Qp, QpConfig,
        QpState, RtrAttr, RtsAttr,
    };
}
