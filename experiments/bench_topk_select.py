"""TopK's selection at high ratios: ``jax.lax.top_k`` against the complement of the smallest.

For each ratio, on ``--sites`` rows of ``--size`` entries (default: the
Fashion-MNIST CNN's dense kernel, 3136 x 256, on 8 sites under ``vmap``),
times ``jax.lax.top_k(|x|, k)`` and
:func:`dadjax.extend.largest_magnitude_indices` (which drops the
``size - k`` smallest when ``k`` is above half the size) after compiling,
interleaved, median of ``--repeats``; prints their ratio and whether the
two kept the same set of indices.

Usage::

  python experiments/bench_topk_select.py [--size 802816 --sites 8 --ratios 0.99,0.9,0.5,0.1,0.01]

Not :func:`dadjax.run.train`: it times one kernel on random rows.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from dadjax.extend import largest_magnitude_indices


def _time(fn, x) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(x))
  return time.perf_counter() - start


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--size", type=int, default=3136 * 256)
  p.add_argument("--sites", type=int, default=8)
  p.add_argument("--ratios", default="0.99,0.9,0.5,0.1,0.01")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args(argv)
  x = jax.random.normal(jax.random.key(0), (args.sites, args.size))
  print(f"{args.sites} sites x {args.size} entries, jax {jax.__version__}, "
        f"{jax.devices()[0].platform}; median of {args.repeats} interleaved calls\n")
  print("| ratio | top_k (ms) | largest_magnitude_indices (ms) | top_k / it | same set |")
  print("|---|---|---|---|---|")
  for ratio in (float(r) for r in args.ratios.split(",")):
    k = min(args.size, max(1, round(ratio * args.size)))
    plain = jax.jit(jax.vmap(lambda v, k=k: jax.lax.top_k(jnp.abs(v), k)[1]))
    chosen = jax.jit(jax.vmap(lambda v, k=k: largest_magnitude_indices(v, k)))
    same = all(set(np.asarray(a).tolist()) == set(np.asarray(b).tolist())
               for a, b in zip(plain(x), chosen(x)))
    times = np.array([(_time(plain, x), _time(chosen, x)) for _ in range(args.repeats)])
    t_plain, t_chosen = np.median(times, axis=0) * 1e3
    print(f"| {ratio:g} | {t_plain:.1f} | {t_chosen:.1f} | {t_plain / t_chosen:.2f} | {same} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
