"""No committed text claims that two rows are equivalent without an equivalence test
(issue 43): "level with", "equivalent", "same as", "powered null", "indistinguishable" and
"not distinguishable" (any case, whole words, across line breaks) may appear in README.md,
docs/**/*.md and results/**/*.md (the READMEs and the generated tables) only beside a TOST,
i.e. in a unit of text that also names "TOST" (the two one-sided tests against a margin
stated before the runs: `tost_paired` in sao_jax/report/stats.py at commit 9f70572). The
pre-registrations (results/**/PREREGISTRATION*.md) are left out: they are the readings
fixed before their runs and are never edited after (two name a "powered null" outcome);
their folder's README says how each result reads now.

A unit is what a reader takes in as one statement: a paragraph (lines up to a blank line),
one list item (a line starting "- ", "* " or "N. " begins a new one), one table row, one
heading. Fenced code blocks are commands, not claims, and are skipped. A "no difference
shown" verdict needs none of these words: write "no difference shown (MDD x)" instead
(docs/results.md, "How to read these tables").

And every MDD such a page quotes (README.md, docs/, the results' READMEs) is a figure of a
committed table's MDD cells (issue 43 item 3): copied, not computed beside the table.
Pure text: no import of the library.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = sorted((ROOT / "results").rglob("*_runs.jsonl"))
PHRASES = re.compile(
    r"\b(level with|equivalent|same as|powered null|indistinguishable|not distinguishable)\b",
    re.IGNORECASE,
)
TOST = re.compile(r"\bTOST\b")
NEW_UNIT = re.compile(r"^\s*(?:[-*]|\d+\.)\s|^\s*\||^#")


def claim_files(root: pathlib.Path) -> list[pathlib.Path]:
    """README.md, docs/**/*.md and every results/**/*.md but the pre-registrations (what a
    reader reads as the project's claims: the pages, the results' READMEs and tables)."""
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    files += sorted(
        f for f in (root / "results").rglob("*.md") if not f.name.startswith("PREREGISTRATION")
    )
    return [f for f in files if f.is_file()]


def units(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each unit (module docstring), fenced code left out."""
    out: list[tuple[int, list[str]]] = []
    fenced = False
    open_unit = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced, open_unit = not fenced, False
            continue
        if fenced or not line.strip():
            open_unit = False
            continue
        if not open_unit or NEW_UNIT.match(line) or out[-1][1][-1].lstrip().startswith("|"):
            out.append((number, []))
        out[-1][1].append(line)
        open_unit = not line.lstrip().startswith("#")
    return [(number, re.sub(r"\s+", " ", " ".join(lines))) for number, lines in out]


def unbacked_claims(text: str) -> list[tuple[int, str]]:
    """(line, phrase) of every banned phrase in a unit that names no TOST."""
    return [
        (number, m.group(0))
        for number, unit in units(text)
        if not TOST.search(unit)
        for m in PHRASES.finditer(unit)
    ]


def test_committed_text_claims_no_equivalence_without_a_tost():
    found = [
        f"{path.relative_to(ROOT)}:{line}: '{phrase}'"
        for path in claim_files(ROOT)
        for line, phrase in unbacked_claims(path.read_text())
    ]
    assert not found, (
        "an equivalence-sounding phrase without a TOST beside it (same paragraph, list item or"
        " table row); write 'no difference shown (MDD x)', or cite the TOST row:\n"
        + "\n".join(found)
    )


NUMBER = re.compile(r"(?<![\d.])\d+\.\d+(?![\d.])")
# from "MDD" up to the end of its parenthesis, bracket, table cell or sentence
MDD_QUOTE = re.compile(r"\bMDDs?\b[^)\]|]*?(?=[)\]|]|\. [A-Z]|$)")


def table_mdds(text: str) -> set[str]:
    """Every figure of a generated table's MDD cells: the cells of a column whose heading
    names "MDD", and "MDD x (y)" written anywhere in it (the Fieller table's cells)."""
    out: set[str] = set()
    lines = text.splitlines()
    heading: list[str] | None = None
    for i, line in enumerate(lines):
        for m in re.finditer(r"MDD (\d+\.\d+)(?: \((\d+\.\d+)\))?", line):
            out |= {g for g in m.groups() if g}
        if not line.startswith("|"):
            heading = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if i + 1 < len(lines) and lines[i + 1].startswith("|-"):
            heading = cells
        elif heading and not set(line) <= set("|-: "):
            out |= {n for h, c in zip(heading, cells) if "MDD" in h for n in NUMBER.findall(c)}
    return out


def quoted_mdds(text: str) -> list[str]:
    """The figures of two or more decimals a text quotes as MDDs: those after "MDD" in the
    same parenthesis, bracket, table cell or sentence, but p-values, powers, the alpha
    0.05 (also of 0.05/m) and a formula's quantile (t_{0.975, n-1})."""
    flat = re.sub(r"\s+", " ", text)
    return [
        n.group(0)
        for m in MDD_QUOTE.finditer(flat)
        for n in NUMBER.finditer(m.group(0))
        if re.fullmatch(r"\d+\.\d\d+", n.group(0))
        and not re.search(r"(\bp|power|alpha) $|[{_]$", m.group(0)[: n.start()][-7:])
        and n.group(0) != "0.05"
    ]


def test_every_mdd_quoted_is_a_generated_table_cell():
    """An MDD in README.md, docs/ or a results README is copied from a committed table's MDD
    cells (issue 43), never computed by hand beside it: a figure found in no table's MDD
    cells is a typo, another row's figure, or a hand computation."""
    cells = set().union(
        *(table_mdds(p.read_text()) for p in claim_files(ROOT) if p.name != "README.md")
    )
    pages = [p for p in claim_files(ROOT) if p.name == "README.md" or "docs" in p.parts]
    found = [
        f"{p.relative_to(ROOT)}: MDD {n}"
        for p in pages
        for n in quoted_mdds(p.read_text())
        if n not in cells
    ]
    assert cells and not found, "an MDD no table prints:\n" + "\n".join(found)


def test_what_counts_as_an_mdd_quote():
    table = "| d | MDD (80% power) |\n|---|---|\n| a | 2.95 (3.57) |\n\n- Fieller: MDD 2.01 (2.55)"
    assert table_mdds(table) == {"2.95", "3.57", "2.01", "2.55"}
    text = "no difference shown (MDD 2.95; 3.57 at 0.05/3, p 0.123, power 0.56). Rest 1.234"
    assert quoted_mdds(text) == ["2.95", "3.57"]
    assert quoted_mdds("MDDs of 8.91 / 19.76 points at 1%; alpha 0.05 and 0.05/4") == [
        "8.91",
        "19.76",
    ]
    assert quoted_mdds("(MDD 1.1-6.7 points by hand)") == []  # one decimal: not a cell figure
    assert quoted_mdds("MDD column ((t_{0.975, n-1} + t_{0.8, n-1}) SE)") == []


def test_the_files_read_are_the_readers_pages():
    names = {p.relative_to(ROOT).as_posix() for p in claim_files(ROOT)}
    assert {"README.md", "docs/results.md"} <= names
    assert sum(n.startswith("docs/") for n in names) > 1  # every page, not one
    assert any(n.startswith("results/") and n.endswith("/README.md") for n in names)
    # the generated tables too, the committed table of every runs file among them
    tables = {p.with_name(p.name.replace("_runs.jsonl", ".md")) for p in RUNS}
    assert tables and {t.relative_to(ROOT).as_posix() for t in tables} <= names
    assert all(n == "README.md" or n.startswith(("docs/", "results/")) for n in names)
    assert not any(pathlib.PurePath(n).name.startswith("PREREGISTRATION") for n in names)


def test_pre_registrations_are_left_out_by_name_only(tmp_path):
    for rel in ("README.md", "docs/a/b.md", "results/x/PREREGISTRATION_two.md", "results/x/t.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("text")
    (tmp_path / "results/x/notes.txt").write_text("not markdown")
    got = [p.relative_to(tmp_path).as_posix() for p in claim_files(tmp_path)]
    assert got == ["README.md", "docs/a/b.md", "results/x/t.md"]


def test_what_counts_as_beside():
    def flagged(text):
        return [phrase for _, phrase in unbacked_claims(text)]

    assert flagged("SAO is level with the oracle.") == ["level with"]
    assert flagged("A Powered\nNull here.") == ["Powered Null"]  # across a line break
    assert flagged("the same as before; equivalent rows") == ["same as", "equivalent"]
    assert flagged("K=1 is not distinguishable from K=2") == ["not distinguishable"]
    # whole words only: no hit inside another word
    assert flagged("Equivalently, the same assumptions; the levels with care") == []
    # a TOST in the same paragraph backs it; in the next paragraph it does not
    assert flagged("Equivalent within 1 point\n(TOST p 0.01, margin 1).") == []
    assert flagged("Equivalent within 1 point.\n\nTOST p 0.01.") == ["Equivalent"]
    # list items and table rows are units of their own
    assert flagged("- level with SAO\n- TOST p 0.01") == ["level with"]
    assert flagged("| a | level with SAO |\n| b | TOST p 0.01 |") == ["level with"]
    assert flagged("| a | level with SAO, TOST p 0.01 |") == []
    assert flagged("# Level with\ntext naming TOST") == ["Level with"]
    # code is not a claim; "tost" in lower case is no citation
    assert flagged("```\necho the same as\n```\nrest") == []
    assert flagged("equivalent, tost") == ["equivalent"]


def test_units_split_where_a_reader_does():
    text = "para one\ncontinues\n\n- item\n  wraps\n- next\n| row |\n| row2 |\n```\ncode\n```\nlast"
    assert units(text) == [
        (1, "para one continues"),
        (4, "- item wraps"),
        (6, "- next"),
        (7, "| row |"),
        (8, "| row2 |"),
        (12, "last"),
    ]
