# s37 call 3: xf (silu_h: the transform's table halved, silu = h + h tanh h everywhere bf16 stores
# the activation) against main: parity tests, BraTS and whole-head benches alternated, the quick
# quality verdict
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
BIN_DIR=.devbin/main source scripts/gpu/bins.sh; MAIN=$BIN
BIN_DIR=.devbin/xf source scripts/gpu/bins.sh; XF=$BIN
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBDIR=$(mktemp -d)/lib; mkdir -p "$LIBDIR"
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBDIR/libcudnn.so"
export LD_LIBRARY_PATH="$LIBDIR:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
t0=$(date +%s)
CUDA_MODULE_LOADING=EAGER MEDDPM_CACHE_DIR=/tmp/cache-xf timeout 300 "$XF/parity_bf16" --test-threads=1 --nocapture \
  wgmma_gn_conv_bf16_parity unet_wgmma_gn_fused_matches_two_calls gn_head_bf16_parity groupnorm_bf16_parity \
  skip_apply_bf16_parity gn_cat_in_bf16_parity cat_free_bf16_parity unet_bf16_forward_backward_parity \
  one_training_step_bf16_parity > "$OUT/tests.log" 2>&1
echo "[tests rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
grep -E "^test |test result|panicked|FAILED" "$OUT/tests.log" | head -20 >> "$OUT/summary.txt"
arm() {
  local name=$1 bin=$2 preset=$3 round=$4 iters=$5
  local t0=$(date +%s)
  MEDDPM_CACHE_DIR=/tmp/cache-$name timeout 200 "$bin/meddpm" bench --device cuda --preset $preset \
    --precision bf16 --layout ndhwc --iters $iters --json "$OUT/$name-$preset-$round.json" > "$OUT/$name-$preset-$round.log" 2>&1
  echo "[$name $preset r$round rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "^bench: bf16|^power|^error" "$OUT/$name-$preset-$round.log" | head -3 >> "$OUT/summary.txt"
}
for r in 1 2 3; do arm main "$MAIN" brats $r 7; arm xf "$XF" brats $r 7; done
for r in 1 2; do arm main "$MAIN" whole-head $r 11; arm xf "$XF" whole-head $r 11; done
MEDDPM_CACHE_DIR=/tmp/cache-xf TRAIN_SECONDS=30 EVAL_SECONDS=60 CONFIGS=fp32/ncdhw,bf16/ndhwc MEDDPM_WGMMA=1 BIN="$XF/meddpm" RES="$OUT/ev" \
  timeout 130 bash scripts/gpu/evalcfg.sh >/dev/null 2>&1
echo "[evalcfg rc=$?]" >> "$OUT/summary.txt"
grep -E "^\| (fp32|bf16)/" "$OUT/ev/eval_configs.md" | head -3 >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
