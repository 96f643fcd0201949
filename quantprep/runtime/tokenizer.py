"""An artifact's tokenizer and chat template without transformers, for the native runtime
(`quantprep generate --native`): whose point is a first token without transformers' imports
(seconds on a small CPU; BENCHMARKS.md, "llama.cpp, the CPU anchor").

It does what transformers' `apply_chat_template(..., add_generation_prompt=True)` and `decode(...,
skip_special_tokens=True)` do for a tokenizer.json: the template rendered in jinja2's immutable
sandbox set up as transformers sets it up (utils/chat_template_utils.py: trim_blocks, lstrip_blocks,
loopcontrols, its tojson, raise_exception, strftime_now), given the messages and the special tokens,
then encoded without special tokens. Without a template: the prompt encoded with them. The ids are
AutoTokenizer's (tests/test_generate_native.py; on the real SmolLM2 tokenizer, tests/test_smollm2.py).

Only files the checked manifest lists are read (their sha256 was checked), each bounded. A template
is the artifact's text: the sandbox refuses attribute access to Python internals, as in transformers,
which renders the same template for `quantprep generate` without --native.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from quantprep._io.jsonfile import MAX_JSON_BYTES, read_json_object
from quantprep.errors import ArtifactError

MAX_TEMPLATE_BYTES = 1 << 20  # chat templates are kilobytes
FIX = "rebuild the artifact from a source with a working tokenizer"


class ArtifactTokenizer:
    """tokenizer.json, the chat template and the end-of-sequence ids of a checked artifact directory
    (`listed`: the file names its manifest lists)."""

    def __init__(self, path: Path, listed: set[str]):
        from tokenizers import Tokenizer

        self.path = path
        if "tokenizer.json" not in listed:
            raise ArtifactError(f"{path}: no tokenizer.json in manifest.json (the native runtime reads only that format); {FIX}")
        text = self._read(path / "tokenizer.json", MAX_JSON_BYTES)
        try:
            self.tokenizer = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises plain Exception on a malformed file
            raise ArtifactError(f"{path / 'tokenizer.json'}: not a tokenizer the tokenizers package reads ({e}); {FIX}") from None
        config = read_json_object(path / "tokenizer_config.json", ArtifactError, FIX) if "tokenizer_config.json" in listed else {}
        self.specials = {k: v for k, v in ((k, _token(config.get(k))) for k in ("bos_token", "eos_token", "unk_token", "pad_token"))
                         if v is not None}
        self.template = self._template(listed, config)
        self.eos = self._eos(listed)

    def _read(self, file: Path, limit: int) -> str:
        with open(file, "rb") as f:
            raw = f.read(limit + 1)
        if len(raw) > limit:
            raise ArtifactError(f"{file}: larger than {limit} bytes; {FIX}")
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise ArtifactError(f"{file}: not UTF-8 text; {FIX}") from None

    def _template(self, listed: set[str], config: dict):
        """The compiled chat template, or None: chat_template.jinja, else chat_template.json's, else
        tokenizer_config.json's (a string, or the one named "default" of a list), as transformers looks."""
        where, source = None, None
        if "chat_template.jinja" in listed:
            where, source = "chat_template.jinja", self._read(self.path / "chat_template.jinja", MAX_TEMPLATE_BYTES)
        elif "chat_template.json" in listed:
            where = "chat_template.json"
            source = read_json_object(self.path / where, ArtifactError, FIX, MAX_TEMPLATE_BYTES).get("chat_template")
        else:
            where, source = "tokenizer_config.json", config.get("chat_template")
            if isinstance(source, list):
                source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
        if source is None:
            return None
        if not isinstance(source, str) or len(source) > MAX_TEMPLATE_BYTES:
            raise ArtifactError(f"{self.path / where}: the chat template is not a string of at most {MAX_TEMPLATE_BYTES} bytes; {FIX}")
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self.template_file = self.path / where
        try:
            return env.from_string(source)
        except jinja2.TemplateError as e:
            raise ArtifactError(f"{self.template_file}: the chat template does not compile ({e}); {FIX}") from None

    def _eos(self, listed: set[str]) -> set[int]:
        """generation_config.json's eos_token_id (an id or a list), else config.json's: where generate stops."""
        for name in ("generation_config.json", "config.json"):
            if name in listed:
                value = read_json_object(self.path / name, ArtifactError, FIX).get("eos_token_id")
                if value is not None:
                    ids = value if isinstance(value, list) else [value]
                    if not all(type(i) is int for i in ids):
                        raise ArtifactError(f"{self.path / name}: eos_token_id {value!r} is not an id or a list of ids; {FIX}")
                    return set(ids)
        return set()

    def prompt_ids(self, prompt: str) -> list[int]:
        """The ids of one user message with the generation prompt after it (or of the bare prompt
        without a chat template), as AutoTokenizer's apply_chat_template gives them."""
        if self.template is None:
            return self.tokenizer.encode(prompt).ids
        import jinja2

        try:
            text = self.template.render(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True, **self.specials)
        except jinja2.TemplateError as e:  # SecurityError too
            raise ArtifactError(f"{self.template_file}: the chat template failed ({e}); {FIX}") from None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _token(value) -> str | None:
    """A special token of tokenizer_config.json: a string, or an added token's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
