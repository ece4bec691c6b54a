#!/usr/bin/env bash
# GPU check of the trainer's step: bf16 training of conf/librispeech_100h_conformer.yaml on
# synthetic batches, a new one every step (steps/s, audio-seconds/s, peak GPU memory, MFU, the
# share of the step the GPU is busy and a torch.profiler table), then decoding (beam 10 + CTC 0.3,
# 32 utterances per batch: real-time factor, utterances/s, host syncs per step). See
# tools/gpu_check.py for what is measured and for the options; tools/device_check.sh is the one
# device run that measures this tree against the baseline (37a736d).
#
#   bash tools/gpu_check.sh [--compile] [--batch-seconds S ...] [--steps N] [--no-decode] [--out FILE]
#   bash tools/gpu_check.sh --device cpu --config conf/tiny.yaml --batch-seconds 10 --warmup 1 --steps 2 \
#       --profile-steps 1 --decode-batch 4                                                   # dry run
#
# Needs a python (PYTHON, default python3) with torch and pyyaml; nothing is installed: the
# repository goes on PYTHONPATH. Exit status 2 when there is no CUDA device. Then runs the
# gpu-marked tests when pytest imports, and tools/gpu_decode_check.py when soundfile does.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv,noheader || true
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$python" "$root/tools/gpu_check.py" "$@"
# Then the gpu-marked tests (the device frontend on CUDA against the CPU fbank, batched search on
# CUDA), when pytest imports: put an unpacked pytest wheel on PYTHONPATH where it is not installed.
if "$python" -c "import pytest" 2>/dev/null; then
  (cd "$root" && "$python" -m pytest -q -p no:cacheprovider -m gpu tests)
else
  echo "gpu_check: no pytest for $python: the gpu-marked tests did not run" >&2
fi
# Then the sharded decode on this one GPU (torchrun N=1 against plain; needs soundfile).
if "$python" -c "import soundfile" 2>/dev/null; then
  "$python" "$root/tools/gpu_decode_check.py"
else
  echo "gpu_check: no soundfile for $python: the sharded decode check did not run" >&2
fi
