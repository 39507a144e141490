#!/usr/bin/env bash
# Run the GPU suite on a CUDA machine from the source tree (nothing installed) and pack the
# records into one archive. Usage: tools/gpu_suite.sh OUTDIR [extra `bp-mech run` args]
# Then, on the book's machine: tar xzf OUTDIR/records.tgz -C book/results && bp-mech results validate
set -uo pipefail
out=${1:?usage: tools/gpu_suite.sh OUTDIR [args]}; shift
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out/records"
python3 -m bp_mech preflight --profile TRAIN-CUDA-MECHANISM | tee "$out/preflight.json"
python3 -m bp_mech run --suite gpu --mode dry_run "$@" > "$out/plan.json"
python3 -m bp_mech run --suite gpu --mode real_gpu --out "$out/records" "$@" 2>&1 | tee "$out/suite.log"
rc=${PIPESTATUS[0]}
python3 -m bp_mech results validate "$out/records" | tee -a "$out/suite.log"
tar czf "$out/records.tgz" -C "$out/records" .
rm -rf "$out/records"
exit "$rc"
