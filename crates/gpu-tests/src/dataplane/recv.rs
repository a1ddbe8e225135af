//! The receive side on the GPU: receives posted and completed by a kernel.

use anyhow::{ensure, Context as _, Result};
use gpuverbs::proxy::{ProxyConfig, ProxyService, ProxyTarget};
use gpuverbs::{Access, CqOptions, DoorbellMode, HostBuffer, QpOptions, RingPlacement};

use super::{arg, connect_both, contexts, gpu, status_name, Status, BUDGET_NS};

/// What [`recv`] varies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvCase {
    /// The sends gather from B's source buffer.
    Gather,
    /// The sends are `send_inline` calls copying the source (mapped into the GPU) into their
    /// WQEs.
    InlineSends,
    /// A's one receive buffer is half the message: A's receive completes with LOCAL_LENGTH and
    /// B's send with REMOTE_INVAL_REQ, both seen by the kernel.
    TooSmall,
}

/// Receive side on the GPU: one kernel thread on side B writes with immediate, sends and sends
/// with immediate to side A, where another kernel thread has posted the receive buffers and
/// takes the receive completions (A's rings, receive CQ included, in `rings`; B rings in
/// `mode`). The host checks every completion field and every byte. [`RecvCase`] says what
/// varies.
pub fn recv(
    ordinal: usize,
    mode: DoorbellMode,
    rings: RingPlacement,
    case: RecvCase,
) -> Result<String> {
    let too_small = case == RecvCase::TooSmall;
    let (n_imm, n_send, size) = match case {
        RecvCase::TooSmall => (0u32, 1u32, 256u32),
        RecvCase::Gather => (24, 24, 256),
        // Payloads that fill several WQE blocks, none a multiple of 16 bytes.
        RecvCase::InlineSends => (4, 24, 180),
    };
    let rsize = if too_small { size / 2 } else { size };
    let n = (n_imm + n_send) as usize;
    let gpu = gpu(ordinal)?;
    let (a, b) = contexts()?;
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let cq_a = |depth| {
        a.create_cq_on(
            &gpu,
            CqOptions {
                depth,
                placement: rings,
                ..Default::default()
            },
        )
    };
    let (scq_a, rcq_a) = (cq_a(64)?, cq_a(64)?);
    let mut oa = QpOptions::new(&scq_a, &rcq_a);
    oa.rq_wqes = 64;
    // A only receives: an SQ no deeper than its send CQ (an exported mlx5 QP must have that)
    oa.sq_blocks = 64;
    oa.placement = rings;
    let qa = pa.create_qp_on(&gpu, oa)?;
    let (scq_b, rcq_b) = (
        b.create_cq(CqOptions::default())?,
        b.create_cq(CqOptions::default())?,
    );
    let mut ob = QpOptions::new(&scq_b, &rcq_b);
    ob.doorbell = mode;
    let qb = pb.create_qp(ob)?;
    connect_both(&qa, &qb, Access::REMOTE_WRITE)?;
    // B's source; A's write-with-immediate target, then its receive buffers.
    let src = HostBuffer::new(n * size as usize);
    let pattern: Vec<u8> = (0..src.len())
        .map(|j| (j as u32).wrapping_mul(2654435761) as u8 | 1)
        .collect();
    src.write(0, &pattern);
    let recv_off = n_imm as usize * size as usize;
    let dst = HostBuffer::new(recv_off + n * rsize as usize);
    let src_mr = pb.register(&src)?;
    let dst_mr = pa.register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let (ea, eb) = (gpu.export_qp(&qa)?, gpu.export_qp(&qb)?);
    let _proxy = if mode.proxied() {
        let svc = ProxyService::start(ProxyConfig::default())?;
        let _handle = svc.add(ProxyTarget::for_qp(&qb)?)?;
        Some(svc)
    } else {
        None
    };
    let ready = gpu.alloc(4)?;
    ready.write(0, &[0; 4])?;
    let comps = gpu.alloc(16 * n)?;
    comps.write(0, &vec![0xff; 16 * n])?;
    let (st_recv, st_send) = (Status::new(&gpu)?, Status::new(&gpu)?);
    let (mut sq, mut rq) = (eb.ptr(), ea.ptr());
    let (mut src_a, mut slk) = (src_mr.addr(), src_mr.lkey().0);
    let mut src_dev = match case {
        RecvCase::InlineSends => gpu.map_host(&src)?,
        _ => 0u64,
    };
    let (mut dst_a, mut drk) = (dst_mr.addr(), dst_mr.rkey().0);
    let (mut size_, mut n_imm_, mut n_send_) = (size, n_imm, n_send);
    let (mut rbuf, mut rlk, mut rsize_) = (dst_mr.addr() + recv_off as u64, dst_mr.lkey().0, rsize);
    let (mut ready_p, mut comps_p, mut budget) = (ready.ptr(), comps.ptr(), BUDGET_NS);
    let (mut out_r, mut out_s) = (st_recv.ptr(), st_send.ptr());
    let mut params = [
        arg(&mut sq),
        arg(&mut rq),
        arg(&mut src_a),
        arg(&mut slk),
        arg(&mut src_dev),
        arg(&mut dst_a),
        arg(&mut drk),
        arg(&mut size_),
        arg(&mut n_imm_),
        arg(&mut n_send_),
        arg(&mut rbuf),
        arg(&mut rlk),
        arg(&mut rsize_),
        arg(&mut ready_p),
        arg(&mut comps_p),
        arg(&mut budget),
        arg(&mut out_r),
        arg(&mut out_s),
    ];
    // SAFETY: parameters match gv_test_recv; the descriptors, the flag, the completion array
    // and the status words are live GPU memory for the whole launch, and the NIC addresses
    // belong to regions registered above (alive until this function returns).
    unsafe { gpu.launch_sync("gv_test_recv", (2, 1, 1), (1, 1, 1), 0, &mut params)? };
    if too_small {
        return too_small_report(&st_recv, &st_send, size, rsize);
    }
    st_recv.expect_ok().context("receiver")?;
    st_send.expect_ok().context("sender")?;
    let msgs = Messages {
        n_imm,
        n_send,
        size,
        rsize,
    };
    check_receives(msgs, &comps, &src, &dst, recv_off)?;
    let da = ea.read()?;
    ensure!(
        da.rq_posted == n as u64 && da.rcq_ci == n as u64,
        "receiver descriptor: {} posted, {} receive CQEs taken",
        da.rq_posted,
        da.rcq_ci
    );
    let how = match case {
        RecvCase::InlineSends => " (the sends inline)",
        _ => "",
    };
    Ok(format!(
        "{n_imm} WRITE_IMM, {} SEND, {} SEND_IMM of {size} B{how}: every receive completion \
         (opcode, immediate, length, WQE) and every byte verified",
        n_send.div_ceil(2),
        n_send / 2
    ))
}

/// The messages of a case: the WRITE_IMMs, the SENDs (every other one with an immediate),
/// their size, and the size of each receive buffer.
#[derive(Clone, Copy, Debug)]
struct Messages {
    n_imm: u32,
    n_send: u32,
    size: u32,
    rsize: u32,
}

/// [`RecvCase::TooSmall`]: the receiving kernel saw LOCAL_LENGTH, the sending one
/// REMOTE_INVAL_REQ; what the case found.
fn too_small_report(st_recv: &Status, st_send: &Status, size: u32, rsize: u32) -> Result<String> {
    let (r, s) = (st_recv.read()?, st_send.read()?);
    ensure!(
        r[0] == 1 && r[1] == 0x01,
        "receiver: {} syndrome {:#04x}, expected ERROR_CQE LOCAL_LENGTH (0x01)",
        status_name(r[0]),
        r[1]
    );
    ensure!(
        s[0] == 1 && s[1] == 0x12,
        "sender: {} syndrome {:#04x}, expected ERROR_CQE REMOTE_INVAL_REQ (0x12)",
        status_name(s[0]),
        s[1]
    );
    Ok(format!(
        "a {size} B send into a {rsize} B receive buffer: the receiving kernel got \
         LOCAL_LENGTH (vendor {:#04x}), the sending kernel REMOTE_INVAL_REQ",
        r[2]
    ))
}

/// Every receive completion the kernel recorded in `comps` (opcode, immediate, length, WQE)
/// and every byte of every message: the WRITE_IMMs at their offsets in `dst`, the sends in the
/// receive buffers from `recv_off` on.
fn check_receives(
    m: Messages,
    comps: &gpuverbs::gpu::DeviceMem,
    src: &HostBuffer,
    dst: &HostBuffer,
    recv_off: usize,
) -> Result<()> {
    let Messages {
        n_imm, size, rsize, ..
    } = m;
    let n = (m.n_imm + m.n_send) as usize;
    let mut raw = vec![0u8; 16 * n];
    comps.read(0, &mut raw)?;
    let words: Vec<u32> = raw
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes(c.try_into().expect("4 bytes")))
        .collect();
    let (s, d) = (src.to_vec(), dst.to_vec());
    for k in 0..n {
        let c = &words[4 * k..4 * k + 4];
        let kk = k as u32;
        let want = if kk < n_imm {
            [1, 0x1000 + kk, size, kk]
        } else {
            let j = kk - n_imm;
            if j % 2 == 1 {
                [3, 0x2000 + j, size, kk]
            } else {
                [2, 0, size, kk]
            }
        };
        ensure!(
            c == want,
            "receive completion {k}: {{opcode, imm, bytes, wqe}} = {c:x?}, expected {want:x?}"
        );
        let sz = size as usize;
        let (from, to) = if kk < n_imm {
            (k * sz, k * sz)
        } else {
            (k * sz, recv_off + k * rsize as usize)
        };
        ensure!(
            d[to..to + sz] == s[from..from + sz],
            "message {k}: bytes differ"
        );
    }
    Ok(())
}
