"""What `quantprep generate` prints of an artifact it does not trust (issue 53, cases 6 and 7), through the
real command in a child process: a chat template that fails under transformers is one line naming its
file (as --native says it: test_generate_native.py), and a completion's control characters reach a
terminal escaped, on every path (torch, --native, openvino), while a pipe gets the text as generated. Outside
completions too (review finding F9): `inspect`'s lines from a hostile manifest and the CLI's one-line
errors reach a terminal escaped, a pipe unchanged."""

import json
import os
import pty
import shutil
import subprocess
import sys
import tempfile

import pytest
from conftest import REPO, TINY_LLAMA, add_chat_tokenizer, edit_manifest, relist
from native_c import require_engine

GENERATE = [sys.executable, "-m", "quantprep", "generate"]
PROMPT = "a"  # id 0 of the word-level vocabulary below, the one word that is not hostile
# A word that sets the terminal's title (OSC ... BEL), clears the screen (CSI 2J), sets a colour through the
# one-character C1 CSI (U+009B), returns the carriage and deletes (DEL), with a tab and a newline that must stay
HOSTILE_WORD = "\x1b]0;pwned\x07\x1b[2J\x9b31m\r{}\x7f\t\n"


@pytest.fixture(scope="module")
def hostile_gptq(tmp_path_factory):
    """A random Llama checkpoint whose vocabulary is all hostile words but "a": whatever it generates is one."""
    from quantprep.build.synthetic import write_random_checkpoint

    gptq = write_random_checkpoint(tmp_path_factory.mktemp("hostile") / "gptq", TINY_LLAMA, bits=4, group_size=64,
                                   desc_act=True, sym=False)
    add_chat_tokenizer(gptq, TINY_LLAMA["vocab_size"])
    tok = json.loads((gptq / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {"a": 0, **{HOSTILE_WORD.format(i): i for i in range(1, TINY_LLAMA["vocab_size"])}}
    (gptq / "tokenizer.json").write_text(json.dumps(tok))
    return gptq


@pytest.fixture(scope="module")
def artifact(hostile_gptq):
    """artifact(target): the hostile checkpoint prepacked for `target` (cpu, openvino), once per module."""
    from quantprep.build.pipeline import prepack

    def make(target: str):
        out = hostile_gptq.parent / target
        if not out.exists():
            prepack(hostile_gptq, target, out)
        return out
    return make


def generate_piped(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*GENERATE, *args], capture_output=True, cwd=REPO, timeout=600)


def generate_on_terminal(*args: str) -> bytes:
    """`quantprep generate ARGS` run to success with a pseudo-terminal as its stdout: the bytes the terminal got."""
    shown, err, code = on_terminal([*GENERATE, *args])
    assert code == 0, err.decode()[-3000:]
    return shown


def on_terminal(argv: list[str], stream: str = "stdout") -> tuple[bytes, bytes, int]:
    """`argv` run with a pseudo-terminal as its `stream` (stdout or stderr) and the other one piped:
    (the bytes the terminal got, the other stream's, the exit code)."""
    terminal, child_end = pty.openpty()
    with tempfile.TemporaryFile() as other:
        ends = {"stdout": child_end, "stderr": other} if stream == "stdout" else {"stdout": other, "stderr": child_end}
        proc = subprocess.Popen(argv, **ends, cwd=REPO)
        os.close(child_end)  # the child holds the only other end: reads end when it exits
        got = bytearray()
        while True:
            try:
                chunk = os.read(terminal, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            got += chunk
        os.close(terminal)
        code = proc.wait(timeout=600)
        other.seek(0)
        return bytes(got), other.read(), code


def escaped(text: str) -> str:
    """The test's own spelling of what a terminal should get: each C0 control but newline and tab, DEL
    and each C1 control as \\xNN."""
    return "".join(f"\\x{ord(c):02x}" if (ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f else c for c in text)


# case 6: a chat template that fails under transformers (the torch path)
TEMPLATE_FAILURES = {
    "raises": ("chat_template.jinja", "{{ raise_exception('no system role\\x1b[31m') }}", "TemplateError: no system role\\x1b[31m"),
    "nested thousands deep": ("chat_template.jinja", "{% if true %}" * 3000 + "a" + "{% endif %}" * 3000, "RecursionError"),
    "an expression nested thousands deep": ("tokenizer_config.json", "{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "RecursionError"),
    "divides by zero": ("chat_template.jinja", "{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    "more nested blocks than Python compiles": ("tokenizer_config.json", "{% for m in messages %}" * 30 + "a" + "{% endfor %}" * 30,
                                                "SyntaxError: too many statically nested blocks"),
}


@pytest.mark.parametrize("case", TEMPLATE_FAILURES)
def test_case22_a_failing_chat_template_is_one_line_naming_its_file(artifact, tmp_path, case):
    where, template, says = TEMPLATE_FAILURES[case]
    art = shutil.copytree(artifact("cpu"), tmp_path / "art")
    if where == "chat_template.jinja":
        (art / where).write_text(template)
    else:  # without chat_template.jinja, AutoTokenizer reads tokenizer_config.json's
        (art / "chat_template.jinja").unlink()
        edit_manifest(art, lambda m: m["files"].pop("chat_template.jinja"))
        config = json.loads((art / where).read_text())
        (art / where).write_text(json.dumps(dict(config, chat_template=template)))
    relist(art, where)  # resealed, as whoever hands out the artifact can
    proc = generate_piped(str(art), "--prompt", PROMPT)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-3000:]
    assert err.startswith(f"quantprep: error: {art / where}: the chat template failed (") and says in err, err
    assert "rebuild the artifact" in err and "\x1b" not in err, err


# case 7: control characters of a completion, on a terminal and through a pipe
PATHS = {
    "torch": ("cpu", []),
    "native": ("cpu", ["--native"]),
    "openvino": ("openvino", []),
}


@pytest.mark.parametrize("path", PATHS)
def test_case23_a_completion_reaches_a_terminal_escaped_and_a_pipe_unchanged(artifact, path):
    if path == "native":
        require_engine()
    if path == "openvino":
        pytest.importorskip("openvino", reason="the openvino extra (make setup installs it)")
    target, options = PATHS[path]
    args = (str(artifact(target)), *options, "--prompt", PROMPT, "--max-new-tokens", "6")

    piped = generate_piped(*args)
    assert piped.returncode == 0, piped.stderr.decode()[-3000:]
    completion = piped.stdout.decode().split("\n", 1)[1].removesuffix("\n")  # after the timings line
    words = {HOSTILE_WORD.format(i) for i in range(1, TINY_LLAMA["vocab_size"])}
    assert completion and all(w in words for w in completion.split(" ")), repr(completion)  # the words as they are

    shown = generate_on_terminal(*args)
    for raw in (b"\x1b", b"\x07", b"\x7f"):
        assert raw not in shown, shown
    text = shown.decode().replace("\r\n", "\n")  # the terminal's own newline translation (ONLCR)
    assert not any((ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f for c in text), repr(text)
    assert text.split("\n", 1)[1] == escaped(completion) + "\n", repr(text)
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m\\x0d" in text and "\\x7f\t\n" in text


# F9: a hostile manifest's fields, in inspect's lines and in an error line, on a terminal and through a pipe
# A field that sets the terminal's title, clears the screen and opens a hyperlink (OSC 8, ended by ESC \\)
HOSTILE_FIELD = "\x1b]0;pwned\x07\x1b[2J\x1b]8;;https://example.invalid\x1b\\here\x1b]8;;\x1b\\\x9b31m\r"
INSPECT = [sys.executable, "-m", "quantprep", "inspect"]


def hostile_manifest(artifact, tmp_path, edit) -> str:
    """A copy of the cpu artifact's manifest (all inspect reads) edited as anyone can: its directory."""
    art = tmp_path / "art"
    art.mkdir()
    shutil.copy(artifact("cpu") / "manifest.json", art / "manifest.json")
    edit_manifest(art, edit)
    return str(art)


def shown_text(shown: bytes) -> str:
    """What a terminal got, as text with no control character but newline and tab in it."""
    text = shown.decode().replace("\r\n", "\n")  # the terminal's own newline translation (ONLCR)
    assert not any((ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f for c in text), repr(text)
    return text


def test_case23_inspect_prints_a_manifests_fields_escaped_on_a_terminal_and_unchanged_through_a_pipe(artifact, tmp_path):
    art = hostile_manifest(artifact, tmp_path, lambda m: m.update(created=HOSTILE_FIELD, quantprep_version=HOSTILE_FIELD))
    shown, err, code = on_terminal([*INSPECT, art])
    assert code == 0, err.decode()[-3000:]
    text = shown_text(shown)
    assert f"built {escaped(HOSTILE_FIELD)} by quantprep {escaped(HOSTILE_FIELD)}\n" in text, repr(text)
    piped = subprocess.run([*INSPECT, art], capture_output=True, cwd=REPO, timeout=600)
    assert piped.returncode == 0 and f"built {HOSTILE_FIELD} by quantprep {HOSTILE_FIELD}\n" in piped.stdout.decode(), piped
    as_json = on_terminal([*INSPECT, art, "--json"])[0].decode().replace("\r\n", "\n")  # json.dumps escapes: as it was
    assert json.loads(as_json)["created"] == HOSTILE_FIELD


def test_case23_an_error_line_quoting_hostile_text_is_escaped_on_a_terminal_and_unchanged_through_a_pipe(artifact, tmp_path):
    art = hostile_manifest(artifact, tmp_path, lambda m: m.update({HOSTILE_FIELD: 1}))  # read_manifest names unknown fields
    shown, out, code = on_terminal([*INSPECT, art], stream="stderr")
    assert code == 2 and out == b"", out
    text = shown_text(shown)
    assert text.startswith("quantprep: error: ") and text.count("\n") == 1, repr(text)
    assert f"unknown field(s) {escaped(HOSTILE_FIELD)};" in text, repr(text)
    piped = subprocess.run([*INSPECT, art], capture_output=True, cwd=REPO, timeout=600)
    assert piped.returncode == 2 and f"unknown field(s) {HOSTILE_FIELD};" in piped.stderr.decode(), piped
