"""The second outside review's openvino cases, each as the attacker built it: a tiny openvino artifact
made by quantprep, one file edited, the manifest resealed as anyone can (conftest.relist). Every
program an openvino artifact holds (the model graph, the tokenizer graphs, the chat template) either
never runs in quantprep or runs only once it equals what quantprep builds from the artifact's data
(runtime/openvino.py, docs/security.md).

case18: a detokenizer whose string table points past its end (it read process memory).
case19: a chat template nested 20,000 deep (genai's C++ Jinja recursed until it crashed).
case20: an IR whose Gather reads an index from bytes appended to the .bin (it segfaulted), and a
        file named openvino_model.xml that is not IR at all (OpenVINO picked another frontend).
"""

import json
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from conftest import TINY_LLAMA, relist

pytest.importorskip("openvino", reason="the openvino extra (make setup installs it)")

import quantprep  # noqa: E402
from quantprep.cli import main  # noqa: E402
from quantprep.errors import ArtifactError  # noqa: E402

PROMPT = "b c d"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An openvino artifact with a tokenizer and chat template, and its untampered completion."""
    from test_openvino_artifact import openvino_artifact

    _, art = openvino_artifact(tmp_path_factory.mktemp("ov-trust"), TINY_LLAMA, tokenizer=True, bits=4, group_size=64,
                               desc_act=True, sym=False)
    code, out, err = generate(art)
    assert code == 0, err
    return art, out


@pytest.fixture
def art(built, tmp_path):
    shutil.copytree(built[0], tmp_path / "ov")
    return tmp_path / "ov"


def generate(art, new: int = 6) -> tuple[int, str, str]:
    """`quantprep generate` in a child process (a crash is a signal there, not the end of pytest):
    its exit code, completion and stderr."""
    proc = subprocess.run([sys.executable, "-m", "quantprep", "generate", str(art), "--prompt", PROMPT, "--max-new-tokens", str(new),
                           "--json"], capture_output=True, text=True, timeout=300)
    return proc.returncode, json.loads(proc.stdout)["completion"] if proc.returncode == 0 else None, proc.stderr


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def layers_and_edges(xml_path):
    root = ET.parse(xml_path).getroot()
    layers = {layer.get("id"): layer for layer in root.iter("layer")}
    edges = [(e.get("from-layer"), e.get("to-layer"), e.get("to-port")) for e in root.iter("edge")]
    return root, layers, edges


def const_inputs(layers, edges, layer_id) -> dict[str, ET.Element]:
    """The Const layers feeding `layer_id`, by input port."""
    return {port: layers[src] for src, dst, port in edges if dst == layer_id and layers[src].get("type") == "Const"}


def test_case18_a_detokenizer_reading_past_its_string_table_never_runs_and_verify_refuses_it(built, art, capsys):
    root, layers, edges = layers_and_edges(art / "openvino_detokenizer.xml")
    [decoder] = [lid for lid, layer in layers.items() if layer.get("type") == "VocabDecoder"]
    begins, ends, chars = (const_inputs(layers, edges, decoder)[port].find("data") for port in ("1", "2", "3"))
    size = int(chars.get("size"))
    data = bytearray((art / "openvino_detokenizer.bin").read_bytes())
    for table, value in ((begins, size), (ends, size + 3000)):  # every token's text: 3000 bytes past the table
        offset, count = int(table.get("offset")), int(table.get("size")) // 4
        data[offset:offset + 4 * count] = struct.pack(f"<{count}i", *[value] * count)
    (art / "openvino_detokenizer.bin").write_bytes(data)
    relist(art, "openvino_detokenizer.bin")

    code, out, err = generate(art)
    assert code == 0, err
    assert out == built[1]  # the artifact's detokenizer did not run: the same text as before the edit
    assert main(["verify", str(art)]) == 2
    assert "openvino_detokenizer.xml" in one_line(capsys.readouterr().err)


def deep_template(depth: int = 20_000) -> str:
    return "{% if true %}" * depth + "x" + "{% endif %}" * depth


def test_case19_a_template_nested_20000_deep_in_the_tokenizer_ir_never_runs_and_verify_refuses_it(built, art, capsys):
    xml = (art / "openvino_tokenizer.xml").read_text()
    start = xml.index('<chat_template value="') + len('<chat_template value="')
    xml = xml[:start] + deep_template().replace("%", "&#37;") + xml[xml.index('"', start):]
    (art / "openvino_tokenizer.xml").write_text(xml)
    relist(art, "openvino_tokenizer.xml")

    code, out, err = generate(art)
    assert code == 0, err
    assert out == built[1]  # the template quantprep rendered is chat_template.jinja's, in its sandbox
    assert main(["verify", str(art)]) == 2
    assert "chat_template" in one_line(capsys.readouterr().err)


def test_case19_a_template_nested_20000_deep_in_the_artifacts_template_is_one_line(art):
    (art / "chat_template.jinja").write_text(deep_template())
    relist(art, "chat_template.jinja")
    code, _, err = generate(art)
    assert code == 2
    assert "chat_template.jinja" in one_line(err)


def test_case20_a_gather_index_appended_to_the_weights_is_refused_before_anything_runs(art, capsys):
    root, layers, edges = layers_and_edges(art / "openvino_model.xml")
    shape_of = {lid for lid, layer in layers.items() if layer.get("type") == "ShapeOf"}
    gather = next(dst for src, dst, port in edges if src in shape_of and port == "0" and layers[dst].get("type") == "Gather")
    index = const_inputs(layers, edges, gather)["1"].find("data")
    bin_size = (art / "openvino_model.bin").stat().st_size
    with open(art / "openvino_model.bin", "ab") as f:
        f.write(struct.pack("<q", 1 << 40))
    index.set("offset", str(bin_size))
    index.set("size", "8")
    ET.ElementTree(root).write(art / "openvino_model.xml")
    relist(art, "openvino_model.xml", "openvino_model.bin")

    code, _, err = generate(art)
    assert code == 2
    assert "openvino_model.xml" in one_line(err) and "not the IR quantprep writes" in err
    assert main(["verify", str(art)]) == 2
    assert "openvino_model.xml" in one_line(capsys.readouterr().err)
    with pytest.raises(ArtifactError, match="not the IR quantprep writes"):
        quantprep.load(art)


def _field(number: int, payload) -> bytes:
    """One protobuf field: a varint (int) or length-delimited bytes."""
    def varint(n: int) -> bytes:
        out = b""
        while True:
            out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                return out
    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def onnx_identity() -> bytes:
    """An ONNX model (y = Identity(x), float [1]), encoded by hand: the onnx package is not installed."""
    tensor = _field(1, _field(1, 1) + _field(2, _field(1, _field(1, 1))))  # TypeProto.tensor_type: float, shape [1]
    value = lambda name: _field(1, name) + _field(2, tensor)  # noqa: E731  ValueInfoProto
    graph = _field(1, _field(1, b"x") + _field(2, b"y") + _field(4, b"Identity")) + _field(2, b"g") + \
        _field(11, value(b"x")) + _field(12, value(b"y"))
    return _field(1, 8) + _field(7, graph) + _field(8, _field(2, 13))  # ir_version 8, the graph, opset 13


def test_case20_a_model_file_that_is_not_ir_is_refused_in_one_line(art):
    import openvino as ov

    (art / "openvino_model.xml").write_bytes(onnx_identity())
    assert ov.Core().read_model(str(art / "openvino_model.xml")).get_parameters()  # OpenVINO itself would run it
    relist(art, "openvino_model.xml")
    code, _, err = generate(art)
    assert code == 2
    assert "not OpenVINO IR" in one_line(err)


# --- from the review of the first fix: OpenVINO's IR reader evaluates constant subgraphs as it reads,
# so an artifact's IR is compared as text and bytes before any reader sees it ---

def _replace_with_graph(art, name: str, build, constant_of) -> None:
    """Write `build()`'s ov.Model as the artifact's `name` IR, each Parameter named in `constant_of`
    turned into a Const holding those bytes (a graph the writer would fold), and reseal."""
    import re

    import openvino as ov

    ov.save_model(build(), art / name, compress_to_fp16=False)
    weights = art / name.replace(".xml", ".bin")
    xml, data = (art / name).read_text(), bytearray(weights.read_bytes())
    for parameter, (kind, shape, raw) in constant_of.items():
        offset = len(data)
        data += raw
        xml, n = re.subn(rf'(name="{parameter}" )type="Parameter"( version="opset1">\s*)<data shape="[^"]*" element_type="[^"]*" />',
                         rf'\1type="Const"\2<data element_type="{kind}" shape="{shape}" offset="{offset}" size="{len(raw)}" />', xml)
        assert n == 1
    (art / name).write_text(xml)
    weights.write_bytes(data)
    relist(art, name, weights.name)


def peak_rss_and_result(*argv: str) -> tuple[int, int, str]:
    """A quantprep command in a child process: (exit code or -signal, its peak RSS in MiB, stderr)."""
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork and exec, so a child of a large pytest
    # would report pytest's own peak
    code = ("import re, sys\nfrom quantprep.cli import main\nrc = main(sys.argv[1:])\n"
            "print(int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) // 1024)\nsys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    return proc.returncode, int(proc.stdout.split()[-1]) if proc.stdout.strip() else -1, proc.stderr


def test_case20_a_model_ir_whose_shape_inference_allocates_gigabytes_is_refused_unread(art):
    import numpy as np
    import openvino as ov
    import openvino.opset15 as ops

    def range_bomb():  # Reshape's target shape from min(range(0, N)) + 1: inferring it builds the range
        stop = ops.parameter([], ov.Type.i64, name="STOP")
        shape = ops.add(ops.reduce_min(ops.range(ops.constant(np.int64(0)), stop, ops.constant(np.int64(1)), ov.Type.i64),
                                       ops.constant(np.array([0], np.int64)), True), ops.constant(np.array([1], np.int64)))
        x = ops.parameter([-1], ov.Type.f32, name="input_ids")
        return ov.Model([ops.result(ops.reshape(x, shape, False))], [x, stop])

    _replace_with_graph(art, "openvino_model.xml", range_bomb, {"STOP": ("i64", "", struct.pack("<q", 300_000_000))})
    code, peak, err = peak_rss_and_result("generate", str(art), "--prompt", PROMPT)
    assert code == 2, err[-2000:]
    assert "openvino_model.xml" in one_line(err)
    assert peak < 1500, peak  # the range alone would be 2.4 GB


def test_case18_verify_never_hands_the_artifacts_detokenizer_to_openvino(art, tmp_path):
    """A detokenizer whose string table ends 2 GB past its bytes, feeding a Reshape's shape: reading
    it folds the VocabDecoder (it faulted: SIGBUS). verify compares it as text and bytes instead."""
    import numpy as np
    import openvino as ov
    import openvino.opset15 as ops
    import openvino_tokenizers

    core = ov.Core()
    core.add_extension(openvino_tokenizers._ext_path)
    for name in ("openvino_detokenizer.xml", "openvino_detokenizer.bin"):  # read from a copy: the model maps its .bin
        shutil.copy(art / name, tmp_path / name)
    original = core.read_model(str(tmp_path / "openvino_detokenizer.xml"))  # quantprep's own, as written
    decoder = next(op for op in original.get_ops() if op.get_type_name() == "VocabDecoder")
    tables = [decoder.input_value(i) for i in range(1, 5)]
    size = decoder.input_value(2).get_partial_shape()[0].get_length()

    def folded_decoder():
        ids = ops.parameter([1, 3], ov.Type.i32, name="IDS")
        begins, ends = (ops.parameter([size], ov.Type.i32, name=n) for n in ("BEGINS", "ENDS"))
        text = openvino_tokenizers._get_factory().create("VocabDecoder", [ids, begins.output(0), ends.output(0), *tables[2:]],
                                                         {"skip_tokens": []})
        shape = ops.convert(ops.slice(text.output(0), *(ops.constant(np.array([v], np.int64)) for v in (0, 1, 1))), ov.Type.i64)
        x = ops.parameter([-1], ov.Type.f32, name="x")
        return ov.Model([ops.result(ops.reshape(x, shape, False))], [x, ids, begins, ends])

    _replace_with_graph(art, "openvino_detokenizer.xml", folded_decoder,
                        {"IDS": ("i32", "1,3", struct.pack("<3i", 1, 2, 3)), "BEGINS": ("i32", str(size), struct.pack(f"<{size}i", *[0] * size)),
                         "ENDS": ("i32", str(size), struct.pack(f"<{size}i", *[2_000_000_000] * size))})
    code, _, err = peak_rss_and_result("verify", str(art))
    assert code == 2, err[-2000:]
    assert "openvino_detokenizer.xml" in one_line(err)


def _edit_xml(art, name: str, old: str, new: str, count: int = 1) -> None:
    xml = (art / name).read_text()
    assert old in xml, old
    (art / name).write_text(xml.replace(old, new, count))
    relist(art, name)


@pytest.mark.parametrize("edit", ["a u4 weight read as nf4", "IR version 10", "a port's rt_info"])
def test_case20_what_the_ir_says_about_its_weights_and_itself_is_compared_too(art, capsys, edit):
    xml = (art / "openvino_model.xml").read_text()
    if edit == "a u4 weight read as nf4":  # the plugin would run a decompression quantprep never writes
        start = xml.index('name="model.layers.0.mlp.down_proj.weight"')
        kind = xml.index('element_type="u4"', start)
        xml = xml[:kind] + 'element_type="nf4"' + xml[kind + len('element_type="u4"'):]
        (art / "openvino_model.xml").write_text(xml)
        relist(art, "openvino_model.xml")
    elif edit == "IR version 10":  # read_model upgrades a v10 IR with passes of its own
        _edit_xml(art, "openvino_model.xml", 'version="11"', 'version="10"')
    else:
        _edit_xml(art, "openvino_model.xml", '<port id="0" precision="I64" names="input_ids">',
                  '<port id="0" precision="I64" names="input_ids"><rt_info><attribute name="layout" version="0" value="[N,C]" /></rt_info>')
    assert main(["generate", str(art), "--prompt", PROMPT]) == 2
    assert "openvino_model.xml" in one_line(capsys.readouterr().err)


def test_case18_verify_refuses_a_tokenizer_ir_missing_the_settings_it_was_converted_with(art, capsys):
    """genai reads eos, pad and the special-token rules from the tokenizer IR's rt_info."""
    xml = (art / "openvino_tokenizer.xml").read_text()
    start = xml.index("<eos_token_id ")
    (art / "openvino_tokenizer.xml").write_text(xml[:start] + xml[xml.index("/>", start) + 2:])
    relist(art, "openvino_tokenizer.xml")
    assert main(["verify", str(art)]) == 2
    assert "openvino_tokenizer.xml" in one_line(capsys.readouterr().err)


def test_case20_a_config_dimension_past_any_model_is_one_line(art, capsys):
    config = json.loads((art / "config.json").read_text())
    (art / "config.json").write_text(json.dumps(dict(config, head_dim=200_000_000_000)))
    relist(art, "config.json")
    assert main(["generate", str(art), "--prompt", PROMPT]) == 2
    assert "head_dim" in one_line(capsys.readouterr().err)


def test_case20_a_module_the_manifest_drops_and_the_ir_lacks_is_one_line(art, capsys):
    from conftest import edit_manifest

    _edit_xml(art, "openvino_model.xml", 'name="model.layers.0.mlp.down_proj.weight"', 'name="renamed"')
    edit_manifest(art, lambda m: m["modules"].pop("model.layers.0.mlp.down_proj"))
    assert main(["generate", str(art), "--prompt", PROMPT]) == 2
    assert "model.layers.0.mlp.down_proj.weight" in one_line(capsys.readouterr().err)


# --- the traced graph's check (runtime/openvino_graph.py): what it builds from is bounded first ---
# Found by an attacker review of the traced IR: each made load build or trace something large, or
# end in a traceback, before the comparison could refuse it.

@pytest.mark.parametrize("edit,named", [
    ({"num_hidden_layers": 20000}, "num_hidden_layers=20000"),  # every layer built before a weight was missing: 91 s, 1.7 GB
    ({"max_position_embeddings": 1 << 25}, "max_position_embeddings"),  # a buffer of positions x hidden, built for real
    ({"model_type": "bert"}, "model_type='bert'"),  # a model no test converts: refused, not traced
    ({"hidden_act": "nope"}, "KeyError"),  # transformers' own refusal, in one line
])
def test_a_config_that_would_build_something_large_or_fail_inside_transformers_is_one_line(art, edit, named):
    config = json.loads((art / "config.json").read_text())
    (art / "config.json").write_text(json.dumps(dict(config, **edit)))
    relist(art, "config.json")
    code, _, err = generate(art)
    assert code == 2 and named in one_line(err)


@pytest.mark.parametrize("edit", [
    lambda meta: meta.update(groups=0),  # divided by
    lambda meta: meta.pop("padded_in"),
    lambda meta: meta.update(out_features=1 << 27),  # the trace's stand-in allocated [.., 2^27]: 2 GB
    lambda meta: meta.update(sym="no"),
])
def test_module_metadata_is_checked_whole_before_anything_is_built(art, edit):
    from conftest import edit_manifest

    edit_manifest(art, lambda m: edit(m["modules"]["model.layers.0.self_attn.o_proj"]))
    code, _, err = generate(art)
    assert code == 2 and "model.layers.0.self_attn.o_proj" in one_line(err)


def test_an_act_order_perm_that_is_not_a_permutation_is_refused(art):
    root, layers, _ = layers_and_edges(art / "openvino_model.xml")
    data = next(layer for layer in layers.values() if layer.get("name") == "model.layers.0.mlp.down_proj.perm").find("data")
    offset, size = int(data.get("offset")), int(data.get("size"))
    blob = bytearray((art / "openvino_model.bin").read_bytes())
    blob[offset:offset + size] = np.full(size // 8, 160, dtype=np.int64).tobytes()  # every index one past the end
    (art / "openvino_model.bin").write_bytes(bytes(blob))
    relist(art, "openvino_model.bin")
    code, _, err = generate(art)
    assert code == 2 and "not a permutation" in one_line(err)


def test_an_rt_info_entry_named_as_the_writer_but_holding_settings_is_compared(art):
    _edit_xml(art, "openvino_model.xml", "\n\t<rt_info>",  # the model's own, one tab in
              '\n\t<rt_info><runtime_options name="OpenVINO Runtime"><KV_CACHE_PRECISION value="u8" /></runtime_options>')
    code, _, err = generate(art)
    assert code == 2 and "runtime_options" in one_line(err)
