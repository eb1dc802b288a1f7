"""Flax (linen) models whose dense layers are built by a swappable ``dense``
factory (``nn.Dense`` by default, ``dadjax.dad.Dense`` for dAD training)."""

from dadjax.models._cnn import CNN
from dadjax.models._gru import GRUClassifier, GRUStep, GRUTimeRows
from dadjax.models._lm import LSTMLM, LSTMStep, TransformerLM
from dadjax.models._mlp import MLP
from dadjax.models._resnet import BasicBlock, ResNet, ResNet18
from dadjax.models._lookup import get_model, model_class, model_fields, model_names, register_model
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
  "model_class",
  "model_fields",
  "model_names",
  "register_model",
]

for _name, _cls in (("mlp", MLP), ("cnn", CNN), ("resnet18", ResNet18), ("resnet", ResNet),
                   ("gru", GRUClassifier), ("transformer", Transformer),
                   ("transformer_lm", TransformerLM), ("lstm_lm", LSTMLM)):
  register_model(_name, _cls)
register_model("vit", Transformer, patch_size=4)
