"""Issue 55, item 2: targets own their facts. A target added as one file (tests/fake_target/fake.py,
put on quantprep.targets' path, its name in TARGET_NAMES, as a new file of the package would be)
is built, loaded, run and verified, and the rest of quantprep asks it for its device's facts (the
kernel cache's key, the plan's, the published variant's name, selftest's description, which
device a choice takes first) instead of knowing its name. The second test keeps it so: no module
outside targets/ compares anything with a name of a target or device other than the CPU's."""

import ast
import sys

import pytest
import torch
from conftest import REPO

import quantprep.targets as targets


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(targets, "TARGET_NAMES", (*targets.TARGET_NAMES, "fake"))
    monkeypatch.setattr(targets, "__path__", [*targets.__path__, str(REPO / "tests" / "fake_target")])
    yield targets.get_target("fake")
    sys.modules.pop("quantprep.targets.fake", None)


def test_a_target_in_one_file_builds_loads_generates_verifies_and_speaks_for_its_device(fake, random_gptq, tmp_path):
    import quantprep
    from quantprep.build.pipeline import prepack
    from quantprep.distribution.publish import choose_variant, publish
    from quantprep.runtime.kcache import cache_key
    from quantprep.runtime.plan import plan_key
    from quantprep.tools.selftest import environment
    from quantprep.tools.verify import verify_artifact

    art = tmp_path / "fake"
    prepack(random_gptq, "fake", art)
    model = quantprep.load(art, device="cpu")  # off its device: the CPU path, as xpu's emulator
    ids = torch.tensor([[1, 2, 3]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 6)
    report = verify_artifact(art)
    assert report["numeric"] == "passed" and report["emulated"] is True

    assert cache_key("fake")["fake_driver"] == "9.9" and "fake_driver" not in cache_key("fake", device_fields=False)
    assert plan_key("fake")["fake_units"] == 4 and plan_key("fake")["fake_arch"] == "f1"
    assert environment("fake")["notes"] == ["a fake device"]
    assert [v["name"] for v in publish([art], str(tmp_path / "ref"), dry_run=True)["variants"]] == ["fake-f1"]

    # where its device is present, it comes before the CPU: the pulled variant, gptqmodel's device
    type(fake).present = lambda self: True
    try:
        from quantprep.build.quantize import quantize_device

        variants = [{"name": t.name, "target": t.name, "compat": t.compat_key()} for t in (targets.get_target("cpu"), fake)]
        assert choose_variant({"variants": variants}, "ref")["name"] == "fake" and quantize_device() == "fake"
    finally:
        del type(fake).present


NAMES = {"xpu", "cuda", "openvino"}  # "cpu" is torch's CPU, where the emulators and quantprep's C kernels run


def named_comparisons(root=REPO / "quantprep") -> list[str]:
    """file:line of every comparison outside targets/ with a target's or device's name (the CPU's aside)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "targets" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                consts = [c for s in sides for c in (s.elts if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [s])]
                if any(isinstance(c, ast.Constant) and c.value in NAMES for c in consts):
                    found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def test_nothing_outside_targets_branches_on_a_target_name(tmp_path):
    assert not named_comparisons(), "ask the target instead (docs/adding-a-target.md)"
    (tmp_path / "x.py").write_text("def f(t):\n    return t.name == 'openvino' or t.device in ('cuda', 'xpu')\n")
    assert named_comparisons(tmp_path) == ["x.py:2", "x.py:2"]  # the checker itself
