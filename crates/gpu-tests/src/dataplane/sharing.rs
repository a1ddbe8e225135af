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

/// Many CTAs, each driving a private QP of its own pair (CTA sharing): every byte of every pair
/// checked.
pub fn private_qps(ordinal: usize, mode: DoorbellMode) -> Result<String> {
    let (ctas, threads, iters, size) = (8u32, 64u32, 8u32, 64u32);
    let bytes = (threads * iters * size) as usize;
    let pairs: Vec<Pair> = (0..ctas)
        .map(|_| Pair::new(ordinal, mode, bytes, 256))
        .collect::<Result<_>>()?;
    let gpu = pairs[0].gpu.clone();
    let array = |words: Vec<u8>| -> Result<gpuverbs::gpu::DeviceMem> {
        let m = gpu.alloc(words.len())?;
        m.write(0, &words)?;
        Ok(m)
    };
    let qps = array(
        pairs
            .iter()
            .flat_map(|p| p.export.ptr().to_ne_bytes())
            .collect(),
    )?;
    let lbases = array(pairs.iter().flat_map(|p| p.src_d.to_ne_bytes()).collect())?;
    let lks = array(
        pairs
            .iter()
            .flat_map(|p| p.src_mr.lkey().0.to_ne_bytes())
            .collect(),
    )?;
    let rbases = array(
        pairs
            .iter()
            .flat_map(|p| p.dst_mr.addr().to_ne_bytes())
            .collect(),
    )?;
    let rks = array(
        pairs
            .iter()
            .flat_map(|p| p.dst_mr.rkey().0.to_ne_bytes())
            .collect(),
    )?;
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
