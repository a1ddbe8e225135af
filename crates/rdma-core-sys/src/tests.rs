//! CPU-only tests: they pass with rdma-core installed (no RDMA device needed) and without it.

use super::*;
use std::ffi::c_int;
use std::mem::{offset_of, size_of};
use std::ptr;

#[test]
fn verbs_loads_or_names_the_library() {
    match verbs() {
        Ok(v) => {
            let mut n: c_int = -1;
            // SAFETY: `n` is a valid out-pointer; the list is freed below.
            let list = unsafe { (v.ibv_get_device_list)(&mut n) };
            if list.is_null() {
                // How rdma-core reports a kernel without RDMA support (errno ENOSYS); it
                // zeroes the count first.
                let err = std::io::Error::last_os_error();
                eprintln!("ibv_get_device_list: NULL, count {n} ({err})");
                assert_eq!(n, 0);
            } else {
                assert!(n >= 0, "device count {n}");
                eprintln!("ibv_get_device_list: {n} device(s)");
                // SAFETY: `list` came from ibv_get_device_list and is freed once.
                unsafe { (v.ibv_free_device_list)(list) };
            }
        }
        Err(e) => {
            let msg = e.to_string();
            eprintln!("{msg}");
            assert!(msg.contains(LIBIBVERBS), "{msg}");
            assert!(msg.contains("libibverbs1"), "{msg}");
        }
    }
}

#[test]
fn mlx5dv_loads_or_names_the_library() {
    match mlx5dv() {
        Ok(_) => assert!(verbs().is_ok(), "libmlx5 loaded without libibverbs"),
        Err(e) => assert!(e.to_string().contains(LIBMLX5), "{e}"),
    }
}

#[test]
fn is_available_agrees_with_the_loaders() {
    assert_eq!(is_available(), verbs().is_ok() && mlx5dv().is_ok());
}

#[test]
fn bogus_library_is_named_in_the_error() {
    const BOGUS: &str = "libgpuverbs-no-such-library.so.7";
    // SAFETY: the library does not exist, so nothing is loaded or run.
    let err = unsafe { IbVerbs::load(BOGUS) }.unwrap_err();
    assert!(matches!(err, LoadError::Library { ref library, .. } if library == BOGUS));
    assert!(
        err.to_string().starts_with(&format!("{BOGUS} not found")),
        "{err}"
    );
    // SAFETY: as above.
    let err = unsafe { Mlx5Dv::load(BOGUS) }.unwrap_err();
    assert!(err.to_string().contains(BOGUS), "{err}");
}

#[test]
fn wrong_library_names_the_missing_symbol() {
    // libc is always present and lacks every ibv_* symbol.
    // SAFETY: libc is already loaded in this process; reopening it runs no initialiser.
    let err = unsafe { IbVerbs::load("libc.so.6") }.unwrap_err();
    match &err {
        LoadError::Symbol {
            library, symbol, ..
        } => {
            assert_eq!(library, "libc.so.6");
            assert!(symbol.starts_with("ibv_"), "{symbol}");
            assert!(err.to_string().contains(symbol), "{err}");
        }
        other => panic!("expected a missing symbol, got {other}"),
    }
}

#[test]
fn cqe_layout() {
    assert_eq!(size_of::<mlx5_cqe64>(), 64);
    assert_eq!(offset_of!(mlx5_cqe64, srqn_uidx), 32);
    assert_eq!(offset_of!(mlx5_cqe64, imm_inval_pkey), 36);
    assert_eq!(offset_of!(mlx5_cqe64, byte_cnt), 44);
    assert_eq!(offset_of!(mlx5_cqe64, sop_drop_qpn), 56);
    assert_eq!(offset_of!(mlx5_cqe64, wqe_counter), 60);
    assert_eq!(offset_of!(mlx5_cqe64, signature), 62);
    assert_eq!(offset_of!(mlx5_cqe64, op_own), 63);
    assert_eq!(size_of::<mlx5_err_cqe>(), 64);
    assert_eq!(offset_of!(mlx5_err_cqe, vendor_err_synd), 54);
    assert_eq!(offset_of!(mlx5_err_cqe, syndrome), 55);
    assert_eq!(offset_of!(mlx5_err_cqe, s_wqe_opcode_qpn), 56);
    assert_eq!(offset_of!(mlx5_err_cqe, op_own), 63);
}

#[test]
fn wqe_segment_layout() {
    assert_eq!(size_of::<mlx5_wqe_ctrl_seg>(), 16);
    assert_eq!(offset_of!(mlx5_wqe_ctrl_seg, opmod_idx_opcode), 0);
    assert_eq!(offset_of!(mlx5_wqe_ctrl_seg, qpn_ds), 4);
    assert_eq!(offset_of!(mlx5_wqe_ctrl_seg, signature), 8);
    assert_eq!(offset_of!(mlx5_wqe_ctrl_seg, fm_ce_se), 11);
    assert_eq!(offset_of!(mlx5_wqe_ctrl_seg, imm), 12);
    assert_eq!(size_of::<mlx5_wqe_data_seg>(), 16);
    assert_eq!(offset_of!(mlx5_wqe_data_seg, lkey), 4);
    assert_eq!(offset_of!(mlx5_wqe_data_seg, addr), 8);
    assert_eq!(size_of::<mlx5_wqe_raddr_seg>(), 16);
    assert_eq!(offset_of!(mlx5_wqe_raddr_seg, rkey), 8);
    assert_eq!(size_of::<mlx5_wqe_atomic_seg>(), 16);
    assert_eq!(offset_of!(mlx5_wqe_atomic_seg, compare), 8);
    assert_eq!(size_of::<mlx5_wqe_inl_data_seg>(), 4);
    // Copy + Default, as downstream layout tests rely on.
    let ctrl = mlx5_wqe_ctrl_seg::default();
    let copy = ctrl;
    assert_eq!({ copy.qpn_ds }, { ctrl.qpn_ds });
    let _ = mlx5_cqe64::default();
}

#[test]
fn constants_are_plain_integers() {
    assert_eq!(MLX5_OPCODE_NOP, 0x00);
    assert_eq!(MLX5_OPCODE_RDMA_WRITE, 0x08);
    assert_eq!(MLX5_OPCODE_RDMA_WRITE_IMM, 0x09);
    assert_eq!(MLX5_OPCODE_SEND, 0x0a);
    assert_eq!(MLX5_OPCODE_RDMA_READ, 0x10);
    assert_eq!(MLX5_OPCODE_ATOMIC_CS, 0x11);
    assert_eq!(MLX5_OPCODE_ATOMIC_FA, 0x12);
    assert_eq!(MLX5_CQE_REQ, 0);
    assert_eq!(MLX5_CQE_REQ_ERR, 13);
    assert_eq!(MLX5_CQE_RESP_ERR, 14);
    assert_eq!(MLX5_CQE_INVALID, 15);
    assert_eq!(MLX5_CQE_SYNDROME_WR_FLUSH_ERR, 0x05);
    assert_eq!(MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR, 0x13);
    assert_eq!(MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR, 0x15);
    assert_eq!(MLX5_WQE_CTRL_CQ_UPDATE, 0x08);
    assert_eq!(MLX5_INLINE_SEG, 0x8000_0000);
    assert_eq!(MLX5_SEND_WQE_BB, 64);
    assert_eq!(MLX5_INVALID_LKEY, 0x100);
    assert_eq!(MLX5_CQ_DOORBELL, 0x20);
    let rts: ibv_qp_state = IBV_QPS_RTS;
    assert_eq!(rts, 3);
}

// --- the hand-ported inlines, driven through fake provider contexts ---

unsafe extern "C" fn fake_post_send(
    _qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    _bad: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: the test passes a valid work request.
    unsafe { (*wr).wr_id as c_int }
}

unsafe extern "C" fn fake_poll_cq(_cq: *mut ibv_cq, n: c_int, _wc: *mut ibv_wc) -> c_int {
    n - 1
}

#[test]
fn ops_inlines_dispatch_through_the_context() {
    let mut ctx_storage = ibv_context::default();
    let ctx: *mut ibv_context = &mut ctx_storage;
    let mut qp = ibv_qp {
        context: ctx,
        ..Default::default()
    };
    let mut wr = ibv_send_wr {
        wr_id: 42,
        ..Default::default()
    };
    let mut bad = ptr::null_mut();
    // SAFETY: `qp` points at a live (fake) context with no post_send/post_recv.
    unsafe {
        assert_eq!(ibv_post_send(&mut qp, &mut wr, &mut bad), EOPNOTSUPP);
        assert_eq!(
            ibv_post_recv(&mut qp, ptr::null_mut(), ptr::null_mut()),
            EOPNOTSUPP
        );
    }
    // SAFETY: `ctx` points at the live local.
    unsafe { (*ctx).ops.post_send = Some(fake_post_send) };
    // SAFETY: the fake post_send only reads `wr`.
    assert_eq!(unsafe { ibv_post_send(&mut qp, &mut wr, &mut bad) }, 42);

    let mut cq = ibv_cq {
        context: ctx,
        ..Default::default()
    };
    // SAFETY: `cq` points at a live (fake) context.
    unsafe {
        assert_eq!(ibv_poll_cq(&mut cq, 4, ptr::null_mut()), -EOPNOTSUPP);
        assert_eq!(ibv_req_notify_cq(&mut cq, 0), EOPNOTSUPP);
    }
    // SAFETY: `ctx` points at the live local.
    unsafe { (*ctx).ops.poll_cq = Some(fake_poll_cq) };
    // SAFETY: the fake poll_cq touches nothing.
    assert_eq!(unsafe { ibv_poll_cq(&mut cq, 4, ptr::null_mut()) }, 3);
}

unsafe extern "C" fn fake_ext_query_port(
    _ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    assert_eq!(len, size_of::<ibv_port_attr>());
    // SAFETY: the caller passes a valid attribute struct.
    unsafe { (*attr).lid = 0x1000 + u16::from(port) };
    0
}

unsafe extern "C" fn fake_compat_query_port(
    _ctx: *mut ibv_context,
    port: u8,
    attr: *mut _compat_ibv_port_attr,
) -> c_int {
    // SAFETY: the caller passes a valid attribute struct.
    unsafe {
        assert_eq!((*attr.cast::<ibv_port_attr>()).lid, 0, "not zeroed first");
        (*attr.cast::<ibv_port_attr>()).lid = 0x2000 + u16::from(port);
    }
    0
}

#[test]
fn query_port_takes_the_extended_op_when_present() {
    let mut vctx = verbs_context::default();
    let vp: *mut verbs_context = &mut vctx;
    // SAFETY: `vp` points at the live local; the context pointer keeps its provenance.
    let ctx = unsafe { &raw mut (*vp).context };
    let mut attr = ibv_port_attr {
        lid: 7,
        ..Default::default()
    };

    // Legacy context: not extended, so the exported symbol runs on a zeroed struct.
    // SAFETY: `ctx` and `attr` are live.
    unsafe {
        assert!(verbs_get_ctx(ctx).is_null());
        assert_eq!(
            query_port_with(fake_compat_query_port, ctx, 1, &mut attr),
            0
        );
    }
    assert_eq!(attr.lid, 0x2001);

    // Extended context whose provider has query_port.
    // SAFETY: `vp` is live and not otherwise borrowed.
    unsafe {
        (*vp).context.abi_compat = ptr::without_provenance_mut(usize::MAX);
        (*vp).sz = size_of::<verbs_context>();
        (*vp).query_port = Some(fake_ext_query_port);
        assert_eq!(verbs_get_ctx(ctx), vp);
        assert_eq!(
            query_port_with(fake_compat_query_port, ctx, 2, &mut attr),
            0
        );
    }
    assert_eq!(attr.lid, 0x1002);

    // Extended, but the provider's context is too small to hold query_port: fall back.
    // SAFETY: as above.
    unsafe {
        (*vp).sz = size_of::<verbs_context>() - offset_of!(verbs_context, query_port) - 8;
        assert_eq!(
            query_port_with(fake_compat_query_port, ctx, 3, &mut attr),
            0
        );
    }
    assert_eq!(attr.lid, 0x2003);
}

unsafe extern "C" fn fake_reg_mr(
    _pd: *mut ibv_pd,
    _addr: *mut c_void,
    _len: usize,
    _access: c_int,
) -> *mut ibv_mr {
    ptr::without_provenance_mut(1)
}

unsafe extern "C" fn fake_reg_mr_iova2(
    _pd: *mut ibv_pd,
    addr: *mut c_void,
    _len: usize,
    iova: u64,
    _access: c_uint,
) -> *mut ibv_mr {
    assert_eq!(iova, addr as usize as u64);
    ptr::without_provenance_mut(2)
}

#[test]
fn reg_mr_picks_the_symbol_like_the_macro() {
    let addr = ptr::without_provenance_mut(0x1000);
    let plain = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    let relaxed = plain | IBV_ACCESS_RELAXED_ORDERING;
    assert_ne!(relaxed & IBV_ACCESS_OPTIONAL_RANGE, 0);
    // SAFETY: the fakes touch no memory.
    unsafe {
        let mr = reg_mr_with(
            fake_reg_mr,
            fake_reg_mr_iova2,
            ptr::null_mut(),
            addr,
            8,
            plain,
        );
        assert_eq!(mr.addr(), 1);
        let mr = reg_mr_with(
            fake_reg_mr,
            fake_reg_mr_iova2,
            ptr::null_mut(),
            addr,
            8,
            relaxed,
        );
        assert_eq!(mr.addr(), 2);
    }
}
