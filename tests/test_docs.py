"""The published numbers: every measured table row of the README and docs/ is a row of
docs/results.md, which `python -m scripts.reproduce` regenerates from the runs (per seed, with the commit
they were trained at). A table kept from before reproduce.py must sit in a block that says so."""

import re

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LEGACY = re.compile(r"<!-- not regenerated: [^>]+ -->.*?<!-- end not regenerated -->", re.S)


def measured_rows(text: str) -> list[str]:
    """Table rows holding a mean ± std: measured over seeds, not a formula or a flag."""
    return [line.strip() for line in text.splitlines() if line.startswith("|") and "±" in line]


MEAN_STD = re.compile(r"[-+]?\d+(?:\.\d+)? ± \d+(?:\.\d+)?")


def test_every_published_table_row_is_regenerated_by_reproduce():
    """A row is results.md's verbatim, or (a table that joins two of its tables, as the prediction for
    a task and its control) every mean ± std in it is results.md's, in a row of the same rule."""
    results = (ROOT / "docs" / "results.md").read_text()
    generated = measured_rows(results)
    assert generated, "docs/results.md holds no measured rows"
    for page in PAGES:
        if page.name == "results.md":
            continue
        text = page.read_text()
        for block in LEGACY.findall(text):  # a legacy block says which commit and how to regenerate it
            assert "commit" in block and "python -m scripts.reproduce" in block, block[:200]
        for row in measured_rows(LEGACY.sub("", text)):
            if row in generated:
                continue
            rule = row.split("|")[1].strip().replace("**", "")
            same_rule = [g for g in generated if g.split("|")[1].strip().startswith(rule.split(" (")[0])]
            for value in MEAN_STD.findall(row.replace("−", "-")):
                assert any(value in g for g in same_rule), \
                    f"{page.name}: {value} of this row is in no row of docs/results.md: {row[:120]}"


def test_results_name_the_commit_of_every_section():
    text = (ROOT / "docs" / "results.md").read_text()
    sections = re.findall(r"<!-- section (\S+) -->(.*?)<!-- end \1 -->", text, re.S)
    assert sections
    for name, body in sections:
        assert re.search(r"(Runs trained|Computed) at commits? [0-9a-f]{10}", body), name
        assert "+dirty" not in body, f"{name}: runs trained from uncommitted code"


def test_the_factorials_report_quotes_results_rows_verbatim():
    """docs/lab.md's tables of the factorial's differences and declared tests are rows of results.md's
    factorial section: one digit changed in either fails."""
    results = (ROOT / "docs" / "results.md").read_text()
    section = results.split("<!-- section factorial -->")[1].split("<!-- end factorial -->")[0]
    lab = (ROOT / "docs" / "lab.md").read_text()
    report = lab.split("### What happened (runs at commit 09262e5")[1].split("**Against the prediction.**")[0]
    rows = [x for x in report.splitlines() if x.startswith(("| AUC |", "| J |"))]
    assert len(rows) == 7
    assert all(row in section.splitlines() for row in rows)


# A passage that quotes measured numbers names the results.md sections they come from:
#   <!-- numbers from results.md: SECTION, SECTION --> ... <!-- end numbers -->
QUOTES = re.compile(r"<!-- numbers from results\.md: ([\w, -]+?) -->(.*?)<!-- end numbers -->", re.S)
DECIMAL = re.compile(r"(?<![\w.+-])[-+]?\d+\.\d+")  # a measured value: means, differences, p values, AUCs


def prose(text: str) -> str:
    """What a reader reads as numbers: no commands, no link targets; a sign as printed (− is -)."""
    text = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", text))
    return text.replace("−", "-")


def untraced(passage: str, sections: list[str]) -> list[str]:
    results = (ROOT / "docs" / "results.md").read_text()
    pool = set()
    for name in sections:
        found = re.search(rf"<!-- section {re.escape(name)} -->(.*?)<!-- end {re.escape(name)} -->", results, re.S)
        assert found, f"results.md has no section {name!r}"
        pool.update(DECIMAL.findall(prose(found[1])))
    return [x for x in DECIMAL.findall(prose(passage)) if x not in pool]


def quoted_passages() -> list[tuple[str, list[str], str]]:
    found = [(page.name, [n.strip() for n in m[1].split(",")], m[2])
             for page in PAGES if page.name != "results.md" for m in QUOTES.finditer(page.read_text())]
    assert found, "no page marks a passage that quotes results.md"
    return found


def test_every_number_a_passage_quotes_is_in_the_results_sections_it_names():
    for page, sections, passage in quoted_passages():
        assert DECIMAL.findall(prose(passage)), f"{page}: a marked passage without numbers"
        assert untraced(passage, sections) == [], f"{page}: numbers in no row of results.md's {sections}"


def test_changing_one_digit_of_a_quoted_number_fails():
    """The check above is not vacuous: each digit of each quoted number, changed, leaves a number untraced."""
    for page, sections, passage in quoted_passages():
        text = prose(passage)
        for m in DECIMAL.finditer(text):
            for i in range(m.start(), m.end()):
                if text[i].isdigit():
                    changed = text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:]
                    assert untraced(changed, sections), f"{page}: {m[0]} changed at one digit still traces"
