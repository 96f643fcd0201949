"""Hostile artifacts, registries, repos and clients (issue 29): each case of the outside review,
reproduced as the attacker would and seen refused (exit 2, one line) or leaving the user's files
unchanged. Case numbers are the issue's."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from conftest import edit_manifest, one_line_error
from hostile_registry import HostileRegistry

from quantprep.cli import main
from quantprep.distribution.publish import INDEX, publish, pull
from quantprep.errors import ArtifactError
from quantprep.format.artifact import MANIFEST, sha256_file


@pytest.fixture
def art(random_gptq, tmp_path) -> Path:
    from quantprep.build.pipeline import prepack

    out = tmp_path / "art"
    prepack(random_gptq, "cpu", out)
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTPREP_PULL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def hostile():
    reg = HostileRegistry()
    yield reg
    reg.close()


def tree(root: Path) -> dict:
    """Every path under root with its bytes (files) and mtime: what 'unchanged' is compared by."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


# --- 1. a command replaces only what is provably its own -------------------------------------------

def _site(root: Path, **files: str) -> Path:
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_case01_publish_keeps_a_directory_with_a_foreign_index(art, tmp_path, capsys):
    site = _site(tmp_path / "site", **{"index.json": '{"pages": ["home"]}', "home.html": "<p>mine</p>"})
    before = tree(site)
    assert main(["publish", str(art), "--to", str(site)]) == 2
    assert "not a published quantprep reference" in one_line_error(capsys) and tree(site) == before
    # a real quantprep index, plus a file of the user's: not provably ours either
    ref = tmp_path / "ref"
    publish([art], str(ref))
    (ref / "notes.txt").write_text("mine")
    assert main(["publish", str(art), "--to", str(ref)]) == 2
    one_line_error(capsys)
    assert (ref / "notes.txt").read_text() == "mine"
    (ref / "notes.txt").unlink()
    assert main(["publish", str(art), "--to", str(ref)]) == 0  # its own: replaced
    assert main(["publish", str(art), "--to", str(site), "--force"]) == 0 and (site / INDEX).is_file()
    assert not (site / "home.html").exists()  # --force replaces it, as asked


@pytest.mark.parametrize("command", ["pull", "prepack"])
def test_case01_pull_and_prepack_keep_a_directory_with_a_foreign_manifest(art, random_gptq, tmp_path, capsys, command):
    extension = _site(tmp_path / "ext", **{"manifest.json": '{"manifest_version": 3, "name": "mine"}', "bg.js": "1;"})
    before = tree(extension)
    ref = tmp_path / "ref"
    publish([art], str(ref))
    argv = (["pull", str(ref), "--out", str(extension)] if command == "pull"
            else ["prepack", str(random_gptq), "--target", "cpu", "--out", str(extension)])
    assert main(argv) == 2
    assert "not a quantprep artifact" in one_line_error(capsys) and tree(extension) == before


def test_case01_leftover_names_without_quantprep_marker_are_never_touched(art, tmp_path, capsys):
    """A user's directories named like staging leftovers (a dead pid, an `.old`) stay as they are,
    also when the destination is missing (the `.old` is not 'restored' into its place)."""
    ref = tmp_path / "ref"
    partial = _site(tmp_path / ".ref.partial-999999", **{"data.txt": "mine"})
    old = _site(tmp_path / ".ref.old", **{"data.txt": "mine too"})
    before = tree(tmp_path / ".ref.partial-999999"), tree(old)
    publish([art], str(ref))  # the destination is missing: nothing to restore from `.ref.old`
    assert main(["publish", str(art), "--to", str(ref)]) == 0  # a replace, with a user's `.old` in the way of none
    assert (tree(partial), tree(old)) == before
    # quantprep's own leftovers (marked, their writer dead) are cleaned by the next writer
    from quantprep._io.staging import MARKER

    mine = tmp_path / ".ref.partial-999998"
    mine.mkdir()
    (mine / MARKER).write_text(json.dumps({"pid": 999998, "out": "ref"}))
    publish([art], str(ref))
    assert not mine.exists() and (tree(partial), tree(old)) == before


# --- 13. everything is on disk before the rename that publishes it ---------------------------------

@pytest.mark.parametrize("command", ["pull", "publish"])
def test_case13_every_file_and_directory_is_fsynced_before_the_swap(art, cache, tmp_path, monkeypatch, command):
    from quantprep._io import staging

    ref = tmp_path / "ref"
    publish([art], str(ref))
    events = []
    fsync, rename, exchange = staging.fsync_path, os.rename, staging._exchange
    monkeypatch.setattr(staging, "fsync_path", lambda p: (events.append(("fsync", Path(p))), fsync(p))[1])
    monkeypatch.setattr(staging.os, "rename", lambda a, b: (events.append(("rename", Path(a))), rename(a, b))[1])
    monkeypatch.setattr(staging, "_exchange", lambda a, b: (events.append(("rename", Path(a))), exchange(a, b))[1])
    out = pull(str(ref), out=tmp_path / "got") if command == "pull" else (publish([art], str(tmp_path / "ref2")), tmp_path / "ref2")[1]
    [swap] = [i for i, (kind, p) in enumerate(events) if kind == "rename" and p.name.startswith(f".{out.name}.partial-")]
    staged = events[swap][1]
    synced = {p.relative_to(staged) for kind, p in events[:swap] if kind == "fsync" and staged in (p, *p.parents)}
    published = {p.relative_to(out) for p in out.rglob("*")} | {Path(".")}
    assert published <= synced, sorted(published - synced)


# --- 3. a kcache layer cannot write more than its manifest lists -----------------------------------

def _with_kcache(art: Path, files: dict[str, bytes]) -> None:
    """Give the artifact a kcache/ as `warm` would list it (the content here is inert bytes)."""
    import hashlib

    for rel, data in files.items():
        (art / "kcache" / rel).parent.mkdir(parents=True, exist_ok=True)
        (art / "kcache" / rel).write_bytes(data)
    edit_manifest(art, lambda m: m.update(kcache={
        "key": {"device": "cpu"}, "shapes": [1], "compile": True,
        "files": {rel: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for rel, d in files.items()}}))


def _sparse_tar(name: str, size: int) -> bytes:
    """A GNU sparse tar: a member of `size` bytes of holes, from a few KiB of archive."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        Path(d, name).parent.mkdir(parents=True)
        with open(Path(d, name), "wb") as f:
            f.truncate(size)
        return subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", "-", "-C", d, name], capture_output=True, check=True).stdout


def _plain_tar(name: str, size: int, data_size: int | None = None, pad: int = 0) -> bytes:
    """A tar whose member header says `size` bytes and that holds `data_size` of them (GNU
    base-256 sizes allow any size at all), then `pad` zero bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        info = tarfile.TarInfo(name)
        info.size = size
        t.addfile(info, io.BytesIO(b"\0" * size) if data_size is None else None)
    raw = buf.getvalue()
    return (raw if data_size is None else raw[:512 + data_size]) + b"\0" * pad


def _entry(art: Path, tmp_path: Path) -> tuple[str, dict]:
    publish([art], str(tmp_path / "dirref"))
    [entry] = json.loads((tmp_path / "dirref" / INDEX).read_text())["variants"]
    return entry["name"], entry


@pytest.mark.parametrize("attack", ["sparse", "base-256 size", "size differs", "oversized layer"])
def test_case03_a_kcache_layer_never_writes_beyond_the_listed_sizes(art, cache, hostile, tmp_path, capsys, attack):
    rel = "triton/kernel.so"
    _with_kcache(art, {rel: b"\x7fELF" + b"\0" * 60})
    name, entry = _entry(art, tmp_path)
    tar = {"sparse": lambda: _sparse_tar(rel, 1 << 30),  # the review's: 10 KiB of tar that writes 1 GiB
           "base-256 size": lambda: _plain_tar(rel, 1 << 40, data_size=4096),
           "size differs": lambda: _plain_tar(rel, 4096),
           "oversized layer": lambda: _plain_tar(rel, 64, pad=1 << 20)}[attack]()
    hostile.publish(art, name, entry, kcache_tar=tar)
    wrote = _bytes_written()
    assert main(["pull", hostile.ref()]) == 2
    err = one_line_error(capsys)
    if attack == "size differs":  # refused at the member's header, before its bytes are written
        assert "the manifest lists 64" in err, err
    assert _bytes_written() - wrote < 16 << 20  # this process's writes during the pull: no 1 GiB, even transiently
    assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")] if cache.exists() else True
    if attack == "oversized layer":  # refused from the descriptor, before a byte of it was fetched
        assert _layer_digest(hostile) not in hostile.requests


def _bytes_written() -> int:
    """Bytes this process has passed to write calls so far (Linux /proc/self/io wchar)."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("wchar:")).split()[1])


def _layer_digest(reg: HostileRegistry) -> str:
    """The kcache layer's blob path in the hostile registry (the one with the largest body)."""
    return max((p for p in reg.routes if "/blobs/" in p), key=lambda p: len(reg.routes[p]))


# --- 9. deep JSON and odd types anywhere are one line ----------------------------------------------

DEEP = b"[" * 200_000 + b"]" * 200_000


def test_case09_deep_json_in_a_manifest_or_an_index_is_one_line(art, cache, tmp_path, capsys):
    (art / MANIFEST).write_bytes(b'{"a": ' + DEEP + b"}")
    for argv in (["inspect", str(art)], ["verify", str(art)], ["generate", str(art)]):
        assert main(argv) == 2, argv
        assert "nested deeper" in one_line_error(capsys)
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / INDEX).write_bytes(b'{"variants": ' + DEEP + b"}")
    assert main(["pull", str(ref)]) == 2
    assert "nested deeper" in one_line_error(capsys)


@pytest.mark.parametrize("answer", ["deep index", "list annotations", "deep entry", "layer annotations a list"])
def test_case09_a_registry_answering_deep_json_or_odd_types_is_one_line(art, cache, hostile, tmp_path, capsys, answer):
    name, entry = _entry(art, tmp_path)
    if answer == "layer annotations a list":
        hostile.publish(art, name, entry, layer_edit=lambda layers: layers[0].update(annotations=["x"]))
    elif answer == "deep entry":
        hostile.publish(art, name, entry)
        index = json.loads(hostile.routes["/v2/models/x/manifests/v1"])
        index["manifests"][0]["annotations"]["org.quantprep.entry"] = (b'{"a": ' + DEEP + b"}").decode()
        hostile.manifest("models/x", "v1", json.dumps(index).encode())
    else:
        body = (b'{"manifests": ' + DEEP + b"}" if answer == "deep index"
                else json.dumps({"manifests": [{"digest": "sha256:" + "0" * 64, "annotations": [1, 2]}]}).encode())
        hostile.manifest("models/x", "v1", body)
    assert main(["pull", hostile.ref()]) == 2
    one_line_error(capsys)


# --- 10. every registry answer is read bounded -----------------------------------------------------

def test_case10_an_endless_probe_body_is_not_read(art, cache, hostile, capsys):
    hostile.routes["/v2/"] = lambda: (b"x" * (64 << 10) for _ in range(400 << 4))  # 400 MiB, what the review measured
    assert main(["pull", hostile.ref()]) == 2  # no index behind it: one line
    one_line_error(capsys)
    assert hostile.sent < 32 << 20, hostile.sent  # socket buffers, not the 400 MiB the review measured


def test_case10_json_layers_are_capped_before_download(art, cache, hostile, tmp_path, capsys):
    from quantprep._io.jsonfile import MAX_JSON_BYTES

    name, entry = _entry(art, tmp_path)
    hostile.publish(art, name, entry, layer_edit=lambda layers: layers[0].update(size=MAX_JSON_BYTES + 1))
    assert main(["pull", hostile.ref()]) == 2
    assert "more than" in one_line_error(capsys)
    assert not [r for r in hostile.requests if "/blobs/" in r]


# --- 2. from_pretrained verifies the directory it loads ---------------------------------------------

@pytest.mark.parametrize("how", ["../ path", "absolute path"])
def test_case02_from_pretrained_refuses_an_index_that_points_at_another_artifact(art, tmp_path, monkeypatch, how):
    """A folder with no manifest and no signature: an edited config.json and an index naming a
    signed artifact's shards. With a verify key set, the signed artifact was verified and this
    folder's config loaded. Now the loaded folder is what is verified, and it is refused."""
    from conftest import keypair
    from transformers import AutoModelForCausalLM

    import quantprep  # noqa: F401 (registers the quantizer)
    from quantprep.distribution.signing import sign
    from quantprep.format.artifact import WEIGHTS_INDEX

    key, pub = keypair(tmp_path / "keys")
    sign(art, key)
    monkeypatch.setenv("QUANTPREP_VERIFY_KEY", str(pub))
    AutoModelForCausalLM.from_pretrained(art)  # the signed artifact itself loads
    evil = tmp_path / "evil"
    evil.mkdir()
    config = json.loads((art / "config.json").read_text())
    config["rope_theta"] = config.get("rope_theta", 10000.0) * 7  # a silently different model
    (evil / "config.json").write_text(json.dumps(config))
    index = json.loads((art / WEIGHTS_INDEX).read_text())
    shard = (f"../{art.name}/" if how == "../ path" else f"{art}/")
    index["weight_map"] = {k: shard + v for k, v in index["weight_map"].items()}
    (evil / WEIGHTS_INDEX).write_text(json.dumps(index))
    with pytest.raises(ArtifactError, match="outside"):
        AutoModelForCausalLM.from_pretrained(evil)


# --- 4. a source's side files never bring a user's file along ---------------------------------------

def test_case04_a_side_file_linked_outside_the_source_is_refused(random_gptq, tmp_path, capsys):
    secret = tmp_path / "home" / ".ssh" / "id_ed25519"
    secret.parent.mkdir(parents=True)
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    (random_gptq / "merges.txt").symlink_to(secret)
    out = tmp_path / "out"
    assert main(["prepack", str(random_gptq), "--target", "cpu", "--out", str(out)]) == 2
    assert "outside the checkpoint" in one_line_error(capsys)
    assert not out.exists() and not [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink() and p != secret and "secret" in p.read_text(errors="ignore")]


def test_case04_a_weight_map_that_is_not_a_plain_file_name_is_refused(random_gptq, tmp_path, capsys):
    other = tmp_path / "other.safetensors"
    [shard] = random_gptq.glob("*.safetensors")
    shard.rename(other)
    from safetensors import safe_open

    with safe_open(other, "pt") as f:
        names = list(f.keys())
    (random_gptq / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, "../other.safetensors")}))
    assert main(["prepack", str(random_gptq), "--target", "cpu", "--out", str(tmp_path / "out")]) == 2
    assert "not a plain" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_case04_a_hub_cache_snapshot_with_links_to_its_blobs_still_builds(random_gptq, tmp_path):
    """The allowed case: huggingface_hub's snapshots are links into the repository's blobs/."""
    from quantprep.format.artifact import read_manifest

    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    (random_gptq / "merges.txt").write_text("#version: 0.2\n")
    for p in random_gptq.iterdir():
        blob = blobs / sha256_file(p)
        p.rename(blob)
        (snap / p.name).symlink_to(Path("../../blobs") / blob.name)
    assert main(["prepack", str(snap), "--target", "cpu", "--out", str(tmp_path / "out")]) == 0
    assert "merges.txt" in read_manifest(tmp_path / "out")["files"]


# --- 5. an artifact never runs its own Python through transformers ----------------------------------

EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nraise SystemExit(1)\n"


@pytest.mark.parametrize("where", ["config auto_map", "tokenizer auto_map", "listed evil.py"])
def test_case05_remote_code_in_an_artifact_is_refused(art, tmp_path, where):
    import subprocess
    import sys

    from conftest import relist

    marker = tmp_path / "evil-ran"
    (art / "evil.py").write_text(EVIL.format(marker=str(marker)))
    auto_map = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel", "AutoTokenizer": ["evil.Tok", None]}
    name = "tokenizer_config.json" if where == "tokenizer auto_map" else "config.json"
    data = json.loads((art / name).read_text()) if (art / name).is_file() else {}
    data.update(auto_map=auto_map, **({"model_type": "evil"} if name == "config.json" else {}))
    (art / name).write_text(json.dumps(data))
    relist(art, name, "evil.py")
    for argv in (["generate", str(art)], ["serve", str(art), "--port", "9"]):
        # a TTY would ask "run the custom code? [y/N]"; piped stdin gave a traceback
        proc = subprocess.run([sys.executable, "-m", "quantprep", *argv], input="y\n", capture_output=True, text=True, timeout=300)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert ("auto_map" in err[0] or "evil.py" in err[0]) and not marker.exists(), err


def test_case05_a_source_with_remote_code_is_refused(random_gptq, tmp_path, capsys):
    config = json.loads((random_gptq / "config.json").read_text())
    (random_gptq / "config.json").write_text(json.dumps(dict(config, auto_map={"AutoModelForCausalLM": "evil.EvilModel"})))
    assert main(["prepack", str(random_gptq), "--target", "cpu", "--out", str(tmp_path / "out")]) == 2
    assert "auto_map" in one_line_error(capsys) and not (tmp_path / "out").exists()


# --- 12. generate reads the tokenizer of the directory load verified --------------------------------

def test_case12_generate_ignores_a_tokenizer_beside_a_reference(tiny_gptq4, cache, tmp_path, capsys):
    from quantprep.build.pipeline import prepack

    a = tmp_path / "a"
    prepack(tiny_gptq4, "cpu", a)
    ref = tmp_path / "ref"
    publish([a], str(ref))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):  # the reference's root is not checked
        if (a / name).is_file():
            (ref / name).write_bytes((a / name).read_bytes())
    tok = json.loads((ref / "tokenizer.json").read_text())  # the same words under other ids: other text decodes
    words = sorted(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
    tok["model"]["vocab"] = {w: i for i, w in enumerate(reversed(words))}
    (ref / "tokenizer.json").write_text(json.dumps(tok))
    argv = ["--prompt", "The capital of France is", "--max-new-tokens", "8", "--json"]
    assert main(["generate", str(a), *argv]) == 0
    want = json.loads(capsys.readouterr().out)["completion"]
    assert main(["generate", str(ref), *argv]) == 0
    assert json.loads(capsys.readouterr().out)["completion"] == want


# --- 6. the kcache that runs is the kcache that was hashed -------------------------------------------

def test_case06_a_kcache_file_swapped_after_a_read_is_not_what_runs(art, tmp_path, monkeypatch):
    """The attacker swaps a kcache file right after quantprep first reads it: the private copy
    holds the bytes that were hashed, because the artifact's file is read once, while copying."""
    import builtins

    from quantprep.format.artifact import read_manifest
    from quantprep.runtime.kcache import Kcache, activate, cache_key

    good = b"\x7fELF" + b"\x01" * 60
    _with_kcache(art, {"triton/kernel.so": good})
    edit_manifest(art, lambda m: m["kcache"].update(key=cache_key("cpu")))
    target, opened, real_open = art / "kcache" / "triton" / "kernel.so", [], builtins.open

    def attacker_open(file, mode="r", *args, **kwargs):
        if Path(file) == target and "r" in mode:
            opened.append(1)
            if len(opened) == 2:  # after the first read: swap in other bytes of the same size
                with real_open(target, "wb") as f:
                    f.write(b"\x7fELF" + b"\x66" * 60)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", attacker_open)
    status = activate(Kcache(art, read_manifest(art), trust=True), "cpu", compile=True)
    monkeypatch.setattr(builtins, "open", real_open)
    assert status["status"] == "used", status
    assert (Path(status["dir"]) / "triton" / "kernel.so").read_bytes() == good and len(opened) == 1


# --- 7. a client of `serve` cannot load, swap or unload models ---------------------------------------

def _post(url: str, body: dict) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_case07_serve_refuses_routes_that_load_or_unload_models(tmp_path):
    from conftest import free_port
    from test_serving import chat_artifact, start_server

    art = chat_artifact(tmp_path / "a")
    other = chat_artifact(tmp_path / "b")  # a real artifact a client would like loaded instead
    port = free_port()
    stop = start_server(art, port)
    base = f"http://127.0.0.1:{port}"
    try:
        chat = {"model": str(art), "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 4, "temperature": 0}
        status, first = _post(f"{base}/v1/chat/completions", chat)
        assert status == 200
        for path, body in (("/load_model", {"model": str(other)}), ("/load_model", {"model": "org/any-hub-model"}), ("/reset", {})):
            status, text = _post(base + path, body)
            assert status == 403 and b"pinned" in text, (path, status, text)
        status, _ = _post(f"{base}/v1/chat/completions", dict(chat, model=str(other)))
        assert status in (400, 403)
        status, again = _post(f"{base}/v1/chat/completions", chat)
        assert status == 200 and json.loads(again)["choices"] == json.loads(first)["choices"]
    finally:
        stop()


def test_case07_options_reach_the_one_load_and_not_the_environment(tmp_path, monkeypatch):
    """serve --trust-kcache / --verify-key apply to the served artifact's load through
    load_options, scoped to that one directory: another load in the process is not affected,
    and no QUANTPREP_TRUST_KCACHE or QUANTPREP_VERIFY_KEY is set for the process."""
    from conftest import keypair
    from test_serving import chat_artifact
    from transformers import AutoModelForCausalLM

    import quantprep  # noqa: F401 (registers the quantizer)
    from quantprep.runtime.hf_quantizer import load_options

    for var in ("QUANTPREP_TRUST_KCACHE", "QUANTPREP_VERIFY_KEY"):
        monkeypatch.delenv(var, raising=False)
    _, pub = keypair(tmp_path / "keys")
    served, other = (chat_artifact(tmp_path / n) for n in ("a", "b"))
    with load_options(served, trust_kcache=True, verify_key=str(pub)):
        with pytest.raises(ArtifactError, match="unsigned"):
            AutoModelForCausalLM.from_pretrained(served)  # the key applies to the served artifact
        AutoModelForCausalLM.from_pretrained(other)  # and to nothing else
        assert not {"QUANTPREP_TRUST_KCACHE", "QUANTPREP_VERIFY_KEY"} & set(os.environ)


# --- 8. a shard changed to other bytes of the same size never loads ---------------------------------

def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["load", "from_pretrained", "generate"])
def test_case08_a_same_size_tampered_shard_is_refused_at_first_load(art, tmp_path, monkeypatch, capsys, how):
    import shutil

    from transformers import AutoModelForCausalLM

    import quantprep

    monkeypatch.setenv("QUANTPREP_VERIFIED_DIR", str(tmp_path / "marks"))  # this user has hashed nothing yet
    copy = tmp_path / "copied"
    shutil.copytree(art, copy)  # as a pull, a copy or a mount would bring it: not built here
    shard = copy / json.loads((copy / MANIFEST).read_text())["shards"][0]
    _flip_a_byte(shard)
    if how == "generate":
        assert main(["generate", str(copy), "--max-new-tokens", "1"]) == 2
        assert "sha256 does not match" in one_line_error(capsys)
    else:
        with pytest.raises(ArtifactError, match="sha256 does not match"):
            quantprep.load(copy) if how == "load" else AutoModelForCausalLM.from_pretrained(copy)
    quantprep.load(copy, verify="sizes")  # the explicit opt-out: sizes only


def test_case08_hashed_once_then_marked_until_a_file_changes(art, tmp_path, monkeypatch):
    import shutil

    import quantprep
    from quantprep.format import artifact

    monkeypatch.setenv("QUANTPREP_VERIFIED_DIR", str(tmp_path / "marks"))
    copy = tmp_path / "copied"
    shutil.copytree(art, copy)
    quantprep.load(copy)  # hashed, then marked
    with monkeypatch.context() as m:
        m.setattr(artifact, "sha256_file", lambda p: pytest.fail(f"hashed again: {p}"))
        quantprep.load(copy)  # the same files: not hashed again
    shard = copy / json.loads((copy / MANIFEST).read_text())["shards"][0]
    _flip_a_byte(shard)  # a write: its ctime moves, so the mark no longer names it
    with pytest.raises(ArtifactError, match="sha256 does not match"):
        quantprep.load(copy)


def test_case08_a_build_and_a_pull_mark_what_they_hashed(art, cache, tmp_path, monkeypatch):
    import quantprep
    from quantprep.format import artifact

    publish([art], str(tmp_path / "ref"))
    got = pull(str(tmp_path / "ref"))
    with monkeypatch.context() as m:
        m.setattr(artifact, "sha256_file", lambda p: pytest.fail(f"hashed again: {p}"))
        quantprep.load(art)  # built here
        quantprep.load(got)  # pulled: hashed while copied


# --- 11. a Hub pull fetches the variant's manifest, then exactly what it lists ----------------------

def _hub_commit(env: dict, path: str, data: bytes, tmp_path: Path) -> None:
    """Commit one file to the stand-in Hub (huggingface_hub in a fresh process: it reads
    HF_ENDPOINT and HF_HUB_OFFLINE at import, and `make test` sets the latter)."""
    import subprocess
    import sys

    src = tmp_path / "commit-me"
    src.write_bytes(data)
    code = ("import sys; from huggingface_hub import HfApi, CommitOperationAdd; "
            "HfApi().create_commit(sys.argv[1], [CommitOperationAdd(sys.argv[2], sys.argv[3])], commit_message='add')")
    r = subprocess.run([sys.executable, "-c", code, "org/tiny", path, str(src)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_case11_a_hub_pull_fetches_only_listed_files_and_a_bounded_index(art, tmp_path):
    from hub_standin import HubStandIn, git
    from test_hub import REPO, _env, _olah, qp

    with HubStandIn(tmp_path / "mirrors", token="hf_writer") as hub:
        url, stop = _olah(tmp_path, hub.root)
        try:
            write = _env(tmp_path, hub.url, HF_TOKEN="hf_writer")
            assert qp(write, "publish", art, "--to", f"hf://{REPO}").returncode == 0
            [variant] = json.loads(git(hub.repo(REPO), "show", "main:index.json"))["variants"]
            unlisted = os.urandom(3 << 20)  # in the variant's folder, in no manifest
            _hub_commit(write, f"{variant['name']}/unlisted.bin", unlisted, tmp_path)
            r = qp(_env(tmp_path, url), "pull", f"hf://{REPO}")
            assert r.returncode == 0, r.stderr[-2000:]
            fetched = [p for p in (tmp_path / "hf-home").rglob("*") if p.is_file()]
            assert fetched and not [p for p in fetched if p.name == "unlisted.bin" or p.stat().st_size == len(unlisted)], fetched
            big = b'{"format": "quantprep-index", "format_version": 1, "variants": []' + b" " * (2 << 20) + b"}"
            _hub_commit(write, "index.json", big, tmp_path)
            r = qp(_env(tmp_path, url, HF_HOME=str(tmp_path / "hf-home-2")), "pull", f"hf://{REPO}")
            err = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(err) == 1 and "more than" in err[0], r.stderr[-2000:]
            assert not [p for p in (tmp_path / "hf-home-2").rglob("*") if p.is_file() and p.stat().st_size >= len(big)]
        finally:
            stop()


# --- 14. a signature names the model and version it is for ------------------------------------------

def _signed_for(art: Path, tmp_path: Path, ref: str, key: Path) -> Path:
    import shutil

    signed = tmp_path / f"signed-{len(list(tmp_path.glob('signed-*')))}"
    shutil.copytree(art, signed)
    assert main(["sign", str(signed), "--key", str(key), "--for", ref]) == 0
    return signed


@pytest.mark.parametrize("served", ["an older version", "another model"])
def test_case14_a_registry_cannot_serve_other_signed_content_under_a_tag(art, cache, hostile, tmp_path, capsys, served):
    from conftest import keypair

    key, pub = keypair(tmp_path / "keys")
    other = hostile.ref("models/x", "v1") if served == "an older version" else hostile.ref("models/other", "v2")
    signed = _signed_for(art, tmp_path, other, key)
    name, entry = _entry(signed, tmp_path)
    hostile.publish(signed, name, entry, repo="models/x", tag="v2")  # what the registry answers for models/x:v2
    assert main(["pull", hostile.ref("models/x", "v2"), "--verify-key", str(pub)]) == 2
    assert "was asked for" in one_line_error(capsys)
    assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")] if cache.exists() else True
    if served == "an older version":  # under the tag it was signed for, it is what was asked for
        hostile.publish(signed, name, entry, repo="models/x", tag="v1")
        assert main(["pull", hostile.ref("models/x", "v1"), "--verify-key", str(pub)]) == 0


def test_case14_a_directory_reference_is_signed_for_its_name(art, cache, tmp_path, capsys):
    import shutil

    from conftest import keypair

    key, pub = keypair(tmp_path / "keys")
    publish([art], str(tmp_path / "qwen-1.5b"), sign_key=key)
    assert pull(str(tmp_path / "qwen-1.5b"), verify_key=pub).is_dir()
    shutil.copytree(tmp_path / "qwen-1.5b", tmp_path / "llama-70b")  # the same signed files under another model's name
    assert main(["pull", str(tmp_path / "llama-70b"), "--verify-key", str(pub)]) == 2
    assert "was asked for" in one_line_error(capsys)
    unsigned_identity = tmp_path / "no-identity"
    shutil.copytree(art, unsigned_identity)
    assert main(["sign", str(unsigned_identity), "--key", str(key)]) == 0  # signed for no reference
    publish([unsigned_identity], str(tmp_path / "plain"))
    assert main(["pull", str(tmp_path / "plain"), "--verify-key", str(pub)]) == 2
    assert "without an identity" in one_line_error(capsys)


# --- also: a signature policy per registry and repository -------------------------------------------

def test_signature_policy_per_reference_with_an_environment_override(art, cache, tmp_path, monkeypatch, capsys):
    from conftest import keypair

    key, pub = keypair(tmp_path / "keys")
    publish([art], str(tmp_path / "team" / "signed"), sign_key=key)
    publish([art], str(tmp_path / "team" / "unsigned"))
    publish([art], str(tmp_path / "public" / "unsigned"))
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[[rule]]\nmatch = "{tmp_path / "team"}/"\nsignatures = "enforce"\nkey = "{pub}"\n\n'
                      f'[[rule]]\nmatch = "{tmp_path / "public"}/"\nsignatures = "warn"\nkey = "{pub}"\n\n'
                      '[default]\nsignatures = "off"\n')
    monkeypatch.setenv("QUANTPREP_POLICY", str(policy))
    monkeypatch.delenv("QUANTPREP_VERIFY_KEY", raising=False)
    monkeypatch.delenv("QUANTPREP_SIGNATURES", raising=False)
    assert main(["pull", str(tmp_path / "team" / "signed"), "--out", str(tmp_path / "a")]) == 0  # enforced, and it verifies
    assert main(["pull", str(tmp_path / "team" / "unsigned"), "--out", str(tmp_path / "b")]) == 2  # enforced: refused
    assert "unsigned" in one_line_error(capsys) and not (tmp_path / "b").exists()
    capsys.readouterr()
    assert main(["pull", str(tmp_path / "public" / "unsigned"), "--out", str(tmp_path / "c")]) == 0  # warn: one line, pulled
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("quantprep: warning:") and "unsigned" in warning[0], warning
    monkeypatch.setenv("QUANTPREP_SIGNATURES", "enforce")  # the environment forces it everywhere
    assert main(["pull", str(tmp_path / "public" / "unsigned"), "--out", str(tmp_path / "d")]) == 2
    assert "unsigned" in one_line_error(capsys)
    monkeypatch.setenv("QUANTPREP_SIGNATURES", "sometimes")
    assert main(["pull", str(tmp_path / "team" / "signed"), "--out", str(tmp_path / "e")]) == 2
    assert "enforce, warn, off" in one_line_error(capsys)


# --- also: artifacts on read-only volumes ------------------------------------------------------------

def test_load_from_pretrained_and_serve_never_write_into_the_artifact(tmp_path, monkeypatch):
    """As root (CI), permissions do not stop a write: the directory tree and every mtime are
    compared before and after instead. The artifact directory is also made read-only (0555), as a
    Kubernetes image volume or an NFS export would have it, for non-root runs."""
    import stat
    import urllib.request

    from conftest import free_port
    from test_serving import chat_artifact, start_server
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quantprep

    monkeypatch.setenv("QUANTPREP_VERIFIED_DIR", str(tmp_path / "marks"))  # the first load hashes (and writes only there)
    art = chat_artifact(tmp_path / "ro")
    for p in [art, *art.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    before, dir_mtime = tree(art), art.stat().st_mtime_ns
    try:
        quantprep.load(art)
        AutoModelForCausalLM.from_pretrained(art)
        AutoTokenizer.from_pretrained(art)
        port = free_port()
        stop = start_server(art, port)
        try:
            body = json.dumps({"model": str(art), "messages": [{"role": "user", "content": "a b"}], "max_tokens": 2}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            assert urllib.request.urlopen(req, timeout=60).status == 200
        finally:
            stop()
        assert tree(art) == before and art.stat().st_mtime_ns == dir_mtime
    finally:
        for p in [art, *art.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


# --- found by the attacker's review of this change ---------------------------------------------------

def test_case04_a_fake_snapshot_whose_blobs_is_a_link_is_refused(random_gptq, tmp_path, capsys):
    """A source laid out like a Hub cache snapshot, its `blobs` a link to ~/.ssh."""
    home_ssh = tmp_path / "home" / ".ssh"
    home_ssh.mkdir(parents=True)
    (home_ssh / "id_ed25519").write_text("VICTIM-SECRET\n")
    repo = tmp_path / "evil" / "models--org--x"
    snap = repo / "snapshots" / "main"
    snap.parent.mkdir(parents=True)
    random_gptq.rename(snap)
    (repo / "blobs").symlink_to(home_ssh)
    (snap / "merges.txt").symlink_to(home_ssh / "id_ed25519")
    assert main(["prepack", str(snap), "--target", "cpu", "--out", str(tmp_path / "out")]) == 2
    assert "outside the checkpoint" in one_line_error(capsys) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["default load", "load(verify='always')", "quantprep verify"])
def test_case08_a_file_changed_while_it_is_hashed_is_not_marked(art, tmp_path, monkeypatch, how):
    """The attacker rewrites a shard (same size) right after quantprep hashed it: nothing may record
    those bytes as hashed, so the next load hashes again and refuses them."""
    import quantprep
    from quantprep.format import artifact, verified
    from quantprep.tools.verify import verify_artifact

    monkeypatch.setenv("QUANTPREP_VERIFIED_DIR", str(tmp_path / "marks"))
    m = json.loads((art / MANIFEST).read_text())
    shard, real = art / m["shards"][0], artifact.sha256_file

    def racing(p):
        digest = real(p)
        if Path(p) == shard:
            _flip_a_byte(shard)
        return digest

    with monkeypatch.context() as patch:
        patch.setattr(artifact, "sha256_file", racing)
        try:
            {"default load": lambda: quantprep.load(art), "load(verify='always')": lambda: quantprep.load(art, verify="always"),
             "quantprep verify": lambda: verify_artifact(art)}[how]()
        except ArtifactError:
            pass
    assert not verified.is_marked(art, m)
    with pytest.raises(ArtifactError, match="sha256 does not match"):
        quantprep.load(art)


@pytest.mark.parametrize("spelling", ["oci://REGISTRY.example.com/ml-team/x:v1", "oci://registry.example.com:443/ml-team/x:v1",
                                      "oci://registry.example.com//ml-team/x:v1", "hf://ML-Org/x", "DIR//team/./x", "file://DIR/team/x"])
def test_policy_rules_match_however_the_reference_is_spelled(tmp_path, monkeypatch, spelling):
    from quantprep.distribution.policy import signature_policy

    policy = tmp_path / "policy.toml"
    policy.write_text(f'[[rule]]\nmatch = "oci://registry.example.com/ml-team/"\nsignatures = "enforce"\nkey = "k.pub"\n\n'
                      f'[[rule]]\nmatch = "hf://ml-org/"\nsignatures = "enforce"\nkey = "k.pub"\n\n'
                      f'[[rule]]\nmatch = "{tmp_path}/team/"\nsignatures = "enforce"\nkey = "k.pub"\n\n[default]\nsignatures = "off"\n')
    monkeypatch.setenv("QUANTPREP_POLICY", str(policy))
    monkeypatch.delenv("QUANTPREP_SIGNATURES", raising=False)
    assert signature_policy(spelling.replace("DIR", str(tmp_path)))[0] == "enforce"
    assert signature_policy(f"{tmp_path}/public/x")[0] == "off"  # the check can fail


def test_case14_a_hub_commit_pin_is_checked_by_name():
    """A commit is made after signing, so a signature cannot name it: pinning one compares the name."""
    from quantprep.distribution.publish import reference_identity

    assert reference_identity("hf://org/x@" + "0123456789abcdef" * 2 + "01234567")["version"] is None
    assert reference_identity("hf://org/x@v1")["version"] == "v1"


def test_case01_a_link_is_never_a_destination_even_with_force(art, cache, tmp_path, capsys):
    docs = _site(tmp_path / "home" / "docs", **{"notes.txt": "mine"})
    link = tmp_path / "home" / "link"
    link.symlink_to(docs)
    publish([art], str(tmp_path / "ref"))
    before = tree(docs)
    assert main(["pull", str(tmp_path / "ref"), "--out", str(link), "--force"]) == 2
    assert "symbolic link" in one_line_error(capsys)
    assert tree(docs) == before and link.is_symlink() and not list((tmp_path / "home").glob(".link*"))


def test_case01_a_refused_command_creates_nothing(art, cache, tmp_path, capsys):
    site = _site(tmp_path / "home" / "site", **{"index.html": "<p>mine</p>"})
    publish([art], str(tmp_path / "ref"))
    for argv in (["pull", str(tmp_path / "ref"), "--out", str(site)], ["publish", str(art), "--to", str(site)]):
        assert main(argv) == 2
        one_line_error(capsys)
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["site"]  # no lock file, no staging directory


def test_a_staging_marker_inside_an_artifact_is_an_unknown_file(art, capsys):
    from quantprep._io.staging import MARKER

    (art / MARKER).write_text(json.dumps({"pid": 1, "out": "art"}))
    assert main(["inspect", str(art)]) == 0 and main(["generate", str(art), "--max-new-tokens", "1"]) == 2
    assert "unknown file" in one_line_error(capsys)
