"""The ``dadjax`` command: ``train``, ``compile``, ``dryrun``, ``demo``, ``methods``, ``plot``, ``netlab``, ``lighthouse``.

A mistake in the command line, the config or the checkpoint directory is
reported as one line, ``dadjax: error: ...``, with exit code 2; ``--debug``
shows the traceback instead.

``dadjax train`` over several processes (``--coordinator``, ``--num-processes``,
``--process-id`` or ``--distributed``) supervises its own worker: the command
runs itself again as a child process and waits for it. JAX's coordination
client aborts a process (SIGABRT, from C++, with no way for Python to
intervene: its ``missed_heartbeat_callback`` cannot be given from Python in
jax 0.10) as soon as the coordination service, hosted by process 0, goes
away; JAX documents that losing process 0 ends every process. The supervisor
turns that abort into the same line as any lost process (``dadjax: error:
process 0 stopped responding at step N (...); the last checkpoint is step M;
restart all processes to resume``, exit code 2); it forwards SIGTERM, SIGINT,
SIGHUP, SIGUSR1 and SIGUSR2 to the worker, passes the worker's exit code on,
and takes the worker down with it if the supervisor itself is killed (Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from dadjax.errors import DadjaxError, Stopped

DEFAULT_DEVICES = 8
_SUPERVISED_ENV = "DADJAX_SUPERVISED"  # set in the supervised worker (see _supervise)
_FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
# What JAX's coordination client logs right before it aborts the process.
_JAX_ABORT = (b"Polled an error from coordination service",
              b"Terminating process because the JAX distributed service detected fatal errors")


def _simulate_devices(n: int) -> None:
  # XLA reads this when the backend starts (first device use), so setting it
  # here, before any computation, gives n CPU devices to shard_map over.
  flag = f"--xla_force_host_platform_device_count={n}"
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def _debug_flag(parser: argparse.ArgumentParser) -> None:
  """``--debug`` after the subcommand too (SUPPRESS keeps one given before it)."""
  parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                      help="show the Python traceback of an error instead of one line")


def _plugin_flag(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                      help="import MODULE first (it registers methods); repeatable. Installed "
                      "packages' dadjax.methods entry points load by themselves")


def _distributed_flags(parser: argparse.ArgumentParser) -> None:
  """Many processes (hosts): flags for ``dadjax.initialize``, not config fields."""
  group = parser.add_argument_group(
      "many processes", "start JAX's multi-process runtime (dadjax.initialize) before training; "
      "every process runs the same command with its own --process-id")
  group.add_argument("--distributed", choices=("auto",),
                     help="auto: JAX's cluster detection (TPU pod, SLURM, Open MPI) fills in the "
                     "coordinator, process count and rank not given below")
  group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
  group.add_argument("--num-processes", type=int, metavar="N", help="number of processes")
  group.add_argument("--process-id", type=int, metavar="I", help="this process's rank in [0, N)")


def _elastic_flags(parser: argparse.ArgumentParser) -> None:
  group = parser.add_argument_group(
      "elastic", "train one site of an elastic local-update run (diloco, local_sgd, "
      "streaming_diloco, sparseloco, demo): sites may be lost and started again "
      "(docs/elastic.md)")
  group.add_argument("--lighthouse", metavar="HOST:PORT",
                     help="the run's lighthouse (dadjax lighthouse)")
  group.add_argument("--site", type=int, metavar="I",
                     help="this site's id in [0, num_sites): its data partition")


def _distributed(args: argparse.Namespace) -> bool:
  """Call ``dadjax.initialize`` when the command line asks for many processes."""
  explicit = (args.coordinator, args.num_processes, args.process_id)
  if args.distributed is None and all(v is None for v in explicit):
    return False
  if args.coordinator is not None and (":" not in args.coordinator
                                       or not args.coordinator.rsplit(":", 1)[1].isdigit()):
    raise DadjaxError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
  if args.num_processes is not None and args.num_processes < 1:
    raise DadjaxError(f"--num-processes must be >= 1, got {args.num_processes}")
  if args.process_id is not None and (
      args.process_id < 0
      or (args.num_processes is not None and args.process_id >= args.num_processes)):
    bound = "N" if args.num_processes is None else args.num_processes
    raise DadjaxError(f"--process-id must be in [0, {bound}), got {args.process_id}")
  from dadjax.parallel import initialize  # pylint: disable=g-import-not-at-top
  try:
    initialize(*explicit)  # gloo collectives on CPU; NCCL / ICI need nothing more
  except (ValueError, RuntimeError) as e:
    raise DadjaxError(f"cannot start the multi-process runtime ({e}); give --coordinator, "
                      "--num-processes and --process-id, or run under a cluster JAX detects "
                      "(--distributed auto)") from None
  return True


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="dadjax", description=__doc__.splitlines()[0])
  parser.add_argument("--debug", action="store_true",
                      help="show the Python traceback of an error instead of one line")
  sub = parser.add_subparsers(dest="command", required=True)
  p_train = sub.add_parser("train", help="train from a config file and key=value overrides")
  p_train.add_argument("--config", help="TOML or JSON config file")
  p_train.add_argument("overrides", nargs="*", help="key=value, e.g. method=topk:0.01 steps=500")
  p_train.add_argument("--no-progress", action="store_true")
  _plugin_flag(p_train)
  p_train.add_argument("--restart", action="store_true",
                       help="delete the checkpoints in checkpoint_dir and start from step 0")
  _distributed_flags(p_train)
  _elastic_flags(p_train)
  p_train.set_defaults(handler=_train)
  _debug_flag(p_train)
  p_demo = sub.add_parser("demo", help="every method on the embedded digits over 8 sites")
  p_demo.add_argument("--steps", type=int, default=300)
  p_demo.add_argument("--methods", help="comma-separated method specs (default: all)")
  p_demo.add_argument("--out", default="demo_out")
  p_demo.add_argument("--no-progress", action="store_true")
  _plugin_flag(p_demo)
  p_demo.set_defaults(handler=_demo)
  _debug_flag(p_demo)
  p_plot = sub.add_parser("plot", help="heat map of a run's Accordion decisions with its learning "
                          "rate, from RUN_DIR/metrics.jsonl")
  p_plot.add_argument("run_dir", help="a run's out_dir (holds metrics.jsonl)")
  p_plot.add_argument("--out", help="image to write (default: RUN_DIR/decisions.png)")
  p_plot.set_defaults(handler=_plot)
  _debug_flag(p_plot)
  p_compile = sub.add_parser(
      "compile", help="compile a config's train step for a TPU topology (no TPU needed) and "
      "print the compiler's per-device memory, collectives per mesh axis, FLOPs")
  p_compile.add_argument("config", help="TOML or JSON train config")
  p_compile.add_argument("overrides", nargs="*", help="key=value config overrides")
  p_compile.add_argument("--topology", required=True,
                         help="e.g. v5e:4x4, v5e:16x16, v5p:4x4x4; cpu:N for N host devices")
  p_compile.add_argument("--slices", type=int, default=1, help="slices joined by DCN (default 1)")
  p_compile.add_argument("--mesh", help="mesh axes, e.g. data=4,fsdp=256 (default: one site per "
                         "slice, the config's in-site axes grown to fill a site)")
  p_compile.add_argument("--json", action="store_true", help="print the report as JSON")
  _plugin_flag(p_compile)
  p_compile.set_defaults(handler=_compile)
  _debug_flag(p_compile)
  p_dry = sub.add_parser("dryrun", help="an estimate of a GPT config's per-device memory "
                         "(parameters, optimizer, activations) from shapes alone; `dadjax "
                         "compile` gives the compiler's figures")
  p_dry.add_argument("config", help="TOML or JSON train config whose model is a gpt_* size")
  p_dry.add_argument("overrides", nargs="*", help="key=value config overrides")
  p_dry.add_argument("--mesh", help="mesh axes, e.g. data=2,fsdp=16,model=1 (default: "
                     "data=num_sites, fsdp=per_site)")
  p_dry.add_argument("--rules", choices=("fsdp", "tp", "fsdp_tp", "replicated"),
                     help="logical axis rules (default fsdp; fsdp_tp with a model axis)")
  p_dry.add_argument("--hbm-gib", type=float, help="device memory to compare with, GiB")
  p_dry.set_defaults(handler=_dryrun)
  _debug_flag(p_dry)
  p_methods = sub.add_parser("methods",
                             help="every method spec with its arguments, defaults and docs")
  _plugin_flag(p_methods)
  p_methods.set_defaults(handler=_methods)
  _debug_flag(p_methods)
  p_light = sub.add_parser("lighthouse", help="the quorum service of an elastic run (sites "
                           "started with dadjax train --lighthouse HOST:PORT --site I)")
  from dadjax.elastic import add_lighthouse_arguments, serve_lighthouse  # pylint: disable=g-import-not-at-top
  add_lighthouse_arguments(p_light)
  p_light.set_defaults(handler=serve_lighthouse)
  _debug_flag(p_light)
  from dadjax.netlab import add_parser as add_netlab  # pylint: disable=g-import-not-at-top
  add_netlab(sub, _debug_flag)
  return parser


def describe_methods() -> str:
  """Every method and compressor spec with its arguments, defaults and docs (``dadjax methods``)."""
  from dadjax import registry  # pylint: disable=g-import-not-at-top
  lines = [
      "Method specs (dadjax train method=SPEC). Write arguments as NAME:A:B:KEY=V or",
      "NAME(A, B, KEY=V); specs nest: ef(topk:0.01), accordion(powersgd:2, powersgd:1).",
  ]

  def block(title: str, group: list) -> None:
    lines.append("")
    lines.append(title)
    for e in group:
      head = e.form() + (f"  (also: {', '.join(e.aliases)})" if e.aliases else "")
      lines.append(f"  {head}")
      lines.append(f"      {e.doc}")
      for a in e.args:
        lines.append(f"      {a.describe()}")

  families: dict[str, list] = {"baseline": []}
  for e in registry.entries("method"):
    families.setdefault(e.family, []).append(e)
  for family, group in families.items():
    block(f"[{family}] methods", group)
  block("[compress] compressors (each is also a method: compressed all-reduce of the gradient)",
        registry.entries("compressor"))
  return "\n".join(lines)


def _methods(args: argparse.Namespace) -> int:
  del args
  print(describe_methods())
  return 0


def _plot(args: argparse.Namespace) -> int:
  import pathlib  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(args.run_dir) / "metrics.jsonl"
  try:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  except OSError as e:
    raise DadjaxError(f"cannot read {str(path)!r}: {e.strerror or e}; RUN_DIR must be a run's "
                      "out_dir") from None
  except json.JSONDecodeError as e:
    raise DadjaxError(f"{str(path)!r} is not JSON lines: {e}") from None
  from dadjax.adaptive import plot_decisions  # pylint: disable=g-import-not-at-top
  out = args.out or str(pathlib.Path(args.run_dir) / "decisions.png")
  try:
    plot_decisions(rows, out, title=rows[-1].get("method", "Accordion") if rows else "Accordion")
  except ValueError as e:
    raise DadjaxError(f"{str(path)!r}: {e} (train with an accordion(...) method)") from None
  print(f"wrote {out}")
  return 0


def _many_processes(args: argparse.Namespace) -> bool:
  return args.distributed is not None or any(
      v is not None for v in (args.coordinator, args.num_processes, args.process_id))


def _train(args: argparse.Namespace) -> int:
  if (args.lighthouse is None) != (args.site is None):
    raise DadjaxError("--lighthouse and --site go together (one site of an elastic run)")
  if args.lighthouse is not None:
    return _train_site(args)
  if _many_processes(args) and not os.environ.get(_SUPERVISED_ENV):
    return _supervise(args.argv, args.process_id)
  from dadjax.run._config import load_config  # pylint: disable=g-import-not-at-top
  config = load_config(args.config, args.overrides)
  # Many processes: each brings its own devices (on CPU: XLA_FLAGS' device count).
  many = _distributed(args)
  if not many:
    # Read the config first: shard_map over num_sites sites needs that many devices.
    _simulate_devices(max(DEFAULT_DEVICES, config.num_sites * config.per_site))
  from dadjax.run._metrics_file import json_row  # pylint: disable=g-import-not-at-top
  from dadjax.run._loop import train  # pylint: disable=g-import-not-at-top
  printed = []

  def log(row: dict) -> None:
    print(json_row(row), flush=True)
    printed.append(row)

  run = train(config, progress=not args.no_progress, restart=args.restart, log=log)
  if run.history and (not printed or printed[-1] is not run.final):
    print(json_row(run.final))  # a resumed run that had finished logs nothing new
  if many:
    import jax  # pylint: disable=g-import-not-at-top
    jax.distributed.shutdown()
  return 0


def _train_site(args: argparse.Namespace) -> int:
  """``dadjax train --lighthouse HOST:PORT --site I``: one site, its own JAX program."""
  if _many_processes(args):
    raise DadjaxError("--lighthouse runs one site per process: it takes none of --distributed, "
                      "--coordinator, --num-processes, --process-id")
  from dadjax.run._config import load_config  # pylint: disable=g-import-not-at-top
  config = load_config(args.config, args.overrides)
  from dadjax.run._elastic import train_site  # pylint: disable=g-import-not-at-top
  from dadjax.run._metrics_file import json_row  # pylint: disable=g-import-not-at-top
  try:
    train_site(config, args.lighthouse, args.site,
               log=lambda row: print(json_row(row), flush=True))
  except ConnectionError as e:  # LighthouseUnreachable
    raise DadjaxError(str(e)) from None
  return 0


def _supervise(argv: list[str], process_id: int | None) -> int:
  """Run ``dadjax ARGV`` as a supervised child process; return its exit code.

  The child's stdout is this process's; its stderr passes through here, so
  that JAX's abort (its log lines and stack dump) can be replaced by one
  ``dadjax: error:`` line naming the lost process, the step and the last
  checkpoint (the child's peer watch reports those on a pipe).

  Args:
    argv: the command line to run again (``train ...``).
    process_id: this process's rank, if given (to name the other one).

  Returns:
    The child's exit code; 2 when JAX aborted it because a process was lost;
    ``128 + signal`` when it died of another signal.
  """
  import threading  # pylint: disable=g-import-not-at-top
  child, status_r = _start_worker(argv)
  forwarded = _forward_signals(child)
  status = ["0", None]  # the child's step and last checkpoint
  reader = threading.Thread(target=_read_status, args=(status_r, status), daemon=True)
  reader.start()
  aborting, held, said = _pass_stderr(child)
  code = child.wait()
  reader.join(2)
  if code >= 0:
    return code
  return _died(child.pid, -code, status, aborting=aborting, held=held, said=said,
               forwarded=forwarded, process_id=process_id)


def _start_worker(argv: list[str]):
  """``(child, status_r)``: ``dadjax ARGV`` started as the supervised worker, and the read end
  of the pipe its peer watch reports its step and last checkpoint on."""
  import subprocess  # pylint: disable=g-import-not-at-top
  from dadjax.run._peers import STATUS_FD_ENV  # pylint: disable=g-import-not-at-top
  status_r, status_w = os.pipe()
  env = {**os.environ, _SUPERVISED_ENV: "1", STATUS_FD_ENV: str(status_w)}
  try:
    child = subprocess.Popen([sys.executable, "-m", "dadjax.cli", *argv], env=env,
                             stderr=subprocess.PIPE, pass_fds=(status_w,),
                             process_group=0,  # a terminal's Ctrl-C reaches it once, from here
                             preexec_fn=_die_with_parent())
  finally:
    os.close(status_w)
  return child, status_r


def _forward_signals(child) -> list[int]:
  """Forward the signals of ``_FORWARDED`` to ``child``; returns the list they are noted in."""
  import signal  # pylint: disable=g-import-not-at-top
  forwarded: list[int] = []

  def forward(signum, frame):
    del frame
    forwarded.append(signum)
    try:
      child.send_signal(signum)
    except ProcessLookupError:
      pass

  for name in _FORWARDED:
    signal.signal(getattr(signal, name), forward)
  return forwarded


def _read_status(status_r: int, status: list) -> None:
  """Keep ``status`` at the last ``step checkpoint`` line the worker wrote (``-``: none)."""
  pending = b""
  while chunk := os.read(status_r, 4096):
    *lines, pending = (pending + chunk).split(b"\n")
    if lines and len(fields := lines[-1].decode(errors="replace").split()) == 2:
      status[:] = [fields[0], None if fields[1] == "-" else fields[1]]
  os.close(status_r)


def _pass_stderr(child) -> tuple[bool, bytes, bool]:
  """Pass the worker's stderr on until it closes; from JAX's abort on keep it back.

  Returns:
    ``(aborting, held, said)``: whether JAX's abort was seen, what was kept
    back from it on (only its ``dadjax:`` lines are passed on), and whether
    the worker printed a lost process's line itself.
  """
  import re  # pylint: disable=g-import-not-at-top
  out = sys.stderr.buffer
  seen = b""  # the last bytes passed on, to find a marker cut across two reads
  held = b""  # from JAX's abort on: kept back, only dadjax's own lines are passed on
  aborting = False
  said = False  # the child printed a lost process's line itself
  fd = child.stderr.fileno()
  while chunk := os.read(fd, 65536):
    if not aborting:
      both = seen + chunk
      at = min((i for i in (both.find(m) for m in _JAX_ABORT) if i >= 0), default=-1)
      if at >= 0:
        aborting = True
        start = max(both.rfind(b"\n", 0, at) + 1, len(seen))
        chunk, held = both[len(seen):start], both[start:]
      out.write(chunk)
      out.flush()
      said = said or re.search(rb"dadjax: error: process \d+ (stopped responding|failed)",
                               seen + chunk) is not None
      seen = (seen + chunk)[-400:]
    else:
      held += chunk
  own = [line for line in held.split(b"\n") if line.startswith(b"dadjax:")]
  for line in own:
    out.write(line + b"\n")
  out.flush()
  said = said or any(re.match(rb"dadjax: error: process \d+ ", line) for line in own)
  return aborting, held, said


def _died(pid: int, signum: int, status: list, *, aborting: bool, held: bytes, said: bool,
          forwarded: list[int], process_id: int | None) -> int:
  """The exit code (and line) of a worker that died of ``signum``."""
  import re  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  step, kept = status
  kept_text = (f"the last checkpoint is step {kept}" if kept is not None
               else "no checkpoint was finished")
  if aborting and signum == signal.SIGABRT:
    if not said:
      text = held.decode(errors="replace")
      why = re.search(r"absl::Status: ([^\n]*)", text) or re.search(
          r"coordination service[^\n]*?\] ([^\n]*)", text)
      why = (why.group(1) if why else "it aborted this process").strip()
      why = why.split(". ")[0].rstrip(".")  # its first sentence: what failed
      why = why if len(why) <= 160 else why[:157] + "..."
      tasks = {int(t) for t in re.findall(r"/task:(\d+)", text)} - {process_id}
      lost = min(tasks) if tasks else 0
      print(f"dadjax: error: process {lost} stopped responding at step {step} (JAX's "
            f"coordination service: {why}); {kept_text}; restart all processes to resume",
            file=sys.stderr, flush=True)
    return 2
  if signum in forwarded:  # a forwarded signal the worker leaves as usual: end the same way
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
  try:
    name = signal.Signals(signum).name
  except ValueError:
    name = f"signal {signum}"
  print(f"dadjax: error: the training process (pid {pid}) was ended by {name} at step "
        f"{step} (a signal from outside, the out-of-memory killer, or a crash: see the output "
        f"above); {kept_text}", file=sys.stderr, flush=True)
  return 128 + signum


def _die_with_parent():
  """A ``preexec_fn`` that has the kernel kill the child when this process dies (Linux)."""
  if not sys.platform.startswith("linux"):
    return None
  import ctypes  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
  except (OSError, AttributeError):
    return None
  parent = os.getpid()

  def setup():
    prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
      os._exit(137)  # pylint: disable=protected-access

  return setup


def _compile(args: argparse.Namespace) -> int:
  topology = args.topology
  if topology.startswith("cpu:") and topology[4:].isdigit():
    _simulate_devices(int(topology[4:]) * max(1, args.slices))
  from dadjax.models import parse_mesh  # pylint: disable=g-import-not-at-top
  from dadjax.pod import compile_config  # pylint: disable=g-import-not-at-top
  from dadjax.run._config import load_config  # pylint: disable=g-import-not-at-top
  try:
    config = load_config(args.config, args.overrides)
    mesh = parse_mesh(args.mesh) if args.mesh else None
    report = compile_config(config, topology, args.slices, mesh=mesh)
  except ValueError as e:
    raise DadjaxError(str(e)) from None
  print(report.to_json() if args.json else report.table())
  return 0


def _dryrun(args: argparse.Namespace) -> int:
  from dadjax.run._config import load_config  # pylint: disable=g-import-not-at-top
  from dadjax.models import gpt_dry_run  # pylint: disable=g-import-not-at-top
  try:
    config = load_config(args.config, args.overrides)
    print(gpt_dry_run(config, mesh=args.mesh, rules=args.rules, hbm_gib=args.hbm_gib))
  except ValueError as e:
    raise DadjaxError(str(e)) from None
  return 0


def _demo(args: argparse.Namespace) -> int:
  _simulate_devices(DEFAULT_DEVICES)
  from dadjax.run._demo import DEFAULT_METHODS, run_demo  # pylint: disable=g-import-not-at-top
  from dadjax.registry import split_specs  # pylint: disable=g-import-not-at-top
  methods = split_specs(args.methods) if args.methods else tuple(DEFAULT_METHODS)
  run_demo(methods, steps=args.steps, out_dir=args.out, progress=not args.no_progress)
  return 0


def _run(args: argparse.Namespace) -> int:
  """Run a parsed command; the library's own errors become one line and exit code 2.

  A run stopped by SIGTERM / SIGINT (its step saved) prints ``dadjax: stopped
  by SIGTERM at step N; ...`` and exits with ``128 + signal`` (143 / 130).
  """
  try:
    if getattr(args, "plugin", None) is not None:
      from dadjax.registry import load_plugins  # pylint: disable=g-import-not-at-top
      load_plugins(args.plugin)
    return args.handler(args)
  except Stopped as e:  # a signal: the step was saved (see dadjax/_signals.py)
    print(f"dadjax: {e}", file=sys.stderr, flush=True)
    return e.exit_code
  except DadjaxError as e:
    if args.debug:
      traceback.print_exc()
    print(f"dadjax: error: {e}", file=sys.stderr, flush=True)
    return 2


def _parse(argv) -> argparse.Namespace:
  """Parse ``argv``; ``train``'s (``dryrun``'s) ``key=value`` overrides may sit between flags."""
  parser = _parser()
  args, extra = parser.parse_known_args(argv)
  if extra and getattr(args, "command", None) in ("train", "dryrun", "compile"):
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if not stray:
      args.overrides = [*args.overrides, *extra]
      return args
  if extra:
    parser.error(f"unrecognized arguments: {' '.join(extra)}")
  return args


def main(argv=None) -> int:
  """The ``dadjax`` command; returns the exit code.

  Output cut short by its reader (``dadjax methods | head``) ends quietly.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    args = _parse(argv)
    args.argv = argv  # a supervised `train` runs the same command line again
    code = _run(args)
    sys.stdout.flush()
    return code
  except BrokenPipeError:
    # Python's recipe: point stdout at devnull so the interpreter's final flush is silent.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a shell reports for a command cut off by a pipe


if __name__ == "__main__":
  sys.exit(main())
