//! The endpoint and memory descriptors a peer sends (`Endpoint::from_bytes`,
//! `RemoteMemory::from_bytes`): any bytes give a value or a typed error, never a panic, and
//! an accepted value encodes to bytes that decode to it again.
#![no_main]

use gpuverbs::{Endpoint, RemoteMemory};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|d: &[u8]| {
    if let Ok(e) = Endpoint::from_bytes(d) {
        let again = Endpoint::from_bytes(&e.to_bytes()).expect("an accepted endpoint re-decodes");
        assert_eq!(again, e);
    }
    if let Ok(m) = RemoteMemory::from_bytes(d) {
        let again = RemoteMemory::from_bytes(&m.to_bytes()).expect("accepted memory re-decodes");
        assert!(again == m, "RemoteMemory round trip");
    }
});
