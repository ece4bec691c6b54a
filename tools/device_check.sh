#!/usr/bin/env bash
# The one device run of issue 45: this tree against the baseline (37a736d) on one GPU, in one go
# of about 9 minutes, the most important figures first. Prepare it here with
# `bash tools/device_prepare.sh` (the baseline tree in .device/baseline, the missing wheels in
# .whl), then on the device: command `bash tools/device_check.sh`, carry [".whl", ".device"].
#
#   bash tools/device_check.sh              # on the device machine; writes under $OUT (else exp/device_check)
#   bash tools/device_check.sh --dry-run    # here: every part on the CPU with conf/tiny.yaml, tiny sizes
#                                           # (the parts' limits x3, the budget 1,800 s: a shared CPU)
#
# One harness for both trees: this tree's tools/gpu_check.py drives each tree's own `asr` package
# (PYTHONPATH puts the tree measured first; gpu_check prints and records which folder it imported).
# The same batches (same seed), the same step (the trainer's optimizer, clipping and one host sync),
# the same FLOP count; what differs is the model and search code. Why not the baseline's own
# tools/gpu_check.py: it reuses ~26 batches (flattering cuDNN's per-shape plans, which are the very
# cost at issue), counts the Conformer's FLOPs short and has no profile, so its figures would not
# compare. Why not each tree's real trainer: its API changed between the trees (37a736d's
# make_run(config, model, tokenizer, ...) against Run / State / Task now) and it needs audio, a
# tokenizer and a loader; the trainer's own costs (host-to-device copies, loader, validation) are
# measured by the recipe's stage 4 on real audio instead.
#
# Parts, each with its own time limit and all within BUDGET seconds (default 510; a part that would
# start with under 30 s left is skipped and says so), in order of importance:
#   1. ours_100h   gpu_check, conf/librispeech_100h_conformer.yaml, micro-batches 500 s and 2,000 s,
#                  with the decoding check (beam 10 + CTC 0.3, batch 32: RTF, host syncs per step)
#   2. base_100h   the same on the baseline's asr (its own conf file: its config class reads it)
#   3. gpu_tests   pytest -m gpu tests (this tree)
#   4. ours_960h   gpu_check, conf/librispeech_960h_conformer.yaml, 550 s, no decoding
#   5. base_960h   the same on the baseline
#   6. decode_check tools/gpu_decode_check.py (torchrun N=1 against plain decode; needs soundfile)
#   7. the summary (tools/device_summary.py): one table of both trees and their ratios, last
# Files under $OUT (at most 8 come back): log, ours_100h.json, base_100h.json, ours_960h.json,
# base_960h.json, decode_check.json, summary.json. Without CUDA (and without --dry-run) it says so
# and exits 2.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
OUT=${OUT:-$root/exp/device_check}
mkdir -p "$OUT"
export OUT
if [ -z "${DEVICE_CHECK_LOGGING:-}" ]; then  # everything also into $OUT/log, which comes back even after a timeout
  DEVICE_CHECK_LOGGING=1 bash "${BASH_SOURCE[0]}" "$@" 2>&1 | tee "$OUT/log"
  exit "${PIPESTATUS[0]}"
fi
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
site=/tmp/site
base=$root/.device/baseline
parts=$(mktemp)  # name, exit status, seconds of each part (for the summary)
start_all=$SECONDS

scale=1  # the parts' limits are multiplied by it
if [ "$dry" = 1 ]; then
  budget=${BUDGET:-1800} scale=3  # a shared CPU: tiny runs, but slow ones
  conf100=conf/tiny.yaml conf960=conf/tiny.yaml caps100="8 16" cap960=8
  common=(--device cpu --warmup 1 --steps 2 --profile-steps 1 --peak-tflops 1)
  decode=(--decode-batch 2 --decode-batches 1 --decode-beam 2)
  decode_check=(--device cpu --config conf/tiny.yaml --utts 4 --beam 2)
  site=  # this environment has the packages; the wheels are for the device's Python 3.12
else
  budget=${BUDGET:-510}
  conf100=conf/librispeech_100h_conformer.yaml conf960=conf/librispeech_960h_conformer.yaml
  caps100="500 2000" cap960=550
  common=(--device cuda --warmup "${WARMUP:-10}" --steps "${STEPS:-40}" --profile-steps "${PROFILE_STEPS:-3}")
  decode=(--decode-batch 32 --decode-batches 3)
  decode_check=(--device cuda --config "$conf100" --utts 32)
fi
deadline=$((start_all + budget))

echo "== device_check $(date -u +%FT%TZ), $([ "$dry" = 1 ] && echo "dry run on the CPU" || echo "on the device"), budget ${budget}s"
git rev-parse HEAD 2>/dev/null | sed 's/^/   this tree: HEAD /' || true
[ -n "$(git status --porcelain 2>/dev/null)" ] && echo "   (with uncommitted changes)"
echo "   baseline: $(cat "$base/COMMIT" 2>/dev/null || echo 'MISSING: run bash tools/device_prepare.sh')"
tree_hash() {  # what was measured, where there is no git: a hash of the tree's asr/**/*.py
  (cd "$1" 2>/dev/null && find asr -name '*.py' -print0 | sort -z | xargs -0 cat | sha256sum | cut -c1-12)
}
echo "   sha256 of asr/**/*.py: this tree $(tree_hash "$root"), baseline $(tree_hash "$base")"
command -v nvidia-smi >/dev/null 2>&1 &&
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv,noheader
if [ "$dry" = 0 ] && ! "$python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "device_check: no CUDA device here: nothing to measure (bash tools/device_check.sh --dry-run runs every part on the CPU)" >&2
  exit 2
fi
if [ -n "$site" ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || echo "device_check: installing .whl failed: the parts that need soundfile or jiwer will fail" >&2
else
  site=
fi
path_of() {  # PYTHONPATH with the tree $1 first
  echo "$1${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
}

part() {  # part NAME LIMIT COMMAND...: run COMMAND within min(LIMIT, what is left of the budget)
  local name=$1 limit=$(($2 * scale)) left t0 rc
  shift 2
  left=$((deadline - SECONDS - 15))  # 15 s kept for the summary
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    echo -e "\n== $name: skipped (${left}s of the budget left)"
    echo -e "$name\tskipped\t0" >> "$parts"
    return
  fi
  echo -e "\n== $name (limit ${limit}s, $((SECONDS - start_all))s into the run)"
  t0=$SECONDS
  timeout -k 10 "$limit" "$@"
  rc=$?
  [ "$rc" = 124 ] && echo "== $name: timed out after ${limit}s (what it wrote so far is kept)"
  echo -e "$name\t$rc\t$((SECONDS - t0))" >> "$parts"
  echo "== $name: exit $rc, $((SECONDS - t0))s"
}

gpu_check() {  # gpu_check TREE: the command that runs tools/gpu_check.py on TREE's asr (into the array cmd)
  cmd=(env PYTHONPATH="$(path_of "$1")" "$python" tools/gpu_check.py "${common[@]}")
}
label="baseline $(cut -c1-7 "$base/COMMIT" 2>/dev/null)"

gpu_check "$root"
# shellcheck disable=SC2086
part ours_100h 170 "${cmd[@]}" --label "this tree" --config "$conf100" --batch-seconds $caps100 "${decode[@]}" \
  --out "$OUT/ours_100h.json"
gpu_check "$base"
# shellcheck disable=SC2086
part base_100h 200 "${cmd[@]}" --label "$label" --config "$base/$conf100" --batch-seconds $caps100 "${decode[@]}" \
  --out "$OUT/base_100h.json"
part gpu_tests 150 env PYTHONPATH="$(path_of "$root")" "$python" -m pytest -q -p no:cacheprovider -m gpu tests
gpu_check "$root"
part ours_960h 100 "${cmd[@]}" --label "this tree" --config "$conf960" --batch-seconds "$cap960" --no-decode \
  --no-frontend --out "$OUT/ours_960h.json"
gpu_check "$base"
part base_960h 120 "${cmd[@]}" --label "$label" --config "$base/$conf960" --batch-seconds "$cap960" --no-decode \
  --no-frontend --out "$OUT/base_960h.json"
part decode_check 90 env PYTHONPATH="$(path_of "$root")" "$python" tools/gpu_decode_check.py "${decode_check[@]}" \
  --out "$OUT/decode_check.json"

echo -e "\n== summary ($((SECONDS - start_all))s into the run)"
"$python" tools/device_summary.py "$OUT" --parts "$parts" --log "$OUT/log"
status=$?
rm -f "$parts"
exit $status
