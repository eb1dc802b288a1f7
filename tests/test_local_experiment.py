"""experiments/local.py runs end to end in its quick mode (marked slow)."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.slow
def test_local_experiment_quick_mode(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "experiments/local.py", "--quick", "--out", str(tmp_path)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  text = (tmp_path / "local.md").read_text()
  for spec in ("allreduce", "diloco:4", "diloco:4:compress=qsgd(7)"):
    assert f"| `{spec}` |" in text
  assert "streaming_diloco:4" in text and "Command: `python experiments/local.py --quick" in text
  assert (tmp_path / "local.png").read_bytes()[:4] == b"\x89PNG"
