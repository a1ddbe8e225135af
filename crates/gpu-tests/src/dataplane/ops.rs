//! The other operations and their error paths: inline, signal, get, atomics, a bad rkey, a
//! dropped doorbell, wait_signal.

use anyhow::{ensure, Result};
use gpuverbs::{Access, DoorbellMode, HostBuffer, RingPlacement};

use super::put::PutArgs;
use super::{
    arg, counters, gpu, skip_on_mlx5, status_name, Buf, Mem, Pair, PairSpec, Status, BUDGET_NS,
};

/// put_inline, put_signal, signal, signal_set, get, fetch-add, compare-swap (8 and 4 bytes),
/// masked fetch-add and compare-swap (8 and 4 bytes) from one thread; payload,
/// atomic targets, results and the signal word in `mem`, side A's rings in `rings`.
pub fn ops(ordinal: usize, mode: DoorbellMode, mem: Mem, rings: RingPlacement) -> Result<String> {
    let spec = PairSpec {
        mode,
        bytes: 4096,
        sq_blocks: 64,
        mem,
        rings,
    };
    let p = Pair::with(ordinal, spec)?;
    // remote words for the atomics; remote bytes for the get
    p.dst.write(1024, &100u64.to_ne_bytes())?;
    p.dst.write(1032, &11u64.to_ne_bytes())?;
    p.dst.write(1040, &1000u32.to_ne_bytes())?;
    p.dst.write(1044, &55u32.to_ne_bytes())?;
    p.dst.write(1048, &0x5_ffff_ffffu64.to_ne_bytes())?;
    p.dst.write(1056, &0x1111_2222_3333_4444u64.to_ne_bytes())?;
    p.dst.write(1072, &5u64.to_ne_bytes())?;
    p.dst.write(1080, &0x00ff_00ffu32.to_ne_bytes())?;
    p.dst.write(1084, &0x1234_5678u32.to_ne_bytes())?;
    let pattern: Vec<u8> = (0..64).map(|i| 0x40 + i as u8).collect();
    p.dst.write(256, &pattern)?;
    let sig = Buf::new(&p.gpu, mem, 8)?;
    let sig_mr = sig.register(p.qb.pd(), Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
    let st = Status::new(&p.gpu)?;
    let (mut q, mut lbase, mut lk, mut rbase, mut rk) = (
        p.export.ptr(),
        p.src_d,
        p.src_mr.lkey().0,
        p.dst_mr.addr(),
        p.dst_mr.rkey().0,
    );
    let (mut sig_addr, mut sig_key, mut budget, mut out) =
        (sig_mr.addr(), sig_mr.rkey().0, BUDGET_NS, st.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut lbase),
        arg(&mut lk),
        arg(&mut rbase),
        arg(&mut rk),
        arg(&mut sig_addr),
        arg(&mut sig_key),
        arg(&mut budget),
        arg(&mut out),
    ];
    // SAFETY: parameters match gv_test_ops; pointers are live device-visible memory.
    unsafe {
        p.gpu
            .launch_sync("gv_test_ops", (1, 1, 1), (1, 1, 1), 0, &mut params)?
    };
    st.expect_ok()?;
    let (src, dst) = (p.src.to_vec()?, p.dst.to_vec()?);
    let inline: Vec<u8> = (0..40).map(|i| 0xA0 + i as u8).collect();
    ensure!(dst[..40] == inline[..], "put_inline bytes differ");
    ensure!(
        dst[600..637] == inline[1..38] && dst[637..640] == [0, 0, 0],
        "put_inline from an unaligned source: {:02x?}",
        &dst[600..640]
    );
    ensure!(
        dst[700..706] == inline[4..10] && dst[706..708] == [0, 0],
        "put_inline of a cut word: {:02x?}",
        &dst[700..708]
    );
    ensure!(dst[64..128] == src[64..128], "put_signal payload differs");
    let s = u64::from_ne_bytes(sig.to_vec()?[..8].try_into()?);
    ensure!(s == 6, "signal word {s}, expected 1 + 5");
    ensure!(src[512..576] == pattern[..], "get bytes differ");
    let word = |b: &[u8], o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap());
    ensure!(
        word(&dst, 1024) == 107 && word(&src, 1024) == 100,
        "fetch-add: target {} old {}",
        word(&dst, 1024),
        word(&src, 1024)
    );
    ensure!(
        word(&dst, 1032) == 22 && word(&src, 1032) == 11,
        "compare-swap: target {} old {}",
        word(&dst, 1032),
        word(&src, 1032)
    );
    // 4-byte atomics: the old value lands big-endian (as a ConnectX writes it), and the
    // kernel's atomic_result32 turns it into host order
    let w32 = |b: &[u8], o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().unwrap());
    let be32 = |b: &[u8], o: usize| u32::from_be_bytes(b[o..o + 4].try_into().unwrap());
    ensure!(
        (w32(&dst, 1040), be32(&src, 1040), w32(&src, 1056)) == (1003, 1000, 1000),
        "4-byte fetch-add: target {} old {} (big-endian), read back {}",
        w32(&dst, 1040),
        be32(&src, 1040),
        w32(&src, 1056)
    );
    ensure!(
        (w32(&dst, 1044), be32(&src, 1044), w32(&src, 1060)) == (66, 55, 55),
        "4-byte compare-swap: target {} old {} (big-endian), read back {}",
        w32(&dst, 1044),
        be32(&src, 1044),
        w32(&src, 1060)
    );
    // two 32-bit fields: the low one wraps to 0 without carrying into the high one
    ensure!(
        word(&dst, 1048) == 0x5_0000_0000 && word(&src, 1048) == 0x5_ffff_ffff,
        "masked fetch-add: target {:#x} old {:#x}",
        word(&dst, 1048),
        word(&src, 1048)
    );
    // masked compare-swap: bits 47..32 matched, bits 31..16 swapped in, the rest kept
    ensure!(
        word(&dst, 1056) == 0x1111_2222_cccc_4444 && word(&src, 1064) == 0x1111_2222_3333_4444,
        "masked compare-swap: target {:#x} old {:#x}",
        word(&dst, 1056),
        word(&src, 1064)
    );
    ensure!(
        word(&dst, 1072) == 0x77,
        "signal_set: {:#x}",
        word(&dst, 1072)
    );
    // masked 4-byte: byte fields that wrap without carrying; a compare on bits 15..8
    ensure!(
        (w32(&dst, 1080), be32(&src, 1080)) == (0, 0x00ff_00ff),
        "masked 4-byte fetch-add: target {:#x} old {:#x} (big-endian)",
        w32(&dst, 1080),
        be32(&src, 1080)
    );
    ensure!(
        (w32(&dst, 1084), be32(&src, 1084)) == (0xabcd_5678, 0x1234_5678),
        "masked 4-byte compare-swap: target {:#x} old {:#x} (big-endian)",
        w32(&dst, 1084),
        be32(&src, 1084)
    );
    if let Some(c) = counters(&p.a) {
        ensure!(
            c.errors.is_empty() && c.device_memory_errors == 0,
            "device: {c:?}"
        );
    }
    Ok(format!(
        "inline, put_signal, signal, signal_set, get, fetch-add, compare-swap (8 and 4 bytes), \
         masked fetch-add and compare-swap (8 and 4 bytes) verified (payload {mem:?}, rings {rings:?})"
    ))
}

/// A bad rkey comes back to the kernel as an error CQE with REMOTE_ACCESS; the WQEs behind it
/// are flushed (each with its own WR_FLUSH CQE) and retired, so quiet returns instead of
/// spinning; the next operation on the QP (now in ERR) fails at once.
pub fn bad_rkey(ordinal: usize, rings: RingPlacement) -> Result<String> {
    let (p, s) = failed_pair(ordinal, 4096, rings)?;
    let one = PutArgs::single(64, BUDGET_NS);
    let err = gpuverbs::post::ErrorCqe {
        responder: false,
        syndrome: s[1] as u8,
        vendor_syndrome: s[2] as u8,
        wqe_opcode: 0x08,
        qpn: p.qa.qpn(),
        wqe_counter: s[3] as u16,
    };
    ensure!(
        p.dst.to_vec()?.iter().all(|&b| b == 0),
        "bytes landed despite the bad key"
    );
    ensure!(
        p.qa.state() == gpuverbs::queue::QpState::Err,
        "QP not in ERR"
    );
    let d = p.export.read()?;
    if let Some(c) = counters(&p.a) {
        let flushed = c.errors_of(gpuverbs::post::Syndrome::WrFlush);
        ensure!(
            c.errors_of(gpuverbs::post::Syndrome::RemoteAccess) == 1 && flushed + 1 == d.sq_ready,
            "{} blocks posted, errors {:?}",
            d.sq_ready,
            c.errors
        );
    }
    ensure!(
        d.sq_retired == d.sq_ready,
        "not all flushed WQEs retired: {d:?}"
    );
    let s2 = p.launch_put(&one, p.dst_mr.rkey().0)?.read()?;
    ensure!(
        s2[0] == 1,
        "a post on a QP in ERR returned {}",
        status_name(s2[0])
    );
    // the device API retired every WQE posted after the failed one (flushes)
    let flushed = d.sq_ready.saturating_sub(1);
    Ok(format!(
        "kernel saw: {err}; {flushed} later WQEs flushed and retired; next post on the ERR QP \
         failed at once"
    ))
}

/// A GPU-doorbell pair (payload of `bytes` in host memory, side A's rings in `rings`) whose
/// kernel has run 8 puts into a forged rkey and seen ERROR_CQE REMOTE_ACCESS; with the status
/// words it reported.
fn failed_pair(ordinal: usize, bytes: usize, rings: RingPlacement) -> Result<(Pair, [i32; 8])> {
    let spec = PairSpec {
        mode: DoorbellMode::GpuDoorbell,
        bytes,
        sq_blocks: 64,
        mem: Mem::Host,
        rings,
    };
    let p = Pair::with(ordinal, spec)?;
    let eight = PutArgs {
        iters: 8,
        ..PutArgs::single(64, BUDGET_NS)
    };
    let s = p.launch_put(&eight, p.dst_mr.rkey().0 ^ 0x5500)?.read()?;
    ensure!(
        s[0] == 1 && s[1] == 0x13,
        "expected ERROR_CQE REMOTE_ACCESS, got {} syndrome {:#x}",
        status_name(s[0]),
        s[1]
    );
    Ok((p, s))
}

/// A kernel runs into an error (a bad rkey) and sees it as a status; while the QP is down a
/// second kernel's put fails at once (never a hang); the host drains and recovers both QPs
/// (`Qp::recover`: flushes taken, RESET, new PSNs), the peers connect again through their new
/// endpoints, the QP is exported again, and a kernel's puts land, every byte checked.
pub fn recover_after_error(ordinal: usize) -> Result<String> {
    let (mut p, _) = failed_pair(ordinal, 16384, RingPlacement::HostMapped)?;
    let one = PutArgs::single(64, BUDGET_NS);
    let t = std::time::Instant::now();
    let down = p.launch_put(&one, p.dst_mr.rkey().0)?.read()?;
    let down_took = t.elapsed();
    // the descriptor keeps the first error: a later call returns it without posting
    ensure!(
        down[0] == 1 && down[1] == 0x13,
        "a put on the QP in ERR: {} syndrome {:#x} (ERROR_CQE with the first error expected)",
        status_name(down[0]),
        down[1]
    );
    let psns = (p.qa.psn(), p.qb.psn());
    // the export is the QP's poster: it goes first
    drop(p.export);
    let wait = std::time::Duration::from_secs(5);
    let da = p.qa.recover(wait)?;
    let db = p.qb.recover(wait)?;
    ensure!(
        p.qa.state() == gpuverbs::queue::QpState::Reset
            && p.qb.state() == gpuverbs::queue::QpState::Reset,
        "not in RESET after recovery"
    );
    ensure!((p.qa.psn(), p.qb.psn()) != psns, "the PSNs did not change");
    let remote = gpuverbs::Access::REMOTE_WRITE
        | gpuverbs::Access::REMOTE_READ
        | gpuverbs::Access::REMOTE_ATOMIC;
    super::connect_both(&p.qa, &p.qb, remote)?;
    p.export = p.gpu.export_qp(&p.qa)?;
    let d = p.export.read()?;
    ensure!(d.sq_ready == 0, "the new export does not start at 0: {d:?}");
    ensure!(
        p.dst.to_vec()?.iter().all(|&b| b == 0),
        "bytes landed before the recovery"
    );
    let many = PutArgs {
        grid: 2,
        block: 32,
        iters: 4,
        signal_every: 4,
        ..one
    };
    let done = super::put::run_put(&p, &many)?;
    Ok(format!(
        "kernel saw REMOTE_ACCESS, a second kernel the same error in {down_took:.1?} while down; recovery took \
         {} + {} leftover completions; after reconnect and re-export: {done}",
        da.send.len() + da.recv.len(),
        db.send.len() + db.recv.len()
    ))
}

/// What `gv_test_qp_error` reports: [status, syndrome, vendor, wqe_counter, wqe, scq_ci
/// before, scq_ci after].
fn qp_error_seen(p: &Pair) -> Result<[u64; 7]> {
    let out = p.gpu.alloc(8 * 8)?;
    out.write(0, &[0xffu8; 64])?;
    let (mut q, mut o) = (p.export.ptr(), out.ptr());
    let mut params = [arg(&mut q), arg(&mut o)];
    // SAFETY: parameters match gv_test_qp_error; both pointers are live device memory.
    unsafe {
        super::launch_own(
            &p.gpu,
            "gv_test_qp_error",
            (1, 1, 1),
            (1, 1, 1),
            &mut params,
        )?
    };
    let mut raw = [0u8; 64];
    out.read(0, &mut raw)?;
    let mut v = [0u64; 7];
    for (i, w) in v.iter_mut().enumerate() {
        *w = u64::from_ne_bytes(raw[8 * i..8 * i + 8].try_into()?);
    }
    Ok(v)
}

/// Issue 46 item 6. Five good writes, then a kernel's writes into a forged rkey: a later
/// kernel asks which error put the QP in ERR without polling the CQ (`qp_error`: REMOTE_ACCESS
/// at the first bad WQE, whose 64-bit index is where the good writes ended; the CQ consumer
/// index unchanged by the call). `ExportedQp::recover` then recovers the QP keeping its
/// descriptor, whose tracking starts clean (every counter 0, no error recorded: `qp_error` OK);
/// after reconnecting, a kernel's writes through the same descriptor land, every byte checked.
pub fn recover_in_place(ordinal: usize) -> Result<String> {
    let spec = PairSpec {
        mode: DoorbellMode::GpuDoorbell,
        bytes: 16384,
        sq_blocks: 64,
        mem: Mem::Host,
        rings: RingPlacement::HostMapped,
    };
    let mut p = Pair::with(ordinal, spec)?;
    let good = PutArgs {
        iters: 5,
        ..PutArgs::single(64, BUDGET_NS)
    };
    super::put::run_put(&p, &good)?;
    let before = p.export.read()?.sq_ready;
    let eight = PutArgs {
        iters: 8,
        ..PutArgs::single(64, BUDGET_NS)
    };
    let s = p.launch_put(&eight, p.dst_mr.rkey().0 ^ 0x5500)?.read()?;
    ensure!(
        s[0] == 1 && s[1] == 0x13,
        "expected ERROR_CQE REMOTE_ACCESS, got {} syndrome {:#x}",
        status_name(s[0]),
        s[1]
    );
    let seen = qp_error_seen(&p)?;
    let d = p.export.read()?;
    // the record's upper half holds bits 47..16 of the failed WQE's index
    let recorded = (d.sq_error_info >> 32) << 16 | (d.sq_error_info & 0xffff);
    ensure!(
        seen[..5] == [1, 0x13, s[2] as u64, before & 0xffff, before]
            && seen[5] == seen[6]
            && recorded == before,
        "qp_error: {seen:?} (status, syndrome, vendor, counter, wqe, scq_ci before / after); \
         the failed kernel saw {s:?}; the first bad WQE starts at {before}; descriptor {d:?}"
    );
    let psns = (p.qa.psn(), p.qb.psn());
    let wait = std::time::Duration::from_secs(5);
    let da = p.export.recover(&p.qa, wait)?;
    let db = p.qb.recover(wait)?;
    ensure!((p.qa.psn(), p.qb.psn()) != psns, "the PSNs did not change");
    let d = p.export.read()?;
    let tracking = [
        d.sq_reserved,
        d.sq_ready,
        d.sq_rung,
        d.sq_retired,
        d.sq_signaled_end,
        d.sq_last_start,
        d.sq_error,
        d.sq_error_info,
        u64::from(d.sq_broken),
        u64::from(d.scq_lock),
        u64::from(d.checked_out),
    ];
    ensure!(
        tracking.iter().all(|&w| w == 0),
        "the descriptor's tracking did not start clean: {d:?}"
    );
    let clean = qp_error_seen(&p)?;
    ensure!(clean[0] == 0, "qp_error after recovery: {clean:?}");
    let remote = gpuverbs::Access::REMOTE_WRITE
        | gpuverbs::Access::REMOTE_READ
        | gpuverbs::Access::REMOTE_ATOMIC;
    super::connect_both(&p.qa, &p.qb, remote)?;
    p.dst.write(0, &vec![0u8; p.dst.len()])?;
    let many = PutArgs {
        grid: 2,
        block: 32,
        iters: 4,
        signal_every: 4,
        ..good
    };
    let done = super::put::run_put(&p, &many)?;
    Ok(format!(
        "qp_error without polling: REMOTE_ACCESS at WQE {before}; recovered in place ({} + {} \
         leftover completions), tracking clean; same descriptor after reconnect: {done}",
        da.send.len() + da.recv.len(),
        db.send.len() + db.recv.len()
    ))
}

/// A dropped doorbell makes the kernel's quiet return TIMEOUT within its budget, not hang.
pub fn dropped_doorbell_timeout(ordinal: usize) -> Result<String> {
    skip_on_mlx5(
        true,
        "needs the soft NIC's fault injection (dropped doorbells)",
    )?;
    let p = Pair::new(ordinal, DoorbellMode::GpuDoorbell, 4096, 64)?;
    p.qa.soft()
        .expect("a soft-NIC QP")
        .inject(gpuverbs::soft::Fault::DropDoorbells(1));
    let t = std::time::Instant::now();
    let st = p.launch_put(&PutArgs::single(64, 50_000_000), p.dst_mr.rkey().0)?;
    let s = st.read()?;
    ensure!(s[0] == 2, "expected TIMEOUT, got {}", status_name(s[0]));
    let c = p.a.soft_device().expect("soft").counters();
    ensure!(c.doorbells_dropped == 1, "counters: {c:?}");
    Ok(format!(
        "TIMEOUT after {:.1?} with a 50 ms budget",
        t.elapsed()
    ))
}

/// wait_signal on a word nobody signals returns TIMEOUT; on a word already at the value, OK.
pub fn wait_signal(ordinal: usize) -> Result<String> {
    let gpu = gpu(ordinal)?;
    let word = HostBuffer::new(8);
    let d = gpu.map_host(&word)?;
    let mut results = Vec::new();
    for (value, preset, want) in [(1u64, 0u64, 2), (3, 3, 0)] {
        word.write(0, &preset.to_ne_bytes());
        let st = Status::new(&gpu)?;
        let (mut sig, mut v, mut budget, mut out) = (d, value, 20_000_000u64, st.ptr());
        let mut params = [arg(&mut sig), arg(&mut v), arg(&mut budget), arg(&mut out)];
        // SAFETY: parameters match gv_test_wait_signal; `d` is the mapped word.
        unsafe { gpu.launch_sync("gv_test_wait_signal", (1, 1, 1), (1, 1, 1), 0, &mut params)? };
        let s = st.read()?;
        ensure!(
            s[0] == want,
            "wait for {value} with {preset}: {}",
            status_name(s[0])
        );
        results.push(status_name(s[0]));
    }
    Ok(format!(
        "unsignaled: {}, already signaled: {}",
        results[0], results[1]
    ))
}
