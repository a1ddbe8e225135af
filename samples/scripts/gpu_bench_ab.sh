#!/usr/bin/env bash
# On the GPU machine: issue 14's launch shapes, a base gpu_bench against a new one, interleaved
# (three rounds of each, each round five interleaved rounds inside gpu_bench), then the GPU suites
# of the new tree. Build here first, both with nvcc (GPUVERBS_REQUIRE_NVCC=1), T the target dir:
#   (base tree)  cargo build --release -p gpuverbs-samples --bin gpu_bench && cp $T/release/gpu_bench /tmp/gb_base
#   (new tree)   cargo xtask gpu-test                                    # fills .gpu-bundle/
#                cargo build --release -p gpuverbs-samples --bin gpu_bench && cp $T/release/gpu_bench .gpu-bundle/gb_new
#                cp /tmp/gb_base .gpu-bundle/ && cp samples/scripts/gpu_bench_ab.sh .gpu-bundle/
# then run `bash .gpu-bundle/gpu_bench_ab.sh` with carry [".gpu-bundle"]; results under $OUT.
# About 80 s on the H200 (2026-12-01: suites 35 s each tree, a shapes run 2 s).
set -u
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT"
timeout 150 "$B/gpu-test" >"$OUT/gpu-test.log" 2>&1
echo "gpu-test rc=$?"; grep "gpu-test:" "$OUT/gpu-test.log"
GPUVERBS_PRELOAD=$B/libgpuverbs_uverbs_preload.so timeout 200 "$B/gpuverbs" emu --devices 2 -- \
    "$B/gpu-test" --backend mlx5 >"$OUT/gpu-test-mlx5.log" 2>&1
echo "mlx5 rc=$?"; grep "gpu-test:" "$OUT/gpu-test-mlx5.log"
for r in 1 2 3; do
    for v in base new; do
        timeout 100 "$B/gb_$v" --series shapes --json >"$OUT/shapes_${v}_$r.json" 2>"$OUT/shapes_${v}_$r.err"
        echo "== $v round $r rc=$? t=${SECONDS}s"
        grep -h "median" "$OUT/shapes_${v}_$r.err" | sed 's/ (runs.*//; s/^shape //'
    done
done
