#!/usr/bin/env bash
# prepare-old.sh REV: build commit REV's binaries (as prepare.sh builds this tree's) into
# .devbin/old, for run.sh's abbin part: the same benchmarks alternated between REV and this tree in
# one GPU call. A refactor's before/after check, e.g.
#   scripts/gpu/prepare-old.sh b4b2af7 && PACK=1 scripts/gpu/prepare.sh && tar -C .devbin -cJf .devbin/old.tar.xz old
#   (GPU machine) AB_PRECISIONS="bf16 tf32" scripts/gpu/run.sh check abbin evalcfg
# The build runs in a temporary worktree with its own target folder (a full build, a few minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
REV=${1:?usage: prepare-old.sh REV}
ROOT=$PWD
WT=$(mktemp -d)/old
git worktree add --detach "$WT" "$REV"
trap 'git -C "$ROOT" worktree remove --force "$WT"' EXIT
(cd "$WT" && scripts/gpu/prepare.sh "$ROOT/.devbin/old")
