#!/usr/bin/env bash
# nvtx_probe.sh: does Nsight Compute see meddpm's NVTX ranges, and which --nvtx-include expressions
# select the kernels of the recorded steps? Runs the tiny preset's ncu child (one training and one
# sampling step inside the range `profile`; full stacks like profile/train/forward/out) under ncu
# with one cheap metric for each expression and prints how many kernels each profiled (at most 30).
# Run by scripts/gpu/run.sh (BIN = meddpm, RES = results). H200, ncu 2025.3.1 (2026-11-30): 30 for
# profile/, profile/*/, profile/train/, train/ and profile/train/forward/ — a range anywhere in
# the stack selects; the child without ncu reports no tool attached.
set -u
: "${BIN:?}" "${RES:?}"
mkdir -p "$RES"
export PATH="/usr/local/cuda/bin:$PATH"
child=("$BIN" profile --device cuda --preset tiny --warmup 1 --repeats 1 --ncu-child)
printf '%-24s %s\n' expression kernels
for expr in "profile/" "profile/*/" "profile/train/" "train/" "profile/train/forward/" "nosuchrange/"; do
  log="$RES/ncu-$(echo "$expr" | tr '/*' '_x').log"
  ncu --clock-control none --metrics gpu__time_duration.sum --nvtx --nvtx-include "$expr" -c 30 "${child[@]}" >"$log" 2>&1
  printf '%-24s %s\n' "$expr" "$(grep -c "==PROF== Profiling" "$log")"
done
grep -h "ncu child" "$RES"/ncu-*.log | sort | uniq -c
# without ncu: the child must say no tool is attached
"${child[@]}" 2>&1 | grep "ncu child"
