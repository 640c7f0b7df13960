#!/usr/bin/env bash
# gpu-prepare.sh: build the CUDA backend's test and benchmark binaries and the release `meddpm`
# command here (release, stripped) and put them with gpu-check.sh and the PyTorch bench script
# (tools/reference/bench_torch.py + medddpm_ref.py, for `meddpm bench --torch --torch-script
# DEST/bench_torch.py`) into DEST (default /work/main/.devbin/cuda, the ignored folder a GPU run
# carries). Then on the GPU machine: `bash .devbin/cuda/gpu-check.sh`.
set -euo pipefail
DEST=${1:-/work/main/.devbin/cuda}
cd "$(dirname "$0")/.."
mkdir -p "$DEST"
cargo test --release --no-run -p meddpm-cuda --message-format=json 2>/dev/null |
  python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("parity", "kernels_compile"):
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])
        print("copied", m["target"]["name"])
' "$DEST"
cargo build --release -p meddpm-cuda --examples
cp target/release/examples/doctor target/release/examples/bench_primitives "$DEST/"
cargo build --release -p meddpm-cli
cp target/release/meddpm "$DEST/"
cp scripts/gpu-check.sh tools/reference/bench_torch.py tools/reference/medddpm_ref.py "$DEST/"
strip "$DEST"/parity "$DEST"/kernels_compile "$DEST"/doctor "$DEST"/bench_primitives "$DEST"/meddpm
ls -la "$DEST"
du -sh "$DEST"
