#!/usr/bin/env bash
# run.sh PART...: the project's integrated GPU run, on the GPU machine, from the repository root.
# Binaries come from scripts/gpu/prepare.sh (.devbin/all). Parts:
#   check    doctor (its kernel compile), parity tests (every primitive, both layouts, every
#            precision), the PyTorch golden files on the GPU; with PRIMITIVES=1 the primitive
#            micro-benchmarks. The GPU tests are #[ignore]d (a plain `cargo test` without a GPU
#            reports them as ignored): their binaries run here with --include-ignored
#   bench    meddpm bench: whole-head train step / sampling forward / 250-step volume, 4 configs,
#            PyTorch side by side
#   torch    full-size .pt import: PyTorch vs meddpm forward (scripts/gpu/torch_full.sh)
#   evalcfg  train the demo on the GPU, sample under every precision × layout, quality verdicts
#   profile  CUPTI kernel breakdown, optimization matrix, ncu counters, PyTorch comparison
#   ab       A/B of the overlapped input (bench --no-overlap) and of the few-channel convs
#            (MEDDPM_SMALL_CONV=1 vs auto), whole-head, alternated in one call
#   abmma    A/B of the tensor-core few-channel convs (MEDDPM_SMALL_MMA=1 vs 0), whole-head bf16
#            NDHWC, alternated twice
#   abbin    A/B of two builds, .devbin/old (scripts/gpu/prepare-old.sh REV) vs .devbin/all (and
#            .devbin/alt, a third variant, when present): whole-head bench in each precision of
#            $AB_PRECISIONS (default bf16) and BraTS bf16, NDHWC, alternated twice
#   abenv    A/B of one build with $AB_ENV set (e.g. MEDDPM_WGMMA=0, a kept switch of docs/kernel-choices.md)
#            against the default: whole-head and BraTS bench, bf16 NDHWC, alternated twice
#   brats    meddpm bench of the BraTS preset, bf16 NDHWC
#   nvtx     how ncu's --nvtx-include selects the kernels of meddpm's NVTX ranges (tiny preset)
#   study    scripts/gpu/study.sh $STUDY (demo model, sampler study, whole-head 20-step timing, BraTS)
#   study64  scripts/gpu/study64.sh $STUDY64 (default: all parts): 64³ data from testdata/mni64 +
#            `meddpm masks`, a 64³ model trained for 5 min in bf16, the sampler study on it, batch 4
#            vs batch 1 volumes/s (~8–9 min; $OUT/study64.tar.gz holds docs/ for docs/reports/sampler-study)
#   ncu      Nsight Compute (--set full) on the kernels matching $NCU_KERNELS (regex), the first
#            $NCU_COUNT (default 4) launches, over one whole-head bf16 NDHWC bench step without
#            graphs ($NCU_ENV: extra environment, e.g. MEDDPM_SMALL_CONV=0); details page as CSV, the
#            per-SASS-instruction source page and the raw stall and tensor-pipe counters
#   quick    a fused path's check in about two minutes: the parity_bf16 tests named in $TESTS
#            (default: the fused-conv and U-Net ones, run with --include-ignored), then
#            whole-head bf16 NDHWC bench alternated twice with $AB_ENV set (e.g.
#            MEDDPM_SMALL_MMA=0) and without, then eval-configs shortened to 30 s of training,
#            fp32/ncdhw against bf16/ndhwc with MEDDPM_WGMMA=1 (the quality verdict)
#   synth    meddpm synthesize of whole-head pairs (initial whole-head weights: the time does not
#            depend on them; masks: $SYNTH_MASK, default .devbin/synth/mask.nii.gz, with --augment
#            3), nnU-Net layout, DDPM-50 ($SYNTH_COUNT50 pairs, default 100) then DDPM-250
#            ($SYNTH_COUNT250, default 12), precision $SYNTH_PREC (default bf16), batch $SYNTH_BATCH
#            (default 1): volumes per hour from each run's summary line
#   prof     the CUPTI breakdown of one training and sampling step for each preset in PROF_PRESETS
#            (default whole-head) and precision in PROF_MATH (default bf16), layout PROF_LAYOUT
#            (default ndhwc), no counters
#            (a minute each)
# BENCH_ARGS (default --torch) are extra arguments of the bench part.
# Each part writes $OUT/<part>.tar.gz (its full results) and one line to $OUT/summary.txt.
set -uo pipefail
source scripts/gpu/bins.sh  # BIN (packed builds unpacked first)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
source scripts/gpu/libs.sh  # SP, LD_LIBRARY_PATH (cuDNN 9.19 first: the cuDNN trap)
# The compiled kernels and cudnnFind choices persist between calls when .devbin/cache is carried
# back in (it is copied to $OUT/cache at the end).
export MEDDPM_CACHE_DIR=${MEDDPM_CACHE_DIR:-$PWD/.devbin/cache}
mkdir -p "$MEDDPM_CACHE_DIR"
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
for part in "$@"; do
  RES="$OUT/$part"
  mkdir -p "$RES"
  t0=$(date +%s)
  case $part in
    check)
      "$BIN/doctor" >"$RES/doctor.log" 2>&1; grep -E "cuDNN|driver|device 0" "$RES/doctor.log"
      # one thread and every module loaded up front: a graph capture on one test thread was
      # invalidated (CUDA error 901) by work on another, most likely a lazily loaded module;
      # benches keep lazy loading (EAGER ran them ~5 % slow)
      for t in parity parity_bf16 golden; do
        CUDA_MODULE_LOADING=EAGER timeout 300 "$BIN/$t" --include-ignored --nocapture --test-threads=1 >"$RES/$t.log" 2>&1
        echo "$t: exit $?"; grep -E "^test |test result|NOT OK|panicked" "$RES/$t.log" | tail -25
      done
      if [ -n "${PRIMITIVES:-}" ]; then timeout 240 "$BIN/bench_primitives" "$RES" 5 >"$RES/bench_primitives.log" 2>&1; fi ;;
    bench)
      "$BIN/meddpm" bench --device cuda --preset whole-head --json "$RES/bench.json" ${BENCH_ARGS---torch} ;;
    ab)
      # A/B switches in one call, alternated twice: overlapped input on/off (whole-head bf16
      # NDHWC), then the few-channel convs always ours / timed per shape (bf16 and TF32)
      for i in 1 2; do for f in "" --no-overlap; do
        "$BIN/meddpm" bench --device cuda --preset whole-head --precision bf16 --layout ndhwc --iters 9 $f 2>&1 \
          | grep -E '^cuda:0' | sed "s/^/[overlap ${f:-on}] /"
      done; done
      for v in 1 auto; do
        MEDDPM_SMALL_CONV=$v "$BIN/meddpm" bench --device cuda --preset whole-head --precision bf16,tf32 --layout ndhwc \
          --iters 7 --json "$RES/small-$v.json" 2>&1 | grep -E '^cuda:0' | sed "s/^/[small conv $v] /"
      done ;;
    abmma)
      for i in 1 2; do for v in 1 0; do
        MEDDPM_SMALL_MMA=$v "$BIN/meddpm" bench --device cuda --preset whole-head --precision bf16 --layout ndhwc \
          --iters 7 2>&1 | grep -E '^cuda:0' | sed "s/^/[small mma $v] /"
      done; done ;;
    abbin)
      # A/B of two builds: .devbin/old (scripts/gpu/prepare-old.sh REV builds it) against this
      # one, whole-head in each precision of $AB_PRECISIONS (default bf16), then BraTS bf16, NDHWC,
      # alternated twice
      BUILDS="old all$([ -x "$(dirname "$BIN")/alt/meddpm" ] && echo " alt")"
      for prec in ${AB_PRECISIONS:-bf16}; do for i in 1 2; do for b in $BUILDS; do
        "$(dirname "$BIN")/$b/meddpm" bench --device cuda --preset whole-head --precision $prec --layout ndhwc \
          --iters 9 2>&1 | grep -E '^cuda:0' | sed "s/^/[whole-head $prec $b] /"
      done; done; done
      for i in 1 2; do for b in $BUILDS; do
        "$(dirname "$BIN")/$b/meddpm" bench --device cuda --preset brats --precision bf16 --layout ndhwc \
          --iters 5 --warmup 2 2>&1 | grep -E '^cuda:0' | sed "s/^/[brats $b] /"
      done; done ;;
    abenv)
      # the default (all) against the same build with $AB_ENV set (env), alternated twice
      for preset in whole-head brats; do
        it=$([ $preset = brats ] && echo "--iters 5 --warmup 2" || echo "--iters 9")
        for i in 1 2; do for e in all env; do
          env $([ $e = env ] && echo "${AB_ENV:?}") "$BIN/meddpm" bench --device cuda --preset $preset \
            --precision bf16 --layout ndhwc $it 2>&1 | grep -E '^cuda:0' | sed "s/^/[$preset $e] /"
        done; done
      done ;;
    quick)
      tests=${TESTS:-wgmma_gn_conv_bf16_parity cat_free_bf16_parity gn_head_bf16_parity unet_}
      CUDA_MODULE_LOADING=EAGER timeout 150 "$BIN/parity_bf16" --include-ignored --test-threads 1 --nocapture $tests \
        >"$RES/parity_bf16.log" 2>&1
      echo "parity_bf16 ($tests): exit $?"; grep -E "^test |test result|panicked|rel L2|skipped" "$RES/parity_bf16.log"
      for i in 1 2; do for e in env all; do
        env $([ $e = env ] && echo "${AB_ENV:?set AB_ENV, e.g. MEDDPM_WGMMA=0}") timeout 70 "$BIN/meddpm" bench \
          --device cuda --preset whole-head --precision bf16 --layout ndhwc --iters 9 2>&1 | grep -E '^cuda:0' \
          | sed "s/^/[whole-head $([ $e = env ] && echo "$AB_ENV" || echo default)] /"
      done; done
      TRAIN_SECONDS=30 EVAL_SECONDS=60 CONFIGS=fp32/ncdhw,bf16/ndhwc MEDDPM_WGMMA=1 BIN="$BIN/meddpm" RES="$RES/ev" \
        timeout 110 bash scripts/gpu/evalcfg.sh >/dev/null 2>&1
      grep -E "^\| (fp32|bf16)/" "$RES/ev/eval_configs.md" | head -2 ;;
    brats)
      "$BIN/meddpm" bench --device cuda --preset brats --precision bf16 --layout ndhwc --iters 7 --warmup 2 \
        --json "$RES/bench-brats.json" 2>&1 | grep -E '^cuda:0|^device' ;;
    synth)
      W=$(mktemp -d /tmp/synth.XXXXXX)
      "$BIN/meddpm" train --device cuda --preset whole-head --steps 0 --no-sample --out "$W/wh" >"$RES/init.log" 2>&1 \
        || { echo "whole-head init failed"; tail -5 "$RES/init.log"; }
      for steps in 50 250; do
        n=$([ $steps = 50 ] && echo "${SYNTH_COUNT50:-100}" || echo "${SYNTH_COUNT250:-12}")
        /usr/bin/time -f "wall %e s, max RSS %M KiB" "$BIN/meddpm" synthesize --device cuda --precision "${SYNTH_PREC:-bf16}" \
          --checkpoint "$W/wh/checkpoint.safetensors" --masks "${SYNTH_MASK:-.devbin/synth/mask.nii.gz}" --augment 3 \
          --count "$n" --sampler ddpm --steps $steps --batch "${SYNTH_BATCH:-1}" --format nnunet --out "$W/ddpm$steps" \
          >"$RES/ddpm$steps.log" 2>&1
        echo "DDPM-$steps, $n pairs: exit $?"; grep -vE '^\s*$' "$RES/ddpm$steps.log" | grep -v '\r' | tail -4
        cp "$W"/ddpm$steps/Dataset*/meddpm_manifest*.jsonl "$RES/manifest$steps.jsonl" 2>/dev/null
        ls "$W"/ddpm$steps/Dataset*/imagesTr | wc -l | sed 's/^/images written: /'
      done
      rm -rf "$W" ;;
    nvtx)    BIN="$BIN/meddpm" RES="$RES" bash scripts/gpu/nvtx_probe.sh ;;
    torch)   TEST_BIN="$BIN/torch_full" BIN="$BIN/meddpm" RES="$RES" bash scripts/gpu/torch_full.sh ;;
    evalcfg) BIN="$BIN/meddpm" BIN_DIR="$BIN" RES="$RES" bash scripts/gpu/evalcfg.sh ;;
    profile) BIN="$BIN/meddpm" BIN_DIR="$BIN" RES="$RES" bash scripts/gpu/profile.sh ;;
    study)   BIN="$BIN/meddpm" OUT="$RES" bash scripts/gpu/study.sh ${STUDY:-demo samplers wholehead brats} ;;
    study64) BIN="$BIN/meddpm" RES="$RES" bash scripts/gpu/study64.sh ${STUDY64:-} ;;
    ncu)
      env ${NCU_ENV:-} ncu -k "regex:${NCU_KERNELS:?}" -c "${NCU_COUNT:-4}" --set full -o "$RES/ncu" \
        "$BIN/meddpm" bench --device cuda --preset whole-head --precision bf16 --layout ndhwc --iters 1 \
        --warmup 0 --no-graphs 2>&1 | grep -vE '^==PROF==' | tail -5
      ncu --import "$RES/ncu.ncu-rep" --page details --csv >"$RES/details.csv"
      # per-SASS-instruction samples (where the warps stall) and the raw stall counters
      ncu --import "$RES/ncu.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$RES/source-sass.csv.gz"
      ncu --import "$RES/ncu.ncu-rep" --page raw --csv 2>/dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
keep = [i for i, n in enumerate(rows[0]) if i < 12 or "stall" in n or "pipe_tensor" in n or "inst_executed" in n]
csv.writer(sys.stdout).writerows([[r[i] for i in keep if i < len(r)] for r in rows])' >"$RES/raw-stalls.csv"
      ncu --import "$RES/ncu.ncu-rep" --page details --csv 2>/dev/null | python3 -c '
import csv, sys
rows = list(csv.DictReader(sys.stdin))
want = ("Duration", "Registers Per Thread", "Achieved Occupancy", "Memory Throughput", "DRAM Throughput",
        "Compute (SM) Throughput", "Issue Slots Busy", "L1/TEX Hit Rate")
seen = {}
for r in rows:
    if r["Metric Name"] in want:
        seen.setdefault((r["ID"], r["Kernel Name"][:40]), {})[r["Metric Name"]] = r["Metric Value"] + " " + r["Metric Unit"]
for (i, k), m in seen.items():
    print(i, k, "|", "; ".join(f"{n}: {m.get(n, "-")}" for n in want))' ;;
    prof)
      CUPTI=$(dirname "$(find "$SP/nvidia" /usr/local/cuda/ -name 'libcupti.so*' 2>/dev/null | head -1)")
      for p in ${PROF_PRESETS:-whole-head}; do for m in ${PROF_MATH:-bf16}; do
        LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$CUPTI" timeout 300 "$BIN/meddpm" profile --device cuda --preset "$p" \
          --math "$m" --layout "${PROF_LAYOUT:-ndhwc}" --warmup 1 --repeats 3 --out "$RES/$p-$m-${PROF_LAYOUT:-ndhwc}"
        grep -A16 "### By category" "$RES/$p-$m-${PROF_LAYOUT:-ndhwc}/report.md" | head -18
      done; done ;;
    *) echo "unknown part $part" ;;
  esac >"$RES/console.log" 2>&1
  rc=$?
  echo "== $part: exit $rc, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  tail -n 30 "$RES/console.log"
  # ncu report files (.ncu-rep) stay behind: their CSV exports come back, and they pass 16 MiB
  tar czf "$OUT/$part.tar.gz" --exclude="*.ncu-rep" -C "$OUT" "$part" && rm -rf "$RES"
  ls -la "$OUT/$part.tar.gz"
done
mkdir -p "$OUT/cache" && cp -r "$MEDDPM_CACHE_DIR"/. "$OUT/cache/" 2>/dev/null
