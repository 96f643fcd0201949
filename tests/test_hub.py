"""hf:// references (hub.py) against real servers on loopback, started and stopped by the tests:
olah (a Hub-API mirror, offline mode) serves a local git repository with its LFS objects to
huggingface_hub's downloads, and tests/hub_standin.py, a stand-in for the Hub's write API (no
open-source server accepts Hub uploads; what it is and is not is said there), takes the commits
into that same repository. huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when imported, so
quantprep runs here in fresh processes, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import files_left_in, free_port, keypair, serve
from hub_standin import HubStandIn, git, lfs_path

import quantprep

REPO = "org/tiny"


@pytest.fixture
def hub(tmp_path):
    with HubStandIn(tmp_path / "mirrors", token="hf_writer") as h:
        yield h


def _olah(tmp_path: Path, mirrors: Path):
    """olah serving `mirrors` offline on a free loopback port; returns (url, stop)."""
    try:
        import olah  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("olah missing: `make setup` installs the test extras")
        pytest.skip("olah missing (pip install olah)")
    port = free_port()
    home = tmp_path / "olah"
    home.mkdir(exist_ok=True)
    (home / "olah.toml").write_text(f'[basic]\nhost = "127.0.0.1"\nport = {port}\nrepos-path = "{home / "repos"}"\n'
                                    f'mirrors-path = ["{mirrors}"]\nmetadata-cache-ttl = 0\n[accessibility]\noffline = true\n')
    url = f"http://127.0.0.1:{port}"
    stop = serve([sys.executable, "-m", "olah.server", "-c", "olah.toml"], f"{url}/api/whoami-v2", "olah", cwd=home)
    return url, stop


@pytest.fixture
def olah(tmp_path, hub):
    url, stop = _olah(tmp_path, hub.root)
    yield url
    stop()


def _env(tmp_path, endpoint, **extra):
    # `make test` exports HF_HUB_OFFLINE=1 (nothing else may reach the network): these servers are local.
    return {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "QUANTPREP_PULL_CACHE": str(tmp_path / "cache"),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", **extra}


def qp(env, *args, timeout=180):
    """quantprep in a fresh process (huggingface_hub reads its environment once, at import)."""
    return subprocess.run([sys.executable, "-m", "quantprep", *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _one_line(r, needle):
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and needle in err[0], (r.returncode, r.stderr[-2000:])


def test_hub_publish_is_one_commit_and_pull_takes_the_variant(built, hub, olah, tmp_path):  # noqa: F811
    key, pub = keypair(tmp_path / "keys")
    write = _env(tmp_path, hub.url, HF_TOKEN="hf_writer")
    r = qp(write, "publish", built / "cpu", built / "xpu", "--to", f"hf://{REPO}", "--sign-key", key)
    assert r.returncode == 0, r.stderr
    release = r.stdout.strip().splitlines()[-1].removeprefix("release: ")
    repo = hub.repo(REPO)
    assert len(git(repo, "rev-list", "main").split()) == 2  # the initial commit and one publish: atomic
    tree = set(git(repo, "ls-tree", "-r", "--name-only", "main").splitlines())
    cpu = next(p.split("/")[0] for p in tree if p.startswith("cpu-"))
    assert {"index.json", f"{cpu}/manifest.json", f"{cpu}/model.sig", "xpu/manifest.json"} <= tree
    shard = next(p for p in tree if p.startswith(cpu) and p.endswith(".safetensors"))
    assert git(repo, "show", f"main:{shard}").startswith("version https://git-lfs.github.com/spec/v1")  # an LFS file
    assert release.startswith(f"hf://{REPO}@quantprep-")
    assert git(repo, "rev-parse", f"refs/tags/{release.split('@')[1]}") == git(repo, "rev-parse", "main")

    read = _env(tmp_path, olah)
    r = qp(read, "pull", f"hf://{REPO}", "--verify-key", pub, "--json")
    assert r.returncode == 0, r.stderr
    got = Path(json.loads(r.stdout)["path"])
    assert got.name == cpu and got.is_relative_to(tmp_path / "cache")
    for p in (built / "cpu").rglob("*"):
        if p.is_file():
            assert (got / p.relative_to(built / "cpu")).read_bytes() == p.read_bytes()
    assert (got / "model.sig").is_file()
    r = qp(read, "pull", release, "--target", "xpu", "--out", tmp_path / "xpu")  # the release tag, a forced variant
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "xpu" / "manifest.json").read_bytes() == (built / "xpu" / "manifest.json").read_bytes()
    hf_cache = tmp_path / "hf-home" / "hub" / f"models--{REPO.replace('/', '--')}"
    assert hf_cache.is_dir()  # downloaded through huggingface_hub's cache

    # Offline: olah gone, HF_HUB_OFFLINE=1, an empty quantprep cache: the Hub cache serves the pull and load.
    olah_stop = olah  # the fixture stops it at teardown; here the endpoint is made unreachable instead
    offline = _env(tmp_path, "http://127.0.0.1:9", HF_HUB_OFFLINE="1", QUANTPREP_PULL_CACHE=str(tmp_path / "cache2"))
    ids = torch.randint(0, 100, (1, 9))
    torch.save(ids, tmp_path / "ids.pt")
    code = (f"import torch, quantprep; m = quantprep.load('hf://{REPO}'); "
            f"torch.save(m(input_ids=torch.load(r'{tmp_path / 'ids.pt'}')).logits, r'{tmp_path / 'logits.pt'}')")
    r = subprocess.run([sys.executable, "-c", code], env=offline, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (olah_stop, r.stderr[-2000:])
    with torch.no_grad():
        local = quantprep.load(built / "cpu")(input_ids=ids).logits
    assert torch.equal(torch.load(tmp_path / "logits.pt"), local)


def test_republish_replaces_the_variants_and_keeps_other_files(built, hub, olah, tmp_path):  # noqa: F811
    write = _env(tmp_path, hub.url, HF_TOKEN="hf_writer")
    assert qp(write, "publish", built / "cpu", built / "xpu", "--to", f"hf://{REPO}", "--tag", "v1").returncode == 0
    hub.commit(REPO, "main", {"README.md": b"# tiny\nthe model card\n"}, [], "a model card")
    r = qp(write, "publish", built / "cpu", "--to", f"hf://{REPO}", "--tag", "v2")
    assert r.returncode == 0, r.stderr
    repo = hub.repo(REPO)
    tree = set(git(repo, "ls-tree", "-r", "--name-only", "main").splitlines())
    assert "README.md" in tree and not any(p.startswith("xpu/") for p in tree)  # the old variant is gone, the card stays
    assert any(p.startswith("xpu/") for p in git(repo, "ls-tree", "-r", "--name-only", "v1").splitlines())  # v1 still has it
    index = json.loads(git(repo, "show", "main:index.json"))
    assert [v["target"] for v in index["variants"]] == ["cpu"]
    # A release tag is never moved: v1 again, with other content, is refused before anything is committed.
    head = git(repo, "rev-parse", "main")
    _one_line(qp(write, "publish", built / "cpu", built / "xpu", "--to", f"hf://{REPO}", "--tag", "v1"), "already names another commit")
    assert git(repo, "rev-parse", "main") == head
    # On a branch that does not exist yet: created from main, main untouched.
    assert qp(write, "publish", built / "xpu", "--to", f"hf://{REPO}@staging").returncode == 0
    assert git(repo, "rev-parse", "main") == head and "xpu/manifest.json" in git(repo, "ls-tree", "-r", "--name-only", "staging")
    r = qp(_env(tmp_path, olah), "pull", f"hf://{REPO}@staging", "--target", "xpu", "--out", tmp_path / "staging")
    assert r.returncode == 0, r.stderr


def test_a_commit_that_raced_another_is_refused_whole(built, hub, tmp_path):  # noqa: F811
    """parent_commit: someone commits between our read of the head and our commit; nothing of ours lands."""
    write = _env(tmp_path, hub.url, HF_TOKEN="hf_writer")
    assert qp(write, "publish", built / "cpu", "--to", f"hf://{REPO}").returncode == 0
    repo = hub.repo(REPO)
    before = set(git(repo, "ls-tree", "-r", "--name-only", "main").splitlines())

    def other_writer():
        hub.before_commit = None
        hub.commit(REPO, "main", {"notes.txt": b"someone else\n"}, [], "someone else's commit")

    hub.before_commit = other_writer
    _one_line(qp(write, "publish", built / "xpu", "--to", f"hf://{REPO}"), "the branch moved")
    assert set(git(repo, "ls-tree", "-r", "--name-only", "main").splitlines()) == before | {"notes.txt"}


def test_a_tampered_lfs_object_from_olah_is_refused(built, hub, olah, tmp_path):  # noqa: F811
    """Same-size bytes in the repository's LFS store, served by olah: huggingface_hub takes them."""
    write = _env(tmp_path, hub.url, HF_TOKEN="hf_writer")
    assert qp(write, "publish", built / "cpu", "--to", f"hf://{REPO}").returncode == 0
    repo = hub.repo(REPO)
    shard = next(p for p in git(repo, "ls-tree", "-r", "--name-only", "main").splitlines() if p.endswith(".safetensors"))
    oid = git(repo, "show", f"main:{shard}").split("sha256:")[1].split()[0]
    obj = lfs_path(repo, oid)
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(data))
    _one_line(qp(_env(tmp_path, olah), "pull", f"hf://{REPO}"), "does not match the sha256")
    assert not files_left_in(tmp_path / "cache")


def test_hub_errors_are_one_line(built, hub, olah, tmp_path):  # noqa: F811
    write = _env(tmp_path, hub.url, HF_TOKEN="hf_writer")
    assert qp(write, "publish", built / "cpu", "--to", f"hf://{REPO}").returncode == 0
    _one_line(qp(_env(tmp_path, hub.url), "publish", built / "cpu", "--to", f"hf://{REPO}"), "set HF_TOKEN")  # 401
    _one_line(qp(_env(tmp_path, hub.url, HF_TOKEN="wrong"), "publish", built / "cpu", "--to", "hf://org/other"), "(401)")
    read = _env(tmp_path, olah)
    _one_line(qp(read, "pull", f"hf://{REPO}@nope"), "or the branch or tag after @")  # olah cannot tell the two apart
    _one_line(qp(read, "pull", "hf://org/missing"), "not found on")
    _one_line(qp(read, "pull", "hf://not a repo"), "not a Hub reference")
    _one_line(qp(_env(tmp_path, "http://127.0.0.1:9"), "pull", f"hf://{REPO}@v9"), "cannot reach")
    hub.create("org/plain")  # a repository that is not a quantprep publish
    _one_line(qp(read, "pull", "hf://org/plain"), "no index.json")
    r = qp(write, "publish", built / "cpu", "--to", f"hf://{REPO}", "--dry-run")
    assert r.returncode == 0 and "would publish 1 variant(s) to hf://org/tiny" in r.stdout
    assert not files_left_in(tmp_path / "cache")
