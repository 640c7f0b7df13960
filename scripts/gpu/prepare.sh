#!/usr/bin/env bash
# prepare.sh: build (here, release, stripped) everything the integrated GPU run needs and put it in
# .devbin/all (ignored by git; a device call carries it). Then: scripts/gpu/run.sh PART... there.
# PACK=1 also writes .devbin/all.tar.xz (about a third of the bytes): a call carries that instead
# (the tracked tree plus the carried paths must stay under 64 MiB, and two builds for an A/B do
# not fit unpacked); run.sh and multigpu.sh unpack every .devbin/NAME.tar.xz whose folder is missing
# (pack .devbin/old or .devbin/alt for abbin the same way: tar -C .devbin -cJf .devbin/old.tar.xz old).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.devbin/all}
rm -rf "$DEST" && mkdir -p "$DEST"
cargo build --release -p meddpm-cli
cp target/release/meddpm "$DEST/"
cargo build --release -p meddpm-cuda --examples
for e in doctor bench_primitives; do cp "target/release/examples/$e" "$DEST/"; done
cargo test --release --no-run -p meddpm-cuda --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])
        print("test binary:", m["target"]["name"])
' "$DEST"
strip "$DEST"/* 2>/dev/null || true
du -sh "$DEST"; ls "$DEST"
if [ -n "${PACK:-}" ]; then
  rm -f "$DEST.tar.xz"
  tar -C "$(dirname "$DEST")" -cf - "$(basename "$DEST")" | xz -T0 -6 >"$DEST.tar.xz"
  du -sh "$DEST.tar.xz"
fi
