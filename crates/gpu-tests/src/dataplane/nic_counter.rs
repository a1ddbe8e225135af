//! Counters the NIC moves (issue 46 item 2): put_counter, put_signal_counter, signal_counter
//! and get_counter on a QP and its companion (`Pd::create_companion`), at thread, warp and
//! block scope; a counted put that fails; the post rate of put_counter next to put + poll.
//! The counters live in GPU memory and the host reads them with `DeviceMem::read_counter`.

use anyhow::{ensure, Result};
use gpuverbs::gpu::{DeviceMem, ExportedQp};
use gpuverbs::proxy::{ProxyConfig, ProxyService, ProxyTarget};
use gpuverbs::queue::CqMode;
use gpuverbs::{Access, CqOptions, DoorbellMode, Mr, Qp, QpOptions, RingPlacement};
use std::time::Duration;

use super::{arg, counters, Mem, Pair, PairSpec, Status, BUDGET_NS};

/// Threads of the `gv_test_nic_counters` block (one bit of a signal word each).
const THREADS: usize = 64;

/// A companion of side A's QP, exported, its counters (in GPU memory, registered for the
/// companion's fetch-adds) and, in CPU-proxy mode, the proxy ringing for it. Dropped in field
/// order: the proxy, the export, the registration, the counters, the QP.
pub struct Companion {
    _proxy: Option<ProxyService>,
    pub export: ExportedQp,
    pub ctr_mr: Mr,
    pub ctr: DeviceMem,
    _qp: Qp,
}

impl Companion {
    /// A companion for `p.qa` with `sq_blocks` blocks (its CQ as deep), rung in `mode`, its
    /// rings placed as `rings`, and `words` zeroed 8-byte counters.
    pub fn new(
        p: &Pair,
        mode: DoorbellMode,
        rings: RingPlacement,
        sq_blocks: u32,
        words: usize,
    ) -> Result<Self> {
        let cq = p.a.create_cq_on(
            &p.gpu,
            CqOptions {
                depth: sq_blocks,
                placement: rings,
                mode: CqMode::OverrunIgnore,
                ..Default::default()
            },
        )?;
        let mut o = QpOptions::new(&cq, &cq);
        o.sq_blocks = sq_blocks;
        o.doorbell = mode;
        o.placement = rings;
        let pd = p.qa.pd();
        let qp = pd.create_companion(Some(&p.gpu), o)?;
        let export = p.gpu.export_qp(&qp)?;
        let proxy = if mode.proxied() {
            let svc = ProxyService::start(ProxyConfig::default())?;
            let _handle = svc.add(ProxyTarget::for_qp(&qp)?)?;
            Some(svc)
        } else {
            None
        };
        let ctr = p.gpu.alloc(8 * words)?;
        ctr.write(0, &vec![0u8; 8 * words])?;
        let ctr_mr = pd.register_device_mem(&ctr, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
        Ok(Self {
            _proxy: proxy,
            export,
            ctr_mr,
            ctr,
            _qp: qp,
        })
    }

    /// The counters as the host reads them now.
    pub fn read(&self, words: usize) -> Result<Vec<u64>> {
        (0..words)
            .map(|i| Ok(self.ctr.read_counter(8 * i)?))
            .collect()
    }
}

/// `gv_test_nic_counters` at `scope` with every `skip_mod`-th thread left out: put_counter,
/// put_signal_counter, signal_counter and get_counter from 64 threads (each at `scope`), each
/// kind on a counter of its own, the companion's WAITs and fetch-adds moving them with no
/// thread polling for them. On the soft NIC the QP's completions are delayed 300 ms, and the
/// kernel checks that no counter moved before. The kernel waits for each counter
/// (wait_counter over the QP and its companion) and checks the gets' bytes; the host reads the
/// counters (`read_counter`) and checks the signal words and both buffers bit for bit.
pub fn nic_counters(
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
    let comp = Companion::new(&p, mode, rings, 1024, 4)?;
    let src0 = p.src.to_vec()?;
    let mut dst0 = vec![0u8; 8192];
    for (i, b) in dst0[4096..4096 + 16 * THREADS].iter_mut().enumerate() {
        *b = (i as u32 * 11 + 1) as u8;
    }
    p.dst.write(0, &dst0)?;
    let delayed = match p.qa.soft() {
        Some(q) => {
            q.inject(gpuverbs::soft::Fault::DelayCompletions(
                Duration::from_millis(300),
            ));
            true
        }
        None => false,
    };
    let vals = p.gpu.alloc(8 * 8)?;
    vals.write(0, &[0xffu8; 64])?;
    let st = Status::new(&p.gpu)?;
    let (mut q, mut cp, mut l, mut lk, mut r, mut rk) = (
        p.export.ptr(),
        comp.export.ptr(),
        p.src_d,
        p.src_mr.lkey().0,
        p.dst_mr.addr(),
        p.dst_mr.rkey().0,
    );
    let (mut sc, mut skip, mut c, mut ck, mut cd, mut early) = (
        scope,
        skip_mod,
        comp.ctr_mr.addr(),
        comp.ctr_mr.rkey().0,
        comp.ctr.ptr(),
        u32::from(delayed),
    );
    let (mut budget, mut out, mut v) = (BUDGET_NS, st.ptr(), vals.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut cp),
        arg(&mut l),
        arg(&mut lk),
        arg(&mut r),
        arg(&mut rk),
        arg(&mut sc),
        arg(&mut skip),
        arg(&mut c),
        arg(&mut ck),
        arg(&mut cd),
        arg(&mut early),
        arg(&mut budget),
        arg(&mut out),
        arg(&mut v),
    ];
    // SAFETY: parameters match gv_test_nic_counters; pointers are live device-visible memory.
    unsafe {
        super::launch_own(
            &p.gpu,
            "gv_test_nic_counters",
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
    ensure!(val(4) == 0, "get_counter: byte {} not there", val(4) - 1);
    if delayed {
        ensure!(
            val(5) == 0,
            "the counters moved ({} in all) before their WQEs' completions (delayed 300 ms)",
            val(5)
        );
    }
    let cv = comp.read(4)?;
    ensure!(cv == [n; 4], "counters read by the host: {cv:?}");
    check_buffers(&p, &src0, &dst0, &part)?;
    if let Some(c) = counters(&p.a) {
        ensure!(
            c.errors.is_empty() && c.device_memory_errors == 0,
            "device: {c:?}"
        );
    }
    let scope_name = ["thread", "warp", "block"][scope as usize % 3];
    Ok(format!(
        "{scope_name} scope, {n} of {THREADS} threads: put_counter, put_signal_counter, \
         signal_counter, get_counter each moved its counter to {n} through the companion (no \
         poll: wait_counter, read_counter on the host){}, every byte checked (payload {mem:?}, \
         rings {rings:?})",
        if delayed {
            "; none moved before the QP's delayed CQEs"
        } else {
            ""
        }
    ))
}

/// Both buffers as they must end: the participants' puts, signal bits and gets.
fn check_buffers(p: &Pair, src0: &[u8], dst0: &[u8], part: &dyn Fn(usize) -> bool) -> Result<()> {
    let (mut want_src, mut want_dst) = (src0.to_vec(), dst0.to_vec());
    let mut mask = 0u64;
    for t in (0..THREADS).filter(|&t| part(t)) {
        mask |= 1 << t;
        for base in [1024, 2048] {
            let o = base + 16 * t;
            want_dst[o..o + 16].copy_from_slice(&src0[o..o + 16]);
        }
        let g = 4096 + 16 * t;
        want_src[g..g + 16].copy_from_slice(&dst0[g..g + 16]);
    }
    want_dst[0..8].copy_from_slice(&mask.to_ne_bytes());
    want_dst[8..16].copy_from_slice(&mask.to_ne_bytes());
    super::gin::same("remote buffer", &p.dst.to_vec()?, &want_dst)?;
    super::gin::same("local buffer", &p.src.to_vec()?, &want_src)
}

/// A counted put that completes moves its counter to 1; three into a forged rkey do not move
/// it: wait_counter returns ERROR_CQE with REMOTE_ACCESS and the counter is still 1 (read by
/// the kernel and by the host), no byte landed.
pub fn nic_counter_error(ordinal: usize) -> Result<String> {
    let p = Pair::new(ordinal, DoorbellMode::GpuDoorbell, 4096, 64)?;
    let comp = Companion::new(
        &p,
        DoorbellMode::GpuDoorbell,
        RingPlacement::HostMapped,
        64,
        1,
    )?;
    let vals = p.gpu.alloc(5 * 8)?;
    vals.write(0, &[0xffu8; 40])?;
    let (mut q, mut cp, mut l, mut lk, mut r, mut rk) = (
        p.export.ptr(),
        comp.export.ptr(),
        p.src_d,
        p.src_mr.lkey().0,
        p.dst_mr.addr(),
        p.dst_mr.rkey().0,
    );
    let (mut bad, mut c, mut ck, mut cd) = (
        p.dst_mr.rkey().0 ^ 0x5500,
        comp.ctr_mr.addr(),
        comp.ctr_mr.rkey().0,
        comp.ctr.ptr(),
    );
    let (mut budget, mut v) = (BUDGET_NS, vals.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut cp),
        arg(&mut l),
        arg(&mut lk),
        arg(&mut r),
        arg(&mut rk),
        arg(&mut bad),
        arg(&mut c),
        arg(&mut ck),
        arg(&mut cd),
        arg(&mut budget),
        arg(&mut v),
    ];
    // SAFETY: parameters match gv_test_nic_counter_error; pointers are live device memory.
    unsafe {
        super::launch_own(
            &p.gpu,
            "gv_test_nic_counter_error",
            (1, 1, 1),
            (1, 1, 1),
            &mut params,
        )?
    };
    let mut raw = [0u8; 40];
    vals.read(0, &mut raw)?;
    let val = |i: usize| u64::from_ne_bytes(raw[8 * i..8 * i + 8].try_into().unwrap());
    let host = comp.read(1)?[0];
    ensure!(
        (val(0), val(1), val(2), val(3), val(4), host) == (0, 1, 1, 0x13, 1, 1),
        "first wait {}, second wait {} seeing {} syndrome {:#x}, counter {} (kernel) {host} \
         (host); (OK, ERROR_CQE, 1, 0x13, 1, 1) expected",
        val(0),
        val(1),
        val(2),
        val(3),
        val(4)
    );
    let dst = p.dst.to_vec()?;
    ensure!(
        dst[64..256].iter().all(|&b| b == 0),
        "bytes landed despite the bad key"
    );
    Ok(
        "a counted put moved its counter to 1; three into a bad rkey did not (wait_counter \
        ERROR_CQE REMOTE_ACCESS, the counter 1 in the kernel and on the host)"
            .into(),
    )
}

/// NVIDIA's GPUNetIO `doca_gpu_dev_verbs_put_counter` (its device code, from the headers
/// `GPUNETIO_SRC` named at build time) on one QP and companion that gpuverbs made and exported,
/// gpuverbs' `put_counter` on a second pair, the same 32 puts of 64 bytes each: both counters
/// must reach 32 (read by the kernel and by the host) and both remote buffers hold the same
/// bytes. Skips when gpu-test was built without `GPUNETIO_SRC`.
pub fn gpunetio_counter(ordinal: usize) -> Result<String> {
    let headers = env!("GPU_TESTS_GPUNETIO");
    if headers.is_empty() {
        return Err(super::Skip(
            "built without GPUNETIO_SRC (NVIDIA's GPUNetIO headers are an input of the build)"
                .into(),
        )
        .into());
    }
    const N: usize = 32;
    const SIZE: usize = 64;
    let g = Pair::new(ordinal, DoorbellMode::GpuDoorbell, 4096, 64)?;
    let v = Pair::new(ordinal, DoorbellMode::GpuDoorbell, 4096, 64)?;
    let (gc, vc) = (
        Companion::new(
            &g,
            DoorbellMode::GpuDoorbell,
            RingPlacement::HostMapped,
            64,
            1,
        )?,
        Companion::new(
            &v,
            DoorbellMode::GpuDoorbell,
            RingPlacement::HostMapped,
            64,
            1,
        )?,
    );
    let dq = g.gpu.alloc(2 * 512)?;
    let vals = g.gpu.alloc(4 * 8)?;
    vals.write(0, &[0u8; 32])?;
    let (mut gq, mut gcp, mut vq, mut vcp, mut dqp) = (
        g.export.ptr(),
        gc.export.ptr(),
        v.export.ptr(),
        vc.export.ptr(),
        dq.ptr(),
    );
    // each pair puts from its own source buffer (registered in its own PD), the same bytes
    v.src.write(0, &g.src.to_vec()?)?;
    let (mut src, mut lk, mut src_v, mut lk_v) =
        (g.src_d, g.src_mr.lkey().0, v.src_d, v.src_mr.lkey().0);
    let (mut dst_g, mut rk_g, mut dst_v, mut rk_v) = (
        g.dst_mr.addr(),
        g.dst_mr.rkey().0,
        v.dst_mr.addr(),
        v.dst_mr.rkey().0,
    );
    let (mut ctr_g, mut ck_g, mut ctr_g_d, mut ctr_v, mut ck_v, mut ctr_v_d) = (
        gc.ctr_mr.addr(),
        gc.ctr_mr.rkey().0,
        gc.ctr.ptr(),
        vc.ctr_mr.addr(),
        vc.ctr_mr.rkey().0,
        vc.ctr.ptr(),
    );
    let (mut size, mut budget, mut out) = (SIZE as u32, BUDGET_NS, vals.ptr());
    let mut params = [
        arg(&mut gq),
        arg(&mut gcp),
        arg(&mut vq),
        arg(&mut vcp),
        arg(&mut dqp),
        arg(&mut src),
        arg(&mut lk),
        arg(&mut src_v),
        arg(&mut lk_v),
        arg(&mut dst_g),
        arg(&mut rk_g),
        arg(&mut dst_v),
        arg(&mut rk_v),
        arg(&mut ctr_g),
        arg(&mut ck_g),
        arg(&mut ctr_g_d),
        arg(&mut ctr_v),
        arg(&mut ck_v),
        arg(&mut ctr_v_d),
        arg(&mut size),
        arg(&mut budget),
        arg(&mut out),
    ];
    // SAFETY: parameters match gv_test_gpunetio_counter; pointers are live device memory.
    unsafe {
        super::launch_own(
            &g.gpu,
            "gv_test_gpunetio_counter",
            (1, 1, 1),
            (N as u32, 1, 1),
            &mut params,
        )?
    };
    let mut raw = [0u8; 32];
    vals.read(0, &mut raw)?;
    let val = |i: usize| u64::from_ne_bytes(raw[8 * i..8 * i + 8].try_into().unwrap());
    let (host_g, host_v) = (gc.read(1)?[0], vc.read(1)?[0]);
    ensure!(
        (val(0), val(1), val(2), val(3), host_g, host_v)
            == (N as u64, N as u64, 0, 0, N as u64, N as u64),
        "GPUNetIO's counter {} (timed out: {}), gpuverbs' {} (status {}); on the host {host_g} \
         and {host_v}; {N} each expected",
        val(0),
        val(3),
        val(1),
        val(2)
    );
    let (bg, bv) = (g.dst.to_vec()?, v.dst.to_vec()?);
    let want = g.src.to_vec()?;
    super::gin::same("GPUNetIO's puts", &bg[..N * SIZE], &want[..N * SIZE])?;
    super::gin::same("gpuverbs' puts", &bv[..N * SIZE], &want[..N * SIZE])?;
    ensure!(
        bg[N * SIZE..].iter().all(|&b| b == 0) && bv[N * SIZE..].iter().all(|&b| b == 0),
        "bytes past the puts"
    );
    Ok(format!(
        "NVIDIA's doca_gpu_dev_verbs_put_counter (headers from {headers}) on a gpuverbs QP and \
         companion, and gpuverbs' put_counter on another: {N} puts each, both counters {N} (in \
         the kernel and on the host), the same bytes"
    ))
}
