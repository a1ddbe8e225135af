//! Protection domains and memory regions: keys, ranges and access rights, checked on every
//! access exactly where a ConnectX checks them.
//!
//! An mkey is `index << 8 | tag`; lkey and rkey are the same value (as on mlx5). The tag changes
//! each time an index is reused, so a stale key from a deregistered region is a bad key, not a
//! silent hit on whatever took its slot.
//!
//! A memory window (`ibv_alloc_mw`) takes a key from the same space. A bind WQE (UMR) gives
//! it a range of a region, rights and a new low byte; peers then use the window's key, and
//! every remote access through it is checked against the window first (bound, PD, for a
//! type 2 window the QP it is bound to, range, rights), then against the region.
//!
//! A region is host memory (the engine copies with raw pointers) or device memory (every access
//! goes through the region's [`DeviceMemory`]). A checked [`MemRange`] carries which; the
//! copies here ([`copy_ranges`], [`read_range`], [`write_range`]) dispatch on it.

mod indirect;

pub use indirect::{IndirectConfig, UmrError, MAX_PIECES};

use crate::devmem::{same_memory, DeviceMemory, DeviceMemoryError, BOUNCE};
use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::sync::Arc;
pub use verbs::Access;

/// A protection domain number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PdId(pub u32);

/// Why an access to registered memory was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// No region has this key.
    #[error("no memory region with key {0:#x}")]
    BadKey(u32),
    /// The region belongs to another protection domain.
    #[error("key {0:#x} belongs to another protection domain")]
    WrongPd(u32),
    /// The range is not inside the region.
    #[error("range {addr:#x}+{len} outside region of key {key:#x}")]
    OutOfRange {
        /// Key.
        key: u32,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The region lacks a right the access needs.
    #[error("key {key:#x} lacks access {need:?}")]
    MissingRight {
        /// Key.
        key: u32,
        /// Rights required.
        need: Access,
    },
    /// One contiguous range was needed (a remote READ or WRITE, an atomic) and the range
    /// spans two entries of an indirect mkey.
    #[error("range {addr:#x}+{len} spans entries of indirect mkey {key:#x}")]
    Split {
        /// Key.
        key: u32,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
}

pub use verbs::MemKind;

/// A registered region as the device records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrInfo {
    /// lkey = rkey.
    pub key: u32,
    /// Owning PD.
    pub pd: PdId,
    /// First byte (virtual address).
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Rights.
    pub access: Access,
    /// Where it lives.
    pub kind: MemKind,
}

impl MrInfo {
    fn covers(&self, addr: u64, len: u64) -> bool {
        covers(self.addr, self.len, addr, len)
    }
}

/// Whether `start..start + size` (a key's range) holds all of `addr..addr + len`, with no
/// overflow on either side.
fn covers(start: u64, size: u64, addr: u64, len: u64) -> bool {
    addr >= start
        && addr
            .checked_add(len)
            .is_some_and(|e| e <= start.saturating_add(size))
}

#[derive(Clone, Default)]
struct Slot {
    tag: u8,
    mr: Option<MrInfo>,
    dev: Option<Arc<dyn DeviceMemory>>,
    /// Host memory the region owns a share of ([`MrTable::insert_owned`]): freed no earlier
    /// than the region is removed, so a registered buffer cannot go away under the device.
    keep: Option<Arc<crate::buffer::DmaBuf>>,
    /// A memory window in this slot (then `mr` is `None`). Its binding changes under the
    /// table's read hold, so a bind or an invalidation never waits for copies in flight.
    mw: Option<Arc<Mutex<Window>>>,
    /// An indirect mkey in this slot, with its key (then `mr` and `mw` are `None`).
    ind: Option<(u32, Arc<Mutex<indirect::Indirect>>)>,
}

impl Slot {
    fn is_free(&self) -> bool {
        self.mr.is_none() && self.mw.is_none() && self.ind.is_none()
    }
}

/// The type of a memory window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MwType {
    /// Type 1: bound with `ibv_bind_mw`, usable through any QP of its PD.
    One,
    /// Type 2 (2B): bound with a BIND_MW work request to one QP, usable only through that QP;
    /// invalidated by LOCAL_INV or by a peer's SEND_WITH_INV.
    Two,
}

/// What a bound window gives access to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MwBinding {
    /// First address as peers name it (0 for a zero-based window).
    pub start: u64,
    /// Length.
    pub len: u64,
    /// Remote rights.
    pub access: Access,
    /// The region's key.
    pub mr_key: u32,
    /// The region address `start` maps to.
    pub mr_addr: u64,
    /// The QP a type 2 window is bound to.
    pub qpn: Option<u32>,
}

/// A memory window as the device records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MwInfo {
    /// Current key (its low byte changes with binds).
    pub key: u32,
    /// Owning PD.
    pub pd: PdId,
    /// Type.
    pub kind: MwType,
    /// The range it is bound to, `None` while free.
    pub bound: Option<MwBinding>,
}

type Window = MwInfo;

/// A bind or invalidation asked of a window (the device's reading of a UMR WQE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MwRequest {
    /// The window's key as the poster knows it: its index selects the window.
    pub key: u32,
    /// The key's new low byte.
    pub variant: u8,
    /// The range to bind (with `access` the rights and `qpn` the QP for a type 2 window), or
    /// `None` to free the window.
    pub bind: Option<MwBinding>,
    /// Fail unless the window is free.
    pub check_free: bool,
    /// Fail unless the window is bound to the posting QP (invalidation of a type 2 window).
    pub check_qpn: bool,
}

/// Why a memory-window operation was refused (a ConnectX completes it with MW_BIND_ERR).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MwError {
    /// No window has this key.
    #[error("no memory window with key {0:#x}")]
    NoWindow(u32),
    /// The window, the region and the QP are not all in one PD.
    #[error("memory window {0:#x}: window, region and QP are in different PDs")]
    WrongPd(u32),
    /// A type 2 bind of a window that is not free.
    #[error("memory window {0:#x} is bound already")]
    NotFree(u32),
    /// An invalidation of a window that is not bound, not type 2, or bound to another QP.
    #[error("memory window {0:#x} is not bound to this QP")]
    NotBoundHere(u32),
    /// The operation's window type (type 1 or type 2 addressing) is not the window's.
    #[error("memory window {0:#x} is of the other type")]
    WrongType(u32),
    /// The region to bind is not live, not bindable (no MW_BIND right), too small for the
    /// range, or lacks local write for remote write or atomic rights.
    #[error("memory window {key:#x}: region {mr_key:#x} cannot be bound ({why})")]
    BadRegion {
        /// Window key.
        key: u32,
        /// Region key.
        mr_key: u32,
        /// What is wrong.
        why: &'static str,
    },
}

/// Copies of a [`MrTable`]: a reader locks only its thread's copy, so the readers of every
/// WQE on several engine threads do not share one lock word.
const COPIES: usize = 8;

/// One copy of the table, on cache lines of its own.
#[derive(Default)]
#[repr(align(128))]
struct Replica(RwLock<Vec<Slot>>);

/// The device's table of memory regions, replicated: a reader ([`MrTable::read`]) locks its
/// thread's copy; a writer locks every copy (waiting for every reader: copies in flight hold a
/// read), changes the first and makes the others equal to it when done. Registration is rare,
/// lookups happen at every WQE.
pub struct MrTable {
    copies: Box<[Replica]>,
}

impl Default for MrTable {
    fn default() -> Self {
        Self {
            copies: (0..COPIES).map(|_| Replica::default()).collect(),
        }
    }
}

/// Every copy of a table, write-locked; derefs to the first, which is copied into the others
/// when dropped.
struct TableWrite<'a>(Vec<RwLockWriteGuard<'a, Vec<Slot>>>);

impl std::ops::Deref for TableWrite<'_> {
    type Target = Vec<Slot>;
    fn deref(&self) -> &Vec<Slot> {
        &self.0[0]
    }
}

impl std::ops::DerefMut for TableWrite<'_> {
    fn deref_mut(&mut self) -> &mut Vec<Slot> {
        &mut self.0[0]
    }
}

impl Drop for TableWrite<'_> {
    fn drop(&mut self) {
        let (first, rest) = self.0.split_at_mut(1);
        for g in rest {
            g.clone_from(&first[0]);
        }
    }
}

/// A checked range `addr..addr+len` inside a live region: host memory (`dev` is `None`) or
/// device memory reached through `dev`.
#[derive(Clone)]
pub struct MemRange {
    /// First byte.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// The device memory holding the range, `None` for host memory.
    pub dev: Option<Arc<dyn DeviceMemory>>,
}

impl MemRange {
    /// A host range.
    pub fn host(addr: u64, len: u64) -> Self {
        Self {
            addr,
            len,
            dev: None,
        }
    }

    /// A range of no bytes: a zero-length RDMA request's, whose key and address a responder
    /// does not check (IBTA C9-88). Its address is a non-null, aligned one, so a copy of
    /// nothing from or to it is defined whatever address the request named.
    pub fn empty() -> Self {
        Self::host(std::ptr::NonNull::<u8>::dangling().as_ptr() as u64, 0)
    }

    /// Whether the range is host memory.
    pub fn is_host(&self) -> bool {
        self.dev.is_none()
    }
}

impl PartialEq for MemRange {
    fn eq(&self, o: &Self) -> bool {
        let same_dev = match (&self.dev, &o.dev) {
            (None, None) => true,
            (Some(a), Some(b)) => same_memory(a, b),
            _ => false,
        };
        self.addr == o.addr && self.len == o.len && same_dev
    }
}

impl std::fmt::Debug for MemRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_host() { "host" } else { "device" };
        write!(f, "MemRange({kind} {:#x}+{})", self.addr, self.len)
    }
}

impl MrTable {
    /// Records a region and returns its description with its key: host memory when `dev` is
    /// `None`, else device memory reached through `dev`.
    pub fn insert(
        &self,
        pd: PdId,
        addr: u64,
        len: u64,
        access: Access,
        dev: Option<Arc<dyn DeviceMemory>>,
    ) -> MrInfo {
        self.insert_slot(pd, addr, len, access, dev, None)
    }

    fn insert_slot(
        &self,
        pd: PdId,
        addr: u64,
        len: u64,
        access: Access,
        dev: Option<Arc<dyn DeviceMemory>>,
        keep: Option<Arc<crate::buffer::DmaBuf>>,
    ) -> MrInfo {
        let mut slots = self.write();
        let index = free_slot(&mut slots);
        let slot = &mut slots[index];
        slot.tag = next_tag(slot.tag);
        let info = MrInfo {
            key: (index as u32) << 8 | slot.tag as u32,
            pd,
            addr,
            len,
            access,
            kind: if dev.is_some() {
                MemKind::Device
            } else {
                MemKind::Host
            },
        };
        slot.mr = Some(info);
        slot.dev = dev;
        slot.keep = keep;
        info
    }

    /// Records a region of host memory that keeps `keep` (the buffer holding
    /// `addr..addr + len`) alive until it is removed.
    pub fn insert_owned(
        &self,
        pd: PdId,
        addr: u64,
        len: u64,
        access: Access,
        keep: Arc<crate::buffer::DmaBuf>,
    ) -> MrInfo {
        self.insert_slot(pd, addr, len, access, None, Some(keep))
    }

    /// Removes a region; `None` when the key is not live. Copies hold a [`MrGuard`] for their
    /// whole duration, so removal waits for copies in flight and memory is never freed under
    /// the device.
    pub fn remove(&self, key: u32) -> Option<MrInfo> {
        let mut slots = self.write();
        match slots.get_mut((key >> 8) as usize) {
            Some(s) if s.mr.is_some_and(|m| m.key == key) => {
                // writes queued into it complete before its owner may free it
                if let Some(Err(e)) = s.dev.as_ref().map(|d| d.settle()) {
                    tracing::warn!(key, error = %e, "queued device-memory writes failed");
                }
                s.dev = None;
                s.keep = None;
                s.mr.take()
            }
            _ => None,
        }
    }

    /// Re-registers a live host region in place (new range, PD or rights; the key stays, as
    /// a ConnectX modifies an mkey in place). Waits for copies in flight, like [`MrTable::remove`].
    /// `None` when the key is not a live host region.
    pub fn replace(
        &self,
        key: u32,
        pd: PdId,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Option<MrInfo> {
        let mut slots = self.write();
        match slots.get_mut((key >> 8) as usize) {
            Some(s) if s.mr.is_some_and(|m| m.key == key) && s.dev.is_none() => {
                // the new range is the caller's (rereg_host's contract), not the buffer's
                s.keep = None;
                let info = MrInfo {
                    key,
                    pd,
                    addr,
                    len,
                    access,
                    kind: MemKind::Host,
                };
                s.mr = Some(info);
                Some(info)
            }
            _ => None,
        }
    }

    /// Allocates a memory window in `pd` (free, unbound) and returns its key.
    pub fn alloc_mw(&self, pd: PdId, kind: MwType) -> u32 {
        let mut slots = self.write();
        let index = free_slot(&mut slots);
        let slot = &mut slots[index];
        slot.tag = next_tag(slot.tag);
        let key = (index as u32) << 8 | slot.tag as u32;
        slot.mw = Some(Arc::new(Mutex::new(Window {
            key,
            pd,
            kind,
            bound: None,
        })));
        key
    }

    /// Frees the memory window whose key has `key`'s index (a bound window is unbound first;
    /// peers using its key get remote access errors). `None` when there is no window there.
    /// Copies through it hold an [`MrGuard`], so this waits for them.
    pub fn dealloc_mw(&self, key: u32) -> Option<MwInfo> {
        let mut slots = self.write();
        let s = slots.get_mut((key >> 8) as usize)?;
        let w = s.mw.take()?;
        let info = *w.lock();
        // the next window or region in this slot gets a tag no window key had
        s.tag = info.key as u8;
        Some(info)
    }

    /// The memory window whose key has `key`'s index.
    pub fn mw(&self, key: u32) -> Option<MwInfo> {
        let g = self.read();
        let w = g.0.get((key >> 8) as usize)?.mw.as_ref()?;
        let info = *w.lock();
        Some(info)
    }

    /// Looks a region up by key.
    pub fn get(&self, key: u32) -> Option<MrInfo> {
        self.read().lookup(key)
    }

    /// Holds the table for checks and copies; regions cannot be removed meanwhile. Guards of
    /// several tables may be held at once in any order (recursive reads never wait for writers).
    pub fn read(&self) -> MrGuard<'_> {
        let copy = &self.copies[crate::counters::shard() % self.copies.len()];
        MrGuard(copy.0.read_recursive())
    }

    /// Every copy, write-locked in order (see [`TableWrite`]).
    fn write(&self) -> TableWrite<'_> {
        TableWrite(self.copies.iter().map(|c| c.0.write()).collect())
    }
}

/// The tag after `t`, never 0: a region's or window's key then never equals the `op` word of a
/// UMR's repeated-block header (0x400), where a KLM list has its first entry's key.
fn next_tag(t: u8) -> u8 {
    t.wrapping_add(1).max(1)
}

/// The index of a free slot, pushing one when none is.
fn free_slot(slots: &mut Vec<Slot>) -> usize {
    slots.iter().position(Slot::is_free).unwrap_or_else(|| {
        slots.push(Slot::default());
        slots.len() - 1
    })
}

/// A read hold on an [`MrTable`].
pub struct MrGuard<'a>(RwLockReadGuard<'a, Vec<Slot>>);

impl MrGuard<'_> {
    fn lookup(&self, key: u32) -> Option<MrInfo> {
        self.slot(key).and_then(|s| s.mr)
    }

    fn slot(&self, key: u32) -> Option<&Slot> {
        self.0
            .get((key >> 8) as usize)
            .filter(|s| s.mr.is_some_and(|m| m.key == key))
    }

    /// Checks that `addr..addr+len` lies in the region of `key`, in `pd`, with rights `need`:
    /// one contiguous range (through an indirect mkey, the range must lie in one of its
    /// entries; [`MrGuard::resolve`] gives the pieces of any range).
    pub fn check(
        &self,
        pd: PdId,
        need: Access,
        key: u32,
        addr: u64,
        len: u64,
    ) -> Result<MemRange, AccessError> {
        if self.is_indirect(key) {
            return self.check_one(pd, need, key, addr, len);
        }
        self.check_region(pd, need, key, addr, len)
    }

    /// [`MrGuard::check`] of a region's key.
    fn check_region(
        &self,
        pd: PdId,
        need: Access,
        key: u32,
        addr: u64,
        len: u64,
    ) -> Result<MemRange, AccessError> {
        let slot = self.slot(key).ok_or(AccessError::BadKey(key))?;
        let mr = slot.mr.ok_or(AccessError::BadKey(key))?;
        if mr.pd != pd {
            return Err(AccessError::WrongPd(key));
        }
        if !mr.covers(addr, len) {
            return Err(AccessError::OutOfRange { key, addr, len });
        }
        if !mr.access.contains(need) {
            return Err(AccessError::MissingRight { key, need });
        }
        Ok(MemRange {
            addr,
            len,
            dev: slot.dev.clone(),
        })
    }

    fn window(&self, key: u32) -> Option<&Arc<Mutex<Window>>> {
        self.0.get((key >> 8) as usize)?.mw.as_ref()
    }

    /// Checks a remote access through `key` by the responder QP `qpn` of `pd`: a region's key
    /// as [`MrGuard::check`] does; a window's key against the window (its current key, bound,
    /// in `pd`, a type 2 window bound to `qpn`, the range inside it, the rights), then the
    /// translated range against the region it is bound to.
    pub fn check_remote(
        &self,
        pd: PdId,
        qpn: u32,
        need: Access,
        key: u32,
        addr: u64,
        len: u64,
    ) -> Result<MemRange, AccessError> {
        let Some(w) = self.window(key) else {
            return self.check(pd, need, key, addr, len);
        };
        let w = *w.lock();
        let b = match w.bound {
            Some(b) if w.key == key => b,
            _ => return Err(AccessError::BadKey(key)),
        };
        if w.pd != pd || b.qpn.is_some_and(|q| q != qpn) {
            return Err(AccessError::WrongPd(key));
        }
        if !covers(b.start, b.len, addr, len) {
            return Err(AccessError::OutOfRange { key, addr, len });
        }
        if !b.access.contains(need) {
            return Err(AccessError::MissingRight { key, need });
        }
        let mr_addr = b.mr_addr + (addr - b.start);
        // the region's own rights were checked at bind time; its range may have changed since
        // (re-registration), so only the range and the PD are checked again
        self.check(pd, Access::NONE, b.mr_key, mr_addr, len)
    }

    /// Binds or frees a memory window on behalf of QP `qpn` of `pd` (a UMR WQE), as a
    /// ConnectX checks it: the window exists and is in `pd`; a type 2 window is addressed as
    /// one (a QPN) and a type 1 window as one (no QPN); `check_free` wants it free and
    /// `check_qpn` bound to `qpn`; a bind's region is live, in `pd`, bindable, covers the
    /// range, and has local write when remote write or atomics are granted.
    pub fn bind_mw(&self, pd: PdId, qpn: u32, req: &MwRequest) -> Result<MwInfo, MwError> {
        let key = req.key;
        let w = self.window(key).ok_or(MwError::NoWindow(key))?;
        let mut w = w.lock();
        if w.pd != pd {
            return Err(MwError::WrongPd(key));
        }
        if req.check_qpn {
            // invalidation: the exact key, a type 2 window bound to this QP
            let here = w.key == key
                && w.kind == MwType::Two
                && w.bound.is_some_and(|b| b.qpn == Some(qpn));
            if !here {
                return Err(MwError::NotBoundHere(key));
            }
        }
        if req.check_free && w.bound.is_some() {
            return Err(MwError::NotFree(key));
        }
        let Some(mut b) = req.bind else {
            w.bound = None;
            if w.kind == MwType::One {
                w.key = (w.key & !0xff) | req.variant as u32;
            }
            return Ok(*w);
        };
        match (w.kind, b.qpn) {
            (MwType::One, None) => {}
            (MwType::Two, Some(q)) if q == qpn => {}
            _ => return Err(MwError::WrongType(key)),
        }
        let bad = |why| MwError::BadRegion {
            key,
            mr_key: b.mr_key,
            why,
        };
        let mr = self.lookup(b.mr_key).ok_or(bad("no such region"))?;
        if mr.pd != pd {
            return Err(MwError::WrongPd(key));
        }
        if !mr.access.contains(Access::MW_BIND) {
            return Err(bad("registered without MW_BIND"));
        }
        if !mr.covers(b.mr_addr, b.len) {
            return Err(bad("range outside the region"));
        }
        let writes = Access(Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0);
        if b.access.0 & writes.0 != 0 && !mr.access.contains(Access::LOCAL_WRITE) {
            return Err(bad("remote write or atomics without local write"));
        }
        if b.start.checked_add(b.len).is_none() {
            return Err(bad("window range overflows"));
        }
        b.access = Access(b.access.0 & Access::REMOTE.0);
        w.key = (w.key & !0xff) | req.variant as u32;
        w.bound = Some(b);
        Ok(*w)
    }

    /// Invalidates the type 2 window `key` bound to QP `qpn` of `pd` (a peer's
    /// SEND_WITH_INV, or LOCAL_INV).
    pub fn invalidate(&self, pd: PdId, qpn: u32, key: u32) -> Result<MwInfo, MwError> {
        let req = MwRequest {
            key,
            variant: key as u8,
            bind: None,
            check_free: false,
            check_qpn: true,
        };
        self.bind_mw(pd, qpn, &req)
    }
}

/// Which side of a copy failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    /// Reading the source failed.
    #[error("source: {0}")]
    Src(DeviceMemoryError),
    /// Writing the destination failed.
    #[error("destination: {0}")]
    Dst(DeviceMemoryError),
}

/// Total length of a list of ranges.
pub(crate) fn total(r: &[MemRange]) -> u64 {
    r.iter().map(|r| r.len).sum()
}

/// Copies bytes from `src` ranges to `dst` ranges (total lengths may differ; copies the
/// shorter total). Host to host is a raw copy (memmove); anything involving device memory goes
/// through the ranges' [`DeviceMemory`]. Returns bytes copied, or which side failed (bytes
/// before the failure may have been copied, as with a DMA that faults half-way).
///
/// # Safety
/// Every host range must be live host memory: checked by an [`MrGuard`] still held by the
/// caller, or a buffer the caller owns.
pub unsafe fn copy_ranges(dst: &[MemRange], src: &[MemRange]) -> Result<u64, CopyError> {
    let mut bounce = Vec::new();
    pieces_of(dst, src, |d, doff, s, soff, n| {
        // SAFETY: both ranges are live per the caller's contract, and n stays within each.
        unsafe { copy_piece(d, doff, s, soff, n, &mut bounce) }
    })
}

/// As [`copy_ranges`] for ranges that all lie in one [`DeviceMemory`] (the same object),
/// with no piece overlapping its source: every piece is queued
/// ([`DeviceMemory::copy_queued`]), complete at that memory's next call other than a queued
/// one, or at its [`DeviceMemory::settle`]. Returns the memory, or `None` when nothing is
/// left queued: the ranges are not of that kind (host memory, two memories, an overlap, no
/// bytes), or the driver refused to queue a piece (pieces queued before it may land); the
/// caller then copies with [`copy_ranges`], which finds the side that fails. No host memory
/// is touched, so no guard needs to outlive the call: a region's removal settles its memory.
pub fn copy_ranges_queued(dst: &[MemRange], src: &[MemRange]) -> Option<Arc<dyn DeviceMemory>> {
    let mem = dst.first()?.dev.clone()?;
    let one = |r: &MemRange| r.dev.as_ref().is_some_and(|m| same_memory(m, &mem));
    if !dst.iter().chain(src).all(one) {
        return None;
    }
    let mut pieces: smallvec::SmallVec<[(u64, u64, usize); 4]> = smallvec::SmallVec::new();
    pieces_of(dst, src, |d, doff, s, soff, n| {
        let (da, sa) = (d.addr + doff, s.addr + soff);
        if sa < da + n && da < sa + n {
            return Err(());
        }
        pieces.push((da, sa, n as usize));
        Ok(())
    })
    .ok()?;
    if pieces.is_empty() {
        return None;
    }
    for (da, sa, n) in pieces {
        if let Err(e) = mem.copy_queued(da, sa, n) {
            tracing::debug!(error = %e, "a device-to-device copy could not be queued");
            return None;
        }
    }
    Some(mem)
}

/// Calls `f(d, doff, s, soff, n)` for each piece of a copy from `src` to `dst` (each piece
/// inside one range of each list, up to the shorter total); the bytes it covers.
fn pieces_of<E>(
    dst: &[MemRange],
    src: &[MemRange],
    mut f: impl FnMut(&MemRange, u64, &MemRange, u64, u64) -> Result<(), E>,
) -> Result<u64, E> {
    let (mut di, mut doff, mut si, mut soff, mut total) = (0, 0u64, 0, 0u64, 0u64);
    while di < dst.len() && si < src.len() {
        let (d, s) = (&dst[di], &src[si]);
        let n = (d.len - doff).min(s.len - soff);
        if n > 0 {
            f(d, doff, s, soff, n)?;
        }
        total += n;
        doff += n;
        soff += n;
        if doff == d.len {
            di += 1;
            doff = 0;
        }
        if soff == s.len {
            si += 1;
            soff = 0;
        }
    }
    Ok(total)
}

/// Copies `n` bytes from `s` at `soff` to `d` at `doff`.
///
/// # Safety
/// As [`copy_ranges`], with both pieces inside their ranges.
unsafe fn copy_piece(
    d: &MemRange,
    doff: u64,
    s: &MemRange,
    soff: u64,
    n: u64,
    bounce: &mut Vec<u8>,
) -> Result<(), CopyError> {
    let (da, sa, len) = (d.addr + doff, s.addr + soff, n as usize);
    match (&d.dev, &s.dev) {
        (None, None) => {
            // SAFETY: both are live host memory per the contract; `copy` tolerates overlap (a
            // region written into itself).
            unsafe { std::ptr::copy(sa as *const u8, da as *mut u8, len) };
            Ok(())
        }
        (Some(dm), None) => {
            // SAFETY: the host side is live host memory per the contract, `len` bytes.
            unsafe { dm.write_from_host(da, sa as *const u8, len) }.map_err(CopyError::Dst)
        }
        (None, Some(sm)) => {
            // SAFETY: the host side is live host memory per the contract, `len` bytes.
            unsafe { sm.read_to_host(sa, da as *mut u8, len) }.map_err(CopyError::Src)
        }
        (Some(dm), Some(sm)) => {
            let same = same_memory(dm, sm);
            let overlap = sa < da + n && da < sa + n;
            if same && !overlap && dm.copy(da, sa, len).is_ok() {
                return Ok(());
            }
            // Different memories, a range moved within itself, or a failed device-to-device
            // copy (which cannot say which side failed: redone through the host, it fails on
            // its side, or succeeds): through the host, chunk by chunk, backwards when the
            // destination is above an overlapping source (memmove).
            bounce.resize(len.min(BOUNCE), 0);
            let chunks = len.div_ceil(BOUNCE);
            for i in 0..chunks {
                let i = if same && overlap && da > sa {
                    chunks - 1 - i
                } else {
                    i
                };
                let at = i * BOUNCE;
                let k = (len - at).min(BOUNCE);
                sm.read(sa + at as u64, &mut bounce[..k])
                    .map_err(CopyError::Src)?;
                dm.write(da + at as u64, &bounce[..k])
                    .map_err(CopyError::Dst)?;
            }
            Ok(())
        }
    }
}

/// Copies `out.len()` bytes at offset `off` of range `r` into `out`.
///
/// # Safety
/// A host `r` must be live host memory (checked under a guard still held), and
/// `off + out.len() <= r.len`.
pub unsafe fn read_range(r: &MemRange, off: u64, out: &mut [u8]) -> Result<(), DeviceMemoryError> {
    match &r.dev {
        Some(m) => m.read(r.addr + off, out),
        None => {
            // SAFETY: per the contract; the source may be written concurrently (DMA semantics):
            // it is copied raw, never referenced.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (r.addr + off) as *const u8,
                    out.as_mut_ptr(),
                    out.len(),
                )
            };
            Ok(())
        }
    }
}

/// Copies `bytes` to offset `off` of range `r`.
///
/// # Safety
/// A host `r` must be live host memory (checked under a guard still held), and
/// `off + bytes.len() <= r.len`.
pub unsafe fn write_range(r: &MemRange, off: u64, bytes: &[u8]) -> Result<(), DeviceMemoryError> {
    match &r.dev {
        Some(m) => m.write(r.addr + off, bytes),
        None => {
            // SAFETY: per the contract; `copy` tolerates a source inside the same memory.
            unsafe { std::ptr::copy(bytes.as_ptr(), (r.addr + off) as *mut u8, bytes.len()) };
            Ok(())
        }
    }
}

/// Copies `bytes` to offset `off` of range `r` as [`write_range`] does, except that in device
/// memory the write may be left queued ([`DeviceMemory::write_queued`]): complete before any
/// other access to that memory, and before [`settle_queued`] returns. For the middle of a
/// message whose arrival nothing reports yet; whatever reports it (a packet the responder
/// sends, a completion) comes after [`settle_queued`] or after another access.
///
/// # Safety
/// As for [`write_range`].
pub unsafe fn write_range_queued(
    r: &MemRange,
    off: u64,
    bytes: &[u8],
) -> Result<(), DeviceMemoryError> {
    let Some(m) = &r.dev else {
        // SAFETY: per the contract.
        return unsafe { write_range(r, off, bytes) };
    };
    m.write_queued(r.addr + off, bytes)?;
    let mut q = QUEUED.lock();
    if !q.iter().any(|x| same_memory(x, m)) {
        q.push(m.clone());
    }
    ANY_QUEUED.store(true, std::sync::atomic::Ordering::Release);
    Ok(())
}

/// Device memories that may hold queued writes ([`write_range_queued`]).
static QUEUED: Mutex<Vec<Arc<dyn DeviceMemory>>> = Mutex::new(Vec::new());
/// Whether [`QUEUED`] may be non-empty (read without the lock on every reply).
static ANY_QUEUED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Completes every queued write of the process ([`write_range_queued`]). A failure (a queued
/// write that failed) is returned once; the memory it belongs to fails every later access.
pub fn settle_queued() -> Result<(), DeviceMemoryError> {
    if !ANY_QUEUED.load(std::sync::atomic::Ordering::Acquire) {
        return Ok(());
    }
    let mems = {
        let mut q = QUEUED.lock();
        ANY_QUEUED.store(false, std::sync::atomic::Ordering::Release);
        std::mem::take(&mut *q)
    };
    mems.iter().map(|m| m.settle()).fold(Ok(()), Result::and)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_ranges_rights_and_stale_keys() {
        let t = MrTable::default();
        let pd = PdId(1);
        let a = t.insert(
            pd,
            0x1000,
            0x100,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            None,
        );
        let g = t.read();
        assert_eq!(
            g.check(pd, Access::REMOTE_WRITE, a.key, 0x1080, 0x80),
            Ok(MemRange::host(0x1080, 0x80))
        );
        assert_eq!(
            g.check(pd, Access::REMOTE_WRITE, a.key, 0x1080, 0x81),
            Err(AccessError::OutOfRange {
                key: a.key,
                addr: 0x1080,
                len: 0x81
            })
        );
        assert_eq!(
            g.check(pd, Access::REMOTE_READ, a.key, 0x1000, 1),
            Err(AccessError::MissingRight {
                key: a.key,
                need: Access::REMOTE_READ
            })
        );
        assert_eq!(
            g.check(PdId(2), Access::NONE, a.key, 0x1000, 1),
            Err(AccessError::WrongPd(a.key))
        );
        drop(g);
        assert!(t.remove(a.key).is_some());
        assert!(t.remove(a.key).is_none());
        let b = t.insert(pd, 0x1000, 0x100, Access::NONE, None);
        assert_ne!(a.key, b.key, "reused slot gets a new tag");
        assert_eq!(
            t.read().check(pd, Access::NONE, a.key, 0x1000, 1),
            Err(AccessError::BadKey(a.key))
        );
    }

    #[test]
    fn scatter_gather_copy() {
        let src = *b"abcdefghij";
        let mut dst = [0u8; 10];
        let s = [
            MemRange::host(src.as_ptr() as u64, 3),
            MemRange::host(src.as_ptr() as u64 + 3, 7),
        ];
        let d = [
            MemRange::host(dst.as_mut_ptr() as u64, 5),
            MemRange::host(dst.as_mut_ptr() as u64 + 5, 5),
        ];
        // SAFETY: the ranges are the two local arrays.
        let n = unsafe { copy_ranges(&d, &s) };
        assert_eq!((n, &dst), (Ok(10), b"abcdefghij"));
    }

    #[test]
    fn copies_dispatch_on_the_memory_kind() {
        use crate::devmem::SimDeviceMemory;
        let (g1, g2) = (SimDeviceMemory::new(1 << 21), SimDeviceMemory::new(4096));
        let (b1, b2) = (g1.base(), g2.base());
        let dev = |m: &Arc<SimDeviceMemory>, addr, len| MemRange {
            addr,
            len,
            dev: Some(m.clone() as Arc<dyn DeviceMemory>),
        };
        let host = *b"0123456789";
        let mut back = [0u8; 10];
        let h = |a: &[u8]| MemRange::host(a.as_ptr() as u64, a.len() as u64);
        // SAFETY: every host range below is one of the local arrays.
        unsafe {
            // host -> device, scattered over two memories
            let n = copy_ranges(&[dev(&g1, b1, 4), dev(&g2, b2, 6)], &[h(&host)]);
            assert_eq!(n, Ok(10));
            // device -> device within one memory: one copy call
            copy_ranges(&[dev(&g1, b1 + 100, 4)], &[dev(&g1, b1, 4)]).unwrap();
            assert_eq!(g1.counts().copies, 1);
            // across memories: through the host
            copy_ranges(&[dev(&g1, b1 + 104, 6)], &[dev(&g2, b2, 6)]).unwrap();
            // device -> host
            let bh = MemRange::host(back.as_mut_ptr() as u64, 10);
            copy_ranges(&[bh], &[dev(&g1, b1 + 100, 10)]).unwrap();
        }
        assert_eq!(&back, b"0123456789");
        // overlapping move within one memory, larger than a bounce chunk, upwards
        let pat: Vec<u8> = (0..BOUNCE + 1000).map(|i| (i % 251) as u8).collect();
        g1.poke(b1, &pat);
        // SAFETY: no host ranges.
        unsafe {
            copy_ranges(
                &[dev(&g1, b1 + 10, pat.len() as u64)],
                &[dev(&g1, b1, pat.len() as u64)],
            )
        }
        .unwrap();
        assert_eq!(g1.peek(b1 + 10, pat.len()), pat);
        // failures name their side
        g2.fail_range(b2, 1);
        // SAFETY: `back` is a local array.
        let e = unsafe {
            copy_ranges(
                &[MemRange::host(back.as_mut_ptr() as u64, 4)],
                &[dev(&g2, b2, 4)],
            )
        };
        assert!(matches!(e, Err(CopyError::Src(_))), "{e:?}");
        // SAFETY: no host ranges.
        let e = unsafe { copy_ranges(&[dev(&g2, b2, 4)], &[dev(&g1, b1, 4)]) };
        assert!(matches!(e, Err(CopyError::Dst(_))), "{e:?}");
        // within one memory, a failed copy is redone through the host to name its side
        g1.fail_range(b1 + 8, 1);
        // SAFETY: no host ranges.
        let e = unsafe { copy_ranges(&[dev(&g1, b1 + 100, 16)], &[dev(&g1, b1, 16)]) };
        assert!(matches!(e, Err(CopyError::Src(_))), "{e:?}");
        // SAFETY: no host ranges.
        let e = unsafe { copy_ranges(&[dev(&g1, b1, 16)], &[dev(&g1, b1 + 100, 16)]) };
        assert!(matches!(e, Err(CopyError::Dst(_))), "{e:?}");
    }
}
