#!/usr/bin/env bash
# Prepare, on this (CPU) machine, what tools/device_check.sh needs on a device machine that has no
# network (the device tool takes only the repository and the ignored folders it is told to carry): run it here once, then make the printed call.
#
#   bash tools/device_prepare.sh            # BASELINE=37a736d by default
#
# 1. The baseline tree: `git archive $BASELINE asr conf` into .device/baseline/ (ignored through
#    .git/info/exclude; only asr/ and conf/: device_check.sh measures the baseline's `asr` package
#    with this tree's harness, tools/gpu_check.py, so the baseline's tools are not needed).
# 2. The wheels the device image lacks, for its Python 3.12 on x86-64, into .whl/ (ignored):
#    soundfile, cffi, pycparser (soundfile's needs), jiwer, rapidfuzz (jiwer's needs), at the
#    versions of this environment; their other requirements (numpy, click, typing-extensions) are
#    on the device image (KINDS.md's package list), which this script checks. A wheel of another
#    version of the same project is removed: two versions stop the whole install there.
# 3. Prints what would travel (tracked + untracked-not-ignored files + the carried folders; the
#    limit is 64 MiB), the carry list and the command for the device tool.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
baseline=${BASELINE:-37a736d}
python=${PYTHON:-python3}
# name==version of each wheel; the versions are this environment's (see `pip list`)
wheels=${WHEELS:-"soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 jiwer==4.0.0 rapidfuzz==3.14.6"}
on_device="numpy click typing-extensions typing_extensions"  # on the device image already (KINDS.md)

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for pattern in /.device/ /.whl/; do
  grep -qxF "$pattern" "$exclude" 2>/dev/null || echo "$pattern" >> "$exclude"
done

echo "== baseline $baseline -> .device/baseline (asr, conf)"
commit=$(git rev-parse --verify "$baseline^{commit}")
rm -rf .device/baseline
mkdir -p .device/baseline
git archive "$commit" asr conf | tar -x -C .device/baseline
echo "$commit" > .device/baseline/COMMIT

echo "== wheels for Python 3.12, x86-64 -> .whl ($wheels)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp" $wheels
mkdir -p .whl
for wheel in "$tmp"/*.whl; do
  project=$(basename "$wheel" | cut -d- -f1)
  find .whl -maxdepth 1 -iname "$project-*.whl" ! -name "$(basename "$wheel")" -print -delete | sed 's/^/   removed another version: /'
  mv "$wheel" .whl/
done
"$python" - "$on_device" .whl/*.whl <<'PY'
"""Every requirement of the wheels is another wheel or on the device image; else exit 1 naming it."""
import re
import sys
import zipfile

on_device = {n.lower().replace("_", "-") for n in sys.argv[1].split()}
wheels = sys.argv[2:]
have = {w.split("/")[-1].split("-")[0].lower().replace("_", "-") for w in wheels}
missing = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            name = re.split(r"[ ;<>=!~\[(]", line.split(":", 1)[1].strip())[0].lower().replace("_", "-")
            where = "a wheel here" if name in have else "the device image" if name in on_device else None
            print(f"   {wheel.split('/')[-1].split('-')[0]} needs {name}: {where or 'MISSING'}")
            if where is None:
                missing.append(name)
if missing:
    sys.exit(f"device_prepare: no wheel for {', '.join(sorted(set(missing)))}: add it to WHEELS")
PY

echo "== what travels (limit 64 MiB)"
tracked=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
untracked=$( (git ls-files -z --others --exclude-standard | du -cb --files0-from=- 2>/dev/null || echo 0) | tail -1 | cut -f1)
shared=0
[ -d shared ] && shared=$(du -sb shared | cut -f1)
carried=$(du -sb .whl .device | awk '{s += $1} END {print s}')
total=$((tracked + untracked + shared + carried))
printf '   tracked %.1f MiB, untracked (not ignored) %.1f MiB, shared/ %.1f MiB, carried (.whl, .device) %.1f MiB: %.1f MiB\n' \
  "$(echo "$tracked / 1048576" | bc -l)" "$(echo "$untracked / 1048576" | bc -l)" "$(echo "$shared / 1048576" | bc -l)" \
  "$(echo "$carried / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -ge $((64 * 1048576)) ]; then
  echo "device_prepare: $total bytes would travel, over the 64 MiB limit" >&2
  exit 1
fi
cat <<EOF
== ready: the device call (one run, about 9 minutes; the summary table is printed last)
   command:   bash tools/device_check.sh
   carry:     [".whl", ".device"]
   timeout_s: 570
   dry run here first: bash tools/device_check.sh --dry-run
EOF
