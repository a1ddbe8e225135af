//! The GPU initiator of the latency tests: [`GpuLat`] launches `gv_sample_verb_lat` (one block per
//! side of this process) and reads back the round trips it timed with %globaltimer.

use super::report::Ran;
use super::side::{pad, tail_len, Side, Target};
use crate::bw::Verb;
use crate::{arg, upload, CommonArgs, Exports, GpuStatus, LatSide};
use anyhow::{bail, Context as _, Result};
use std::time::Duration;

pub(super) struct GpuLat {
    pub(super) gpu: std::sync::Arc<gpuverbs::gpu::Gpu>,
    pub(super) exports: Exports,
    /// Per side: GPU addresses of src, recv, sig, fetch (mapped host memory, or GPU memory).
    pub(super) mapped: Vec<[u64; 4]>,
    pub(super) status: GpuStatus,
    pub(super) verb: Verb,
}

impl GpuLat {
    /// `gv_sample_verb_lat` for the sides of this process that post (WRITE and SEND: each;
    /// READ and atomics: side A only), block b driving side `first + b`. `targets[i]`: where
    /// local side `ids[i]`'s WQEs go (the peer's buffers, in this process or the other).
    /// `signal`: WRITE's receiver waits on its signal word; `inline`: WRITE and SEND carry the
    /// payload in the WQE; `duration` (-D): `total` is the warm-up, then a timed part.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &mut self,
        sides: &[Side],
        ids: &[usize],
        targets: &[Target],
        size: u64,
        total: u32,
        duration: Option<Duration>,
        signal: bool,
        inline: bool,
        a: &CommonArgs,
    ) -> Result<Ran> {
        let verb = self.verb;
        let acting: Vec<usize> = (0..sides.len())
            .filter(|&i| matches!(verb, Verb::Write | Verb::Send) || ids[i] == 0)
            .collect();
        let Some(&first_i) = acting.first() else {
            // Side B of a READ or atomic test: its NIC answers, nothing to launch.
            return Ok(Ran {
                sent: [None, Some(0)],
                ..Ran::default()
            });
        };
        let descs: Vec<LatSide> = acting
            .iter()
            .map(|&i| self.side_desc(&sides[i], &targets[i], self.mapped[i], size, i))
            .collect::<Result<_>>()?;
        let dev_sides = upload(&self.gpu, &descs)?;
        let rtt = self.gpu.alloc(8 * total.max(1) as usize)?;
        // Per side: messages sent, timed round trips, their span (ns); -D only.
        let counts = self.gpu.alloc(32 * descs.len())?;
        counts.write(0, &vec![0u8; 32 * descs.len()])?;
        self.status.reset()?;
        let mut sides_ptr = dev_sides.ptr();
        let mut first = ids[first_i] as u32;
        // Loopback WRITE and SEND: one thread drives both sides in turn (one block).
        let mut in_turn = u32::from(descs.len() == 2);
        let mut code = verb.code();
        let mut size_ = size as u32;
        let mut tail = tail_len(size) as u32;
        let mut iters = total;
        let mut cq_mod = a.cq_mod;
        let mut use_signal = u32::from(signal);
        let mut use_inline = u32::from(inline);
        let mut duration_ns = duration.map_or(0, |d| d.as_nanos() as u64);
        let mut counts_ptr = counts.ptr();
        let mut budget = a.wait().as_nanos() as u64;
        let mut out = self.status.ptr();
        let mut rtt_ptr = rtt.ptr();
        let mut params = [
            arg(&mut sides_ptr),
            arg(&mut first),
            arg(&mut in_turn),
            arg(&mut code),
            arg(&mut size_),
            arg(&mut tail),
            arg(&mut iters),
            arg(&mut cq_mod),
            arg(&mut use_signal),
            arg(&mut use_inline),
            arg(&mut duration_ns),
            arg(&mut counts_ptr),
            arg(&mut budget),
            arg(&mut out),
            arg(&mut rtt_ptr),
        ];
        // SAFETY: the parameters match gv_sample_verb_lat's signature, one block per entry of
        // the side array, or one block for both with `in_turn`; the side array, the status
        // words, the counts (32 bytes per side) and the times (`total` entries, the most the
        // kernel writes) are live GPU memory for the whole launch; the NIC addresses in the
        // sides are registered regions of `sides` or the peer's (checked by the device), the
        // GPU addresses (payload, receive buffer, signal and fetch words) mapped host memory
        // or GPU memory of `sides` (alive across the launch), and the descriptors are
        // exported QPs kept alive by `self.exports`.
        unsafe {
            self.gpu.launch_sync(
                "gv_sample_verb_lat",
                (if in_turn != 0 { 1 } else { descs.len() as u32 }, 1, 1),
                (1, 1, 1),
                0,
                &mut params,
            )
        }
        .context("launch gv_sample_verb_lat")?;
        let qpn = |side: usize| {
            ids.iter()
                .position(|&i| i == side)
                .map_or(0, |k| sides[k].qp.qpn())
        };
        self.status.check("gv_sample_verb_lat", qpn)?;
        self.check_values(total)?;
        self.ran(&counts, &rtt, ids, &acting, total, duration)
    }

    /// The side descriptor the kernel gets for local side `i` (`s`, its messages going to
    /// `to`; `mapped`: its buffers' GPU addresses).
    fn side_desc(
        &self,
        s: &Side,
        to: &Target,
        mapped: [u64; 4],
        size: u64,
        i: usize,
    ) -> Result<LatSide> {
        let p = pad(size);
        let [src_d, recv_d, sig_d, fetch_d] = mapped;
        let src_stride = u32::try_from(s.src_stride)
            .context("the payload's two copies are more than 4 GiB apart")?;
        let base = LatSide {
            qp: self.exports.qps[i].ptr(),
            ..Default::default()
        };
        Ok(match self.verb {
            // WRITE: the own payload into the peer's receive buffer (and signal word);
            // the own receive buffer's last word and signal word are polled.
            Verb::Write => LatSide {
                src_nic: s.src_mr.addr() + p,
                src_dev: src_d + p,
                src_stride,
                dst_remote: to.recv.addr + p,
                recv_dev: recv_d + p + size - 8,
                sig_remote: to.sig.addr,
                sig_dev: sig_d,
                lkey: s.src_mr.lkey().0,
                rkey: to.recv.rkey.0,
                sig_rkey: to.sig.rkey.0,
                ..base
            },
            // SEND: the own payload, and the own receive buffer in dst_remote / rkey
            // (its NIC address and lkey).
            Verb::Send => LatSide {
                src_nic: s.src_mr.addr() + p,
                src_dev: src_d + p,
                src_stride,
                dst_remote: s.recv_mr.addr() + p,
                lkey: s.src_mr.lkey().0,
                rkey: s.recv_mr.lkey().0,
                ..base
            },
            // READ: into the own receive buffer (src_nic / lkey) from the peer's source.
            Verb::Read => LatSide {
                src_nic: s.recv_mr.addr() + p,
                dst_remote: to.src.addr + p,
                lkey: s.recv_mr.lkey().0,
                rkey: to.src.rkey.0,
                ..base
            },
            // Atomics: on the peer's word, the old value into the own fetch word
            // (dst_remote / rkey: its NIC address and lkey; recv_dev: its GPU address).
            Verb::Atomic(_) => LatSide {
                dst_remote: s.fetch_mr.addr(),
                rkey: s.fetch_mr.lkey().0,
                recv_dev: fetch_d,
                sig_remote: to.sig.addr,
                sig_rkey: to.sig.rkey.0,
                ..base
            },
        })
    }

    /// The kernel's own checks of `total` iterations: SEND's byte counts, the fetched values.
    fn check_values(&self, total: u32) -> Result<()> {
        let w = self.status.words()?;
        if w[5] != 0 {
            bail!(
                "gv_sample_verb_lat: {} of {total} {} (first: iteration {})",
                w[5],
                match self.verb {
                    Verb::Send => "receives had the wrong byte count",
                    _ => "fetched values differ from what they must be",
                },
                w[6]
            );
        }
        Ok(())
    }

    /// What the launch did, from its counts (32 bytes per acting side) and round trips: every
    /// side here sent what it acted for (READ and atomics: side A `total`), side A's round
    /// trips, or with -D its timed part.
    fn ran(
        &self,
        counts: &gpuverbs::gpu::DeviceMem,
        rtt: &gpuverbs::gpu::DeviceMem,
        ids: &[usize],
        acting: &[usize],
        total: u32,
        duration: Option<Duration>,
    ) -> Result<Ran> {
        let words = |m: &gpuverbs::gpu::DeviceMem, n: usize| -> Result<Vec<u64>> {
            let mut raw = vec![0u8; 8 * n];
            m.read(0, &mut raw)?;
            Ok(raw
                .chunks_exact(8)
                .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
                .collect())
        };
        // Every side here sent what it acted for; READ and atomics: side A `total`.
        let mut ran = Ran::default();
        for &i in ids {
            ran.sent[i] = Some(0);
        }
        let c = words(counts, 4 * acting.len())?;
        for (b, &i) in acting.iter().enumerate() {
            let side = ids[i];
            ran.sent[side] = Some(match duration {
                Some(_) => c[4 * b],
                None => u64::from(total),
            });
            if side == 0 && duration.is_some() {
                ran.timed = Some((c[4 * b + 1], c[4 * b + 2]));
            }
        }
        if ids.contains(&0) && duration.is_none() {
            ran.rtt = Some(words(rtt, total as usize)?);
        }
        Ok(ran)
    }
}
