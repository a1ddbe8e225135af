//! Signals, put-with-signal and the atomics at warp and block scope, and the GIN-style calls at
//! thread scope (put_signal_set, put_value, get_wait, read / wait / reset of a signal word,
//! flush of one QP and of several), flush and get_wait at warp and block scope: every byte of
//! both buffers checked on the host.

use anyhow::{ensure, Result};
use gpuverbs::{DoorbellMode, RingPlacement};

use super::{arg, counters, Mem, Pair, PairSpec, Status, BUDGET_NS};

/// Threads of the `gv_test_scopes` block (one bit of a signal word each).
const THREADS: usize = 64;

fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_ne_bytes());
}

fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_ne_bytes());
}

/// An 8-byte fetch-add split into fields: a set bit of `boundary` is the top bit of a field,
/// and no carry leaves a field (what the NIC computes for a masked fetch-add).
fn masked_add(old: u64, add: u64, boundary: u64) -> u64 {
    let mut out = 0u64;
    let mut lo = 0u32;
    while lo < 64 {
        let top = (lo..64).find(|&b| boundary >> b & 1 == 1).unwrap_or(63);
        let width = top - lo + 1;
        let mask = if width == 64 {
            u64::MAX
        } else {
            ((1u64 << width) - 1) << lo
        };
        out |= (old & mask).wrapping_add(add & mask) & mask;
        lo = top + 1;
    }
    out
}

/// The first byte where `got` and `want` differ, as an error naming `what`.
pub(super) fn same(what: &str, got: &[u8], want: &[u8]) -> Result<()> {
    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
        let end = (i + 8).min(want.len());
        anyhow::bail!(
            "{what}: first difference at byte {i}: got {:02x?}, want {:02x?}",
            &got[i..end],
            &want[i..end]
        );
    }
    Ok(())
}

/// `gv_test_scopes` at `scope` (1 warp, 2 block) with every `skip_mod`-th thread left out (0:
/// none): signal, signal_set, put_signal, put_signal_set, get and the six atomics from 64
/// threads, each on its own words; the host computes both buffers as they must end and
/// compares them whole. (The thread-scope calls are `ops`' and `gin`'s.)
pub fn scopes(
    ordinal: usize,
    mode: DoorbellMode,
    mem: Mem,
    rings: RingPlacement,
    scope: u32,
    skip_mod: u32,
) -> Result<String> {
    let spec = PairSpec {
        mode,
        bytes: 8192,
        sq_blocks: 512,
        mem,
        rings,
    };
    ensure!(
        scope == 1 || scope == 2,
        "gv_test_scopes runs at warp (1) or block (2) scope"
    );
    let p = Pair::with(ordinal, spec)?;
    let src0 = p.src.to_vec()?;
    let dst0 = scopes_remote_start();
    p.dst.write(0, &dst0)?;
    launch_scoped(&p, "gv_test_scopes", scope, skip_mod)?;
    let (want_src, want_dst, n) = scopes_expected(&src0, &dst0, skip_mod);
    same("remote buffer", &p.dst.to_vec()?, &want_dst)?;
    same("local buffer", &p.src.to_vec()?, &want_src)?;
    if let Some(c) = counters(&p.a) {
        ensure!(
            c.errors.is_empty() && c.device_memory_errors == 0,
            "device: {c:?}"
        );
    }
    let scope_name = ["thread", "warp", "block"][scope as usize % 3];
    Ok(format!(
        "{scope_name} scope, {n} of {THREADS} threads: signal, signal_set, put_signal, \
         put_signal_set, get, fetch-add, compare-swap, masked fetch-add and compare-swap (8 and \
         4 bytes), both buffers bit for bit (payload {mem:?}, rings {rings:?})"
    ))
}

/// Launches `kernel` (one block of THREADS threads; parameters: the QP, the local buffer and
/// key, the remote buffer and key, the scope, `skip_mod`, the budget, the status word) on `p`
/// and expects it to report OK.
fn launch_scoped(p: &Pair, kernel: &str, scope: u32, skip_mod: u32) -> Result<()> {
    let st = Status::new(&p.gpu)?;
    let (mut q, mut l, mut lk, mut r, mut rk) = (
        p.export.ptr(),
        p.src_d,
        p.src_mr.lkey().0,
        p.dst_mr.addr(),
        p.dst_mr.rkey().0,
    );
    let (mut sc, mut skip, mut budget, mut out) = (scope, skip_mod, BUDGET_NS, st.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut l),
        arg(&mut lk),
        arg(&mut r),
        arg(&mut rk),
        arg(&mut sc),
        arg(&mut skip),
        arg(&mut budget),
        arg(&mut out),
    ];
    // SAFETY: the callers' kernels take exactly these parameters; pointers are live
    // device-visible memory.
    unsafe {
        super::launch_own(
            &p.gpu,
            kernel,
            (1, 1, 1),
            (THREADS as u32, 1, 1),
            &mut params,
        )?
    };
    st.expect_ok()
}

/// The remote buffer `gv_test_scopes` starts from: a get source and the atomics' operands.
fn scopes_remote_start() -> Vec<u8> {
    let mut dst0 = vec![0u8; 8192];
    for (i, b) in dst0[3584..4608].iter_mut().enumerate() {
        *b = (i as u32 * 13 + 5) as u8;
    }
    for t in 0..THREADS {
        let t64 = t as u64;
        put_u64(&mut dst0, 4608 + 8 * t, 1000 + t64);
        put_u64(&mut dst0, 5120 + 8 * t, 2000 + t64);
        put_u32(&mut dst0, 5632 + 4 * t, 300 + t as u32);
        put_u32(&mut dst0, 5888 + 4 * t, 400 + t as u32);
        put_u64(&mut dst0, 6144 + 8 * t, 0x0000_0001_ffff_fff0 + t64);
        put_u64(&mut dst0, 6656 + 8 * t, 0x1111_2222_3333_0000 | t64);
        put_u32(&mut dst0, 7168 + 4 * t, 0x00ff_1000 | (0xc0 + t as u32));
        put_u32(
            &mut dst0,
            7424 + 4 * t,
            0x7700_0000 | (t as u32) << 8 | t as u32,
        );
    }
    dst0
}

/// Both buffers as `gv_test_scopes` must leave them (local, remote), and how many threads took
/// part, with every `skip_mod`-th thread left out (0: none).
fn scopes_expected(src0: &[u8], dst0: &[u8], skip_mod: u32) -> (Vec<u8>, Vec<u8>, usize) {
    let (mut want_src, mut want_dst) = (src0.to_vec(), dst0.to_vec());
    let part = |t: usize| skip_mod == 0 || t % skip_mod as usize != skip_mod as usize - 1;
    let mask: u64 = (0..THREADS).filter(|&t| part(t)).map(|t| 1u64 << t).sum();
    let mut n = 0;
    for t in (0..THREADS).filter(|&t| part(t)) {
        n += 1;
        let t64 = t as u64;
        put_u64(&mut want_dst, 64 + 8 * t, 0x5157_0000_0000_0000 | t64);
        let ps = 1024 + 16 * t;
        want_dst[ps..ps + 16].copy_from_slice(&src0[ps..ps + 16]);
        let pss = 2048 + 16 * t;
        want_dst[pss..pss + 16].copy_from_slice(&src0[pss..pss + 16]);
        put_u64(
            &mut want_dst,
            3072 + 8 * t,
            0xc0de_0000_0000_005a | t64 << 8,
        );
        let g = 3584 + 16 * t;
        want_src[g..g + 16].copy_from_slice(&dst0[g..g + 16]);
        // fetch-add +(t + 1)
        put_u64(&mut want_dst, 4608 + 8 * t, 1000 + t64 + t64 + 1);
        put_u64(&mut want_src, 4608 + 8 * t, 1000 + t64);
        // compare-swap: swaps for even t
        if t % 2 == 0 {
            put_u64(&mut want_dst, 5120 + 8 * t, 0xc5000 + t64);
        }
        put_u64(&mut want_src, 5120 + 8 * t, 2000 + t64);
        // 4-byte: old values big-endian
        put_u32(&mut want_dst, 5632 + 4 * t, 307 + t as u32);
        want_src[5632 + 4 * t..5636 + 4 * t].copy_from_slice(&(300 + t as u32).to_be_bytes());
        if t % 3 != 0 {
            put_u32(&mut want_dst, 5888 + 4 * t, 0xab00 + t as u32);
        }
        want_src[5888 + 4 * t..5892 + 4 * t].copy_from_slice(&(400 + t as u32).to_be_bytes());
        let mfa_old = 0x0000_0001_ffff_fff0 + t64;
        let mfa_new = masked_add(mfa_old, 0x0000_0001_0000_0010, 0x8000_0000_8000_0000);
        put_u64(&mut want_dst, 6144 + 8 * t, mfa_new);
        put_u64(&mut want_src, 6144 + 8 * t, mfa_old);
        let mcs_old = 0x1111_2222_3333_0000 | t64;
        if t % 2 == 0 {
            let smask = 0x0000_0000_ffff_0000u64;
            let new = (mcs_old & !smask) | (0xaaaa_bbbb_cccc_dddd & smask);
            put_u64(&mut want_dst, 6656 + 8 * t, new);
        }
        put_u64(&mut want_src, 6656 + 8 * t, mcs_old);
        // 4-byte masked: byte fields (the carry out of bit 31 dropped too); a compare on
        // bits 15..8 that matches for even t
        let mfa32_old = 0x00ff_1000 | (0xc0 + t as u32);
        let mfa32_new = masked_add(u64::from(mfa32_old), 0x0101_0110, 0x8080_8080) as u32;
        put_u32(&mut want_dst, 7168 + 4 * t, mfa32_new);
        want_src[7168 + 4 * t..7172 + 4 * t].copy_from_slice(&mfa32_old.to_be_bytes());
        let mcs32_old = 0x7700_0000 | (t as u32) << 8 | t as u32;
        if t % 2 == 0 {
            put_u32(
                &mut want_dst,
                7424 + 4 * t,
                (mcs32_old & 0xffff) | 0xa5a5_0000,
            );
        }
        want_src[7424 + 4 * t..7428 + 4 * t].copy_from_slice(&mcs32_old.to_be_bytes());
    }
    put_u64(&mut want_dst, 0, mask);
    put_u64(&mut want_dst, 8, mask);
    (want_src, want_dst, n)
}

/// `gv_test_gin` on two pairs: put_signal_set, put_value (1, 2, 4, 8 bytes; 3 is INVALID),
/// get_wait (the kernel checks the bytes as soon as it returns), signal / wait_signal /
/// read_signal / reset_signal / signal_set on a word the kernel reads, wait_signal's TIMEOUT,
/// flush_all over both QPs (one WQE published and not rung) and flush of one.
pub fn gin(ordinal: usize, mode: DoorbellMode, mem: Mem, rings: RingPlacement) -> Result<String> {
    let spec = |bytes| PairSpec {
        mode,
        bytes,
        sq_blocks: 64,
        mem,
        rings,
    };
    let p = Pair::with(ordinal, spec(8192))?;
    let p2 = Pair::with(ordinal, spec(4096))?;
    let got: Vec<u8> = (0..64u32).map(|i| (i * 7 + 3) as u8).collect();
    p.dst.write(256, &got)?;
    let (src0, src20) = (p.src.to_vec()?, p2.src.to_vec()?);
    let vals = p.gpu.alloc(16 * 8)?;
    vals.write(0, &[0xffu8; 16 * 8])?;
    let st = Status::new(&p.gpu)?;
    let (mut q, mut q2) = (p.export.ptr(), p2.export.ptr());
    let (mut l, mut lk, mut r, mut rk) = (
        p.src_d,
        p.src_mr.lkey().0,
        p.dst_mr.addr(),
        p.dst_mr.rkey().0,
    );
    let (mut l2, mut lk2, mut r2, mut rk2) = (
        p2.src_d,
        p2.src_mr.lkey().0,
        p2.dst_mr.addr(),
        p2.dst_mr.rkey().0,
    );
    let (mut rw, mut budget, mut out, mut v) =
        (p.dst.gpu_addr(&p.gpu)?, BUDGET_NS, st.ptr(), vals.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut q2),
        arg(&mut l),
        arg(&mut lk),
        arg(&mut r),
        arg(&mut rk),
        arg(&mut l2),
        arg(&mut lk2),
        arg(&mut r2),
        arg(&mut rk2),
        arg(&mut rw),
        arg(&mut budget),
        arg(&mut out),
        arg(&mut v),
    ];
    // SAFETY: parameters match gv_test_gin; pointers are live device-visible memory.
    unsafe { super::launch_own(&p.gpu, "gv_test_gin", (1, 1, 1), (1, 1, 1), &mut params)? };
    st.expect_ok()?;
    let mut raw = [0u8; 16 * 8];
    vals.read(0, &mut raw)?;
    let val = |i: usize| u64::from_ne_bytes(raw[8 * i..8 * i + 8].try_into().unwrap());
    ensure!(
        val(0) == 3,
        "put_value of 3 bytes: status {} (INVALID expected)",
        val(0)
    );
    ensure!(
        val(1) == 0,
        "get_wait returned before byte {} was there",
        val(1) - 1
    );
    let signals: Vec<u64> = (2..9).map(val).collect();
    ensure!(
        signals == [5, 5, 0, 9, 10, 2, 10],
        "signal word: waited 5 saw {}, read {}, after reset {}, set 9 saw {}, +1 saw {}, \
         wait for 11: status {} saw {}",
        signals[0],
        signals[1],
        signals[2],
        signals[3],
        signals[4],
        signals[5],
        signals[6]
    );
    ensure!(
        (val(9), val(10), val(11)) == (0, 0xffff, 0),
        "flush_all {} (failed QP {}), flush {}",
        val(9),
        val(10),
        val(11)
    );
    let mut want = vec![0u8; 8192];
    want[..64].copy_from_slice(&src0[..64]);
    want[256..320].copy_from_slice(&got);
    want[1024..1280].copy_from_slice(&src0[1024..1280]);
    want[2048..2112].copy_from_slice(&src0[2048..2112]);
    put_u64(&mut want, 4096, 0x1234_5678_9abc_def0);
    put_u64(&mut want, 4104, 0x0102_0304_0506_0708);
    put_u32(&mut want, 4112, 0xa1b2_c3d4);
    want[4116..4118].copy_from_slice(&0xbeefu16.to_ne_bytes());
    want[4118] = 0x7f;
    put_u64(&mut want, 4200, 10);
    same("remote buffer of QP 1", &p.dst.to_vec()?, &want)?;
    let mut want_src = src0.clone();
    want_src[512..576].copy_from_slice(&got);
    same("local buffer of QP 1", &p.src.to_vec()?, &want_src)?;
    let mut want2 = vec![0u8; 4096];
    want2[..512].copy_from_slice(&src20[..512]);
    want2[1024..1088].copy_from_slice(&src20[1024..1088]);
    same("remote buffer of QP 2", &p2.dst.to_vec()?, &want2)?;
    for pair in [&p, &p2] {
        if let Some(c) = counters(&pair.a) {
            ensure!(
                c.errors.is_empty() && c.device_memory_errors == 0,
                "device: {c:?}"
            );
        }
    }
    Ok(format!(
        "put_signal_set, put_value (8/4/2/1 bytes; 3 refused), get_wait, signal word read / \
         wait / reset / set, flush_all over 2 QPs (an unrung WQE rung by it), flush: every byte \
         checked (payload {mem:?}, rings {rings:?})"
    ))
}

/// `gv_test_counters` at `scope` with every `skip_mod`-th thread left out: put_counted,
/// put_signal_counted, put_signal_set_counted and get_counted from 64 threads, each kind on a
/// counter of its own; the kernel waits for each counter to reach the number of participants
/// (polling, no quiet) and checks the gets' bytes at once; the host checks the counters, the
/// signal words and both buffers bit for bit.
pub fn counted(
    ordinal: usize,
    mode: DoorbellMode,
    mem: Mem,
    rings: RingPlacement,
    scope: u32,
    skip_mod: u32,
) -> Result<String> {
    let spec = PairSpec {
        mode,
        bytes: 8192,
        sq_blocks: 512,
        mem,
        rings,
    };
    let p = Pair::with(ordinal, spec)?;
    let src0 = p.src.to_vec()?;
    let mut dst0 = vec![0u8; 8192];
    for (i, b) in dst0[4096..4096 + 16 * THREADS].iter_mut().enumerate() {
        *b = (i as u32 * 11 + 1) as u8;
    }
    p.dst.write(0, &dst0)?;
    let ctr = p.gpu.alloc(4 * 8)?;
    let vals = p.gpu.alloc(8 * 8)?;
    vals.write(0, &[0xffu8; 64])?;
    let st = Status::new(&p.gpu)?;
    let (mut q, mut l, mut lk, mut r, mut rk) = (
        p.export.ptr(),
        p.src_d,
        p.src_mr.lkey().0,
        p.dst_mr.addr(),
        p.dst_mr.rkey().0,
    );
    let (mut sc, mut skip, mut c, mut budget, mut out, mut v) =
        (scope, skip_mod, ctr.ptr(), BUDGET_NS, st.ptr(), vals.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut l),
        arg(&mut lk),
        arg(&mut r),
        arg(&mut rk),
        arg(&mut sc),
        arg(&mut skip),
        arg(&mut c),
        arg(&mut budget),
        arg(&mut out),
        arg(&mut v),
    ];
    // SAFETY: parameters match gv_test_counters; pointers are live device-visible memory.
    unsafe {
        super::launch_own(
            &p.gpu,
            "gv_test_counters",
            (1, 1, 1),
            (THREADS as u32, 1, 1),
            &mut params,
        )?
    };
    st.expect_ok()?;
    let part = |t: usize| skip_mod == 0 || t % skip_mod as usize != skip_mod as usize - 1;
    let n = (0..THREADS).filter(|&t| part(t)).count() as u64;
    let mut raw = [0u8; 64];
    vals.read(0, &mut raw)?;
    let val = |i: usize| u64::from_ne_bytes(raw[8 * i..8 * i + 8].try_into().unwrap());
    let seen: Vec<u64> = (0..4).map(val).collect();
    ensure!(
        seen == [n; 4],
        "counters seen by wait_counter {seen:?}, {n} expected each"
    );
    ensure!(val(4) == 0, "get_counted: byte {} not there", val(4) - 1);
    ensure!(
        (val(5), val(6)) == (0, n),
        "after reset_counter: {}; the other counter read {}",
        val(5),
        val(6)
    );
    let mut craw = [0u8; 32];
    ctr.read(0, &mut craw)?;
    let cv: Vec<u64> = (0..4)
        .map(|i| u64::from_ne_bytes(craw[8 * i..8 * i + 8].try_into().unwrap()))
        .collect();
    // the final quiet took every CQE: no counter moved after the kernel read them
    ensure!(cv == [0, n, n, n], "counters at the end: {cv:?}");
    let (mut want_src, mut want_dst) = (src0.clone(), dst0.clone());
    let mut mask = 0u64;
    for t in (0..THREADS).filter(|&t| part(t)) {
        mask |= 1 << t;
        for base in [1024, 2048, 3072] {
            let o = base + 16 * t;
            want_dst[o..o + 16].copy_from_slice(&src0[o..o + 16]);
        }
        put_u64(&mut want_dst, 64 + 8 * t, 0xc0c0_0000_0000_0000 | t as u64);
        let g = 4096 + 16 * t;
        want_src[g..g + 16].copy_from_slice(&dst0[g..g + 16]);
    }
    put_u64(&mut want_dst, 0, mask);
    same("remote buffer", &p.dst.to_vec()?, &want_dst)?;
    same("local buffer", &p.src.to_vec()?, &want_src)?;
    if let Some(c) = counters(&p.a) {
        ensure!(
            c.errors.is_empty() && c.device_memory_errors == 0,
            "device: {c:?}"
        );
    }
    let scope_name = ["thread", "warp", "block"][scope as usize % 3];
    Ok(format!(
        "{scope_name} scope, {n} of {THREADS} threads: put_counted, put_signal_counted, \
         put_signal_set_counted, get_counted each moved its counter to {n} (wait_counter, no \
         quiet), reset_counter, every byte checked (payload {mem:?}, rings {rings:?})"
    ))
}

/// Counted puts into a forged rkey: wait_counter returns ERROR_CQE with REMOTE_ACCESS and
/// the counter still 0 (a failed or flushed WQE never moves it), within its budget.
pub fn counter_error(ordinal: usize) -> Result<String> {
    let p = Pair::new(ordinal, DoorbellMode::GpuDoorbell, 4096, 64)?;
    let ctr = p.gpu.alloc(8)?;
    let vals = p.gpu.alloc(3 * 8)?;
    vals.write(0, &[0xffu8; 24])?;
    let (mut q, mut l, mut lk, mut r, mut bad) = (
        p.export.ptr(),
        p.src_d,
        p.src_mr.lkey().0,
        p.dst_mr.addr(),
        p.dst_mr.rkey().0 ^ 0x5500,
    );
    let (mut c, mut budget, mut v) = (ctr.ptr(), BUDGET_NS, vals.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut l),
        arg(&mut lk),
        arg(&mut r),
        arg(&mut bad),
        arg(&mut c),
        arg(&mut budget),
        arg(&mut v),
    ];
    // SAFETY: parameters match gv_test_counter_error; pointers are live device memory.
    unsafe {
        super::launch_own(
            &p.gpu,
            "gv_test_counter_error",
            (1, 1, 1),
            (1, 1, 1),
            &mut params,
        )?
    };
    let mut raw = [0u8; 24];
    vals.read(0, &mut raw)?;
    let val = |i: usize| u64::from_ne_bytes(raw[8 * i..8 * i + 8].try_into().unwrap());
    let mut craw = [0u8; 8];
    ctr.read(0, &mut craw)?;
    let counter = u64::from_ne_bytes(craw);
    ensure!(
        (val(0), val(1), val(2), counter) == (1, 0, 0x13, 0),
        "wait_counter: status {} seen {} syndrome {:#x}; counter {counter} (ERROR_CQE, 0, \
         0x13, 0 expected)",
        val(0),
        val(1),
        val(2)
    );
    ensure!(
        p.dst.to_vec()?.iter().all(|&b| b == 0),
        "bytes landed despite the bad key"
    );
    Ok(
        "counted puts into a bad rkey: wait_counter ERROR_CQE REMOTE_ACCESS, the counter still 0"
            .into(),
    )
}

/// `gv_test_scope_waits` at `scope` (1 warp, 2 block) with every `skip_mod`-th thread left out:
/// a put then flush at the scope, get_wait at the scope and a load of what it read; both
/// buffers checked whole (non-participants' bytes untouched).
pub fn scope_waits(
    ordinal: usize,
    mode: DoorbellMode,
    mem: Mem,
    rings: RingPlacement,
    scope: u32,
    skip_mod: u32,
) -> Result<String> {
    ensure!(
        scope == 1 || scope == 2,
        "gv_test_scope_waits runs at warp (1) or block (2) scope"
    );
    let spec = PairSpec {
        mode,
        bytes: 4096,
        sq_blocks: 256,
        mem,
        rings,
    };
    let p = Pair::with(ordinal, spec)?;
    let mut src0 = p.src.to_vec()?;
    src0[1024..3072].fill(0);
    p.src.write(0, &src0)?;
    let mut dst0 = vec![0u8; 4096];
    for (i, b) in dst0[1024..2048].iter_mut().enumerate() {
        *b = (i as u32 * 29 + 11) as u8 | 0x40;
    }
    p.dst.write(0, &dst0)?;
    launch_scoped(&p, "gv_test_scope_waits", scope, skip_mod)?;
    let part = |t: usize| skip_mod == 0 || t % skip_mod as usize != skip_mod as usize - 1;
    let (mut want_src, mut want_dst) = (src0.clone(), dst0.clone());
    let mut n = 0;
    for t in (0..THREADS).filter(|&t| part(t)) {
        n += 1;
        let (o, g) = (16 * t, 1024 + 16 * t);
        want_dst[o..o + 16].copy_from_slice(&src0[o..o + 16]);
        want_src[g..g + 16].copy_from_slice(&dst0[g..g + 16]);
        want_src[g + 1024..g + 1040].copy_from_slice(&dst0[g..g + 16]);
    }
    same("local buffer", &p.src.to_vec()?, &want_src)?;
    same("remote buffer", &p.dst.to_vec()?, &want_dst)?;
    let desc = p.export.read()?;
    ensure!(desc.sq_retired == desc.sq_ready, "{desc:?}");
    let at = if scope == 1 { "warp" } else { "block" };
    Ok(format!(
        "{n} of {THREADS} threads: put + flush_{at}, get_wait_{at} and a load of its bytes; \
         both buffers checked"
    ))
}

/// NCCL GIN's rolling comparison on the device (`gv_test_rolling`): `rolling_le` over a table
/// of pairs at widths 4 to 64 around each wrap must agree with the host's copy
/// (`gpuverbs::gpu::rolling_le`); `wait_signal_rolling` and `wait_counter_rolling` (on an
/// exported QP with nothing posted) end OK on words that wrapped past 2^56 and 2^64, time out
/// on one that is short, refuse widths 0 and 65, ignore bits above the width; `read_signal` and
/// `read_counter` with a width mask.
pub fn rolling(ordinal: usize) -> Result<String> {
    use gpuverbs::gpu::{rolling_le, COUNTER_BITS};
    let p = Pair::new(ordinal, DoorbellMode::GpuDoorbell, 4096, 64)?;
    let gpu = p.gpu.clone();
    let mut table: Vec<(u64, u64, u32)> = Vec::new();
    for bits in [4u32, 8, 32, 56, 63, 64] {
        let m = gpuverbs::gpu::rolling_mask(bits);
        for (a, b) in [
            (0, 0),
            (1, 0),
            (m, 0),
            (m - 1, 2),
            (2, m - 1),
            (0, m >> 1),
            (0, (m >> 1) + 1),
            (m >> 1, 0),
            (0xab00_0000_0000_0003, 0x1200_0000_0000_0004),
        ] {
            table.push((a, b, bits));
        }
    }
    let n = table.len();
    ensure!(n <= 64, "one thread per pair");
    let bytes = |v: Vec<u8>| -> Result<gpuverbs::gpu::DeviceMem> {
        let m = gpu.alloc(v.len().max(8))?;
        m.write(0, &v)?;
        Ok(m)
    };
    let da = bytes(table.iter().flat_map(|t| t.0.to_ne_bytes()).collect())?;
    let db = bytes(table.iter().flat_map(|t| t.1.to_ne_bytes()).collect())?;
    let dbits = bytes(table.iter().flat_map(|t| t.2.to_ne_bytes()).collect())?;
    let cmp = bytes(vec![0xffu8; 4 * n])?;
    let w = bytes(3u64.to_ne_bytes().to_vec())?;
    let hi = bytes(0xab00_0000_0000_0003u64.to_ne_bytes().to_vec())?;
    let out = bytes(vec![0u8; 16 * 8])?;
    let (mut q, mut a, mut b, mut bits, mut n_, mut c) = (
        p.export.ptr(),
        da.ptr(),
        db.ptr(),
        dbits.ptr(),
        n as u32,
        cmp.ptr(),
    );
    let (mut w_, mut hi_, mut budget, mut short, mut o) =
        (w.ptr(), hi.ptr(), BUDGET_NS, 2_000_000u64, out.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut a),
        arg(&mut b),
        arg(&mut bits),
        arg(&mut n_),
        arg(&mut c),
        arg(&mut w_),
        arg(&mut hi_),
        arg(&mut budget),
        arg(&mut short),
        arg(&mut o),
    ];
    // SAFETY: parameters match gv_test_rolling; every pointer is a live allocation of this
    // GPU sized as the kernel reads and writes it (n pairs, 16 result words).
    unsafe { super::launch_own(&gpu, "gv_test_rolling", (1, 1, 1), (64, 1, 1), &mut params)? };
    let mut got = vec![0u8; 4 * n];
    cmp.read(0, &mut got)?;
    for (i, &(a, b, bits)) in table.iter().enumerate() {
        let dev = u32::from_ne_bytes(got[4 * i..4 * i + 4].try_into()?);
        let want = u32::from(rolling_le(a, b, bits));
        ensure!(
            dev == want,
            "rolling_le({a:#x}, {b:#x}, {bits}): device {dev}, host {want}"
        );
    }
    let mut o = [0u8; 16 * 8];
    out.read(0, &mut o)?;
    let r: Vec<u64> = o
        .chunks(8)
        .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let (ok, timeout, invalid) = (0u64, 2u64, 3u64);
    let want = [
        (0, ok, "wait_signal_rolling(w, 2^56 - 2, 56)"),
        (2, ok, "wait_signal_rolling(w, 2^64 - 2, 64)"),
        (4, timeout, "wait_signal_rolling(w, 4, 56)"),
        (6, invalid, "wait_signal_rolling(bits 0)"),
        (7, invalid, "wait_signal_rolling(bits 65)"),
        (8, ok, "wait_signal_rolling(hi, 2^56 - 2, 56)"),
        (12, ok, "wait_counter_rolling(q, w, 2^56 - 2, COUNTER_BITS)"),
        (14, timeout, "wait_counter_rolling(q, w, 4, 56)"),
    ];
    for (k, s, what) in want {
        ensure!(
            r[k] == s,
            "{what}: {} (want {})",
            super::status_name(r[k] as i32),
            super::status_name(s as i32)
        );
    }
    ensure!(
        r[1] == 3 && r[3] == 3 && r[5] == 3 && r[9] == 3 && r[13] == 3 && r[15] == 3,
        "seen values {r:?}"
    );
    ensure!(
        r[10] == 3 && r[11] == 3,
        "masked reads {:#x} {:#x}",
        r[10],
        r[11]
    );
    ensure!(COUNTER_BITS == 56);
    Ok(format!(
        "rolling_le agrees with the host on {n} pairs (widths 4..64, across each wrap); waits \
         across the 56- and 64-bit wraps OK, a short one TIMEOUT, widths 0 and 65 INVALID"
    ))
}

#[cfg(test)]
mod tests {
    use super::masked_add;

    #[test]
    fn masked_add_keeps_carries_in_their_fields() {
        // no boundary: a plain add
        assert_eq!(masked_add(u64::MAX, 1, 0), 0);
        assert_eq!(masked_add(5, 7, 0), 12);
        // two 32-bit fields: the low one wraps without touching the high one
        assert_eq!(
            masked_add(
                0x0000_0001_ffff_fff0,
                0x0000_0001_0000_0010,
                0x8000_0000_8000_0000
            ),
            0x0000_0002_0000_0000
        );
        // bytes
        assert_eq!(
            masked_add(0x00ff_00ff, 0x0001_0001, 0x8080_8080),
            0x0000_0000
        );
    }
}
