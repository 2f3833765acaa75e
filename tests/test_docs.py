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

Scanned: every .py and .sh file under flashnorm_mlx/, tests/ and scripts/,
README.md and the other docs/*.md pages. Inside docs/design.md itself, `section X` / `§X` references to its
own sections are checked the same way.

Links: every Markdown link in README.md and docs/*.md to a file of the
repository must name a file that exists, and a `#anchor` on a link to a
Markdown page must name one of that page's headings (as GitHub makes anchors).
The README stays a short front page: at most 250 lines, both of its commands in
the first 40, every docs/*.md page linked from it, and its test command the one
.ci/run runs.

The file name is never written out whole in this file's code (NAME below), so
the examples and the deliberately bad references of the unit tests are not
references themselves.
"""

import re
from pathlib import Path
from typing import Iterable, List, Set
from urllib.parse import unquote

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
    for path in sorted((root / "docs").glob("*.md")):
        if path.name != NAME:
            yield path


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


# --- links in README.md and docs/*.md ----------------------------------------------

README = Path("README.md")
README_MAX_LINES = 250
FRONT_LINES = 40  # both commands must be on the README's first screen
# A fenced code block (its text is code, not links), an inline code span, a
# link or image `[text](target "title")`, a Markdown heading.
_FENCE = re.compile(r"^(```|~~~)[^\n]*\n.*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]+`")
_LINK = re.compile(
    r"!?\[(?:[^\[\]\n]|\[[^\]\n]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_MD_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def _blank(m: "re.Match") -> str:
    """The match's text with every character but line breaks made a space, so
    what follows keeps its line and column."""
    return re.sub(r"[^\n]", " ", m.group(0))


def without_code(text: str) -> str:
    return _CODE_SPAN.sub(_blank, _FENCE.sub(_blank, text))


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: the text as shown (code marks dropped, a
    link's text kept), lower case, anything but letters, digits, `_`, `-` and
    spaces dropped, spaces made hyphens."""
    shown = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", shown.lower()).replace(" ", "-")


def anchors(text: str) -> Set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict = {}
    out = set()
    for m in _MD_HEADING.finditer(_FENCE.sub(_blank, text)):
        a = anchor(m.group(1))
        out.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return out


def link_problems(root: Path, page: Path) -> List[str]:
    """One 'page:line: what' line per local link of `page` (under `root`) whose
    file or heading does not exist; web addresses are not followed."""
    root = root.resolve()
    text = without_code(page.read_text(encoding="utf-8"))
    where = page.resolve().relative_to(root)
    found = []
    for m in _LINK.finditer(text):
        target = m.group(1)
        if not target or _URL.match(target):
            continue
        path, _, frag = unquote(target).partition("#")
        dest = (page.parent / path).resolve() if path else page.resolve()
        line = _line(text, m.start())
        if root not in dest.parents and dest != root:
            found.append(f"{where}:{line}: link {target!r} leaves the repository")
        elif not dest.exists():
            found.append(f"{where}:{line}: link {target!r}: no such file")
        elif frag and (dest.suffix != ".md" or frag not in anchors(dest.read_text())):
            found.append(
                f"{where}:{line}: link {target!r}: {dest.relative_to(root)} has no "
                f"heading with the anchor {frag!r}"
            )
    return found


def pages(root: Path) -> List[Path]:
    return [root / README] + sorted((root / "docs").glob("*.md"))


def test_links_in_readme_and_docs_name_existing_files_and_headings():
    found = [p for page in pages(ROOT) for p in link_problems(ROOT, page)]
    assert not found, f"{len(found)} broken link(s):\n" + "\n".join(found)


def test_readme_is_a_short_front_page_linking_every_docs_page():
    lines = (ROOT / README).read_text(encoding="utf-8").split("\n")
    assert len(lines) - 1 <= README_MAX_LINES, f"README.md has {len(lines) - 1} lines"
    front = lines[:FRONT_LINES]
    chat = [x for x in front if x.startswith("python3 -m venv") and x.endswith(" chat")]
    tests = [x for x in front if x.startswith("python3 -m venv") and "pytest" in x]
    assert chat and tests, f"install-and-chat {chat}, test command {tests}"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").split("\n")
    assert tests[0] in ci, f"the README's test command is not .ci/run's: {tests[0]}"
    linked = {
        (ROOT / unquote(m.group(1)).partition("#")[0]).resolve()
        for m in _LINK.finditer(without_code("\n".join(lines)))
    }
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize(
    "heading, expected",
    [
        (
            "3e. Engines: the compiled decode step",
            "3e-engines-the-compiled-decode-step",
        ),
        (
            "2. What FlashNorm computes, and why it is exact",
            "2-what-flashnorm-computes-and-why-it-is-exact",
        ),
        ("Bad input, progress and `--help`", "bad-input-progress-and---help"),
        ("The `flashnorm_vs_stock` ratio", "the-flashnorm_vs_stock-ratio"),
        ("See [serve](serve.md)", "see-serve"),
    ],
)
def test_anchor_is_githubs(heading, expected):
    assert anchor(heading) == expected


def test_link_checker_fails_on_a_missing_file_heading_or_a_link_outside(tmp_path):
    # A made-up repository in tmp_path: one page, and one name that is not there.
    page, absent = Path("guide", "page.md").as_posix(), Path("guide", "absent.md")
    (tmp_path / "guide").mkdir()
    (tmp_path / page).write_text("# A page\n## Twice\n## Twice\n")
    (tmp_path / "pic.png").write_bytes(b"")
    good = (
        f"# Top\n[a]({page}) [b]({page}#twice-1) ![p](pic.png) [top](#top)\n"
        "[web](https://example.com/x.md) `[code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
    )
    bad = (
        f"[missing]({absent.as_posix()})\n[no heading]({page}#twice-2)\n"
        "[outside](../elsewhere.md)\n[anchor on a picture](pic.png#x)\n"
    )
    (tmp_path / "README.md").write_text(good + bad)
    found = link_problems(tmp_path, tmp_path / "README.md")
    assert [f.split(": ", 1)[0] for f in found] == [
        f"README.md:{n}" for n in (7, 8, 9, 10)
    ], found
    assert "no such file" in found[0] and "'twice-2'" in found[1], found
    assert "leaves the repository" in found[2] and "'x'" in found[3], found
