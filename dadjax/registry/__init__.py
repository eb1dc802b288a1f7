"""Methods by name: one catalog, one spec grammar, one error.

Every family declares its methods where it defines them, with a decorator
that names the method, types its arguments (defaults, allowed ranges) and
documents it::

    @register_compressor("topk", Arg("ratio", float, within="(0, 1]", doc="fraction kept"))
    def topk(ratio: float = 0.01) -> Compressor: ...

A method builder takes the :class:`BuildContext` (``axis_name``, ``seed``,
``steps_per_epoch``, ``lr_schedule``) as its first argument and returns a
:class:`Method` (or an optax transformation, which becomes
``Method(tx=...)``); arguments typed :data:`COMPRESSOR` arrive built::

    @register_method("accordion", Arg("low", COMPRESSOR), Arg("high", COMPRESSOR),
                     Arg("eta", float, within="(0, inf)", doc="critical threshold"),
                     doc="Accordion: low in critical regimes, high otherwise")
    def _accordion(ctx, low, high, eta=0.5):
      return Method(tx=accordion(low, high, eta=eta, axis_name=ctx.axis_name, seed=ctx.seed))

Two kinds live here. A *compressor* spec builds a
:class:`~dadjax.compress.Compressor`; a *method* spec builds a
:class:`Method` (what the train step needs). Every compressor spec is
also a method spec: the compressor, communicated by
:func:`dadjax.compress.compressed`.

Spec syntax (names are case-insensitive, values keep their case)::

    name                               topk, dad, allreduce
    name:arg:arg:key=value             topk:0.01, rank_dad:2:two_way:warm, qsgd:4:bucket_size=512
    name(arg, arg, key=value)          qsgd(4, bucket_size=512)
    nested specs as arguments          ef(topk:0.01), accordion(powersgd:2, powersgd:1),
                                       dataquant:2:correct=topk(0.1):gate=0.5

Positional arguments fill the non-flag arguments in order; a flag (a
``bool`` argument) is set by its bare name (``rank_dad:2:two_way``) or by
``name=true``. A nested spec with arguments of its own needs the
parenthesized form inside a colon spec (``correct=topk(0.1)``); inside
parentheses either form works. ``ef_<compressor>`` means
``ef(<compressor>)`` (a prefix alias).

The pieces: ``_grammar`` (text <-> :class:`Spec`), ``_args`` (typed
:class:`Arg`), ``_method`` (:class:`Method`, :class:`BuildContext`) and
``_catalog`` (registering, lookup, :func:`resolve`, :func:`build`). This
package imports nothing from ``dadjax`` but its error types; ``import
dadjax`` imports every family package, which registers its entries, and
installed plugins (entry-point group ``dadjax.methods``) are loaded by
:func:`load_plugins` or on the first unknown name.
"""

from dadjax.registry._args import COMPRESSOR, METHOD, Arg
from dadjax.registry._catalog import (
    KINDS,
    PLUGIN_GROUP,
    ArgumentError,
    Entry,
    Resolved,
    SpecError,
    build,
    entries,
    get_compressor,
    lift_compressors,
    load_plugins,
    lookup,
    parse_spec,
    register,
    register_compressor,
    register_method,
    resolve,
    unregister,
    valid_forms,
)
from dadjax.registry._grammar import Spec, format_spec, split_specs
from dadjax.registry._method import BuildContext, Method

__all__ = [
    "Arg",
    "ArgumentError",
    "BuildContext",
    "COMPRESSOR",
    "Entry",
    "KINDS",
    "METHOD",
    "Method",
    "PLUGIN_GROUP",
    "Resolved",
    "Spec",
    "SpecError",
    "build",
    "entries",
    "format_spec",
    "get_compressor",
    "lift_compressors",
    "load_plugins",
    "lookup",
    "parse_spec",
    "register",
    "register_compressor",
    "register_method",
    "resolve",
    "split_specs",
    "unregister",
    "valid_forms",
]
