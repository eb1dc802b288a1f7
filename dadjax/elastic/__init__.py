"""Sites that come and go: elastic DiLoCo over a quorum service (torchft's pattern, in JAX).

JAX's multi-process runtime fixes its process set when it starts
(``python experiments/elastic_runtime.py`` measures it), so each site of an
elastic run is its own JAX program, and the outer step goes through a
:class:`Lighthouse` the run starts with, not through a JAX collective:

* :class:`Lighthouse`: forms a quorum at each outer synchronization (drops
  a site that does not contribute within ``quorum_timeout_s``), returns the
  weighted mean over the quorum, and relays a live site's state to a joiner.
* :func:`run_site` with an :class:`ElasticDiLoCo`: one site's training
  (inner steps under ``jit``, the outer step on the mean), fp32, bf16 or
  through a dadjax compressor; :func:`streaming_diloco`, :func:`sparseloco`
  and :func:`demo` its Streaming DiLoCo, SparseLoCo and DeMo forms.
* ``python -m dadjax.elastic --port 5555 --expected-sites 4`` (or ``dadjax
  lighthouse``): a lighthouse on its own; ``dadjax train --lighthouse HOST:PORT
  --site I`` one site of a config (:func:`dadjax.run.train_site`).

See the guide ``docs/elastic.md``.
"""

from dadjax.elastic._lighthouse import Lighthouse
from dadjax.elastic._serve import add_lighthouse_arguments, serve_lighthouse
from dadjax.elastic._site import (DecayingMemory, ElasticDiLoCo, LighthouseUnreachable, SiteRun,
                                  SiteState, demo, run_site, sparseloco, streaming_diloco)

__all__ = ["DecayingMemory", "ElasticDiLoCo", "Lighthouse", "LighthouseUnreachable", "SiteRun",
           "SiteState", "add_lighthouse_arguments", "demo", "run_site", "serve_lighthouse", "sparseloco",
           "streaming_diloco"]
