"""Every `module.name` the docs mention exists: a renamed or deleted function must not linger in
README.md, BENCHMARKS.md or docs/ (issue 30: BENCHMARKS.md named `warm.repoint_triton_groups`,
long gone). A stem two packages share is named `package.module.name` (`runtime.openvino.load`).
Manifest fields are written `source["sha256"]`, so they are not taken for modules."""

import importlib
import re

from conftest import REPO

DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
PACKAGE = REPO / "quantprep"
# `stem` where it is unique (test_layers.py: all but SHARED_STEMS), and `package.stem` for every module
_PATHS = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in PACKAGE.rglob("*.py") if p.stem != "__init__"]
_STEMS = [m.rpartition(".")[2] for m in _PATHS]
MODULES = {**{m.split(".", 1)[1]: m for m in _PATHS}, **{s: m for s, m in zip(_STEMS, _PATHS, strict=True) if _STEMS.count(s) == 1}}
MENTION = re.compile(r"`(?:quantprep\.)?([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*){1,3})(?:\(\))?`")
FILE_SUFFIXES = {"py", "md", "json", "toml", "sh"}  # `warm.py` names a file


def missing_names(text: str) -> list[str]:
    missing = []
    for m in MENTION.finditer(text):
        parts = m.group(1).split(".")
        if ".".join(parts[:2]) in MODULES and len(parts) > 2 and parts[2] not in FILE_SUFFIXES:
            module, attrs = MODULES[".".join(parts[:2])], parts[2:]  # `runtime.openvino.load`
        elif parts[0] in MODULES and parts[1] not in FILE_SUFFIXES:
            module, attrs = MODULES[parts[0]], parts[1:]
        else:
            continue
        obj = importlib.import_module(module)
        for attr in attrs:
            if not hasattr(obj, attr):
                missing.append(m.group(0))
                break
            obj = getattr(obj, attr)
    return missing


def test_every_module_attribute_the_docs_name_exists():
    missing = {doc.name: names for doc in DOCS if (names := missing_names(doc.read_text()))}
    assert not missing, missing


def test_a_stale_name_is_found():
    assert missing_names("see `warm.repoint_triton_groups` and `kcache.materialize`") == ["`warm.repoint_triton_groups`"]
    assert missing_names("`runtime.openvino.load`, `runtime.openvino.genai_load`, `runtime.openvino.OpenVINOModel.pipeline`, "
                         "`targets.openvino.load`") == ["`runtime.openvino.genai_load`", "`targets.openvino.load`"]
