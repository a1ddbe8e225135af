//! `send_lat`: SEND ping-pong latency, in the style of perftest's `ib_send_lat` (`-I` default
//! 236): each side keeps one receive posted, takes its completion and answers. Both receive
//! buffers are checked after every size, and every receive's byte count as it completes. GPU
//! initiator (`--loopback`): `gv_sample_verb_lat`, one thread driving sides A and B in turn,
//! posts each side's receives (`post_recv`) and takes them (`recv_wait`) in the kernel. The harness is
//! [`gpuverbs_samples::lat`].

fn main() -> std::process::ExitCode {
    gpuverbs_samples::lat::main(gpuverbs_samples::bw::Verb::Send)
}
