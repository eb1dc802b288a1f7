"""The README's Python examples run as written (in order, sharing names)."""
import pathlib
import re

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  # Blocks that start a multi-host runtime are documentation for clusters.
  runnable = [b for b in blocks if "dadjax.initialize(" not in b]
  assert len(runnable) >= 3
  namespace: dict = {}
  for block in runnable:
    exec(compile(block, str(README), "exec"), namespace)  # pylint: disable=exec-used
  assert namespace["rep"].wire_bits_per_step > namespace["rep"].payload_bits_per_step > 0
  assert namespace["metrics"]["loss"].shape == (8,)
