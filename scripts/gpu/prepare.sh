#!/usr/bin/env bash
# prepare.sh: build (here, release, stripped) everything the integrated GPU run needs and put it in
# .devbin/all (ignored by git; a device call carries it). Then: scripts/gpu/run.sh PART... there.
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
