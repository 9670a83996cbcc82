"""A safetensors file written one tensor at a time (issue 57, class 8): the host holds the tensor being
written, never the file's worth that `safetensors.numpy.save_file` takes as one dict.

The format (huggingface/safetensors, "Format"): an 8-byte little-endian header length N, N bytes of
JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}` padded with
spaces to a multiple of 8, then the tensors' bytes back to back in the offsets' order. Every size is
known from the shapes before any tensor is made, so the header goes first and each tensor follows as
it is produced.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np

CODES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16"}


class Entry(NamedTuple):
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]  # the tensor, made when its turn to be written comes


def write(path: str | Path, entries: Iterable[Entry], metadata: dict[str, str] | None = None) -> None:
    """The safetensors file `path` of `entries`, in their order, one tensor in host memory at a time."""
    entries = list(entries)
    header, offset = {"__metadata__": dict(metadata or {})}, 0
    for e in entries:
        size = math.prod(e.shape) * np.dtype(e.dtype).itemsize
        header[e.name] = {"dtype": CODES[np.dtype(e.dtype)], "shape": list(e.shape), "data_offsets": [offset,
                                                                                                     offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for e in entries:
            x = np.asarray(e.make(), order="C")  # (np.ascontiguousarray makes a scalar 1-d)
            if x.dtype != np.dtype(e.dtype) or x.shape != tuple(e.shape):
                raise AssertionError(f"{e.name}: made {x.dtype}{list(x.shape)}, declared {e.dtype}{list(e.shape)}")
            f.write(x.reshape(-1).view(np.uint8).data)
            del x
