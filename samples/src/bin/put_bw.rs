//! `put_bw`: RDMA WRITE bandwidth with the WQEs posted by CUDA kernels (or by the CPU), in the
//! style of perftest's `ib_write_bw`. The harness is [`gpuverbs_samples::bw`] (its docs say
//! what a run does); the kernel is `gv_sample_put_bw` (thread, warp or block scope).

fn main() -> std::process::ExitCode {
    gpuverbs_samples::bw::main(gpuverbs_samples::bw::Verb::Write)
}
