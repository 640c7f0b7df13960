# s38 call 1: ex5 = main + MEDDPM_DIAG_DEFS (diag-early-and-fragment-groups.patch + DIAG_FT, the taps
# in the fragment ring). Queue depth at each wgmma fence: GW groups in flight after the wait.
#   base: FT=3 GW=1 (main)   w2: FT=3 GW=2 (= next-two-taps-in-flight.patch)
#   f4w3: FT=4 GW=3          f4w2: FT=4 GW=2 (loads two taps ahead, two taps queued)
# Also dumps the SASS of the plain wgmma convs per arm (which scoreboard WARPGROUP.ARRIVE waits on).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"; L=/tmp/logs; mkdir -p $L
BIN_DIR=.devbin/${BINNAME:-ex5} source scripts/gpu/bins.sh
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBDIR=$(mktemp -d)/lib; mkdir -p "$LIBDIR"
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBDIR/libcudnn.so"
export LD_LIBRARY_PATH="$LIBDIR:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
ARMS=${ARMS:-base: w2:GW=2 f4w3:FT=4,GW=3 f4w2:FT=4,GW=2}
TESTS=${TESTS:-wgmma_conv_bf16_parity wgmma_gn_conv_bf16_parity wgmma_dgrad_gn_bf16_parity}
# tests per arm (they compile the arm's kernels into the arm's cache, which the benches then reuse)
for a in $ARMS; do
  name=${a%%:*}; defs=${a#*:}; t0=$(date +%s)
  MEDDPM_DIAG_DEFS=$defs CUDA_MODULE_LOADING=EAGER MEDDPM_CACHE_DIR=/tmp/cache-$name timeout 240 "$BIN/parity_bf16" --test-threads=1 $TESTS > $L/tests-$name.log 2>&1
  echo "[tests $name defs=$defs rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "test result|panicked|FAILED" $L/tests-$name.log | head -5 >> "$OUT/summary.txt"
  for f in /tmp/cache-$name/kernels-*.cubin; do cuobjdump -sass "$f" 2>/dev/null; done \
    | awk '/Function : /{p = ($3 ~ /^conv3d_wgmma_(fwd|dgrad)$/)} p' | gzip > "$L/sass-$name.txt.gz"
done
arm() {
  local name=$1 defs=$2 preset=$3 round=$4 iters=$5
  local t0=$(date +%s)
  MEDDPM_DIAG_DEFS=$defs MEDDPM_CACHE_DIR=/tmp/cache-$name timeout 200 "$BIN/meddpm" bench --device cuda --preset $preset \
    --precision bf16 --layout ndhwc --iters $iters --json "$L/$name-$preset-$round.json" > "$L/$name-$preset-$round.log" 2>&1
  echo "[$name $preset r$round defs=$defs rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "^bench: bf16|^error" "$L/$name-$preset-$round.log" | head -3 >> "$OUT/summary.txt"
}
for r in 1 2 3; do for a in $ARMS; do arm "${a%%:*}" "${a#*:}" brats $r 7; done; done
for r in 1 2; do for a in $ARMS; do arm "${a%%:*}" "${a#*:}" whole-head $r 11; done; done
tar -C /tmp -czf "$OUT/logs.tar.gz" logs
echo "== table (train ms / fwd ms)" >> "$OUT/summary.txt"
for a in $ARMS; do n=${a%%:*}; for p in brats whole-head; do
  echo "$n $p: $(grep -h '^bench: bf16' $L/$n-$p-*.log | sed -E 's/.*fwd ([0-9.]+) ms, train ([0-9.]+) ms.*/\2\/\1/' | tr '\n' ' ')" >> "$OUT/summary.txt"
done; done
cat "$OUT/summary.txt"
