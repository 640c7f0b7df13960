#!/usr/bin/env bash
# multigpu.sh: data-parallel checks for the two-GPU machine (nvidia-h200-x2), from the repository
# root, with the binaries of scripts/gpu/prepare.sh in .devbin/all (it copies the `multigpu` test
# executable too). Build here: `bash scripts/gpu/prepare.sh`; then on the machine (carry .devbin):
#   bash scripts/gpu/multigpu.sh [PART...]      (default: doctor tests gpus scaling; ≈ 5 min in all,
#                                                 each part bounded by `timeout`s)
# Parts, each logged to $OUT/multigpu/ (packed into $OUT/multigpu.tar.gz), one line each in
# $OUT/summary.txt:
#   doctor     NCCL version and file, devices
#   tests      crates/meddpm-cuda/tests/multigpu.rs: 2×1 == 1×2 over 10 steps, identical weights
#              after 100 steps, a killed rank stops the other
#   gpus       `meddpm train --gpus 2` (tiny, fp32) and the same run launched torchrun-style by hand;
#              both checkpoints must hold the same weights; then a resume of it on 1 GPU
#   scaling    whole-head 128³, batch 1 per GPU, TF32: steps/s on 1 GPU (--gpus 1) and on 2
#              (the global batch doubles: efficiency = steps/s(2) / steps/s(1))
# Library path as scripts/gpu/run.sh, plus a private `libnccl.so` link: cudarc looks for that name
# (or .so.13/.12/…), while pip's NCCL ships only `libnccl.so.2`.
# NVLink multicast must stay off on these machines (../shared/docs/gpu-machine.md): the three
# variables below are exported here and `--gpus` sets them in every rank again.
set -uo pipefail
BIN=$(cd "${BIN_DIR:-.devbin/all}" && pwd)
OUT=${OUT:-$PWD/gpu-out}
RES="$OUT/multigpu"
mkdir -p "$RES"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBDIR=$(mktemp -d)/lib
mkdir -p "$LIBDIR"
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBDIR/libcudnn.so"
ln -sf "$SP/nvidia/nccl/lib/libnccl.so.2" "$LIBDIR/libnccl.so"
export LD_LIBRARY_PATH="$LIBDIR:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export MEDDPM_CACHE_DIR=${MEDDPM_CACHE_DIR:-/tmp/meddpm-cache}
M="$BIN/meddpm"
sum() { echo "$*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"

doctor() {
"$M" doctor >"$RES/doctor.log" 2>&1
sum "doctor: $(grep -E '^NCCL:|devices visible' "$RES/doctor.log" | tr '\n' ' ')"
}

# each test starts its own ranks; the kill test re-runs the binary as two processes
tests() {
timeout 300 "$BIN/multigpu" --nocapture --test-threads=1 >"$RES/tests.log" 2>&1
sum "tests: exit $? — $(grep -E '^test result' "$RES/tests.log")"
grep -E "^test |panicked|NOT OK|exited .* after the kill" "$RES/tests.log"
}

# the local launcher, the same run torchrun-style, then a 1-GPU resume
gpus() {
TINY=(train --preset tiny --steps 20 --checkpoint-every 0 --no-sample --device cuda --precision fp32 --layout ncdhw --check-every 5)
timeout 120 "$M" "${TINY[@]}" --gpus 2 --out "$RES/gpus2" >"$RES/gpus2.log" 2>&1
sum "train --gpus 2: exit $? — $(grep -E '^done' "$RES/gpus2.log")"
PORT=$((20000 + RANDOM % 20000))
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
    timeout 120 "$M" "${TINY[@]}" --out "$RES/torchrun" >"$RES/torchrun$r.log" 2>&1 &
done
wait
sum "torchrun-style: $(grep -E '^done' "$RES/torchrun0.log") $(grep -E '^rank 1: done' "$RES/torchrun1.log")"
# same seeds, same shards: the two launches should agree (bit-identical unless cuDNN picked other
# algorithms); print the largest difference
sum "--gpus 2 vs torchrun-style checkpoint: $(python3 - "$RES/gpus2/checkpoint.safetensors" "$RES/torchrun/checkpoint.safetensors" <<'EOF'
import json, struct, sys, array
def tensors(p):
    b = open(p, 'rb').read(); n = struct.unpack('<Q', b[:8])[0]; h = json.loads(b[8:8 + n]); h.pop('__metadata__', None)
    return {k: array.array('f', b[8 + n + v['data_offsets'][0]:8 + n + v['data_offsets'][1]]) for k, v in h.items()}
try:
    a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
    d = max(max((abs(x - y) for x, y in zip(a[k], b[k])), default=0.0) for k in a)
    print(f"{len(a)} tensors, max |diff| {d:.3e}" + (" (identical)" if d == 0 else ""))
except Exception as e:
    print(f"cannot compare: {e}")
EOF
)"
timeout 120 "$M" train --resume "$RES/gpus2/checkpoint.safetensors" --steps 25 --no-sample --checkpoint-every 0 \
  --device cuda --precision fp32 --layout ncdhw --out "$RES/resume1" >"$RES/resume1.log" 2>&1
sum "resume on 1 GPU: exit $? — $(grep -E '^done' "$RES/resume1.log")"
}

# whole-head 128³ on the built-in demo pairs; the first steps include cudnnFind
scaling() {
for g in 1 2; do
  timeout 200 "$M" train --preset whole-head --steps 40 --checkpoint-every 0 --no-sample --gpus $g \
    --out "$RES/wh$g" >"$RES/scaling$g.log" 2>&1
  sum "whole-head --gpus $g: exit $? — $(grep -E '^done' "$RES/scaling$g.log")"
done
}

for part in ${@:-doctor tests gpus scaling}; do
  case $part in
    doctor|tests|gpus|scaling) $part ;;
    *) echo "unknown part $part (doctor tests gpus scaling)" ;;
  esac
done

tar czf "$OUT/multigpu.tar.gz" --exclude="*.safetensors" -C "$OUT" multigpu && rm -rf "$RES"
cat "$OUT/summary.txt"
