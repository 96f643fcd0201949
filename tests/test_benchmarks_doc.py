"""BENCHMARKS.md's generated tables match the raw JSON they cite (benchmarks/tables.py)."""

import subprocess
import sys

from conftest import REPO


def test_generated_tables_match_their_json():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import tables

    doc = tables.DOC.read_text()
    blocks = tables.BLOCK.findall(doc)
    assert len(blocks) >= 3, "BENCHMARKS.md lost its generated tables"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tables.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    body = blocks[0][3]
    edited = doc.replace(body, body.replace("|", "| 9.99 |", 2), 1)  # a figure typed in by hand
    assert tables.render(edited) == doc
