#!/usr/bin/env bash
# run-records.sh [REV]: the share of tracked text lines at REV that are run records: everything under
# docs/ except the pages written for readers (docs/*.md, docs/perf/{RESULTS,tried,scaling-4-8-gpus-model,loader}.md,
# a short docs/perf/README.md), plus *.patch and *.log elsewhere. The kept results (docs/perf/results/,
# docs/reports/) are counted apart, so "other run records" is what should be 0.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:-HEAD}
git grep -I -c '' $REV -- . | sed "s/^$REV://" | awk -F: '
{ f=$1; n=$NF; all+=n
  page = (f ~ /^docs\/[^\/]+\.md$/) || (f ~ /^docs\/perf\/(RESULTS|tried|scaling-4-8-gpus-model|loader)\.md$/) || (f=="docs/perf/README.md" && n<20)
  if (f ~ /^docs\// && !page) { rec+=n; if (f ~ /^docs\/(reports|perf\/results)\//) cur+=n }
  if (f !~ /^docs\// && f ~ /\.(patch|log)$/) rec+=n }
END { printf "all text lines %d; run records %d (%.1f %%); of which current results/reports %d; other run records %d (%.1f %%)\n", all, rec, 100*rec/all, cur, rec-cur, 100*(rec-cur)/all }'
