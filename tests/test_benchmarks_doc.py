"""BENCHMARKS.md stays a short summary that matches its JSON (benchmarks/tables.py): the table is
regenerated and compared, it has at most tables.MAX_ROWS rows, the page at most 40 KB, each row
links to its note, and benchmarks/results/ holds exactly the product results the page reads or
links. benchmarks/experiments/ is dated and frozen: nothing here reads it."""

import re
import subprocess
import sys

from conftest import REPO

sys.path.append(str(REPO / "benchmarks"))
import tables  # noqa: E402  (benchmarks/ is not a package)

RESULTS = REPO / "benchmarks" / "results"
MAX_BYTES = 40_000


def _rows(doc: str) -> list[str]:
    return [line for line in tables.BLOCK.search(doc).group(2).splitlines() if line.startswith("| [")]


def test_the_summary_is_what_its_json_renders():
    doc = tables.DOC.read_text()
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tables.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    row = _rows(doc)[1]
    typed = re.sub(r"\d\.\d\dx", "9.99x", row, count=1)  # a figure typed in by hand
    assert typed != row
    edited = doc.replace(row, typed)
    assert tables.render(edited) == doc


def test_the_page_is_short():
    doc = tables.DOC.read_text()
    assert len(doc.encode()) <= MAX_BYTES, f"BENCHMARKS.md is {len(doc.encode())} bytes: move detail to a JSON or an experiment"
    assert len(tables.ROWS) <= tables.MAX_ROWS and len(_rows(doc)) == len(tables.ROWS)


def test_every_row_has_a_goal_and_a_verdict_and_links_to_its_note():
    doc = tables.DOC.read_text()
    anchors = {tables._anchor(h) for h in re.findall(r"^#+ (.+)$", doc, re.M)}
    for row, line in zip(tables.ROWS, _rows(doc), strict=True):
        assert row.goal and row.command and (row.met or row.goal.startswith("none stated; compared with")), row.what
        assert tables._anchor(row.note) in anchors, row.note
        assert re.search(r"\| (met|not met|partly: [^|]+|no goal|not measured) \|", line), line


def test_results_hold_exactly_what_the_page_reads_or_links():
    doc = tables.DOC.read_text()
    read = {f for row in tables.ROWS for f in row.files}
    linked = set(re.findall(r"benchmarks/results/([\w.-]+\.(?:json|png))", doc))
    on_disk = {p.name for p in RESULTS.iterdir()}
    assert read | linked <= on_disk, f"named but not in benchmarks/results/: {sorted((read | linked) - on_disk)}"
    assert on_disk <= read | linked, (f"in benchmarks/results/ but not read by a row of benchmarks/tables.py nor linked from "
                                      f"BENCHMARKS.md (a row's file, or an experiment's: benchmarks/experiments/): {sorted(on_disk - read - linked)}")
