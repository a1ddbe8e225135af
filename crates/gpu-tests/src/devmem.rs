//! GPU-memory cases beyond the shared `put`/`ops` shapes: a kernel that produces and consumes
//! a payload in GPU memory (put it away, get it back, check it on the GPU), and GPU-memory
//! regions driven by the CPU initiator (no kernel: the soft NIC's CUDA copies alone).

use crate::dataplane::{arg, gpu, Mem, Pair, PairSpec, Status, BUDGET_NS};
use anyhow::{ensure, Result};
use gpuverbs::gpu::DeviceMemory;
use gpuverbs::memory::MemKind;
use gpuverbs::post::Completion;
use gpuverbs::post::RingMode;
use gpuverbs::post::{CtrlFlags, Local, Op};
use gpuverbs::{
    Access, ConnectOptions, CqOptions, DoorbellMode, Error, HostBuffer, QpOptions, RingPlacement,
};
use std::time::Duration;

/// Bytes the round trip moves: more than the soft NIC's 1 MiB staging buffer.
const ROUNDTRIP: usize = (1 << 20) + 4096;

fn pattern(seed: u32, bytes: usize) -> Vec<u8> {
    (0..bytes as u32 / 4)
        .flat_map(|i| gpuverbs::cuda::selftest_value(seed, i).to_ne_bytes())
        .collect()
}

/// `gv_test_gpumem_roundtrip`: the kernel writes a pattern into GPU memory, puts it to the
/// peer's GPU memory, gets it back into its own and checks every word on the GPU; the host
/// then checks both buffers too.
pub fn gpumem_roundtrip(
    ordinal: usize,
    mode: DoorbellMode,
    rings: RingPlacement,
) -> Result<String> {
    let n = ROUNDTRIP;
    let spec = PairSpec {
        mode,
        bytes: 2 * n,
        sq_blocks: 64,
        mem: Mem::Gpu,
        rings,
    };
    let p = Pair::with(ordinal, spec)?;
    // the local buffer starts zeroed: nothing of the pattern is there before the kernel runs
    p.src.write(0, &vec![0; 2 * n])?;
    let seed = 0x5eed_0bad_u32;
    let st = Status::new(&p.gpu)?;
    let (mut q, mut local, mut lk, mut remote, mut rk) = (
        p.export.ptr(),
        p.src_d,
        p.src_mr.lkey().0,
        p.dst_mr.addr(),
        p.dst_mr.rkey().0,
    );
    let (mut n32, mut seed_, mut budget, mut out) = (n as u32, seed, BUDGET_NS, st.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut local),
        arg(&mut lk),
        arg(&mut remote),
        arg(&mut rk),
        arg(&mut n32),
        arg(&mut seed_),
        arg(&mut budget),
        arg(&mut out),
    ];
    // SAFETY: the parameters match gv_test_gpumem_roundtrip; `local` is the device address of
    // a live 2n-byte allocation, `out` of the status words; `remote` is only a WQE address.
    unsafe {
        p.gpu.launch_sync(
            "gv_test_gpumem_roundtrip",
            (1, 1, 1),
            (256, 1, 1),
            0,
            &mut params,
        )?
    };
    let s = st.read()?;
    ensure!(
        s[4] == 0,
        "the kernel read back a wrong word at index {}",
        s[4] - 1
    );
    st.expect_ok()?;
    let want = pattern(seed, n);
    let (src, dst) = (p.src.to_vec()?, p.dst.to_vec()?);
    ensure!(dst[..n] == want[..], "the peer's GPU memory differs");
    ensure!(src[n..] == want[..], "the bytes read back differ");
    if let Some(c) = crate::dataplane::counters(&p.a) {
        ensure!(
            c.errors.is_empty() && c.device_memory_errors == 0,
            "device: {c:?}"
        );
    }
    Ok(format!(
        "{n} B written by the kernel, put and got back through GPU memory, checked on the GPU \
         and the host (rings {rings:?})"
    ))
}

/// GPU-memory regions driven by the CPU initiator (host rings): `Pd::register_gpu` on a raw
/// device pointer and `Pd::register_device_mem`; WRITE host → GPU, GPU → GPU (one GPU: a
/// device-to-device copy), READ GPU → host, fetch-add on a GPU word with the result in GPU
/// memory, 3 MiB through the staging buffer; then WRITE and READ again with the host region
/// pinned by the driver (copied directly, odd offsets); registration refuses what is not
/// device memory.
pub fn cpu_initiator_gpumem(ordinal: usize) -> Result<String> {
    let gpu = gpu(ordinal)?;
    let (a, b) = crate::dataplane::contexts()?;
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (ca, cb) = (
        a.create_cq(CqOptions::default())?,
        b.create_cq(CqOptions::default())?,
    );
    let qa = pa.create_qp(QpOptions::new(&ca, &ca))?;
    let qb = pb.create_qp(QpOptions::new(&cb, &cb))?;
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let conn = ConnectOptions {
        access: all | Access::REMOTE_ATOMIC,
        ..Default::default()
    };
    qa.connect(&qb.endpoint(), conn)?;
    qb.connect(&qa.endpoint(), conn)?;
    let big = 3 << 20;
    let ga = gpu.alloc(big)?;
    let gb = gpu.alloc(big)?;
    let host = HostBuffer::new(big);
    // refusals: a host pointer, a range past the allocation (`Gpu::alloc` allocates up to two
    // host pages more than asked, to start and end on page boundaries: 1 MiB past is past it)
    ensure!(
        matches!(
            pa.register_gpu(host.addr(), 4096, Access::LOCAL_WRITE),
            Err(Error::InvalidArgument(_))
        ),
        "a host pointer registered as GPU memory"
    );
    ensure!(
        matches!(
            pa.register_gpu(ga.ptr() + (1 << 20), big as u64, Access::LOCAL_WRITE),
            Err(Error::InvalidArgument(_))
        ),
        "a range past the allocation registered"
    );
    let mra = pa.register_gpu(ga.ptr(), big as u64, all | Access::REMOTE_ATOMIC)?;
    let mrb = pb.register_device_mem(&gb, all | Access::REMOTE_ATOMIC)?;
    let mrh = pa.register_with(&host, all)?;
    ensure!(mra.kind() == MemKind::Device && mrb.kind() == MemKind::Device);
    let mut ini = qa.try_cpu_initiator(RingMode::Doca)?;
    let mut go = |op: &Op<'_>| -> Result<()> {
        ini.post_and_ring(op, CtrlFlags::SIGNALED)?;
        let c = ini.wait_send(Duration::from_secs(10))?;
        ensure!(matches!(c, Completion::Req { .. }), "{c:?}");
        Ok(())
    };
    let data = pattern(0x1234, big);
    host.write(0, &data);
    let read_gpu = |m: &gpuverbs::gpu::DeviceMem, off: usize, n: usize| -> Result<Vec<u8>> {
        let mut v = vec![0; n];
        m.read(off, &mut v)?;
        Ok(v)
    };
    // host -> GPU (B), 3 MiB: three staging chunks
    go(&Op::Write {
        remote: mrb.remote(0),
        local: Local::Sges(&[mrh.sge(0, big as u32)]),
        imm: None,
    })?;
    ensure!(read_gpu(&gb, 0, big)? == data, "host -> GPU bytes differ");
    // GPU (B) -> GPU (A) by READ: one device-to-device copy
    go(&Op::Read {
        remote: mrb.remote(0),
        local: &[mra.sge(0, big as u32)],
    })?;
    ensure!(read_gpu(&ga, 0, big)? == data, "GPU -> GPU bytes differ");
    // GPU (B) -> host by READ
    host.fill(0, big, 0);
    go(&Op::Read {
        remote: mrb.remote(4096),
        local: &[mrh.sge(0, 8192)],
    })?;
    ensure!(
        host.to_vec()[..8192] == data[4096..4096 + 8192],
        "GPU -> host bytes differ"
    );
    // fetch-add on a GPU word, the old value into GPU memory
    gb.write(64, &41u64.to_ne_bytes())?;
    go(&Op::FetchAdd {
        remote: mrb.remote(64),
        add: 1,
        result: mra.sge(128, 8),
    })?;
    let word = |m: &gpuverbs::gpu::DeviceMem, off| -> Result<u64> {
        Ok(u64::from_ne_bytes(read_gpu(m, off, 8)?.try_into().unwrap()))
    };
    ensure!(
        word(&gb, 64)? == 42 && word(&ga, 128)? == 41,
        "fetch-add: target {} old {}",
        word(&gb, 64)?,
        word(&ga, 128)?
    );
    // the host region pinned by the driver (mapped into the GPU, as a CUDA application's own
    // pinned buffers are): its copies of 64 KiB and more go directly, not staged
    gpu.map_host(&host)?;
    let pinned = pattern(0x4321, big);
    host.write(0, &pinned);
    go(&Op::Write {
        remote: mrb.remote(0),
        local: Local::Sges(&[mrh.sge(0, big as u32)]),
        imm: None,
    })?;
    ensure!(
        read_gpu(&gb, 0, big)? == pinned,
        "pinned host -> GPU bytes differ"
    );
    host.fill(0, big, 0);
    let n = (1 << 20) + 100;
    go(&Op::Read {
        remote: mrb.remote(4096 + 3),
        local: &[mrh.sge(8192 + 5, n as u32)],
    })?;
    let back = host.to_vec();
    ensure!(
        back[8192 + 5..8192 + 5 + n] == pinned[4099..4099 + n]
            && back[..8197].iter().all(|&b| b == 0)
            && back[8197 + n..].iter().all(|&b| b == 0),
        "GPU -> pinned host bytes differ"
    );
    if let Some(c) = crate::dataplane::counters(&a) {
        ensure!(c.device_memory_errors == 0 && c.errors.is_empty(), "{c:?}");
    }
    let path = match mra.gpu_path() {
        Some(p) => format!(" (rdma-core: {p:?})"),
        None => String::new(),
    };
    // the regions go before the memory under them
    drop((mra, mrb, mrh));
    drop((ga, gb));
    Ok(format!(
        "register_gpu / register_device_mem{path}; {} MiB host -> GPU, GPU -> GPU, GPU -> \
         host, fetch-add on GPU memory, and pinned host <-> GPU verified",
        big >> 20
    ))
}

/// The registration cache on GPU memory: CUDA's buffer IDs key it (stable per allocation, new
/// for memory allocated again, whatever its address); the second registration of a
/// `DeviceMem` is a hit on the same region, on both backends (mlx5: through dma-buf or
/// peermem).
pub fn reg_cache_gpumem(ordinal: usize) -> Result<String> {
    use crate::dataplane::contexts;
    let gpu = gpu(ordinal)?;
    let (ctx, _peer) = contexts()?;
    let pd = ctx.alloc_pd();
    let rights = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let mem = gpu.alloc(1 << 20)?;
    let id = mem.buffer_id()?;
    ensure!(
        mem.clone().buffer_id()? == id,
        "a clone has another buffer ID"
    );
    let other = gpu.alloc(1 << 20)?;
    let other_id = other.buffer_id()?;
    ensure!(other_id != id, "two allocations with one buffer ID {id}");
    let cold = pd.register_cached(&mem, rights)?;
    let warm = pd.register_cached(&mem, rights)?;
    ensure!(
        cold.lkey() == warm.lkey() && cold.kind() == MemKind::Device,
        "no hit on the same allocation"
    );
    let o = pd.register_cached(&other, rights)?;
    let (old_addr, old_key) = (other.ptr(), o.lkey());
    ensure!(old_key != cold.lkey(), "two allocations, one region");
    // freed (the dead entry goes at the trim) and allocated again, perhaps at the same address
    drop((o, other));
    pd.reg_cache().trim();
    let again = gpu.alloc(1 << 20)?;
    let again_id = again.buffer_id()?;
    ensure!(
        again_id != other_id,
        "memory allocated again kept buffer ID {other_id}"
    );
    let misses = pd.reg_cache().stats().misses;
    let h = pd.register_cached(&again, rights)?;
    let st = pd.reg_cache().stats();
    ensure!(
        st.misses == misses + 1 && h.lkey() != old_key,
        "memory allocated again hit the old entry: {st:?}"
    );
    Ok(format!(
        "buffer IDs {id}, {other_id}, {again_id}; a hit on the same allocation; memory \
         allocated again {} misses",
        if again.ptr() == old_addr {
            "at the freed address"
        } else {
            "elsewhere"
        }
    ))
}

/// The soft NIC's queued writes into GPU memory (what a wire WRITE's packets become): runs of
/// packets that continue one another, across the staging slots and round the staging buffer,
/// with jumps, odd sizes, a write over bytes still queued and reads in between. The memory
/// must end exactly as the same writes applied in order on the host, and each read must see
/// every write queued before it.
pub fn devmem_queued_runs(ordinal: usize) -> Result<String> {
    let gpu = gpu(ordinal)?;
    let len = 3 << 20;
    let buf = gpu.alloc(len)?;
    let dm = gpu.device_memory();
    let base = buf.ptr();
    let mut model = vec![0u8; len];
    dm.write(base, &model)?;
    let mut writes = 0;
    let mut put = |model: &mut [u8], off: usize, n: usize, seed: u32| -> Result<()> {
        let bytes: Vec<u8> = (0..n as u32)
            .map(|i| (i.wrapping_mul(31) ^ seed) as u8)
            .collect();
        dm.write_queued(base + off as u64, &bytes)?;
        model[off..off + n].copy_from_slice(&bytes);
        writes += 1;
        Ok(())
    };
    // 2.5 MiB of 4 KiB packets in order: runs cut by the four 256 KiB slots, round the
    // staging buffer twice and a half
    for k in 0..640 {
        put(&mut model, k * 4096, 4096, k as u32)?;
    }
    // odd sizes continuing one another, then a write back over bytes just queued
    let far = 5 << 19;
    let mut at = far + 7;
    for (k, n) in [1000usize, 3, 4093, 1, 2048, 65536].into_iter().enumerate() {
        put(&mut model, at, n, 700 + k as u32)?;
        at += n;
    }
    put(&mut model, far + 500, 3000, 800)?;
    let mut seen = vec![0u8; 8192];
    dm.read(base + far as u64, &mut seen)?;
    ensure!(
        seen == model[far..far + 8192],
        "a read did not see the writes queued before it"
    );
    // more packets after the read, ending mid-slot, then the wait
    for k in 0..40 {
        put(&mut model, (1 << 20) + 13 + k * 4096, 4096, 900 + k as u32)?;
    }
    dm.settle()?;
    matches_model(&*dm, base, &model, "the writes")?;
    Ok(format!(
        "{writes} queued writes landed in order; a read in between saw the ones before it"
    ))
}

/// Reads `model.len()` bytes of device memory at `base` back and names the first byte that
/// differs from `model` (what `what` should have made it).
fn matches_model(dm: &dyn DeviceMemory, base: u64, model: &[u8], what: &str) -> Result<()> {
    let mut back = vec![0u8; model.len()];
    dm.read(base, &mut back)?;
    if let Some(i) = back.iter().zip(model).position(|(a, b)| a != b) {
        anyhow::bail!("byte {i} is {:#x}, {what} made it {:#x}", back[i], model[i]);
    }
    Ok(())
}

/// One step of `devmem_queued_copies`, applied to GPU memory (queued) and to the model.
enum Step {
    /// A queued write of `n` pattern bytes at `off`.
    Write(usize, usize, u32),
    /// A queued copy of `n` bytes from `src` to `dst`.
    Copy(usize, usize, usize),
}

/// Queued device-to-device copies (`DeviceMemory::copy_queued`) on the real `CudaMemory`
/// keep their place among queued writes (one stream): a copy whose source earlier queued
/// writes covered (a run still staged among them) copies their bytes, a write queued after a
/// copy over its source does not change what it copied, a copy out of a copy's destination
/// sees the first copy, a read in between sees everything queued before it, and `settle`
/// completes the rest.
pub fn devmem_queued_copies(ordinal: usize) -> Result<String> {
    let gpu = gpu(ordinal)?;
    let len = 4 << 20;
    let buf = gpu.alloc(len)?;
    let dm = gpu.device_memory();
    let base = buf.ptr();
    let mut model: Vec<u8> = (0..len)
        .map(|i| (i.wrapping_mul(7) ^ (i >> 9)) as u8)
        .collect();
    dm.write(base, &model)?;
    let (mut writes, mut copies) = (0, 0);
    let mut run = |model: &mut [u8], steps: &[Step]| -> Result<()> {
        for s in steps {
            match *s {
                Step::Write(off, n, seed) => {
                    let bytes: Vec<u8> = (0..n as u32)
                        .map(|i| (i.wrapping_mul(131) ^ seed) as u8)
                        .collect();
                    dm.write_queued(base + off as u64, &bytes)?;
                    model[off..off + n].copy_from_slice(&bytes);
                    writes += 1;
                }
                Step::Copy(dst, src, n) => {
                    dm.copy_queued(base + dst as u64, base + src as u64, n)?;
                    model.copy_within(src..src + n, dst);
                    copies += 1;
                }
            }
        }
        Ok(())
    };
    let (a, b, c) = (0usize, 1 << 20, 2 << 20);
    let mut first = Vec::new();
    // packets of one message (a staged run, still unissued) over the copy's source
    for k in 0..16 {
        first.push(Step::Write(a + k * 4096, 4096, k as u32));
    }
    first.extend([
        // the copy reads the run just staged, and bytes before it that were never queued
        Step::Copy(b + 3, a + 1000, 60_000),
        // a write after the copy over its source: the copy keeps the older bytes
        Step::Write(a + 2000, 5000, 77),
        // a copy out of the first copy's destination, and one of the later write
        Step::Copy(c, b + 3, 30_000),
        Step::Copy(c + 100_000, a + 1500, 8000),
        // odd sizes
        Step::Write(a + 300_001, 3, 78),
        Step::Copy(b + 500_000, a + 300_000, 5),
    ]);
    run(&mut model, &first)?;
    let mut seen = vec![0u8; 200_000];
    dm.read(base + b as u64, &mut seen)?;
    ensure!(
        seen == model[b..b + 200_000],
        "a read did not see the copies queued before it"
    );
    // more after the read: runs round the staging slots, copies between them, then the wait
    let mut second = Vec::new();
    for k in 0..100 {
        second.push(Step::Write(c + 400_000 + k * 4096, 4096, 1000 + k as u32));
        if k % 10 == 9 {
            second.push(Step::Copy(
                a + 600_000 + k * 5000,
                c + 400_000 + k * 4096 - 20_000,
                24_000,
            ));
        }
    }
    second.push(Step::Copy(b + 1_000_000, c + 400_000, 400_000));
    run(&mut model, &second)?;
    dm.settle()?;
    matches_model(&*dm, base, &model, "the queued writes and copies")?;
    Ok(format!(
        "{writes} queued writes and {copies} queued copies landed in call order; a read in \
         between saw all queued before it"
    ))
}

/// Small writes on the real `CudaMemory` (words of 4 and 8 bytes aligned and not, an inline
/// WRITE's payload, a flag; odd sizes) land exactly, neighbours untouched, and in call order
/// with queued writes over the same bytes: a word written after a queued run overwrites it, a
/// run queued after a word overwrites the word.
pub fn devmem_words(ordinal: usize) -> Result<String> {
    let gpu = gpu(ordinal)?;
    let len = 1 << 16;
    let buf = gpu.alloc(len)?;
    let dm = gpu.device_memory();
    let base = buf.ptr();
    let mut model: Vec<u8> = (0..len).map(|i| (i * 13) as u8).collect();
    dm.write(base, &model)?;
    let mut words = 0;
    let mut write = |model: &mut [u8], off: usize, bytes: &[u8]| -> Result<()> {
        dm.write(base + off as u64, bytes)?;
        model[off..off + bytes.len()].copy_from_slice(bytes);
        words += 1;
        Ok(())
    };
    for (k, (off, n)) in [
        (64, 8),
        (128, 4),
        (196, 4),
        (200, 8),
        (301, 8),
        (403, 4),
        (500, 2),
        (601, 1),
        (700, 3),
        (808, 16),
    ]
    .into_iter()
    .enumerate()
    {
        let bytes: Vec<u8> = (0..n).map(|i| 0xa0 ^ (k * 16 + i) as u8).collect();
        write(&mut model, off, &bytes)?;
    }
    // a run queued over a word, then a word over the run still queued
    let run: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 1) as u8).collect();
    dm.write_queued(base + 4096, &run)?;
    model[4096..8192].copy_from_slice(&run);
    write(
        &mut model,
        4096 + 800,
        &0x1122_3344_5566_7788u64.to_ne_bytes(),
    )?;
    dm.write_queued(base + 4096 + 792, &[0xee; 24])?;
    model[4096 + 792..4096 + 816].fill(0xee);
    write(&mut model, 4096 + 1000, &0xdead_beefu32.to_ne_bytes())?;
    matches_model(&*dm, base, &model, "the writes")?;
    Ok(format!(
        "{words} small writes (words aligned and not, odd sizes) landed exactly and in order with queued runs"
    ))
}
