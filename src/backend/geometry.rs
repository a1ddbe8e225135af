//! A queue's geometry, as its backend made it: where the rings, the doorbell record, the
//! doorbell register and the CPU-proxy word live, their sizes, and what keeps them alive. What
//! the layers above do with a queue that is not a device call (export into a GPU, the CPU
//! proxy, the CPU initiator's rings) is written once over it, whichever backend made the queue.

use prm::doorbell::BF_HALF_SIZE;
use std::any::Any;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use verbs::DmaBuf;

/// Where one piece of a queue lives.
pub(crate) enum Place<'a> {
    /// Bytes from the offset on of a device-visible buffer (host or GPU memory).
    Buf(&'a DmaBuf, usize),
    /// Host memory a provider mapped (a doorbell record of its pool, a UAR page).
    Host(*mut u8),
}

impl Place<'_> {
    /// Its host address, when it is host memory.
    pub(crate) fn host(&self) -> Option<*mut u8> {
        match self {
            // SAFETY: an offset inside the buffer (every geometry's places are in bounds).
            Self::Buf(b, off) if b.is_host() => Some(unsafe { b.as_ptr().add(*off) }),
            Self::Buf(..) => None,
            Self::Host(p) => Some(*p),
        }
    }

    /// Big-endian 32-bit word `i` from here (of a doorbell record) as a number: a load with
    /// acquire, or a copy from GPU memory (0 when that read fails).
    pub(crate) fn word(&self, i: usize) -> u32 {
        let w = match self {
            Self::Buf(b, off) => b.load_u32_acquire(off + 4 * i).unwrap_or(0),
            // SAFETY: a geometry's host places are live (kept by its `keep`), 4-byte aligned
            // records that the device and posters access atomically.
            Self::Host(p) => {
                unsafe { &*(p.add(4 * i) as *const AtomicU32) }.load(Ordering::Acquire)
            }
        };
        u32::from_be(w)
    }

    /// The native 64-bit word here (the CPU-proxy word) with acquire, 0 where it is not host
    /// memory.
    pub(crate) fn load_u64(&self) -> u64 {
        match self {
            Self::Buf(b, off) if b.is_host() => b.atomic_u64(*off).load(Ordering::Acquire),
            Self::Buf(..) => 0,
            // SAFETY: as in `store_u64`.
            Self::Host(p) => unsafe { &*(*p as *const AtomicU64) }.load(Ordering::Acquire),
        }
    }

    /// Stores `v` with release into the 8 aligned bytes here (the CPU-proxy word); false
    /// when they are not host memory.
    pub(crate) fn store_u64(&self, v: u64) -> bool {
        match self {
            Self::Buf(b, off) if b.is_host() => {
                b.atomic_u64(*off).store(v, Ordering::Release);
                true
            }
            Self::Buf(..) => false,
            Self::Host(p) => {
                // SAFETY: a geometry's proxy word is 8 aligned bytes of live host memory (kept
                // by the geometry's `keep`), accessed only atomically.
                unsafe { &*(*p as *const AtomicU64) }.store(v, Ordering::Release);
                true
            }
        }
    }
}

/// The bytes a doorbell register spans (its two BlueFlame halves).
pub(crate) const DB_REG_LEN: usize = 2 * BF_HALF_SIZE;

/// What an 8-byte doorbell write does besides the store: wakes a software device's engine
/// (a hardware NIC needs nothing).
pub(crate) type Kick = Arc<dyn Fn() + Send + Sync>;

/// Makes the device's help for one CPU poster of a QP.
pub(crate) type PosterHooks = Arc<dyn Fn() -> verbs::initiator::DeviceHooks + Send + Sync>;

/// A QP's queues.
pub(crate) struct QpGeometry<'a> {
    pub qpn: u32,
    /// The SQ ring (64-byte blocks).
    pub sq: &'a DmaBuf,
    pub sq_blocks: u32,
    /// The RQ ring, when the QP has one.
    pub rq: Option<&'a DmaBuf>,
    pub rq_wqes: u32,
    pub rq_stride: u32,
    pub max_inline: u32,
    /// The 8-byte doorbell record (word 0: RQ head, word 1: SQ producer).
    pub dbrec: Place<'a>,
    /// The doorbell register (its first BlueFlame half; [`DB_REG_LEN`] bytes).
    pub db_reg: Place<'a>,
    /// The register is a real UAR (MMIO): a GPU maps it as I/O memory first.
    pub db_reg_io: bool,
    /// The 8-byte CPU-proxy word, where the QP has one.
    pub proxy_word: Option<Place<'a>>,
    /// What a doorbell write must do besides the store, `None` for hardware.
    pub kick: Option<Kick>,
    /// What the device tells and does for a CPU poster beyond the rings (made anew for each
    /// poster), `None` where it offers nothing (hardware).
    pub poster_hooks: Option<PosterHooks>,
    /// Keeps every place above alive.
    pub keep: Arc<dyn Any + Send + Sync>,
}

/// A CQ's ring.
pub(crate) struct CqGeometry<'a> {
    /// The CQE ring (64-byte CQEs).
    pub ring: &'a DmaBuf,
    pub ncqe: u32,
    /// The CQ doorbell record (word 0: consumer index).
    pub dbrec: Place<'a>,
    /// Every CQE lands in slot 0.
    pub collapsed: bool,
    /// The device writes no CQE over one its consumer has not taken (an rdma-core CQ): a send
    /// CQ smaller than the SQ could then stall a kernel, so export refuses it.
    pub never_overwrites: bool,
    /// Keeps the ring and the record alive.
    pub keep: Arc<dyn Any + Send + Sync>,
}

impl QpGeometry<'_> {
    /// The send producer index (64-bit): the CPU-proxy word when a kernel wrote it ahead of
    /// the doorbell record's 16 bits (its WQEs not rung yet, the proxy will), else those 16
    /// bits, as the 64-bit value at or below the word.
    pub(crate) fn sq_producer(&self) -> u64 {
        let proxy = self.proxy_word.as_ref().map_or(0, Place::load_u64);
        producer_from(self.dbrec.word(1) as u16, proxy)
    }
}

/// The 64-bit producer from the doorbell record's 16 bits and the CPU-proxy word.
pub(crate) fn producer_from(sq16: u16, proxy: u64) -> u64 {
    proxy
        .checked_sub(u64::from((proxy as u16).wrapping_sub(sq16)))
        .unwrap_or(u64::from(sq16))
}
