//! The emulated connection manager's parsers of what arrives on QP1 and in ucma commands
//! (`uverbs::cm`): any bytes as a CM MAD (`mad::parse`: never a panic; what it takes encodes
//! back to 256 bytes that parse to the same message), as a socket address (`addr::parse`) and as
//! the CMA header of a REQ's private data (`addr::parse_cma_hdr`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use uverbs::cm::{addr, mad};

fuzz_target!(|d: &[u8]| {
    if let Ok(m) = mad::parse(d) {
        let b = mad::encode(&m);
        assert_eq!(b.len(), mad::MAD_LEN);
        assert_eq!(mad::parse(&b), Ok(m));
    }
    if let Ok(a) = addr::parse(d) {
        // an address reads back from its own encoding (AF_IB keeps its GID and service ID)
        if a.family != addr::AF_IB {
            assert_eq!(addr::parse(&a.encode()), Ok(a));
        }
    }
    let _ = addr::parse_cma_hdr(d, 7174);
});
