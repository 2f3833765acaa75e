"""References to the project's design document, docs/design.md, stay valid.

Code comments and docstrings cite the design document by section. The sections
are its headings that start with a section id: `## 3. Title`, `### 3b. Title`
(and `### 5.3 Title` style, should the document use it). A section id is a
number, optionally followed by one lower-case letter or by dotted numbers
(e.g. 2, 4a, 5.3).

A reference is the file name `design.md` (with or without `docs/` before it)
followed by one of these, across a line break and a comment's `#` too:
- `section X` (also `Section X`);
- `sections X and Y`, or a longer list: `sections X, Y and Z`, `X or Y`;
- `§X` or `§§X and Y` (the same lists);
- a bare id on the same line: `design.md X`.
Every X in a reference must be a section of docs/design.md. A mention of the
file without a section (e.g. "see docs/design.md") is not a reference and is
accepted. Any other spelling of the file name, above all the upper-case one of
the old design notes that live outside the repository, fails.

Scanned: every .py and .sh file under flashnorm_mlx/, tests/ and scripts/, and
README.md. Inside docs/design.md itself, `section X` / `§X` references to its
own sections are checked the same way.

The file name is never written out whole in this file's code (NAME below), so
the examples and the deliberately bad references of the unit tests are not
references themselves.
"""

import re
from pathlib import Path
from typing import Iterable, List, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = Path("docs") / "design.md"
NAME = "design" + ".md"
OLD_NAME = NAME[: -len(".md")].upper() + ".md"  # the old notes, outside the repository
SCANNED_DIRS = ("flashnorm_mlx", "tests", "scripts")
SUFFIXES = (".py", ".sh")
SCANNED_FILES = ("README.md",)

# A section id as written in prose: starts with a digit, ends with a letter or
# digit (so "section 2." cites "2"); checked against the headings, so a malformed
# id such as "4ab" is reported rather than skipped.
_ID = r"\d(?:[0-9A-Za-z.]*[0-9A-Za-z])?"
_LIST = rf"{_ID}(?:\s*(?:,\s*and|,\s*or|,|and|or|&)\s*{_ID})*"
_KEYWORD = r"(?i:sections?)|§§?"
# What may follow the file name: a keyword (after punctuation, line breaks and
# comment marks) or a bare id on the same line; then the list of ids.
_AFTER = re.compile(
    rf"(?:[\s#,(]*(?:{_KEYWORD})[\s#]*|[ \t]+)(?P<ids>{_LIST})(?![0-9A-Za-z])"
)
# The document's own cross-references: a keyword, then the list.
_INTERNAL = re.compile(rf"(?<![0-9A-Za-z])(?:{_KEYWORD})\s*(?P<ids>{_LIST})")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(\d+[a-z]?(?:\.\d+)*)\.?[ \t]", re.MULTILINE)
_FILE_NAME = re.compile(re.escape(NAME), re.IGNORECASE)


def sections(doc_text: str) -> List[str]:
    """Section ids of the document's headings, in order."""
    return [m.group(2) for m in _HEADING.finditer(doc_text)]


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _ids(ids: str) -> List[str]:
    return re.findall(_ID, ids)


def references(text: str) -> List[tuple]:
    """(line, file name as written, [section ids]) for each mention of the file;
    ids is empty for a mention that cites no section."""
    out = []
    for m in _FILE_NAME.finditer(text):
        after = _AFTER.match(text, m.end())
        ids = _ids(after.group("ids")) if after else []
        out.append((_line(text, m.start()), m.group(0), ids))
    return out


def problems_in(text: str, where: str, known: Set[str]) -> List[str]:
    """One 'file:line: what' line per bad reference in `text`."""
    found = []
    for line, written, ids in references(text):
        if written != NAME:
            found.append(
                f"{where}:{line}: refers to {written!r}, not the repository's "
                f"docs/{NAME}: cite docs/{NAME} by section instead"
            )
            continue
        for x in ids:
            if x not in known:
                found.append(
                    f"{where}:{line}: docs/{NAME} has no section {x!r} "
                    f"(its sections: {', '.join(sorted(known))})"
                )
    return found


def internal_problems(doc_text: str, where: str) -> List[str]:
    """The document's references to its own sections that name no heading."""
    known = set(sections(doc_text))
    return [
        f"{where}:{_line(doc_text, m.start())}: no section {x!r} in this document"
        for m in _INTERNAL.finditer(doc_text)
        for x in _ids(m.group("ids"))
        if x not in known
    ]


def scanned_files(root: Path) -> Iterable[Path]:
    for d in SCANNED_DIRS:
        for path in sorted((root / d).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file():
                yield path
    for name in SCANNED_FILES:
        if (root / name).is_file():
            yield root / name


def scan(root: Path) -> List[str]:
    """Every bad reference under `root` (a checkout, or a copy of one)."""
    doc_text = (root / DOC).read_text(encoding="utf-8")
    known = set(sections(doc_text))
    found = internal_problems(doc_text, str(DOC))
    for path in scanned_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        found += problems_in(text, str(path.relative_to(root)), known)
    return found


# --- the checks on this repository -----------------------------------------------


def test_design_doc_references_name_existing_sections():
    found = scan(ROOT)
    assert not found, f"{len(found)} bad reference(s):\n" + "\n".join(found)


def test_design_doc_sections_are_numbered_in_order():
    """`## 1.`, `## 2.`, ... with subsections `### 1a.`, `### 1b.`, ... under
    their own section, each id once."""
    heads = [
        (len(m.group(1)), m.group(2))
        for m in _HEADING.finditer((ROOT / DOC).read_text(encoding="utf-8"))
    ]
    ids = [x for _, x in heads]
    assert ids, f"docs/{NAME} has no numbered headings"
    assert len(ids) == len(set(ids)), f"repeated section ids: {ids}"
    top = [x for level, x in heads if level == 2]
    assert top == [str(i) for i in range(1, len(top) + 1)], top
    current = None
    for level, x in heads:
        if level == 2:
            current, letter = x, "a"
        elif re.fullmatch(r"\d+[a-z]", x):
            assert current and x == f"{current}{letter}", (x, "after", current, letter)
            letter = chr(ord(letter) + 1)
        else:
            assert current and x.split(".")[0] == current, (x, "under", current)


# --- the checker itself: it accepts what it should and fails where it must ---------

KNOWN = {"1", "1a", "2", "3b", "4a", "5", "5.3"}


@pytest.mark.parametrize(
    "text, ids",
    [
        (f"see docs/{NAME} section 2.", ["2"]),
        (f"(docs/{NAME} section 4a)", ["4a"]),
        (f"docs/{NAME}, Section 3b: the plan", ["3b"]),
        (f"docs/{NAME} sections 1a and 3b", ["1a", "3b"]),
        (f"{NAME} sections 1, 2 and 5.3", ["1", "2", "5.3"]),
        (f"{NAME} sections 1a or 2", ["1a", "2"]),
        (f"docs/{NAME} §5.3", ["5.3"]),
        (f"docs/{NAME} §§1a, 2", ["1a", "2"]),
        (f"docs/{NAME} 4a", ["4a"]),
        (f"# spans lines (docs/{NAME}\n    # section 3b)", ["3b"]),
        (f"see docs/{NAME} for the math", []),
        (f"docs/{NAME} sections 2 and the kernels", ["2"]),
    ],
)
def test_reference_forms(text, ids):
    [(line, written, got)] = references(text)
    assert (line, written, got) == (1, NAME, ids)
    assert problems_in(text, "x.py", KNOWN) == []


@pytest.mark.parametrize(
    "text, bad",
    [
        (f"docs/{NAME} section 6", "'6'"),
        (f"docs/{NAME} section 4b", "'4b'"),
        (f"docs/{NAME} sections 1a and 9", "'9'"),
        (f"docs/{NAME} §5.4", "'5.4'"),
        (f"docs/{NAME} 4ab", "'4ab'"),
        (f"{OLD_NAME} section 2", "refers to"),
        (f"see {OLD_NAME}", "refers to"),
    ],
)
def test_bad_references_fail_with_file_and_line(text, bad):
    found = problems_in("first line\n" + text, "pkg/mod.py", KNOWN)
    assert len(found) == 1 and found[0].startswith("pkg/mod.py:2: "), found
    assert bad in found[0], found


def test_scan_fails_on_a_copy_with_bad_references(tmp_path):
    """The whole scan, on a copy of the document and a small tree: a bad section
    number and an upper-case file name each fail, naming file and line."""
    (tmp_path / "docs").mkdir()
    (tmp_path / DOC).write_text((ROOT / DOC).read_text(encoding="utf-8"))
    pkg = tmp_path / "flashnorm_mlx"
    pkg.mkdir()
    (pkg / "good.py").write_text(f'"""Math: docs/{NAME} section 1a."""\n')
    (pkg / "bad.py").write_text(
        f'"""Fine: docs/{NAME} section 1.\n\nBroken: docs/{NAME} section 99z."""\n'
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(f"# {OLD_NAME} 4a\n")
    found = scan(tmp_path)
    assert len(found) == 2, found
    assert found[0].startswith("flashnorm_mlx/bad.py:3: ") and "'99z'" in found[0]
    assert found[1].startswith("tests/test_x.py:1: ") and "refers to" in found[1]


def test_internal_references_are_checked():
    doc = "## 1. One\n### 1a. Sub\nAs section 1a says; see §2.\n"
    found = internal_problems(doc, "d.md")
    assert found == ["d.md:3: no section '2' in this document"], found
