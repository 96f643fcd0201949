"""`quantprep generate --native`: a cpu artifact run by runtime/engine.py with its tokenizer and
chat template read by runtime/tokenizer.py, in a process that imports neither torch nor transformers.
Checked against transformers' own pipeline: AutoTokenizer's apply_chat_template ids, the native
model's greedy tokens from them, AutoTokenizer's decode. The real SmolLM2 tokenizer: tests/test_smollm2.py."""

import json
import shutil
import subprocess
import sys

import pytest
from conftest import CHAT_TEMPLATE, REPO, TINY_LLAMA, add_chat_tokenizer, edit_manifest, one_line_error, relist
from native_c import require_engine

from quantprep.cli import main
from quantprep.errors import ArtifactError
from quantprep.runtime import engine
from quantprep.runtime.tokenizer import ArtifactTokenizer

require_engine()
PROMPT = "b c d e"
# specials and the generation prompt, as real templates use them
TEMPLATE = ("{{ pad_token }} {% if tools is not none or documents is not none %}z {% endif %}{% for m in messages %}{{ m['role'] }} "
            "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}{% generation %}f g{% endgeneration %}{% endif %}")
NEW = 6
# a child that runs the CLI and reports what it imported
RUN = """import json, sys
from quantprep.cli import main
from quantprep.errors import ArtifactError
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint

    root = tmp_path_factory.mktemp("native-generate")
    # Llama: transformers 5's AutoTokenizer runs a Llama tokenizer.json as it is (TokenizersBackend); for a
    # qwen2 config it builds Qwen2Tokenizer's own pipeline from the vocabulary, which this word-level one is not
    gptq = write_random_checkpoint(root / "gptq", TINY_LLAMA, bits=4, group_size=64, desc_act=True, sym=False)
    add_chat_tokenizer(gptq, TINY_LLAMA["vocab_size"])
    prepack(gptq, "cpu", root / "art")
    # a post-processor that adds a special token ("a") in front, as BOS-adding tokenizers do: the bare
    # prompt gets it (add_special_tokens, as tok(prompt)), a rendered template does not (as transformers)
    tok = json.loads((root / "art" / "tokenizer.json").read_text())
    tok["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "a", "type_id": 0}},
                                                                      {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {"a": {"id": "a", "ids": [0], "tokens": ["a"]}}}
    (root / "art" / "tokenizer.json").write_text(json.dumps(tok))
    relist(root / "art", "tokenizer.json")
    return root / "art"


def copy_of(art, tmp_path):
    shutil.copytree(art, tmp_path / "art")
    return tmp_path / "art"


def template_in(art, where: str):
    """The artifact with its chat template moved: TEMPLATE in chat_template.jinja (as saved), in
    tokenizer_config.json as a string or as the "default" of a list, an empty one, or none at all."""
    jinja = art / "chat_template.jinja"
    config = json.loads((art / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if where == "jinja":
        jinja.write_text(TEMPLATE)
        return relist(art, "chat_template.jinja")
    jinja.unlink(missing_ok=True)
    edit_manifest(art, lambda m: m["files"].pop("chat_template.jinja", None))
    if where == "tokenizer_config":
        config["chat_template"] = TEMPLATE
    elif where == "empty":
        config["chat_template"] = ""  # no template, to transformers
    elif where == "default_of_a_list":
        config["chat_template"] = [{"name": "default", "template": CHAT_TEMPLATE}, {"name": "tool_use", "template": CHAT_TEMPLATE},
                                   {"name": "default", "template": TEMPLATE}]  # the last "default" counts, as in transformers
    (art / "tokenizer_config.json").write_text(json.dumps(config))
    return relist(art, "tokenizer_config.json")


def transformers_pipeline(art) -> tuple[list[int], str]:
    """The prompt's ids by AutoTokenizer, and its decode of the native model's greedy tokens from them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(art)
    if tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
    else:
        ids = tok(PROMPT)["input_ids"]
    return ids, tok.decode(engine.load(art).generate(ids, NEW), skip_special_tokens=True)


@pytest.mark.parametrize("where", ["jinja", "tokenizer_config", "default_of_a_list", "empty", "none"])
def test_native_generate_is_transformers_pipeline_without_torch(tmp_path, art, where):
    copy = copy_of(art, tmp_path)
    template_in(copy, where)
    ids, want = transformers_pipeline(copy)
    ours = ArtifactTokenizer(copy, json.loads((copy / "manifest.json").read_text())["files"])
    assert (ours.template is None) == (where in ("none", "empty"))
    assert ours.prompt_ids(PROMPT) == ids and len(ids) == 5 + 3 * (ours.template is not None)  # "a" in front (the template's pad_token, or the post-processor), "user" and "f g"
    proc = subprocess.run([sys.executable, "-c", RUN, "generate", str(copy), "--native", "--json", "--prompt", PROMPT,
                           "--max-new-tokens", str(NEW)], capture_output=True, text=True, cwd=REPO)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report == {"rc": 0, "torch": False, "transformers": False}, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["completion"] == want and want.strip(), (result, want)
    assert 0 < result["load_s"] <= result["first_token_s"]


def test_native_generate_stops_at_end_of_sequence(tmp_path, art, capsys):
    """generation_config.json's eos_token_id (here: the first token greedy picks) ends the completion
    after it, as transformers' generate does (the token is kept, and shows unless it is a special token)."""
    copy = copy_of(art, tmp_path)
    ids = ArtifactTokenizer(copy, json.loads((copy / "manifest.json").read_text())["files"]).prompt_ids(PROMPT)
    first, second = engine.load(copy).generate(ids, 2)
    assert main(["generate", str(copy), "--native", "--json", "--prompt", PROMPT, "--max-new-tokens", "2"]) == 0
    two = json.loads(capsys.readouterr().out)["completion"]
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    relist(copy, "generation_config.json")
    assert main(["generate", str(copy), "--native", "--json", "--prompt", PROMPT, "--max-new-tokens", "2"]) == 0
    one = json.loads(capsys.readouterr().out)["completion"]
    assert len(two.split()) == 2 and one == two.split()[0], (one, two)


BAD = {
    "a template that does not compile": ("chat_template.jinja", "{% for m in %}", "chat_template.jinja: the chat template does not compile"),
    "a template reaching Python's internals": ("chat_template.jinja", "{{ messages.__class__.__mro__ }}", "chat_template.jinja: the chat template failed"),
    "a template that raises": ("chat_template.jinja", "{{ raise_exception('no system role') }}", "no system role"),
    "a template's multi-line message": ("chat_template.jinja", "{{ raise_exception('a\\nquantprep: fake\\x1b[31m') }}",
                                        "a\\nquantprep: fake\\x1b[31m"),
    "a template dividing by zero": ("chat_template.jinja", "{{ 1 / 0 }}", "the chat template failed (ZeroDivisionError"),
    "a template including a file": ("chat_template.jinja", "{% include 'tokenizer.json' %}", "the chat template failed"),
    "a template recursing": ("chat_template.jinja", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "the chat template failed (RecursionError"),
    "a namespace attribute with an underscore": ("chat_template.jinja", "{% set ns = namespace(_x=1) %}a", "starts with an underscore"),
    "a template writing megabytes": ("chat_template.jinja", "{{ 'b ' * 600000 }}", "the chat template writes more than"),
    "a template that is not UTF-8": ("chat_template.jinja", b"\xff\xfe{{ messages }}", "chat_template.jinja: not UTF-8"),
    "a list of templates without a default": ("tokenizer_config.json", '{"chat_template": [{"name": "tool_use", "template": "a"}]}',
                                              "none \"default\""),
    "a tokenizer.json that is not one": ("tokenizer.json", '{"model": 7}', "tokenizer.json: not a tokenizer"),
    "an eos_token_id that is not an id": ("generation_config.json", '{"eos_token_id": "x"}', "eos_token_id 'x' is not an id"),
    "a repetition penalty that is not a number": ("generation_config.json", '{"repetition_penalty": "x"}',
                                                  "repetition_penalty 'x' is not a positive number"),
    "no repeated n-grams": ("generation_config.json", '{"no_repeat_ngram_size": 3}', "no_repeat_ngram_size 3 (generate --native decodes"),
    "a penalty on the prompt's tokens": ("generation_config.json", '{"encoder_repetition_penalty": 1.2}', "encoder_repetition_penalty 1.2"),
    "a message that is an int too long to print": ("chat_template.jinja", "{% set n = messages|length + 9 %}{{ raise_exception(n ** 5000) }}",
                                                   "the chat template failed"),
    "beam search": ("generation_config.json", '{"num_beams": 4}', "num_beams 4"),
}


@pytest.mark.parametrize("case", BAD)
def test_native_generate_refuses_bad_tokenizer_files_in_one_line(tmp_path, art, capsys, case):
    name, text, says = BAD[case]
    copy = copy_of(art, tmp_path)
    if name == "tokenizer_config.json":
        template_in(copy, "none")  # else chat_template.jinja is the one read
    (copy / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    relist(copy, name)
    assert main(["generate", str(copy), "--native", "--prompt", PROMPT]) == 2
    assert says in one_line_error(capsys)


def test_native_generate_reads_only_listed_files(tmp_path, art, capsys):
    """Without a tokenizer.json in the manifest (whose hash the load checked), none is read: refused.
    (An unlisted file beside the listed ones is refused by every load: test_trust_boundary.py.)"""
    copy = copy_of(art, tmp_path)
    edit_manifest(copy, lambda m: m["files"].pop("tokenizer.json"))
    (copy / "tokenizer.json").unlink()
    assert main(["generate", str(copy), "--native"]) == 2
    assert "no tokenizer.json in manifest.json" in one_line_error(capsys)


def test_native_generate_refuses_a_reference_in_one_line(tmp_path, capsys):
    (tmp_path / "index.json").write_text("{}")
    for ref in (str(tmp_path), "oci://127.0.0.1:9/x:y"):
        assert main(["generate", ref, "--native"]) == 2
        assert "quantprep pull" in one_line_error(capsys)


def tokenizer_json_edited(art, tmp_path, edit):
    copy = copy_of(art, tmp_path)
    tok = json.loads((copy / "tokenizer.json").read_text())
    edit(tok)
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    relist(copy, "tokenizer.json")
    return copy


def test_native_generate_neither_truncates_nor_pads(tmp_path, art):
    """tokenizer.json's own truncation and padding are off, as transformers turns them off per call."""
    def edit(tok):
        tok["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
        tok["padding"] = {"strategy": {"Fixed": 20}, "direction": "Left", "pad_to_multiple_of": None, "pad_id": 0,
                          "pad_type_id": 0, "pad_token": "a"}
    plain = ArtifactTokenizer(art, json.loads((art / "manifest.json").read_text())["files"]).prompt_ids(PROMPT)
    copy = tokenizer_json_edited(art, tmp_path, edit)
    assert ArtifactTokenizer(copy, json.loads((copy / "manifest.json").read_text())["files"]).prompt_ids(PROMPT) == plain
    assert len(plain) == 4  # the fixture's template writes the message alone


def test_native_generate_refuses_ids_outside_the_vocabulary(tmp_path, art, capsys):
    """A token of tokenizer.json past the model's vocab_size (256), written by the template: one line."""
    def edit(tok):
        tok["added_tokens"].append({"id": 257, "content": "<big>", "single_word": False, "lstrip": False, "rstrip": False,
                                    "normalized": False, "special": True})
    copy = tokenizer_json_edited(art, tmp_path, edit)
    (copy / "chat_template.jinja").write_text("<big> {{ messages[0]['content'] }}")
    relist(copy, "chat_template.jinja")
    assert main(["generate", str(copy), "--native", "--prompt", PROMPT]) == 2
    assert "tokenizer.json: the prompt encodes to token id 257, outside the model's 256" in one_line_error(capsys)


def test_native_generate_bounds_prompt_and_new_tokens_by_the_context(art, capsys):
    assert main(["generate", str(art), "--native", "--prompt", PROMPT, "--max-new-tokens", "1000000"]) == 2
    assert "max_position_embeddings" in one_line_error(capsys)


def test_native_generate_reads_the_bytes_the_manifest_lists(tmp_path, art):
    """A side file whose bytes are no longer the manifest's (changed after the load's check) is refused."""
    files = json.loads((art / "manifest.json").read_text())["files"]
    changed = dict(files, **{"tokenizer_config.json": dict(files["tokenizer_config.json"], sha256="0" * 64)})
    with pytest.raises(ArtifactError, match="tokenizer_config.json: not the file manifest.json lists"):
        ArtifactTokenizer(art, changed)


def test_native_generate_applies_the_repetition_penalty_as_transformers(tmp_path, art, capsys):
    """generation_config.json's repetition_penalty: each step's tokens are the argmax of transformers'
    own RepetitionPenaltyLogitsProcessor over the native logits (prompt and output ids seen)."""
    import torch
    from transformers import AutoTokenizer
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    copy = copy_of(art, tmp_path)
    (copy / "generation_config.json").write_text(json.dumps({"repetition_penalty": 3.0}))
    relist(copy, "generation_config.json")
    ids = ArtifactTokenizer(copy, json.loads((copy / "manifest.json").read_text())["files"]).prompt_ids(PROMPT)
    model, penalty, seq, want = engine.load(copy), RepetitionPenaltyLogitsProcessor(3.0), list(ids), []
    logits = model.forward(ids)
    for _ in range(NEW):
        want.append(int(penalty(torch.tensor([seq]), torch.from_numpy(logits.copy())[None]).argmax()))
        seq.append(want[-1])
        logits = model.forward(want[-1:])
    assert want != engine.load(copy).generate(ids, NEW)  # the penalty changes the greedy tokens here
    assert main(["generate", str(copy), "--native", "--json", "--prompt", PROMPT, "--max-new-tokens", str(NEW)]) == 0
    assert json.loads(capsys.readouterr().out)["completion"] == AutoTokenizer.from_pretrained(copy).decode(want, skip_special_tokens=True)
