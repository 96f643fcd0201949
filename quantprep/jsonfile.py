"""Bounded JSON reading for files that may come from elsewhere (manifests, indexes, configs).

At most `limit` bytes are read (a huge or endless file is refused before parsing), the text must
be a JSON object, and every failure is one line of the caller's error type naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_JSON_BYTES = 64 << 20  # manifests, indexes and configs are kilobytes; refuse anything absurd


def read_json_object(path: Path, error: type[Exception], fix: str, limit: int = MAX_JSON_BYTES) -> dict:
    """Parse `path` as a JSON object; `error(f"{path}: <problem>; {fix}")` when it cannot be."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e}); {fix}") from None
    if len(raw) > limit:
        raise error(f"{path}: larger than {limit} bytes; {fix}")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object; {fix}")
    return data
