# s38 call 3: ex7 = branch ring38 (WmRing: plain kernels GK = 9, RG = 2; fused GK = 6, RG = 2) +
# MEDDPM_DIAG_DEFS overrides (DIAG_PGK/PR for the plain kernels' ring, DIAG_FGK/FR for the fused).
#   base: 4x3 everywhere (main's loop)   a62: 6x2 everywhere (call 2's k6r2)   cand: the branch
# The whole parity_bf16 suite on cand and a62; benches alternated; then CUPTI profiles of the faster.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"; L=/tmp/logs; mkdir -p $L
BIN_DIR=.devbin/${BINNAME:-ex7} source scripts/gpu/bins.sh
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBDIR=$(mktemp -d)/lib; mkdir -p "$LIBDIR"
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBDIR/libcudnn.so"
export LD_LIBRARY_PATH="$LIBDIR:$SP/nvidia/cudnn/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
ARMS=${ARMS:-base:PGK=4,PR=3,FGK=4,FR=3 a62:PGK=6,PR=2 cand:}
TESTARMS=${TESTARMS:-a62 cand}
for a in $ARMS; do
  name=${a%%:*}; defs=${a#*:}
  case " $TESTARMS " in *" $name "*) ;; *) continue ;; esac
  t0=$(date +%s)
  MEDDPM_DIAG_DEFS=$defs CUDA_MODULE_LOADING=EAGER MEDDPM_CACHE_DIR=/tmp/cache-$name timeout 300 "$BIN/parity_bf16" --test-threads=1 > $L/tests-$name.log 2>&1
  echo "[parity_bf16 $name defs=$defs rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "test result|panicked|FAILED" $L/tests-$name.log | head -5 >> "$OUT/summary.txt"
done
arm() {
  local name=$1 defs=$2 preset=$3 round=$4 iters=$5
  local t0=$(date +%s)
  MEDDPM_DIAG_DEFS=$defs MEDDPM_CACHE_DIR=/tmp/cache-$name timeout 200 "$BIN/meddpm" bench --device cuda --preset $preset \
    --precision bf16 --layout ndhwc --iters $iters --json "$L/$name-$preset-$round.json" > "$L/$name-$preset-$round.log" 2>&1
  echo "[$name $preset r$round defs=$defs rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "^bench: bf16|^error" "$L/$name-$preset-$round.log" | head -3 >> "$OUT/summary.txt"
}
for r in ${BRATS_ROUNDS:-1 2 3}; do for a in $ARMS; do arm "${a%%:*}" "${a#*:}" brats $r 7; done; done
for r in ${WH_ROUNDS:-1 2}; do for a in $ARMS; do arm "${a%%:*}" "${a#*:}" whole-head $r 11; done; done
for a in $ARMS; do
  n=${a%%:*}
  for f in /tmp/cache-$n/kernels-*.cubin; do cuobjdump -sass "$f" 2>/dev/null; done \
    | awk '/Function :/{f=$3} /LDL|STL/{c[f]++} END{s=""; for (k in c) s=s" "k":"c[k]; print "  spills '"$n"':" (s==""?" none":s)}' >> "$OUT/summary.txt"
done
echo "== table (train ms / fwd ms)" >> "$OUT/summary.txt"
best=; bm=1e9
for a in $ARMS; do n=${a%%:*}; for p in brats whole-head; do
  echo "$n $p: $(grep -h '^bench: bf16' $L/$n-$p-*.log | sed -E 's/.*fwd ([0-9.]+) ms, train ([0-9.]+) ms.*/\2\/\1/' | tr '\n' ' ')" >> "$OUT/summary.txt"
done
  [ "$n" = base ] && continue
  m=$(grep -h '^bench: bf16' $L/$n-brats-*.log | sed -E 's/.*train ([0-9.]+) ms.*/\1/' | sort -n | sed -n 2p)
  if python3 -c "import sys; sys.exit(0 if $m < $bm else 1)"; then best=$a; bm=$m; fi
done
echo "profiles: ${best%%:*} (BraTS median $bm ms)" >> "$OUT/summary.txt"
CUPTI=$(dirname "$(find "$SP/nvidia" /usr/local/cuda/ -name 'libcupti.so*' 2>/dev/null | head -1)")
for p in ${PROF_PRESETS-brats whole-head}; do
  t0=$(date +%s)
  MEDDPM_DIAG_DEFS=${best#*:} MEDDPM_CACHE_DIR=/tmp/cache-${best%%:*} LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$CUPTI" timeout 200 \
    "$BIN/meddpm" profile --device cuda --preset $p --math bf16 --layout ndhwc --warmup 1 --repeats 3 --out /tmp/prof/$p > $L/prof-$p.log 2>&1
  echo "[profile $p rc=$? $(( $(date +%s) - t0 )) s]" >> "$OUT/summary.txt"
  grep -E "^\| (train step|sampling step)" /tmp/prof/$p/report.md | head -4 | cut -c1-200 >> "$OUT/summary.txt"
done
tar -C /tmp -czf "$OUT/logs.tar.gz" logs
tar -C /tmp/prof -czf "$OUT/prof.tar.gz" --exclude='*.json' .
cat "$OUT/summary.txt"
