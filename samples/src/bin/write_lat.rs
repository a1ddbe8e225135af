//! `write_lat`: RDMA WRITE ping-pong latency between GPU-driven QPs (or CPU-driven ones), in the
//! style of perftest's `ib_write_lat`. The harness is [`gpuverbs_samples::lat`] (its docs say
//! what a run does); the kernel is `gv_sample_verb_lat`.

fn main() -> std::process::ExitCode {
    gpuverbs_samples::lat::main(gpuverbs_samples::bw::Verb::Write)
}
