"""The method registry: nested spec parsing, typed arguments, the one error, `dadjax methods`."""

import math
import subprocess
import sys

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import given, settings

import dadjax
from dadjax import cli, compress, registry
from dadjax.registry import _args
from dadjax.methods import build_method
from dadjax.models import MLP
from dadjax.registry import (COMPRESSOR, METHOD, Arg, Method, Spec, SpecError, format_spec,
                             parse_spec)

S = Spec


# -- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, tree", [
    ("topk", S("topk")),
    ("topk:0.01", S("topk", ("0.01",))),
    ("  TopK:0.01 ", S("topk", ("0.01",))),
    ("topk(0.01)", S("topk", ("0.01",))),
    ("sign()", S("sign")),
    ("rank_dad:2:two_way:warm:ef", S("rank_dad", ("2", "two_way", "warm", "ef"))),
    ("qsgd:4:bucket_size=512", S("qsgd", ("4",), (("bucket_size", "512"),))),
    ("ef_topk:0.01", S("ef_topk", ("0.01",))),
    ("ef(topk:0.01)", S("ef", (S("topk", ("0.01",)),))),
    ("ef(sign)", S("ef", ("sign",))),
    ("accordion(powersgd:2,powersgd:1)",
     S("accordion", (S("powersgd", ("2",)), S("powersgd", ("1",))))),
    ("accordion(ef(topk:0.5), topk(0.1), eta=0.25)",
     S("accordion", (S("ef", (S("topk", ("0.5",)),)), S("topk", ("0.1",))), (("eta", "0.25"),))),
    ("dataquant:2:correct=ef_scaled_sign:gate=0.5",
     S("dataquant", ("2",), (("correct", "ef_scaled_sign"), ("gate", "0.5")))),
    ("dataquant(2, correct=topk:0.1, gate=0.5)",
     S("dataquant", ("2",), (("correct", S("topk", ("0.1",))), ("gate", "0.5")))),
    ("dataquant:2:correct=topk(0.1):gate=0.5",
     S("dataquant", ("2",), (("correct", S("topk", ("0.1",))), ("gate", "0.5")))),
    ("terngrad:clip=-1e-3", S("terngrad", (), (("clip", "-1e-3"),))),
])
def test_parse_tree(text, tree):
  assert parse_spec(text) == tree
  assert parse_spec(format_spec(tree)) == tree


@pytest.mark.parametrize("text, canonical", [
    ("topk(0.01)", "topk:0.01"),
    ("sign()", "sign"),
    ("dataquant:2:correct=topk(0.1):gate=0.5", "dataquant(2, correct=topk:0.1, gate=0.5)"),
    ("accordion(powersgd:2,powersgd:1)", "accordion(powersgd:2, powersgd:1)"),
])
def test_canonical_text(text, canonical):
  assert str(parse_spec(text)) == canonical


def test_split_specs_keeps_nested_commas():
  text = " topk:0.01, accordion(powersgd:2,powersgd:1),dataquant(2, correct=topk:0.1) ,"
  assert registry.split_specs(text) == [
      "topk:0.01", "accordion(powersgd:2,powersgd:1)", "dataquant(2, correct=topk:0.1)"]


_names = st.sampled_from(["a", "topk", "ef", "rank_dad", "x1", "two_way"])
_atoms = st.one_of(_names, st.sampled_from(["0", "0.01", "-2.5", "1e-3", "inf", "none", "16"]))


def _specs(depth):
  value = _atoms if depth == 0 else st.one_of(_atoms, _specs(depth - 1))
  kwargs = st.dictionaries(st.sampled_from(["k", "gate", "correct", "eta"]), value, max_size=2)
  return st.builds(
      lambda name, args, kw: Spec(name, tuple(args), tuple(kw.items())),
      _names, st.lists(value, max_size=3), kwargs,
  ).filter(lambda s: s.args or s.kwargs)


@settings(max_examples=200, deadline=None)
@given(_specs(2))
def test_round_trip(tree):
  text = format_spec(tree)
  assert parse_spec(text) == tree
  assert format_spec(parse_spec(text)) == text


# -- the one error -----------------------------------------------------------------------


def _assert_lists_every_form(err, kind):
  msg = str(err)
  assert "valid forms:" in msg
  for form in registry.valid_forms(kind):
    assert form in msg, form


@pytest.mark.parametrize("text, why", [
    ("", "empty"),
    ("nope", "unknown method 'nope': no method named 'nope'"),
    ("nope:1", "unknown method 'nope:1'"),
    ("topk:", "end of spec"),
    ("topk:(", "expected a value"),
    ("topk(0.1", "end of spec"),
    ("topk(0.1))", "unexpected ')'"),
    ("topk(0.1, ratio=0.2)", "given twice"),
    ("topk(ratio=0.1, 0.2)", "positional argument follows"),
    ("topk:0.1:0.2", "unexpected argument '0.2'"),
    ("topk:abc", "ratio must be a float in (0, 1]"),
    ("topk:0", "ratio must be a float in (0, 1]"),
    ("topk:nan", "ratio must be a float in (0, 1]"),
    ("topk:fraction=0.1", "unknown argument 'fraction' (arguments: ratio, approx)"),
    ("sign:3", "unexpected argument '3'"),
    ("powersgd:2.5", "rank must be an int"),
    ("powersgd:2:warm_start=maybe", "warm_start must be true or false"),
    ("cast:int8", "dtype must be one of bf16, fp16, fp32"),
    ("ef", "missing required argument 'compressor'"),
    ("ef(nope)", "bad method spec 'ef(nope)': ef: compressor: no compressor named 'nope'"),
    ("ef(topk:2)", "ratio must be a float in (0, 1]"),
    ("ef_", "unknown method 'ef_'"),
    ("rank_dad:2:fast", "flags: two_way, warm, ef"),
    ("rank_dad:0", "rank must be an int in [1, inf)"),
    ("rank_dad:2:two_way:two_way", "flag 'two_way' given twice"),
    ("2topk", "is not a name"),
    (12, "not a string"),
])
def test_bad_method_specs_give_one_error(text, why):
  with pytest.raises(SpecError) as info:
    build_method(text, axis_name=None)
  assert why in str(info.value)
  assert isinstance(info.value, ValueError)
  # Nested compressor errors list the compressor forms, all others the method forms.
  _assert_lists_every_form(info.value, info.value.listed)
  assert str(info.value).startswith(("bad method spec", "unknown method"))


@pytest.mark.parametrize("text", ["nope", "topk:abc", "sign:3", "ef_", "powersgd:2.5", "dad"])
def test_bad_compressor_specs_list_compressor_forms(text):
  with pytest.raises(SpecError) as info:
    compress.get_compressor(text)
  assert info.value.kind == info.value.listed == "compressor"
  _assert_lists_every_form(info.value, "compressor")


def test_builder_argument_errors_become_spec_errors(scratch):
  @scratch("compressor", "picky", Arg("n", int))
  def picky(n=2):
    """Test compressor whose factory checks more than the range."""
    if n % 2:
      raise registry.ArgumentError(f"n must be even, got {n}")
    return compress.identity()

  assert isinstance(compress.get_compressor("picky:4"), compress.Compressor)
  with pytest.raises(SpecError, match="picky: n must be even, got 3; valid forms: .*picky"):
    build_method("picky:3")
  with pytest.raises(SpecError, match=r"bad method spec 'ef\(picky:3\)': ef: compressor: picky: "
                     "n must be even"):
    build_method("ef(picky:3)")


def test_builder_defects_propagate_as_themselves(scratch):
  # A ValueError (or any other error) inside a builder is the library's, not the user's:
  # it is not relabelled "bad method spec ... valid forms".
  @scratch("compressor", "broken", Arg("n", int))
  def broken(n=2):
    """Test compressor with a defect."""
    raise ValueError(f"internal shape mismatch {n}")

  @scratch("method", "broken_method")
  def broken_method(ctx):
    """Test method with a defect."""
    return {}["missing"]

  for spec in ("broken:3", "ef(broken:3)"):
    with pytest.raises(ValueError, match="internal shape mismatch 3") as info:
      build_method(spec)
    assert not isinstance(info.value, SpecError)
  with pytest.raises(KeyError):
    build_method("broken_method")
  # resolve() checks what the user wrote and builds nothing, so it does not see the defect
  entry, kwargs = registry.resolve("method", "ef(broken:3)")
  assert entry.name == "ef" and kwargs["compressor"].entry.name == "broken"
  assert kwargs["compressor"].kwargs == {"n": 3}


def test_values_keep_their_case_names_do_not(scratch):
  seen = {}

  @scratch("method", "echo", Arg("path", str), Arg("flag", bool))
  def echo(ctx, path="", flag=False):
    """Test method recording a string argument."""
    seen.update(path=path, flag=flag)
    return Method(tx=optax.identity())

  build_method("ECHO(path=Data/Run_A, flag=TRUE)")
  assert seen == {"path": "Data/Run_A", "flag": True}
  assert parse_spec("Echo:Data:FLAG") == S("echo", ("Data", "FLAG"))
  build_method("echo:X:FLAG")
  assert seen == {"path": "X", "flag": True}
  assert compress.get_compressor("cast:BF16").name == compress.get_compressor("cast:bf16").name


# -- typed conversion and building ----------------------------------------------------------


def test_arguments_are_typed_and_defaulted():
  entry, kw = registry.resolve("method", "powersgd:3:warm_start=false:min_compression_rate=0")
  assert entry.name == "powersgd" and entry.kind == "compressor"
  assert kw == {"rank": 3, "warm_start": False, "min_compression_rate": 0.0}
  assert type(kw["rank"]) is int and type(kw["min_compression_rate"]) is float
  entry, kw = registry.resolve("method", "rank_dad:two_way")
  assert entry.family == "dad" and kw == {"two_way": True}
  assert registry.resolve("compressor", "qsgd:4:bucket_size=none")[1] == {"levels": 4,
                                                                          "bucket_size": None}
  args = {a.name: a for a in registry.lookup("compressor", "topk").args}
  assert args["ratio"].default == 0.01  # read from topk's signature
  assert args["ratio"].describe() == (
      "ratio: float in (0, 1], default 0.01 -- fraction of entries kept")
  assert registry.lookup("method", "fp32").name == "allreduce"
  assert registry.lookup("compressor", "fp32").name == "identity"


def test_legacy_and_nested_error_feedback_are_the_same():
  g = {"w": jnp.arange(12.0).reshape(3, 4) - 5.0}
  outs = []
  for text in ("ef_topk:0.25", "ef(topk:0.25)", "ef(compressor=topk(ratio=0.25))"):
    c = compress.get_compressor(text)
    assert isinstance(c.init(g), compress.ErrorFeedbackState)
    tx = compress.compressed(c, axis_name=None)
    outs.append(tx.update(g, tx.init(g))[0])
  for out in outs[1:]:
    chex.assert_trees_all_equal(out, outs[0])
  assert int(jnp.sum(outs[0]["w"] != 0)) == 3  # top 25% of 12 entries


def _example(arg):
  if arg.type is COMPRESSOR:
    return "topk:0.5"
  if arg.type is METHOD:
    return "allreduce"
  if arg.type is bool:
    return "true"
  if arg.type is str:
    return arg.choices[0]
  lo, hi, lo_closed, _ = _args.parse_interval(arg.within or "(-inf, inf)")
  if arg.type is int:
    return str(int(lo) if lo_closed else int(lo) + 1) if math.isfinite(lo) else "1"
  return str((lo + hi) / 2 if math.isfinite(hi) else (lo + 1 if math.isfinite(lo) else 1.0))


def _specs_of(entry):
  """The bare spec (if it needs no argument) and one that sets every argument by keyword."""
  out = []
  if not any(a.required for a in entry.args):
    out.append(entry.name)
  if entry.args:
    out.append(f"{entry.name}({', '.join(f'{a.name}={_example(a)}' for a in entry.args)})")
  return out


_TREE = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.array([0.5, -0.25, 0.0])}


def _all_specs():
  return [s for kind in ("method", "compressor") for e in registry.entries(kind)
          for s in _specs_of(e)]


@pytest.mark.parametrize("spec", _all_specs())
def test_every_registered_method_builds_and_updates(spec):
  method = build_method(spec, axis_name=None, seed=3)
  assert isinstance(method, Method) and method.name == spec
  assert method.tx is not None or method.batch_stage is not None or method.wrap is not None
  if method.dense is None:
    params = _TREE
  else:  # dAD: the model is built (and initialized) with the method's dense factory first
    x = jnp.ones((2, 5))
    model = MLP(num_classes=3, hidden=(4,), dense=method.dense)
    params = model.init(jax.random.key(0), x)["params"]
  if method.tx is None and method.wrap is None:
    return
  grads = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape),
                       params)
  tx = method.optimizer(optax.sgd(0.1))  # the method's chain, under its wrap if it has one
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  chex.assert_trees_all_equal_shapes(updates, params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
  assert dadjax.comm_stats(state) is not None


def test_compressor_specs_are_methods_through_compressed():
  method = build_method("qsgd:4", axis_name=None, seed=1)
  ref = optax.chain(compress.compressed(compress.qsgd(4), axis_name=None, seed=1))
  g = {"w": jnp.linspace(-1.0, 1.0, 8)}
  a, _ = method.tx.update(g, method.tx.init(g), g)
  b, _ = ref.update(g, ref.init(g), g)
  chex.assert_trees_all_equal(a, b)


def test_dad_specs_keep_their_options():
  method = build_method("rank_dad(3, two_way, ef, iters=5)", axis_name=None, seed=2)
  assert method.dense.options == dict(axis_name=None, seed=2, mode="rank", rank=3,
                                      aggregation="two_way", warm_start=False,
                                      error_feedback=True, iters=5)
  assert dadjax.dad.is_method("rank_dad(3)") and not dadjax.dad.is_method("ef(topk)")
  assert not dadjax.dad.is_method("((")
  with pytest.raises(SpecError, match="not a dAD spec"):
    dadjax.dad.get_method("topk:0.1")


# -- registering a family -------------------------------------------------------------------


@pytest.fixture
def scratch():
  """Register test-only methods and remove them afterwards."""
  added = []

  def add(kind, name, *args, **kw):
    deco = registry.register(kind, name, *args, **kw)

    def wrap(fn):
      added.append((kind, name))
      return deco(fn)

    return wrap

  yield add
  for kind, name in added:
    registry.unregister(kind, name)


def test_methods_with_compressor_arguments(scratch):
  seen = {}

  # What registering Accordion takes: the nested specs arrive as Compressors.
  @scratch("method", "two_settings", Arg("low", COMPRESSOR), Arg("high", COMPRESSOR),
           Arg("eta", float, within="(0, inf)", doc="threshold"))
  def two_settings(ctx, low, high, eta=0.5):
    """Test method: low and high settings."""
    seen.update(low=low, high=high, eta=eta)
    return compress.compressed(low, axis_name=ctx.axis_name, seed=ctx.seed)

  method = build_method("two_settings(powersgd:2, ef(topk:0.1))", axis_name=None)
  assert method.name == "two_settings(powersgd:2, ef(topk:0.1))" and method.dense is None
  assert isinstance(seen["low"], compress.Compressor) and seen["eta"] == 0.5
  assert isinstance(seen["high"].init(_TREE), compress.ErrorFeedbackState)
  build_method("two_settings(sign, scaled_sign, eta=2)", axis_name=None)
  assert seen["eta"] == 2.0
  with pytest.raises(SpecError, match="two_settings: high: no compressor named 'nope'"):
    build_method("two_settings(sign, nope)")
  with pytest.raises(SpecError, match="eta must be a float in"):
    build_method("two_settings(sign, sign, eta=0)")


def test_data_side_method_both_spellings(scratch):
  calls = []

  @scratch("method", "data_q", Arg("bits", int, within="[1, 8]"),
           Arg("correct", COMPRESSOR, default=None), Arg("gate", float, within="[0, 1]"))
  def data_q(ctx, bits, correct=None, gate=1.0):
    """Test batch-stage method."""
    calls.append((bits, correct, gate))
    return Method("", batch_stage=dadjax.BatchStage(lambda p: (), lambda *a: None))

  a = build_method("data_q:2:correct=ef_scaled_sign:gate=0.5", axis_name=None)
  b = build_method("data_q(2, correct=topk:0.1, gate=0.5)", axis_name=None)
  c = build_method("data_q:4", axis_name=None)
  build_method("data_q(4, correct=none)", axis_name=None)
  assert calls[-1] == (4, None, 1.0)
  assert a.tx is None and a.batch_stage is not None and b.batch_stage is not None
  assert [(n, g) for n, _, g in calls] == [(2, 0.5), (2, 0.5), (4, 1.0), (4, 1.0)]
  assert isinstance(calls[0][1].init(_TREE), compress.ErrorFeedbackState)
  assert calls[1][1].communication == "gather" and calls[2][1] is None
  assert c.name == "data_q:4"
  with pytest.raises(SpecError, match=r"bits must be an int in \[1, 8\]"):
    build_method("data_q:9")


def test_method_arguments_get_the_build_context(scratch):
  @scratch("method", "wrapped", Arg("inner", registry.METHOD))
  def wrapped(ctx, inner):
    """Test method that wraps another."""
    assert isinstance(inner, Method)
    return Method("", tx=inner.tx, dense=inner.dense)

  method = build_method("wrapped(rank_dad:2:warm)", axis_name=None, seed=7)
  assert method.name == "wrapped(rank_dad:2:warm)"
  assert method.dense.options["seed"] == 7 and method.dense.options["axis_name"] is None
  assert method.dense.options["warm_start"] is True
  assert build_method("wrapped(topk:0.5)", axis_name=None).dense is None


def test_register_rejects_bad_entries(scratch):
  with pytest.raises(ValueError, match="already registered"):
    registry.register_compressor("topk")(lambda: None)
  with pytest.raises(ValueError, match="name must match"):
    registry.register_compressor("Top-K")(lambda: None)
  with pytest.raises(ValueError, match="no parameter 'ratio'"):
    registry.register_compressor("odd", Arg("ratio", float), doc="odd")(lambda: None)
  with pytest.raises(ValueError, match="type must be one of"):
    registry.register_compressor("odd", Arg("r", list), doc="odd")(lambda r=(): None)
  with pytest.raises(ValueError, match="within applies to int and float"):
    registry.register_compressor("odd", Arg("r", str, within="[0, 1]"), doc="odd")(lambda r="": 0)
  with pytest.raises(ValueError, match="one-line doc"):
    registry.register_compressor("odd")(lambda: None)
  with pytest.raises(ValueError, match="within must look like"):
    registry.register_compressor("odd2", Arg("r", float, within="0..1"), doc="odd")(
        lambda r=0.5: None)
  with pytest.raises(ValueError, match="takes the BuildContext as its first parameter"):
    registry.register_method("odd3", doc="odd")(lambda *, axis_name="data": None)


def test_builders_get_one_build_context(scratch):
  seen = []

  @scratch("method", "ctx_probe", Arg("inner", METHOD, default=None))
  def ctx_probe(ctx, inner=None):
    """Test method recording its context."""
    seen.append(ctx)
    return Method(tx=optax.identity())

  sched = optax.constant_schedule(0.5)
  build_method("ctx_probe(inner=ctx_probe)", axis_name="sites", seed=4, steps_per_epoch=9,
               lr_schedule=sched)
  assert seen == [registry.BuildContext("sites", 4, 9, sched)] * 2  # nested: the same context
  assert registry.build("method", "ctx_probe", registry.BuildContext(seed=1)).name == "ctx_probe"
  assert seen[-1] == registry.BuildContext(seed=1)


# -- `dadjax methods` and lazy loading ------------------------------------------------------


def test_cli_lists_every_method(capsys):
  assert cli.main(["methods"]) == 0
  out = capsys.readouterr().out
  for kind in ("method", "compressor"):
    for e in registry.entries(kind):
      assert f"  {e.form()}" in out, e.name
      assert e.doc and e.doc in out
      for a in e.args:
        assert a.describe() in out
  assert "allreduce  (also: fp32)" in out and "ef(COMPRESSOR) or ef_COMPRESSOR" in out


@pytest.mark.parametrize("module", ["dadjax.registry", "dadjax.compress._sparse", "dadjax.dad",
                                    "dadjax.methods", "dadjax.config"])
def test_importing_any_module_registers_every_family(module):
  # No lazy loading and no family list: importing any module imports dadjax, whose
  # __init__ imports every family package, and each registers where it is defined.
  code = (f"import {module}\n"
          "import sys\n"
          "from dadjax import registry\n"
          "names = {e.family for k in registry.KINDS for e in registry.entries(k)}\n"
          "assert {'compress', 'dad', 'baseline', 'adaptive', 'dataquant'} <= names, names\n"
          "print(registry.build('method', 'ef(topk:0.1)', axis_name=None).name)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "ef(topk:0.1)"
