//! How a QP is shared: poster handover between kernel and CPU, exclusive checkout laps,
//! private QPs per CTA.

use anyhow::{ensure, Result};
use gpuverbs::post::{Completion, CtrlFlags, Local, Op, RingMode};
use gpuverbs::{DoorbellMode, RingPlacement};

use super::put::{run_put, PutArgs};
use super::{arg, counters, Mem, Pair, PairSpec, Status, BUDGET_NS};

/// The QP passes from a kernel to the CPU initiator and back to a kernel: each poster continues
/// where the last left the queue (producer, blocks not yet retired, CQ consumer index), with
/// unsignaled WQEs left behind by the CPU; every byte and the final counters checked.
pub fn poster_handover(ordinal: usize) -> Result<String> {
    let a = PutArgs {
        grid: 1,
        block: 32,
        scope: 0,
        skip_mod: 0,
        size: 64,
        iters: 2,
        signal_every: 1,
        budget_ns: 2_000_000_000,
    };
    let p = Pair::new(ordinal, DoorbellMode::GpuDoorbell, 64 * 64, 64)?;
    run_put(&p, &a)?;
    let first = p.export.read()?.sq_rung;
    let Pair {
        a: ctx,
        qa,
        qb,
        src,
        dst,
        src_mr,
        dst_mr,
        src_d,
        export,
        gpu,
        _b,
        _proxy,
    } = p;
    drop(export);
    // the CPU: two unsignaled WRITEs and a signaled one, then one unsignaled left behind
    let zeros = vec![0u8; dst.len()];
    dst.write(0, &zeros)?;
    let mut ini = qa.try_cpu_initiator(RingMode::RdmaCore)?;
    ensure!(
        u64::from(ini.producer()) == first & 0xffff,
        "the CPU initiator starts at {}, the kernel left the queue at {first}",
        ini.producer()
    );
    let unsig = CtrlFlags {
        signaled: false,
        ..CtrlFlags::SIGNALED
    };
    let sges: Vec<_> = (0..4u64).map(|k| [src_mr.sge(k * 64, 64)]).collect();
    let w = |k: usize| Op::Write {
        remote: dst_mr.remote(k as u64 * 64),
        local: Local::Sges(&sges[k]),
        imm: None,
    };
    ini.post(&w(0), unsig)?;
    ini.post(&w(1), unsig)?;
    ini.post_and_ring(&w(2), CtrlFlags::SIGNALED)?;
    let c = ini.wait_send(std::time::Duration::from_secs(10))?;
    ensure!(matches!(c, Completion::Req { .. }), "{c:?}");
    ini.post_and_ring(&w(3), unsig)?;
    let left = ini.producer();
    drop(ini);
    let t = std::time::Instant::now();
    let (srcv, mut dstv) = (src.to_vec()?, dst.to_vec()?);
    while dstv[..256] != srcv[..256] && t.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(1));
        dstv = dst.to_vec()?;
    }
    ensure!(dstv[..256] == srcv[..256], "the CPU's WRITEs did not land");
    // a kernel again, on a new export
    dst.write(0, &zeros)?;
    let export = gpu.export_qp(&qa)?;
    let d = export.read()?;
    ensure!(
        d.sq_rung & 0xffff == u64::from(left),
        "the new export starts at {}, the CPU left the queue at {left}",
        d.sq_rung
    );
    let p = Pair {
        a: ctx,
        qa,
        qb,
        src,
        dst,
        src_mr,
        dst_mr,
        src_d,
        export,
        gpu,
        _b,
        _proxy,
    };
    let r = run_put(&p, &a)?;
    Ok(format!(
        "kernel (to block {first}) -> CPU initiator (3 WRITEs, 1 left unsignaled, to block \
         {left}) -> kernel: {r}"
    ))
}

/// One thread, exclusive sharing on a register copy of the descriptor (checkout / checkin),
/// many laps of a 64-block ring (in host or GPU memory); the descriptor read back afterwards
/// must hold the state the copy reached.
pub fn exclusive_wrap(ordinal: usize, mode: DoorbellMode, rings: RingPlacement) -> Result<String> {
    let (iters, size) = (2000u32, 32u32);
    let spec = PairSpec {
        mode,
        bytes: (iters * size) as usize,
        sq_blocks: 64,
        mem: Mem::Host,
        rings,
    };
    let p = Pair::with(ordinal, spec)?;
    let st = Status::new(&p.gpu)?;
    let (mut q, mut lbase, mut lk, mut rbase, mut rk) = (
        p.export.ptr(),
        p.src_d,
        p.src_mr.lkey().0,
        p.dst_mr.addr(),
        p.dst_mr.rkey().0,
    );
    let (mut size_, mut iters_, mut sig, mut budget, mut out) =
        (size, iters, 16u32, BUDGET_NS, st.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut lbase),
        arg(&mut lk),
        arg(&mut rbase),
        arg(&mut rk),
        arg(&mut size_),
        arg(&mut iters_),
        arg(&mut sig),
        arg(&mut budget),
        arg(&mut out),
    ];
    // SAFETY: parameters match gv_test_put_exclusive; pointers are live device-visible memory.
    unsafe {
        p.gpu.launch_sync(
            "gv_test_put_exclusive",
            (1, 1, 1),
            (1, 1, 1),
            0,
            &mut params,
        )?
    };
    st.expect_ok()?;
    ensure!(
        p.dst.to_vec()? == p.src.to_vec()?[..p.dst.len()],
        "bytes differ"
    );
    let d = p.export.read()?;
    ensure!(
        d.sq_ready / 64 >= 30,
        "only {} blocks: fewer than 30 laps (state not checked in?)",
        d.sq_ready
    );
    // quiet returned OK, so everything posted retired; checkin wrote that back, released the
    // QP, and the BUSY calls made while it was checked out posted nothing.
    ensure!(
        d.sq_ready == u64::from(iters),
        "{} blocks published for {iters} one-block writes",
        d.sq_ready
    );
    ensure!(d.checked_out == 0, "the QP is still checked out");
    ensure!(
        d.sq_retired == d.sq_ready && d.sq_rung == d.sq_ready && d.sq_reserved == d.sq_ready,
        "descriptor after checkin: reserved {} ready {} rung {} retired {}",
        d.sq_reserved,
        d.sq_ready,
        d.sq_rung,
        d.sq_retired
    );
    let Some(dev) = counters(&p.a) else {
        return Ok(format!(
            "{iters} writes over {} laps of a 64-block SQ verified; device counters not \
             available (mlx5)",
            iters / 64
        ));
    };
    ensure!(dev.errors.is_empty(), "device errors: {:?}", dev.errors);
    ensure!(
        (mode == DoorbellMode::BlueFlame) == (dev.bf_run > 0),
        "{} WQEs ran from BlueFlame copies in {mode:?} mode",
        dev.bf_run
    );
    Ok(format!(
        "{iters} writes over {} laps of a 64-block SQ verified; {} WQEs from BlueFlame copies, {} \
         copies torn",
        d.sq_ready / 64,
        dev.bf_run,
        dev.bf_torn
    ))
}

/// Per-pair arrays in GPU memory for kernels that drive several pairs: the exported QPs, the
/// local buffers and keys, the remote buffers and keys, pair `i` at index `i`.
struct PairArrays {
    qps: gpuverbs::gpu::DeviceMem,
    lbases: gpuverbs::gpu::DeviceMem,
    lks: gpuverbs::gpu::DeviceMem,
    rbases: gpuverbs::gpu::DeviceMem,
    rks: gpuverbs::gpu::DeviceMem,
}

impl PairArrays {
    fn new(pairs: &[Pair]) -> Result<Self> {
        let gpu = &pairs[0].gpu;
        let array = |words: Vec<u8>| -> Result<gpuverbs::gpu::DeviceMem> {
            let m = gpu.alloc(words.len())?;
            m.write(0, &words)?;
            Ok(m)
        };
        let each = |f: &dyn Fn(&Pair) -> Vec<u8>| array(pairs.iter().flat_map(f).collect());
        Ok(Self {
            qps: each(&|p| p.export.ptr().to_ne_bytes().to_vec())?,
            lbases: each(&|p| p.src_d.to_ne_bytes().to_vec())?,
            lks: each(&|p| p.src_mr.lkey().0.to_ne_bytes().to_vec())?,
            rbases: each(&|p| p.dst_mr.addr().to_ne_bytes().to_vec())?,
            rks: each(&|p| p.dst_mr.rkey().0.to_ne_bytes().to_vec())?,
        })
    }
}

/// Many CTAs, each driving a private QP of its own pair (CTA sharing): every byte of every pair
/// checked.
pub fn private_qps(ordinal: usize, mode: DoorbellMode) -> Result<String> {
    let (ctas, threads, iters, size) = (8u32, 64u32, 8u32, 64u32);
    let bytes = (threads * iters * size) as usize;
    let pairs: Vec<Pair> = (0..ctas)
        .map(|_| Pair::new(ordinal, mode, bytes, 256))
        .collect::<Result<_>>()?;
    let gpu = pairs[0].gpu.clone();
    let PairArrays {
        qps,
        lbases,
        lks,
        rbases,
        rks,
    } = PairArrays::new(&pairs)?;
    let st = Status::new(&gpu)?;
    let (mut a, mut b, mut c, mut d, mut e) =
        (qps.ptr(), lbases.ptr(), lks.ptr(), rbases.ptr(), rks.ptr());
    let (mut size_, mut iters_, mut budget, mut out) = (size, iters, BUDGET_NS, st.ptr());
    let mut params = [
        arg(&mut a),
        arg(&mut b),
        arg(&mut c),
        arg(&mut d),
        arg(&mut e),
        arg(&mut size_),
        arg(&mut iters_),
        arg(&mut budget),
        arg(&mut out),
    ];
    // SAFETY: parameters match gv_test_put_private; the arrays hold one entry per CTA and
    // every pointer in them is live device-visible memory for the whole launch.
    unsafe {
        gpu.launch_sync(
            "gv_test_put_private",
            (ctas, 1, 1),
            (threads, 1, 1),
            0,
            &mut params,
        )?
    };
    st.expect_ok()?;
    for (i, p) in pairs.iter().enumerate() {
        ensure!(
            p.dst.to_vec()? == p.src.to_vec()?,
            "CTA {i}: destination differs from source"
        );
        let desc = p.export.read()?;
        ensure!(desc.sq_retired == desc.sq_ready, "CTA {i}: {desc:?}");
    }
    Ok(format!(
        "{ctas} CTAs x {threads} threads, each CTA on its own QP: {} messages of {size} B verified",
        ctas * threads * iters
    ))
}

/// `ring_multi_skips` of gv_test_ring_multi: QP `i` has nothing posted in round `r`.
fn ring_multi_skips(r: usize, i: usize, n: usize) -> bool {
    r % 2 == 1 && i == (r / 2) % n
}

/// The multi-QP doorbell: one QP per entry of `modes` (each its own pair, doorbell mode and
/// rings), 64 threads putting on every QP unrung, thread 0 ringing them all with one
/// `ring_multi` per round (some rounds leave one QP with nothing to ring). Every byte of every
/// QP checked (and the bytes of skipped rounds still zero), every QP's completions retired.
pub fn ring_multi(
    ordinal: usize,
    modes: &[DoorbellMode],
    mem: Mem,
    rings: RingPlacement,
) -> Result<String> {
    let (threads, rounds, size) = (64u32, 6u32, 32u32);
    let n = modes.len();
    let bytes = (threads * rounds * size) as usize;
    let pairs: Vec<Pair> = modes
        .iter()
        .map(|&mode| {
            Pair::with(
                ordinal,
                PairSpec {
                    mode,
                    bytes,
                    sq_blocks: 256,
                    mem,
                    rings,
                },
            )
        })
        .collect::<Result<_>>()?;
    for p in &pairs {
        p.dst.write(0, &vec![0; bytes])?;
    }
    let gpu = pairs[0].gpu.clone();
    let PairArrays {
        qps,
        lbases,
        lks,
        rbases,
        rks,
    } = PairArrays::new(&pairs)?;
    let st = Status::new(&gpu)?;
    let (mut a, mut b, mut c, mut d, mut e) =
        (qps.ptr(), lbases.ptr(), lks.ptr(), rbases.ptr(), rks.ptr());
    let (mut n_, mut size_, mut rounds_, mut budget, mut out) =
        (n as u32, size, rounds, BUDGET_NS, st.ptr());
    let mut params = [
        arg(&mut a),
        arg(&mut b),
        arg(&mut c),
        arg(&mut d),
        arg(&mut e),
        arg(&mut n_),
        arg(&mut size_),
        arg(&mut rounds_),
        arg(&mut budget),
        arg(&mut out),
    ];
    // SAFETY: parameters match gv_test_ring_multi; the arrays hold one entry per QP and every
    // pointer in them is live device-visible memory for the whole launch.
    unsafe {
        super::launch_own(
            &gpu,
            "gv_test_ring_multi",
            (1, 1, 1),
            (threads, 1, 1),
            &mut params,
        )?
    };
    st.expect_ok()?;
    let slot = size as usize;
    for (i, p) in pairs.iter().enumerate() {
        let (src, dst) = (p.src.to_vec()?, p.dst.to_vec()?);
        for r in 0..rounds as usize {
            let span = r * threads as usize * slot..(r + 1) * threads as usize * slot;
            if ring_multi_skips(r, i, n) {
                ensure!(
                    dst[span.clone()].iter().all(|&x| x == 0),
                    "QP {i}: round {r} was skipped but bytes landed"
                );
            } else {
                ensure!(
                    dst[span.clone()] == src[span.clone()],
                    "QP {i} ({:?}): round {r}'s bytes differ",
                    modes[i]
                );
            }
        }
        let desc = p.export.read()?;
        ensure!(
            desc.sq_retired == desc.sq_ready && desc.sq_rung == desc.sq_ready,
            "QP {i}: {desc:?}"
        );
    }
    Ok(format!(
        "{n} QPs ({modes:?}) rung together by ring_multi, {rounds} rounds of {threads} puts \
         of {size} B each: every byte and completion checked"
    ))
}
