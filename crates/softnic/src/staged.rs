//! Sources of wire-bound WRITEs and SENDs read ahead of their turn (device memory, one batched
//! read for many WQEs: [`crate::devmem::DeviceMemory::read_many`]), kept per WQE until the
//! engine runs it.
//!
//! An entry stands for the WQE at one 16-bit index, and is used only by that WQE while it is
//! announced and not yet run, and only if its source resolves to the very ranges the entry
//! was read from. Entries the consumer passes (or that fall outside the announced window) are
//! dropped at every step, and all of them when the QP errs, flushes or resets, so an index
//! that comes round again never meets old bytes. At most [`MAX_WQES`] entries and
//! [`MAX_BYTES`] bytes are kept.

use crate::devmem::DeviceMemoryError;
use crate::mem::MemRange;
use smallvec::SmallVec;
use std::collections::VecDeque;

/// Most WQEs whose sources one QP keeps read ahead (the WQE being run included).
pub(crate) const MAX_WQES: usize = 64;
/// Most bytes of one message whose source is read ahead for the wire (a larger one is read
/// packet by packet).
pub(crate) const STAGE_MAX: u64 = 16 << 20;
/// Most bytes of sources one QP keeps read ahead (the WQE being run not included: it is read
/// up to the per-message limit as before).
pub(crate) const MAX_BYTES: u64 = 4 << 20;

/// The source of the WQE at `idx`, read ahead.
pub(crate) struct StagedSrc {
    /// The WQE's index.
    pub idx: u16,
    /// The WQE's blocks (the next WQE starts at `idx + blocks`).
    pub blocks: u16,
    /// The checked ranges the bytes were read from.
    pub src: SmallVec<[MemRange; 4]>,
    /// The bytes, or why the device memory could not be read.
    pub bytes: Result<Vec<u8>, DeviceMemoryError>,
}

impl StagedSrc {
    fn len(&self) -> u64 {
        self.bytes.as_ref().map_or(0, |b| b.len() as u64)
    }
}

/// The sources a QP has read ahead, in WQE order.
#[derive(Default)]
pub(crate) struct Staged {
    entries: VecDeque<StagedSrc>,
    bytes: u64,
}

impl Staged {
    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes kept.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }

    /// Drops every entry outside the announced window `ci .. target`: those the consumer has
    /// passed without using them (and any that an index coming round might meet later).
    pub fn prune(&mut self, ci: u16, target: u16) {
        let window = target.wrapping_sub(ci);
        let before = self.entries.len();
        self.entries.retain(|e| e.idx.wrapping_sub(ci) < window);
        if self.entries.len() != before {
            self.bytes = self.entries.iter().map(StagedSrc::len).sum();
        }
    }

    /// Takes the entry of the WQE at `idx` (the consumer, after [`Staged::prune`]: the first
    /// entry if there is one for it) if it was read from `src`; an entry read from other
    /// ranges (the WQE's keys now resolve elsewhere) is dropped.
    pub fn take(
        &mut self,
        idx: u16,
        src: &[MemRange],
    ) -> Option<Result<Vec<u8>, DeviceMemoryError>> {
        if self.entries.front()?.idx != idx {
            return None;
        }
        let e = self.entries.pop_front()?;
        self.bytes -= e.len();
        (e.src[..] == *src).then_some(e.bytes)
    }

    /// Where the WQE after the last entry starts, if there is an entry.
    pub fn end(&self) -> Option<u16> {
        self.entries.back().map(|e| e.idx.wrapping_add(e.blocks))
    }

    /// Keeps `e` (a WQE after every entry kept).
    pub fn push(&mut self, e: StagedSrc) {
        self.bytes += e.len();
        self.entries.push_back(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(idx: u16, byte: u8) -> StagedSrc {
        StagedSrc {
            idx,
            blocks: 1,
            src: smallvec::smallvec![MemRange::host(0x1000 + idx as u64, 8)],
            bytes: Ok(vec![byte; 8]),
        }
    }

    #[test]
    fn an_entry_is_used_by_its_own_wqe_only() {
        let mut s = Staged::default();
        for i in 0..4 {
            s.push(entry(10 + i, i as u8));
        }
        assert_eq!((s.len(), s.bytes(), s.end()), (4, 32, Some(14)));
        s.prune(10, 20);
        assert_eq!(s.len(), 4);
        // not the consumer's
        assert!(s.take(11, &[MemRange::host(0x100b, 8)]).is_none());
        // the consumer's, read from other ranges: dropped
        assert!(s.take(10, &[MemRange::host(0x2000, 8)]).is_none());
        assert_eq!((s.len(), s.bytes()), (3, 24));
        let got = s.take(11, &[MemRange::host(0x100b, 8)]);
        assert_eq!(got, Some(Ok(vec![1; 8])));
        // the consumer passed WQE 12 without it
        s.prune(13, 20);
        assert_eq!(s.len(), 1);
        assert!(s.take(12, &[MemRange::host(0x100c, 8)]).is_none());
        assert_eq!(
            s.take(13, &[MemRange::host(0x100d, 8)]),
            Some(Ok(vec![3; 8]))
        );
        assert!(s.is_empty());
        assert_eq!(s.bytes(), 0);
    }

    /// The 16-bit index comes round: an entry never outlives the window it was read in, so
    /// the WQE at the same index 64K blocks later does not meet it.
    #[test]
    fn an_index_coming_round_never_meets_old_bytes() {
        let mut s = Staged::default();
        s.push(entry(5, 0xaa));
        s.push(entry(6, 0xbb));
        // the consumer runs WQE 5 from elsewhere (not taking it) and moves on, one block at a
        // time, all the way round
        let mut ci = 5u16;
        for _ in 0..0x1_0000u32 {
            ci = ci.wrapping_add(1);
            s.prune(ci, ci.wrapping_add(8));
            if ci == 6 {
                assert_eq!(s.len(), 1, "WQE 6 is still ahead");
                s.take(6, &[]);
            }
        }
        assert_eq!(ci, 5);
        assert!(s.take(5, &[MemRange::host(0x1005, 8)]).is_none());
        assert!(s.is_empty());
        // an empty window drops everything
        s.push(entry(7, 1));
        s.prune(7, 7);
        assert!(s.is_empty());
        // errors are kept like bytes (and weigh nothing)
        s.push(StagedSrc {
            bytes: Err(DeviceMemoryError("x".into())),
            ..entry(9, 0)
        });
        assert_eq!(s.bytes(), 0);
        let got = s.take(9, &[MemRange::host(0x1009, 8)]);
        assert!(matches!(got, Some(Err(_))));
        s.push(entry(1, 1));
        s.clear();
        assert!(s.is_empty() && s.bytes() == 0);
    }
}
