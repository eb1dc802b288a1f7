"""Flax (linen) models whose dense layers are built by a swappable ``dense``
factory (``nn.Dense`` by default, ``dadjax.dad.Dense`` for dAD training), and
a GPT decoder for pods (:class:`GPT`: scanned, rematerialized, logically
partitioned; its projections take ``dot_general_cls``)."""

from dadjax.models._cnn import CNN
from dadjax.models._gpt import (
    GPT,
    GPT_CONFIGS,
    GPT_FSDP_RULES,
    GPT_FSDP_TP_RULES,
    GPT_TP_RULES,
    GPTBlock,
    GPTMemory,
    gpt_config,
    gpt_dry_run,
    gpt_memory,
    parse_mesh,
    gpt_param_count,
    gpt_rules,
    make_gpt,
)
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
  "GPT",
  "GPTBlock",
  "GPTMemory",
  "GPT_CONFIGS",
  "GPT_FSDP_RULES",
  "GPT_TP_RULES",
  "GPT_FSDP_TP_RULES",
  "gpt_config",
  "gpt_dry_run",
  "gpt_memory",
  "parse_mesh",
  "gpt_param_count",
  "gpt_rules",
  "make_gpt",
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
register_model("gpt", GPT)
for _name, _fields in GPT_CONFIGS.items():  # "gpt_tiny", "gpt_cpu", "gpt_125m", "gpt_1b"
  register_model(_name, GPT, **_fields)
