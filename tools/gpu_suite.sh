#!/usr/bin/env bash
# Run the GPU suite on a CUDA machine from the source tree (nothing installed), in timed phases.
#
#   tools/gpu_suite.sh OUT [--smoke-workload W] [--full | --phases LIST] [-- extra `bp-mech run` args]
#
# Phases (each one a separate call fits a 600-second limit; records are saved as they are made):
#   smoke  every GPU experiment at one small workload (default qwen05-b1s128), run label gpu-smoke
#   full   every GPU experiment at its default workload (the GPU matrix), run label gpu-default
# Default: smoke only. --full: smoke then full. --phases full (or PHASES=full): full only.
#
# Under OUT: preflight.json; per phase dry-run-<phase>.json (its dry run and estimate), <phase>.log,
# records/<phase>/*.json (plain JSON records, validated after the phase); phases.txt (rc and wall time
# of each phase). Exit: 2 when preflight fails (nothing runs), else 1 when a phase failed, else 0.
#
# Environment: PYTHON (default python3); PHASES (as --phases); PHASE_TIMEOUT_S (stop a phase with
# SIGINT after that many seconds, so a call limit never kills the validation; default none);
# BP_MECH_SUITE_MODE=dry_run (a dry run instead of running: the whole script without CUDA, for tests).
# Sets HF_HUB_OFFLINE=1 (pretrained weights come from the local cache or not at all), PYTHONPATH=src
# and BP_MECH_GIT_COMMIT (git rev-parse HEAD, else the file GIT_COMMIT at the repo root, else unset: null in the records).
# Then, on the book's machine: cp OUT/records/full/*.json book/results/ && bp-mech results validate
set -uo pipefail

usage() { echo "usage: tools/gpu_suite.sh OUT [--smoke-workload W] [--full | --phases smoke,full] [-- run args]" >&2; exit 2; }
[ $# -ge 1 ] || usage
out=$1; shift
smoke_workload=qwen05-b1s128
phases=${PHASES:-smoke}
extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --smoke-workload) [ $# -ge 2 ] || usage; smoke_workload=$2; shift 2 ;;
    --full) phases="smoke full"; shift ;;
    --phases) [ $# -ge 2 ] || usage; phases=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) usage ;;
  esac
done
phases=${phases//,/ }
for p in $phases; do case $p in smoke|full) ;; *) echo "gpu_suite: unknown phase '$p' (smoke, full)" >&2; exit 2 ;; esac; done

mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the commands below run from the repo root
cd "$(dirname "$0")/.." || exit 2
py=${PYTHON:-python3}
mode=real_gpu
[ "${BP_MECH_SUITE_MODE:-}" = dry_run ] && mode=dry_run

commit=$(git rev-parse HEAD 2>/dev/null) || commit=
[ -z "$commit" ] && [ -f GIT_COMMIT ] && commit=$(tr -d '[:space:]' < GIT_COMMIT)
export HF_HUB_OFFLINE=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TQDM_DISABLE=${TQDM_DISABLE:-1}
if [ -n "$commit" ]; then export BP_MECH_GIT_COMMIT=$commit; else unset BP_MECH_GIT_COMMIT; fi  # none: null in records
echo "gpu_suite: phases '$phases', mode $mode, commit ${commit:-none known}, python $py, out $out"

"$py" -m bp_mech preflight --profile TRAIN-CUDA-MECHANISM > "$out/preflight.json"
rc=$?
cat "$out/preflight.json"
if [ $rc -ne 0 ]; then
  echo "gpu_suite: preflight failed (rc $rc, see $out/preflight.json); nothing run" >&2
  exit 2
fi

limit=()
[ -n "${PHASE_TIMEOUT_S:-}" ] && limit=(timeout -s INT -k 30 "$PHASE_TIMEOUT_S")
status=0
for phase in $phases; do
  if [ "$phase" = smoke ]; then args=(--workload "$smoke_workload" --run-label gpu-smoke --smoke); else args=(); fi
  records=$out/records/$phase log=$out/$phase.log
  mkdir -p "$records"
  "$py" -m bp_mech run --suite gpu --mode dry_run "${args[@]}" "${extra[@]}" > "$out/dry-run-$phase.json" 2> "$log"
  prc=$?
  tail -n 1 "$log"  # the dry run's summary line: the estimate of this phase (or why there is none)
  echo "== phase $phase: start $(date -u +%FT%TZ)" | tee -a "$log"
  start=$SECONDS
  "${limit[@]}" "$py" -m bp_mech run --suite gpu --mode "$mode" "${args[@]}" --out "$records" "${extra[@]}" 2>&1 \
    | tee -a "$log"
  rc=${PIPESTATUS[0]}
  wall=$((SECONDS - start))
  "$py" -m bp_mech results validate "$records" 2>&1 | tee -a "$log"
  vrc=${PIPESTATUS[0]}
  n=$(find "$records" -name '*.json' | wc -l)
  echo "== phase $phase: dry run rc $prc, rc $rc, validate rc $vrc, $n record(s), wall $wall s, end $(date -u +%FT%TZ)" \
    | tee -a "$log" "$out/phases.txt"
  [ $rc -ne 0 ] || [ $vrc -ne 0 ] && status=1
done
exit $status
