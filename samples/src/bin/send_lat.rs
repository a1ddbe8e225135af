//! `send_lat`: SEND ping-pong latency, in the style of perftest's `ib_send_lat` (`-I` default
//! 236): each side keeps one receive posted, takes its completion and answers. Both receive
//! buffers are checked after every size, and every receive's byte count as it completes. GPU
//! initiator (`--loopback`): `gv_sample_verb_lat`, blocks 0 and 1 (sides A and B) post their own
//! receives (`post_recv`) and take them (`recv_wait`) in the kernel. The harness is
//! [`gpuverbs_samples::lat`].

fn main() -> std::process::ExitCode {
    gpuverbs_samples::lat::main(gpuverbs_samples::bw::Verb::Send)
}
