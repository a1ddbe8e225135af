//! `send_bw`: SEND bandwidth with the WQEs posted by CUDA kernels (or by the CPU), in the style
//! of perftest's `ib_send_bw` (`-r`/`--rx-depth`: receives kept posted per QP, default 512).
//! The receiver checks each receive's byte count as it completes and every byte of every
//! receive slot after the run. The receives are posted by a host thread of the receiving
//! process, with the CPU and with the GPU initiator alike: with `--initiator gpu` the kernel
//! (`gv_sample_verb_bw`, one thread per QP) posts only the SENDs. The harness is
//! [`gpuverbs_samples::bw`].

fn main() -> std::process::ExitCode {
    gpuverbs_samples::bw::main(gpuverbs_samples::bw::Verb::Send)
}
