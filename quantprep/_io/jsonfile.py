"""Bounded JSON for everything that may come from elsewhere: manifests, indexes, configs, registry
and Hub responses. One home for the limits: at most `limit` bytes are read (a huge or endless
input is refused before parsing), nesting at most MAX_DEPTH deep (Python's parser would raise
RecursionError on a deeply nested input), the top level a JSON object, and every failure one line
of the caller's error type naming the input.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_JSON_BYTES = 64 << 20  # manifests, indexes and configs are kilobytes; refuse anything absurd
MAX_DEPTH = 64  # quantprep's own files nest 4 deep; transformers' configs fewer than 10


def _depth(value) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > MAX_DEPTH:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_json_object(raw: bytes | str, where: str, error: type[Exception], fix: str, limit: int = MAX_JSON_BYTES) -> dict:
    """`raw` as a JSON object; `error(f"{where}: <problem>; {fix}")` when it is not one."""
    if len(raw) > limit:
        raise error(f"{where}: larger than {limit} bytes; {fix}")
    try:
        data = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise error(f"{where}: not valid JSON ({e}); {fix}") from None
    except RecursionError:
        raise error(f"{where}: JSON nested deeper than {MAX_DEPTH} levels; {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{where}: expected a JSON object; {fix}")
    if _depth(data) > MAX_DEPTH:
        raise error(f"{where}: JSON nested deeper than {MAX_DEPTH} levels; {fix}")
    return data


def read_json_object(path: Path, error: type[Exception], fix: str, limit: int = MAX_JSON_BYTES) -> dict:
    """Parse the file `path` as a JSON object (parse_json_object), reading at most limit + 1 bytes."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e}); {fix}") from None
    return parse_json_object(raw, str(path), error, fix, limit)
