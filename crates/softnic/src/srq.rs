//! Shared receive queues in the mlx5 format: a ring of receive WQEs, each a 16-byte
//! next-WQE segment (`mlx5_wqe_srq_next_seg`: bytes 2-3 BE16 `next_wqe_index`) followed by data
//! segments (a short list ends with the invalid-lkey terminator), in a power-of-two stride.
//! Free WQEs form a linked list that software keeps: it posts at its head and links freed
//! WQEs at its tail. The device keeps its own head: it takes the WQE there and follows that
//! WQE's `next_wqe_index`. The doorbell record (BE32, low 16 bits) counts the WQEs posted;
//! the device has taken its own count, and the difference is what it may still take.
//! A responder CQE of a QP on an SRQ carries the SRQ WQE's index as its `wqe_counter`.
//!
//! XRC: an XRC domain ([`Xrcd`]) groups XRC SRQs. An XRC SRQ is bound to its domain and to a
//! CQ of its own: the receives of every XRC target QP of the domain that a request names it in
//! (the XRCETH) complete there, stamped with the SRQ's user index (its number when it has
//! none), and the request's memory accesses are checked against the SRQ's PD.

use crate::buffer::DmaBuf;
use crate::counters::Counters;
use crate::cq::Cq;
use crate::event::{AsyncEvent, EventHandler, EventSlot};
use crate::mem::PdId;
use crate::Error;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};

/// Bytes of the next-WQE segment at the start of each SRQ WQE.
pub const NEXT_SEG_SIZE: usize = 16;

/// Parameters of a new SRQ.
pub struct SrqConfig {
    /// Protection domain of the receive buffers.
    pub pd: PdId,
    /// Number of WQEs in the ring (a power of two, ≤ 32768).
    pub wqes: u32,
    /// Bytes per WQE (a power of two, 32..=512): the next segment and `stride / 16 - 1` data
    /// segments.
    pub stride: u32,
    /// The ring; allocated (zeroed, linked in order) in host memory when `None`.
    pub ring: Option<DmaBuf>,
    /// Where the 4-byte doorbell record lives (offset 0, host memory); allocated by the device
    /// when `None`.
    pub dbrec: Option<DmaBuf>,
    /// Initial limit (0: not armed).
    pub limit: u32,
}

impl SrqConfig {
    /// A config with `wqes` WQEs of `max_sge` data segments each, device-allocated memory and
    /// no limit.
    pub fn new(pd: PdId, wqes: u32, max_sge: u32) -> Self {
        let stride = ((max_sge as usize + 1) * 16).max(32).next_power_of_two() as u32;
        Self {
            pd,
            wqes,
            stride,
            ring: None,
            dbrec: None,
            limit: 0,
        }
    }
}

/// XRC domain numbers (device-wide uniqueness is all a number needs).
static NEXT_XRCDN: AtomicU32 = AtomicU32::new(1);

/// An XRC domain: the XRC SRQs its target QPs may deliver to, by number.
pub struct Xrcd {
    xrcdn: u32,
    srqs: Mutex<HashMap<u32, Weak<Srq>>>,
}

impl Xrcd {
    pub(crate) fn new() -> Self {
        Self {
            xrcdn: NEXT_XRCDN.fetch_add(1, Ordering::Relaxed) & 0xff_ffff,
            srqs: Mutex::default(),
        }
    }
    /// The domain's number.
    pub fn xrcdn(&self) -> u32 {
        self.xrcdn
    }
    /// The XRC SRQ numbered `srqn` in this domain (`None`: no such SRQ, or one of another
    /// domain).
    pub fn srq(&self, srqn: u32) -> Option<Arc<Srq>> {
        self.srqs.lock().get(&srqn).and_then(Weak::upgrade)
    }
    /// How many XRC SRQs the domain holds.
    pub fn srq_count(&self) -> usize {
        self.srqs
            .lock()
            .values()
            .filter(|w| w.strong_count() > 0)
            .count()
    }
    pub(crate) fn add(&self, srq: &Arc<Srq>) {
        self.srqs.lock().insert(srq.srqn, Arc::downgrade(srq));
    }
    pub(crate) fn remove(&self, srqn: u32) {
        self.srqs.lock().remove(&srqn);
    }
}

impl std::fmt::Debug for Xrcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Xrcd").field("xrcdn", &self.xrcdn).finish()
    }
}

/// What makes an SRQ an XRC SRQ ([`crate::Device::create_xrc_srq`]).
#[derive(Clone)]
pub struct XrcSrqConfig {
    /// Its domain.
    pub xrcd: Arc<Xrcd>,
    /// The CQ its receives complete on.
    pub cq: Arc<Cq>,
    /// The user index its CQEs carry (`srqn_uidx`); the SRQ number when `None`.
    pub user_index: Option<u32>,
}

struct SrqState {
    /// The device's head of the free list.
    head: u16,
    /// WQEs taken so far (16 bits, as the doorbell record's counter).
    taken: u16,
    /// Armed limit (0: not armed).
    limit: u32,
}

/// A shared receive queue.
pub struct Srq {
    srqn: u32,
    pd: PdId,
    wqes: u32,
    stride: u32,
    ring: DmaBuf,
    dbrec: DmaBuf,
    counters: Arc<Counters>,
    state: Mutex<SrqState>,
    pub(crate) events: EventSlot,
    /// An XRC SRQ's domain, CQ and user index.
    pub(crate) xrc: Option<XrcSrqConfig>,
}

impl Srq {
    pub(crate) fn new(srqn: u32, cfg: SrqConfig, counters: Arc<Counters>) -> Result<Self, Error> {
        if !cfg.wqes.is_power_of_two() || cfg.wqes > 32768 || cfg.wqes < 2 {
            return Err(Error::InvalidArgument(
                "SRQ size must be a power of two in 2..=32768",
            ));
        }
        if !cfg.stride.is_power_of_two() || !(32..=512).contains(&cfg.stride) {
            return Err(Error::InvalidArgument(
                "SRQ stride must be a power of two in 32..=512",
            ));
        }
        if cfg.limit >= cfg.wqes {
            return Err(Error::InvalidArgument("SRQ limit must be below its size"));
        }
        let bytes = (cfg.wqes * cfg.stride) as usize;
        let ring = match cfg.ring {
            Some(r) if r.len() < bytes => {
                return Err(Error::InvalidArgument("SRQ ring memory too small"))
            }
            Some(r) => r,
            None => {
                let r = DmaBuf::alloc(bytes);
                for i in 0..cfg.wqes {
                    let next = ((i + 1) & (cfg.wqes - 1)) as u16;
                    r.write((i * cfg.stride) as usize + 2, &next.to_be_bytes());
                }
                r
            }
        };
        let dbrec = match cfg.dbrec {
            Some(d) if d.len() < 4 || !d.is_host() => {
                return Err(Error::InvalidArgument(
                    "SRQ doorbell record must be 4 bytes of host memory",
                ))
            }
            Some(d) => d,
            None => DmaBuf::alloc(64),
        };
        Ok(Self {
            srqn,
            pd: cfg.pd,
            wqes: cfg.wqes,
            stride: cfg.stride,
            ring,
            dbrec,
            counters,
            state: Mutex::new(SrqState {
                head: 0,
                taken: 0,
                limit: cfg.limit,
            }),
            events: EventSlot::default(),
            xrc: None,
        })
    }

    /// Makes a new SRQ an XRC SRQ of `x.xrcd` (not yet registered there).
    pub(crate) fn with_xrc(mut self, mut x: XrcSrqConfig) -> Self {
        x.user_index = x.user_index.map(|u| u & 0xff_ffff);
        self.xrc = Some(x);
        self
    }
    /// An XRC SRQ's domain (`None` for an ordinary SRQ).
    pub fn xrcd(&self) -> Option<&Arc<Xrcd>> {
        self.xrc.as_ref().map(|x| &x.xrcd)
    }
    /// An XRC SRQ's CQ (`None` for an ordinary SRQ).
    pub fn xrc_cq(&self) -> Option<&Arc<Cq>> {
        self.xrc.as_ref().map(|x| &x.cq)
    }

    /// SRQ number.
    pub fn srqn(&self) -> u32 {
        self.srqn
    }
    /// Protection domain.
    pub fn pd(&self) -> PdId {
        self.pd
    }
    /// WQEs in the ring.
    pub fn wqes(&self) -> u32 {
        self.wqes
    }
    /// Bytes per WQE.
    pub fn stride(&self) -> u32 {
        self.stride
    }
    /// Data segments per WQE.
    pub fn max_sge(&self) -> u32 {
        self.stride / 16 - 1
    }
    /// The ring.
    pub fn ring(&self) -> &DmaBuf {
        &self.ring
    }
    /// The doorbell record (BE32 count of posted WQEs at offset 0).
    pub fn dbrec(&self) -> &DmaBuf {
        &self.dbrec
    }
    /// The armed limit (0: not armed).
    pub fn limit(&self) -> u32 {
        self.state.lock().limit
    }
    /// Arms the limit event (`ibv_modify_srq` with `IBV_SRQ_LIMIT`); 0 disarms.
    pub fn set_limit(&self, limit: u32) -> Result<(), Error> {
        if limit >= self.wqes {
            return Err(Error::InvalidArgument("SRQ limit must be below its size"));
        }
        // Armed until the device takes a WQE that leaves fewer than `limit` posted.
        self.state.lock().limit = limit;
        Ok(())
    }
    /// Sets (or clears) the receiver of this SRQ's events.
    pub fn set_event_handler(&self, h: Option<EventHandler>) {
        self.events.set(h);
    }
    /// WQEs posted and not yet taken by the device.
    pub fn available(&self) -> u32 {
        let st = self.state.lock();
        self.available_locked(&st)
    }
    /// WQEs the device has taken so far (16 bits).
    pub fn taken(&self) -> u16 {
        self.state.lock().taken
    }

    fn available_locked(&self, st: &SrqState) -> u32 {
        let posted = u32::from_be(self.dbrec.atomic_u32(0).load(Ordering::Acquire)) as u16;
        let n = posted.wrapping_sub(st.taken) as u32;
        if n > self.wqes {
            // a doorbell record ahead of the ring: nothing the device could take
            Counters::add(&self.counters.bad_doorbells, 1);
            return 0;
        }
        n
    }

    /// Takes the WQE at the device's head, if one is posted: returns its index.
    pub(crate) fn take(&self) -> Option<u16> {
        let mut st = self.state.lock();
        let avail = self.available_locked(&st);
        if avail == 0 {
            return None;
        }
        let idx = st.head & (self.wqes - 1) as u16;
        let mut next = [0u8; 2];
        self.ring
            .try_read(idx as usize * self.stride as usize + 2, &mut next)
            .ok()?;
        st.head = u16::from_be_bytes(next) & (self.wqes - 1) as u16;
        st.taken = st.taken.wrapping_add(1);
        let fire = st.limit != 0 && avail - 1 < st.limit;
        if fire {
            st.limit = 0;
        }
        drop(st);
        if fire {
            self.events.raise(AsyncEvent::SrqLimitReached);
        }
        Some(idx)
    }

    /// Offset of WQE `idx`'s first data segment in the ring.
    pub(crate) fn data_offset(&self, idx: u16) -> usize {
        (idx as usize & (self.wqes as usize - 1)) * self.stride as usize + NEXT_SEG_SIZE
    }
}

impl std::fmt::Debug for Srq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Srq")
            .field("srqn", &self.srqn)
            .field("wqes", &self.wqes)
            .field("stride", &self.stride)
            .finish()
    }
}
