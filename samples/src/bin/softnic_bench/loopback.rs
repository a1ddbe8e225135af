//! The bench's loopback: two soft devices, a QP on each connected to the other, their buffers
//! and the CPU initiator of the sending QP ([`Loopback`]), and the reads of a destination slot.

use super::args::{Args, Ring};
use anyhow::{bail, Context, Result};
use gpuverbs::post::{Completion, CpuInitiator as Initiator, RingMode, Syndrome};
use gpuverbs::soft::raw::{
    Access, Cq, CqConfig, CqGeometry, CqMode, DmaBuf, DoorbellMode, Modify, MrInfo, Qp, QpConfig,
    RqGeometry, RtrAttr, RtsAttr, SoftQpInitiator as _, SqGeometry,
};
use gpuverbs::soft::{CounterSnapshot, Device, DeviceConfig, Fault};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest wait for a completion before the run is declared stuck.
pub(super) const STUCK: Duration = Duration::from_secs(5);

/// Bytes per message-rate slot.
pub(super) const SLOT: usize = 8;

/// Two soft devices, one RC connection A → B, and an initiator on A's QP.
pub(super) struct Loopback {
    // Field order is drop order: the initiator and QPs go before the devices, and the buffers
    // are dropped last (after the devices' engines have stopped).
    pub(super) ini: Initiator,
    pub(super) qa: Arc<Qp>,
    pub(super) a: Device,
    pub(super) b: Device,
    pub(super) src_mr: MrInfo,
    pub(super) dst_mr: MrInfo,
    pub(super) src: DmaBuf,
    pub(super) dst: DmaBuf,
}

impl Loopback {
    /// `kick`: the initiator wakes the engine after each doorbell (as a CPU can); without it the
    /// engine finds doorbells by polling alone, as it finds a GPU's.
    pub(super) fn new(args: &Args, ring: Ring, buf_len: usize, kick: bool) -> Result<Self> {
        let a = Device::open(DeviceConfig::default()).context("open device A")?;
        let b = Device::open(DeviceConfig::default()).context("open device B")?;
        let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
        let doorbell = if ring == Ring::Bf {
            DoorbellMode::BlueFlame
        } else {
            DoorbellMode::GpuDoorbell
        };
        let mk = |d: &Device, pd| -> Result<Arc<Qp>> {
            // One CQE per SQ block at most: the CQ can never overrun.
            let cq = d.create_cq(CqConfig {
                ncqe: args.sq_blocks.max(64),
                ..Default::default()
            })?;
            let mut cfg = QpConfig::new(pd, cq.clone(), cq);
            cfg.sq_blocks = args.sq_blocks;
            cfg.rq_wqes = 0;
            cfg.doorbell = doorbell;
            Ok(d.create_qp(cfg)?)
        };
        let (qa, qb) = (mk(&a, pa)?, mk(&b, pb)?);
        let src = DmaBuf::alloc(buf_len);
        let dst = DmaBuf::alloc(buf_len);
        // SAFETY: both buffers are owned by the returned value and outlive the devices (field
        // order above); nothing else writes them while WQEs that name them are in flight.
        let (src_mr, dst_mr) = unsafe {
            (
                a.reg_host(pa, src.addr(), src.len() as u64, Access::NONE)?,
                b.reg_host(
                    pb,
                    dst.addr(),
                    dst.len() as u64,
                    Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                )?,
            )
        };
        for (q, peer, dev) in [(&qa, &qb, &b), (&qb, &qa, &a)] {
            q.modify(Modify::Init {
                access: Access::REMOTE_WRITE,
            })?;
            q.modify(Modify::Rtr(RtrAttr {
                remote_gid: dev.gid(),
                remote_qpn: peer.qpn(),
                rq_psn: 0,
                mtu: 4096,
                min_rnr_timer: 1,
                selective_repeat: false,
            }))?;
            q.modify(Modify::Rts(RtsAttr::default()))?;
        }
        if args.inject_fault {
            qa.inject(Fault::FailNext {
                count: 1,
                syndrome: Syndrome::RemoteAccess,
            });
        }
        let ini = if kick {
            Initiator::for_soft_qp(&a, &qa, ring.mode())
        } else {
            silent_initiator(&qa, ring.mode())
        };
        Ok(Self {
            ini,
            qa,
            a,
            b,
            src_mr,
            dst_mr,
            src,
            dst,
        })
    }

    /// Takes one send completion; `Ok(None)` when none is there. Any error CQE aborts.
    pub(super) fn poll(&mut self) -> Result<Option<u16>> {
        match self.ini.poll_send() {
            None => Ok(None),
            Some(Completion::Req {
                wqe_opcode,
                wqe_counter,
                ..
            }) if wqe_opcode == gpuverbs::post::Opcode::RdmaWrite as u8 => Ok(Some(wqe_counter)),
            Some(Completion::Error(e)) => bail!("error CQE: {e}"),
            Some(other) => bail!("unexpected completion on the send CQ: {other:?}"),
        }
    }

    /// Waits for one send completion, at most [`STUCK`].
    pub(super) fn wait(&mut self) -> Result<u16> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(w) = self.poll()? {
                return Ok(w);
            }
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 && start.elapsed() > STUCK {
                bail!(
                    "no completion within {STUCK:?} (QP {:?}, {} blocks outstanding); counters A: {:?}",
                    self.qa.state(),
                    self.ini.outstanding(),
                    self.a.counters()
                );
            }
            std::hint::spin_loop();
        }
    }

    pub(super) fn counters(&self) -> CounterSnapshot {
        self.a.counters()
    }

    pub(super) fn check_clean(&self) -> Result<()> {
        for (name, d) in [("A", &self.a), ("B", &self.b)] {
            let c = d.counters();
            if !c.errors.is_empty() || c.bad_doorbells != 0 || c.stale_wqes != 0 {
                bail!("device {name} counted errors: {c:?}");
            }
        }
        Ok(())
    }
}

/// An initiator for `qp` that never wakes the engine: its doorbells are noticed by the engine's
/// polling alone, as a GPU's are. The same geometry as `Initiator::for_soft_qp`, without `wake`.
pub(super) fn silent_initiator(qp: &Arc<Qp>, mode: RingMode) -> Initiator {
    let cq_geom = |cq: &Cq| CqGeometry {
        ring: cq.ring().as_ptr(),
        ncqe: cq.ncqe(),
        dbrec: cq.dbrec().as_ptr(),
        collapsed: cq.mode() == CqMode::Collapsed,
    };
    let ctrl = qp.ctrl_page().as_ptr();
    // SAFETY: both offsets lie inside the QP's own control and UAR pages.
    let (dbrec, bf_reg) = unsafe {
        (
            ctrl.add(qp.dbrec_offset()),
            qp.uar().as_ptr().add(gpuverbs::post::BF_OFFSET),
        )
    };
    let sq = SqGeometry {
        ring: qp.sq_ring().as_ptr(),
        blocks: qp.sq_blocks(),
        dbrec,
        bf_reg,
        qpn: qp.qpn(),
    };
    let rq = RqGeometry {
        ring: qp.rq_ring().as_ptr(),
        wqes: qp.rq_wqes(),
        stride: qp.rq_stride(),
        dbrec,
    };
    // SAFETY: every pointer is into memory owned by `qp` or its CQs, kept alive by the clone of
    // `qp` handed over; this initiator is the QP's only client.
    unsafe {
        Initiator::from_geometry(
            sq,
            rq,
            cq_geom(qp.send_cq()),
            cq_geom(qp.recv_cq()),
            mode,
            qp.clone(),
            None,
        )
    }
}

/// The 8-byte value message `n` writes (never 0, so an unwritten slot cannot pass).
pub(super) fn value(n: u64) -> u64 {
    n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

pub(super) fn read_u64(buf: &DmaBuf, off: usize) -> u64 {
    let mut b = [0u8; 8];
    buf.read(off, &mut b);
    u64::from_ne_bytes(b)
}
