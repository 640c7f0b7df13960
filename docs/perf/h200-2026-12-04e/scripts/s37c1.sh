# s37 call 1: diag build ex1, BraTS bf16 NDHWC bench arms (MEDDPM_DIAG_DEFS), alternated twice
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
BIN_DIR=.devbin/ex1 source scripts/gpu/bins.sh
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBDIR=$(mktemp -d)/lib; mkdir -p "$LIBDIR"
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBDIR/libcudnn.so"
export LD_LIBRARY_PATH="$LIBDIR:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
arm() {
  local name=$1 defs=$2 round=$3
  local t0=$(date +%s)
  MEDDPM_CONV_LOG=${CONVLOG:-0} MEDDPM_DIAG_DEFS=$defs MEDDPM_CACHE_DIR=/tmp/cache-$name timeout 300 "$BIN/meddpm" bench --device cuda --preset brats \
    --precision bf16 --layout ndhwc --iters 7 --json "$OUT/$name-$round.json" > "$OUT/$name-$round.log" 2>&1
  echo "[$name r$round defs=$defs rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "train|forward|power" "$OUT/$name-$round.log" | grep -v "^\s*$" | head -8 >> "$OUT/summary.txt"
}
CONVLOG=1
for a in ${ARMS:-base: noe2:NOE2 nost:NOST xg:XF2,GB2 pf2:PF,PFD=2}; do arm "${a%%:*}" "${a#*:}" ${ROUND:-1}; done
for d in /tmp/cache-*; do mkdir -p "$OUT/caches"; tar -C /tmp -czf "$OUT/caches/$(basename $d).tgz" "$(basename $d)"; done
du -sh "$OUT/caches"
cat "$OUT/summary.txt"
