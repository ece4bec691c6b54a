"""tools/env.sh: an environment that already has PyTorch is used as it is."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_env_sh_uses_an_active_environment(tmp_path):
    """A python that imports torch, torchaudio and the requirements (this one) is used: no .venv
    is made, nothing is installed, `asr` and `python` run from the repository through it."""
    root = tmp_path / "checkout"
    (root / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "env.sh", root / "tools")
    shutil.copytree(ROOT / "tools" / "bin", root / "tools" / "bin")
    shutil.copy(ROOT / "setup.py", root)
    (root / "asr").symlink_to(ROOT / "asr")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH")}
    env.update(ASR_PYTHON=sys.executable, PATH="/usr/bin:/bin", PIP_NO_INDEX="1")
    script = ('. tools/env.sh && command -v asr python && asr --help >/dev/null && '
              'python -c "import asr, sys; print(asr.__file__); print(sys.executable)"')
    done = subprocess.run(["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not (root / ".venv").exists()
    assert "nothing installed" in done.stderr and "setting up" not in done.stderr, done.stderr
    asr_cmd, python_cmd, module, executable = done.stdout.split()
    assert (asr_cmd, python_cmd) == (str(root / "tools/bin/asr"), str(root / "tools/bin/python"))
    assert module == str(root / "asr" / "__init__.py")
    assert executable == sys.executable
