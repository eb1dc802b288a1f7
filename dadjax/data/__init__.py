"""Data sets as numpy arrays, and their partitioning across sites."""

from dadjax.data._embedded import Dataset, load_digits
from dadjax.data._partition import SiteBatcher, partition, partition_summary, site_batches
from dadjax.data._synthetic import synthetic_classification, synthetic_sequences
from dadjax.data._tfds import load, load_tfds, tokenize

__all__ = [
  "Dataset",
  "load",
  "load_digits",
  "synthetic_classification",
  "synthetic_sequences",
  "load_tfds",
  "tokenize",
  "partition",
  "partition_summary",
  "SiteBatcher",
  "site_batches",
]
