//! `read_bw`: RDMA READ bandwidth with the WQEs posted by CUDA kernels (or by the CPU), in the
//! style of perftest's `ib_read_bw` (`-o`/`--outs`: reads in flight per QP, default 16). The
//! initiator reads the target's source slots (poisoned, then filled with the size's pattern)
//! into its destination slots and checks every byte. GPU initiator: `gv_sample_verb_bw`, one
//! thread per QP posting `get`s, at most `-o` in flight (it waits for the completion `-o`
//! READs back before posting the next). The harness is [`gpuverbs_samples::bw`].

fn main() -> std::process::ExitCode {
    gpuverbs_samples::bw::main(gpuverbs_samples::bw::Verb::Read)
}
