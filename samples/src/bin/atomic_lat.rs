//! `atomic_lat`: 8-byte atomic latency, in the style of perftest's `ib_atomic_lat`: `-A
//! FETCH_AND_ADD` (default) or `CMP_AND_SWAP`, one at a time on side B's word; the whole atomic
//! is reported (perftest does not halve it). Every fetched old value is checked, and B's word
//! after each size. GPU initiator (`--loopback`): `gv_sample_verb_lat`, block 0 posting
//! `atomic_fetch_add` / `atomic_compare_swap`, checking each fetched value itself. The harness
//! is [`gpuverbs_samples::lat`].

fn main() -> std::process::ExitCode {
    gpuverbs_samples::lat::main(gpuverbs_samples::bw::Verb::Atomic(
        gpuverbs_samples::bw::AtomicOp::FetchAdd,
    ))
}
