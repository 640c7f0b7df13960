#!/usr/bin/env bash
# Whole-head performance study on the GPU machine (issue 4), run by the integration script with
#   BIN = the release `meddpm` binary, RES = the results folder (written here).
# PARTS (env, default "torch-table whole-head torch-ncu") picks the steps below; the whole-head
# profile with matrix counters runs every kernel of four training steps under ncu (minutes).
# Produces on an H200:
#   $RES/profile-whole-head/   CUPTI breakdown of one training + one sampling step, TF32 + NDHWC,
#                              the per-call (synced) view, the 4-configuration matrix (CUPTI times
#                              and ncu totals of every kernel of one training step per configuration),
#                              Nsight Compute counters of the 6 kernels with the most GPU time,
#                              and the PyTorch reference forward (torch.profiler table) as a pass
#   $RES/profile-torch-ncu/    the PyTorch reference forward under ncu (`meddpm profile -- …`)
#   $RES/profile.log           everything printed
# Library choices follow ../shared/docs/gpu-machine.md (cuDNN 9.19 via a private libcudnn.so link).
set -u
: "${BIN:?set BIN to the release meddpm binary}"
: "${RES:?set RES to the results folder}"
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
BIN=$(readlink -f "$BIN")
LOG="$RES/profile.log"
exec > >(tee -a "$LOG") 2>&1
cd "$(dirname "$0")/../.."

SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
LIBD=$(mktemp -d)
ln -sf "$SP/nvidia/cudnn/lib/libcudnn.so.9" "$LIBD/libcudnn.so"
extra=""
for pat in 'libcupti.so*'; do
    f=$(find "$SP/nvidia" /usr/local/cuda/ -name "$pat" 2>/dev/null | head -1)
    [ -n "$f" ] && extra="$extra:$(dirname "$f")"
    echo "profile.sh: $pat -> ${f:-not found}"
done
export LD_LIBRARY_PATH="$LIBD:$SP/nvidia/cu13/lib$extra:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PATH="/usr/local/cuda/bin:$PATH"
export MEDDPM_CACHE_DIR="${MEDDPM_CACHE_DIR:-$RES/cache}"
command -v ncu >/dev/null || echo "profile.sh: ncu not on PATH (the reports will say so)"
t0=$(date +%s)
step() { echo "== $(( $(date +%s) - t0 ))s: $*"; }

PARTS=${PARTS:-torch-table whole-head torch-ncu}
has() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# 1) PyTorch reference: one whole-head forward, in-process torch.profiler table (TF32, NDHWC)
if has torch-table; then
  step "PyTorch reference forward (torch.profiler)"
  timeout 45 python3 tools/reference/profile_torch.py --preset whole-head --table "$RES/torch-whole-head-forward.txt" \
      || echo "profile.sh: torch table failed"
fi
TT=()
[ -s "$RES/torch-whole-head-forward.txt" ] && TT=(--torch-table "$RES/torch-whole-head-forward.txt")

# 2) the whole-head report: CUPTI breakdown (TF32 + NDHWC), matrix, counters of the top 6 kernels.
#    The profile process itself is the warm-up process for ncu: it chooses the cuDNN algorithms
#    (cudnnFind, outside any profiler) and leaves them in the on-disk cache ($MEDDPM_CACHE_DIR)
#    before it re-runs itself under ncu, whose warm-up steps also run outside the profiled range.
if has whole-head; then
step "meddpm whole-head profile"
timeout "${WHOLE_HEAD_TIMEOUT:-540}" "$BIN" profile --device cuda --preset whole-head --math tf32 --layout ndhwc \
    --warmup 1 --repeats 3 --matrix --counters --counters-kernels 6 --ncu-timeout "${NCU_TIMEOUT:-100}" --predict whole-head \
    "${TT[@]}" --out "$RES/profile-whole-head" || echo "profile.sh: whole-head profile failed"
fi

# 3) the PyTorch forward under ncu (durations, cycles, instructions, IPC per kernel)
if has torch-ncu; then
  step "PyTorch reference forward under ncu"
  timeout 75 "$BIN" profile --nvtx-include forward/ --launch-count 400 --out "$RES/profile-torch-ncu" \
      -- python3 tools/reference/profile_torch.py --preset whole-head --warmup 1 \
      || echo "profile.sh: torch under ncu failed"
fi

step "done"
for d in profile-whole-head profile-torch-ncu; do
    [ -f "$RES/$d/report.md" ] && echo "report: $RES/$d/report.md"
done
