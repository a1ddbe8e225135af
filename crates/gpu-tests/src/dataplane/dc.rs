//! DC from a kernel: a DC initiator exported to the GPU reaches a DC target on the other
//! device through `dc_put`, `dc_get` and the DC atomics, naming the target by the address
//! vector the host hands it (`DcTarget::address_vector`).

use anyhow::{ensure, Result};
use gpuverbs::proxy::{ProxyConfig, ProxyService, ProxyTarget};
use gpuverbs::{
    Access, ConnectOptions, CqOptions, DctOptions, DoorbellMode, QpOptions, RingPlacement,
};

use super::{arg, contexts, counters, gpu, Buf, Mem, Status, BUDGET_NS};

/// dc_put, dc_get, dc_atomic_fetch_add and dc_atomic_compare_swap from one thread, doorbell
/// `mode`, payloads in `mem`, the initiator's rings placed as `rings`; every byte and both
/// old values checked on the host.
pub fn dc_ops(
    ordinal: usize,
    mode: DoorbellMode,
    mem: Mem,
    rings: RingPlacement,
) -> Result<String> {
    let gpu = gpu(ordinal)?;
    let (a, b) = contexts()?;
    let (pa, pb) = (a.alloc_pd(), b.alloc_pd());
    let cqb = b.create_cq(CqOptions::default())?;
    let dct = pb.create_dct(&cqb, DctOptions::new(0x1ee7_a330))?;
    let target = dct.target();
    let cqa = a.create_cq_on(
        &gpu,
        CqOptions {
            placement: rings,
            ..Default::default()
        },
    )?;
    let mut o = QpOptions::new(&cqa, &cqa);
    o.sq_blocks = 64;
    o.doorbell = mode;
    o.placement = rings;
    let conn = ConnectOptions {
        timeout: 10,
        retry_cnt: 3,
        ..Default::default()
    };
    let dci = pa.create_dci_on(&gpu, o, conn)?;
    dci.reach(&target)?;
    let rights = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let (src, dst) = (Buf::new(&gpu, mem, 4096)?, Buf::new(&gpu, mem, 4096)?);
    let pattern: Vec<u8> = (0..64).map(|i| 0x30 + i as u8).collect();
    src.write(0, &pattern)?;
    let far: Vec<u8> = (0..64).map(|i| 0x90 ^ i as u8).collect();
    dst.write(256, &far)?;
    dst.write(1024, &100u64.to_ne_bytes())?;
    dst.write(1032, &11u64.to_ne_bytes())?;
    let src_mr = src.register(&pa, rights)?;
    let dst_mr = dst.register(&pb, rights | Access::REMOTE_ATOMIC)?;
    let export = gpu.export_qp(&dci)?;
    // the proxy thread rings for a CPU-proxy QP (the handle is not needed: the service,
    // dropped at the end, releases the target)
    let _proxy = if mode.proxied() {
        let svc = ProxyService::start(ProxyConfig::default())?;
        let _handle = svc.add(ProxyTarget::for_qp(&dci)?)?;
        Some(svc)
    } else {
        None
    };
    let st = Status::new(&gpu)?;
    let av: [u8; 48] = bytemuck::cast(target.address_vector());
    let unit = |i: usize| -> [u32; 4] { bytemuck::pod_read_unaligned(&av[i * 16..i * 16 + 16]) };
    let (mut av0, mut av1, mut av2) = (unit(0), unit(1), unit(2));
    let (mut q, mut lbase, mut lk, mut rbase, mut rk, mut budget, mut out) = (
        export.ptr(),
        src.gpu_addr(&gpu)?,
        src_mr.lkey().0,
        dst_mr.addr(),
        dst_mr.rkey().0,
        BUDGET_NS,
        st.ptr(),
    );
    let mut params = [
        arg(&mut q),
        arg(&mut av0),
        arg(&mut av1),
        arg(&mut av2),
        arg(&mut lbase),
        arg(&mut lk),
        arg(&mut rbase),
        arg(&mut rk),
        arg(&mut budget),
        arg(&mut out),
    ];
    // SAFETY: parameters match gv_test_dc (three uint4 are three 16-byte [u32; 4]); the
    // pointers are live device-visible memory.
    unsafe { gpu.launch_sync("gv_test_dc", (1, 1, 1), (1, 1, 1), 0, &mut params)? };
    st.expect_ok()?;
    let (s, d) = (src.to_vec()?, dst.to_vec()?);
    ensure!(d[..64] == pattern[..], "dc_put bytes differ");
    ensure!(s[512..576] == far[..], "dc_get bytes differ");
    let word = |b: &[u8], o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap());
    ensure!(
        (word(&d, 1024), word(&s, 1024)) == (107, 100),
        "dc fetch-add: target {} old {}",
        word(&d, 1024),
        word(&s, 1024)
    );
    ensure!(
        (word(&d, 1032), word(&s, 1032)) == (22, 11),
        "dc compare-swap: target {} old {}",
        word(&d, 1032),
        word(&s, 1032)
    );
    if let Some(c) = counters(&a) {
        ensure!(c.errors.is_empty(), "device: {c:?}");
    }
    Ok(format!(
        "dc_put, dc_get, dc fetch-add and compare-swap to DCT {:#x} verified (payload {mem:?}, \
         rings {rings:?})",
        target.dctn
    ))
}
