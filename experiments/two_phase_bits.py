"""Wire bits per site of each elementwise compressor on its one-round and two-phase routes.

Runs one compressed update (``dadjax.compress.compressed``) of every spec on
an MLP's gradient shapes over N simulated sites (``jax.vmap(axis_name=...)``),
reads the ledger through :func:`dadjax.comm.report` and prints the ring wire
bits per site, per gradient entry and against the fp32 all-reduce, for each
route and N; ``auto`` shows the route it took. Not :func:`dadjax.run.train`:
no model is trained, one exchange of random gradients is the measurement.

    python experiments/two_phase_bits.py --hidden 256,256 --sites 8,64 \\
        --out experiments/results/two_phase_bits.md
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp

import dadjax
from dadjax import compress as C

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

SPECS = ("qsgd:7", "qsgd:16", "terngrad", "quantize:4", "sign", "scaled_sign", "fp8",
         "cast:fp8_e5m2", "bf16")


def mlp_shapes(inputs: int, hidden: tuple[int, ...], classes: int) -> dict:
  widths = (inputs,) + hidden + (classes,)
  return {f"layer{i}": {"kernel": (a, b), "bias": (b,)}
          for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))}


def wire(spec: str, shapes: dict, n: int) -> tuple[float, int, str]:
  """(ring wire bits per site, dense bits, route taken) of one update of ``spec`` over n sites."""
  like = jax.tree.map(lambda s: jnp.zeros(s), shapes, is_leaf=lambda x: isinstance(x, tuple))
  leaves, treedef = jax.tree.flatten(like)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  grads = jax.tree.unflatten(treedef, [jax.random.normal(k, (n,) + x.shape)
                                       for k, x in zip(keys, leaves)])
  compressor = C.get_compressor(spec)
  tx = C.compressed(compressor, axis_name="sites")
  state = jax.vmap(tx.init)(grads)
  _, state = jax.jit(jax.vmap(tx.update, axis_name="sites"))(grads, state)
  rep = dadjax.comm.report(state, dadjax.comm.NetworkModel(num_sites=n))
  dense = sum(x.size for x in leaves) * 32
  return rep.wire_bits_per_step, dense, C.chosen_route(compressor, like, n)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--inputs", type=int, default=784)
  parser.add_argument("--hidden", default="256,256")
  parser.add_argument("--classes", type=int, default=10)
  parser.add_argument("--sites", default="8,64")
  parser.add_argument("--specs", default=",".join(SPECS))
  parser.add_argument("--out", default=None, help="write the table (markdown) here")
  args = parser.parse_args(argv)
  hidden = tuple(int(h) for h in args.hidden.split(","))
  shapes = mlp_shapes(args.inputs, hidden, args.classes)
  sites = [int(n) for n in args.sites.split(",")]
  head = "| spec | " + " | ".join(
      f"N={n} one_round | N={n} two_phase | N={n} auto takes" for n in sites) + " |"
  lines = [head, "|---|" + "---|---|---|" * len(sites)]
  entries = None
  for spec in args.specs.split(","):
    cells = []
    for n in sites:
      one, dense, _ = wire(spec, shapes, n)
      two, _, _ = wire(f"{spec}:route=two_phase", shapes, n)
      like = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
      took = C.chosen_route(C.get_compressor(f"{spec}:route=auto"), like, n)
      entries = dense // 32
      fp32 = 2 * (n - 1) / n * dense
      cells += [f"{one / entries:.2f} ({fp32 / one:.1f}x)", f"{two / entries:.2f} ({fp32 / two:.1f}x)",
                took]
    lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    print(lines[-1], flush=True)
  command = harness.command_line("two_phase_bits.py", argv if argv is not None else sys.argv[1:])
  text = (f"# Wire bits per gradient entry: one-round and two-phase routes\n\n"
          f"Command: `{command}` (MLP {args.inputs}-{args.hidden.replace(',', '-')}-"
          f"{args.classes}, {entries:,} entries; one compressed update per spec over N sites "
          f"simulated with jax.vmap, the ledger read by dadjax.comm.report). Each cell: ring wire "
          "bits per site per gradient entry, and in parentheses the fp32 all-reduce's wire bits "
          "over the method's (2 (N-1)/N x 32 per entry). `auto takes`: the route "
          "`route=auto` took at that N.\n\n" + "\n".join(lines) + "\n")
  if args.out:
    pathlib.Path(args.out).write_text(text)
  print(text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
