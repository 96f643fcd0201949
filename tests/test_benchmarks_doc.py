"""BENCHMARKS.md's generated tables match the raw JSON they cite (benchmarks/tables.py), its summary
links land on its sections, and benchmarks/results/ holds exactly what some document names."""

import re
import subprocess
import sys

from conftest import REPO

sys.path.append(str(REPO / "benchmarks"))
import tables  # noqa: E402  (benchmarks/ is not a package)

RESULTS = REPO / "benchmarks" / "results"


def test_generated_tables_match_their_json():
    doc = tables.DOC.read_text()
    blocks = tables.BLOCK.findall(doc)
    assert len(blocks) >= 3, "BENCHMARKS.md lost its generated tables"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tables.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    body = blocks[0][3]
    edited = doc.replace(body, body.replace("|", "| 9.99 |", 2), 1)  # a figure typed in by hand
    assert tables.render(edited) == doc


def test_the_summary_opens_the_document_and_links_to_its_sections():
    doc = tables.DOC.read_text()
    first = tables.BLOCK.search(doc)
    assert first.group(2) == "summary", "BENCHMARKS.md must open with the summary table"
    anchors = {tables._anchor(h) for h in re.findall(r"^#+ (.+)$", doc, re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", first.group(4))
    assert len(links) == len(tables.SUMMARY)
    assert set(links) <= anchors, set(links) - anchors


def test_every_results_file_is_named_by_a_document_and_every_named_one_exists():
    texts = [p.read_text() for p in (REPO / "BENCHMARKS.md", REPO / "README.md", *(REPO / "docs").glob("*.md"),
                                     *(REPO / "benchmarks").glob("*.py"), *(REPO / "tests").rglob("*.py"))]
    on_disk = {p.name for p in RESULTS.iterdir()}
    unnamed = {f for f in on_disk if not any(f in t for t in texts)}
    assert not unnamed, f"results no document names (delete them): {sorted(unnamed)}"
    cited = set(re.findall(r"results/([\w.-]+\.(?:json|png|txt))", tables.DOC.read_text()))
    assert cited <= on_disk, f"BENCHMARKS.md names results that are not there: {sorted(cited - on_disk)}"
