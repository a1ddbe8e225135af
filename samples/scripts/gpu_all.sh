#!/usr/bin/env bash
# Every GPU check of the project in one call on the GPU machine (a machine start costs minutes of
# a session's device time): gpu-test on the soft NIC and on the mlx5 backend under the
# emulation, the samples' GPU-initiator check, NVIDIA's NVSHMEM with IBGDA (check, then the
# side-by-side benchmark) and, with its source given, NVIDIA's GPUNetIO examples beside
# gpuverbs' samples. Each step has a time limit and its own log; the summary lines come last.
#
# usage: gpu_all.sh BUNDLE_DIR BIN_DIR [GPUNETIO_TARBALL_OR_DIR]
#   BUNDLE_DIR  what `cargo xtask gpu-test` bundles (gpu-test, gpuverbs, the preload library)
#   BIN_DIR     release put_bw, read_bw, send_bw, atomic_bw, write_lat, read_lat, send_lat,
#               atomic_lat, user-kernel and nvshmem_check (built against the NVSHMEM wheel)
# Environment: LOG (default /tmp/gpu-all), STEPS (default "soft mlx5 samples nvshmem bench
# gpunetio").
set -u
bundle=$(realpath "$1") bin=$(realpath "$2") gpunetio=${3:-}
here=$(dirname "$(realpath "$0")")
log=${LOG:-/tmp/gpu-all}
mkdir -p "$log"
g=$bundle/gpuverbs p=$bundle/libgpuverbs_uverbs_preload.so
# NVLink multicast stays off on the shared GPU machines
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u
summary=()
# step NAME LIMIT PATTERN CMD...: runs CMD into $log/NAME.log within LIMIT seconds and keeps
# the line matching PATTERN (or says the step gave none).
step() {
    local name=$1 limit=$2 pattern=$3
    shift 3
    case " ${STEPS:-soft mlx5 samples nvshmem bench gpunetio} " in
    *" $name "*) ;;
    *) return ;;
    esac
    local t0=$SECONDS
    timeout "$limit" "$@" >"$log/$name.log" 2>&1
    local rc=$?
    local line
    line=$(grep -E "$pattern" "$log/$name.log" | tail -n 1)
    summary+=("$name (rc $rc, $((SECONDS - t0)) s): ${line:-no summary line; see $log/$name.log}")
}
step soft 150 '^gpu-test:' "$bundle/gpu-test"
step mlx5 150 '^gpu-test:' "$g" emu --devices 2 -- "$bundle/gpu-test" --backend mlx5
step samples 300 '^gpu-samples:' env LOG="$log/samples" "$here/gpu_samples_check.sh" "$bin" "$g" "$p"
step nvshmem 200 '^nvshmem:' env LOG="$log/nvshmem" TIMEOUT=90 \
    "$here/nvshmem_check.sh" "$g" "$p" "$bin/nvshmem_check"
step bench 240 '^nvshmem:' env LOG="$log/bench" HANDLERS=gpu MODE=bench TIMEOUT=90 \
    "$here/nvshmem_check.sh" "$g" "$p" "$bin/nvshmem_check" "$bin"
if [ -n "$gpunetio" ]; then
    step gpunetio 480 '^gpunetio:' env LOG="$log/gpunetio" HANDLERS="2 6 1" \
        "$here/gpunetio_check.sh" "$gpunetio" "$g" "$p" "$bin"
fi
date -u
printf '%s\n' "${summary[@]}"
