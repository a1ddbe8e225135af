//! A self-contained bandwidth measurement of the wire: two soft devices in this process talk
//! RoCEv2 over UDP on 127.0.0.1, one RDMA-WRITEs a buffer into the other's in fixed-size
//! WQEs (a CPU initiator posts them, as `ib_write_bw` does), optionally with packet loss.
//! Used by `tests/wire_bench.rs` and callable from samples.

use crate::initiator::{Initiator, InitiatorError, RingMode, SoftQpInitiator};
use crate::mem::Access;
use crate::net::{WireConfig, WireFaults};
use crate::qp::{Modify, QpConfig, RtrAttr, RtsAttr};
use crate::{CqConfig, Device, DeviceConfig, DmaBuf, Error, WireCounters};
use prm::wqe::{CtrlFlags, Local, Op, RemoteAddr, Sge};
use prm::{Completion, Lkey, Rkey};
use std::time::{Duration, Instant};

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WriteBw {
    /// Bytes per WRITE WQE.
    pub msg: usize,
    /// Bytes in all (a multiple of `msg`).
    pub total: usize,
    /// WQEs kept outstanding.
    pub depth: usize,
    /// Path MTU.
    pub mtu: u32,
    /// Loss probability on each direction (requests and ACKs).
    pub loss: f64,
    /// Packets the requester may have in flight.
    pub window: u32,
    /// Selective repeat on both QPs ([`crate::RtrAttr::selective_repeat`]).
    pub selective_repeat: bool,
}

impl Default for WriteBw {
    /// 256 MiB in 1 MiB WRITEs, 16 outstanding, 4096-byte MTU, no loss, default window,
    /// selective repeat (as two gpuverbs soft NICs agree on).
    fn default() -> Self {
        Self {
            msg: 1 << 20,
            total: 256 << 20,
            depth: 16,
            mtu: 4096,
            loss: 0.0,
            window: WireConfig::loopback().window,
            selective_repeat: true,
        }
    }
}

/// What was measured.
#[derive(Clone, Debug, PartialEq)]
pub struct WriteBwResult {
    /// Bytes written.
    pub bytes: u64,
    /// From the first post to the last completion.
    pub elapsed: Duration,
    /// The requester's wire counters.
    pub requester: WireCounters,
    /// The responder's wire counters.
    pub responder: WireCounters,
}

impl WriteBwResult {
    /// Payload bandwidth in bytes per second.
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64()
    }
}

/// Errors of the measurement.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Device setup failed.
    #[error(transparent)]
    Device(#[from] Error),
    /// Posting or polling failed.
    #[error(transparent)]
    Initiator(#[from] InitiatorError),
    /// A WQE completed with an error.
    #[error("a WRITE failed: {0:?}")]
    Failed(Completion),
    /// Bad parameters.
    #[error("invalid parameters: {0}")]
    Params(&'static str),
}

/// Runs the measurement (the payload is checked at the end: identical bytes or an error).
pub fn write_bw(p: WriteBw) -> Result<WriteBwResult, BenchError> {
    if p.msg == 0 || p.total % p.msg != 0 || p.msg > 1 << 30 || p.depth == 0 {
        return Err(BenchError::Params(
            "msg must divide total, be 1..=1 GiB, depth >= 1",
        ));
    }
    // The buffers are declared before the devices, so that they outlive them on every path
    // (locals drop in reverse order of declaration).
    let src = DmaBuf::alloc(p.total);
    let dst = DmaBuf::alloc(p.total);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for off in (0..p.total).step_by(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        src.write(off, &x.to_ne_bytes()[..8.min(p.total - off)]);
    }
    let open = |seed| {
        Device::open(DeviceConfig {
            wire: Some(WireConfig {
                window: p.window,
                faults: WireFaults::loss(p.loss, seed),
                ..WireConfig::loopback()
            }),
            ..Default::default()
        })
    };
    let (a, b) = (open(1)?, open(2)?);
    for (x, y) in [(&a, &b), (&b, &a)] {
        let addr = y
            .wire_addr()
            .ok_or(Error::InvalidArgument("no wire port"))?;
        x.add_peer(y.gid(), addr)?;
    }
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    // SAFETY: both buffers outlive the devices (declared before them, so dropped after them
    // on every path), hence every use the devices make of them.
    let (ma, mb) = unsafe {
        (
            a.reg_host(pa, src.addr(), p.total as u64, Access::LOCAL_WRITE)?,
            b.reg_host(
                pb,
                dst.addr(),
                p.total as u64,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )?,
        )
    };
    let mk = |d: &Device, pd| -> Result<_, Error> {
        let cq = d.create_cq(CqConfig {
            ncqe: 1024,
            ..Default::default()
        })?;
        let mut c = QpConfig::new(pd, cq.clone(), cq);
        c.sq_blocks = 1024;
        d.create_qp(c)
    };
    let (qa, qb) = (mk(&a, pa)?, mk(&b, pb)?);
    for (q, peer, dev) in [(&qa, &qb, &b), (&qb, &qa, &a)] {
        q.modify(Modify::Init {
            access: Access::REMOTE_WRITE,
        })?;
        q.modify(Modify::Rtr(RtrAttr {
            remote_gid: dev.gid(),
            remote_qpn: peer.qpn(),
            rq_psn: 0,
            mtu: p.mtu,
            min_rnr_timer: 1,
            selective_repeat: p.selective_repeat,
        }))?;
        q.modify(Modify::Rts(RtsAttr {
            timeout: 16,
            ..RtsAttr::default()
        }))?;
    }
    let mut ini = Initiator::for_soft_qp(&a, &qa, RingMode::RdmaCore);
    let n = p.total / p.msg;
    let signal_every = p.depth.div_ceil(2).max(1);
    let t0 = Instant::now();
    let (mut posted, mut done) = (0usize, 0usize);
    let mut pending = std::collections::VecDeque::new();
    while done < n {
        while posted < n && posted - done < p.depth {
            let sig = posted % signal_every == signal_every - 1 || posted + 1 == n;
            let op = Op::Write {
                remote: RemoteAddr {
                    addr: dst.addr() + (posted * p.msg) as u64,
                    rkey: Rkey(mb.key),
                },
                local: Local::Sges(&[Sge {
                    addr: src.addr() + (posted * p.msg) as u64,
                    len: p.msg as u32,
                    lkey: Lkey(ma.key),
                }]),
                imm: None,
            };
            let flags = CtrlFlags {
                signaled: sig,
                ..CtrlFlags::SIGNALED
            };
            ini.post(&op, flags)?;
            posted += 1;
            if sig {
                pending.push_back(posted);
                ini.ring();
            }
        }
        match ini.wait_send(Duration::from_secs(30))? {
            Completion::Req { .. } => done = pending.pop_front().unwrap_or(n),
            c => return Err(BenchError::Failed(c)),
        }
    }
    let elapsed = t0.elapsed();
    let mut same = true;
    let mut x = vec![0u8; 1 << 16];
    let mut y = vec![0u8; 1 << 16];
    for off in (0..p.total).step_by(1 << 16) {
        let k = (1 << 16).min(p.total - off);
        src.read(off, &mut x[..k]);
        dst.read(off, &mut y[..k]);
        same &= x[..k] == y[..k];
    }
    if !same {
        return Err(BenchError::Params("payload differs at the receiver"));
    }
    let result = WriteBwResult {
        bytes: p.total as u64,
        elapsed,
        requester: a.counters().wire,
        responder: b.counters().wire,
    };
    drop(ini);
    drop(a);
    drop(b);
    Ok(result)
}
