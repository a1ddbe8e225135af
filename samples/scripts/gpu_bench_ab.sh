#!/usr/bin/env bash
# On the GPU machine: issue 14's shapes, main's gpu_bench against this branch's, interleaved,
# then the GPU suites of this branch. Build here first (both with nvcc, GPUVERBS_REQUIRE_NVCC=1):
#   git checkout main && cargo build --release -p gpuverbs-samples --bin gpu_bench && cp $T/release/gpu_bench /tmp/gb_main
#   git checkout issue14-exclusive-copy && cargo xtask gpu-test          # fills .gpu-bundle/
#   cargo build --release -p gpuverbs-samples --bin gpu_bench && cp $T/release/gpu_bench .gpu-bundle/gb_branch
#   cp /tmp/gb_main .gpu-bundle/ && cp samples/scripts/gpu_bench_ab.sh .gpu-bundle/
# then run `bash .gpu-bundle/gpu_bench_ab.sh` with carry [".gpu-bundle"]; results under $OUT.
set -u
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT"
for r in 1 2; do
    for v in main branch; do
        echo "== $v round $r"
        timeout 150 "$B/gb_$v" --series shapes --json >"$OUT/shapes_${v}_$r.json" 2>"$OUT/shapes_${v}_$r.err"
        echo "rc=$? t=${SECONDS}s"
        grep -h "median" "$OUT/shapes_${v}_$r.err" | sed 's/(runs.*//'
    done
done
timeout 150 "$B/gpu-test" >"$OUT/gpu-test.log" 2>&1
echo "gpu-test rc=$?"; grep "gpu-test:" "$OUT/gpu-test.log"
GPUVERBS_PRELOAD=$B/libgpuverbs_uverbs_preload.so timeout 200 "$B/gpuverbs" emu --devices 2 -- \
    "$B/gpu-test" --backend mlx5 >"$OUT/gpu-test-mlx5.log" 2>&1
echo "mlx5 rc=$?"; grep "gpu-test:" "$OUT/gpu-test-mlx5.log"
