//! Every status path of the device API, each call timed against its budget.

use anyhow::{ensure, Context as _, Result};
use gpuverbs::gpu::Gpu;
use gpuverbs::{Access, Context, CqOptions, HostBuffer, Mr, Pd, Qp, QpOptions};
use std::sync::Arc;

use super::{arg, connect_both, contexts, gpu, status_name};

/// Budget of each status-path call, and how far past it a call may return (the clock's
/// granularity, launch noise).
const STATUS_BUDGET_NS: u64 = 2_000_000;
const STATUS_SLACK_NS: u64 = 1_000_000;

/// One QP for a status path: A has its own receive CQ (16 receives), an SQ of 64 blocks, a
/// host buffer to send from; B is its connected peer.
struct StatusSetup {
    qa: Qp,
    qb: Qp,
    _a: Context,
    _b: Context,
    pa: Pd,
    src: HostBuffer,
    src_mr: Mr,
    dst_mr: Mr,
    _dst: HostBuffer,
    export: Option<gpuverbs::gpu::ExportedQp>,
}

fn status_setup(gpu: &Arc<Gpu>) -> Result<StatusSetup> {
    let (a, b) = contexts()?;
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let (scq, rcq) = (
        a.create_cq(CqOptions {
            depth: 64,
            ..Default::default()
        })?,
        a.create_cq(CqOptions {
            depth: 64,
            ..Default::default()
        })?,
    );
    let mut oa = QpOptions::new(&scq, &rcq);
    oa.sq_blocks = 64;
    oa.rq_wqes = 16;
    let qa = pa.create_qp(oa)?;
    let cqb = b.create_cq(CqOptions::default())?;
    let qb = pb.create_qp(QpOptions::new(&cqb, &cqb))?;
    connect_both(&qa, &qb, Access::REMOTE_WRITE)?;
    let src = HostBuffer::new(4096);
    let dst = HostBuffer::new(4096);
    let src_mr = pa.register_with(&src, Access::LOCAL_WRITE)?;
    let dst_mr = pb.register_with(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    gpu.map_host(&src)?;
    let export = Some(gpu.export_qp(&qa)?);
    Ok(StatusSetup {
        qa,
        qb,
        _a: a,
        _b: b,
        pa,
        src,
        src_mr,
        dst_mr,
        _dst: dst,
        export,
    })
}

/// Runs gv_test_status case `which` on `st`: [status, ns, follow-up status, OK calls before].
fn launch_status(gpu: &Arc<Gpu>, st: &StatusSetup, which: u32, threads: u32) -> Result<[u64; 4]> {
    let out = gpu.alloc(32)?;
    out.write(0, &[0u8; 32])?;
    let export = st.export.as_ref().context("no export")?;
    let (mut q, mut w, mut budget) = (export.ptr(), which, STATUS_BUDGET_NS);
    let (mut laddr, mut lk) = (gpu.map_host(&st.src)?, st.src_mr.lkey().0);
    let (mut raddr, mut rk, mut o) = (st.dst_mr.addr(), st.dst_mr.rkey().0, out.ptr());
    let mut params = [
        arg(&mut q),
        arg(&mut w),
        arg(&mut budget),
        arg(&mut laddr),
        arg(&mut lk),
        arg(&mut raddr),
        arg(&mut rk),
        arg(&mut o),
    ];
    // SAFETY: the parameters match gv_test_status's signature; q, laddr (mapped host memory) and
    // out are live device-visible memory for the whole launch; raddr is only a remote address.
    unsafe { gpu.launch_sync("gv_test_status", (1, 1, 1), (threads, 1, 1), 0, &mut params)? };
    let mut b = [0u8; 32];
    out.read(0, &mut b)?;
    Ok(bytemuck::cast(b))
}

/// Every status path of the device API, each call timed: it must return its status within its
/// budget plus a small bound. The shared-publish timeout breaks the send queue (every later call
/// BROKEN) and the host recovers by resetting, reconnecting and exporting the QP again.
pub fn status_paths(ordinal: usize) -> Result<String> {
    let gpu = gpu(ordinal)?;
    let mut worst = 0u64;
    let mut seen = Vec::new();
    // (case, name, expected status, lock word the host holds, threads)
    let cases: [(u32, &str, i32, Option<&str>, u32); 9] = [
        (0, "reserve (SQ full)", 2, None, 1),
        (1, "doorbell lock", 2, Some("ring"), 1),
        (2, "receive lock", 2, Some("rq"), 1),
        (3, "recv_wait", 2, None, 1),
        (4, "wait_ticket", 2, None, 1),
        (5, "shared publish", 2, None, 2),
        (6, "post_recv", 5, None, 1),
        (7, "put_inline", 3, None, 1),
        (8, "quiet", 2, Some("ring"), 1),
    ];
    for (which, name, want, lock, threads) in cases {
        let mut st = status_setup(&gpu)?;
        if let Some(l) = lock {
            let export = st.export.as_ref().context("no export")?;
            let mut d = export.read()?;
            match l {
                "ring" => d.sq_rung = u64::MAX,
                _ => d.rq_lock = 1,
            }
            export.write(&d)?;
        }
        let r = launch_status(&gpu, &st, which, threads)?;
        ensure!(
            r[0] as i32 == want,
            "{name}: {} where {} was expected ({r:?})",
            status_name(r[0] as i32),
            status_name(want)
        );
        if want == 2 {
            ensure!(
                r[1] + 1000 >= STATUS_BUDGET_NS && r[1] <= STATUS_BUDGET_NS + STATUS_SLACK_NS,
                "{name}: TIMEOUT after {} ns for a budget of {STATUS_BUDGET_NS} ns",
                r[1]
            );
            worst = worst.max(r[1].saturating_sub(STATUS_BUDGET_NS));
        } else {
            ensure!(
                r[1] <= STATUS_SLACK_NS,
                "{name}: {} ns to say {}",
                r[1],
                status_name(want)
            );
        }
        match which {
            0 => ensure!(
                r[3] >= 1,
                "reserve: no put succeeded before the SQ filled: {r:?}"
            ),
            6 => ensure!(
                r[3] == 16,
                "post_recv: {} receives fitted a 16-entry RQ",
                r[3]
            ),
            5 => {
                ensure!(
                    r[2] as i32 == 6,
                    "after the publish timeout: {} (BROKEN expected)",
                    status_name(r[2] as i32)
                );
                let export = st.export.take().context("no export")?;
                ensure!(export.is_broken()?, "the descriptor does not say broken");
                drop(export);
                // the host recovers: reset, connect again, export again
                st.qa.modify(gpuverbs::Modify::Reset)?;
                st.qb.modify(gpuverbs::Modify::Reset)?;
                connect_both(&st.qa, &st.qb, Access::REMOTE_WRITE)?;
                st.export = Some(gpu.export_qp(&st.qa)?);
                let again = launch_status(&gpu, &st, 1, 1)?;
                ensure!(
                    again[0] == 0,
                    "after reset and a new export: {}",
                    status_name(again[0] as i32)
                );
            }
            _ => {}
        }
        let _ = &st.pa;
        seen.push(format!("{name} {}", status_name(want)));
    }
    Ok(format!(
        "{}; every TIMEOUT within {:.1} ms of its {} ms budget (worst {:.2} ms over); a broken \
         send queue recovered by reset and a new export",
        seen.join(", "),
        STATUS_SLACK_NS as f64 / 1e6,
        STATUS_BUDGET_NS / 1_000_000,
        worst as f64 / 1e6
    ))
}
