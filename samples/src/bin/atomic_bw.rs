//! `atomic_bw`: 8-byte atomic bandwidth with the WQEs posted by CUDA kernels (or by the CPU), in
//! the style of perftest's `ib_atomic_bw`: `-A FETCH_AND_ADD` (default) or `-A CMP_AND_SWAP`,
//! `-o`/`--outs` atomics in flight per QP (default 16). Every fetched old value is checked by
//! the initiator and the final value of every target word by the target. GPU initiator:
//! `gv_sample_verb_bw`, one thread per QP (`atomic_fetch_add` / `atomic_compare_swap`). The
//! harness is [`gpuverbs_samples::bw`].

fn main() -> std::process::ExitCode {
    gpuverbs_samples::bw::main(gpuverbs_samples::bw::Verb::Atomic(
        gpuverbs_samples::bw::AtomicOp::FetchAdd,
    ))
}
