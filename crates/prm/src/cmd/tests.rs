use super::*;

#[test]
fn get_and_set_follow_the_prm_bit_numbering() {
    let mut b = [0u8; 16];
    // opcode 0x500 in DW0[31:16], uid 0x1234 in DW0[15:0]
    set(&mut b, cmd_in::OPCODE, 0x500);
    set(&mut b, cmd_in::UID, 0x1234);
    assert_eq!(&b[..4], &[0x05, 0x00, 0x12, 0x34]);
    assert_eq!(get(&b, cmd_in::OPCODE), 0x500);
    // a 24-bit field ending a dword: QPN DW2[23:0]
    set(&mut b, modify_qp_in::QPN, 0xabcdef);
    assert_eq!(&b[8..12], &[0, 0xab, 0xcd, 0xef]);
    // a field inside a structure placed in a mailbox: qpc.state at byte 24
    let mut m = [0u8; QP_IN];
    set(&mut m, qpc::STATE.at(QPC_AT), 3);
    assert_eq!(m[24], 0x30);
    // a value wider than the field keeps only its low bits, and neighbours are untouched
    set(&mut m, qpc::ST.at(QPC_AT), 0x1ff);
    assert_eq!((m[24], m[25]), (0x30, 0xff));
    assert_eq!(get(&m, qpc::STATE.at(QPC_AT)), 3);
}

#[test]
fn short_mailboxes_read_as_zero_and_drop_writes() {
    let b = [0xffu8; 4];
    assert_eq!(get(&b, modify_qp_in::QPN), 0);
    let mut s = [0u8; 2];
    set(&mut s, cmd_in::UID, 0xffff);
    assert_eq!(s, [0, 0]);
    assert_eq!(bytes(&b, ads::RGID_RIP.at(8)), &[] as &[u8]);
}

#[test]
fn a_64_bit_field_round_trips() {
    let mut m = [0u8; QP_IN];
    set(&mut m, create_qp_in::WQ_UMEM_OFFSET, 0x0123_4567_89ab_cdef);
    assert_eq!(&m[256..264], &0x0123_4567_89ab_cdefu64.to_be_bytes());
    assert_eq!(get(&m, create_qp_in::WQ_UMEM_OFFSET), 0x0123_4567_89ab_cdef);
}

#[test]
fn every_field_fits_its_structure_and_none_overlap() {
    for (prm, fields) in ALL {
        for (i, (a, fa)) in fields.iter().enumerate() {
            assert!(
                fa.width >= 1 && (fa.width <= 64 || fa.width % 8 == 0),
                "{prm}.{a}"
            );
            for (b, fb) in &fields[i + 1..] {
                let apart = fa.bit + fa.width <= fb.bit || fb.bit + fb.width <= fa.bit;
                assert!(apart, "{prm}: {a} overlaps {b}");
            }
        }
    }
}
