#!/usr/bin/env bash
# Re-derive the built-in demo data (testdata/demo/) from the MNI152 template in ../shared/data/mni152.
# The derivation is meddpm::data::demo::derive_from_mni152 (see its docs for every step); this runs it
# through an ignored test so no extra binary is needed. The test suite then checks that the committed
# files equal a fresh derivation (data_demo::committed_demo_equals_a_fresh_derivation).
set -euo pipefail
cd "$(dirname "$0")/../.."
MEDDPM_WRITE_DEMO=1 cargo test -p meddpm --test data_demo -- --ignored --exact write_demo_files
ls -l testdata/demo testdata/demo/mask testdata/demo/image
