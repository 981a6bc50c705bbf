"""The published numbers cannot drift: every measured number of the README and docs/ sits in a passage
that names the sections of a record it comes from, docs/results.md (what `python -m scripts.reproduce`
regenerates from the runs, per seed, with the commit they were trained at) or docs/measurements.md
(what a benchmark printed, at a commit, on a machine), and is where that record prints it; changing
any digit of any of them fails."""

import functools
import re
from collections import defaultdict

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def measured_rows(text: str) -> list[str]:
    """Table rows holding a mean ± std: measured over seeds, not a formula or a flag."""
    return [line.strip() for line in text.splitlines() if line.startswith("|") and "±" in line]


MEAN_STD = re.compile(r"[-+]?\d+(?:\.\d+)? ± \d+(?:\.\d+)?")


def test_every_published_table_row_is_regenerated_by_reproduce():
    """A row is results.md's verbatim, or (a table that joins two of its tables, as the prediction for
    a task and its control) every mean ± std in it is results.md's, in a row of the same rule."""
    generated = measured_rows((ROOT / "docs" / "results.md").read_text())
    assert generated, "docs/results.md holds no measured rows"
    generated += measured_rows((ROOT / "docs" / "measurements.md").read_text())
    for page in PAGES:
        if page.name in RECORDS:
            continue
        text = page.read_text()
        assert "not regenerated" not in text, f"{page.name}: a block kept from an older commit; regenerate it"
        for row in measured_rows(text):
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


# A passage that quotes measured numbers names the sections of the record they come from:
#   <!-- numbers from results.md: SECTION, SECTION --> ... <!-- end numbers -->
# Each number is anchored where it is read: a copied table row is a row of those sections for the same
# rule, cell for cell (a table that joins tables: each cell is a cell of such a row; where no row has
# its first cell, of any row); a mean ± std (with what its cell adds: "80.7 ± 2.3 / 0.94 / 0.96") or a
# CI is the same; "Holm p = 0.026", "t = ...", "d_z = ..." a cell of that column; any other number of
# a sentence one the sections print alone (the prediction's -0.05 is not its +0.05, nor the mean of
# a "-0.05 ± 0.01", nor one of a list of per-seed values).
# A passage the record holds word for word (a declared prediction) says so: <!-- text from ... -->.
QUOTES = re.compile(r"<!-- (numbers|text) from (\S+\.md): ([\w, -]+?) -->(.*?)<!-- end \1 -->", re.S)
NUMBER = re.compile(  # measured: a decimal, a power of ten, a percentage; not a version (0.32.0) or a name (1.5B)
    r"(?<![\w.+])[-+]?(?:\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+|\d+(?=%))(?![\w.]*\d|[a-wyzA-Z])")
N = NUMBER.pattern
PAIR = re.compile(rf"{N} ± {N}(?: / {N}(?! ±))*|\[{N}, {N}\]")  # mean ± std (/ what the cell adds), a CI
LABELLED = re.compile(rf"\b(Holm p|TOST p|p|t|d_z) = ({N})")  # a test's number, in its column
QUOTED = re.compile(r'"(?=\S)([^"]*?\d[^"]*?)(?<=\S)"')  # words quoted from the record (not a " token")


def prose(text: str) -> str:
    """What a reader reads as numbers: no commands (a fenced block of a language, a `span`), no link
    targets; a sign as printed (− is -). A block of printed output (``` or ```text) is read."""
    text = re.sub(r"```[a-z]+\n(?<!```text\n).*?```", "", text, flags=re.S)
    text = re.sub(r"^```(?:text)?[ \t]*$", "", text, flags=re.M)  # an output block's fences, not a `span`
    text = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", text))
    return text.replace("−", "-").replace("**", "")


RECORDS = ("results.md", "measurements.md")  # what reproduce.py regenerates; what a benchmark printed


def record_sections(record: str, names: list[str]) -> str:
    assert record in RECORDS, f"numbers from {record}: the records are {RECORDS}"
    text = (ROOT / "docs" / record).read_text()
    parts = []
    for name in names:
        found = re.search(rf"<!-- section {re.escape(name)} -->(.*?)<!-- end {re.escape(name)} -->", text, re.S)
        assert found, f"{record} has no section {name!r}"
        parts.append(prose(found[1]))
    return "\n".join(parts)


def is_row(line: str) -> bool:
    return line.strip().startswith("|") and line.strip().endswith("|")  # not a sentence that starts "|A| < 1"


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@functools.cache
def index(source: str) -> tuple[list[list[str]], set[str], set[str], dict[str, set[str]]]:
    """A record's table rows; its pairs; the numbers it prints alone: in a sentence, a cell or a cell's
    part ("J / check first / ..."), not half of a pair or one of a list of per-seed values; and each
    column's cells by its header."""
    lines = source.splitlines()
    rows, columns, head = [], defaultdict(set), []
    for k, line in enumerate(lines):
        if not is_row(line) or set(line) <= set("|- "):
            continue
        row = cells(line)
        rows.append(row)
        if k + 1 < len(lines) and set(lines[k + 1].strip()) <= set("|-") and lines[k + 1].strip():
            head = row
            continue
        for h, c in zip(head, row):
            columns[h].add(c)
    pairs = set(PAIR.findall(source))
    pairs |= {p.split(" / ")[0] for p in pairs}  # the mean ± std of a cell that adds to it
    alone = [x for x in lines if not is_row(x)]
    alone += [part for row in rows for cell in row for part in cell.split(" / ") if len(NUMBER.findall(part)) == 1]
    singles = {x for part in alone for x in NUMBER.findall(PAIR.sub(" ", part))}
    return rows, pairs, singles | {x.lstrip("+") for x in singles}, columns


def in_column(label: str, value: str, columns: dict[str, set[str]]) -> bool:
    """ "Holm p = 0.026" is a cell of the column "p (Holm)" (or "0.026 (Holm)" of the column "p")."""
    if label == "Holm p":
        return value in columns.get("p (Holm)", ()) or f"{value} (Holm)" in columns.get("p", ())
    return value in columns.get(label, ())


def untraced(passage: str, source: str, verbatim: bool = False) -> list[str]:
    """The numbers of a passage that are not where the source (its record's sections) prints them."""
    if verbatim:
        return [] if " ".join(prose(passage).split()) in " ".join(source.split()) else ["the passage"]
    rows, pairs, singles, columns = index(source)
    missing, sentences = [], []
    for line in prose(passage).splitlines():
        if is_row(line):  # a table row: each cell where the source has it
            row = cells(line)
            same = [r for r in rows if r[0].split(" (")[0] == row[0].split(" (")[0]] or rows  # the same rule
            numeric = [i for i, c in enumerate(row) if NUMBER.search(c)]
            aligned = [r for r in same if len(r) == len(row)]  # a copied row: one row's cells, each in its column
            if aligned:
                best = max(aligned, key=lambda r: sum(r[i] == row[i] for i in numeric))
                missing += [row[i] for i in numeric if best[i] != row[i]]
            else:
                missing += [row[i] for i in numeric if not any(row[i] in r for r in same)]
        else:
            sentences.append(line.strip())
    text = " ".join(sentences)  # a pair may break across lines
    flat = " ".join(source.split())
    missing += [q for q in QUOTED.findall(text) if NUMBER.search(q) and " ".join(q.split()) not in flat]
    text = QUOTED.sub(" ", text)
    missing += [x for x in PAIR.findall(text) if x not in pairs and x.lstrip("+") not in pairs]  # + left out
    missing += [f"{m[1]} = {m[2]}" for m in LABELLED.finditer(text) if not in_column(m[1], m[2], columns)]
    return missing + [x for x in NUMBER.findall(LABELLED.sub(" ", PAIR.sub(" ", text))) if x not in singles]


def quoted_passages() -> list[tuple[str, str, str, bool]]:
    """(page, the record's sections it names, the passage, word for word?) for every marked passage."""
    found = [(page.name, record_sections(m[2], [n.strip() for n in m[3].split(",")]), m[4], m[1] == "text")
             for page in PAGES if page.name not in RECORDS for m in QUOTES.finditer(page.read_text())]
    assert found, "no page marks a passage that quotes results.md"
    return found


def test_every_number_a_passage_quotes_is_where_its_record_prints_it():
    for page, source, passage, verbatim in quoted_passages():
        assert NUMBER.findall(prose(passage)), f"{page}: a marked passage without numbers"
        missing = untraced(passage, source, verbatim)
        assert missing == [], f"{page}: {missing[:5]} not as its record prints them: {passage[:80]!r}"


def test_changing_one_digit_of_a_quoted_number_fails():
    """The check above is not vacuous: each digit of each quoted number, changed, leaves a number untraced."""
    for page, source, passage, verbatim in quoted_passages():
        for text in re.split(r"\n\s*\n", prose(passage)):  # a paragraph or a table: nothing pairs across them
            for m in NUMBER.finditer(text):
                for i in range(m.start(), m.end()):
                    if text[i].isdigit():
                        changed = text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:]
                        assert untraced(changed, source, verbatim), f"{page}: {m[0]}, one digit changed, still traces"


def test_no_mean_std_or_p_value_outside_a_traced_passage():
    """A measured number cannot be published unmarked: outside the marked passages no sentence of the
    docs holds a mean ± std or a p value."""
    for page in PAGES:
        if page.name in RECORDS:
            continue
        text = prose(QUOTES.sub("", page.read_text()))
        loose = PAIR.findall(text) + re.findall(r"\bp (?:\(Holm\) )?[=<] ?\d", text)
        assert not loose, f"{page.name}: measured numbers outside a traced passage: {loose[:5]}"


def test_every_measurement_names_its_commit_its_machine_and_whether_its_output_was_kept():
    """docs/measurements.md, the record of what the benchmarks printed: a section is the output as
    printed, at a commit, on a machine, or says that the printed output was not kept."""
    text = (ROOT / "docs" / "measurements.md").read_text()
    sections = re.findall(r"<!-- section (\S+) -->(.*?)<!-- end \1 -->", text, re.S)
    assert sections
    for name, body in sections:
        kept = re.search(r"Measured at commit [0-9a-f]{7,10} on [^;]+; the output as printed", body)
        lost = re.search(r"Published at commit [0-9a-f]{7,10} from [^;]+; the printed output was not kept", body)
        assert kept or lost, f"measurements.md {name}: say the commit, the machine and whether the output was kept"
        assert not kept or "```text" in body, f"measurements.md {name}: the output as printed, in a ```text block"


def test_every_section_shows_the_commands_reproduce_runs():
    """results.md's commands are reproduce.py's, which pins the rules each experiment ran: regenerating a
    section runs what it shows (a rule added to the trainer changes neither)."""
    from scripts import reproduce

    text = (ROOT / "docs" / "results.md").read_text()
    for name, (_, ablations, tables) in reproduce.EXPERIMENTS.items():
        body = text.split(f"<!-- section {name} -->")[1].split(f"<!-- end {name} -->")[0]
        shown = [x for x in body.splitlines() if x.startswith("python -m scripts.ablation ")]
        assert shown == [f"python -m scripts.ablation {' '.join(a)}" for a in ablations], name
        labels = [x[1:-1] for x in body.splitlines() if x.startswith("`") and x.endswith("`") and x.count("`") == 2]
        assert labels == [reproduce.shown(cmd) for cmd in tables], name


def test_the_lora_studys_report_quotes_results_rows_verbatim():
    """docs/lora.md's tables of the LoRA study's cells and declared tests are rows of results.md's lora section
    (the cells' AUC and J columns): one digit changed in either fails."""
    results = (ROOT / "docs" / "results.md").read_text()
    section = results.split("<!-- section lora -->")[1].split("<!-- end lora -->")[0]
    lora = (ROOT / "docs" / "lora.md").read_text()
    report = lora.split("### What happened")[1].split("**Against the prediction.**")[0]
    tests = [x for x in report.splitlines() if x.startswith(("| d, ", "| L, ", "| D, "))]
    assert len(tests) == 9 and all(row in section.splitlines() for row in tests)
    cells = [x for x in report.splitlines() if x.startswith(("| full |", "| r1 |", "| r8 |"))]
    assert len(cells) == 6
    for row in cells:
        arm, rule, auc, j = (c.strip() for c in row.strip("|").split("|"))
        assert any(x.startswith(f"| {arm} | {rule} |") and f"| {auc} | {j} |" in x for x in section.splitlines()), row
