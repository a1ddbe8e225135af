#!/usr/bin/env bash
# NVIDIA's NVSHMEM (the machine's Python environment's nvidia-nvshmem wheel, unmodified) with its
# IBGDA transport on gpuverbs' emulated ConnectX: two PEs on one GPU (MPS started where the
# machine has it), each under its own `gpuverbs emu` (addresses 127.0.0.1 and 127.0.0.2, one
# emulated mlx5_0 each), meeting through NVSHMEM's UID bootstrap. Runs samples/nvshmem/
# nvshmem_check.cu once per NIC handler in $HANDLERS (NVSHMEM_IBGDA_NIC_HANDLER; default
# "gpu cpu_host_memory"): a case passes when both PEs exit 0 with `0 failed`, NVSHMEM's log says
# the IBGDA transport came up on each, and neither fell back to IBRC. With MODE=bench the same
# pairs print the put-rate and put-signal round-trip rows instead (PE 0), and, with gpuverbs'
# samples given, gpuverbs' put_bw and write_lat (GPU initiator, two processes, the same
# emulated devices and shapes) print theirs after them. TRANSPORT=ibrc runs the same with NVSHMEM's
# IBRC transport instead (its CPU proxy posts the device's operations through libibverbs; IBGDA
# not loaded; one case, the NIC handlers being IBGDA's), passing when NVSHMEM's log says IBRC came
# up. MODE=build only builds the binary (in $LOG).
#
# usage: nvshmem_check.sh GPUVERBS PRELOAD [NVSHMEM_CHECK_BIN [SAMPLES_DIR]]
# (without the binary, it is built here with nvcc against the wheel's headers and libraries)
# prints one line per case and `nvshmem: N passed, M failed`; logs in $LOG (default
# /tmp/nvshmem-check).
set -u
gpuverbs=$(realpath "$1") preload=$(realpath "$2") bin=${3:-} samples=${4:-}
log=${LOG:-/tmp/nvshmem-check}
mode=${MODE:-check}
transport=${TRANSPORT:-ibgda}
mkdir -p "$log"
passed=0 failed=0
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; failed=$((failed + 1)); }

nv=$(python3 -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])') || exit 1
echo "NVSHMEM: $(python3 -m pip show nvidia-nvshmem-cu13 2>/dev/null | grep ^Version) at $nv"
if [ -z "$bin" ]; then
    here=$(dirname "$(realpath "$0")")
    bin=$log/nvshmem_check
    mkdir -p "$log/lib" && ln -sf "$nv/lib/libnvshmem_host.so.3" "$log/lib/libnvshmem_host.so"
    if ! /usr/local/cuda/bin/nvcc -rdc=true -O2 -std=c++17 -arch=sm_90 -I"$nv/include" \
        "$here/../nvshmem/nvshmem_check.cu" -o "$bin" -L"$log/lib" -L"$nv/lib" \
        -lnvshmem_host -lnvshmem_device >"$log/build.log" 2>&1; then
        bad "build (see $log/build.log)"
        tail -n 20 "$log/build.log"
        echo "nvshmem: $passed passed, $failed failed"
        exit 1
    fi
fi
bin=$(realpath "$bin")
[ "$mode" = build ] && { echo "built $bin"; exit 0; }
export LD_LIBRARY_PATH=$nv/lib:${LD_LIBRARY_PATH:-} GPUVERBS_PRELOAD=$preload
# NVLink multicast stays off (the machine's rule); P2P off so the PEs, on one GPU, talk through
# the (emulated) NIC; IBGDA asked for on the one emulated HCA each process has, and no other
# remote transport loaded (IBGDA failing to come up then fails the run instead of falling back
# to IBRC); the emulated sysfs in place of the machine's (NVSHMEM reads the NIC's PCI path).
export NVSHMEM_DISABLE_NVLS=1 NVSHMEM_DISABLE_P2P=1 NVSHMEM_IB_ENABLE_IBGDA=1 \
    NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NCCL=1 NVSHMEM_DISABLE_GDRCOPY=1 \
    GPUVERBS_EMU_SYSFS=replace NVSHMEM_HCA_LIST=mlx5_0 NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo \
    NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-268435456} NVSHMEM_DEBUG=${NVSHMEM_DEBUG:-INFO}
up=IBGDA
if [ "$transport" = ibrc ]; then  # (NVSHMEM_IBGDA_NIC_HANDLER=ibrc below: unread with IBGDA off)
    export NVSHMEM_IB_ENABLE_IBGDA=0 NVSHMEM_REMOTE_TRANSPORT=ibrc HANDLERS=ibrc
    up=ibrc
fi
mps=0
if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d 2>/dev/null; then
    mps=1
fi

# transport_up LOG: NVSHMEM brought the transport asked for up (no other remote transport is
# loaded, so a run without it fails). NVSHMEM 3.4.5's line, src/host/transport/transport.cpp.
transport_up() {
    grep -q "Successfully initialized the transport: $up" "$1"
}

for h in ${HANDLERS:-gpu cpu_host_memory}; do
    name=${mode}_$h
    rm -f "$log/$name.uid"
    for r in 0 1; do
        NVSHMEM_IBGDA_NIC_HANDLER=$h GPUVERBS_EMU_COUNTERS=$log/$name.$r.counters \
            timeout "${TIMEOUT:-240}" "$gpuverbs" emu --ip 127.0.0.$((r + 1)) -- \
            "$bin" "$r" "$log/$name.uid" "$mode" >"$log/$name.$r.log" 2>&1 &
        eval "pid$r=$!"
    done
    wait "$pid0"
    rc0=$?
    wait "$pid1"
    rc1=$?
    if [ "$mode" = bench ]; then
        grep -h '^{' "$log/$name.0.log" "$log/$name.1.log"
        if [ "$rc0" = 0 ] && [ "$rc1" = 0 ] && transport_up "$log/$name.0.log" &&
            ! grep -qh '"validated":false' "$log/$name.0.log" "$log/$name.1.log"; then
            ok "bench, NIC handler $h"
        else
            bad "bench, NIC handler $h (rc $rc0/$rc1; see $log/$name.*)"
        fi
    elif [ "$rc0" = 0 ] && [ "$rc1" = 0 ] && grep -q "nvshmem-check: [0-9]* passed, 0 failed" "$log/$name.0.log" &&
        grep -q "nvshmem-check: [0-9]* passed, 0 failed" "$log/$name.1.log" &&
        transport_up "$log/$name.0.log" && transport_up "$log/$name.1.log"; then
        ok "NIC handler $h: $(grep 'nvshmem-check:' "$log/$name.0.log") on each PE, $up up"
    else
        bad "NIC handler $h (rc $rc0/$rc1; see $log/$name.*)"
        grep -E "^(FAIL|nvshmem-check)" "$log/$name.0.log" "$log/$name.1.log"
        tail -n 15 "$log/$name.0.log"
    fi
    grep -h '^cuda' "$log/$name.0.counters" 2>/dev/null
done
 
# gv NAME SAMPLE ARGS...: gpuverbs' SAMPLE as server (127.0.0.1) and client (127.0.0.2) under
# the emulation, GPU initiator; prints the client's rows.
gv() {
    local name=$1 s=$2
    shift 2
    timeout 120 "$gpuverbs" emu --ip 127.0.0.1 -- "$samples/$s" -d mlx5_0 -p 18700 \
        --initiator gpu --json "$@" >"$log/gv_$name.server" 2>&1 &
    local sp=$!
    sleep 2
    timeout 120 "$gpuverbs" emu --ip 127.0.0.2 -- "$samples/$s" -d mlx5_0 -p 18700 \
        --initiator gpu --json "$@" 127.0.0.1 >"$log/gv_$name.client" 2>&1
    local crc=$?
    wait "$sp"
    local src=$?
    grep -h '^{' "$log/gv_$name.client"
    if [ "$crc" = 0 ] && [ "$src" = 0 ] && ! grep -q '"validated":false' "$log/gv_$name.client"; then
        ok "gpuverbs $name"
    else
        bad "gpuverbs $name (rc $crc/$src; see $log/gv_$name.*)"
    fi
}
if [ "$mode" = bench ] && [ -n "$samples" ]; then
    echo "gpuverbs on the same emulated devices:"
    for size in 8 4096; do
        # payloads in GPU memory registered through dma-bufs, as NVSHMEM's symmetric heap is
        gv "put_bw_${size}_1x1" put_bw -s "$size" -n 2000 --ctas 1 --threads 1 --scope thread --mem gpu --use_cuda_dmabuf
        gv "put_bw_${size}_1x32" put_bw -s "$size" -n 6400 --ctas 1 --threads 32 --scope thread --mem gpu --use_cuda_dmabuf
        gv "put_bw_${size}_8x32" put_bw -s "$size" -n 12800 --ctas 8 --threads 32 --scope thread --mem gpu --use_cuda_dmabuf
        gv "write_lat_$size" write_lat -s "$size" -n 1000 --mem gpu --use_cuda_dmabuf --signal
    done
fi
if [ "$mps" = 1 ]; then
    echo quit | nvidia-cuda-mps-control
fi
echo "nvshmem: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
