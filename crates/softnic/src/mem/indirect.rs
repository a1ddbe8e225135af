//! Indirect mkeys (KLM mode, as `mlx5dv_create_mkey` makes them through DEVX CREATE_MKEY): a
//! key whose address range maps, piece by piece, onto other regions. It is created free; a UMR
//! WQE gives it rights, a length and a layout — a list of (key, address, length) entries, or a
//! block of strided entries repeated — or frees it again (LOCAL_INV, or a peer's SEND_WITH_INV
//! when it was created with remote invalidation). An access through it is split into the
//! pieces it covers, and each piece is checked against its own region as any access is.
//!
//! Not implemented (refused, never misread): an entry naming another indirect mkey, signature
//! and crypto mkeys, and, where one contiguous range is needed (a remote READ or WRITE, an
//! atomic), an access that spans two entries.

use super::{Access, AccessError, MemRange, MrGuard, MrTable, PdId, Slot};
use parking_lot::Mutex;
use prm::parse::{Layout, UmrOp};
use prm::wqe::{
    MKEY_ACCESS_ATOMIC, MKEY_ACCESS_LOCAL_WRITE, MKEY_ACCESS_REMOTE_READ, MKEY_ACCESS_REMOTE_WRITE,
    UMR_MASK_ACCESS, UMR_MASK_LEN, UMR_MASK_START_ADDR,
};
use std::sync::Arc;

/// Most pieces one access may be split into. A ConnectX walks any layout; the soft NIC keeps a
/// list of the pieces, so a pathological layout (1-byte entries under a 2 GiB access) is
/// refused as an access out of range rather than allocated.
pub const MAX_PIECES: usize = 1 << 16;

/// How an indirect mkey is created (the mkey context of CREATE_MKEY).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndirectConfig {
    /// Owning PD.
    pub pd: PdId,
    /// The key's low byte (`mkey_7_0`).
    pub variant: u8,
    /// The QP it is bound to; `0xff_ffff` for any.
    pub qpn: u32,
    /// Translation entries the layout may have (`translations_octword_size`).
    pub max_entries: u32,
    /// A peer's SEND_WITH_INV may free it (`en_rinval`).
    pub remote_invalidate: bool,
    /// Rights while it is valid, until a UMR changes them.
    pub access: Access,
    /// Its first address, until a UMR changes it.
    pub start: u64,
}

/// One piece of a list layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    key: u32,
    addr: u64,
    len: u64,
}

/// One entry of a repeated block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Strided {
    key: u32,
    addr: u64,
    len: u64,
    stride: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Map {
    List(Vec<Piece>),
    Repeat { count: u64, block: Vec<Strided> },
}

/// An indirect mkey as the device records it.
#[derive(Clone, Debug)]
pub(super) struct Indirect {
    key: u32,
    cfg: IndirectConfig,
    access: Access,
    start: u64,
    len: u64,
    /// The layout; `None` while the mkey is free.
    map: Option<Map>,
}

/// Why a UMR on an indirect mkey, or its invalidation, was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UmrError {
    /// The key names no indirect mkey (or a stale one).
    #[error("no indirect mkey with key {0:#x}")]
    NoMkey(u32),
    /// The mkey and the QP are in different PDs, or the mkey belongs to another QP.
    #[error("mkey {0:#x} does not belong to this QP's PD or QP")]
    NotHere(u32),
    /// A peer asked to invalidate an mkey created without remote invalidation.
    #[error("mkey {0:#x} was not created for remote invalidation")]
    NoRemoteInvalidate(u32),
    /// The mkey must be free and is not.
    #[error("mkey {0:#x} is in use")]
    NotFree(u32),
    /// The layout is missing, longer than the mkey was created for, shorter than its length,
    /// or names another indirect mkey.
    #[error("mkey {key:#x}: bad layout ({why})")]
    BadLayout {
        /// The mkey.
        key: u32,
        /// What is wrong.
        why: &'static str,
    },
}

impl Indirect {
    /// The rights an access needs, and whether this mkey grants them.
    fn grants(&self, need: Access) -> bool {
        self.access.contains(need)
    }

    /// Calls `f(key, addr, len)` for each piece of `off..off + len` (offsets from the mkey's
    /// start, inside its length), in order.
    fn pieces(
        &self,
        off: u64,
        len: u64,
        mut f: impl FnMut(u32, u64, u64) -> Result<(), AccessError>,
    ) -> Result<(), AccessError> {
        let Some(map) = &self.map else {
            return Err(AccessError::BadKey(self.key));
        };
        let (mut at, end) = (off, off + len);
        let mut emit = |key: u32, addr: u64, plen: u64, pos: u64| -> Result<(), AccessError> {
            // the part of [pos, pos + plen) inside [at, end)
            let a = at.max(pos);
            let e = end.min(pos + plen);
            if a < e {
                f(key, addr + (a - pos), e - a)?;
                at = e;
            }
            Ok(())
        };
        match map {
            Map::List(list) => {
                let mut pos = 0u64;
                for p in list {
                    if pos >= end {
                        break;
                    }
                    emit(p.key, p.addr, p.len, pos)?;
                    pos += p.len;
                }
            }
            Map::Repeat { count, block } => {
                let block_len: u64 = block.iter().map(|s| s.len).sum();
                let first = off / block_len;
                let mut pos = first * block_len;
                'blocks: for r in first..*count {
                    for s in block {
                        if pos >= end {
                            break 'blocks;
                        }
                        emit(s.key, s.addr + r * s.stride, s.len, pos)?;
                        pos += s.len;
                    }
                }
            }
        }
        Ok(())
    }
}

impl MrTable {
    /// Creates a free indirect mkey (DEVX CREATE_MKEY in KLM mode) and returns its key.
    pub fn create_indirect(&self, cfg: IndirectConfig) -> u32 {
        let mut slots = self.write();
        let index = super::free_slot(&mut slots);
        let slot = &mut slots[index];
        // the creator chooses the low byte; the slot's next user gets another
        slot.tag = cfg.variant;
        let key = (index as u32) << 8 | cfg.variant as u32;
        slot.ind = Some((
            key,
            Arc::new(Mutex::new(Indirect {
                key,
                cfg,
                access: cfg.access,
                start: cfg.start,
                len: 0,
                map: None,
            })),
        ));
        key
    }

    /// Destroys the indirect mkey `key`; `false` when there is none. Copies through it hold an
    /// [`MrGuard`], so this waits for them.
    pub fn destroy_indirect(&self, key: u32) -> bool {
        let mut slots = self.write();
        match slots.get_mut((key >> 8) as usize) {
            Some(s) if s.ind.as_ref().is_some_and(|i| i.0 == key) => {
                s.ind = None;
                true
            }
            _ => false,
        }
    }
}

impl Slot {
    /// The indirect mkey in this slot when its key is `key`.
    fn indirect(&self, key: u32) -> Option<&Arc<Mutex<Indirect>>> {
        self.ind.as_ref().filter(|i| i.0 == key).map(|i| &i.1)
    }
}

impl MrGuard<'_> {
    /// Whether `key` names an indirect mkey (of any state).
    pub fn is_indirect(&self, key: u32) -> bool {
        self.0
            .get((key >> 8) as usize)
            .is_some_and(|s| s.ind.is_some())
    }

    /// The checked ranges of `addr..addr+len` through `key`, in order, appended to `out`: one
    /// range for a region's key, one per piece for an indirect mkey (valid, in `pd`, granting
    /// `need`, covering the range; each piece checked against its region with `need` too).
    pub fn resolve(
        &self,
        pd: PdId,
        need: Access,
        key: u32,
        addr: u64,
        len: u64,
        out: &mut impl Extend<MemRange>,
    ) -> Result<(), AccessError> {
        let slot = self
            .0
            .get((key >> 8) as usize)
            .ok_or(AccessError::BadKey(key))?;
        let Some(ind) = slot.indirect(key) else {
            out.extend([self.check_region(pd, need, key, addr, len)?]);
            return Ok(());
        };
        let ind = ind.lock();
        if ind.map.is_none() {
            return Err(AccessError::BadKey(key));
        }
        if ind.cfg.pd != pd {
            return Err(AccessError::WrongPd(key));
        }
        if !super::covers(ind.start, ind.len, addr, len) {
            return Err(AccessError::OutOfRange { key, addr, len });
        }
        if !ind.grants(need) {
            return Err(AccessError::MissingRight { key, need });
        }
        let mut n = 0usize;
        ind.pieces(addr - ind.start, len, |k, a, l| {
            n += 1;
            if n > MAX_PIECES {
                return Err(AccessError::OutOfRange { key, addr, len });
            }
            out.extend([self.check_region(pd, need, k, a, l)?]);
            Ok(())
        })
    }

    /// One contiguous checked range through `key`: [`MrGuard::resolve`] when it gives exactly
    /// one piece (a region's key, or a range inside one entry of an indirect mkey).
    pub(super) fn check_one(
        &self,
        pd: PdId,
        need: Access,
        key: u32,
        addr: u64,
        len: u64,
    ) -> Result<MemRange, AccessError> {
        let mut v: smallvec::SmallVec<[MemRange; 2]> = smallvec::SmallVec::new();
        self.resolve(pd, need, key, addr, len, &mut v)?;
        match v.len() {
            1 => Ok(v.pop().expect("one")),
            0 => Ok(MemRange::empty()),
            _ => Err(AccessError::Split { key, addr, len }),
        }
    }

    /// The indirect mkey `key`, when it is in `pd` and, where `qpn` is given, not bound to
    /// another QP.
    fn indirect_here(
        &self,
        pd: PdId,
        qpn: Option<u32>,
        key: u32,
    ) -> Result<&Arc<Mutex<Indirect>>, UmrError> {
        let ind = self
            .0
            .get((key >> 8) as usize)
            .and_then(|s| s.indirect(key))
            .ok_or(UmrError::NoMkey(key))?;
        let (owner, in_pd) = {
            let i = ind.lock();
            (i.cfg.qpn, i.cfg.pd == pd)
        };
        if !in_pd || qpn.is_some_and(|q| owner != 0xff_ffff && owner != q) {
            return Err(UmrError::NotHere(key));
        }
        Ok(ind)
    }

    /// Runs a UMR on the indirect mkey it names, posted by QP `qpn` of `pd`: frees it, or
    /// gives it (with the fields the mask names) rights, a first address, a length and the
    /// layout the WQE carries.
    pub fn umr_indirect(&self, pd: PdId, qpn: u32, op: &UmrOp<'_>) -> Result<(), UmrError> {
        let key = op.key;
        let ind = self.indirect_here(pd, op.check_qpn().then_some(qpn), key)?;
        let mut ind = ind.lock();
        if op.check_free() && ind.map.is_some() {
            return Err(UmrError::NotFree(key));
        }
        if op.frees() {
            ind.map = None;
            return Ok(());
        }
        let bad = |why| UmrError::BadLayout { key, why };
        let mut access = ind.access;
        if op.mask & UMR_MASK_ACCESS != 0 {
            let f = op.ctx.access_flags;
            let bit = |b: u8, a: Access| if f & b != 0 { a.0 } else { 0 };
            access = Access(
                bit(MKEY_ACCESS_LOCAL_WRITE, Access::LOCAL_WRITE)
                    | bit(MKEY_ACCESS_REMOTE_READ, Access::REMOTE_READ)
                    | bit(MKEY_ACCESS_REMOTE_WRITE, Access::REMOTE_WRITE)
                    | bit(MKEY_ACCESS_ATOMIC, Access::REMOTE_ATOMIC),
            );
        }
        let start = if op.mask & UMR_MASK_START_ADDR != 0 {
            op.ctx.start_addr.get()
        } else {
            ind.start
        };
        if op.mask & UMR_MASK_LEN == 0 {
            return Err(bad("no length"));
        }
        let len = op.ctx.len.get();
        if start.checked_add(len).is_none() {
            return Err(bad("range overflows"));
        }
        let layout = op.layout().ok_or(bad("no inline translation"))?;
        let nested = |k: u32| self.is_indirect(k);
        let map = match layout {
            Layout::List(klms) => {
                // entries until the length is reached; the rest is padding
                let mut list = Vec::new();
                let mut sum = 0u64;
                for k in klms {
                    if sum >= len {
                        break;
                    }
                    let n = k.byte_count.get() as u64;
                    if n == 0 {
                        continue;
                    }
                    if nested(k.mkey.get()) {
                        return Err(bad("an entry names an indirect mkey"));
                    }
                    list.push(Piece {
                        key: k.mkey.get(),
                        addr: k.address.get(),
                        len: n,
                    });
                    sum += n;
                }
                if list.len() as u64 > ind.cfg.max_entries as u64 {
                    return Err(bad("more entries than the mkey was created for"));
                }
                if sum != len {
                    return Err(bad("the entries do not add up to the length"));
                }
                Map::List(list)
            }
            Layout::Repeat {
                count,
                block_len,
                entries,
            } => {
                if entries.len() as u64 + 1 > ind.cfg.max_entries as u64 {
                    return Err(bad("more entries than the mkey was created for"));
                }
                let block: Vec<Strided> = entries
                    .iter()
                    .map(|e| Strided {
                        key: e.memkey.get(),
                        addr: e.va.get(),
                        len: e.byte_count.get() as u64,
                        stride: e.stride.get() as u64,
                    })
                    .collect();
                if block.iter().any(|s| nested(s.key)) {
                    return Err(bad("an entry names an indirect mkey"));
                }
                let sum: u64 = block.iter().map(|s| s.len).sum();
                if sum == 0 || sum != block_len as u64 {
                    return Err(bad("the block's entries do not add up to its length"));
                }
                if sum * count as u64 != len {
                    return Err(bad("the repeated blocks do not add up to the length"));
                }
                Map::Repeat {
                    count: count as u64,
                    block,
                }
            }
        };
        ind.access = access;
        ind.start = start;
        ind.len = len;
        ind.map = Some(map);
        Ok(())
    }

    /// A peer's SEND_WITH_INV of the indirect mkey `key` at the responder QP `qpn` of `pd`:
    /// frees it when it was created for remote invalidation.
    pub fn invalidate_indirect(&self, pd: PdId, qpn: u32, key: u32) -> Result<(), UmrError> {
        let ind = self.indirect_here(pd, Some(qpn), key)?;
        let mut ind = ind.lock();
        if !ind.cfg.remote_invalidate {
            return Err(UmrError::NoRemoteInvalidate(key));
        }
        ind.map = None;
        Ok(())
    }
}
