//! `read_lat`: RDMA READ latency, in the style of perftest's `ib_read_lat`: side A reads `size`
//! bytes of side B's buffer, one READ at a time, and the whole READ is reported (perftest does
//! not halve it). Side A checks every byte it read. GPU initiator (`--loopback`):
//! `gv_sample_verb_lat`, block 0 posting `get` and waiting with `quiet`. The harness is
//! [`gpuverbs_samples::lat`].

fn main() -> std::process::ExitCode {
    gpuverbs_samples::lat::main(gpuverbs_samples::bw::Verb::Read)
}
