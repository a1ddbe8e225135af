//! `put` cases: the `gv_test_put` launch, its byte check, and the cases built on it.

use anyhow::{ensure, Result};
use gpuverbs::queue::CqMode;
use gpuverbs::{DoorbellMode, RingPlacement};

use super::{arg, counters, Mem, Pair, PairSpec, Status, BUDGET_NS};

/// The shape of one `gv_test_put` launch.
#[derive(Clone, Copy, Debug)]
pub struct PutArgs {
    pub grid: u32,
    pub block: u32,
    /// 0 thread, 1 warp, 2 block.
    pub scope: u32,
    /// Threads with index % skip_mod == skip_mod - 1 do not take part (0: all do).
    pub skip_mod: u32,
    pub size: u32,
    pub iters: u32,
    pub signal_every: u32,
    pub budget_ns: u64,
}

impl PutArgs {
    /// One thread writing one signaled message of `size` bytes.
    pub fn single(size: u32, budget_ns: u64) -> Self {
        Self {
            grid: 1,
            block: 1,
            scope: 0,
            skip_mod: 0,
            size,
            iters: 1,
            signal_every: 1,
            budget_ns,
        }
    }
    fn takes_part(&self, thread: u64) -> bool {
        let m = self.skip_mod as u64;
        m == 0 || (thread % self.block as u64) % m != m - 1
    }
}

impl Pair {
    /// Launches `gv_test_put` with rkey `rk` and returns the kernel's status words.
    pub fn launch_put(&self, a: &PutArgs, rk: u32) -> Result<Status> {
        let threads = a.grid as u64 * a.block as u64;
        ensure!(
            threads * a.iters as u64 * a.size as u64 <= self.dst.len() as u64,
            "buffers too small"
        );
        let st = Status::new(&self.gpu)?;
        let (mut q, mut lbase, mut lk, mut rbase, mut rk) = (
            self.export.ptr(),
            self.src_d,
            self.src_mr.lkey().0,
            self.dst_mr.addr(),
            rk,
        );
        let (mut size, mut iters, mut scope, mut skip, mut sig, mut budget, mut out) = (
            a.size,
            a.iters,
            a.scope,
            a.skip_mod,
            a.signal_every,
            a.budget_ns,
            st.ptr(),
        );
        let mut params = [
            arg(&mut q),
            arg(&mut lbase),
            arg(&mut lk),
            arg(&mut rbase),
            arg(&mut rk),
            arg(&mut size),
            arg(&mut iters),
            arg(&mut scope),
            arg(&mut skip),
            arg(&mut sig),
            arg(&mut budget),
            arg(&mut out),
        ];
        // SAFETY: the parameters match gv_test_put's signature; q, lbase (mapped host memory)
        // and out are live device-visible memory for the whole launch; rbase is only used as a
        // remote address (checked by the device).
        unsafe {
            self.gpu.launch_sync(
                "gv_test_put",
                (a.grid, 1, 1),
                (a.block, 1, 1),
                0,
                &mut params,
            )?
        };
        Ok(st)
    }
}

/// Launches `gv_test_put` and checks every written byte.
pub fn run_put(p: &Pair, a: &PutArgs) -> Result<String> {
    p.launch_put(a, p.dst_mr.rkey().0)?.expect_ok()?;
    let (src, dst) = (p.src.to_vec()?, p.dst.to_vec()?);
    let mut msgs = 0u64;
    for t in 0..a.grid as u64 * a.block as u64 {
        for i in 0..a.iters as u64 {
            let off = ((t * a.iters as u64 + i) * a.size as u64) as usize;
            let range = off..off + a.size as usize;
            if a.takes_part(t) {
                ensure!(
                    dst[range.clone()] == src[range.clone()],
                    "thread {t} message {i}: bytes differ"
                );
                msgs += 1;
            } else {
                ensure!(
                    dst[range].iter().all(|&b| b == 0),
                    "thread {t} (not taking part) wrote bytes"
                );
            }
        }
    }
    let d = p.export.read()?;
    ensure!(
        d.sq_retired == d.sq_ready && d.sq_ready == d.sq_rung,
        "counters: {d:?}"
    );
    Ok(format!(
        "{msgs} messages of {} B verified, {} blocks",
        a.size, d.sq_ready
    ))
}

/// A `put` case: doorbell mode, SQ size, launch shape, payload and ring placement.
pub struct PutCase {
    pub mode: DoorbellMode,
    pub sq_blocks: u32,
    pub args: PutArgs,
    pub mem: Mem,
    pub rings: RingPlacement,
}

pub fn put_case(ordinal: usize, c: &PutCase) -> Result<String> {
    let a = &c.args;
    let bytes = (a.grid * a.block * a.iters * a.size) as usize;
    let spec = PairSpec {
        mode: c.mode,
        bytes,
        sq_blocks: c.sq_blocks,
        mem: c.mem,
        rings: c.rings,
    };
    let p = Pair::with(ordinal, spec)?;
    let r = run_put(&p, a)?;
    let Some(dev) = counters(&p.a) else {
        return Ok(format!("{r}; device counters not available (mlx5)"));
    };
    ensure!(dev.errors.is_empty(), "device errors: {:?}", dev.errors);
    Ok(format!("{r}; {} doorbells", dev.doorbells_seen))
}

/// A no-DBR QP (`DoorbellMode::NoDbr`: rung at UAR + 0x600 with the producer index in the
/// doorbell value, as a ConnectX-8's `send_dbr_mode` NO_DBR_EXT): a kernel's puts land, and
/// on the soft NIC the QP's doorbell record's send word is still 0 afterwards (the device API
/// never stored it; on a ConnectX the record is GPU memory the host does not read here). Its
/// rings on the GPU (`rings`): an rdma-core provider QP (host rings, provider CQs) cannot be
/// no-DBR.
///
/// `DoorbellMode::NoDbrEmulated` (GPUNetIO's `NO_DBR_SW_EMULATED`): an ordinary QP the kernel
/// rings at its ordinary register without the record, publishing its producer in the proxy
/// word, while the pair's proxy thread keeps the record: the puts land and, on the soft NIC,
/// the record's send word holds the last producer index (the proxy's) at the end.
pub fn put_no_dbr(
    ordinal: usize,
    mode: DoorbellMode,
    rings: RingPlacement,
    scope: u32,
    skip: u32,
) -> Result<String> {
    let a = PutArgs {
        grid: 4,
        block: 64,
        scope,
        skip_mod: skip,
        size: 64,
        iters: 8,
        signal_every: 4,
        budget_ns: BUDGET_NS,
    };
    let spec = PairSpec {
        mode,
        bytes: (a.grid * a.block * a.iters * a.size) as usize,
        sq_blocks: 256,
        mem: Mem::Host,
        rings,
    };
    let p = Pair::with(ordinal, spec)?;
    ensure!(p.qa.doorbell().0 == mode, "mode {:?}", p.qa.doorbell());
    let r = run_put(&p, &a)?;
    let Some(s) = p.qa.soft() else {
        return Ok(format!(
            "{r}; {mode:?} (the device's record not read on mlx5)"
        ));
    };
    if mode == DoorbellMode::NoDbrEmulated {
        return emulated_record(&p, s, r);
    }
    ensure!(
        s.bf_offset() == gpuverbs::post::DBR_LESS_OFFSET,
        "register at {:#x}",
        s.bf_offset()
    );
    let mut rec = [0u8; 8];
    s.dbrec_page().read(s.dbrec_offset(), &mut rec);
    ensure!(
        rec[4..] == [0u8; 4],
        "the send doorbell record was written: {rec:?}"
    );
    Ok(format!("{r}; no DBR, send record still 0"))
}

/// The soft NIC's view of an emulated no-DBR QP after its puts: an ordinary register, and a
/// send record that the proxy (never the kernel) brought to the producer the kernel rang.
fn emulated_record(p: &Pair, s: &gpuverbs::soft::raw::Qp, r: String) -> Result<String> {
    ensure!(
        s.bf_offset() == gpuverbs::post::BF_OFFSET,
        "register at {:#x}",
        s.bf_offset()
    );
    let rung = p.export.read()?.sq_rung;
    let want = (rung & 0xffff) as u32;
    // the proxy thread may still be on its way from the word to the record
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let mut rec = [0u8; 8];
        s.dbrec_page().read(s.dbrec_offset(), &mut rec);
        let snd = u32::from_be_bytes([rec[4], rec[5], rec[6], rec[7]]);
        if snd == want {
            return Ok(format!(
                "{r}; no DBR emulated, the proxy's send record = {snd} (producer {rung})"
            ));
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the send record holds {snd}, the kernel rang {rung}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// A collapsed send CQ (every CQE in slot 0): the device API takes slot 0 whenever its last word
/// changes and retires up to the WQE it names; puts, quiet and the bytes all check out.
pub fn collapsed_cq(ordinal: usize) -> Result<String> {
    let a = PutArgs {
        grid: 2,
        block: 64,
        scope: 0,
        skip_mod: 0,
        size: 64,
        iters: 8,
        signal_every: 4,
        budget_ns: BUDGET_NS,
    };
    let spec = PairSpec {
        mode: DoorbellMode::GpuDoorbell,
        bytes: (a.grid * a.block * a.iters * a.size) as usize,
        sq_blocks: 256,
        mem: Mem::Host,
        rings: RingPlacement::HostMapped,
    };
    let p = Pair::build(ordinal, spec, CqMode::Collapsed)?;
    let r = run_put(&p, &a)?;
    Ok(format!("{r} (collapsed send CQ)"))
}
