"""Every method's train step compiled by the TPU compiler for named TPU topologies.

Each row is ``dadjax.pod.compile_config`` of a config with one model and one
method on one topology (nothing runs: libtpu compiles on this host), in a
child process of its own (an abort inside XLA ends one row, not the table).
Every figure is the compiler's: per-device memory (``memory_analysis``:
arguments + outputs + temporaries + code) against the chip's HBM, the
operand bytes per device and step of the cross-slice (DCN) and in-slice
(ICI) collectives, the compile time. ``--ratios`` adds each method's
temporaries, DCN bytes and compile time against the all-reduce step's on the
same topology.

Run (the table in docs/results.md, the README's pod section):

    python experiments/pod_compile.py --name pod_compile_gpt_125m --models gpt_125m
    python experiments/pod_compile.py --name pod_compile_gpt_1b --models gpt_1b
    python experiments/pod_compile.py --name pod_compile_mlp --config \
        experiments/configs/pod_mlp.toml --models mlp --topologies v5e:4x4:2 --ratios --unit MiB

``--from-json --name NAME[,NAME]`` renders saved runs again; ``--summary FILE`` beside it
writes one table per model of all of them (docs/results.md's):

    python experiments/pod_compile.py --from-json \
        --name pod_compile_gpt_125m,pod_compile_gpt_1b --summary pod_compile_gpt

``--update`` compiles the named cells again and replaces them in the saved run (after a
change to a method), e.g.:

    python experiments/pod_compile.py --update --name pod_compile_gpt_1b --models gpt_1b \
        --methods sparseloco:50,demo

Needs libtpu (``pip install -e ".[tpu]"``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import time

METHODS = ("allreduce", "powersgd:4", "ef(topk:0.01)", "qsgd:16", "sign", "dad", "diloco:50",
           "sparseloco:50", "demo")
TOPOLOGIES = ("v5e:4x4:2", "v5e:16x16:4", "v5p:4x4x4:1")
ROOT = pathlib.Path(__file__).resolve().parent


def _row(config: str, model: str, method: str, topology: str, slices: int, seq_len: int,
         extra: list[str]) -> dict:
  """One compile, in this process (the child's side)."""
  from dadjax.pod import compile_config  # pylint: disable=g-import-not-at-top
  from dadjax.run import load_config  # pylint: disable=g-import-not-at-top
  overrides = [f"model={model}", f"method={method}", *extra]
  if seq_len:
    overrides.append(f'dataset_kwargs={{"seq_len": {seq_len}}}')
  report = compile_config(load_config(config, overrides), topology, slices)
  return report.as_dict()


def _child(args, model, method, topology, slices) -> dict:
  seq = {"gpt_125m": 1024, "gpt_1b": 2048}.get(model, 0)
  cmd = [sys.executable, __file__, "--child", args.config, model, method, topology, str(slices),
         str(seq), *args.override]
  start = time.perf_counter()
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
  row = {"model": model, "method": method, "topology": f"{topology} x {slices}"}
  if out.returncode == 0:
    row.update(json.loads(out.stdout.strip().splitlines()[-1]))
  else:
    last = [l for l in out.stderr.strip().splitlines() if l.strip()][-1:] or ["?"]
    row["error"] = f"rc {out.returncode}: {last[0][:200]}"
  row["wall_s"] = time.perf_counter() - start
  return row


def render(rows: list[dict], ratios: bool, command: str, unit: str = "GiB") -> str:
  scale = 2 ** 30 if unit == "GiB" else 2 ** 20
  head = ["model", "topology", "method", "fits", f"{unit}/device", f"temp {unit}", "DCN MiB/step",
          "ICI MiB/step", "compile s"]
  if ratios:
    head += ["temp x all-reduce", "DCN x all-reduce", "compile x all-reduce"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  base = {(r["model"], r["topology"]): r for r in rows
          if r["method"] == "allreduce" and "error" not in r}
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['model']} | {r['topology']} | {r['method']} | not compiled: "
                   f"{r['error']} |" + " |" * (len(head) - 4))
      continue
    gib = lambda b: f"{b / scale:.2f}"
    cells = [r["model"], r["topology"], r["method"], "yes" if r["fits"] else "**no**",
             gib(r["total_bytes"]), gib(r["temp_bytes"]), f"{r['dcn_bytes'] / 2 ** 20:.2f}",
             f"{r['ici_bytes'] / 2 ** 20:.1f}", f"{r['compile_s']:.1f}"]
    if ratios:
      b = base.get((r["model"], r["topology"]))
      ratio = lambda k: f"{r[k] / b[k]:.2f}" if b and b[k] else "-"
      cells += [ratio("temp_bytes"), ratio("dcn_bytes"), ratio("compile_s")]
    lines.append("| " + " | ".join(cells) + " |")
  device = "; ".join(dict.fromkeys(
      f"{r['topology'].split()[0].split(':')[0]}: {r['device_kind']}, "
      f"{r['hbm_bytes'] / 2 ** 30:g} GiB HBM"
      for r in rows if "error" not in r and r.get("hbm_bytes")))
  return ("Every figure is the TPU compiler's (libtpu, compiling on a CPU host for the named "
          f"topology; {device}): memory per device from memory_analysis (arguments + outputs - "
          "aliased + temporaries + code), collective operand bytes per device and step from the "
          "optimized program (DCN: cross-slice transfers; ICI: in-slice), compile time on this "
          "host.\n\n" + "\n".join(lines) + f"\n\nCommand: `{command}`\n")


_OUT_OF_HBM = re.compile(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def _cell(r: dict) -> str:
  """One row as a summary cell: GiB per device, DCN MiB per step, compile s (or why not)."""
  if "error" in r:
    out_of_hbm = _OUT_OF_HBM.search(r["error"])
    if out_of_hbm:
      return f"**does not fit**: temporaries {out_of_hbm[1]} GiB > {out_of_hbm[2]} GiB HBM"
    if r["error"].startswith("rc -6"):
      return "**XLA aborted** (SIGABRT in the compiler)"
    return f"**not compiled**: {r['error'][:80]}"
  fits = "" if r["fits"] else " (**does not fit**)"
  return (f"{r['total_bytes'] / 2 ** 30:.2f} GiB{fits} · {r['dcn_bytes'] / 2 ** 20:.2f} MiB · "
          f"{r['compile_s']:.0f} s")


def render_summary(rows: list[dict], commands: list[str]) -> str:
  """One table per model: a method per line, a topology per column."""
  out = ["Every figure is the TPU compiler's (libtpu on a CPU host, no TPU): per cell, memory "
         "per device (of 16 GiB HBM on v5e, 95 GiB on v5p) · DCN operand bytes per device and "
         "step · compile time on a 2-core host."]
  for model in dict.fromkeys(r["model"] for r in rows):
    mine = [r for r in rows if r["model"] == model]
    topologies = list(dict.fromkeys(r["topology"] for r in mine))
    cells = {(r["method"], r["topology"]): _cell(r) for r in mine}
    out += ["", f"**{model}**", "", "| method | " + " | ".join(topologies) + " |",
            "|" + "---|" * (len(topologies) + 1)]
    for method in dict.fromkeys(r["method"] for r in mine):
      out.append(f"| {method} | " + " | ".join(cells.get((method, t), "-") for t in topologies)
                 + " |")
  return "\n".join(out) + "\n\nCommands: " + "; ".join(f"`{c}`" for c in commands) + "\n"


def _commands(saved: dict) -> str:
  """The run's command, then those that compiled some of its cells again."""
  return "`; `".join([saved["command"], *saved.get("updates", [])])


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--child"]:
    config, model, method, topology, slices, seq, *extra = argv[1:]
    print(json.dumps(_row(config, model, method, topology, int(slices), int(seq), extra)))
    return 0
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default=str(ROOT / "configs" / "gpt_v5e.toml"))
  p.add_argument("--models", default="gpt_125m,gpt_1b")
  p.add_argument("--methods", default=",".join(METHODS))
  p.add_argument("--topologies", default=",".join(TOPOLOGIES),
                 help="NAME:SLICES, comma-separated (default: %(default)s)")
  p.add_argument("--override", action="append", default=[], help="key=value for every row")
  p.add_argument("--ratios", action="store_true")
  p.add_argument("--unit", choices=("GiB", "MiB"), default="GiB", help="memory columns' unit")
  p.add_argument("--timeout", type=int, default=1800)
  p.add_argument("--name", default="pod_compile_gpt")
  p.add_argument("--out", default=str(ROOT / "results"))
  p.add_argument("--from-json", action="store_true",
                 help="render OUT/NAME.json again (NAME: comma-separated names)")
  p.add_argument("--summary", help="with --from-json: also write OUT/SUMMARY.md, one table "
                 "per model of every named run")
  p.add_argument("--update", action="store_true",
                 help="compile only the given cells again and replace them in OUT/NAME.json "
                      "(the command is kept with the run's)")
  args = p.parse_args(argv)
  out = pathlib.Path(args.out)
  command = "python experiments/pod_compile.py " + " ".join(argv)
  if args.from_json:
    runs = [json.loads((out / f"{name}.json").read_text()) for name in args.name.split(",")]
    for name, saved in zip(args.name.split(","), runs):
      (out / f"{name}.md").write_text(render(saved["rows"], args.ratios, _commands(saved),
                                             args.unit))
    if args.summary:
      (out / f"{args.summary}.md").write_text(render_summary(
          [r for saved in runs for r in saved["rows"]],
          [c for saved in runs for c in [saved["command"], *saved.get("updates", [])]]))
    return 0
  saved = (json.loads((out / f"{args.name}.json").read_text()) if args.update
           else {"command": command, "rows": []})
  if args.update:
    saved["updates"] = saved.get("updates", []) + [command]
  rows = saved["rows"]
  from dadjax.registry import split_specs  # pylint: disable=g-import-not-at-top
  for topo in args.topologies.split(","):
    name, _, slices = topo.rpartition(":")
    for model in args.models.split(","):
      for method in split_specs(args.methods):
        row = _child(args, model, method, name, int(slices))
        same = [i for i, r in enumerate(rows) if (r["model"], r["method"], r["topology"]) ==
                (row["model"], row["method"], row["topology"])]
        if same:
          rows[same[0]] = row
        else:
          rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("model", "topology", "method", "total_bytes",
                                                    "temp_bytes", "dcn_bytes", "compile_s",
                                                    "error")}), flush=True)
        (out / f"{args.name}.json").write_text(json.dumps(saved, indent=1))
  (out / f"{args.name}.md").write_text(render(rows, args.ratios, _commands(saved), args.unit))
  return 0


if __name__ == "__main__":
  sys.exit(main())
