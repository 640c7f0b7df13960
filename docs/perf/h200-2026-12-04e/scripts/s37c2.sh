# s37 call 2: ex2 (output statistics on the producer, default on; DIAG_YPOFF = the old epilogue):
# parity tests, then BraTS bf16 NDHWC bench arms alternated
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
BIN_DIR=.devbin/${BINNAME:-ex2} source scripts/gpu/bins.sh
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBDIR=$(mktemp -d)/lib; mkdir -p "$LIBDIR"
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBDIR/libcudnn.so"
export LD_LIBRARY_PATH="$LIBDIR:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
if [ -n "${TESTS-wgmma_gn_conv_bf16_parity unet_epilogue_stats_feed_the_next_layer unet_wgmma_gn_fused_matches_two_calls cat_free_bf16_parity}" ]; then
  t0=$(date +%s)
  CUDA_MODULE_LOADING=EAGER MEDDPM_CACHE_DIR=/tmp/cache-yp timeout 240 "$BIN/parity_bf16" --test-threads=1 \
    ${TESTS-wgmma_gn_conv_bf16_parity unet_epilogue_stats_feed_the_next_layer unet_wgmma_gn_fused_matches_two_calls cat_free_bf16_parity} > "$OUT/tests.log" 2>&1
  echo "[tests rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "^test |test result|panicked|FAILED|error" "$OUT/tests.log" | head -20 >> "$OUT/summary.txt"
fi
arm() {
  local name=$1 defs=$2 round=$3 preset=${PRESET:-brats}
  local t0=$(date +%s)
  MEDDPM_CONV_LOG=${CONVLOG:-0} MEDDPM_DIAG_DEFS=$defs MEDDPM_CACHE_DIR=/tmp/cache-$name timeout 300 "$BIN/meddpm" bench --device cuda --preset $preset \
    --precision bf16 --layout ndhwc --iters ${ITERS:-7} --json "$OUT/$name-$preset-$round.json" > "$OUT/$name-$preset-$round.log" 2>&1
  echo "[$name $preset r$round defs=$defs rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "^bench|^power|^error" "$OUT/$name-$preset-$round.log" | head -8 >> "$OUT/summary.txt"
}
CONVLOG=1
for a in ${ARMS:-ypoff:YPOFF yp: ypxg:XF2,GB2}; do arm "${a%%:*}" "${a#*:}" 1; done
CONVLOG=0
for a in ${ARMS2:-ypoff:YPOFF yp:}; do arm "${a%%:*}" "${a#*:}" 2; done
cat "$OUT/summary.txt"
