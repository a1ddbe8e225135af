#!/usr/bin/env bash
# The perftest-style samples' GPU-initiator paths, run and checked on a machine with a GPU
# (CI has none, so `cargo test` covers only their CPU paths and refusals): each case runs with
# `--initiator gpu --json`, in loopback or as a server and a client on 127.0.0.1, and passes
# when every process exits 0 and every row it prints says `"validated":true`.
#
# Usage: samples/scripts/gpu_samples_check.sh [BIN_DIR] [GPUVERBS PRELOAD]
#   BIN_DIR   where put_bw, read_bw, send_bw, atomic_bw, write_lat, read_lat, send_lat,
#             atomic_lat and user-kernel are (default: target/release)
#   GPUVERBS, PRELOAD   the `gpuverbs` command and its preload library: the mlx5 cases then run
#             the samples on the real libmlx5 under `gpuverbs emu` (default: none, skipped)
# Environment: MPS=0 keeps MPS off for the two-process cases (default: started with
# nvidia-cuda-mps-control when it is there: two processes whose kernels share one GPU otherwise
# time-slice it, milliseconds per message). LOG (default /tmp/gpu-samples) keeps each case's
# output.
# Prints one line per case and `gpu-samples: N passed, M failed`; exits 1 when one failed.
set -uo pipefail
bin=${1:-target/release}
gpuverbs=${2:-}
preload=${3:-}
log=${LOG:-/tmp/gpu-samples}
mkdir -p "$log"
passed=0
failed=0
port=19100

# check NAME FILE...: every file has a row and only validated rows.
check() {
    local name=$1 f rows bad
    shift
    for f in "$@"; do
        rows=$(grep -c '^{' "$f" || true)
        bad=$(grep '^{' "$f" | grep -vc '"validated":true' || true)
        if [ "$rows" -eq 0 ] || [ "$bad" -ne 0 ]; then
            echo "FAIL $name: $rows rows, $bad not validated ($f)"
            return 1
        fi
    done
    return 0
}

# The command the loopback cases run under (the emulation, for the mlx5 cases).
wrap=()

# loop NAME BIN ARGS...: one process, both sides.
loop() {
    local name=$1 b=$2
    shift 2
    local out="$log/$name.out"
    if timeout 120 ${wrap[@]+"${wrap[@]}"} "$bin/$b" --loopback --initiator gpu --json "$@" >"$out" \
        2>"$log/$name.err" &&
        check "$name" "$out"; then
        echo "ok   $name: $(grep -c '^{' "$out") rows"
        passed=$((passed + 1))
    else
        echo "FAIL $name (exit or rows; see $log/$name.err)"
        tail -n 3 "$log/$name.err"
        failed=$((failed + 1))
    fi
}

# pair NAME BIN ARGS...: a server and a client on 127.0.0.1, both with the GPU initiator.
pair() {
    local name=$1 b=$2
    shift 2
    port=$((port + 1))
    local s="$log/$name.server" c="$log/$name.client"
    timeout 120 "$bin/$b" -p "$port" --timeout 60 --initiator gpu --json "$@" >"$s.out" \
        2>"$s.err" &
    local server=$!
    sleep 0.5
    timeout 120 "$bin/$b" 127.0.0.1 -p "$port" --initiator gpu --json "$@" >"$c.out" 2>"$c.err"
    local rc_c=$?
    wait "$server"
    local rc_s=$?
    if [ "$rc_c" -eq 0 ] && [ "$rc_s" -eq 0 ] && check "$name" "$s.out" "$c.out"; then
        echo "ok   $name: $(grep -c '^{' "$c.out") rows, both sides"
        passed=$((passed + 1))
    else
        echo "FAIL $name (client $rc_c, server $rc_s; see $c.err, $s.err)"
        tail -n 3 "$c.err" "$s.err"
        failed=$((failed + 1))
    fi
}

# Loopback: -I (inline WQEs from the kernels), -D (a run of a duration; the bandwidth tests with
# every scope, the latency tests' duration rows).
loop put_bw_inline put_bw -s 64 -n 2000 -I 64
loop put_bw_inline_shared put_bw -s 200 -n 4096 -I 256 --threads 32 --scope thread
loop put_bw_duration put_bw -s 4096 -D 1
loop put_bw_duration_shared put_bw -s 4096 -D 1 -q 2 --ctas 4 --threads 64 --scope thread
loop put_bw_duration_warp put_bw -s 4096 -D 1 --threads 64 --scope warp
loop put_bw_duration_block put_bw -s 4096 -D 1 --threads 128 --scope block
loop send_bw_inline send_bw -s 128 -n 2000 -I 128
loop send_bw_duration send_bw -s 4096 -D 1 -q 2
loop read_bw_duration read_bw -s 4096 -D 1 -q 2
loop atomic_bw_duration atomic_bw -D 1 -A CMP_AND_SWAP
loop write_lat_inline write_lat -s 64
loop write_lat_inline_signal write_lat -s 100 --signal
loop write_lat_gather write_lat -s 64 -I 0
loop write_lat_gpumem write_lat -s 220 --mem gpu
loop send_lat_inline send_lat -s 64
loop send_lat_gather send_lat -s 4096
loop read_lat read_lat -s 64
loop atomic_lat atomic_lat
loop write_lat_duration write_lat -s 64 -D 1
loop send_lat_duration send_lat -s 4096 -D 1 --cpu_util
loop read_lat_duration read_lat -D 1
loop atomic_lat_duration atomic_lat -D 1 -A CMP_AND_SWAP

# The user-kernel sample: a crate's own kernels (user_put, and the README's put_signal and
# wait_put) on an exported QP; it checks every byte and the signal itself and exits 0 when all
# arrived. Skipped (and said) when BIN_DIR has no user-kernel.
if [ -x "$bin/user-kernel" ]; then
    if timeout 120 "$bin/user-kernel" >"$log/user_kernel.out" 2>"$log/user_kernel.err" &&
        grep -q "the README's put_signal" "$log/user_kernel.out"; then
        echo "ok   user_kernel: $(tail -n 1 "$log/user_kernel.out")"
        passed=$((passed + 1))
    else
        echo "FAIL user_kernel (see $log/user_kernel.err)"
        tail -n 3 "$log/user_kernel.err"
        failed=$((failed + 1))
    fi
else
    echo "skip user_kernel: no $bin/user-kernel"
fi

# Two processes: write_lat's kernel drives one side per process; -D and -I across the wire.
mps_started=0
if [ "${MPS:-1}" != 0 ] && command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=$log/mps-pipe CUDA_MPS_LOG_DIRECTORY=$log/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && mps_started=1
fi
pair write_lat_2p write_lat -s 64
pair write_lat_2p_gather write_lat -a -I 0
pair write_lat_2p_signal write_lat -s 4096 --signal
pair send_lat_2p send_lat -s 64
pair put_bw_2p_duration put_bw -s 65536 -D 1
pair send_bw_2p_inline send_bw -s 64 -n 2000 -I 64
pair read_bw_2p_duration read_bw -s 4096 -D 1
pair send_bw_2p_duration send_bw -s 4096 -D 1
pair write_lat_2p_duration write_lat -s 64 -D 1
pair send_lat_2p_duration send_lat -s 64 -D 1
pair atomic_lat_2p_duration atomic_lat -D 1
if [ "$mps_started" = 1 ]; then
    echo quit | nvidia-cuda-mps-control
fi

# The mlx5 backend on the real libmlx5, under the uverbs emulation.
if [ -n "$gpuverbs" ] && [ -n "$preload" ]; then
    export GPUVERBS_PRELOAD=$preload
    wrap=("$gpuverbs" emu --devices 1 --)
    loop mlx5_put_bw_inline_duration put_bw -d mlx5_0 -s 64 -D 1 -I 64
    loop mlx5_send_bw_inline send_bw -d mlx5_0 -s 128 -n 1000 -I 128
    loop mlx5_write_lat_inline write_lat -d mlx5_0 -s 64
    loop mlx5_send_lat_inline send_lat -d mlx5_0 -s 64
    loop mlx5_write_lat_duration write_lat -d mlx5_0 -s 64 -D 1
    # rings in GPU memory: DEVX CQs and QPs on GPU-memory umems
    loop mlx5_put_bw_gpu_rings put_bw -d mlx5_0 -s 4096 -n 2000 --rings gpu
    loop mlx5_send_bw_gpu_rings send_bw -d mlx5_0 -s 1024 -n 1000 --rings gpu
    loop mlx5_write_lat_gpu_rings write_lat -d mlx5_0 -s 64 -n 1000 --rings gpu
    loop mlx5_put_bw_gpu_rings_gpu_mem put_bw -d mlx5_0 -s 65536 -n 500 --rings gpu --mem gpu
fi

echo "gpu-samples: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
