"""Data quantization by name (``dataquant:2``, ``dataquant:2:correct=ef_scaled_sign:gate=0.5``).

The method is a batch stage alone: the sites exchange quantized data, not
gradients, so the optimizer chain needs no communicating transformation
(the train step uses ``optax.identity()`` in its place) and every bit sent
is booked in the step's own ledger (``TrainState.comm``).
"""

from __future__ import annotations

from dadjax.dataquant._gate import GATE_MODES, SCORES, check_gate
from dadjax.dataquant._stage import QUANTIZERS, dataquant
from dadjax._core.quantize import SCALES
from dadjax.registry import COMPRESSOR, Arg, ArgumentError, BuildContext, Method, register_method


@register_method(
    "dataquant",
    Arg("bits", int, within="[1, 8]", doc="bits per coordinate (codebook: 2**bits codewords); "
        "none sends the rows exactly"),
    Arg("correct", COMPRESSOR, doc="compressor of the correction g(x) - g(Q(x)); none: no "
        "correction"),
    Arg("gate", float, within="[0, inf)", doc="threshold score (gate_mode=threshold) or "
        "expected fraction of rows sent (gate_mode=sample); none: every row"),
    Arg("gate_mode", str, choices=GATE_MODES, positional=False, doc="how the gate decides"),
    Arg("score", str, choices=SCORES, positional=False, doc="the gate's per-row score"),
    Arg("floor", float, within="[0, 1]", positional=False,
        doc="uniform share of the sampling probabilities"),
    Arg("every", int, within="[1, inf)", positional=False, doc="correct every k steps"),
    Arg("scale", str, choices=SCALES, positional=False, doc="per-sample or per-feature range"),
    Arg("quantizer", str, choices=QUANTIZERS, positional=False,
        doc="stochastic uniform or a learned codebook"),
    Arg("block", int, within="[1, inf)", positional=False, doc="features per codeword"),
    Arg("classes", int, within="[2, inf)", positional=False,
        doc="pack labels into ceil(log2(classes)) bits; none: 32-bit labels"),
)
def _dataquant(ctx: BuildContext, bits=None, correct=None, gate=None, gate_mode="threshold",
               score="loss", floor=0.1, every=1, scale="sample", quantizer="uniform", block=4,
               classes=None) -> Method:
  """Data quantization: sites all-gather quantized rows instead of reducing gradients."""
  # ctx.seed is unused: the stage's keys come from the train step's key schedule
  try:  # the checks across arguments (the gate's range depends on gate_mode)
    check_gate(gate, gate_mode, floor)
  except ValueError as e:
    raise ArgumentError(str(e)) from None
  if quantizer == "codebook" and bits is None:
    raise ArgumentError("bits must be an int in [1, 8] for quantizer=codebook, got none")
  stage = dataquant(bits, scale=scale, quantizer=quantizer, block=block, correction=correct,
                    correct_every=every, gate=gate, gate_mode=gate_mode, score=score,
                    gate_floor=floor, num_classes=classes, axis_name=ctx.axis_name)
  return Method(batch_stage=stage)
