"""Every table the README and docs/ publish, regenerated from its runs by one command.

    python -m scripts.reproduce                   # every experiment (~5 h on a 2-core CPU), then docs/results.md
    python -m scripts.reproduce lab-check         # one experiment's section of docs/results.md
    python -m scripts.reproduce --list            # the experiments and their commands
    python -m scripts.reproduce --tables-only     # rewrite the sections from the runs already there

Each experiment trains its runs with ablation.py (a finished run is skipped, an interrupted one
resumes) and prints its tables with compare_rules.py, length_drift.py or evaluate.py's table, into
its section of docs/results.md, with per-seed values and the commit every run was trained at
(ablation.py records it in OUT/RUN.commit). The docs' tables are copies of these sections
(tests/test_docs.py holds them to it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts import compare_rules

ROOT = Path(__file__).resolve().parent.parent  # the project's root
RESULTS = ROOT / "docs" / "results.md"
PY = sys.executable
SEEDS5 = ["1", "2", "3", "4", "5"]
FACTORIAL_SEEDS = [str(s) for s in range(11, 23)]  # 12 seeds no earlier experiment ran
FACTORIAL_FLAGS = ["--steps", "30", "--save-interval", "10", "--max-response-len", "96"]  # every cell alike
COMPARE_RULES, LENGTH_DRIFT = "scripts.compare_rules", "scripts.length_drift"  # the tables' modules
# The rules each published experiment ran, in its tables' order, pinned: a rule added to the trainer (which
# ablation.py's --aggs all and the tables' default --rules take in) changes no published experiment.
LAB_RULES = ["seq", "token", "balanced", "balanced-batch", "token-batch", "dr-grpo", "seq-sum"]
COMPARE = ["seq", "token", "token-batch", "balanced", "balanced-batch", "dr-grpo"]  # the lab-check pair's order
PREDICT = [r for r in LAB_RULES if r != "seq-sum"]  # the factorial's prediction
LORA_SEEDS = [str(s) for s in range(23, 33)]  # the LoRA study's: 10 seeds no earlier experiment ran

# name: (what it is, [ablation.py arguments, ...], [table command, ...]). A table command is a
# module of this folder run from the project root; its standard output is the section's table.
EXPERIMENTS: dict[str, tuple[str, list[list[str]], list[list[str]]]] = {
    "lab-check": (
        "A task where the coupling can cost accuracy: the prediction, then 6 rules x 5 paired seeds",
        [["--model", "lab-check", "--aggs", *COMPARE, "--seeds", *SEEDS5, "--no-eval",
          *"--out runs/compare-lab-check -- --steps 30 --save-interval 10".split()]],
        [[COMPARE_RULES, "--predict", "lab-check", "--rules", *COMPARE],
         [COMPARE_RULES, "runs/compare-lab-check", "--rules", *COMPARE]],
    ),
    "lab-check-nogap": (
        "Its control, failures as long as successes: the prediction, then 6 rules x 5 paired seeds",
        [["--model", "lab-check-nogap", "--aggs", *COMPARE, "--seeds", *SEEDS5, "--no-eval",
          "--out", "runs/compare-lab-check-nogap", "--", "--steps", "30", "--save-interval", "10"]],
        [[COMPARE_RULES, "--predict", "lab-check-nogap", "--rules", *COMPARE],
         [COMPARE_RULES, "runs/compare-lab-check-nogap", "--rules", *COMPARE]],
    ),
    "factorial-prediction": (
        "The factorial's prediction, before its runs: each gap's first-step and steady gains",
        [],
        [[COMPARE_RULES, "--predict", task, "--steady", "--rules", *PREDICT, "--", *FACTORIAL_FLAGS[-2:]]
         for task in compare_rules.GAPS.values()],
    ),
    "factorial": (
        "The paper's contrast: token vs balanced x the failures' length gap (none, middle, long), 12 paired seeds",
        [["--model", task, "--aggs", *compare_rules.FACTORIAL_RULES, "--seeds", *FACTORIAL_SEEDS, "--no-eval",
          "--out", "runs/factorial", "--", *FACTORIAL_FLAGS] for task in compare_rules.GAPS.values()],
        [[COMPARE_RULES, "--factorial", "runs/factorial", "--figure", "docs/factorial.png"]],
    ),
    "lora-prediction": (
        "The LoRA study's prediction, before its runs: token's and balanced's first-step and steady gains on the "
        "long gap, full fine-tuning and LoRA of ranks 1 and 8",
        [],
        [[COMPARE_RULES, "--predict", compare_rules.LORA_TASK, "--steady", "--rules", *compare_rules.FACTORIAL_RULES,
          "--", *FACTORIAL_FLAGS[-2:], *flags] for flags in compare_rules.LORA_ARMS.values()],
    ),
    "lora": (
        "Does the paper's effect survive LoRA? token vs balanced on the long gap, full fine-tuning and LoRA of "
        "ranks 1 and 8, 10 paired seeds",
        [["--model", compare_rules.LORA_TASK, "--aggs", *compare_rules.FACTORIAL_RULES, "--seeds", *LORA_SEEDS,
          "--no-eval", "--out", f"runs/lora/{arm}", "--", *FACTORIAL_FLAGS, *flags]
         for arm, flags in compare_rules.LORA_ARMS.items()],
        [[COMPARE_RULES, "--lora", "runs/lora", "--figure", "docs/lora.png"]],
    ),
    "heldout-design": (
        "Table 1's measure at lab scale, the design before its runs: the power analysis behind its seeds",
        [],
        [["scripts.heldout_study", "--design"]],
    ),
    "lab": (
        "The aggregation lab: every rule x 3 seeds, 40 steps, Acc@8 of every checkpoint (Table 1's layout)",
        [["--model", "lab", "--aggs", *LAB_RULES]],
        [[LENGTH_DRIFT, "--summary", "runs/ablation-lab", "--per-seed"], ["evaluate_table", "runs/ablation-lab"]],
    ),
    "length-study": (
        "Is balanced aggregation length-neutral? The two controls, every rule x 3 seeds",
        [["--model", "lab-nogap", "--aggs", *LAB_RULES], ["--model", "lab-nogap-hi", "--aggs", *LAB_RULES]],
        [[LENGTH_DRIFT, "--model", m, "--predict", "--rules", *LAB_RULES] for m in ("lab", "lab-nogap", "lab-nogap-hi")]
        + [[LENGTH_DRIFT, f"runs/ablation-{m}"] for m in ("lab-nogap", "lab-nogap-hi")]
        + [[LENGTH_DRIFT, "--summary", *(f"runs/ablation-{m}" for m in ("lab", "lab-nogap", "lab-nogap-hi")),
            "--figure", "docs/workbench.png", "--per-seed"]],
    ),
    "cispo": (
        "CISPO aggregated as MiniMax-M1 does (token-batch) and as token-agg, against ppo, 4 updates a rollout",
        ["--aggs token token-batch --losses ppo cispo --seeds 1 2 --out runs/cispo-lab -- --minibatches 4".split()],
        [[LENGTH_DRIFT, "--summary", "runs/cispo-lab", "--per-seed"]],
    ),
    "losses": (
        "The policy losses under seq, token, balanced and token-batch, 4 updates per rollout, 2 seeds",
        ["--aggs seq token balanced token-batch --losses ppo gspo cispo sapo --seeds 1 2 --out runs/losses-lab "
         "-- --minibatches 4".split()],
        [[LENGTH_DRIFT, "--summary", "runs/losses-lab", "--figure", "docs/workbench_losses.png", "--per-seed"]],
    ),
}


# figures an experiment's runs draw (evaluate.py --plot), copied where the docs show them
FIGURES = {"lab": [(f"runs/ablation-lab/{f}.png", f"docs/lab_{f}.png")
                   for f in ("figure1_accuracy", "figure2_pg_loss", "figure3_length")],
           "length-study": [("runs/ablation-lab-nogap/figure3_length.png", "docs/nogap_figure3_length.png"),
                            ("runs/ablation-lab-nogap-hi/figure3_length.png", "docs/nogap_hi_figure3_length.png")]}


def untrained(name: str) -> list[tuple[list[str], list[Path]]]:
    """Every ablation.py command (of any experiment) that writes into a run directory this experiment's tables
    read, with what of it is not there (runs not finished, its evaluated table and figures), relative to the
    project's root: what --tables-only needs, checked before the first table (a prediction runs for minutes
    before a table of the runs said that they were missing)."""
    from scripts import ablation

    tables = EXPERIMENTS[name][2]
    files = [Path(cmd[1]) / "eval_table.md" for cmd in tables if cmd[0] == "evaluate_table"]
    files += [Path(src) for src, _ in FIGURES.get(name, [])]  # ablation.py's evaluation draws them
    reads = {Path(a) for cmd in tables for a in cmd[1:] if a.startswith("runs/")} | {f.parent for f in files}
    out, seen = [], set()
    for _, ablations, _ in EXPERIMENTS.values():  # the lab's runs are read by the length study's tables too
        for a in ablations:
            planned = ablation.planned_runs(ablation.parser().parse_args(a[: a.index("--")] if "--" in a else a))
            d = planned[0].parent
            if not any(r == d or r in d.parents for r in reads):  # a table reads it, or the study folder it is in
                continue
            missing = [r for r in planned if not ablation.finished(ROOT / r)]
            if d not in seen:  # the files once, with the first command that writes into their directory
                missing += [f for f in files if f.parent == d and not (ROOT / f).exists()]
            seen.add(d)
            if missing:
                out.append((a, missing))
    return out


def check_trained(names: list[str]) -> None:
    """--tables-only: every run the tables read is trained, or one line names what is missing and the command
    that trains it."""
    lacking = [(name, a, missing) for name in names for a, missing in untrained(name)]
    if not lacking:
        return
    name = lacking[0][0]
    own = [(a, missing) for n, a, missing in lacking if n == name]
    missing = [m for _, ms in own for m in ms]
    shown = ", ".join(map(str, missing[:3])) + (", ..." if len(missing) > 3 else "")
    more = f" and {len(own) - 1} more (python -m scripts.reproduce --list)" if len(own) > 1 else ""
    others = sorted({n for n, _, _ in lacking} - {name})
    raise ValueError(f"--tables-only: {name}'s tables read {len(missing)} runs or files not there ({shown}); train "
                     f"them with `python -m scripts.ablation {' '.join(own[0][0])}`{more}"
                     + (f"; untrained too: {', '.join(others)}" if others else ""))


def run_commits(table_cmds: list[list[str]]) -> list[str]:
    """The commits the runs read by these tables were trained at (ablation.py's RUN.commit files)."""
    dirs = {Path(a) for cmd in table_cmds for a in cmd[1:] if a.startswith("runs/")}
    found = set()
    for d in dirs:
        for f in [*(ROOT / d).glob("*.commit"), *(ROOT / d).glob("*/*.commit")]:  # a study's arms: a folder each
            found.update(x.split()[0] for x in f.read_text().splitlines() if x.strip())
    return sorted(found)


def table_output(cmd: list[str]) -> str:
    if cmd[0] == "evaluate_table":  # evaluate.py's Table 1 layout, written by ablation.py's evaluation
        return (ROOT / cmd[1] / "eval_table.md").read_text().strip()
    res = subprocess.run([PY, "-m", *cmd], cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {(res.stderr or res.stdout).strip().splitlines()[-1:]}")
    return "\n".join(x for x in res.stdout.splitlines() if not x.startswith(("Loading weights", "figure:"))).strip()


def shown(cmd: list[str]) -> str:
    """A table command as its section of docs/results.md and --list show it."""
    return f"python -m {' '.join(cmd)}" if cmd[0] != "evaluate_table" else f"{cmd[1]}/eval_table.md (evaluate.py)"


def short(commit: str) -> str:
    return commit[:10] + ("+dirty" if commit.endswith("+dirty") else "")


def section(name: str) -> str:
    what, ablations, tables = EXPERIMENTS[name]
    if ablations:
        commits = run_commits(tables)
        made = f"Runs trained at commit{'s' if len(commits) > 1 else ''} {', '.join(map(short, commits)) or '-'}"
    else:  # a prediction: computed from the shipped policies by the code of this commit
        from scripts.ablation import code_commit

        made = f"Computed at commit {short(code_commit())}, no runs"
    out = [f"<!-- section {name} -->", f"## {name}: {what}", "",
           f"{made}; regenerate with `python -m scripts.reproduce {name}`.", "",
           *(["```bash", *(f"python -m scripts.ablation {' '.join(a)}" for a in ablations), "```", ""]
             if ablations else [])]
    for cmd in tables:
        out += [f"`{shown(cmd)}`", "", table_output(cmd), ""]
    return "\n".join(out) + f"<!-- end {name} -->\n"


def write_sections(names: list[str]) -> None:
    """Replace these sections of docs/results.md (the others are kept as they were)."""
    head = ("# Results\n\nEvery table the README and docs/ publish, with per-seed values, generated by "
            "`python -m scripts.reproduce` (do not edit by hand; the docs quote these sections).\n\n")
    new_sections = {name: section(name) for name in names}  # minutes; the file is read after them
    text = RESULTS.read_text() if RESULTS.exists() else head
    for name, new in new_sections.items():
        for src, dst in FIGURES.get(name, []):
            shutil.copyfile(ROOT / src, ROOT / dst)
        pattern = re.compile(rf"<!-- section {re.escape(name)} -->.*?<!-- end {re.escape(name)} -->\n", re.S)
        text = pattern.sub(lambda _: new, text) if pattern.search(text) else text + "\n" + new
    RESULTS.write_text(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiments", nargs="*", help=f"some of: {', '.join(EXPERIMENTS)} (default: all)")
    p.add_argument("--list", action="store_true", help="print the experiments' commands and stop")
    p.add_argument("--tables-only", action="store_true", help="train nothing; rewrite the sections from the runs")
    args = p.parse_args()
    unknown = [n for n in args.experiments if n not in EXPERIMENTS]
    if unknown:
        p.error(f"unknown experiment {unknown[0]!r} (choose from {', '.join(EXPERIMENTS)})")
    names = args.experiments or list(EXPERIMENTS)
    if args.list:
        for name in names:
            what, ablations, tables = EXPERIMENTS[name]
            print(f"{name}: {what}")
            for a in ablations:
                print(f"  python -m scripts.ablation {' '.join(a)}")
            for t in tables:
                print(f"  {shown(t)}")
        return
    from grpo_utils.common import first_line, writable_problem

    try:  # before hours of runs and minutes of tables, not after them
        if problem := writable_problem(RESULTS.parent):
            raise OSError(problem)
        if RESULTS.exists():
            open(RESULTS, "a").close()  # leaves it as it is
    except OSError as e:
        sys.exit(f"reproduce.py: error: {RESULTS} is not writable ({first_line(e)}): the sections and the figures go "
                 "there")
    t0 = time.time()
    if args.tables_only:
        try:
            check_trained(names)
        except ValueError as e:  # a damaged args.json too (ablation.finished)
            sys.exit(f"reproduce.py: error: {e}")
    else:
        for name in names:
            for a in EXPERIMENTS[name][1]:
                print(f"[reproduce] {name}: python -m scripts.ablation {' '.join(a)}", flush=True)
                if subprocess.run([PY, "-m", "scripts.ablation", *a], cwd=ROOT, env=os.environ).returncode != 0:
                    sys.exit(f"reproduce.py: error: {name}'s runs failed (above); rerun the same command to resume")
    try:
        write_sections(names)
    except (RuntimeError, OSError) as e:
        sys.exit(f"reproduce.py: error: {e}")
    print(f"[reproduce] {', '.join(names)}: {RESULTS} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
