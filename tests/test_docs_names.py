"""Every `module.name` the docs mention exists: a renamed or deleted function must not linger in
README.md, BENCHMARKS.md or docs/ (issue 30: BENCHMARKS.md named `warm.repoint_triton_groups`,
long gone). Manifest fields are written `source["sha256"]`, so they are not taken for modules."""

import importlib
import re

from conftest import REPO

DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
PACKAGE = REPO / "quantprep"
MODULES = {p.stem: ".".join(p.relative_to(REPO).with_suffix("").parts)  # stems are unique (test_layers.py)
           for p in PACKAGE.rglob("*.py") if p.stem != "__init__"}
MENTION = re.compile(r"`(?:quantprep\.)?([a-z_][a-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?(?:\(\))?`")
FILE_SUFFIXES = {"py", "md", "json", "toml", "sh"}  # `warm.py` names a file


def missing_names(text: str) -> list[str]:
    missing = []
    for m in MENTION.finditer(text):
        if m.group(1) not in MODULES or m.group(2) in FILE_SUFFIXES:
            continue
        obj = importlib.import_module(MODULES[m.group(1)])
        for attr in (g for g in m.groups()[1:] if g):
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
