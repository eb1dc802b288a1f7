"""A lost site: elastic DiLoCo's recovery against a restart from the last checkpoint.

Three sites of the ``text_gpt_cpu`` workload (the GPT decoder gpt_cpu, 6.4M parameters, on the
bytes of the Python 3.11 documentation, sites non-IID by file), each its own process, DiLoCo
with H = 10 inner Adam steps; the lighthouse runs in this process. Three runs, same seed:

* **none**: no fault.
* **elastic**: site 2 is SIGKILLed in the middle of an interval and started again at once
  (a replacement is at hand); the other two go on without it (``dadjax.elastic``) and it
  rejoins from a live site's state.
* **elastic_lost**: the same, with no replacement: the run ends with two sites.
* **restart**: the same fault as a one-program run meets it today (``jax.distributed``:
  a lost process ends every process): every site is killed at that moment and all are
  started again from their last checkpoint (every ``--checkpoint-every`` rounds).

Each seed (``--seeds 0,1,2``) draws its own initial parameters, site partition and batches,
and kills site 2 two steps later than the seed before (``--kill-at`` + 2 * seed); the table
gives the mean and the spread (min-max) over the seeds.

Per run: site-steps lost (inner steps computed and then discarded, summed over sites),
seconds from the kill until the run is back at the step it had reached (every site
training again), wall time, and test bits/byte of the final anchor (1,024 held-out
windows). Run (about 10 min per seed on 2 cores):

    python experiments/elastic.py --seeds 0,1,2 --name elastic_gpt_cpu

Needs the text (``make data``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent
SITES = 3


def _data(seed: int):
  sys.path.insert(0, str(ROOT))
  from workloads import TEXT_GLOB  # pylint: disable=g-import-not-at-top
  from dadjax import data as data_lib  # pylint: disable=g-import-not-at-top
  ds = data_lib.load("text:" + TEXT_GLOB, seq_len=64, max_eval_windows=1024)
  parts = data_lib.partition(ds.groups, SITES, scheme="by_class", seed=seed)
  return ds, data_lib.SiteBatcher(ds.x_train, ds.y_train, parts, 8, seed=seed)


def site_main(argv: list[str]) -> int:
  """One site (a child process): ``ADDRESS SITE STEPS EVERY CHECKPOINT_DIR CHECKPOINT_EVERY SEED``."""
  address, site, steps, every, ckpt, ckpt_every, seed = argv
  site, steps, every, ckpt_every, seed = int(site), int(steps), int(every), int(ckpt_every), \
      int(seed)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from dadjax import elastic, models  # pylint: disable=g-import-not-at-top
  ds, batcher = _data(seed)
  model = models.get_model("gpt_cpu", ds.num_classes, vocab_size=ds.vocab_size)
  params = model.init(jax.random.key(seed), ds.x_train[:8])

  def loss_fn(p, batch):
    logits = model.apply(p, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  def batch_at(s, step):
    x, y = batcher.batch_at(step, [s])
    return {"x": x, "y": y}

  method = elastic.ElasticDiLoCo(loss_fn, optax.adam(2e-3), every)
  run = elastic.run_site(method, params, batch_at, lighthouse=address, site=site, steps=steps,
                         checkpoint_dir=ckpt, checkpoint_every_rounds=ckpt_every,
                         on_round=lambda row, _: print(json.dumps(dict(row, t=time.time())),
                                                    flush=True),
                         on_step=lambda step, _: print(json.dumps({"step": step, "t": time.time()}),
                                                       flush=True))
  if site == 0:
    test_loss = jax.jit(loss_fn)
    xs, ys = ds.x_test[:1024], ds.y_test[:1024]
    loss = float(np.mean([test_loss(run.anchor, {"x": xs[i:i + 64], "y": ys[i:i + 64]})
                          for i in range(0, len(xs), 64)]))
    print(json.dumps({"test_bits_per_byte": loss / np.log(2)}), flush=True)
  return 0


class _Run:
  """The lighthouse and the site processes of one run."""

  def __init__(self, args, work: pathlib.Path, seed: int):
    from dadjax import elastic  # pylint: disable=g-import-not-at-top
    self.args, self.work, self.seed = args, work, seed
    self.lighthouse = elastic.Lighthouse(expected_sites=SITES,
                                         quorum_timeout_s=args.quorum_timeout_s).start()
    self.lines: dict[int, list[dict]] = {}
    self.procs: dict[int, subprocess.Popen] = {}
    self.starts: dict[int, int] = {}

  def new_lighthouse(self) -> None:
    from dadjax import elastic  # pylint: disable=g-import-not-at-top
    self.lighthouse.close()
    self.lighthouse = elastic.Lighthouse(expected_sites=SITES,
                                         quorum_timeout_s=self.args.quorum_timeout_s).start()

  def start(self, site: int) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, __file__, "--site", self.lighthouse.address, str(site),
           str(self.args.steps), str(self.args.every), str(self.work / f"ckpt{site}"),
           str(self.args.checkpoint_every), str(self.seed)]
    err = open(self.work / f"site{site}.{self.starts.get(site, 0)}.err", "w")
    self.starts[site] = self.starts.get(site, 0) + 1
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    self.procs[site] = proc
    self.lines.setdefault(site, [])
    threading.Thread(target=self._read, args=(site, proc), daemon=True).start()

  def _read(self, site, proc):
    for line in proc.stdout:
      self.lines[site].append(dict(json.loads(line), start=self.starts[site]))

  def _steps(self, site: int, start: int | None = None) -> list[dict]:
    return [l for l in self.lines[site] if "step" in l and "round" not in l
            and (start is None or l["start"] == start)]

  def last_step(self, site: int, start: int | None = None) -> int:
    return max((l["step"] for l in self._steps(site, start)), default=-1)

  def first_step_t(self, site: int) -> float:
    return min(l["t"] for l in self._steps(site, self.starts[site]))

  def _wait(self, site: int, done) -> None:
    while not done():
      if self.procs[site].poll() is not None and not done():
        raise SystemExit(f"site {site} ended: see {self.work}")
      time.sleep(0.05)

  def wait_step(self, site: int, step: int, start: int | None = None) -> None:
    self._wait(site, lambda: self.last_step(site, start) >= step)

  def wait_first_step(self, site: int) -> None:
    self._wait(site, lambda: bool(self._steps(site, self.starts[site])))

  def wait_rounds(self, site: int, count: int, after: float) -> None:
    self._wait(site, lambda: sum(1 for l in self.lines[site]
                                 if "round" in l and l["t"] > after) >= count)

  def kill(self, site: int) -> None:
    os.kill(self.procs[site].pid, signal.SIGKILL)
    self.procs[site].wait()

  def finish(self) -> None:
    for site, proc in self.procs.items():
      if proc.wait() not in (0, -signal.SIGKILL):  # a killed site not started again
        raise SystemExit(f"site {site} exited {proc.returncode}: see {self.work}")
    time.sleep(0.2)
    self.lighthouse.close()


def _completed_round_steps(lines: list[dict]) -> list[int]:
  return [l["step"] for l in lines if "round" in l]


def _lost_steps(run: _Run, site: int, killed_at_step: int) -> int:
  """Inner steps the killed incarnation computed after its last completed round."""
  first = [l for l in run.lines[site] if l.get("start") == 1]
  done = max(_completed_round_steps(first), default=0)
  return killed_at_step - done


def one_run(args, fault: str, seed: int) -> dict:
  work = pathlib.Path(tempfile.mkdtemp(prefix=f"dadjax-elastic-{fault}-"))
  run = _Run(args, work, seed)
  t0 = time.time()
  for site in range(SITES):
    run.start(site)
  out = {"fault": fault, "seed": seed}
  if fault != "none":
    run.wait_step(2, args.kill_at + 2 * seed)
    t_kill = time.time()
    killed_at = {s: run.last_step(s) for s in range(SITES)}
    if fault in ("elastic", "elastic_lost"):
      run.kill(2)
      lost = _lost_steps(run, 2, killed_at[2] + 1)
      training = None
      if fault == "elastic":  # a replacement at hand: started at once
        run.start(2)
        run.wait_first_step(2)
        training = run.first_step_t(2) - t_kill
      # the live sites go on; what they lose is the wait of the round that drops site 2
      run.wait_rounds(0, 1, after=t_kill)
      stalled = _round_stall(run.lines[0], t_kill)
    else:
      for site in range(SITES):
        run.kill(site)
      lost = sum(_lost_steps_to_checkpoint(run, s, killed_at[s] + 1, args) for s in range(SITES))
      run.new_lighthouse()  # the whole job restarts, its coordination service too
      for site in range(SITES):
        run.start(site)
      for site in range(SITES):
        run.wait_first_step(site)
      training = max(run.first_step_t(s) for s in range(SITES)) - t_kill
      for site in range(SITES):  # back where the run was: no progress until then
        run.wait_step(site, killed_at[site], start=2)
      stalled = time.time() - t_kill
    out.update(killed_at_step=killed_at[2], site_steps_lost=lost, seconds_no_progress=stalled)
    if training is not None:
      out["seconds_to_every_site_training"] = training
  run.finish()
  out["wall_s"] = time.time() - t0
  (test,) = [l["test_bits_per_byte"] for l in run.lines[0] if "test_bits_per_byte" in l]
  out["test_bits_per_byte"] = test
  out["quorums"] = [l["quorum"] for l in run.lines[0] if "round" in l]
  shutil.rmtree(work, ignore_errors=True)
  return out


def _round_stall(lines: list[dict], t_kill: float) -> float:
  """How much longer than the median round the first round that ended after the kill took."""
  times = [l["t"] for l in lines if "round" in l]
  durations = [b - a for a, b in zip(times, times[1:])]
  after = next(i for i, t in enumerate(times[1:]) if t > t_kill)
  others = sorted(d for i, d in enumerate(durations) if i != after)
  return durations[after] - others[len(others) // 2]


def _lost_steps_to_checkpoint(run: _Run, site: int, killed_at_step: int, args) -> int:
  """A restart from the last checkpoint discards every step since it was written."""
  rounds = [l["round"] + 1 for l in run.lines[site] if "round" in l]
  saved = max((r for r in rounds if r % args.checkpoint_every == 0), default=0)
  return killed_at_step - saved * args.every


_COLUMNS = ("site_steps_lost", "seconds_no_progress", "seconds_to_every_site_training", "wall_s",
            "test_bits_per_byte")


def _cell(values: list[float], digits: int) -> str:
  """The mean, and the min-max over the seeds when there are several."""
  if not values:
    return "-"
  mean = f"{np.mean(values):.{digits}f}"
  if len(values) == 1:
    return mean
  return f"{mean} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def render(rows: list[dict], command: str, args) -> str:
  seeds = sorted({r["seed"] for r in rows})
  kills = ", ".join(str(args.kill_at + 2 * s) for s in seeds)
  lines = [f"Three sites of text_gpt_cpu (gpt_cpu, 6.4M parameters, non-IID by file), DiLoCo "
           f"H = {args.every}, {args.steps} inner Adam steps per site, one process per site on "
           f"a 2-core CPU; site 2 killed at its inner step {kills} (seeds {seeds}); lighthouse "
           f"quorum_timeout_s = {args.quorum_timeout_s:g}; checkpoints every "
           f"{args.checkpoint_every} rounds ({args.checkpoint_every * args.every} steps). "
           f"Mean over {len(seeds)} seed(s), min-max in parentheses.", "",
           "| run | site-steps lost | s the live sites made no progress | s until every site "
           "trains again | wall s | test bits/byte |", "|---|---|---|---|---|---|"]
  for fault in dict.fromkeys(r["fault"] for r in rows):
    runs = [r for r in rows if r["fault"] == fault]
    cells = [_cell([r.get(k, 0) for r in runs] if k == "site_steps_lost"
                   else [r[k] for r in runs if k in r], d)
             for k, d in zip(_COLUMNS, (0, 1, 1, 0, 3))]
    lines.append(f"| {fault} | " + " | ".join(cells) + " |")
  lines += ["", "Quorums per round: " + "; ".join(
      f"{r['fault']} (seed {r['seed']}): " + " ".join("".join(map(str, q)) for q in r["quorums"])
      for r in rows), "", f"Command: `{command}`", ""]
  return "\n".join(lines)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--site"]:
    return site_main(argv[1:])
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=80)
  p.add_argument("--every", type=int, default=10)
  p.add_argument("--kill-at", type=int, default=35, help="site 2's inner step at the kill")
  p.add_argument("--checkpoint-every", type=int, default=2, help="rounds between checkpoints")
  p.add_argument("--quorum-timeout-s", type=float, default=10.0)
  p.add_argument("--runs", default="none,elastic,elastic_lost,restart")
  p.add_argument("--seeds", default="0", help="comma-separated seeds (e.g. 0,1,2)")
  p.add_argument("--name", default="elastic_gpt_cpu")
  p.add_argument("--out", default=str(ROOT / "results"))
  args = p.parse_args(argv)
  rows = []
  for seed in [int(s) for s in args.seeds.split(",")]:
    for fault in args.runs.split(","):
      rows.append(one_run(args, fault, seed))
      print(json.dumps(rows[-1]), flush=True)
  command = "python experiments/elastic.py " + " ".join(argv)
  out = pathlib.Path(args.out)
  (out / f"{args.name}.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
  (out / f"{args.name}.md").write_text(render(rows, command, args))
  print(render(rows, command, args))
  return 0


if __name__ == "__main__":
  sys.exit(main())
