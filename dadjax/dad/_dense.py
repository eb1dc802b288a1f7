"""The dAD dense layer's names in one place (the implementation is split by concept).

* :mod:`dadjax.dad._config`: :class:`DadConfig` and the mode names;
* :mod:`dadjax.dad._state`: the ``"dad_state"`` entry;
* :mod:`dadjax.dad._routes`: the backward pass of each route (metered);
* :mod:`dadjax.dad._quantized`: quantized dAD's payload (``quantize_bits``);
* :mod:`dadjax.dad._cost`: the routes' cost model (bits from the payloads);
* :mod:`dadjax.dad._vjp`: the ``custom_vjp`` and :func:`dense`;
* :mod:`dadjax.dad._layer`: the one layer route every dAD layer runs;
* :mod:`dadjax.dad._module`: the linen :class:`Dense` and :class:`DotGeneral`;
* :mod:`dadjax.dad._nnx`: the NNX :class:`NnxDotGeneral`.
"""

from dadjax.dad._config import AGGREGATIONS, MODES, ROUTES, DadConfig  # noqa: F401
from dadjax.dad._cost import choose_route, layer_bits, layer_route, layer_traffic  # noqa: F401
from dadjax.dad._module import Dense  # noqa: F401
from dadjax.dad._state import STATE_NAME, current_state, init_state, next_state  # noqa: F401
from dadjax.dad._vjp import dense  # noqa: F401
