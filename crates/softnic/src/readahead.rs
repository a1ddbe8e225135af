//! Reading ahead the sources of wire-bound WRITEs and SENDs: when the engine takes such a WQE
//! whose source has device memory, the sources of the WQEs announced behind it are read with
//! it, one [`crate::devmem::DeviceMemory::read_many`] per device memory, and kept per WQE
//! ([`crate::staged`]) until their turn. Only WQEs already at hand are looked at (a ring in
//! host memory, or the blocks read ahead of a ring in device memory): never a read of the ring
//! for this.

use crate::counters::Counters;
use crate::devmem::same_memory;
use crate::gather::gather;
use crate::mem::{total, MemRange, MrGuard};
use crate::qp::{Qp, SqState, Transport};
use crate::shared::Shared;
use crate::staged::{self, StagedSrc, STAGE_MAX};
use prm::parse::{parse_wqe, parse_xrc_wqe, ParsedLocal, ParsedOp};
use prm::wqe::{blocks_for_ds, CtrlSeg, Fence};
use prm::{DS_UNIT, MAX_WQE_BBS, WQEBB};
use smallvec::SmallVec;
use std::sync::Arc;

/// A WQE whose source a batch reads.
struct Ahead {
    idx: u16,
    blocks: u16,
    src: SmallVec<[MemRange; 4]>,
}

/// Reads the source `src` of the WQE being run (at the consumer index) together with those of
/// the WQEs announced behind it ([`scan_ahead`]), one batched read per device memory; keeps
/// theirs in [`SqState::staged`] (a WQE whose part failed keeps its error, one whose part
/// came after a failure is not kept: it is read at its turn) and returns its own.
pub(crate) fn stage_batch(
    dev: &Shared,
    qp: &Qp,
    sq: &mut SqState,
    g: &MrGuard<'_>,
    wqe: &prm::ParsedWqe<'_>,
    src: &SmallVec<[MemRange; 4]>,
) -> Result<Vec<u8>, crate::DeviceMemoryError> {
    let (idx, ci, target) = (sq.ci, sq.ci, sq.target);
    let blocks = blocks_for_ds(wqe.ds.max(1)) as u16;
    let mut batch = vec![Ahead {
        idx,
        blocks,
        src: src.clone(),
    }];
    if matches!(
        qp.transport,
        Transport::Rc | Transport::Uc | Transport::XrcIni
    ) {
        // after what is kept already (read by an earlier batch), else after this WQE
        let from = sq
            .staged
            .end()
            .filter(|e| e.wrapping_sub(ci) <= target.wrapping_sub(ci))
            .unwrap_or(idx.wrapping_add(blocks));
        scan_ahead(qp, sq, g, from, &mut batch);
    }
    let mut read = read_sources(&batch).into_iter();
    if batch.len() > 1 {
        Counters::add(&dev.counters.staged_batches, 1);
        Counters::add(&dev.counters.staged_wqes, batch.len() as u64);
    }
    let mine = read.next().flatten();
    for (a, bytes) in batch.into_iter().skip(1).zip(read) {
        if let Some(bytes) = bytes {
            sq.staged.push(StagedSrc {
                idx: a.idx,
                blocks: a.blocks,
                src: a.src,
                bytes,
            });
        }
    }
    // its parts come first in every read: never left unread, read alone all the same
    mine.unwrap_or_else(|| read_one(src))
}

/// Adds to `batch` the WQEs announced from `at` on whose sources may be read now: WRITEs and
/// SENDs with device memory in their gather lists, their keys checked under `g` as `prepare`
/// checks them, up to [`staged::MAX_WQES`] WQEs and [`staged::MAX_BYTES`] bytes kept. It
/// passes NOPs and inline sources and stops at the first WQE it cannot take: one whose check
/// fails (it fails at its turn), one not wholly at hand ([`peek_wqe`]), a READ, an atomic, a
/// WAIT, a UMR (each may change what a later source holds, or when it may be read), and a
/// fenced one while a READ or atomic is on the wire.
fn scan_ahead(qp: &Qp, sq: &SqState, g: &MrGuard<'_>, mut at: u16, batch: &mut Vec<Ahead>) {
    let mut buf = [0u8; MAX_WQE_BBS * WQEBB];
    let mut bytes = sq.staged.bytes();
    let window = sq.target.wrapping_sub(sq.ci);
    let mut looked = 0;
    while at.wrapping_sub(sq.ci) < window
        && batch.len() + sq.staged.len() < staged::MAX_WQES
        && looked < 2 * staged::MAX_WQES
    {
        looked += 1;
        let Some(blocks) = peek_wqe(qp, sq, at, &mut buf) else {
            break;
        };
        let bytes_of = &buf[..blocks * WQEBB];
        let parsed = match qp.transport {
            Transport::XrcIni => parse_xrc_wqe(bytes_of).map(|(w, _)| w),
            _ => parse_wqe(bytes_of),
        };
        let Ok(w) = parsed else { break };
        if w.flags.fence != Fence::None && reads_on_wire(sq) {
            break;
        }
        match &w.op {
            ParsedOp::Nop => {}
            ParsedOp::Write {
                local: l @ ParsedLocal::Sges(_),
                ..
            }
            | ParsedOp::Send {
                local: l @ ParsedLocal::Sges(_),
            } => {
                let Ok(src) = gather(g, qp, l) else { break };
                let len = total(&src);
                if len <= STAGE_MAX && src.iter().any(|r| !r.is_host()) {
                    if bytes + len > staged::MAX_BYTES {
                        break;
                    }
                    bytes += len;
                    batch.push(Ahead {
                        idx: at,
                        blocks: blocks as u16,
                        src,
                    });
                }
            }
            ParsedOp::Write { .. } | ParsedOp::Send { .. } => {}
            _ => break,
        }
        at = at.wrapping_add(blocks as u16);
    }
}

/// Whether a READ or an atomic is on the wire (a fence waits for them).
fn reads_on_wire(sq: &SqState) -> bool {
    sq.wire.as_ref().is_some_and(|w| {
        w.msgs.iter().any(|m| {
            matches!(
                m.op,
                crate::rc_state::OutOp::Read { .. } | crate::rc_state::OutOp::Atomic { .. }
            )
        })
    })
}

/// The WQE at `idx`, announced and behind the one being run, into `buf`, without a read of
/// device memory: from a ring in host memory, or from the blocks read ahead of a ring in
/// device memory ([`SqState::ahead`]; `None` when it is not wholly there). Its blocks, if it
/// is a WQE of this QP at this index that ends before the producer.
fn peek_wqe(qp: &Qp, sq: &SqState, idx: u16, buf: &mut [u8; MAX_WQE_BBS * WQEBB]) -> Option<usize> {
    let ring = &qp.sq_ring;
    let mask = qp.sq_blocks as usize - 1;
    let copy = |buf: &mut [u8], n: usize| -> Option<()> {
        if ring.is_host() {
            for (i, b) in buf[..n * WQEBB].chunks_mut(WQEBB).enumerate() {
                ring.try_read(((idx as usize + i) & mask) * WQEBB, b).ok()?;
            }
        } else {
            if sq.ahead_blocks(idx) < n {
                return None;
            }
            let off = idx.wrapping_sub(sq.ahead.start) as usize * WQEBB;
            buf[..n * WQEBB].copy_from_slice(sq.ahead.bytes.get(off..off + n * WQEBB)?);
        }
        Some(())
    };
    copy(buf, 1)?;
    let ctrl: CtrlSeg = bytemuck::pod_read_unaligned(&buf[..DS_UNIT]);
    let blocks = blocks_for_ds(ctrl.ds().max(1));
    let fits = blocks <= MAX_WQE_BBS
        && blocks <= qp.sq_blocks as usize
        && blocks <= sq.target.wrapping_sub(idx) as usize;
    if ctrl.wqe_index() != idx || ctrl.qpn() != qp.qpn || !fits {
        return None;
    }
    copy(buf, blocks)?;
    Some(blocks)
}

/// Reads the sources of `batch`, each into a buffer of its length: host ranges by a copy,
/// device ranges with one [`crate::devmem::DeviceMemory::read_many`] per device memory. Per
/// WQE: its bytes, the error of its part that failed, or `None` when a part of it came after
/// another WQE's failure (not read).
fn read_sources(batch: &[Ahead]) -> Vec<Option<Result<Vec<u8>, crate::DeviceMemoryError>>> {
    type Parts<'a> = (
        Arc<dyn crate::DeviceMemory>,
        Vec<(u64, &'a mut [u8])>,
        Vec<usize>,
    );
    let mut outs: Vec<Vec<u8>> = batch
        .iter()
        .map(|a| vec![0u8; total(&a.src) as usize])
        .collect();
    let mut state: Vec<Option<Result<(), crate::DeviceMemoryError>>> =
        (0..batch.len()).map(|_| Some(Ok(()))).collect();
    {
        let mut groups: Vec<Parts<'_>> = Vec::new();
        for (w, (a, out)) in batch.iter().zip(outs.iter_mut()).enumerate() {
            let mut rest = &mut out[..];
            for r in &a.src {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(r.len as usize);
                rest = tail;
                let Some(m) = &r.dev else {
                    // SAFETY: `r` was checked under the guard the caller holds; `head` is its
                    // length.
                    if let Err(e) = unsafe { crate::mem::read_range(r, 0, head) } {
                        state[w] = Some(Err(e));
                    }
                    continue;
                };
                let k = match groups.iter().position(|(d, ..)| same_memory(d, m)) {
                    Some(k) => k,
                    None => {
                        groups.push((m.clone(), Vec::new(), Vec::new()));
                        groups.len() - 1
                    }
                };
                groups[k].1.push((r.addr, head));
                groups[k].2.push(w);
            }
        }
        for (m, mut parts, owner) in groups {
            let Err(e) = m.read_many(&mut parts) else {
                continue;
            };
            // the parts after the failing one were not read
            let failed = owner.get(e.part).copied();
            for &w in owner.get(e.part..).unwrap_or(&owner[..]) {
                if matches!(state[w], Some(Ok(()))) {
                    state[w] = None;
                }
            }
            if let Some(w) = failed {
                state[w] = Some(Err(e.error));
            }
        }
    }
    outs.into_iter()
        .zip(state)
        .map(|(out, st)| st.map(|r| r.map(|()| out)))
        .collect()
}

/// Reads one WQE's source (`src` checked under a guard the caller holds), a copy per range.
fn read_one(src: &[MemRange]) -> Result<Vec<u8>, crate::DeviceMemoryError> {
    let mut out = vec![0u8; total(src) as usize];
    let mut at = 0usize;
    for r in src {
        let end = at + r.len as usize;
        // SAFETY: `r` was checked under the guard the caller holds; `out[at..end]` is its
        // length.
        unsafe { crate::mem::read_range(r, 0, &mut out[at..end]) }?;
        at = end;
    }
    Ok(out)
}
