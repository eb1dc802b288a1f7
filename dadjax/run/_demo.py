"""The main job: every method on the embedded digits over 8 sites, one table.

Trains the default MLP with each method, prints accuracy, payload and wire
bits per step per site, the wire-based ratio versus fp32 and bf16
all-reduce at the stated N and topology, modeled communication time, and
bits and time to a target accuracy; plots test accuracy against cumulative
bits.
"""

from __future__ import annotations

import pathlib

from dadjax.run._config import Config
from dadjax.run._loop import Run, train
from dadjax.run._targets import to_target

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
    "accordion(powersgd:2,powersgd:1)": 0.1,
    "dataquant:2:classes=10": 0.1,  # 2-bit data, not gradients (compute: N x the rows)
}


def format_table(runs: list[Run], target_accuracy: float = 0.8) -> str:
  """A markdown table of the runs: payload vs wire bits, baselines, cost to a target accuracy.

  Every figure is the train loop's own read-out, :func:`dadjax.comm.report`
  of the final state with the compiled step's collective ops (the row
  ``metrics.jsonl`` holds): per site and optimizer step, payload bits (what
  the site hands to collectives), wire bits under the runs' topology at
  their N, the wire-based ratio against an fp32 and a bf16 all-reduce of
  the same tensors (> 1: fewer bits on the wire), and the modeled
  communication time with latency charged per compiled op (the step's
  metric all-reduce included). The last columns are the cumulative wire
  bits and the modeled time (:func:`~dadjax.run.to_target`) to the first
  evaluation at ``target_accuracy`` ("-" when it is never reached).
  """
  config = runs[0].config
  n, topo = config.num_sites, config.topology
  lines = [f"| method | lr | test acc | payload bits/step/site "
           f"| wire bits/step/site ({topo}, N={n}) "
           f"| wire ratio vs fp32 | vs bf16 | modeled comm/step (s) "
           f"| wire bits to {target_accuracy:g} acc "
           f"| modeled comm to {target_accuracy:g} acc (s) | wall (s) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  fp32_row = bf16_row = None
  for run in runs:
    row = run.final
    reached = to_target(run.history, "test_accuracy", target_accuracy)
    bits_to = f"{reached.bits:,.0f}" if reached else "-"
    time_to = f"{reached.seconds:.3f}" if reached else "-"
    lines.append(f"| {row['method']} | {run.config.lr:g} | {row['test_accuracy']:.3f} | "
                 f"{row['payload_bits_per_step']:,} | {row['wire_bits_per_step']:,.0f} | "
                 f"{row['wire_ratio_fp32']:.1f}x | {row['wire_ratio_bf16']:.2f}x | "
                 f"{row['modeled_comm_s_per_step']:.4f} | {bits_to} | {time_to} | "
                 f"{row['wall_s']:.1f} |")
    fp32_row = fp32_row or (row["fp32_wire_bits_per_step"], row["fp32_comm_s_per_step"])
    bf16_row = bf16_row or (row["bf16_wire_bits_per_step"], row["bf16_comm_s_per_step"])
  lines.append("")
  lines.append(f"Baselines for these tensors: an fp32 all-reduce moves {fp32_row[0]:,.0f} "
               f"wire bits/site per step ({fp32_row[1]:.4f} s), a bf16 all-reduce "
               f"{bf16_row[0]:,.0f} ({bf16_row[1]:.4f} s). Ratios < 1 mean the method puts *more* "
               f"bits on the wire than the baseline: an all-gather's wire bits grow with N, an "
               f"all-reduce's do not.")
  lines.append(f"Network model: {topo} at {config.bandwidth / 1e9:g} Gbit/s, "
               f"{config.latency * 1e6:g} us latency per message, N={n}, latency charged per "
               f"{runs[0].final['latency_per']}; {config.steps} steps.")
  return "\n".join(lines)


def plot(runs: list[Run], path: pathlib.Path) -> None:
  """Test accuracy against cumulative wire bits per site, one line per method."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4.5))
  colors = plt.cm.tab20.colors  # more methods than the default 10-colour cycle
  for i, run in enumerate(runs):
    ax.plot([r["total_wire_bits"] for r in run.history], [r["test_accuracy"] for r in run.history],
            marker="os^v"[i % 4], color=colors[i % len(colors)], label=run.config.method)
  ax.set_xscale("log")
  config = runs[0].config
  ax.set_xlabel(f"cumulative wire bits per site ({config.topology}, N={config.num_sites})")
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
