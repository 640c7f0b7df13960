#!/usr/bin/env bash
# Full-size PyTorch ↔ meddpm comparison of a Med-DDPM .pt checkpoint (issue 5), for the GPU machine.
#
# PyTorch (tools/reference/torch_full.py) builds the whole-head (128³) and BraTS (144×192×192)
# models with random weights (every parameter, zero-initialised convs included), saves each as a
# reference-style .pt ({'step', 'model', 'ema'}, 'denoise_fn.' keys + 13 buffers) with a fixed input,
# t = 137 and its float32 output (TF32 off). Then the meddpm test binary
# crates/meddpm-cuda/tests/torch_full.rs loads each .pt (config inferred), runs the forward on the
# GPU in fp32, tf32 and bf16, NDHWC and NCDHW, and reports max |Δ| / relative L2 vs PyTorch; and
# `$BIN convert` converts the whole-head .pt (timed), as a user would.
#
# Env: BIN      release `meddpm` binary (optional: the convert step is skipped without it)
#      TEST_BIN the torch_full test executable: on the build machine
#               cargo test --release -p meddpm-cuda --test torch_full --no-run  (path printed)
#      RES      results folder (report.txt, logs); default $OUT or ./torch_full_results
#      WORK     scratch for the ~1.6 GB of .pt files; default a mktemp dir (removed at the end)
#      MODELS   default "whole_head,brats"; SIZE="D,S" / CHANNELS=N for a reduced dry run,
#      DEVICE=cpu for a CPU dry run (no GPU, no cuDNN setup needed).
# Budget: ~90 s on an H200 with a warm kernel cache (python import + CUDA init ~15 s, .pt writes ~5 s,
# loads ~5 s, 12 forwards with their algorithm choice); a cold NVRTC cache adds ~50 s a precision.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
RES=${RES:-${OUT:-$PWD/torch_full_results}}
mkdir -p "$RES"
if [ -z "${WORK:-}" ]; then WORK=$(mktemp -d); MADE_WORK=1; else MADE_WORK=; mkdir -p "$WORK"; fi
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
: "${TEST_BIN:?set TEST_BIN to the torch_full test executable (cargo test --release -p meddpm-cuda --test torch_full --no-run)}"
T0=$(date +%s%N)
secs() { echo "$(( ($(date +%s%N) - $1) / 1000000 )) ms"; }

if [ "$DEVICE" != cpu ]; then
  # cuDNN trap (docs gpu-machine.md): libcudnn.so must resolve to PyTorch's 9.19, not 9.14
  source "$HERE/scripts/gpu/libs.sh"
fi

PYARGS=(--out "$WORK" --models "${MODELS:-whole_head,brats}" --device "$DEVICE")
[ -n "${SIZE:-}" ] && PYARGS+=(--size "$SIZE")
[ -n "${CHANNELS:-}" ] && PYARGS+=(--channels "$CHANNELS")
echo "== PyTorch reference ($($PY -c 'import torch; print(torch.__version__)'))" | tee "$RES/torch_full.log"
$PY "$HERE/tools/reference/torch_full.py" "${PYARGS[@]}" 2>&1 | tee -a "$RES/torch_full.log"

echo "== meddpm forward vs PyTorch" | tee -a "$RES/torch_full.log"
rm -f "$WORK/report.txt"
set +e
# the test is #[ignore]d (it needs these files): --include-ignored runs it
MEDDPM_TORCH_FULL_DIR="$WORK" MEDDPM_TORCH_FULL_DEVICE="$DEVICE" "$TEST_BIN" --include-ignored --nocapture --test-threads 1 \
  2>&1 | tee -a "$RES/torch_full.log"
RC=${PIPESTATUS[0]}
set -e
cp -f "$WORK/report.txt" "$RES/torch_full_report.txt" 2>/dev/null || true

if [ -n "${BIN:-}" ] && [ -f "$WORK/whole_head.pt" ]; then
  echo "== meddpm convert (whole-head .pt → safetensors)" | tee -a "$RES/torch_full.log"
  CONV_ARGS=()
  [ -n "${SIZE:-}" ] && CONV_ARGS+=(--depth "${SIZE%,*}" --size "${SIZE#*,}")
  [ -n "${CHANNELS:-}" ] && CONV_ARGS+=(--groups "$(( CHANNELS < 32 ? CHANNELS : 32 ))")
  S=$(date +%s%N)
  "$BIN" convert "$WORK/whole_head.pt" "$WORK/whole_head.safetensors" "${CONV_ARGS[@]}" 2>&1 | tee -a "$RES/torch_full.log" || RC=1
  echo "convert: $(secs "$S")" | tee -a "$RES/torch_full.log"
fi

[ -n "$MADE_WORK" ] && rm -rf "$WORK"
echo "== torch_full: exit $RC, $(secs "$T0") total" | tee -a "$RES/torch_full.log"
exit $RC
