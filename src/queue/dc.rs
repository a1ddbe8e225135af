//! Dynamically connected transport: DC targets ([`Dct`]) that any initiator presenting their
//! key reaches, DC initiators (a [`Qp`] made by [`Pd::create_dci`], in RTS at once) whose WQEs
//! each name their target, and the [`DcTarget`] a target hands to its initiators, with the
//! address vector a WQE carries ([`DcTarget::address_vector`]).
//!
//! A DC target here takes RDMA WRITE, READ and atomics; it has no receive queue of the host
//! API's, so a SEND to it ends in RNR (the initiator's `rnr_retry` decides).

use super::cq::Cq;
use super::qp::{Qp, QpOptions};
use super::ring::resolve;
use crate::backend::seam::{DctOps, DctSpec, GpuRings, QpSpec};
use crate::backend::ConnectOptions;
use crate::endpoint::Gid;
use crate::gpu::Gpu;
use crate::memory::Pd;
use crate::Error;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use verbs::{Access, QpState};

/// Parameters of a DC target.
#[derive(Clone, Copy, Debug)]
pub struct DctOptions {
    /// The DC access key initiators must present (a capability: who knows it reaches the
    /// target's memory that its rights allow).
    pub key: u64,
    /// The remote rights initiators get; REMOTE_WRITE, REMOTE_READ and REMOTE_ATOMIC by
    /// default.
    pub access: Access,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
}

impl DctOptions {
    /// A target with key `key` and every remote right.
    pub fn new(key: u64) -> Self {
        Self {
            key,
            access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            min_rnr_timer: 1,
        }
    }
}

/// A DC target. Dropping it destroys the device's target (initiators then get no answer).
#[derive(Debug)]
pub struct Dct {
    pd: Pd,
    _cq: Cq,
    dev: Arc<dyn DctOps>,
    key: u64,
}

impl Drop for Dct {
    fn drop(&mut self) {
        self.dev.destroy();
    }
}

/// What an initiator needs to reach a DC target: its device's GID, its number, its key, the
/// path MTU, and the UDP port of a soft NIC on the wire. Made only by [`Dct::target`] (the key
/// travels on purpose), or decoded from what a target's owner sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DcTarget {
    /// The target device's GID.
    pub gid: Gid,
    /// The target's number (DCTN).
    pub dctn: u32,
    /// Its DC access key.
    pub key: u64,
    /// Its path MTU (bytes).
    pub mtu: u32,
    /// The UDP port its soft NIC listens on (at the GID's address); `None`: the RoCE v2
    /// default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_port: Option<u16>,
}

impl DcTarget {
    /// The 48-byte address vector a DC initiator's WQE carries after its control segment
    /// (CPU: `CpuInitiator::post_with_av`).
    pub fn address_vector(&self) -> prm::wqe::DatagramSeg {
        prm::wqe::DatagramSeg::dc(self.dctn, self.key, self.gid.0)
    }
}

impl Dct {
    /// Its number (what initiators name).
    pub fn number(&self) -> u32 {
        self.dev.number()
    }
    /// Its DC access key.
    pub fn key(&self) -> u64 {
        self.key
    }
    /// Its state (RTR while it serves).
    pub fn state(&self) -> QpState {
        self.dev.state()
    }
    /// The protection domain whose memory it reaches.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }
    /// What initiators need to reach it, its key included.
    pub fn target(&self) -> DcTarget {
        DcTarget {
            gid: self.pd.ctx.gid().into(),
            dctn: self.number(),
            key: self.key,
            mtu: self.pd.ctx.mtu(),
            udp_port: self.pd.ctx.udp_port(),
        }
    }
}

impl Pd {
    /// Creates a DC target on this PD, completing on `cq`, serving at once.
    pub fn create_dct(&self, cq: &Cq, o: DctOptions) -> Result<Dct, Error> {
        let spec = DctSpec {
            cq: &cq.dev,
            key: o.key,
            access: o.access,
            mtu: self.ctx.mtu(),
            min_rnr_timer: o.min_rnr_timer,
        };
        let dev = self.dev.create_dct(&spec)?;
        tracing::debug!(dctn = dev.number(), "DC target created");
        Ok(Dct {
            pd: self.clone(),
            _cq: cq.clone(),
            dev,
            key: o.key,
        })
    }

    /// Creates a DC initiator on `o.send_cq` (no receive side: `o.recv_cq` and the RQ sizes
    /// are not used), its rings in host memory, and brings it to RTS with `c`'s timers and
    /// retry counts (`c.access` is not used: an initiator grants nothing). Each WQE names its
    /// target ([`DcTarget::address_vector`]); on a soft NIC on the wire, [`Qp::reach`] makes a
    /// target's device known first.
    pub fn create_dci(&self, o: QpOptions, c: ConnectOptions) -> Result<Qp, Error> {
        self.create_dci_with(o, c, None)
    }

    /// [`Pd::create_dci`] for `gpu`'s kernels: its SQ ring placed as `o.placement` says, as
    /// [`Pd::create_qp_on`] places an RC QP's (on a ConnectX a DEVX DCI).
    pub fn create_dci_on(
        &self,
        gpu: &Arc<Gpu>,
        o: QpOptions,
        c: ConnectOptions,
    ) -> Result<Qp, Error> {
        self.create_dci_with(o, c, Some(gpu as &dyn GpuRings))
    }

    fn create_dci_with(
        &self,
        o: QpOptions,
        c: ConnectOptions,
        gpu: Option<&dyn GpuRings>,
    ) -> Result<Qp, Error> {
        let device = &*self.ctx.inner.device;
        let (gpu, placement) = resolve(o.placement, gpu, device, "Pd::create_dci_on")?;
        let (mode, reason) = self.doorbell_of(o.doorbell, gpu.is_some());
        let spec = QpSpec {
            sq_blocks: o.sq_blocks,
            rq_wqes: 0,
            max_recv_sge: 1,
            max_inline: o.max_inline,
            doorbell: mode,
            gpu,
            cross_channel: false,
        };
        let dev = self.dev.create_dci(&spec, &o.send_cq.dev)?;
        let qp = self.finish_qp(o, dev, (mode, reason), placement)?;
        qp.dev.ready_dc(self.ctx.mtu(), qp.psn(), &c)?;
        Ok(qp)
    }
}

impl Qp {
    /// Makes target `t` reachable from this DC initiator: on a soft NIC on the wire, a
    /// peer-table entry for the target's GID at its UDP port; nothing on a ConnectX (it routes
    /// by GID) or for a target without a port.
    pub fn reach(&self, t: &DcTarget) -> Result<(), Error> {
        let Some(port) = t.udp_port else {
            return Ok(());
        };
        let gid: verbs::Gid = t.gid.into();
        let Some(ip) = gid.to_ipv4() else {
            return Err(Error::InvalidArgument(format!(
                "DC target {:#x}: a UDP port with a GID that is not IPv4-mapped",
                t.dctn
            )));
        };
        let shown = format!("DC target {:#x}", t.dctn);
        self.dev.reach(gid, (ip, port).into(), &shown)
    }
}
