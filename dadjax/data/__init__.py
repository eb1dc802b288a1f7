"""Data sets as numpy arrays, their partitioning across sites, and a Grain input pipeline per host."""

from dadjax.data._embedded import Dataset, load_digits
from dadjax.data._idx import load_fashion_mnist, load_idx, read_idx
from dadjax.data._partition import SiteBatcher, partition, partition_summary, site_batches
from dadjax.data._synthetic import synthetic_classification, synthetic_sequences
from dadjax.data._lookup import (as_dataset, dataset_names, get_dataset, load, load_npz,
                                 register_dataset)
from dadjax.data._text import (
    BYTE_VOCAB,
  bits_per_byte,
  language_model_metrics,
  load_text,
  perplexity,
  split_files,
  text_windows,
)
from dadjax.data._tfds import load_tfds, tokenize
from dadjax.data._checks import check_dataset
from dadjax.data._grain import (ArrayRecordSource, ArraySource, SitePipeline, TextSource,
                               TfdsSource, grain_pipeline, process_sites, text_source,
                               write_array_record)

__all__ = [
    "check_dataset",
    "BYTE_VOCAB",
  "Dataset",
  "load",
  "load_digits",
  "load_idx",
  "read_idx",
  "load_fashion_mnist",
  "load_text",
  "split_files",
  "text_windows",
  "bits_per_byte",
  "perplexity",
  "language_model_metrics",
  "synthetic_classification",
  "synthetic_sequences",
  "load_tfds",
  "tokenize",
  "partition",
  "partition_summary",
  "SiteBatcher",
  "site_batches",
  "register_dataset",
  "get_dataset",
  "dataset_names",
  "load_npz",
  "as_dataset",
  "ArraySource",
  "TextSource",
  "ArrayRecordSource",
  "TfdsSource",
  "SitePipeline",
  "text_source",
  "write_array_record",
  "process_sites",
  "grain_pipeline",
]

register_dataset("digits", load_digits)
register_dataset("synthetic", synthetic_classification)
register_dataset("synthetic_seq", synthetic_sequences)
register_dataset("fashion_mnist", load_fashion_mnist)
register_dataset("text", load_text, takes_argument=True)
register_dataset("idx", load_idx, takes_argument=True)
