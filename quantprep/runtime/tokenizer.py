"""An artifact's tokenizer and chat template without transformers, for the native runtime
(`quantprep generate --native`): whose point is a first token without transformers' imports
(seconds on a small CPU; BENCHMARKS.md, "llama.cpp, the CPU anchor"). `quantprep serve` encodes and
decodes an openvino artifact's requests with it too, so the template renders in this sandbox rather
than in openvino.genai's C++ Jinja, which recurses without a bound.

It does what transformers 5's `apply_chat_template(..., add_generation_prompt=True)` and `decode(...,
skip_special_tokens=True)` do for a tokenizer.json run as it is (TokenizersBackend): the template
rendered in jinja2's immutable sandbox set up as transformers sets it up (utils/chat_template_utils.py:
trim_blocks, lstrip_blocks, loopcontrols, its tojson, raise_exception, strftime_now, its dict and
namespace), given the message, tools=None, documents=None and the named special tokens, then encoded
without special tokens, neither truncated nor padded. Without a template: the prompt encoded with
them. The ids are AutoTokenizer's (tests/test_generate_native.py; the real SmolLM2 tokenizer:
tests/test_smollm2.py).

Only files the checked manifest lists are read, each bounded, and their bytes are checked against
its sha256 as they are read. Anything wrong with them, a template that fails included, is one line
naming the file. A template's output is bounded (MAX_PROMPT_CHARS); its running time is not, as in
transformers, which renders the same template for `quantprep generate` without --native.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from quantprep._io.jsonfile import MAX_JSON_BYTES, parse_json_object
from quantprep.errors import ArtifactError

MAX_TEMPLATE_BYTES = 1 << 20  # chat templates are kilobytes
MAX_PROMPT_CHARS = 1 << 20  # a rendered prompt; more is refused, not tokenized
FIX = "rebuild the artifact from a source with a working tokenizer"
# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES): what a template sees of them
# transformers' GenerationConfig fields that change what generate(do_sample=False) picks, at their no-op values
# (repetition_penalty is applied: ArtifactTokenizer.repetition_penalty; the encoder_ ones act on the prompt in a decoder-only model)
NEUTRAL_GENERATION = {"num_beams": 1, "penalty_alpha": 0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0,
                      "encoder_no_repeat_ngram_size": 0, "bad_words_ids": [],
                      "min_length": 0, "min_new_tokens": 0, "suppress_tokens": [], "begin_suppress_tokens": [], "forced_bos_token_id": None,
                      "forced_eos_token_id": None, "sequence_bias": {}, "exponential_decay_length_penalty": None, "dola_layers": None,
                      "guidance_scale": 1.0, "stop_strings": [], "watermarking_config": None}
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def said(x) -> str:
    """A message or value from the artifact (a template's, a tokenizer's) as one short printable line."""
    try:
        text = str(x)
    except Exception:  # an int of more than 4300 digits, a __str__ that fails
        text = f"<a {type(x).__name__}>"
    return text.encode("unicode_escape").decode("ascii")[:200]


class ArtifactTokenizer:
    """tokenizer.json, the chat template and the end-of-sequence ids of a checked artifact directory
    (`files`: its manifest's "files", {name: {"sha256", "size"}}). defer_template_error: a chat
    template that cannot be used is raised by every prompt_ids and chat_ids call instead of here, so
    a server answers chat requests with it and still encodes prompts (`quantprep serve`)."""

    def __init__(self, path: Path, files: dict, defer_template_error: bool = False):
        from tokenizers import Tokenizer

        self.path, self.files = path, files
        if "tokenizer.json" not in files:
            raise ArtifactError(f"{path}: no tokenizer.json in manifest.json (the native runtime reads only that format); {FIX}")
        with self._tokenizers("not a tokenizer the tokenizers package reads"):
            self.tokenizer = Tokenizer.from_str(self._read("tokenizer.json", MAX_JSON_BYTES).decode())
            self.tokenizer.no_truncation()  # transformers turns both off unless a call asks for them
            self.tokenizer.no_padding()
        config = self._json("tokenizer_config.json")
        self.specials = self._specials(config)
        self.template_error: ArtifactError | None = None
        try:
            self.template = self._template(config)
        except ArtifactError as e:
            if not defer_template_error:
                raise
            self.template, self.template_error = None, e
        self.eos = self._eos()

    def _read(self, name: str, limit: int) -> bytes:
        """A listed file's bytes, at most `limit`, checked against the manifest's sha256 and size."""
        file = self.path / name
        with open(file, "rb") as f:
            raw = f.read(limit + 1)
        if len(raw) > limit:
            raise ArtifactError(f"{file}: larger than {limit} bytes; {FIX}")
        listed = self.files[name]
        if len(raw) != listed.get("size") or hashlib.sha256(raw).hexdigest() != listed.get("sha256"):
            raise ArtifactError(f"{file}: not the file manifest.json lists (changed since the load checked it); load it again")
        return raw

    def _json(self, name: str) -> dict:
        return parse_json_object(self._read(name, MAX_JSON_BYTES), str(self.path / name), ArtifactError, FIX) if name in self.files else {}

    def _specials(self, config: dict) -> dict[str, str]:
        """The named special tokens, as transformers reads them: tokenizer_config.json's, and where it
        has no added_tokens_decoder (a legacy save), special_tokens_map.json's over them."""
        tokens = {k: config.get(k) for k in SPECIAL_TOKENS}
        if "added_tokens_decoder" not in config:
            tokens |= {k: v for k, v in self._json("special_tokens_map.json").items() if k in SPECIAL_TOKENS}
        tokens = {k: v.get("content") if isinstance(v, dict) else v for k, v in tokens.items()}
        return {k: v for k, v in tokens.items() if isinstance(v, str)}

    def _template(self, config: dict):
        """The compiled chat template, or None: chat_template.jinja, else tokenizer_config.json's (a
        string, or of a list of {"name", "template"} the last named "default"), as AutoTokenizer looks."""
        if "chat_template.jinja" in self.files:
            where = "chat_template.jinja"
            try:
                source = self._read(where, MAX_TEMPLATE_BYTES).decode()
            except UnicodeDecodeError:
                raise ArtifactError(f"{self.path / where}: not UTF-8 text; {FIX}") from None
        else:
            where, source = "tokenizer_config.json", config.get("chat_template")
            if isinstance(source, list):
                if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in source):
                    raise ArtifactError(f"{self.path / where}: chat_template is a list whose entries are not all {{name, template}}; {FIX}")
                named = {t["name"]: t["template"] for t in source}
                if "default" not in named:
                    raise ArtifactError(f"{self.path / where}: chat_template names {said(sorted(named))}, none \"default\"; {FIX}")
                source = named["default"]
        self.template_file = self.path / where
        if source is None or source == "":  # no template, as transformers' `if tokenizer.chat_template`
            return None
        if not isinstance(source, str) or len(source) > MAX_TEMPLATE_BYTES:
            raise ArtifactError(f"{self.template_file}: the chat template is not a string of at most {MAX_TEMPLATE_BYTES} bytes; {FIX}")
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.utils
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        class TemplateDict:  # transformers': `dict(...)` makes a dict, and its class is not reachable
            def __call__(self, *args, **kwargs):
                return dict(*args, **kwargs)

            def fromkeys(self, *args, **kwargs):
                return dict.fromkeys(*args, **kwargs)

        class TemplateNamespace(jinja2.utils.Namespace):  # transformers': no underscore names
            def __init__(*args, **kwargs):
                self, args = args[0], args[1:]
                attrs = dict(*args, **kwargs)
                for name in attrs:
                    TemplateNamespace._check_name(name)
                jinja2.utils.Namespace.__init__(self, attrs)

            def __setitem__(self, name, value):
                TemplateNamespace._check_name(name)
                jinja2.utils.Namespace.__setitem__(self, name, value)

            @staticmethod
            def _check_name(name):
                if isinstance(name, str) and name.startswith("_"):
                    raise jinja2.exceptions.SecurityError(f"a namespace attribute {name!r} starts with an underscore")

        class Generation(jinja2.ext.Extension):  # transformers' {% generation %} block (AssistantTracker): its body, as rendered
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                           dict=TemplateDict(), namespace=TemplateNamespace)
        try:
            return env.from_string(source)
        except Exception as e:  # TemplateSyntaxError, or a RecursionError on a deeply nested one
            raise ArtifactError(f"{self.template_file}: the chat template does not compile ({said(e)}); {FIX}") from None

    def _eos(self) -> set[int]:
        """The end-of-sequence ids where generate stops, and the repetition penalty: from
        generation_config.json, else config.json (as transformers makes a generation config from it).
        Another setting there that makes transformers' generate(do_sample=False) other than greedy is
        refused: --native would answer otherwise."""
        name = "generation_config.json" if "generation_config.json" in self.files else "config.json"
        config = self._json(name)
        for key, neutral in NEUTRAL_GENERATION.items():
            if config.get(key, neutral) not in (neutral, None):
                raise ArtifactError(f"{self.path / name}: {key} {said(repr(config[key]))} (generate --native decodes plain greedy); "
                                    "run `quantprep generate` without --native")
        penalty = config.get("repetition_penalty", 1.0)
        if type(penalty) not in (int, float) or not 0 < penalty < 1e6:
            raise ArtifactError(f"{self.path / name}: repetition_penalty {said(repr(penalty))} is not a positive number; {FIX}")
        self.repetition_penalty = float(penalty)
        value = config.get("eos_token_id")
        ids = [] if value is None else value if isinstance(value, list) else [value]
        if not all(type(i) is int for i in ids):
            raise ArtifactError(f"{self.path / name}: eos_token_id {said(repr(value))} is not an id or a list of ids; {FIX}")
        return set(ids)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The ids of one user message with the generation prompt after it (or of the bare prompt
        without a chat template), as AutoTokenizer's apply_chat_template gives them."""
        if self.template_error:
            raise self.template_error
        if self.template is None:
            return self._encode(prompt, True)
        return self._encode(self._render([{"role": "user", "content": prompt}]), False)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The ids of `messages` ({"role", "content"} each) with the generation prompt after them, as
        AutoTokenizer's apply_chat_template gives them; an artifact without a chat template has none."""
        if self.template_error:
            raise self.template_error
        if self.template is None:
            raise ArtifactError(f"{self.template_file}: the artifact has no chat template to render messages with; "
                                "give it a prompt instead")
        return self._encode(self._render(messages), False)

    def text_ids(self, text: str) -> list[int]:
        """The ids of plain text with the tokenizer's special tokens, as AutoTokenizer's encode gives them."""
        return self._encode(text, True)

    def _render(self, messages: list[dict]) -> str:
        """The chat template's text for `messages`, bounded (MAX_PROMPT_CHARS); its failures as one line."""
        parts, size = [], 0
        try:
            for part in self.template.generate(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                               **self.specials):
                size += len(part)
                if size > MAX_PROMPT_CHARS:
                    raise ArtifactError(f"{self.template_file}: the chat template writes more than {MAX_PROMPT_CHARS} characters "
                                        f"for a prompt of {sum(len(m['content']) for m in messages)}; {FIX}")
                parts.append(part)
        except ArtifactError:
            raise
        except Exception as e:  # any error of the template's own making (raise_exception, SecurityError, 1/0, recursion)
            raise ArtifactError(f"{self.template_file}: the chat template failed ({type(e).__name__}: {said(e)}); {FIX}") from None
        return "".join(parts)

    def pick(self, logits, seen: list[int]) -> int:
        """The greedy token of float32 logits [vocab], after transformers' RepetitionPenaltyLogitsProcessor
        over the ids `seen` (prompt and output): a seen token's logit divided by the penalty, or
        multiplied where it is negative."""
        import numpy as np

        if self.repetition_penalty != 1.0:
            ids = np.unique(np.asarray(seen, np.int64))
            s = logits[ids]
            logits = logits.copy()
            logits[ids] = np.where(s < 0, s * np.float32(self.repetition_penalty), s / np.float32(self.repetition_penalty))
        return int(logits.argmax())

    def _encode(self, text: str, special: bool) -> list[int]:
        with self._tokenizers("cannot encode the prompt"):
            return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        with self._tokenizers("cannot decode the tokens"):
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    @contextmanager
    def _tokenizers(self, what: str):
        """A tokenizers call's failure, an Exception or its Rust panic (a BaseException), as one line."""
        try:
            yield
        except (ArtifactError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            raise ArtifactError(f"{self.path / 'tokenizer.json'}: {what} ({said(e)}); {FIX}") from None
