"""The main job: every method on the embedded digits over 8 sites, one table.

Trains the default MLP with each method, prints accuracy, bits per step per
site, compression ratio versus fp32 and modeled communication time at
1 Gbit/s, and plots test accuracy against cumulative bits.
"""

from __future__ import annotations

import pathlib

from dadjax.config import Config
from dadjax.train import Run, train

# Method spec -> learning rate (SGD, momentum 0.9), each picked from the grid
# {0.1, 0.03, 0.01, 0.003, 0.001} on this task. Sign methods need small
# steps (every coordinate moves by the full step); unbiased RandomK scales
# the gradient by d/k and with it the variance.
DEFAULT_METHODS = {
    "allreduce": 0.1,
    "bf16": 0.1,
    "topk:0.01": 0.1,
    "ef_topk:0.01": 0.1,
    "randomk:0.1": 0.03,
    "qsgd:16": 0.1,
    "terngrad": 0.1,
    "sign": 0.001,
    "ef_scaled_sign": 0.03,
    "powersgd:2": 0.1,
    "dad": 0.1,
    "rank_dad:2": 0.1,
    "dataquant:2:classes=10": 0.1,  # 2-bit data, not gradients (compute: N x the rows)
}


def format_table(runs: list[Run]) -> str:
  """A markdown table of the runs' final rows."""
  lines = ["| method | lr | test acc | bits/step/site | ratio vs fp32 | modeled comm @1Gb/s (s) | wall (s) |",
           "|---|---|---|---|---|---|---|"]
  for run in runs:
    row = run.final
    lines.append(f"| {row['method']} | {run.config.lr:g} | {row['test_accuracy']:.3f} | {row['bits_per_step']:,} | "
                 f"{row['compression_ratio']:.1f}x | {row['modeled_comm_s']:.3f} | {row['wall_s']:.1f} |")
  config = runs[0].config
  lines.append("")
  lines.append(f"Modeled comm: {config.topology} collectives at {config.bandwidth / 1e9:g} Gbit/s with "
               f"{config.latency * 1e6:g} us latency per collective call, summed over "
               f"{config.steps} steps; on a model this small the latency term dominates.")
  return "\n".join(lines)


def plot(runs: list[Run], path: pathlib.Path) -> None:
  """Test accuracy against cumulative bits per site, one line per method."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4.5))
  colors = plt.cm.tab20.colors  # more methods than the default 10-colour cycle
  for i, run in enumerate(runs):
    ax.plot([r["total_bits"] for r in run.history], [r["test_accuracy"] for r in run.history],
            marker="os^v"[i % 4], color=colors[i % len(colors)], label=run.config.method)
  ax.set_xscale("log")
  ax.set_xlabel("cumulative bits sent per site")
  ax.set_ylabel("test accuracy")
  ax.set_title(f"{runs[0].config.dataset}, {runs[0].config.num_sites} sites")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run_demo(methods=tuple(DEFAULT_METHODS), *, steps: int = 300, out_dir: str = "demo_out",
             base: Config | None = None, progress: bool = True) -> list[Run]:
  """Train each method, print the table, write ``table.md`` and ``accuracy_vs_bits.png``.

  Methods in :data:`DEFAULT_METHODS` use their learning rate from there,
  others ``base.lr``.
  """
  base = base or Config(steps=steps, eval_every=max(1, steps // 6))
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  runs = []
  for i, method in enumerate(methods):
    if progress:
      print(f"[{i + 1}/{len(methods)}] {method}", flush=True)
    config = base.replace(method=method, lr=DEFAULT_METHODS.get(method, base.lr),
                          out_dir=str(out / method.replace(":", "_")))
    runs.append(train(config, progress=progress))
  table = format_table(runs)
  print(table)
  (out / "table.md").write_text(table + "\n")
  plot(runs, out / "accuracy_vs_bits.png")
  print(f"wrote {out / 'table.md'} and {out / 'accuracy_vs_bits.png'}")
  return runs
