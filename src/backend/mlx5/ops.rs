//! A ConnectX through rdma-core behind the seam: which objects the provider makes and which
//! DEVX makes (rings in GPU memory, CQ modes the provider cannot give, or everything when
//! [`DEVX_ENV`](super::objects::DEVX_ENV) asks), libmlx5's SQ sizing, and the QP transitions.

use super::super::geometry::{CqGeometry, QpGeometry};
use super::super::seam::{
    CqOps, CqSpec, DctOps, DctSpec, DeviceOps, GpuRings, PdOps, Progress, QpOps, QpSpec,
    Registration, Remote,
};
use super::super::ConnectOptions;
use super::device::{Device, Pd};
use super::objects::{devx_always, Cq, Qp};
use crate::Error;
use rdma_core_sys as sys;
use std::any::Any;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use verbs::{Access, CqInit, CqMode, DeviceMemory, DmaBuf, DoorbellMode, Gid, Modify, QpState};

/// An rdma-core device.
pub(crate) struct Mlx5Device(pub(crate) Arc<Device>);

struct Mlx5Pd(Arc<Pd>);
struct Mlx5Cq(Arc<Cq>);
struct Mlx5Qp(Arc<Qp>);

/// An rdma-core region, deregistered when dropped.
struct MlxMr(#[allow(dead_code)] super::objects::Mr);

impl DeviceOps for Mlx5Device {
    fn gid(&self) -> Gid {
        Gid(self.0.gid.gid)
    }
    fn gid_index(&self) -> u8 {
        self.0.gid.index
    }
    fn mtu(&self) -> u32 {
        self.0.mtu
    }
    fn wire_addr(&self) -> Option<SocketAddr> {
        None
    }
    fn auto_doorbell(&self, _rings_on_gpu: bool) -> (DoorbellMode, &'static str) {
        (
            DoorbellMode::GpuDoorbell,
            "auto: GPU doorbell; the UAR page is registered into the GPU at export (as I/O \
             memory, else as plain memory; the export fails and says why when the GPU cannot \
             map it)",
        )
    }
    fn rings_for_kernels(&self) -> (bool, &'static str) {
        (
            true,
            "auto: GPU memory (DEVX umems), which the NIC reads peer to peer; the device API \
             then orders WQEs before the doorbell at GPU scope",
        )
    }
    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>, Error> {
        Ok(Arc::new(Mlx5Pd(self.0.alloc_pd()?)))
    }

    /// The provider's CQs detect overrun, start with op_own 0xF0 and live in host memory;
    /// anything else is made with DEVX on a ring of ours (as is everything under
    /// [`DEVX_ENV`](super::objects::DEVX_ENV)).
    fn create_cq(&self, spec: &CqSpec<'_>) -> Result<Arc<dyn CqOps>, Error> {
        let provider = spec.gpu.is_none()
            && spec.mode == CqMode::OverrunDetect
            && spec.init == CqInit::Invalid
            && !devx_always();
        if provider {
            let cq = self.0.create_cq(spec.depth)?;
            if cq.ncqe != spec.depth {
                return Err(Error::Unsupported(format!(
                    "the provider made a CQ of {} entries for {}",
                    cq.ncqe, spec.depth
                )));
            }
            return Ok(Arc::new(Mlx5Cq(cq)));
        }
        let bytes = (spec.depth as usize).saturating_mul(prm::CQE_SIZE);
        let ring = match spec.gpu {
            Some(g) => g.ring_buffer(bytes)?,
            None => DmaBuf::alloc(bytes),
        };
        prefill(&ring, spec.depth, spec.init)?;
        let dmabuf = spec.gpu.map(|g| g.dmabuf(ring.addr(), bytes as u64));
        // beside a ring in GPU memory, its doorbell record is GPU memory too (its consumer, a
        // kernel, writes it)
        let rec = match spec.gpu {
            Some(g) => g.ring_buffer(8)?,
            None => DmaBuf::alloc(64),
        };
        let cq = Cq::devx(&self.0, spec.depth, spec.mode, ring, dmabuf, rec)?;
        Ok(Arc::new(Mlx5Cq(cq)))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Fills a new CQ ring as its consumer expects to find it (`init`), 64-byte CQEs.
fn prefill(ring: &DmaBuf, ncqe: u32, init: CqInit) -> Result<(), Error> {
    verbs::cq::prefill(ring, ncqe as usize, init)
        .map_err(|e| Error::InvalidArgument(format!("a new CQ's ring: {e}")))
}

impl fmt::Debug for Mlx5Pd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("mlx5 PD")
    }
}

impl Mlx5Pd {
    fn registration(
        mr: super::objects::Mr,
        gpu_path: Option<super::super::GpuRegPath>,
    ) -> Registration {
        Registration {
            lkey: mr.lkey,
            rkey: mr.rkey,
            gpu_path,
            handle: Box::new(MlxMr(mr)),
        }
    }

    /// libmlx5 sizes the SQ as the power of two of max_send_wr times its largest WQE (ctrl +
    /// raddr + the inline data, in 64-byte blocks; versions differ in what else they count):
    /// asks for as many work requests of that size as fit in the blocks asked for, and fewer
    /// while the provider makes a larger SQ.
    fn provider_qp(
        &self,
        spec: &QpSpec<'_>,
        scq: &Arc<Cq>,
        rcq: &Arc<Cq>,
    ) -> Result<Arc<Qp>, Error> {
        let wqe_blocks = (32 + (4 + spec.max_inline as usize).next_multiple_of(16))
            .div_ceil(prm::WQEBB)
            .max(1) as u32;
        let mut wrs = (spec.sq_blocks / wqe_blocks).max(1);
        loop {
            let q = self.0.create_qp(
                scq,
                rcq,
                wrs,
                spec.rq_wqes,
                spec.max_recv_sge,
                spec.max_inline,
            )?;
            if q.sq_blocks <= spec.sq_blocks || wrs == 1 {
                return Ok(q);
            }
            wrs /= 2;
        }
    }

    /// A QP made with DEVX: its WQ (RQ then SQ) one buffer, in GPU memory when the spec says
    /// so; the doorbell record beside GPU rings is GPU memory too, unless the CPU proxy writes
    /// it.
    fn devx_qp(
        &self,
        spec: &QpSpec<'_>,
        (scq, rcq): (&Arc<Cq>, &Arc<Cq>),
        dci: bool,
    ) -> Result<Arc<Qp>, Error> {
        let stride = spec.rq_stride();
        let len = spec.rq_wqes as usize * stride as usize + spec.sq_blocks as usize * prm::WQEBB;
        let (wq, dmabuf) = match spec.gpu {
            Some(g) => {
                let wq = g.ring_buffer(len)?;
                let d = g.dmabuf(wq.addr(), len as u64);
                (wq, Some(d))
            }
            None => (DmaBuf::alloc(len), None),
        };
        let rec = match spec.gpu {
            // a host proxy thread writes the record of a proxied QP: host memory
            Some(g) if !spec.doorbell.proxied() => g.ring_buffer(8)?,
            _ => DmaBuf::alloc(64),
        };
        self.0.create_devx_qp(
            scq,
            rcq,
            spec.sq_blocks,
            spec.rq_wqes,
            stride,
            wq,
            dmabuf,
            rec,
            (spec.doorbell, dci, spec.cross_channel),
        )
    }
}

/// A provider (rdma-core verbs) QP has no no-DBR mode: `mlx5dv_create_qp` cannot ask for
/// `send_dbr_mode`, so a [`DoorbellMode::NoDbr`] QP must be made with DEVX.
fn refuse_provider_no_dbr(spec: &QpSpec<'_>) -> Result<(), Error> {
    match spec.doorbell {
        DoorbellMode::NoDbr => Err(Error::Unsupported(
            "DoorbellMode::NoDbr on a QP the provider would make (rdma-core's verbs path has \
             no send_dbr_mode): give it rings on a GPU (Pd::create_qp_on), DEVX CQs, or set \
             GPUVERBS_MLX5_DEVX=1"
                .into(),
        )),
        _ => Ok(()),
    }
}

impl PdOps for Mlx5Pd {
    unsafe fn reg_host(&self, addr: u64, len: u64, access: Access) -> Result<Registration, Error> {
        if len == 0 {
            return Err(Error::InvalidArgument("an empty memory region".into()));
        }
        // SAFETY: forwarded contract.
        let mr = unsafe { self.0.reg_host(addr, len, access)? };
        Ok(Self::registration(mr, None))
    }

    /// Through a dma-buf of the GPU pages (`ibv_reg_dmabuf_mr`), else the GPU address itself
    /// (`ibv_reg_mr`, nvidia-peermem).
    fn reg_gpu(
        &self,
        gpu: &dyn GpuRings,
        dptr: u64,
        len: u64,
        access: Access,
    ) -> Result<Registration, Error> {
        if len == 0 {
            return Err(Error::InvalidArgument("an empty memory region".into()));
        }
        let (mr, path) = self.0.reg_gpu(dptr, len, access, gpu.dmabuf(dptr, len))?;
        Ok(Self::registration(mr, Some(path)))
    }

    fn reg_device_memory(
        &self,
        _mem: Arc<dyn DeviceMemory>,
        _dptr: u64,
        _len: u64,
        _access: Access,
    ) -> Result<Registration, Error> {
        Err(Error::Unsupported(
            "a DeviceMemory region on an rdma-core device (register GPU memory with \
             Pd::register_gpu or Pd::register_device_mem)"
                .into(),
        ))
    }

    /// Rings in GPU memory or CQs made with DEVX: the QP is made with DEVX too; otherwise the
    /// provider makes it.
    fn create_qp(
        &self,
        spec: &QpSpec<'_>,
        send_cq: &Arc<dyn CqOps>,
        recv_cq: &Arc<dyn CqOps>,
    ) -> Result<Arc<dyn QpOps>, Error> {
        let of = |c: &Arc<dyn CqOps>| c.as_any().downcast_ref::<Mlx5Cq>().map(|c| c.0.clone());
        let (Some(scq), Some(rcq)) = (of(send_cq), of(recv_cq)) else {
            return Err(Error::InvalidArgument(
                "the QP's CQs belong to another device".into(),
            ));
        };
        if !spec.sq_blocks.is_power_of_two()
            || (spec.rq_wqes != 0 && !spec.rq_wqes.is_power_of_two())
        {
            return Err(Error::InvalidArgument(format!(
                "SQ of {} blocks, RQ of {} WQEs: powers of two",
                spec.sq_blocks, spec.rq_wqes
            )));
        }
        // a cross-channel QP needs DEVX: the provider's QPs cannot ask for `cd_master`
        let devx = spec.gpu.is_some() || spec.cross_channel || scq.is_devx() || rcq.is_devx();
        let q = if devx || devx_always() {
            self.devx_qp(spec, (&scq, &rcq), false)?
        } else {
            refuse_provider_no_dbr(spec)?;
            self.provider_qp(spec, &scq, &rcq)?
        };
        Ok(Arc::new(Mlx5Qp(q)))
    }

    /// The provider's on host rings; made with DEVX (`st` DCI) for rings in GPU memory or on
    /// a DEVX CQ.
    fn create_dci(
        &self,
        spec: &QpSpec<'_>,
        send_cq: &Arc<dyn CqOps>,
    ) -> Result<Arc<dyn QpOps>, Error> {
        let Some(cq) = send_cq.as_any().downcast_ref::<Mlx5Cq>() else {
            return Err(Error::InvalidArgument(
                "the DC initiator's CQ belongs to another device".into(),
            ));
        };
        // rings in GPU memory or a DEVX CQ: a DEVX DCI, as for RC
        if spec.gpu.is_some() || cq.0.is_devx() || devx_always() {
            let q = self.devx_qp(spec, (&cq.0, &cq.0), true)?;
            return Ok(Arc::new(Mlx5Qp(q)));
        }
        refuse_provider_no_dbr(spec)?;
        let wqe_blocks = (32 + 48 + (4 + spec.max_inline as usize).next_multiple_of(16))
            .div_ceil(prm::WQEBB)
            .max(1) as u32;
        let mut wrs = (spec.sq_blocks / wqe_blocks).max(1);
        loop {
            let q = self.0.create_dci(&cq.0, wrs, spec.max_inline)?;
            if q.sq_blocks <= spec.sq_blocks || wrs == 1 {
                return Ok(Arc::new(Mlx5Qp(q)));
            }
            wrs /= 2;
        }
    }

    fn create_dct(&self, t: &DctSpec<'_>) -> Result<Arc<dyn DctOps>, Error> {
        let Some(cq) = t.cq.as_any().downcast_ref::<Mlx5Cq>() else {
            return Err(Error::InvalidArgument(
                "the DC target's CQ belongs to another device".into(),
            ));
        };
        let d = self
            .0
            .create_dct(&cq.0, t.key, t.access, (t.mtu, t.min_rnr_timer))?;
        Ok(Arc::new(Mlx5Dct(d)))
    }
}

/// A DC target of a ConnectX (destroyed when the last holder lets go).
struct Mlx5Dct(super::dc::Dct);

impl fmt::Debug for Mlx5Dct {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "mlx5 DCT {:#x}", self.0.dctn)
    }
}

impl DctOps for Mlx5Dct {
    fn number(&self) -> u32 {
        self.0.dctn
    }
    fn state(&self) -> QpState {
        match self.0.state() {
            sys::IBV_QPS_RTR => QpState::Rtr,
            _ => QpState::Err,
        }
    }
    /// Nothing now: destroyed when the last holder lets go.
    fn destroy(&self) {}
}

impl fmt::Debug for Mlx5Cq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "mlx5 CQ {:#x}", self.0.cqn)
    }
}

impl CqOps for Mlx5Cq {
    fn cqn(&self) -> u32 {
        self.0.cqn
    }
    fn depth(&self) -> u32 {
        self.0.ncqe
    }
    fn geometry(&self) -> CqGeometry<'_> {
        self.0.geometry()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl fmt::Debug for Mlx5Qp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "mlx5 QP {:#x}", self.0.qpn)
    }
}

impl QpOps for Mlx5Qp {
    fn qpn(&self) -> u32 {
        self.0.qpn
    }

    /// As QUERY_QP reports it; ERR when the query fails.
    fn state(&self) -> QpState {
        match self.0.state() {
            Ok(0) => QpState::Reset,
            Ok(1) => QpState::Init,
            Ok(2) => QpState::Rtr,
            Ok(3) => QpState::Rts,
            _ => QpState::Err,
        }
    }

    fn connect(&self, remote: &Remote<'_>, psn: u32, o: &ConnectOptions) -> Result<(), Error> {
        let r = super::device::Remote {
            gid: remote.gid.0,
            qpn: remote.qpn,
            psn: remote.psn,
            mtu: remote.mtu,
        };
        self.0.connect(o.access, &r, psn, o)
    }

    fn ready_dc(&self, mtu: u32, psn: u32, o: &ConnectOptions) -> Result<(), Error> {
        self.0.ready_dc(mtu, psn, o)
    }

    /// A ConnectX routes to a target's GID itself.
    fn reach(&self, _gid: Gid, _udp: SocketAddr, _shown: &dyn fmt::Display) -> Result<(), Error> {
        Ok(())
    }

    /// RESET and ERR only (the others take attributes: connect).
    fn modify(&self, m: Modify) -> Result<(), Error> {
        match m {
            Modify::Reset => self.0.to_state(sys::IBV_QPS_RESET),
            Modify::Err => self.0.to_state(sys::IBV_QPS_ERR),
            other => Err(Error::Unsupported(format!(
                "{other:?} on an mlx5 QP: use Qp::connect"
            ))),
        }
    }

    fn geometry(&self) -> QpGeometry<'_> {
        self.0.geometry()
    }

    /// A NIC's consumer indexes are inside it.
    fn progress(&self) -> Option<Progress> {
        None
    }

    fn is_live(&self) -> bool {
        true
    }

    /// Nothing now: destroyed when the last holder (maybe a CPU initiator) lets go.
    fn destroy(&self) {}

    fn as_any(&self) -> &dyn Any {
        self
    }
}
