//! Unit tests of the WQE segment builders.

use super::*;

fn sge(addr: u64, len: u32) -> Sge {
    Sge {
        addr,
        len,
        lkey: Lkey(0x1234),
    }
}

#[test]
fn write_two_sges_layout() {
    let sges = [sge(0x1000, 8), sge(0x2000, 16)];
    let op = Op::Write {
        remote: RemoteAddr {
            addr: 0xdead_beef_0000,
            rkey: Rkey(0x77),
        },
        local: Local::Sges(&sges),
        imm: None,
    };
    let w = op.encode(17, 0x1a2, CtrlFlags::SIGNALED).unwrap();
    assert_eq!(w.ds(), 4);
    assert_eq!(w.blocks(), 1);
    let b = w.as_bytes();
    assert_eq!(&b[0..4], &[0, 0, 17, 0x08]);
    assert_eq!(&b[4..8], &[0, 0x01, 0xa2, 4]);
    assert_eq!(b[11], 0x08);
    assert_eq!(&b[16..24], &0xdead_beef_0000u64.to_be_bytes());
    assert_eq!(&b[24..28], &[0, 0, 0, 0x77]);
    assert_eq!(&b[32..36], &8u32.to_be_bytes());
    assert_eq!(&b[36..40], &0x1234u32.to_be_bytes());
    assert_eq!(&b[48..52], &16u32.to_be_bytes());
}

#[test]
fn inline_sizes_and_padding() {
    let data = [0xabu8; 13];
    let op = Op::Send {
        local: Local::Inline(&data),
        imm: Some(5),
    };
    let w = op.encode(0, 1, CtrlFlags::default()).unwrap();
    // ctrl 1 + align(4+13,16)/16 = 2
    assert_eq!(w.ds(), 3);
    let b = w.as_bytes();
    assert_eq!(&b[16..20], &(13u32 | INLINE_SEG).to_be_bytes());
    assert_eq!(&b[20..33], &data);
    assert!(b[33..].iter().all(|&x| x == 0), "reserved bytes zero");
    assert_eq!(&b[12..16], &5u32.to_be_bytes());
    assert_eq!(b[11], 0);
}

#[test]
fn too_large_is_an_error() {
    let big = [0u8; MAX_INLINE_WRITE + 1];
    let op = Op::Write {
        remote: RemoteAddr::default(),
        local: Local::Inline(&big),
        imm: None,
    };
    assert!(matches!(
        op.encode(0, 1, CtrlFlags::default()),
        Err(BuildError::TooLarge { .. })
    ));
    let ok = [0u8; MAX_INLINE_WRITE];
    let op = Op::Write {
        remote: RemoteAddr::default(),
        local: Local::Inline(&ok),
        imm: None,
    };
    assert_eq!(op.encode(0, 1, CtrlFlags::default()).unwrap().ds(), 63);
    let sges = [sge(0, 1); 63];
    let fits = Op::Send {
        local: Local::Sges(&sges[..62]),
        imm: None,
    };
    assert_eq!(fits.encode(0, 1, CtrlFlags::default()).unwrap().ds(), 63);
    let op = Op::Send {
        local: Local::Sges(&sges),
        imm: None,
    };
    assert_eq!(
        op.encode(0, 1, CtrlFlags::default()).unwrap_err(),
        BuildError::TooLarge { ds: 64 }
    );
}

#[test]
fn multi_block_wqe_wraps_in_ring() {
    let sges = [sge(0x10, 4); 10]; // ds = 2 + 10 = 12 → 3 blocks
    let op = Op::Write {
        remote: RemoteAddr::default(),
        local: Local::Sges(&sges),
        imm: None,
    };
    let w = op.encode(0xffff, 5, CtrlFlags::default()).unwrap();
    assert_eq!(w.blocks(), 3);
    let mut ring = [0u8; 4 * WQEBB];
    let next = w.copy_to_ring(&mut ring).unwrap();
    assert_eq!(next, 2);
    // first block at slot 3, then slots 0 and 1
    assert_eq!(&ring[3 * 64..4 * 64], w.block(0));
    assert_eq!(&ring[0..64], w.block(1));
    assert_eq!(&ring[64..128], w.block(2));
    assert!(ring[128..192].iter().all(|&x| x == 0));
    assert!(w.copy_to_ring(&mut [0u8; 3 * WQEBB]).is_err());
}

#[test]
fn flags_round_trip() {
    for signaled in [false, true] {
        for solicited in [false, true] {
            for fence in [Fence::None, Fence::Small, Fence::Strong] {
                let f = CtrlFlags {
                    signaled,
                    solicited,
                    fence,
                };
                assert_eq!(CtrlFlags::from_fm_ce_se(f.fm_ce_se()), f);
            }
        }
    }
}
