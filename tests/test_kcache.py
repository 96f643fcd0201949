"""The kernel cache's trust boundary (kcache.py): a kcache is code, so an artifact from elsewhere never
runs it without the user's consent, while an artifact warmed here by this user keeps using its own.

The planted-library test is the attack, not a mock: a real AOTInductor package whose shared library
is replaced by one that writes a marker file when loaded, with the manifest re-signed as anyone can.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile

import pytest
from conftest import edit_manifest, fresh_process

from quantprep.errors import ArtifactError
from quantprep.format.artifact import read_manifest, sha256_file
from quantprep.runtime.kcache import KCACHE, Kcache, activate, cache_env, exec_env, kcache_digest, materialize, runtime_dir

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("QUANTPREP_TEST_MARKER");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) { fputs("planted library ran", f); fclose(f); }
}
"""


def _resign(art, edit=None):
    """What an attacker can do: change files, then rewrite the manifest's digests to match."""
    def change(m):
        for rel, f in m["kcache"]["files"].items():
            p = art / KCACHE / rel
            f.update(sha256=sha256_file(p), size=p.stat().st_size)
        if edit:
            edit(m)
    edit_manifest(art, change)
    return read_manifest(art)


@pytest.fixture
def planted(warmed_aot, copy_of, tmp_path):
    """A copy of a warmed artifact whose every compiled MLP package carries the planted library."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the planted library")
    (tmp_path / "planted.c").write_text(PLANTED_C)
    lib = tmp_path / "planted.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "planted.c")], check=True)
    art = copy_of(warmed_aot[0])
    packages = [e["file"] for e in read_manifest(art)["kcache"]["aot"]]
    assert packages
    for rel in packages:
        path = art / KCACHE / rel
        with zipfile.ZipFile(path) as z:
            members = {i.filename: z.read(i.filename) for i in z.infolist()}
        libs = [n for n in members if n.endswith(".so")]
        assert libs, sorted(members)
        members.update({n: lib.read_bytes() for n in libs})
        with zipfile.ZipFile(path, "w") as z:
            for name, data in members.items():
                z.writestr(name, data)
    _resign(art)
    return art


LOAD_CHILD = """
import json, sys
import quantprep
model = quantprep.load(sys.argv[1], compile=sys.argv[2] == "1", trust_kcache=sys.argv[3] == "1")
print(json.dumps({"status": model.quantprep_kcache["status"]}))
"""


def _load_in_fresh_process(art, tmp_path, compile: bool, trust: bool, **env) -> tuple[dict, bool, str]:
    marker = tmp_path / f"marker-{compile}-{trust}"
    env = dict(os.environ, QUANTPREP_TEST_MARKER=str(marker), QUANTPREP_TRUST_DIR=str(tmp_path / "empty-trust-store"),
               QUANTPREP_KCACHE_DIR=str(tmp_path / f"runtime-{compile}-{trust}"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               **env)
    status, stderr = fresh_process(LOAD_CHILD, art, int(compile), int(trust), env=env)
    return status, marker.exists(), stderr


@pytest.mark.parametrize("compile", [True, False])
def test_planted_library_never_runs_from_an_untrusted_artifact(planted, tmp_path, compile):
    status, ran, stderr = _load_in_fresh_process(planted, tmp_path, compile, trust=False)
    assert not ran
    # without compile a cpu load reads only the kernel plan from kcache/, and not from an untrusted one
    assert status["status"] == "untrusted" and "plan" not in status
    assert "not trusted here" in stderr and "--trust-kcache" in stderr
    assert not (tmp_path / f"runtime-{compile}-False").exists()  # not even copied


def test_planted_library_runs_once_the_user_trusts_it(planted, tmp_path):
    """The control: the same load, trusted, does run the library (so the test above can fail)."""
    status, ran, _ = _load_in_fresh_process(planted, tmp_path, compile=True, trust=True)
    assert status["status"] == "used" and ran
    status, ran, _ = _load_in_fresh_process(planted, tmp_path / "env", compile=True, trust=False, QUANTPREP_TRUST_KCACHE="1")
    assert status["status"] == "used" and ran


def test_untrusted_cuda_kcache_points_no_runtime_at_it(warmed_aot, copy_of, tmp_path, monkeypatch):
    """The H100 finding: load(compile=False) on cuda set TRITON_CACHE_DIR at the artifact's copy, so
    its launcher library ran at the first long prompt. Untrusted: no variable set, nothing copied."""
    art = copy_of(warmed_aot[0])
    m = _resign(art, lambda m: m["kcache"]["key"].update(device="cuda"))
    monkeypatch.setenv("QUANTPREP_TRUST_DIR", str(tmp_path / "empty-trust-store"))
    monkeypatch.setenv("QUANTPREP_KCACHE_DIR", str(tmp_path / "runtime"))
    before = {k: os.environ.get(k) for k in cache_env(tmp_path / "probe")}
    for compile in (False, True):
        with pytest.warns(UserWarning, match="not trusted here"):
            assert activate(Kcache(art, m), "cuda", compile=compile)["status"] == "untrusted"
    assert {k: os.environ.get(k) for k in before} == before
    assert not (tmp_path / "runtime").exists()


def test_warm_trusts_what_it_built_and_only_that(warmed_aot, copy_of, tmp_path, monkeypatch):
    art, _ = warmed_aot
    m = read_manifest(art)
    store = os.environ["QUANTPREP_TRUST_DIR"]
    assert os.path.isfile(os.path.join(store, kcache_digest(m["kcache"])))  # warm recorded it
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    monkeypatch.setenv("QUANTPREP_KCACHE_DIR", str(tmp_path / "runtime"))
    assert activate(Kcache(art, m), "cpu", compile=True)["trusted"] == "warmed here"
    other = copy_of(art)  # the same artifact with one kcache byte changed is another cache: untrusted
    p = other / KCACHE / m["kcache"]["aot"][0]["file"]
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="not trusted here"):
        assert activate(Kcache(other, _resign(other)), "cpu", compile=True)["status"] == "untrusted"


def test_a_load_reads_the_manifest_once_and_decides_the_kcache_trust_once(warmed_aot, tmp_path, monkeypatch):
    """quantprep.load opens the artifact once (issue 55, item 4): one read of its manifest, and one
    trust decision for its kcache, carried (kcache.Kcache) to where the kcache is used."""
    import quantprep
    from quantprep.format import artifact
    from quantprep.runtime import kcache

    art, _ = warmed_aot
    monkeypatch.setenv("QUANTPREP_KCACHE_DIR", str(tmp_path / "runtime"))
    reads, trusts = [], []
    read, trust = artifact.read_manifest, kcache.trust_reason
    for module in [m for name, m in sys.modules.items() if name.startswith("quantprep")]:
        if getattr(module, "read_manifest", None) is read:
            monkeypatch.setattr(module, "read_manifest", lambda *a, **k: reads.append(a) or read(*a, **k))
    monkeypatch.setattr(kcache, "trust_reason", lambda *a, **k: trusts.append(a) or trust(*a, **k))
    model = quantprep.load(art, compile=True)
    assert model.quantprep_kcache["status"] == "used" and model.quantprep_kcache["trusted"] == "warmed here"
    assert (len(reads), len(trusts)) == (1, 1), (reads, trusts)


def test_exec_refuses_an_untrusted_kcache(warmed_aot, tmp_path):
    env = dict(os.environ, QUANTPREP_TRUST_DIR=str(tmp_path / "empty-trust-store"), QUANTPREP_KCACHE_DIR=str(tmp_path / "rt"))
    proc = subprocess.run([sys.executable, "-m", "quantprep", "exec", str(warmed_aot[0]), "--", "true"], env=env,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "not trusted here" in lines[0], proc.stderr
    assert not (tmp_path / "rt").exists()
    proc = subprocess.run([sys.executable, "-m", "quantprep", "exec", str(warmed_aot[0]), "--trust-kcache", "--", "true"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_runtime_copy_is_private_and_rechecked(warmed_aot, tmp_path, monkeypatch):
    art, _ = warmed_aot
    m = read_manifest(art)
    monkeypatch.setenv("QUANTPREP_KCACHE_DIR", str(tmp_path / "runtime"))
    dest = materialize(art, m)
    assert stat.S_IMODE(os.stat(tmp_path / "runtime").st_mode) == 0o700 and stat.S_IMODE(os.stat(dest).st_mode) == 0o700
    rel = m["kcache"]["aot"][0]["file"]
    (dest / rel).write_bytes(b"tampered")  # the runtime copy no longer matches the manifest: copied afresh
    assert materialize(art, m) == dest and sha256_file(dest / rel) == m["kcache"]["files"][rel]["sha256"]


def test_an_unchanged_runtime_copy_is_not_hashed_again_and_a_same_size_edit_is_caught(warmed_aot, tmp_path, monkeypatch):
    """The copy's files are hashed as copied; a later load trusts their unchanged stamps (a compiled
    OpenVINO model is gigabytes), and any write, even of the same size with mtime set back, changes ctime."""
    from quantprep.runtime import kcache

    art, _ = warmed_aot
    m = read_manifest(art)
    monkeypatch.setenv("QUANTPREP_KCACHE_DIR", str(tmp_path / "runtime"))
    dest = materialize(art, m)
    hashed = []
    real = kcache.sha256_file
    monkeypatch.setattr(kcache, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert materialize(art, m) == dest and hashed == []
    rel = m["kcache"]["aot"][0]["file"]
    before = os.stat(dest / rel)
    data = bytearray((dest / rel).read_bytes())
    data[len(data) // 2] ^= 1
    (dest / rel).write_bytes(bytes(data))
    os.utime(dest / rel, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert materialize(art, m) == dest and hashed  # hashed again, found altered, copied afresh
    assert sha256_file(dest / rel) == m["kcache"]["files"][rel]["sha256"]


def test_a_runtime_dir_others_can_write_is_never_used(warmed_aot, tmp_path, monkeypatch):
    art, _ = warmed_aot
    m = read_manifest(art)
    base = tmp_path / "shared"
    base.mkdir()
    os.chmod(base, 0o777)  # e.g. QUANTPREP_KCACHE_DIR on a shared /tmp: anyone could plant a `.complete` copy
    monkeypatch.setenv("QUANTPREP_KCACHE_DIR", str(base))
    with pytest.raises(ArtifactError, match="not a private directory"):
        runtime_dir(m)
    with pytest.warns(UserWarning, match="not a private directory"):
        assert activate(Kcache(art, m), "cpu", compile=True)["status"] == "ignored"
    if os.getuid() != 0:
        pytest.skip("the other-owner case needs root to chown (CI runs as root)")
    os.chmod(base, 0o700)
    os.chown(base, 1, 1)  # owned by another user
    with pytest.raises(ArtifactError, match="owner uid 1"):
        runtime_dir(m)
    mine = tmp_path / "mine"
    monkeypatch.setenv("QUANTPREP_KCACHE_DIR", str(mine))
    dest = runtime_dir(m)
    shutil.copytree(art / KCACHE, dest)
    (dest / ".complete").touch()
    os.chown(dest, 1, 1)  # a finished-looking copy made by someone else: replaced, not used
    assert materialize(art, m) == dest and os.stat(dest).st_uid == os.getuid()


def test_cache_dirs_exist_before_any_runtime_reads_them(tmp_path):
    """Intel's compute-runtime switches its cache off when NEO_CACHE_DIR is set but missing."""
    env = cache_env(tmp_path / "root")
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "NEO_CACHE_DIR", "SYCL_CACHE_DIR"):
        assert os.path.isdir(env[var]), var
    assert env["NEO_CACHE_MAX_SIZE"] == "0"


def test_exec_env_creates_the_dirs_it_names(warmed_aot, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTPREP_KCACHE_DIR", str(tmp_path / "rt"))
    env = exec_env(warmed_aot[0])
    assert all(os.path.isdir(env[v]) for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "NEO_CACHE_DIR", "SYCL_CACHE_DIR"))


# Logs, at the start of every Python process, each cache variable it was given and whether that dir exists.
DIR_LOG = """
import json, os
log = os.environ.get("QUANTPREP_TEST_DIR_LOG")
if log:
    seen = {v: os.path.isdir(os.environ[v]) for v in
            ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "NEO_CACHE_DIR", "SYCL_CACHE_DIR") if v in os.environ}
    with open(log, "a") as f:
        f.write(json.dumps(seen) + "\\n")
"""


def test_every_process_sees_existing_dirs_for_the_cache_variables_it_gets(tmp_path, random_artifact):
    """Issue 14: Intel's driver turns its cache off when NEO_CACHE_DIR names a missing dir. warm's
    child, `quantprep exec`'s command and `load` get only existing dirs, checked in each process."""
    site, log = tmp_path / "site", tmp_path / "dirs.jsonl"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DIR_LOG)
    env = dict(os.environ, QUANTPREP_TEST_DIR_LOG=str(log), QUANTPREP_KCACHE_DIR=str(tmp_path / "rt"),
               PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))

    def quantprep(*args):
        proc = subprocess.run([sys.executable, "-m", "quantprep", *args], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    warm_seen = quantprep("warm", str(random_artifact), "--shapes", "1,4")
    assert any("NEO_CACHE_DIR" in s for s in warm_seen), warm_seen  # the warm child got the driver's variables
    log.unlink()
    exec_seen = quantprep("exec", str(random_artifact), "--", sys.executable, "-c", "pass")
    assert any("NEO_CACHE_DIR" in s for s in exec_seen), exec_seen
    for seen in warm_seen + exec_seen:
        assert all(seen.values()), seen
    load_code = ("import os, json, sys, quantprep\n"
                 "m = quantprep.load(sys.argv[1], compile=True)\n"
                 "scoped = m.quantprep_kcache['env']\n"
                 "print(json.dumps([{v: os.path.isdir(d) for v, d in scoped.items()}, m.quantprep_kcache['status'],"
                 " sorted(v for v, d in scoped.items() if os.environ.get(v) == d)]))")
    proc = subprocess.run([sys.executable, "-c", load_code, str(random_artifact)], env=dict(env, QUANTPREP_TEST_DIR_LOG=""),
                          capture_output=True, text=True, timeout=600)
    seen, status, left = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status == "used" and seen == {"TORCHINDUCTOR_CACHE_DIR": True, "TRITON_CACHE_DIR": True}, (seen, status)
    assert left == [], left  # issue 30: they point at the copy during load only (Inductor may set its default after)


def test_a_used_kcache_is_in_effect_while_its_model_runs_and_not_after(warmed_aot, tmp_path, monkeypatch):
    """Issue 30: load points Triton and Inductor at the kcache copy while this model compiles and
    runs (its forward), not for the process: before and after a forward the variables are the
    user's, so a second model or a child process never writes into this artifact's copy. load
    runs nothing it was not asked to (warmup=False)."""
    import torch

    import quantprep

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("QUANTPREP_KCACHE_DIR", str(tmp_path / "rt"))
    model = quantprep.load(warmed_aot[0], compile=True)
    env = model.quantprep_kcache.get("env", {})
    assert model.quantprep_kcache["status"] == "used" and not hasattr(model, "quantprep_warmup"), model.quantprep_kcache
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != env["TORCHINDUCTOR_CACHE_DIR"]
    seen = []
    model.model.layers[0].register_forward_hook(
        lambda *_: seen.append((os.environ.get("TRITON_CACHE_DIR"), os.environ.get("TORCHINDUCTOR_CACHE_DIR"))))
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
    assert seen == [(env["TRITON_CACHE_DIR"], env["TORCHINDUCTOR_CACHE_DIR"])]
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != env["TORCHINDUCTOR_CACHE_DIR"]


def test_xpu_warm_asks_triton_for_native_code_only_with_ocloc(tmp_path):
    """Issue 14 item 7: with `ocloc` on PATH, warm's child gets TRITON_XPU_GEN_NATIVE_CODE=1 (Triton then
    ships zebins, not SPIR-V); load sets it again only when the kcache was warmed so and ocloc is here.
    The ocloc here is an empty stand-in: only its presence on PATH is read."""
    from quantprep.runtime.kcache import triton_native_env
    from quantprep.targets import get_target

    xpu_warm_env = get_target("xpu").warm_env

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    manifest = {"serving": {"shapes": [1, 16]}, "modules": {"a": {"bits": 4, "in_features": 8, "out_features": 8}}}
    assert xpu_warm_env(manifest, {"PATH": str(bin_dir)}) == {}
    (bin_dir / "ocloc").write_text("#!/bin/sh\n")
    (bin_dir / "ocloc").chmod(0o755)
    assert xpu_warm_env(manifest, {"PATH": str(bin_dir)}) == {"TRITON_XPU_GEN_NATIVE_CODE": "1"}
    assert xpu_warm_env(manifest, {"PATH": str(bin_dir), "TRITON_XPU_GEN_NATIVE_CODE": "0"}) == {}  # the user's choice stands
    assert triton_native_env({"triton_native_code": True}, {"PATH": str(bin_dir)}) == {"TRITON_XPU_GEN_NATIVE_CODE": "1"}
    assert triton_native_env({"triton_native_code": True}, {"PATH": str(tmp_path)}) == {}
    assert triton_native_env({}, {"PATH": str(bin_dir)}) == {}
    linears = {f"m{i}": {"bits": 4, "in_features": 8, "out_features": 8 * (i + 1)} for i in range(4)}
    many = {"serving": {"shapes": list(range(1, 300))}, "modules": linears | {"i8": {"bits": 8, "in_features": 8, "out_features": 64}}}
    assert xpu_warm_env(many, {"PATH": ""}) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1200"}  # (299 + decode) x 4 linears
