#!/usr/bin/env bash
# multigpu.sh: data-parallel checks for the two-GPU machine (nvidia-h200-x2), from the repository
# root, with the binaries of scripts/gpu/prepare.sh in .devbin/all (it copies the `multigpu` test
# executable too). Build here: `bash scripts/gpu/prepare.sh`; then on the machine (carry .devbin):
#   bash scripts/gpu/multigpu.sh [PART...]      (default: doctor tests gpus stop kill9 sample bench scaling;
#                                                 ≈ 11 min in all, each part bounded by `timeout`s)
#   NGPU=4 (or 8) bash scripts/gpu/multigpu.sh bench scaling    on a 4- or 8-GPU machine (default 2)
# Parts, each logged to $OUT/multigpu/ (packed into $OUT/multigpu.tar.gz), one line each in
# $OUT/summary.txt:
#   doctor     NCCL version and file, devices
#   tests      crates/meddpm-cuda/tests/multigpu.rs: 2×1 == 1×2 over 10 steps, identical weights
#              after 100 steps, bf16 ranks identical and near 1×2, a killed rank stops the other
#   gpus       `meddpm train --gpus 2` (tiny, fp32) and the same run launched torchrun-style by hand;
#              both checkpoints must hold the same weights; then a resume of it on 1 GPU; a bf16 run
#   stop       `train --gpus 2` interrupted (SIGINT to the launcher): both ranks stop after the same
#              step, rank 0's checkpoint holds it; then SIGTERM to rank 1 alone, same check
#   kill9      a torchrun-style GPU run whose rank 1 gets SIGKILL mid-run: rank 0 must exit non-zero
#              naming rank 1; the last checkpoint loads and resumes on one GPU
#   sample     `sample --gpus 2` vs one GPU: the same volume files (bytes), one timing file
#   bench      `meddpm bench --gpus $NGPU` (whole-head, bf16 and tf32, NDHWC): step on 1 GPU vs NGPU,
#              efficiency, and every rank's all-reduce time, hidden share and GPU idle time (CUPTI)
#   scaling    whole-head 128³, batch 1 per GPU, TF32: steps/s on 1 GPU (--gpus 1) and on NGPU
#              (the global batch grows NGPU-fold: efficiency = steps/s(NGPU) / steps/s(1))
# Library path as scripts/gpu/run.sh, plus a private `libnccl.so` link: cudarc looks for that name
# (or .so.13/.12/…), while pip's NCCL ships only `libnccl.so.2`.
# NVLink multicast must stay off on these machines (../shared/docs/gpu-machine.md): the three
# variables below are exported here and `--gpus` sets them in every rank again.
set -uo pipefail
source scripts/gpu/bins.sh  # BIN (packed builds unpacked first)
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
# CUPTI, for the all-reduce overlap and GPU idle time `bench --gpus` measures on every rank
CUPTI=$(dirname "$(find "$SP/nvidia" /usr/local/cuda/ -name 'libcupti.so*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$CUPTI"
export MEDDPM_CACHE_DIR=${MEDDPM_CACHE_DIR:-/tmp/meddpm-cache}
M="$BIN/meddpm"
NGPU=${NGPU:-2}
sum() { echo "$*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"

doctor() {
"$M" doctor >"$RES/doctor.log" 2>&1
sum "doctor: $(grep -E '^NCCL:|devices visible' "$RES/doctor.log" | tr '\n' ' ')"
}

# each test starts its own ranks; the kill test re-runs the binary as two processes (child_rank,
# skipped here). The tests are #[ignore]d (a plain `cargo test` reports them as ignored):
# --include-ignored runs them
tests() {
timeout 300 "$BIN/multigpu" --include-ignored --skip child_rank --nocapture --test-threads=1 >"$RES/tests.log" 2>&1
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
timeout 120 "$M" train --preset tiny --steps 20 --checkpoint-every 10 --no-sample --device cuda --precision bf16 \
  --layout ndhwc --check-every 5 --gpus 2 --out "$RES/bf16" >"$RES/bf16.log" 2>&1
sum "train --gpus 2 bf16: exit $? — $(grep -E '^done' "$RES/bf16.log")"
}

# the step each rank stopped at, from its log ("stopped at step N" / "rank 1: stopped at step N")
stopped_at() { grep -oE 'stopped at step [0-9]+' "$1" | head -1 | grep -oE '[0-9]+$'; }
ck_step() { python3 -c "import json,struct,sys; b=open(sys.argv[1],'rb').read(); n=struct.unpack('<Q',b[:8])[0]; print(json.loads(b[8:8+n])['__metadata__']['step'])" "$1" 2>/dev/null; }

# the process `timeout` runs (a signal to `timeout` itself reaches its child twice: directly and
# through the process group, and a second signal aborts)
child() { pgrep -P "$1" | head -1; }

# safe stop: SIGINT to the --gpus launcher, then SIGTERM to one rank of a torchrun-style run
stop() {
LONG=(train --preset demo --steps 100000 --checkpoint-every 0 --no-sample --device cuda --check-every 20)
timeout 180 "$M" "${LONG[@]}" --gpus 2 --out "$RES/stop" >"$RES/stop.log" 2>&1 &
P=$!
sleep 45; kill -INT "$(child $P)"; wait $P
sum "stop --gpus 2 (SIGINT): exit $? — $(grep -E 'stopped at step|rank 1: stopped' "$RES/stop.log" | tr '\n' ' ') checkpoint step $(ck_step "$RES/stop/checkpoint.safetensors")"
PORT=$((20000 + RANDOM % 20000))
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
    timeout 180 "$M" "${LONG[@]}" --out "$RES/stop1" >"$RES/stop1_$r.log" 2>&1 &
  eval "R$r=\$!"
done
sleep 45; kill -TERM "$(child "$R1")"; wait "$R0"; E0=$?; wait "$R1"; E1=$?
sum "stop torchrun-style (SIGTERM to rank 1): exits $E0/$E1 — rank 0 at $(stopped_at "$RES/stop1_0.log"), rank 1 at $(stopped_at "$RES/stop1_1.log"), checkpoint step $(ck_step "$RES/stop1/checkpoint.safetensors")"
}

# SIGKILL to rank 1 of a GPU run: rank 0 exits non-zero naming it (its liveness watch sees the
# closed connection), the last checkpoint stays whole and resumes on one GPU
kill9() {
LONG=(train --preset demo --steps 100000 --checkpoint-every 50 --no-sample --device cuda --check-every 20 --dist-timeout 60)
PORT=$((20000 + RANDOM % 20000))
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
    timeout 240 "$M" "${LONG[@]}" --out "$RES/kill9" >"$RES/kill9_$r.log" 2>&1 &
  eval "K$r=\$!"
done
for _ in $(seq 120); do [ -f "$RES/kill9/checkpoint.safetensors" ] && break; sleep 1; done
sleep 2; T0=$(date +%s.%N); kill -KILL "$(child "$K1")"; wait "$K0"; E0=$?; T1=$(date +%s.%N); wait "$K1"
CK=$(ck_step "$RES/kill9/checkpoint.safetensors")
sum "kill9 (SIGKILL to rank 1): rank 0 exit $E0 after $(python3 -c "print(f'{$T1-$T0:.1f}')") s — $(grep -oE 'rank 1 [^:]*(crashed|killed|lost)[^.]*' "$RES/kill9_0.log" | head -1) — checkpoint step $CK"
timeout 180 "$M" train --resume "$RES/kill9/checkpoint.safetensors" --steps $((CK + 10)) --no-sample --checkpoint-every 0 \
  --device cuda >"$RES/kill9_resume.log" 2>&1
sum "kill9: resume on 1 GPU: exit $? — $(grep -E '^done' "$RES/kill9_resume.log")"
}

# sample --gpus 2 writes the files one GPU writes
sample() {
CK="$RES/gpus2/checkpoint.safetensors"
S=(sample --checkpoint "$CK" --sampler ddim --steps 10 --num-samples 3 --device cuda --precision fp32 --layout ncdhw)
timeout 120 "$M" "${S[@]}" --out "$RES/s1/v" >"$RES/sample1.log" 2>&1
timeout 120 "$M" "${S[@]}" --gpus 2 --out "$RES/s2/v" >"$RES/sample2.log" 2>&1
sum "sample --gpus 2: exit $? — files $(ls "$RES/s2" | tr '\n' ' ') — differing volumes vs 1 GPU: $(for f in "$RES"/s1/*.nii.gz; do cmp -s "$f" "$RES/s2/$(basename "$f")" || echo -n "$(basename "$f") "; done)"
}

# bench --gpus NGPU: the step on one GPU against NGPU, whole-head; every rank's collective figures
bench() {
timeout 500 "$M" bench --preset whole-head --precision bf16,tf32 --layout ndhwc --iters 10 --warmup 3 --gpus "$NGPU" \
  --json "$OUT/bench-gpus$NGPU.json" >"$RES/bench.log" 2>&1
sum "bench --gpus $NGPU: exit $? — $(grep -E '^(bf16|tf32) |all-reduce' "$RES/bench.log" | tr '\n' ';')"
}

# whole-head 128³ on the built-in demo pairs; the first steps include cudnnFind
scaling() {
for g in 1 "$NGPU"; do
  timeout 200 "$M" train --preset whole-head --steps 40 --checkpoint-every 0 --no-sample --gpus $g \
    --out "$RES/wh$g" >"$RES/scaling$g.log" 2>&1
  sum "whole-head --gpus $g: exit $? — $(grep -E '^done' "$RES/scaling$g.log")"
done
}

for part in ${@:-doctor tests gpus stop kill9 sample bench scaling}; do
  case $part in
    doctor|tests|gpus|stop|kill9|sample|bench|scaling) $part ;;
    *) echo "unknown part $part (doctor tests gpus stop kill9 sample bench scaling)" ;;
  esac
done

tar czf "$OUT/multigpu.tar.gz" --exclude="*.safetensors" -C "$OUT" multigpu && rm -rf "$RES"
cat "$OUT/summary.txt"
