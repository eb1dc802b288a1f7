"""The elastic service's messages: a JSON header and raw array bytes, over one TCP stream.

A message is an 8-byte big-endian length, that many bytes of UTF-8 JSON (the
header), then the bytes of the arrays the header lists under ``"arrays"``
(``{"dtype", "shape"}`` each, C order, back to back). No pickle: a peer can
send only numbers and JSON.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Sequence

import ml_dtypes  # jax's own dependency: bfloat16 and the float8 types as numpy dtypes
import numpy as np

_LENGTH = struct.Struct(">Q")
_MAX_HEADER = 1 << 24  # a header longer than 16 MiB is not one of ours


class WireError(ConnectionError):
  """The peer closed the stream or sent something that is not a message."""


def dtype_of(name: str) -> np.dtype:
  return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def send(sock: socket.socket, header: dict, arrays: Sequence[np.ndarray] = ()) -> int:
  """Writes one message; returns the bytes of its arrays (the payload)."""
  arrays = [np.asarray(a).copy(order="C") for a in arrays]  # (ascontiguousarray makes 0-d 1-d)
  header = dict(header, arrays=[{"dtype": a.dtype.name, "shape": list(a.shape)} for a in arrays])
  head = json.dumps(header).encode()
  sock.sendall(_LENGTH.pack(len(head)) + head)
  for a in arrays:
    sock.sendall(a.reshape(-1).view(np.uint8))  # bytes, also of ml_dtypes (no buffer format)
  return sum(a.nbytes for a in arrays)


def _exactly(sock: socket.socket, n: int) -> bytearray:
  buf = bytearray(n)
  view, got = memoryview(buf), 0
  while got < n:
    k = sock.recv_into(view[got:])
    if not k:
      raise WireError(f"the peer closed the connection after {got} of {n} bytes")
    got += k
  return buf


def recv(sock: socket.socket) -> tuple[dict, list[np.ndarray]]:
  """Reads one message: ``(header, arrays)``."""
  (length,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
  if length > _MAX_HEADER:
    raise WireError(f"a header of {length} bytes is not a dadjax.elastic message")
  try:
    header = json.loads(_exactly(sock, length))
    specs = header.pop("arrays")
  except (ValueError, KeyError) as e:
    raise WireError(f"not a dadjax.elastic message: {e}") from e
  arrays = []
  for spec in specs:
    dtype, shape = dtype_of(spec["dtype"]), tuple(spec["shape"])
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    arrays.append(np.frombuffer(_exactly(sock, n), dtype=dtype).reshape(shape))
  return header, arrays
