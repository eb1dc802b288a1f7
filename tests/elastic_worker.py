"""One site of an elastic DiLoCo run, as its own process (tests/test_elastic.py starts 2-4).

    python tests/elastic_worker.py ADDRESS SITE --steps 60 --every 5 [--die-in-sync ROUND]
        [--checkpoint DIR] [--step-sleep S] [--compressor SPEC]

A small MLP regression; each site's rows come from its own slice of one synthetic
problem (so the sites' data differ). Prints one JSON line per round on stdout and the
``dadjax: elastic:`` lines on stderr. ``--die-in-sync ROUND`` sends that round's
contribution and then kills the process before the reply (a loss during a
synchronization).
"""

import argparse
import json
import os
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dadjax.elastic as elastic
from dadjax.elastic import _site

IN, HIDDEN, ROWS = 8, 16, 16


def in_threads(fn, sites, timeout_s: float = 300.0) -> dict:
  """``{site: fn(site)}`` with each site in a thread of its own; a site's exception is raised
  here, in the caller's thread."""
  out, errors = {}, []

  def go(site):
    try:
      out[site] = fn(site)
    except Exception as e:  # noqa: BLE001 - reraised below, in the caller's thread
      errors.append(e)

  threads = [threading.Thread(target=go, args=(s,)) for s in sites]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=timeout_s)
  if errors:
    raise errors[0]
  return out

def init_params(seed: int = 0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN), "b1": jnp.zeros(HIDDEN),
          "w2": jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN), "b2": jnp.zeros(1)}


def loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


_TRUE = np.random.default_rng(123).normal(size=(IN, 1)).astype(np.float32)


def batch_at(site: int, step: int):
  rng = np.random.default_rng([site, step])
  x = rng.normal(loc=0.3 * site, size=(ROWS, IN)).astype(np.float32)
  y = np.tanh(x @ _TRUE) + 0.05 * rng.normal(size=(ROWS, 1)).astype(np.float32)
  return {"x": x, "y": y}


def method(every: int, compressor=None) -> elastic.ElasticDiLoCo:
  return elastic.ElasticDiLoCo(loss_fn, optax.adam(1e-2), every,
                               outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
                               compressor=compressor)


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("address")
  p.add_argument("site", type=int)
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--every", type=int, default=5)
  p.add_argument("--die-in-sync", type=int, default=-1)
  p.add_argument("--checkpoint", default=None)
  p.add_argument("--step-sleep", type=float, default=0.0)
  p.add_argument("--compressor", default=None)
  args = p.parse_args()

  if args.die_in_sync >= 0:  # send round R's contribution, then die before the reply
    request = _site._request

    def dying_request(address, header, arrays=(), timeout_s=600.0):
      if header["kind"] == "sync" and header["round"] == args.die_in_sync:
        import socket  # pylint: disable=g-import-not-at-top
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        _site.send(sock, header, arrays)
        print(json.dumps({"dying_in_sync": header["round"]}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
      return request(address, header, arrays, timeout_s)

    _site._request = dying_request

  def slow_batch(site, step):
    if args.step_sleep:
      import time  # pylint: disable=g-import-not-at-top
      time.sleep(args.step_sleep)
    return batch_at(site, step)

  run = elastic.run_site(method(args.every, args.compressor), init_params(), slow_batch,
                         lighthouse=args.address, site=args.site, steps=args.steps,
                         checkpoint_dir=args.checkpoint,
                         on_round=lambda row, _: print(json.dumps(row), flush=True))
  flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(run.anchor)])
  print(json.dumps({"final": flat.tolist(), "site": args.site}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
