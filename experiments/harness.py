"""What every experiment script shares: the run grid, seeds, mean +- std, cost to a target,
markdown tables, plots and the results file with the command that wrote it.

A script states its grid (methods x seeds x settings), trains each cell with
:func:`dadjax.run.train` (or says in its docstring why it runs its own
loop), and reads every number from the rows the run layer logs
(:func:`dadjax.comm.report`'s columns). Steps, wire bits and modeled time to
a target come from :func:`dadjax.run.to_target` on those rows (the first
evaluation at the target, its *cumulative* bits and seconds):
:func:`to_target_cells` gives them as table cells over seeds.

A script puts its own directory on ``sys.path`` and imports ``harness``; the
harness imports only the standard library and numpy at the top, so the
script can call :func:`host_devices` before anything starts JAX's backend.
"""

from __future__ import annotations

import math
import os
import pathlib
import shlex
import subprocess
from typing import Any, Callable, Iterable, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent
RESULTS = ROOT / "results"


def host_devices(n: int = 8, *, force: bool = False) -> None:
  """Simulate ``n`` CPU devices (XLA_FLAGS), unless the flag is already set (``force``: always).

  Call before JAX creates its backend (the first computation or device query).
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if force or "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def command_line(script: str, argv: Sequence[str]) -> str:
  """The command that reproduces this run, from the repository root (quoted for a shell)."""
  return " ".join(["python", f"experiments/{script}", *map(shlex.quote, argv)])


def uptime() -> str:
  """The machine's load right now (``uptime``; the load average where it is missing)."""
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def common_args(parser, name: str, workload: str, *, quick: str = "workloads at their quick "
                "sizes", seeds: str | None = "0,1,2") -> None:
  """The arguments every grid script takes: ``--out``, ``--name`` (the results' stem),
  ``--workload`` (help: ``workload``), ``--quick`` (help: ``quick``) and ``--seeds``."""
  parser.add_argument("--out", default=str(RESULTS), help="output directory")
  parser.add_argument("--name", default=name, help="output file stem (<out>/<name>.md)")
  parser.add_argument("--workload", default=None, help=workload)
  parser.add_argument("--quick", action="store_true", help=quick)
  if seeds is not None:
    parser.add_argument("--seeds", default=seeds, help="comma-separated seeds")


def seeds(text: str) -> list[int]:
  """``"0,1,2"`` -> ``[0, 1, 2]``."""
  return [int(s) for s in str(text).split(",") if s.strip()]


def grid(methods: Iterable, seed_list: Iterable[int], run: Callable[[Any, Any, int], Any], *,
         settings: Iterable = (None,), done: Callable[[dict], None] | None = None) -> dict:
  """Run every (setting, method, seed), setting-major then method then seed.

  Args:
    methods: the methods (specs, or any key).
    seed_list: the seeds.
    run: ``run(setting, method, seed)`` -> one result.
    settings: the settings (models, partitions, ...); default one, ``None``.
    done: called with the results so far after every run (a long grid
      writes its file as it goes, and keeps what it measured).

  Returns:
    ``{(setting, method): [result per seed]}`` in run order.
  """
  seed_list, methods = list(seed_list), list(methods)
  results: dict = {}
  for setting in settings:
    for method in methods:
      for seed in seed_list:
        results.setdefault((setting, method), []).append(run(setting, method, seed))
        if done is not None:
          done(results)
  return results


def _present(values) -> list[float]:
  return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def mean_std(values, fmt: str = "{:.3g}", std: str = "{:.2g}",
             missing: str = "not reached") -> str:
  """``mean ± std`` over seeds (population std); one value: the value.

  ``None`` / NaN values (a seed that never reached a target) are left out
  and counted: ``"3 ± 1 (2/4 seeds)"``; none left: ``missing``.
  """
  values = list(values)
  ok = _present(values)
  if not ok:
    return missing
  text = fmt.format(np.mean(ok)) + (f" ± {std.format(np.std(ok))}" if len(ok) > 1 else "")
  return text if len(ok) == len(values) else f"{text} ({len(ok)}/{len(values)} seeds)"


def to_target_cells(histories: Iterable[Sequence[dict]], metric: str, target: float, *,
                    seconds_scale: float = 1.0,
                    fmts: tuple[str, str, str] = ("{:.0f}", "{:.3g}", "{:.3g}"),
                    **columns) -> tuple[str, str, str]:
  """Steps, wire bits and modeled seconds to ``target`` over seeds, as ``mean ± std`` cells.

  Args:
    histories: one list of metrics rows per seed (``Run.history``).
    metric, target: as :func:`dadjax.run.to_target` (direction from the name).
    seconds_scale: multiplies the seconds (``1e3`` for milliseconds).
    fmts: formats of the steps, bits and seconds means.
    **columns: ``bits=`` / ``seconds=`` / ``higher=`` for :func:`dadjax.run.to_target`.
  """
  from dadjax.run import to_target  # pylint: disable=g-import-not-at-top  (after host_devices)
  reached = [to_target(h, metric, target, **columns) for h in histories]
  steps = [r.step if r else None for r in reached]
  bits = [r.bits if r else None for r in reached]
  secs = [r.seconds * seconds_scale if r and r.seconds is not None else None for r in reached]
  return tuple(mean_std(v, fmt) for v, fmt in zip((steps, bits, secs), fmts))


def cell(value: Any) -> str:
  """A markdown table cell: ``str(value)`` with ``|`` escaped (method specs carry them)."""
  return str(value).replace("|", "\\|")


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "---") -> str:
  """A markdown table: the header, a rule of ``align`` per column, one line per row.

  Raises:
    ValueError: a row with another number of cells than the header.
  """
  lines = ["| " + " | ".join(header) + " |", "|" + f"{align}|" * len(header)]
  for row in rows:
    if len(row) != len(header):
      raise ValueError(f"table: a row of {len(row)} cells under {len(header)} columns: {row}")
    lines.append("| " + " | ".join(cell(c) for c in row) + " |")
  return "\n".join(lines)


def pyplot():
  """matplotlib's pyplot on the file backend (no display)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def plot_curves(ax, curves: dict, *, xlabel: str, ylabel: str, title: str | None = None,
                logx: bool = True, legend: float | None = 7, markersize: float = 3) -> None:
  """One line per label on ``ax``: ``curves = {label: (xs, ys)}`` (tab20 colours, 5 markers)."""
  colors = pyplot().cm.tab20.colors  # more methods than the default 10-colour cycle
  for i, (label, (xs, ys)) in enumerate(curves.items()):
    ax.plot(xs, ys, marker="os^vD"[i % 5], ms=markersize, color=colors[i % len(colors)],
            label=label)
  if logx:
    ax.set_xscale("log")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  if legend:
    ax.legend(fontsize=legend, ncol=2)


def save(fig, path: pathlib.Path | str, dpi: int = 110) -> None:
  """Write ``fig`` (tight layout) and close it."""
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  pyplot().close(fig)


def write_results(path: pathlib.Path | str, title: str, command: str, *sections: str,
                  note: str = "") -> str:
  """Write a results page: ``# title``, ``Command: `command` note``, then the sections.

  Returns the text written (scripts print it).
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  text = "\n\n".join([f"# {title}", f"Command: `{command}`{note}", *sections]).rstrip() + "\n"
  path.write_text(text)
  return text
