#!/usr/bin/env bash
# The Python package (crates/meddpm-py): build its abi3 wheel with maturin, install it into a
# virtual environment, run its pytest suite on the CPU. Called by .ci/run; runs alone too.
# Installs from PyPI: maturin, numpy, nibabel, pytest. torch and MONAI are not installed (torch's
# Linux wheel is 539 MB and pulls the CUDA wheels, GBs): the MONAI example's test skips, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
venv=target/py-venv
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "maturin>=1.7,<2" numpy nibabel pytest
# The workspace's target folder: the engine's dependencies built by `cargo test --release` are reused.
export CARGO_TARGET_DIR="$PWD/target"
rm -rf target/wheels
"$venv/bin/maturin" build --release --strip -m crates/meddpm-py/Cargo.toml --out target/wheels
ls -l target/wheels
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps target/wheels/meddpm-*.whl
# From another folder, so that `import meddpm` finds the installed wheel, not the source tree.
(cd crates/meddpm-py/tests && "$OLDPWD/$venv/bin/python" -m pytest -q -rs .)
echo "python package: wheel built and tested in $(( $(date +%s) - start )) s"
