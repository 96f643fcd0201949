"""The import contract: quantprep's packages form layers, and a module imports only its own layer
or lower ones. Every import counts, at module level or inside a function, because a lazy import
still runs on the path that reaches it. docs/architecture.md draws the same picture.

    cli, __init__, __main__         (top: the commands and the public API)
    tools/                          verify, eval, selftest, serving, openai_server
    build/                          recipes, source, quantize (gptqmodel), prepack, pipeline
    runtime/                        load, checked, hf_quantizer, kcache, aot, fused, warm, cpu_attention, cpu_layers,
                                    engine, openvino
    distribution/                   publish/pull, registry (OCI), hub, signing, policy
    targets/                        one module per kernel layout
    format/                         gptq packing, the artifact manifest, verified marks
    _io/, errors, settings, version (bottom: plumbing)

So the load path (runtime/) never imports build/, tools/ or gptqmodel: a serving machine needs
neither the quantizer nor its dependencies. The second test checks that on a real load.
"""

import ast
import subprocess
import sys

import pytest
from conftest import REPO

PACKAGE = REPO / "quantprep"
LAYERS = {"_io": 0, "errors": 0, "settings": 0, "version": 0, "format": 1, "targets": 2, "distribution": 3,
          "runtime": 4, "build": 5, "tools": 6, "cli": 7, "__init__": 7, "__main__": 7, "pipelines": 0}
# third-party packages that only some layers or modules may import, and which (a layer, or layer/module)
OPENVINO = ("targets/openvino", "runtime/openvino_graph", "build/openvino_ir", "runtime/openvino", "tools/verify", "tools/selftest", "tools/openai_server")
ONLY_IN = {"gptqmodel": ("build",), "openvino": OPENVINO, "openvino_genai": ("runtime/openvino", "tools/openai_server"),
           "openvino_tokenizers": ("build/openvino_ir",)}


def layer_of(module: str) -> str:
    """`quantprep.runtime.load` -> "runtime"; `quantprep` itself -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, relative ones resolved."""
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *([base] if base else [])])
            # `from quantprep import x` imports the module quantprep.x when there is one
            found += [(node.lineno, f"{base}.{a.name}" if (REPO / (base + "." + a.name).replace(".", "/")).exists()
                       or (REPO / ((base + "." + a.name).replace(".", "/") + ".py")).exists() else base) for a in node.names]
        elif isinstance(node, ast.Call) and _callee(node.func) in ("import_module", "__import__") and node.args:
            arg = node.args[0]  # importing by name: a constant is checked like an import; anything else must be listed
            found.append((node.lineno, arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                          else f"<dynamic {ast.unparse(arg)}>"))
    return found


def _callee(func) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


# Imports by a computed name, and why each stays in its layer.
DYNAMIC = {
    ("quantprep/targets/__init__.py", "f'{__name__}.{name}'"): "a module of targets/ itself (TARGET_NAMES)",
    ("quantprep/runtime/aot.py", "name"): "torch's Inductor runtime modules (INDUCTOR_RUNTIME), imported ahead",
    ("quantprep/build/quantize.py", "name"): "a recipe's GGUF part packages (installed data, no quantprep module)",
}


def violations(root=PACKAGE) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        mine = layer_of(".".join(path.relative_to(REPO).with_suffix("").parts))
        for line, name in imports(path):
            if name.startswith("<dynamic "):
                if (str(path.relative_to(REPO)), name[len("<dynamic "):-1]) not in DYNAMIC:
                    bad.append(f"{path.relative_to(REPO)}:{line} imports a computed name {name[9:-1]}: list it in DYNAMIC with why it is safe")
                continue
            top = name.split(".")[0]
            where = path.relative_to(REPO / "quantprep").with_suffix("").as_posix()
            if top in ONLY_IN and not any(where == a or where.startswith(a + "/") for a in ONLY_IN[top]):
                bad.append(f"{path.relative_to(REPO)}:{line} {mine}/ imports {name} (only {', '.join(ONLY_IN[top])} may)")
            if top == "quantprep" and LAYERS[layer_of(name)] > LAYERS[mine]:
                bad.append(f"{path.relative_to(REPO)}:{line} {mine}/ imports {name} ({layer_of(name)}/ is above it)")
    return bad


def test_every_package_imports_only_its_own_layer_or_lower():
    assert not violations()


# Stems that two packages share, each a module of its package: docs name them `package.stem.function`.
SHARED_STEMS = {"openvino": ("targets/openvino", "runtime/openvino")}  # the openvino target; OpenVINO's runtime of it


def test_every_package_has_a_layer_and_stems_are_unique():
    """A new package must be placed in LAYERS; module stems are unique (but SHARED_STEMS) so docs can
    name `stem.function`."""
    tops = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    tops |= {p.stem for p in PACKAGE.glob("*.py")}
    assert tops <= set(LAYERS), tops - set(LAYERS)
    paths = [p.relative_to(PACKAGE).with_suffix("").as_posix() for p in PACKAGE.rglob("*.py") if p.stem != "__init__"]
    stems = [p.rpartition("/")[2] for p in paths]
    shared = {s: tuple(sorted(p for p in paths if p.rpartition("/")[2] == s)) for s in stems if stems.count(s) > 1}
    assert shared == {s: tuple(sorted(p)) for s, p in SHARED_STEMS.items()}, shared


def test_a_crossing_import_is_found(tmp_path, monkeypatch):
    """The checker itself: a runtime module that imports the build side is reported."""
    fake = tmp_path / "quantprep" / "runtime"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text("import importlib\n\ndef f(n):\n    from quantprep.build.source import read_checkpoint\n    import gptqmodel\n"
                               "    importlib.import_module('quantprep.tools.eval')\n    __import__(n)\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    found = violations(tmp_path / "quantprep")
    assert len(found) == 4 and "build/ is above it" in found[0] and "only build may" in found[1], found
    assert "tools/ is above it" in found[2] and "computed name n" in found[3], found


@pytest.mark.parametrize("entry", ["quantprep.load", "from_pretrained", "a published reference"])
def test_loading_an_artifact_imports_neither_build_nor_tools_nor_gptqmodel(random_artifact, tmp_path, entry):
    """A fresh process loads a (random) cpu artifact, directly, through from_pretrained, or pulled
    from a published directory reference, and runs it; then no module of build/, tools/ or
    gptqmodel may be in sys.modules."""
    import os

    path = random_artifact
    if entry == "a published reference":
        from quantprep.distribution.publish import publish

        publish([random_artifact], str(tmp_path / "ref"))
        path = tmp_path / "ref"
    run = ("import quantprep; m = quantprep.load(p)" if entry != "from_pretrained" else
           "import quantprep; from transformers import AutoModelForCausalLM; m = AutoModelForCausalLM.from_pretrained(p)")
    code = f"""import sys, torch
p = {str(path)!r}
{run}
m(torch.tensor([[1, 2, 3]]))
bad = sorted(n for n in sys.modules if n.startswith(("quantprep.build", "quantprep.tools", "gptqmodel", "openvino")))
print("BAD", bad)
"""
    env = dict(os.environ, QUANTPREP_PULL_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "BAD []" in out.stdout, out.stdout[-2000:]
