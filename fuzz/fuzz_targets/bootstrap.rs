//! The bootstrap's side of a TCP connection to a hostile peer: the peer (this harness) sends
//! the input's bytes — a hello, length-prefixed frames, JSON — then closes its half; this
//! process, as rank 0 (accepting) or rank 1 (connecting), runs one bootstrap call on it. The
//! first byte picks the role and the call (`recv`, `exchange` of an `Endpoint`, `barrier`,
//! `all_gather` of `RemoteMemory`). Oracle: the call returns (a value or a typed error) within
//! its timeouts, never a panic, and never allocates for a frame longer than the limit.
#![no_main]

use gpuverbs::bootstrap::{Bootstrap, Listener};
use gpuverbs::{Endpoint, RemoteMemory};
use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_millis(300);

/// The peer's part: write everything, close the writing half, read until the other side
/// closes (so our writes never block), at most 2 s.
fn play(mut s: TcpStream, bytes: Vec<u8>) {
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.write_all(&bytes);
    let _ = s.shutdown(Shutdown::Write);
    let mut sink = [0u8; 4096];
    while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
}

fn call(b: &mut Bootstrap, which: u8) {
    b.set_timeout(T);
    b.set_max_frame(1 << 16);
    let ep = Endpoint::new(
        std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
        0x100,
        0x1234,
        4096,
        "softnic",
    )
    .expect("a valid endpoint");
    match which % 4 {
        0 => drop(b.recv()),
        1 => drop(b.exchange(&ep)),
        2 => drop(b.barrier()),
        _ => {
            let m = RemoteMemory::export_rkey(0x1000, 4096, 7).expect("valid memory");
            drop(b.all_gather(&m))
        }
    }
}

fuzz_target!(|d: &[u8]| {
    let Some((&ctl, rest)) = d.split_first() else {
        return;
    };
    let bytes = rest.to_vec();
    let start = Instant::now();
    if ctl & 4 == 0 {
        // we accept; the hostile peer connects and talks first
        let l = Listener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr();
        let peer = std::thread::spawn(move || {
            if let Ok(s) = TcpStream::connect(addr) {
                play(s, bytes)
            }
        });
        if let Ok(mut b) = l.accept(T) {
            call(&mut b, ctl);
        }
        peer.join().expect("the peer thread");
    } else {
        // we connect to a hostile rank 0
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("address");
        let peer = std::thread::spawn(move || {
            if let Ok((s, _)) = l.accept() {
                play(s, bytes)
            }
        });
        if let Ok(mut b) = Bootstrap::client(addr, T) {
            call(&mut b, ctl);
        }
        drop(TcpStream::connect(addr)); // the peer's accept returns even if we never connected
        peer.join().expect("the peer thread");
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "a bootstrap call took {:?}",
        start.elapsed()
    );
});
