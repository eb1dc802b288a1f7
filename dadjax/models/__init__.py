"""Flax (linen) models whose dense layers are built by a swappable ``dense``
factory (``nn.Dense`` by default, ``dadjax.dad.Dense`` for dAD training)."""

import flax.linen as nn

from dadjax.models._cnn import CNN
from dadjax.models._gru import GRUClassifier, GRUStep, GRUTimeRows
from dadjax.models._lm import LSTMLM, LSTMStep, TransformerLM
from dadjax.models._mlp import MLP
from dadjax.models._resnet import BasicBlock, ResNet, ResNet18
from dadjax.models._transformer import Transformer, TransformerBlock

__all__ = [
  "MLP",
  "CNN",
  "ResNet",
  "ResNet18",
  "BasicBlock",
  "GRUClassifier",
  "GRUStep",
  "GRUTimeRows",
  "Transformer",
  "TransformerBlock",
  "TransformerLM",
  "LSTMLM",
  "LSTMStep",
  "get_model",
]

_MODELS = {
  "mlp": MLP,
  "cnn": CNN,
  "resnet18": ResNet18,
  "resnet": ResNet,
  "gru": GRUClassifier,
  "transformer": Transformer,
  "vit": Transformer,
  "transformer_lm": TransformerLM,
  "lstm_lm": LSTMLM,
}


def get_model(name: str, num_classes: int, dense=nn.Dense, **kwargs) -> nn.Module:
  """Build a model by name: "mlp", "cnn", "resnet18" / "resnet", "gru",
  "transformer", "vit" (a ``Transformer`` with ``patch_size=4`` unless
  given), "transformer_lm", "lstm_lm" (next-token logits ``(batch, T,
  num_classes)``). ``kwargs`` are passed to the model class. Raises ``ValueError`` for
  an unknown name."""
  key = name.lower()
  if key not in _MODELS:
    raise ValueError(f"unknown model {name!r}; valid names: {sorted(_MODELS)}")
  if key == "vit":
    kwargs.setdefault("patch_size", 4)
  return _MODELS[key](num_classes=num_classes, dense=dense, **kwargs)
