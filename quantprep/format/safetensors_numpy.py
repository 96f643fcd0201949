"""Safetensors files as numpy arrays, without torch (runtime/engine.py reads artifacts this way).

The format (huggingface.co/docs/safetensors): an 8-byte little-endian header length, that many
bytes of JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}),
then the data, offsets relative to its start. Every bound is checked before a byte of data is
touched: the header's length against MAX_HEADER and the file, its JSON by _io/jsonfile's limits,
each dtype against DTYPES, each shape's size against its offsets, each range against the file and
its start against its element size (C reads the arrays as their type).
Each tensor is a read-only view of one memory map of the file: no copy, the page cache's pages.
bfloat16 comes back as uint16 (numpy has no bfloat16); the dtype name says which it is.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import numpy as np

from quantprep._io.jsonfile import parse_json_object
from quantprep.errors import ArtifactError
from quantprep.format.artifact import SAFETENSORS_DTYPES

MAX_HEADER = 100 << 20  # safetensors' own limit
DTYPES = {name: numpy for name, (_, numpy) in SAFETENSORS_DTYPES.items()}  # a safetensors dtype -> numpy's


def read(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (safetensors dtype, read-only array)} of every tensor in the file; ArtifactError (one line
    naming the file and what is wrong) for anything the format does not allow."""
    fix = "the artifact is corrupt: rebuild it"
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_HEADER, size - 8):
                raise ArtifactError(f"{path}: header length {n} does not fit the file ({size} bytes); {fix}")
            header = parse_json_object(f.read(n), str(path), ArtifactError, fix, MAX_HEADER)
            # MAP_POPULATE: the kernel maps every page now, in one pass, not one fault per 4 KiB page at first use
            data = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ) \
                if size > 8 + n else b""
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be read ({e.strerror or e}); {fix}") from None
    start, room = 8 + n, size - 8 - n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPES:
            raise ArtifactError(f"{where}: no dtype of {sorted(DTYPES)}; {fix}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= 8 and all(type(d) is int and 0 <= d < 1 << 40 for d in shape)):
            raise ArtifactError(f"{where}: shape {shape!r} is not a list of sizes; {fix}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= room):
            raise ArtifactError(f"{where}: data_offsets {offsets!r} are not a range of the file's {room} data bytes; {fix}")
        dtype = np.dtype(DTYPES[entry["dtype"]])
        count = math.prod(shape)
        if count * dtype.itemsize != offsets[1] - offsets[0]:
            raise ArtifactError(f"{where}: shape {shape} of {entry['dtype']} is {count * dtype.itemsize} bytes, "
                                f"its data_offsets hold {offsets[1] - offsets[0]}; {fix}")
        if (start + offsets[0]) % dtype.itemsize:  # C reads it as an array of its type: aligned, as quantprep writes it
            raise ArtifactError(f"{where}: starts at byte {start + offsets[0]}, not aligned to its {dtype.itemsize}-byte elements; {fix}")
        array = np.frombuffer(data, dtype, count, start + offsets[0]) if count else np.empty(0, dtype)
        tensors[name] = (entry["dtype"], array.reshape(shape))
    return tensors
