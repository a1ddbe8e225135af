//! kv_transfer: a KV-cache hand-off as inference clusters do it. A list of non-contiguous GPU
//! blocks (`--blocks` of `--block-size` bytes, taken from a shuffled order of the source
//! blocks) is written into non-contiguous GPU blocks of the peer (a shuffled subset of twice as
//! many destination blocks), `--batch` blocks at a time with unsignaled puts and one signal per
//! batch. The receiver is a kernel too: it waits for each batch's signal and checks every word
//! of the batch's blocks on the GPU; the host checks them again afterwards. Reports blocks/s
//! and GB/s of the sender's run (from %globaltimer).
//!
//! One kernel launch, two blocks (`gv_sample_kv_transfer`): block 0 sends on the exported QP
//! of soft NIC A, block 1 receives into GPU memory registered on soft NIC B (loopback, this
//! process). `kv_transfer [--gpu N] [--block-size B] [--blocks N] [--batch N] [--json]`.

use anyhow::{ensure, Context as _, Result};
use clap::Parser;
use gpuverbs::gpu::Gpu;
use gpuverbs::{Access, ConnectOptions, Context, CqOptions, DeviceRequest, HostBuffer, QpOptions};
use gpuverbs_samples::{arg, upload};
use serde_json::json;

#[derive(Parser)]
#[command(about = "Non-contiguous GPU blocks to a peer, one signal per batch, checked on the GPU")]
struct Args {
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Bytes of one block (a multiple of 8).
    #[arg(long, default_value_t = 16384,
          value_parser = clap::value_parser!(u32).range(8..=(1 << 24)))]
    block_size: u32,
    /// Blocks to transfer.
    #[arg(long, default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=(1 << 20)))]
    blocks: u32,
    /// Blocks per signal.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=512))]
    batch: u32,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// Each wait in the kernel.
const BUDGET_NS: u64 = 10_000_000_000;

/// Word `w` of source block `b` (the kernel's `kv_word`).
fn kv_word(b: u32, w: u32) -> u64 {
    ((u64::from(b) << 32) | u64::from(w)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// `0..n` shuffled (a fixed seed: the run is repeatable).
fn shuffled(n: u32, mut seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    for i in (1..v.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    v
}

fn main() -> std::process::ExitCode {
    gpuverbs_samples::exit_with("kv_transfer", run(Args::parse()))
}

fn run(a: Args) -> Result<()> {
    ensure!(
        a.block_size % 8 == 0,
        "--block-size must be a multiple of 8"
    );
    let gpu = Gpu::open(a.gpu).context("kv_transfer needs a GPU: both sides are kernels")?;
    let (bs, n) = (a.block_size as usize, a.blocks);
    let dst_blocks = 2 * n;
    let src_idx = shuffled(n, 0x5eed);
    let dst_idx: Vec<u32> = shuffled(dst_blocks, 0xd57)[..n as usize].to_vec();
    // sources: word w of block b is kv_word(b, w)
    let src = gpu.alloc(n as usize * bs)?;
    let mut bytes = vec![0u8; n as usize * bs];
    for b in 0..n {
        for w in 0..(bs / 8) as u32 {
            let at = b as usize * bs + 8 * w as usize;
            bytes[at..at + 8].copy_from_slice(&kv_word(b, w).to_ne_bytes());
        }
    }
    src.write(0, &bytes)?;
    let dst = gpu.alloc(dst_blocks as usize * bs)?;
    let (ca, cb) = (
        Context::open(DeviceRequest::Soft)?,
        Context::open(DeviceRequest::Soft)?,
    );
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let depth = (2 * a.batch + 2).next_power_of_two().max(64);
    let cqa = ca.create_cq(CqOptions {
        depth,
        ..Default::default()
    })?;
    let cqb = cb.create_cq(CqOptions::default())?;
    let mut o = QpOptions::new(&cqa, &cqa);
    o.sq_blocks = depth;
    let qa = pa.create_qp(o)?;
    let qb = pb.create_qp(QpOptions::new(&cqb, &cqb))?;
    let c = ConnectOptions {
        access: Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        ..Default::default()
    };
    qa.connect(&qb.endpoint(), c)?;
    qb.connect(&qa.endpoint(), c)?;
    let src_mr = pa.register_device_mem(&src, Access::LOCAL_WRITE)?;
    let dst_mr = pb.register_device_mem(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let sig = HostBuffer::new(64);
    let sig_mr = pb.register_with(&sig, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
    let sig_dev = gpu.map_host(&sig)?;
    let out = HostBuffer::new(64);
    let out_dev = gpu.map_host(&out)?;
    let (src_list, dst_list) = (upload(&gpu, &src_idx)?, upload(&gpu, &dst_idx)?);
    let export = gpu.export_qp(&qa)?;
    let (mut q, mut snic, mut lk, mut dnic, mut rk) = (
        export.ptr(),
        src_mr.addr(),
        src_mr.lkey().0,
        dst_mr.addr(),
        dst_mr.rkey().0,
    );
    let (mut sremote, mut srk, mut sdev, mut ddev) =
        (sig_mr.addr(), sig_mr.rkey().0, sig_dev, dst.ptr());
    let (mut sl, mut dl, mut nb, mut bsz, mut bt, mut budget, mut od) = (
        src_list.ptr(),
        dst_list.ptr(),
        n,
        a.block_size,
        a.batch,
        BUDGET_NS,
        out_dev,
    );
    let mut params = [
        arg(&mut q),
        arg(&mut snic),
        arg(&mut lk),
        arg(&mut dnic),
        arg(&mut rk),
        arg(&mut sremote),
        arg(&mut srk),
        arg(&mut sdev),
        arg(&mut ddev),
        arg(&mut sl),
        arg(&mut dl),
        arg(&mut nb),
        arg(&mut bsz),
        arg(&mut bt),
        arg(&mut budget),
        arg(&mut od),
    ];
    // SAFETY: the parameters match gv_sample_kv_transfer's signature; the descriptor, the
    // mapped signal and report words, the index lists and both GPU buffers live until the
    // synchronous launch has returned.
    unsafe {
        gpu.launch_sync(
            "gv_sample_kv_transfer",
            (2, 1, 1),
            (1, 1, 1),
            0,
            &mut params,
        )
    }?;
    let w = out.to_vec();
    let word = |i: usize| u64::from_ne_bytes(w[8 * i..8 * i + 8].try_into().expect("8 bytes"));
    ensure!(
        word(0) == 0 && word(1) == 0,
        "sender status {}, receiver status {} (0 is OK, 2 TIMEOUT, 3 ERROR_CQE)",
        word(0),
        word(1)
    );
    ensure!(
        word(2) == 0,
        "the receiving kernel found {} words wrong, first in batch {}",
        word(2),
        word(3)
    );
    // and the host checks every destination block, and that no other block was touched
    let mut got = vec![0u8; dst_blocks as usize * bs];
    dst.read(0, &mut got)?;
    let mut written = vec![None; dst_blocks as usize];
    for (j, &d) in dst_idx.iter().enumerate() {
        written[d as usize] = Some(src_idx[j]);
    }
    for (d, s) in written.iter().enumerate() {
        for w in 0..bs / 8 {
            let at = d * bs + 8 * w;
            let v = u64::from_ne_bytes(got[at..at + 8].try_into().expect("8 bytes"));
            let want = s.map_or(0, |s| kv_word(s, w as u32));
            ensure!(
                v == want,
                "destination block {d} word {w}: {v:#x}, expected {want:#x}"
            );
        }
    }
    let ns = word(5).saturating_sub(word(4)).max(1) as f64;
    let total = n as f64 * bs as f64;
    let (gbps, blocks_s) = (total / ns, n as f64 / (ns * 1e-9));
    if a.json {
        println!(
            "{}",
            json!({"test": "kv_transfer", "block_size": a.block_size, "blocks": n,
                   "batch": a.batch, "signals": n.div_ceil(a.batch), "gpu": gpu.info().to_string(),
                   "time_s": ns * 1e-9, "gb_per_s": gbps, "blocks_per_s": blocks_s,
                   "validated": true})
        );
    } else {
        println!("# kv_transfer on {} (soft NIC, loopback)", gpu.info());
        println!(
            " {:>10} {:>8} {:>6} {:>10} {:>14} {:>10}",
            "block[B]", "blocks", "batch", "time[ms]", "blocks/s", "GB/s"
        );
        println!(
            " {:>10} {:>8} {:>6} {:>10.3} {:>14.0} {:>10.3}",
            a.block_size,
            n,
            a.batch,
            ns * 1e-6,
            blocks_s,
            gbps
        );
        println!(" every block checked by the receiving kernel and by the host");
    }
    Ok(())
}
