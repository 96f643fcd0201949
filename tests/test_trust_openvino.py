"""The second outside review's openvino cases, each as the attacker built it: a tiny openvino artifact
made by quantprep, one file edited, the manifest resealed as anyone can (conftest.relist). Every
program an openvino artifact holds (the model graph, the tokenizer graphs, the chat template) either
never runs in quantprep or runs only once it equals what quantprep builds from the artifact's data
(runtime/genai.py, docs/security.md).

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
    assert "openvino_model.xml" in one_line(err) and "other values" in err
    assert main(["verify", str(art)]) == 2
    assert "openvino_model.xml" in one_line(capsys.readouterr().err)
    with pytest.raises(ArtifactError, match="not the graph quantprep builds"):
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
