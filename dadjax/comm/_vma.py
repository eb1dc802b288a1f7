"""The Flax collections the layers and the train step share.

Named here so the layers do not depend on the train step:

* :data:`COMM_COLLECTION` (``"comm"``): bits a layer hands to collectives in
  its backward pass, sown as :class:`~dadjax.comm.Bits`.
* :data:`STATE_COLLECTION` (``"dad_state"``): layer state that the train
  step differentiates and overwrites with its cotangent.

Variance typing under ``shard_map`` lives in :mod:`dadjax._core.vma`.
"""

COMM_COLLECTION = "comm"
STATE_COLLECTION = "dad_state"
