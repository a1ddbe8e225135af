//! The layout of a run and its checks: the jobs (one QP's work), the slots of a size ([`Plan`]),
//! each side's QPs and registered buffers ([`Side`], [`register`]), the keys the initiators use
//! ([`Keys`]), and the poison and validation of the destinations and atomic words.

use super::verb::{atomic_base, atomic_value, Verb};
use crate::{pattern, Payload};
use anyhow::{bail, Result};
use gpuverbs::{Access, CachedMr, Mr, Qp, RemoteMemory};
use std::time::Instant;

/// Destination bytes per job before slots are reused.
pub(super) const DST_CAP: u64 = 16 << 20;

/// Source bytes (per direction) before fewer source slots are used.
pub(super) const SRC_CAP: u64 = 64 << 20;

/// Byte of destination slots that no iteration writes.
pub(super) const UNTOUCHED: u8 = 0xa5;

/// One QP's work: direction 0 is A → B, 1 is B → A (with --bidir).
#[derive(Clone, Copy, Debug)]
pub(super) struct Job {
    pub(super) dir: usize,
    /// QP index within its side.
    pub(super) k: usize,
    /// Threads that drive it (1 for the CPU).
    pub(super) workers: u32,
}

impl Job {
    /// The side that holds the job's destination slots and checks them: the target of a WRITE
    /// or SEND, the initiator of a READ or an atomic.
    pub(super) fn check_side(&self, verb: Verb) -> usize {
        match verb {
            Verb::Write | Verb::Send => 1 - self.dir,
            Verb::Read | Verb::Atomic(_) => self.dir,
        }
    }

    /// The side whose source slots the job's messages carry (`None` for an atomic).
    pub(super) fn data_side(&self, verb: Verb) -> Option<usize> {
        match verb {
            Verb::Write | Verb::Send => Some(self.dir),
            Verb::Read => Some(1 - self.dir),
            Verb::Atomic(_) => None,
        }
    }
}

/// The layout of one size.
#[derive(Clone, Debug)]
pub(super) struct Plan {
    pub(super) size: u64,
    pub(super) iters: u32,
    pub(super) warmup: u32,
    /// Destination slots of each job.
    pub(super) dst_slots: Vec<u32>,
    /// Byte offset of each job's slots in its receiver's destination buffer.
    pub(super) dst_off: Vec<u64>,
    /// Source slots (shared by the jobs of a direction).
    pub(super) src_slots: u32,
    /// Destination bytes each checking side needs.
    pub(super) dst_len: [u64; 2],
}

impl Plan {
    pub(super) fn new(jobs: &[Job], verb: Verb, size: u64, iters: u32, warmup: u32) -> Self {
        let mut dst_slots = Vec::with_capacity(jobs.len());
        let mut dst_off = Vec::with_capacity(jobs.len());
        let mut dst_len = [0u64; 2];
        let most = iters.max(warmup) as u64;
        for j in jobs {
            let w = j.workers as u64;
            let fit = (DST_CAP / (w * size)).max(1);
            let per_worker = most.div_ceil(w).clamp(1, fit);
            let d = (w * per_worker) as u32;
            let c = j.check_side(verb);
            dst_off.push(dst_len[c]);
            dst_len[c] += d as u64 * size;
            dst_slots.push(d);
        }
        // Two consecutive writes into a slot (iterations i and i + D) read sources i and i + D
        // modulo S: they differ when S does not divide D. S = D + 1 gives every iteration of a
        // pass its own bytes; large sizes take fewer sources (the largest S that still divides
        // no D).
        let dmax = dst_slots.iter().copied().max().unwrap_or(1);
        let cap = ((SRC_CAP / size).min(u32::MAX as u64) as u32)
            .max(3)
            .min(dmax + 1);
        let src_slots = (2..=cap)
            .rev()
            .find(|s| dst_slots.iter().all(|d| d % s != 0))
            .unwrap_or(dmax + 1);
        Self {
            size,
            iters,
            warmup,
            dst_slots,
            dst_off,
            src_slots,
            dst_len,
        }
    }

    /// The source slot whose bytes destination slot `r` of job `j` ends with after `iters`
    /// iterations, or `None` when no iteration writes it.
    pub(super) fn expected(&self, j: usize, r: u32, iters: u32) -> Option<u64> {
        self.last(j, r, iters)
            .map(|last| (last + j as u64) % self.src_slots as u64)
    }

    /// The last of `iters` iterations of job `j` that lands in its slot `r` (`None`: none).
    pub(super) fn last(&self, j: usize, r: u32, iters: u32) -> Option<u64> {
        let d = self.dst_slots[j] as u64;
        let r = r as u64;
        if r >= iters as u64 {
            return None;
        }
        Some(r + d * ((iters as u64 - 1 - r) / d))
    }

    /// What destination slot `r` of job `j` holds after `iters` iterations, into `scratch`
    /// (`false`: no iteration lands there): the bytes of its source slot, or for an atomic the
    /// 8 bytes of the old value the last iteration into it fetched.
    pub(super) fn fill_expected(
        &self,
        verb: Verb,
        j: usize,
        r: u32,
        iters: u32,
        seed: u64,
        scratch: &mut Vec<u8>,
    ) -> bool {
        match verb {
            Verb::Atomic(_) => match self.last(j, r, iters) {
                Some(i) => {
                    scratch.clear();
                    scratch.extend_from_slice(&atomic_value(j as u64, i).to_ne_bytes());
                    true
                }
                None => false,
            },
            _ => match self.expected(j, r, iters) {
                Some(s) => {
                    pattern::fill(scratch, seed, s, self.size as usize);
                    true
                }
                None => false,
            },
        }
    }
}

/// One side: its QPs, its source and destination buffers.
pub(super) struct Side {
    pub(super) qps: Vec<Qp>,
    /// Source slots (the messages' bytes).
    pub(super) src: Option<(Payload, Reg)>,
    /// Destination slots (what this side checks).
    pub(super) dst: Option<(Payload, Reg)>,
    /// Atomics: the words the peer's jobs work on (word `j` for job `j`).
    pub(super) words: Option<(Payload, Reg)>,
}

/// A buffer's region: registered directly, or held from the PD's registration cache.
pub(super) enum Reg {
    Plain(Mr),
    Cached(CachedMr),
}

impl std::ops::Deref for Reg {
    type Target = Mr;
    fn deref(&self) -> &Mr {
        match self {
            Reg::Plain(m) => m,
            Reg::Cached(c) => c,
        }
    }
}

/// One buffer's cold and warm registration through the cache (`--reg-cache`).
pub(super) struct RegTiming {
    pub(super) side: &'static str,
    pub(super) buffer: &'static str,
    pub(super) bytes: usize,
    pub(super) cold_ns: u64,
    pub(super) warm_ns: u64,
}

/// Registers `b`: directly, or (with `timings`) twice through the cache, timing both.
pub(super) fn register(
    b: &Payload,
    pd: &gpuverbs::Pd,
    access: Access,
    timings: Option<(&mut Vec<RegTiming>, &'static str, &'static str, usize)>,
) -> Result<Reg> {
    let Some((timings, side, buffer, bytes)) = timings else {
        return Ok(Reg::Plain(b.register(pd, access)?));
    };
    let ns = |t: Instant| u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
    let t = Instant::now();
    let first = b.register_cached(pd, access)?;
    let cold_ns = ns(t);
    let t = Instant::now();
    let again = b.register_cached(pd, access)?;
    let warm_ns = ns(t);
    if again.lkey() != first.lkey() {
        bail!("the registration cache gave another region for the same buffer");
    }
    timings.push(RegTiming {
        side,
        buffer,
        bytes,
        cold_ns,
        warm_ns,
    });
    Ok(Reg::Cached(first))
}

/// The destination buffer of job `job` (the slots its checking side checks), when this
/// process holds it.
pub(super) fn dst_buf<'a>(
    sides: &'a [Option<Side>; 2],
    job: &Job,
    verb: Verb,
) -> Option<&'a Payload> {
    sides[job.check_side(verb)]
        .as_ref()
        .and_then(|s| s.dst.as_ref())
        .map(|(b, _)| b)
}

/// The words of the atomic jobs that target a side of this process (word `j` of job `j`).
pub(super) fn words_buf<'a>(sides: &'a [Option<Side>; 2], job: &Job) -> Option<&'a Payload> {
    sides[1 - job.dir]
        .as_ref()
        .and_then(|s| s.words.as_ref())
        .map(|(b, _)| b)
}

/// Sets the words of the atomic jobs this process's sides are targets of to their base.
pub(super) fn reset_words(sides: &[Option<Side>; 2], jobs: &[Job]) -> Result<()> {
    for (j, job) in jobs.iter().enumerate() {
        if let Some(w) = words_buf(sides, job) {
            w.write(8 * j, &atomic_base(j as u64).to_ne_bytes())?;
        }
    }
    Ok(())
}

/// Checks the word of atomic job `j` after `iters` iterations.
pub(super) fn validate_word(w: &Payload, j: usize, iters: u32) -> Result<()> {
    let mut b = [0u8; 8];
    w.read(8 * j, &mut b)?;
    let (got, want) = (u64::from_ne_bytes(b), atomic_value(j as u64, iters as u64));
    if got != want {
        bail!(
            "the target's word is {got:#018x} after {iters} atomics, expected {want:#018x} (base              {:#018x} + {iters})",
            atomic_base(j as u64)
        );
    }
    Ok(())
}

/// The buffer of a side that the peer's WQEs reach: WRITE's destination, READ's source, the
/// atomics' words (SEND: none).
pub(super) fn reached_buf(sd: &Side, verb: Verb) -> Option<&(Payload, Reg)> {
    match verb {
        Verb::Write => sd.dst.as_ref(),
        Verb::Read => sd.src.as_ref(),
        Verb::Atomic(_) => sd.words.as_ref(),
        Verb::Send => None,
    }
}

/// Keys and addresses of the jobs this process drives (in the order of `ids`).
pub(super) struct Keys {
    pub(super) lbase: Vec<u64>,
    pub(super) lkey: Vec<u32>,
    pub(super) rbase: Vec<u64>,
    pub(super) rkey: Vec<u32>,
}

impl Keys {
    /// `peer_mem`: the buffer of the peer that the WQEs reach (across processes).
    pub(super) fn new(
        jobs: &[Job],
        verb: Verb,
        ids: &[usize],
        sides: &[Option<Side>; 2],
        peer_mem: Option<&RemoteMemory>,
        bad_rkey: bool,
    ) -> Self {
        let mut k = Self {
            lbase: vec![],
            lkey: vec![],
            rbase: vec![],
            rkey: vec![],
        };
        for &j in ids {
            let job = &jobs[j];
            let me = sides[job.dir].as_ref().expect("the initiator's side");
            let src = match verb {
                Verb::Write | Verb::Send => &me.src.as_ref().expect("sender has sources").1,
                Verb::Read | Verb::Atomic(_) => {
                    &me.dst.as_ref().expect("initiator has destinations").1
                }
            };
            let (rbase, rkey) = match sides[1 - job.dir].as_ref() {
                Some(s) => {
                    let b = match verb {
                        Verb::Write => s.dst.as_ref(),
                        Verb::Read => s.src.as_ref(),
                        Verb::Atomic(_) => s.words.as_ref(),
                        Verb::Send => None,
                    };
                    b.map_or((0, 0), |(_, mr)| (mr.addr(), mr.rkey().0))
                }
                None => peer_mem.map_or((0, 0), |r| (r.addr(), r.rkey())),
            };
            k.lbase.push(src.addr());
            k.lkey.push(src.lkey().0);
            k.rbase.push(rbase);
            k.rkey.push(rkey ^ if bad_rkey { 0x5a00 } else { 0 });
        }
        k
    }
}

/// Fills job `j`'s destination slots with the complement of what they must end with (and the
/// slots no iteration writes with [`UNTOUCHED`]).
pub(super) fn poison(
    b: &Payload,
    verb: Verb,
    p: &Plan,
    j: usize,
    seed: u64,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let size = p.size as usize;
    for r in 0..p.dst_slots[j] {
        let off = p.dst_off[j] as usize + r as usize * size;
        if p.fill_expected(verb, j, r, p.iters, seed, scratch) {
            scratch.iter_mut().for_each(|x| *x = !*x);
            b.write(off, scratch)?;
        } else {
            b.fill(off, size, UNTOUCHED)?;
        }
    }
    Ok(())
}

/// Checks every byte of job `j`'s destination slots after `p.iters` iterations; `poisoned`:
/// the iterations the poison was made for (with -D more than ran: a slot no iteration wrote
/// still holds the poison of the plan's layout).
#[allow(clippy::too_many_arguments)]
pub(super) fn validate(
    b: &Payload,
    verb: Verb,
    p: &Plan,
    poisoned: u32,
    j: usize,
    seed: u64,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let size = p.size as usize;
    let mut got = vec![0u8; size];
    for r in 0..p.dst_slots[j] {
        let off = p.dst_off[j] as usize + r as usize * size;
        b.read(off, &mut got)?;
        if p.fill_expected(verb, j, r, p.iters, seed, scratch) {
            if let Some(o) = pattern::first_difference(&got, scratch) {
                let last = p.last(j, r, p.iters).unwrap_or(0);
                if let Verb::Atomic(op) = verb {
                    bail!(
                        "result slot {r}: iteration {last}'s {} fetched {:#018x}, expected \
                         {:#018x}",
                        op.name(),
                        u64::from_ne_bytes(got[..8].try_into().expect("8 bytes")),
                        u64::from_ne_bytes(scratch[..8].try_into().expect("8 bytes"))
                    );
                }
                bail!(
                    "destination slot {r} (last written by iteration {last}, source slot {}): \
                     byte {o} is {:#04x}, expected {:#04x} ({})",
                    p.expected(j, r, p.iters).unwrap_or(0),
                    got[o],
                    scratch[o],
                    mismatch(&got, scratch)
                );
            }
        } else {
            {
                let want_poison = p
                    .fill_expected(verb, j, r, poisoned, seed, scratch)
                    .then(|| scratch.iter_mut().for_each(|x| *x = !*x));
                let changed = match want_poison {
                    Some(()) => pattern::first_difference(&got, scratch),
                    None => got.iter().position(|&x| x != UNTOUCHED),
                };
                if let Some(o) = changed {
                    bail!("destination slot {r} is written by no iteration, but byte {o} changed");
                }
            }
        }
    }
    Ok(())
}

/// What a slot that differs from its pattern `want` holds: still the poison everywhere (the
/// write never arrived), the poison where it differs (the write arrived in part), or other
/// bytes (it arrived with wrong bytes).
pub(super) fn mismatch(got: &[u8], want: &[u8]) -> String {
    let (mut wrong, mut poison) = (0usize, 0usize);
    for (g, w) in got.iter().zip(want) {
        if g != w {
            wrong += 1;
            poison += usize::from(*g == !*w);
        }
    }
    let n = want.len();
    if poison == n {
        "the whole slot still holds the poison: the write never arrived".to_string()
    } else if poison == wrong {
        format!("{wrong} of {n} bytes still hold the poison: the write arrived in part")
    } else {
        format!("{wrong} of {n} bytes differ: the write arrived with wrong bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jobs(workers: &[u32], dirs: usize) -> Vec<Job> {
        let per = workers.len() / dirs;
        workers
            .iter()
            .enumerate()
            .map(|(j, &w)| Job {
                dir: j / per,
                k: j % per,
                workers: w,
            })
            .collect()
    }

    /// Simulates a run: each slot ends with the source of its last write.
    fn check_plan(p: &Plan, jobs: &[Job]) {
        for (j, job) in jobs.iter().enumerate() {
            let d = p.dst_slots[j];
            assert_eq!(d % job.workers, 0, "{p:?}");
            assert!(d as u64 * p.size <= (DST_CAP).max(job.workers as u64 * p.size));
            let mut last = vec![None; d as usize];
            for i in 0..p.iters as u64 {
                let slot = (i % d as u64) as usize;
                let src = (i + j as u64) % p.src_slots as u64;
                if let Some(prev) = last[slot] {
                    assert_ne!(
                        prev, src,
                        "two writes into slot {slot} carry the same bytes"
                    );
                }
                last[slot] = Some(src);
            }
            for r in 0..d {
                assert_eq!(p.expected(j, r, p.iters), last[r as usize], "slot {r}");
            }
        }
        assert!(p.src_slots as u64 * p.size <= SRC_CAP.max(3 * p.size) || p.src_slots == 2);
    }

    #[test]
    fn plans_give_each_slot_one_writer_and_distinct_consecutive_bytes() {
        for (workers, dirs) in [
            (vec![1], 1),
            (vec![1, 1, 1, 1], 2),
            (vec![32, 32], 1),
            (vec![256, 128, 128], 1),
            (vec![128], 1),
        ] {
            let js = jobs(&workers, dirs);
            for size in [2u64, 4096, 1 << 20, 8 << 20] {
                for (iters, warmup) in [(1, 1), (7, 1), (5000, 500), (64, 6), (300, 30)] {
                    let p = Plan::new(&js, Verb::Write, size, iters, warmup);
                    check_plan(&p, &js);
                    for d in 0..dirs {
                        let sum: u64 = js
                            .iter()
                            .enumerate()
                            .filter(|(_, j)| 1 - j.dir == d)
                            .map(|(j, _)| p.dst_slots[j] as u64 * size)
                            .sum();
                        assert_eq!(p.dst_len[d], sum);
                    }
                }
            }
        }
    }
}
