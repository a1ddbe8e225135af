//! One side of the round trips: its QP and registered buffers ([`Side`]), where its messages go
//! ([`Target`]), the tail words that carry a message's number, and the check of what arrived
//! ([`validate`]).

use crate::bw::{atomic_value, Verb};
use crate::{create_qp, create_qp_rq, pattern, Payload, Placement, QpSpec};
use anyhow::{bail, Result};
use gpuverbs::gpu::Gpu;
use gpuverbs::post::RemoteAddr;
use gpuverbs::{Access, HostBuffer, Mr, Pd, Qp};
use std::sync::Arc;

/// Bytes of the tail that carries the iteration number.
pub(super) fn tail_len(size: u64) -> usize {
    size.min(8) as usize
}

/// Where a message of `size` bytes starts in its buffer: it ends on an 8-byte boundary, so its
/// last bytes lie in one aligned word that can be read atomically.
pub(super) fn pad(size: u64) -> u64 {
    size.next_multiple_of(8) - size
}

/// The value the last `n` bytes of the word ending a payload show for iteration number `k1`
/// (they are the word's top bytes).
pub(super) fn tail_of_word(word: u64, n: usize) -> u64 {
    let mask = if n >= 8 {
        u64::MAX
    } else {
        (1u64 << (8 * n)) - 1
    };
    (word >> (64 - 8 * n as u32)) & mask
}

pub(super) fn tail_value(k1: u64, n: usize) -> u64 {
    if n >= 8 {
        k1
    } else {
        k1 & ((1u64 << (8 * n)) - 1)
    }
}

/// One side: its QP, outgoing payload (READ: the buffer the peer reads), receive buffer (READ:
/// where this side's reads land), signal word (atomics: the word the peer's atomics work on),
/// atomic result word (each in host or GPU memory, as `--mem` says) and `--signal`'s result
/// word (host memory: nobody reads it).
pub(super) struct Side {
    pub(super) qp: Qp,
    pub(super) src: Payload,
    pub(super) src_mr: Mr,
    /// WRITE and SEND: bytes from the outgoing payload's first copy to its second (see
    /// `LatSide::src_stride`); 0 for the verbs whose source is one copy.
    pub(super) src_stride: usize,
    pub(super) recv: Payload,
    pub(super) recv_mr: Mr,
    pub(super) sig: Payload,
    pub(super) sig_mr: Mr,
    /// Where `--signal`'s old values land (the region keeps its buffer alive).
    pub(super) result_mr: Mr,
    /// Where an atomic's fetched value lands (atomic_lat).
    pub(super) fetch: Payload,
    pub(super) fetch_mr: Mr,
}

impl Side {
    pub(super) fn new(
        pd: &Pd,
        spec: QpSpec,
        gpu: Option<&Arc<Gpu>>,
        mem: Placement,
        len: usize,
        verb: Verb,
    ) -> Result<Self> {
        let qp = match verb {
            Verb::Send => create_qp_rq(pd, spec, gpu, 16)?,
            _ => create_qp(pd, spec, gpu)?,
        };
        // WRITE and SEND: two copies of the outgoing payload (see `LatSide::src_stride`).
        let src_stride = if matches!(verb, Verb::Write | Verb::Send) {
            len
        } else {
            0
        };
        let src = Payload::new(mem, gpu, src_stride + len)?;
        let src_mr = src.register(pd, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
        let recv = Payload::new(mem, gpu, len)?;
        let recv_mr = recv.register(pd, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
        let sig = Payload::new(mem, gpu, 64)?;
        let sig_mr = sig.register(pd, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
        let result = HostBuffer::new(64);
        let result_mr = pd.register_with(&result, Access::LOCAL_WRITE)?;
        let fetch = Payload::new(mem, gpu, 64)?;
        let fetch_mr = fetch.register(pd, Access::LOCAL_WRITE)?;
        Ok(Self {
            qp,
            src,
            src_mr,
            src_stride,
            recv,
            recv_mr,
            sig,
            sig_mr,
            result_mr,
            fetch,
            fetch_mr,
        })
    }
}

/// Where a side's messages go: the peer's receive buffer and signal word (atomics: the word
/// they work on), and the source buffer a READ reads.
#[derive(Clone, Copy, Debug)]
pub(super) struct Target {
    pub(super) recv: RemoteAddr,
    pub(super) sig: RemoteAddr,
    pub(super) src: RemoteAddr,
}

impl Target {
    /// The receive buffer, signal word and source of a side of this process.
    pub(super) fn of(s: &Side) -> Self {
        Self {
            recv: s.recv_mr.remote(0),
            sig: s.sig_mr.remote(0),
            src: s.src_mr.remote(0),
        }
    }
}

/// Checks the receive buffers of `sides` (side numbers `ids`): the peer's pattern, then the
/// number of the peer's last message (`sent[peer]`: the messages each side sent); and the
/// signal words with `--signal`. READ: side A's receive buffer holds B's pattern; atomics: A's
/// last fetched value and B's word's final value.
#[allow(clippy::too_many_arguments)]
pub(super) fn validate(
    sides: &[Side],
    ids: &[usize],
    verb: Verb,
    size: u64,
    sent: [u64; 2],
    seed: u64,
    signal: bool,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let (p, tl) = (pad(size) as usize, tail_len(size));
    let side_name = |me: usize| ["A", "B"][me];
    for (&me, s) in ids.iter().zip(sides) {
        let peer = 1 - me;
        if let Verb::Atomic(op) = verb {
            let word = |b: &Payload| -> Result<u64> {
                let mut w = [0u8; 8];
                b.read(0, &mut w)?;
                Ok(u64::from_ne_bytes(w))
            };
            let n = sent[0];
            let (got, want, what) = if me == 0 {
                (
                    word(&s.fetch)?,
                    atomic_value(0, n.saturating_sub(1)),
                    "the last fetched value",
                )
            } else {
                (
                    word(&s.sig)?,
                    atomic_value(0, n),
                    "the target word's final value",
                )
            };
            if got != want {
                bail!(
                    "side {}: {what} after {n} {} is {got:#018x}, expected {want:#018x}",
                    side_name(me),
                    op.name()
                );
            }
            continue;
        }
        if verb == Verb::Read {
            if me == 1 {
                // B's receive buffer is nobody's target.
                continue;
            }
            pattern::fill(scratch, seed ^ peer as u64, 0, size as usize);
        } else {
            pattern::fill(scratch, seed ^ peer as u64, 0, size as usize - tl);
            scratch.extend_from_slice(&sent[peer].to_le_bytes()[..tl]);
        }
        let mut got = vec![0u8; size as usize];
        s.recv.read(p, &mut got)?;
        if let Some(o) = pattern::first_difference(&got, scratch) {
            bail!(
                "side {}'s receive buffer: byte {o} of {size} is {:#04x}, expected {:#04x}{}",
                side_name(me),
                got[o],
                scratch[o],
                if verb == Verb::Read && got[o] == !scratch[o] {
                    " (the poison: the READ did not land)"
                } else {
                    ""
                }
            );
        }
        let mut before = vec![0u8; p];
        s.recv.read(0, &mut before)?;
        if before.iter().any(|&x| x != 0) {
            bail!("side {}: bytes before the payload changed", side_name(me));
        }
        if signal {
            // The run is over (every WQE completed): a plain copy reads the final value.
            let mut word = [0u8; 8];
            s.sig.read(0, &mut word)?;
            let v = u64::from_ne_bytes(word);
            if v != sent[peer] {
                bail!(
                    "side {}'s signal word is {v}, expected {} (the messages of side {})",
                    side_name(me),
                    sent[peer],
                    side_name(peer)
                );
            }
        }
    }
    Ok(())
}
