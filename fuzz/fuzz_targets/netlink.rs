//! The emulation's RDMA netlink answers (`uverbs::netlink::answer`) to any bytes a program may
//! send on its `NETLINK_RDMA` socket: never a panic, and every answer is whole netlink messages
//! (each length at least a header and inside its datagram), addressed to the socket's port id,
//! in datagrams of at most a page unless one message alone is larger.
#![no_main]

use libfuzzer_sys::fuzz_target;
use uverbs::netlink::{answer, NlDevice};

const PORTID: u32 = 0x1234;

fuzz_target!(|d: &[u8]| {
    let devs: Vec<NlDevice> = (0..2)
        .map(|i| NlDevice {
            index: i,
            name: format!("mlx5_{i}"),
            node_guid: 0x029c_a5ff_7f00_0001 + i as u64,
            fw_version: "0.1.0".into(),
            cdev: (231, 192 + i),
            abi: 1,
            port_cap_flags: 0x0401_0000,
            port_state: 4,
            port_phys_state: 5,
            netdev: (1, "lo".into()),
            resources: vec![("pd", 1), ("qp", 2)],
            counters: vec![("wqes_executed".into(), 3)],
        })
        .collect();
    for dgram in answer(d, PORTID, &devs) {
        let mut rest = &dgram[..];
        let mut messages = 0;
        while !rest.is_empty() {
            assert!(rest.len() >= 16, "a partial header");
            let len = u32::from_ne_bytes(rest[..4].try_into().unwrap()) as usize;
            assert!((16..=rest.len()).contains(&len), "length {len} of {}", rest.len());
            assert_eq!(u32::from_ne_bytes(rest[12..16].try_into().unwrap()), PORTID);
            messages += 1;
            rest = &rest[((len + 3) & !3).min(rest.len())..];
        }
        assert!(dgram.len() <= 4096 || messages == 1);
    }
});
