"""The README's and the guides' Python examples run as written (in order, sharing names)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent
# The front page's example starts the session the guides continue (`ds`, `batches`, `x`, `y`),
# so the pages run in this order; every guide with a Python block must be listed.
PAGES = ["README.md", "docs/quickstart.md", "docs/compression.md", "docs/dad.md",
         "docs/own_step.md", "docs/dataquant.md", "docs/extending.md", "docs/placement.md",
         "docs/local.md", "docs/elastic.md", "docs/api.md"]


def _python_blocks(path: pathlib.Path) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def test_every_page_with_python_is_run():
  with_python = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if _python_blocks(p)}
  assert with_python <= set(PAGES), f"add to PAGES: {sorted(with_python - set(PAGES))}"


def test_readme_and_guides_python_blocks_run():
  namespace: dict = {}
  ran = 0
  for page in PAGES:
    path = ROOT / page
    # Blocks that start a multi-host runtime are documentation for clusters.
    runnable = [b for b in _python_blocks(path) if "dadjax.initialize(" not in b]
    assert runnable, f"{page} has no Python block to run"
    for block in runnable:
      exec(compile(block, str(path), "exec"), namespace)  # pylint: disable=exec-used
      ran += 1
  assert ran >= 15
  assert namespace["rep"].wire_bits_per_step > namespace["rep"].payload_bits_per_step > 0
  assert namespace["metrics"]["loss"].shape == (8,)
