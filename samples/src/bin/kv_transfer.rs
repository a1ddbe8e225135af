//! kv_transfer: a KV-cache hand-off as inference clusters do it. A list of non-contiguous GPU
//! blocks (`--blocks` of `--block-size` bytes, taken from a shuffled order of the source
//! blocks) is written into non-contiguous GPU blocks of the peer (a shuffled subset of twice as
//! many destination blocks), `--batch` blocks at a time with unsignaled puts and one signal per
//! batch. The receiver is a kernel too: it waits for each batch's signal and checks every word
//! of the batch's blocks on the GPU; the host checks them again afterwards. Reports blocks/s
//! and GB/s of the sender's run (from %globaltimer).
//!
//! Roles, as perftest's (the TCP bootstrap of samples/src/peer.rs):
//!
//! - `kv_transfer [--loopback]` (no server host and no `-p`: the default): one kernel launch,
//!   two blocks (`gv_sample_kv_transfer`): block 0 sends on the exported QP of soft NIC A,
//!   block 1 receives into GPU memory registered on soft NIC B, in this process.
//! - `kv_transfer -p PORT` (server, the receiver): its soft NIC gets a wire port (RoCEv2 over
//!   UDP); its kernel (`gv_sample_kv_one`, role 1) waits on each batch's signal and checks the
//!   blocks, and the host checks every destination block again.
//! - `kv_transfer SERVER -p PORT` (client, the sender): its kernel (`gv_sample_kv_one`, role 0)
//!   writes the blocks into the server's GPU memory with one signal per batch.
//!
//! Both sides need a GPU (and say so at once without one); both print blocks/s and GB/s (the
//! sender's %globaltimer), and a failure on either side ends both with its reason. On one host
//! the two kernels share a GPU: without MPS the GPU time-slices them (H200: 18 s for 1024
//! blocks of 16 KiB, against 4.5 ms for 256 in one process); use MPS or `--gpu` on each side.
//!
//! `kv_transfer [--gpu N] [--block-size B] [--blocks N] [--batch N] [--json]
//! [--loopback | -p PORT [SERVER] [--timeout S] [--wire-port P]]`.

use anyhow::{bail, ensure, Context as _, Result};
use clap::Parser;
use gpuverbs::gpu::Gpu;
use gpuverbs::{Access, ConnectOptions, Context, CqOptions, DeviceRequest, HostBuffer, QpOptions};
use gpuverbs_samples::{arg, upload, Role, RoleArgs};
use serde_json::json;

#[derive(Parser)]
#[command(about = "Non-contiguous GPU blocks to a peer, one signal per batch, checked on the GPU")]
struct Args {
    #[command(flatten)]
    roles: RoleArgs,
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

/// The source and destination orders (the same on both sides: fixed seeds).
fn orders(n: u32) -> (Vec<u32>, Vec<u32>) {
    let src_idx = shuffled(n, 0x5eed);
    let dst_idx: Vec<u32> = shuffled(2 * n, 0xd57)[..n as usize].to_vec();
    (src_idx, dst_idx)
}

/// The sources: word w of block b is kv_word(b, w).
fn source_bytes(n: u32, bs: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; n as usize * bs];
    for b in 0..n {
        for w in 0..(bs / 8) as u32 {
            let at = b as usize * bs + 8 * w as usize;
            bytes[at..at + 8].copy_from_slice(&kv_word(b, w).to_ne_bytes());
        }
    }
    bytes
}

/// The host's check of the destination blocks (`got`: all `2 * n` of them): each written block
/// holds its source's pattern, and no other block was touched.
fn check_destination(got: &[u8], bs: usize, src_idx: &[u32], dst_idx: &[u32]) -> Result<()> {
    let mut written = vec![None; got.len() / bs];
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
    Ok(())
}

/// Prints blocks/s and GB/s of the sender's run (`ns`). `role`: this side's, in two processes.
fn print(a: &Args, gpu: &str, ns: f64, role: Option<&str>) {
    let n = a.blocks;
    let total = n as f64 * a.block_size as f64;
    let (gbps, blocks_s) = (total / ns, n as f64 / (ns * 1e-9));
    if a.json {
        let mut v = json!({"test": "kv_transfer", "block_size": a.block_size, "blocks": n,
               "batch": a.batch, "signals": n.div_ceil(a.batch), "gpu": gpu,
               "time_s": ns * 1e-9, "gb_per_s": gbps, "blocks_per_s": blocks_s,
               "validated": true});
        if let Some(r) = role {
            v["role"] = json!(r);
        }
        println!("{v}");
    } else {
        match role {
            Some(r) => println!("# kv_transfer on {gpu} ({r}, two processes, soft NIC wire)"),
            None => println!("# kv_transfer on {gpu} (soft NIC, loopback)"),
        }
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
}

fn run(a: Args) -> Result<()> {
    ensure!(
        a.block_size % 8 == 0,
        "--block-size must be a multiple of 8"
    );
    match a.roles.role() {
        Role::Client => remote::run(&a, false),
        Role::Server => remote::run(&a, true),
        Role::Loopback => run_loopback(a),
    }
}

fn run_loopback(a: Args) -> Result<()> {
    let gpu = Gpu::open(a.gpu).context("kv_transfer needs a GPU: both sides are kernels")?;
    let (bs, n) = (a.block_size as usize, a.blocks);
    let dst_blocks = 2 * n;
    let (src_idx, dst_idx) = orders(n);
    let src = gpu.alloc(n as usize * bs)?;
    src.write(0, &source_bytes(n, bs))?;
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
    check_destination(&got, bs, &src_idx, &dst_idx)?;
    let ns = word(5).saturating_sub(word(4)).max(1) as f64;
    print(&a, &gpu.info().to_string(), ns, None);
    Ok(())
}

/// The server/client roles: the receiver (server) and the sender (client) in two processes,
/// over the TCP bootstrap of samples/src/peer.rs and the soft NICs' wire. The steps: open the
/// device (and set up the QP and the GPU buffers), exchange endpoints (and the receiver's
/// destination and signal word), connect, started (the receiver's kernel is launched), sent
/// (the sender's outcome), checked (the receiver's).
mod remote {
    use super::*;
    use gpuverbs::gpu::{DeviceMem, ExportedQp};
    use gpuverbs::{Cq, Mr, Qp, RemoteMemory};
    use gpuverbs_samples::{local_ip_towards, Peer};
    use std::net::SocketAddr;
    use std::sync::Arc;

    const TEST: &str = "kv_transfer";

    /// This side's device, QP and GPU buffers.
    struct Side {
        _ctx: Context,
        _cq: Cq,
        qp: Qp,
        /// The sender's sources, or the receiver's destination blocks.
        mem: DeviceMem,
        mr: Mr,
        /// The receiver's signal word (the sender: unused).
        _sig: HostBuffer,
        sig_mr: Mr,
        sig_dev: u64,
        /// The kernel's report words.
        out: HostBuffer,
        out_dev: u64,
        lists: (DeviceMem, DeviceMem),
        export: Option<ExportedQp>,
    }

    fn open(a: &Args, peer: &Peer, gpu: &Arc<Gpu>, receiver: bool) -> Result<Side> {
        let ip = local_ip_towards(peer.addr.ip())?;
        let bind = SocketAddr::from((ip, a.roles.wire_port.unwrap_or(0)));
        let ctx = Context::open_wire(DeviceRequest::Soft, bind)
            .with_context(|| format!("open the soft NIC (a wire port on {bind})"))?;
        let pd = ctx.alloc_pd();
        let depth = (2 * a.batch + 2).next_power_of_two().max(64);
        let cq = ctx.create_cq(CqOptions {
            depth,
            ..Default::default()
        })?;
        let mut o = QpOptions::new(&cq, &cq);
        o.sq_blocks = depth;
        let qp = pd.create_qp(o)?;
        let (bs, n) = (a.block_size as usize, a.blocks);
        let (src_idx, dst_idx) = orders(n);
        let (mem, mr) = if receiver {
            let dst = gpu.alloc(2 * n as usize * bs)?;
            dst.write(0, &vec![0u8; 2 * n as usize * bs])?;
            let mr = pd.register_device_mem(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
            (dst, mr)
        } else {
            let src = gpu.alloc(n as usize * bs)?;
            src.write(0, &source_bytes(n, bs))?;
            let mr = pd.register_device_mem(&src, Access::LOCAL_WRITE)?;
            (src, mr)
        };
        let sig = HostBuffer::new(64);
        let sig_mr = pd.register_with(&sig, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)?;
        let sig_dev = gpu.map_host(&sig)?;
        let out = HostBuffer::new(64);
        let out_dev = gpu.map_host(&out)?;
        let lists = (upload(gpu, &src_idx)?, upload(gpu, &dst_idx)?);
        let export = if receiver {
            None
        } else {
            Some(gpu.export_qp(&qp)?)
        };
        Ok(Side {
            _ctx: ctx,
            _cq: cq,
            qp,
            mem,
            mr,
            _sig: sig,
            sig_mr,
            sig_dev,
            out,
            out_dev,
            lists,
            export,
        })
    }

    /// Word `i` of the kernel's report.
    fn word(side: &Side, i: usize) -> u64 {
        let w = side.out.to_vec();
        u64::from_ne_bytes(w[8 * i..8 * i + 8].try_into().expect("8 bytes"))
    }

    /// One side's launch of `gv_sample_kv_one`; `to`: the receiver's destination and signal
    /// word (the sender's).
    fn launch(
        a: &Args,
        gpu: &Gpu,
        side: &Side,
        to: Option<(&RemoteMemory, &RemoteMemory)>,
    ) -> Result<()> {
        let (mut q, mut snic, mut lk) = match &side.export {
            Some(e) => (e.ptr(), side.mr.addr(), side.mr.lkey().0),
            None => (0, 0, 0),
        };
        let (mut dnic, mut rk, mut sremote, mut srk) = match to {
            Some((d, s)) => (d.addr(), d.rkey(), s.addr(), s.rkey()),
            None => (0, 0, 0, 0),
        };
        let (mut sdev, mut ddev, mut role) = match to {
            Some(_) => (0, 0, 0u32),
            None => (side.sig_dev, side.mem.ptr(), 1u32),
        };
        let (mut sl, mut dl, mut nb, mut bsz, mut bt, mut budget, mut od) = (
            side.lists.0.ptr(),
            side.lists.1.ptr(),
            a.blocks,
            a.block_size,
            a.batch,
            BUDGET_NS,
            side.out_dev,
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
            arg(&mut role),
        ];
        // SAFETY: the parameters match gv_sample_kv_one's signature; the descriptor (the
        // sender's), the mapped signal and report words, the index lists and the GPU buffers
        // live until the synchronous launch has returned; the pointers a side does not use are
        // null and not read by its role.
        unsafe { gpu.launch_sync("gv_sample_kv_one", (1, 1, 1), (1, 1, 1), 0, &mut params) }?;
        Ok(())
    }

    pub fn run(a: &Args, receiver: bool) -> Result<()> {
        if !receiver && a.roles.port == Some(0) {
            bail!("-p 0: the client needs the server's port (the one the server printed)");
        }
        // Before the rendezvous: without a GPU, say so at once instead of waiting.
        let gpu = Gpu::open(a.gpu).context(if receiver {
            "kv_transfer needs a GPU: the receiver (server) is a kernel"
        } else {
            "kv_transfer needs a GPU: the sender (client) is a kernel"
        })?;
        gpuverbs::cuda::fatbin().context("kv_transfer needs the gpuverbs kernels")?;
        let common = a.roles.common(TEST)?;
        let mut peer = Peer::rendezvous(&common, TEST)?;
        if peer.addr.ip().is_loopback() {
            // Measured on the H200: 18 s for 1024 blocks of 16 KiB without MPS.
            eprintln!(
                "{TEST}: note: the {} is on this host and both sides run a resident kernel: \
                 when they share a GPU without MPS (nvidia-cuda-mps-control -d), the GPU \
                 time-slices the two processes (each batch waits for the other's slice); MPS, \
                 or a GPU each (--gpu), avoid it",
                peer.peer_role
            );
        }
        let (side, mine) = match open(a, &peer, &gpu, receiver) {
            Ok(s) => (Some(s), Ok(())),
            Err(e) => (None, Err(e)),
        };
        peer.step("open the device", mine)?;
        let side = side.context("the device step succeeded without a device")?;
        let params = json!({"block_size": a.block_size, "blocks": a.blocks, "batch": a.batch});
        let facts = if receiver {
            json!({
                "dst": RemoteMemory::export_rkey(side.mr.addr(), side.mr.len(), side.mr.rkey().0)?,
                "sig": RemoteMemory::export_rkey(side.sig_mr.addr(), side.sig_mr.len(),
                                                 side.sig_mr.rkey().0)?,
            })
        } else {
            json!({})
        };
        let hello = peer.hello(&common, TEST, params, vec![side.qp.endpoint()], facts)?;
        let ep = hello.endpoints[0].clone();
        let c = ConnectOptions {
            access: Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
            ..Default::default()
        };
        let connected = side
            .qp
            .connect(&ep, c)
            .with_context(|| format!("connect to the {} ({ep})", peer.peer_role));
        peer.step("connect", connected)?;
        let name = gpu.info().to_string();
        if receiver {
            let (received, sent) = std::thread::scope(|sc| {
                let k = sc.spawn(|| launch(a, &gpu, &side, None));
                let sent = peer
                    .step("started", Ok(()))
                    .and_then(|()| peer.step::<Option<[u64; 3]>>("sent", Ok(None)));
                let received = k
                    .join()
                    .map_err(|_| anyhow::anyhow!("the launch thread panicked"))
                    .and_then(|r| r);
                (received, sent)
            });
            let sent = sent?.context("the sender sent no outcome")?;
            let checked = received.and_then(|()| {
                ensure!(
                    word(&side, 1) == 0,
                    "the receiving kernel ended with status {} (0 OK, 2 TIMEOUT)",
                    word(&side, 1)
                );
                ensure!(
                    word(&side, 2) == 0,
                    "the receiving kernel found {} words wrong, first in batch {}",
                    word(&side, 2),
                    word(&side, 3)
                );
                let (src_idx, dst_idx) = orders(a.blocks);
                let mut got = vec![0u8; 2 * a.blocks as usize * a.block_size as usize];
                side.mem.read(0, &mut got)?;
                check_destination(&got, a.block_size as usize, &src_idx, &dst_idx)
            });
            // the sender's failure first: it is why the receiver's waits ran out
            ensure!(
                sent[0] == 0,
                "the sender's kernel ended with status {} (0 OK, 2 TIMEOUT, 3 ERROR_CQE)",
                sent[0]
            );
            peer.step::<()>("checked", checked)?;
            print(
                a,
                &name,
                sent[2].saturating_sub(sent[1]).max(1) as f64,
                Some("server"),
            );
        } else {
            let remote = |k: &str| -> Result<RemoteMemory> {
                serde_json::from_value(hello.facts[k].clone())
                    .with_context(|| format!("the receiver's {k}"))
            };
            let (dst, sig) = (remote("dst")?, remote("sig")?);
            ensure!(
                dst.len() >= 2 * u64::from(a.blocks) * u64::from(a.block_size) && sig.len() >= 8,
                "the receiver's buffers are too small ({} B of blocks, {} B of signal)",
                dst.len(),
                sig.len()
            );
            peer.step("started", Ok(()))?;
            let sent = launch(a, &gpu, &side, Some((&dst, &sig)))
                .map(|()| [word(&side, 0), word(&side, 4), word(&side, 5)]);
            let status = sent.as_ref().map_or(0, |s| s[0]);
            let times = sent.as_ref().map_or([0, 0, 0], |s| *s);
            peer.step("sent", sent.map(Some))?;
            ensure!(
                status == 0,
                "the sender's kernel ended with status {status} (0 OK, 2 TIMEOUT, 3 ERROR_CQE)"
            );
            peer.step::<()>("checked", Ok(()))?;
            print(
                a,
                &name,
                times[2].saturating_sub(times[1]).max(1) as f64,
                Some("client"),
            );
        }
        Ok(())
    }
}
