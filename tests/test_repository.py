"""The repository stands alone: no code reads a folder beside the clone, and every cited document is in it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = [
    *ROOT.glob("ultramem/**/*.py"),
    *ROOT.glob("ultramem/**/*.yaml"),
    *ROOT.glob("benchmarks/*.py"),
    *ROOT.glob("tests/**/*.py"),
    ROOT / "pyproject.toml",
    ROOT / ".ci" / "run",
]
DOCS = [ROOT / "README.md", *ROOT.glob("benchmarks/*.md"), *ROOT.glob("ultramem/**/*.md")]
OUTSIDE = re.compile(r"""\.\./shared|["'/]shared["'/]|shared/data""")


def test_no_code_reads_a_folder_beside_the_clone():
    hits = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in CODE if path != Path(__file__).resolve()
            for line in path.read_text(encoding="utf-8").splitlines() if OUTSIDE.search(line)]
    assert not hits, hits


def test_decisions_are_cited_from_the_repository():
    assert "## Memory layer placement" in (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    hits = [str(path.relative_to(ROOT)) for path in CODE + DOCS if re.search(r"\bSPEC\b", path.read_text(encoding="utf-8"))]
    assert not hits, hits
