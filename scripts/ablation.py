"""The paper's ablation in one command: every aggregation rule x several seeds, then Table 1 and
Figures 1-3 (mean ± std over seeds).

    python -m scripts.ablation                        # the aggregation lab on the CPU: 3 rules x 3 seeds
    python -m scripts.ablation --model lab-nogap      # the control: the same lengths, no sign-length gap
    python -m scripts.ablation --model lab-nogap-hi   # the same control, above 50% accuracy
    python -m scripts.ablation --aggs all             # every rule of train_grpo.py (docs/workbench.md's table)
    python -m scripts.ablation --losses ppo gspo cispo sapo --out runs/losses-lab -- --minibatches 4   # policy losses
    python -m scripts.ablation --model Qwen/Qwen2.5-Math-7B --seeds 1 --out runs/ablation-7b \\
        --eval-args "--benchmarks aime24,amc23,math500 --template dapo --n 8" \\
        -- --dataset BytedTsinghua-SIA/DAPO-Math-17k --template dapo    # paper scale (args after -- go to the trainer)

Each run is `deepspeed train_grpo.py --model M --agg A --seed S --output-dir OUT/M-A-sS ...` (with a
policy loss other than ppo: `--policy-loss P`, OUT/M-A-P-sS), its output in OUT/M-A-sS.log; a finished
run is skipped and an interrupted one resumes, so the same command continues an ablation that was
stopped. Then `evaluate.py --run OUT/M-*-s* --plot --out OUT` scores every checkpoint and the initial
policy, and writes OUT/eval_table.md and the figures.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project's root
# the offline policies: evaluate on the held-out sums, sampled as in training
LAB_EVAL = "--benchmarks demo-test --template plain --n 8 --temperature 1.0 --top-p 1.0 --max-tokens 48"
# A rule's own trainer flags. Dr. GRPO (arXiv 2503.20783) is two changes: the constant normaliser
# (--agg dr-grpo) and advantages not divided by the group's std; verl and TRL keep them as two
# switches, as the trainer does, so the ablation's `dr-grpo` sets both.
RULE_ARGS = {"dr-grpo": ["--no-std-norm"]}
# The trainer flags the ablation sets per run (train_args, RULE_ARGS), with where to give them instead: after --
# they would come later on the trainer's command line and win, so that every run trained that one setting under
# its own name (`-- --agg token`: three "rules", all token).
PER_RUN = {"model": "give the policy with --model", "agg": "give rules with --aggs",
           "policy_loss": "give policy losses with --losses",
           "seed": "give seeds with --seeds", "output_dir": "give the ablation's directory with --out (each run goes "
           "to OUT/MODEL-AGG-sSEED)",
           "eval_dataset": "the runs leave held-out evaluation to evaluate.py: give its flags with --eval-args",
           "no_std_norm": "it would change every rule; the ablation's dr-grpo already sets it (Dr. GRPO)"}


def code_commit() -> str:
    """The commit of the code that trains a run ("+dirty" with uncommitted changes to tracked files)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "HEAD")
    return (sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")) if sha else "unknown"


def train_args(model: str, agg: str, loss: str, seed: int, run: Path, extra: list[str]) -> list[str]:
    """One run's trainer arguments: the setting, the rule's own flags (RULE_ARGS), then the user's."""
    return ["--model", model, "--agg", agg, "--policy-loss", loss, "--seed", str(seed), "--output-dir", str(run),
            "--eval-dataset", "", *RULE_ARGS.get(agg, []), *extra]


def rule_args(model: str, agg: str, extra: list[str] | None = None) -> argparse.Namespace:
    """The trainer's arguments of this ablation's run of `agg` on `model` with the trainer flags `extra` (parsed
    by the trainer itself): what a prediction assumes where no run has recorded them."""
    import train_grpo

    return train_grpo.parse_args(train_args(model, agg, "ppo", 1, Path("prediction"), extra or []))


def finished(run: Path) -> bool:
    """The run's last checkpoint is its final step; a damaged args.json is named in one line (ValueError), not
    taken for a run to train again."""
    from grpo_utils.checkpoints import checkpoint_dirs
    from grpo_utils.run_dir import read_args_json

    steps = (read_args_json(run) or {}).get("steps")
    return [c.name for c in checkpoint_dirs(run / "checkpoints")][-1:] == [f"step_{steps:06d}"] \
        if isinstance(steps, int) else False


def parser() -> argparse.ArgumentParser:
    """ablation.py's own flags (those before --)."""
    import train_grpo

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="lab", help="'lab', 'lab-nogap(-hi)', 'demo', a checkpoint or a hub id")
    p.add_argument("--aggs", nargs="+", default=["seq", "token", "balanced"], choices=train_grpo.AGGS + ["all"],
                   help="aggregation rules ('all': every rule)")
    p.add_argument("--losses", nargs="+", default=["ppo"], choices=list(train_grpo.POLICY_LOSS_DEFAULTS),
                   help="policy losses, each with every rule")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--nproc", type=int, default=None, help="ranks per run (default: GPUs, or 2 on the CPU)")
    p.add_argument("--out", default=None, help="default runs/ablation-MODEL")
    p.add_argument("--eval-args", default=None, help=f"evaluate.py's arguments (offline policies: {LAB_EVAL!r})")
    p.add_argument("--no-eval", action="store_true", help="train only (compare_rules.py reads the training logs)")
    return p


def run_dir(out: Path, model: str, agg: str, loss: str, seed: int) -> Path:
    """One run's directory: OUT/M-A-sS, with a policy loss other than ppo OUT/M-A-P-sS."""
    return out / f"{Path(model).name}-{agg}{'' if loss == 'ppo' else '-' + loss}-s{seed}"


def planned_runs(args: argparse.Namespace) -> list[Path]:
    """Every run directory of these ablation.py flags (parser()), in the order they train (seeds outermost)."""
    import train_grpo

    aggs = train_grpo.AGGS if "all" in args.aggs else args.aggs
    out = Path(args.out or f"runs/ablation-{Path(args.model).name}")
    return [run_dir(out, args.model, agg, loss, seed) for seed in args.seeds for loss in args.losses for agg in aggs]


def main() -> None:
    argv = sys.argv[1:]
    train_extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    import train_grpo

    p = parser()
    args = p.parse_args(argv)
    for flag, values in (("--aggs", args.aggs), ("--losses", args.losses), ("--seeds", args.seeds)):
        if twice := next((v for v in values if values.count(v) > 1), None):  # one run trained, listed twice
            p.error(f"{flag} names {twice} twice; give each once")
    planned = planned_runs(args)
    if "all" in args.aggs:
        args.aggs = train_grpo.AGGS
    # read as the trainer reads them (flags_given), so that `--agg=token` and an abbreviation count too
    for k in (k for k in PER_RUN if k in train_grpo.parse_args(train_extra).flags_given):
        p.error(f"--{k.replace('_', '-')} after -- would override what the ablation sets per run: {PER_RUN[k]}")
    import torch

    cuda = torch.cuda.is_available()
    nproc = args.nproc if args.nproc is not None else (torch.cuda.device_count() if cuda else 2)
    out = Path(args.out or f"runs/ablation-{Path(args.model).name}")
    from data.demo import TASKS

    offline = args.model in TASKS
    try:
        eval_args = shlex.split(args.eval_args if args.eval_args is not None else LAB_EVAL if offline else "--n 8")
    except ValueError as e:  # an unclosed quote
        p.error(f"--eval-args {args.eval_args!r}: {e}")
    env = dict(os.environ, **({} if cuda else {"DS_ACCELERATOR": "cpu"}))
    if nproc < 1:
        p.error(f"--nproc must be at least 1 (got {nproc})")
    if out.exists() and not out.is_dir():
        p.error(f"--out {out} is a file; give a directory (each run's output goes inside it)")
    # every run's and the evaluation's arguments checked before the first run starts (argparse
    # errors exit here with their own one-line message)
    import evaluate
    from grpo_utils.distributed import free_port
    from grpo_utils.flags import check_args

    settings = [(agg, loss) for loss in args.losses for agg in args.aggs]
    try:
        for agg, loss in settings:
            for seed in args.seeds:
                trial = train_grpo.parse_args(train_args(args.model, agg, loss, seed, out / "check", train_extra))
                check_args(trial, nproc, train_grpo.POLICY_LOSS_DEFAULTS[loss], train_grpo.OFFLINE_DEFAULTS)
            train_grpo.deepspeed_config(trial, nproc)
        evaluate.parse_args(["--run", str(out), *eval_args])
        evaluate.check_writable(out, "every run and the table go there; give another --out")
        for run in planned:  # a damaged args.json named now, not after the runs before it have trained
            finished(run)
    except ValueError as e:
        sys.exit(f"ablation.py: error: {e}")

    t_all, runs = time.time(), []
    for seed in args.seeds:
        for agg, loss in settings:
            run = run_dir(out, args.model, agg, loss, seed)
            runs.append(run)
            if finished(run):
                print(f"[ablation] {run.name}: already trained", flush=True)
                continue
            t0 = time.time()
            with open(out / f"{run.name}.commit", "a") as f:  # the code of every launch (a resume may differ)
                f.write(code_commit() + "\n")
            # the trainer's own held-out evaluation is left to evaluate.py (every checkpoint, all seeds)
            cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nproc),
                   "--master_port", str(free_port()), "train_grpo.py",
                   *train_args(args.model, agg, loss, seed, run, train_extra)]
            with open(out / f"{run.name}.log", "a") as log:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0 or not finished(run):
                tail = (out / f"{run.name}.log").read_text().splitlines()[-5:]
                sys.exit("\n".join(tail) + f"\nablation.py: error: {run.name} failed (exit {rc}); "
                         f"its output is in {out / (run.name + '.log')}; rerun the same command to resume")
            print(f"[ablation] {run.name}: trained in {time.time() - t0:.0f} s", flush=True)
    t_train = time.time() - t_all
    if args.no_eval:
        print(f"[ablation] training {t_train:.0f} s; runs in {out}/ (compare_rules.py {out})")
        return

    t0 = time.time()
    cmd = [sys.executable, "evaluate.py", "--run", *map(str, runs), "--plot", "--out", str(out), *eval_args]
    rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out / "evaluate.log").write_text(rc.stdout)
    if rc.returncode != 0:
        sys.exit("\n".join(rc.stdout.splitlines()[-5:]) + f"\nablation.py: error: evaluation failed; "
                 f"see {out}/evaluate.log; rerun the same command to resume")
    print((out / "eval_table.md").read_text(), end="")
    t_eval = time.time() - t0
    print(f"[ablation] training {t_train:.0f} s, evaluation {t_eval:.0f} s, total {time.time() - t_all:.0f} s")
    print(f"[ablation] table and figures in {out}/ (eval_table.md, figure1_accuracy.png, figure2_pg_loss.png, "
          "figure3_length.png)")


if __name__ == "__main__":
    main()
