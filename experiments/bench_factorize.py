"""rank-dAD's two power iterations side by side on one layer: time and approximation error.

``factorize(method="deflated")`` (one component at a time) against
``method="block"`` (all at once), on the rows of one dense layer (default:
the ViT's MLP input layer on one site, 520 rows, 512 -> 2048), with the
Eckart-Young optimum of the rank-r approximation for reference. Prints the
median of ``--repeats`` timed calls of each (after compiling), their ratio,
and the relative errors ``||G - u v^T|| / ||G||``.

Usage::

  python experiments/bench_factorize.py [--rows 520 --d-in 512 --d-out 2048 --rank 4]

Not :func:`dadjax.run.train`: it times one kernel on random matrices.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from dadjax.extend import factorize


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", type=int, default=520)
  p.add_argument("--d-in", type=int, default=512)
  p.add_argument("--d-out", type=int, default=2048)
  p.add_argument("--rank", type=int, default=4)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--repeats", type=int, default=7)
  args = p.parse_args(argv)
  rng = np.random.default_rng(0)
  # Inputs with a decaying spectrum (as layer inputs have), deltas white.
  a = (rng.standard_normal((args.rows, args.d_in))
       / np.sqrt(np.arange(1, args.d_in + 1))).astype(np.float32)
  d = rng.standard_normal((args.rows, args.d_out)).astype(np.float32)
  g = a.astype(np.float64).T @ d
  s = np.linalg.svd(g, compute_uv=False)
  optimum = np.sqrt(np.sum(s[args.rank:] ** 2)) / np.linalg.norm(g)
  times, errors = {}, {}
  for method in ("deflated", "block"):
    run = jax.jit(lambda a, d, m=method: factorize(a, d, rank=args.rank, iters=args.iters,
                                                   tol=1e-3, key=jax.random.key(0), method=m))
    fac = jax.block_until_ready(run(a, d))
    samples = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(run(a, d))
      samples.append(time.perf_counter() - t0)
    times[method] = float(np.median(samples))
    errors[method] = float(np.linalg.norm(g - np.asarray(fac.u @ fac.v.T, np.float64))
                           / np.linalg.norm(g))
  print(f"layer: {args.rows} rows, {args.d_in} -> {args.d_out}, rank {args.rank}, "
        f"iters {args.iters}; jax {jax.__version__} on {jax.devices()[0].platform}")
  for method in times:
    print(f"{method:>8}: {1e3 * times[method]:7.1f} ms  relative error {errors[method]:.5f}")
  print(f" optimum: relative error {optimum:.5f}; deflated / block time: "
        f"{times['deflated'] / times['block']:.2f}x")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
