"""Is an aggregation rule length-neutral? Each rule's expected push on the stopping decision, next to
the length drift it produced in training (docs/lab.md, "Is balanced aggregation length-neutral?").

    python -m scripts.length_drift runs/ablation-lab-nogap-hi        # an ablation.py output directory
    python -m scripts.length_drift --model lab-nogap-hi --simulate   # before training: the initial policy alone
    python -m scripts.length_drift --model lab --predict             # every rule's coupling and push, before training
    python -m scripts.length_drift --summary runs/ablation-lab runs/ablation-lab-nogap runs/ablation-lab-nogap-hi \
        --figure docs/workbench.png                          # docs/workbench.md's side-by-side table and figure

The model. A policy that stops at position t with probability h_t (one logit per position) gets,
from an on-policy GRPO step with weights w_i and advantages A_i, the gradient
    g_t = sum_i w_i A_i ([L_i = t] - h_t [L_i >= t])
on the logit of stopping at t; summed over t, the push towards stopping (positive: shorter) is
    push = sum_i w_i A_i (1 - H(L_i)),   H(L) = sum_{t <= L} h_t,
with w_i from train_grpo.aggregation_weights (the trainer's own rules) and h_t the empirical hazard
of the lengths at hand. When lengths are independent of rewards, E[push] = 0 for seq and token
(A_i is independent of every length and sums to 0 per group); balanced normalises each sign subset
by its own mean length, whose inverse is larger in expectation for the smaller subset (Jensen).

The data. evaluate.py caches, for every checkpoint of every run, n samples per held-out prompt at
the training temperature (ablation.py: n = 8 = G): groups of the policy's own responses. For each
checkpoint this prints the push of every rule on those groups as they are, and in expectation with
the lengths shuffled across the checkpoint's responses (length independent of reward: the rule's own
term), next to the training metrics of the runs (mean response length, accuracy) at that step.

The coupling (the paper's Figure 2). On-policy, every policy loss's token term is -A_i, so the
aggregated pg loss of a step is -sum_i w_i A_i L_i: 0 for rules whose weights balance a group's signs
(seq, balanced), positive where longer failures carry more weight. `--predict` prints it per rule,
with the sum rules' scale divided out (-sum w A L / sum w L, the token-weighted mean of -A: Adam
removes a rule's overall scale, not how it weighs one token against another), next to the push.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import torch

from scripts.ablation import rule_args
from train_grpo import AGGS as RULES

ROOT = Path(__file__).resolve().parent.parent  # the project's root

def run_args(run: Path, required: tuple[str, ...] = ()) -> argparse.Namespace:
    """The trainer's arguments a run recorded (run_dir.recorded_args)."""
    import train_grpo
    from grpo_utils.run_dir import recorded_args

    return recorded_args(run, train_grpo.parse_args([]), required)


def in_groups_of(args: argparse.Namespace, n: int) -> argparse.Namespace:
    """The run's arguments for samples drawn n per prompt (evaluate.py's --n) instead of G."""
    return argparse.Namespace(**{**vars(args), "group_size": n})


def rule_weights(adv: torch.Tensor, lengths: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """The trainer's weights (aggregation_weights with the run's arguments) on mini-batches of the run's
    size, scaled so that a sum over all responses is the mean over mini-batches of each one's sum."""
    from train_grpo import aggregation_weights

    size, L = args.prompts_per_step // args.minibatches * args.group_size, lengths.long()
    return torch.cat([aggregation_weights(adv[i : i + size], L[i : i + size], args.group_size, args.agg,
                                          max_len=args.max_response_len) * len(adv[i : i + size])
                      for i in range(0, len(L), size)]) / len(L)


def hazard_push(rewards: torch.Tensor, lengths: torch.Tensor, args: argparse.Namespace,
                population: torch.Tensor | None = None) -> float:
    """sum_i w_i A_i (1 - H(L_i)) per group (groups: consecutive runs of args.group_size responses), with
    the hazard of the `population` lengths (default: these), and the advantages and weights the trainer
    computes with the run's arguments `args`."""
    from train_grpo import advantages

    L, pop = lengths.long(), (lengths if population is None else population).long()
    counts = torch.bincount(pop, minlength=int(max(L.max(), pop.max())) + 1).double()
    at_risk = counts.flip(0).cumsum(0).flip(0)  # #{L >= t}
    cum_hazard = (counts / at_risk.clamp(min=1)).cumsum(0)
    adv = advantages(rewards.double(), args)
    w = rule_weights(adv, L, args)
    return float((w * adv * (1 - cum_hazard[L])).sum())


def loss_scale(rewards: torch.Tensor, lengths: torch.Tensor, args: argparse.Namespace) -> float:
    """sum_i w_i L_i of a step: 1 for the rules that take a mean of token terms, L-bar for seq-sum."""
    from train_grpo import advantages

    return float((rule_weights(advantages(rewards.double(), args), lengths, args) * lengths).sum())


def coupling(rewards: torch.Tensor, lengths: torch.Tensor, args: argparse.Namespace) -> tuple[float, float]:
    """(the on-policy pg loss of a step, -sum_i w_i A_i L_i; the same over loss_scale)."""
    from train_grpo import advantages

    adv = advantages(rewards.double(), args)
    loss = float(-(rule_weights(adv, lengths, args) * adv * lengths).sum())
    return loss, loss / loss_scale(rewards, lengths, args)


def shuffled_push(rewards: torch.Tensor, lengths: torch.Tensor, args: argparse.Namespace, draws: int = 200) -> float:
    """E[push] with the lengths permuted across all responses: length independent of reward."""
    g = torch.Generator().manual_seed(0)
    return sum(hazard_push(rewards, lengths[torch.randperm(len(lengths), generator=g)], args, lengths)
               for _ in range(draws)) / draws


def simulated_push(lengths: torch.Tensor, accuracy: float, args: argparse.Namespace, groups: int = 64_000) -> float:
    """E[push] per group for binary rewards ~ Bernoulli(accuracy) and lengths drawn from `lengths`."""
    g = torch.Generator().manual_seed(0)
    r = (torch.rand(groups * args.group_size, generator=g) < accuracy).double()
    L = lengths[torch.randint(len(lengths), (groups * args.group_size,), generator=g)]
    return hazard_push(r, L, args, population=lengths)


def checkpoint_samples(ckpt: str, eval_args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rewards, lengths, n) of a checkpoint's cached samples: lengths in tokens with the EOS."""
    from transformers import AutoTokenizer

    from evaluate import cache_dir

    files = sorted(cache_dir(ckpt, eval_args).glob("*.samples*.jsonl"))
    rows = [json.loads(x) for f in files for x in f.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "responses" in r]
    if not rows:
        raise ValueError(f"{ckpt}: no cached samples (run evaluate.py on it with the same settings first)")
    tok = AutoTokenizer.from_pretrained(ckpt)
    texts = [t for r in rows for t in r["responses"]]
    lengths = torch.tensor([len(x) + 1 for x in tok(texts, add_special_tokens=False)["input_ids"]])
    rewards = torch.tensor([s for r in rows for s in r["scores"]], dtype=torch.float64)
    return rewards, lengths, len(rows[0]["scores"])


def training_metric(runs: list[Path], key: str, step: int) -> list[float]:
    """The runs' logged `key` at the rollout of `step` (metrics.jsonl), one value per run."""
    from grpo_utils.run_dir import run_metrics

    return [m[key] for m in (run_metrics(run).get(step, {}) for run in runs) if key in m]


def mean_std(xs: list[float], digits: int = 1, sign: bool = False) -> str:
    """Mean ± sample standard deviation over seeds, as every table prints it ("-" for none)."""
    if not xs:
        return "-"
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)) ** 0.5
    return f"{m:{'+' if sign else ''}.{digits}f} ± {sd:.{digits}f}"


def setting_runs(ablation: Path) -> dict[tuple[str, str], list[Path]]:
    """An ablation directory's runs by (rule, policy loss), in the trainer's order of the rules."""
    out = defaultdict(list)
    for agg, runs in ablation_runs(str(ablation)).items():
        for run in runs:
            out[(agg, run_args(run).policy_loss)].append(run)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][1] != "ppo", kv[0][1], RULES.index(kv[0][0]))))


def scale_free(metrics: dict, args: argparse.Namespace) -> float:
    """A step's loss/pg over its total token weight sum_i w_i L_i, as the trainer logs it (loss/token_weight:
    L-bar for seq-sum, L-bar / L_max for dr-grpo, 1 for the rules that take a mean of token terms). A step logged
    before that metric: the trainer's weights give it where they make it a function of the mean length alone;
    else one line."""
    if "loss/token_weight" in metrics:
        return metrics["loss/pg"] / metrics["loss/token_weight"]
    return metrics["loss/pg"] / mean_length_scale(metrics["length/mean"], args)


def mean_length_scale(mean_length: float, args: argparse.Namespace) -> float:
    """sum_i w_i L_i of the run's rule (the trainer's aggregation_weights, one group) on responses of
    `mean_length` tokens, checked on lengths spread around that mean: a rule whose sum depends on more than the
    mean is refused in one line."""
    from train_grpo import aggregation_weights

    G = args.group_size
    adv = torch.tensor([(-1.0) ** i for i in range(G)], dtype=torch.float64)  # both signs, as a mixed group
    scale = []
    for spread in (0.0, 0.5):  # every length the mean; then from 0.5x to 1.5x it, the same mean
        L = float(mean_length) * (1 + spread * torch.linspace(-1, 1, G, dtype=torch.float64))
        scale.append(float((aggregation_weights(adv, L, G, args.agg, max_len=args.max_response_len) * L).sum()))
    if abs(scale[0] - scale[1]) > 1e-6 * abs(scale[0]):
        raise ValueError(f"--agg {args.agg}: its loss's scale sum_i w_i L_i depends on more than the mean length, "
                         "and this run's metrics.jsonl predates loss/token_weight: retrain it to log the scale")
    return scale[0]


def summary(ablations: list[Path], eval_args: argparse.Namespace, figure: Path | None, per_seed: bool = False) -> None:
    """docs/workbench.md's side-by-side table: per rule (and policy loss), mean ± std over seeds, of the lab's
    coupling (loss/pg over steps 1-5, raw and scale-free), each task's mean length over steps 36-40,
    the controls' push (lengths shuffled, scale-free, mean over the run's checkpoints) and each task's
    Acc@8 at the peak and the last checkpoint."""
    import evaluate

    def acc(run: Path) -> tuple[float, float, dict[int, float]]:  # evaluate.py's results cached per checkpoint
        per_step = {s: json.loads((evaluate.cache_dir(c, eval_args) / "results.json").read_text())["results"]
                    for s, c in evaluate.run_checkpoints(str(run))}
        pl = evaluate.peak_and_last(per_step, eval_args.n)
        at = {s: 100 * r["average"][f"acc@{eval_args.n}"] for s, r in per_step.items()}
        return (*(100 * pl[k][1]["average"][f"acc@{eval_args.n}"] for k in ("peak", "last")), at)

    def steps(run: Path) -> dict[int, dict]:
        from grpo_utils.run_dir import run_metrics

        return {s: m for s, m in run_metrics(run).items() if "loss/pg" in m}

    tasks = {Path(a).name.split("-", 1)[1] if "-" in Path(a).name else Path(a).name: setting_runs(Path(a))
             for a in ablations}
    check_steps([run for runs in tasks.values() for group in runs.values() for run in group])
    settings = list(dict.fromkeys(k for runs in tasks.values() for k in runs))
    losses = len({loss for _, loss in settings}) > 1  # then also the share of tokens each loss clips
    head = ["rule"]
    for task in tasks:
        head += ([f"{task}: pg loss, steps 1-5", "scale-free", "scale-free, step 1"] if "nogap" not in task
                 else [f"{task}: push x1000"])
        head += [f"{task}: length, steps 36-40", f"{task}: Acc@8 peak / last"]
        head += [f"{task}: clip fraction, steps 1-40"] if losses else []
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    curves, seed_rows, clip_rows, coupling_rows, acc_rows = defaultdict(dict), [], [], [], {}
    clip = json.loads((ROOT / "ds_config.json").read_text())["gradient_clipping"]  # what every run clips at
    for agg, loss in settings:
        cells = [agg if loss == "ppo" else f"{agg}, {loss}"]
        for task, by_setting in tasks.items():
            runs = by_setting.get((agg, loss), [])
            if not runs:
                cells += ["-"] * ((3 if "nogap" in task else 5) + losses)
                continue
            per_run, run_argss = [steps(r) for r in runs], [run_args(r) for r in runs]
            seeds = [a.seed for a in run_argss]
            if "nogap" not in task:
                first = [sum(scale_free(m[s], a) for s in range(1, 6)) / 5 for m, a in zip(per_run, run_argss)]
                cells.append(mean_std([sum(m[s]["loss/pg"] for s in range(1, 6)) / 5 for m in per_run], 4, True))
                cells.append(mean_std(first, 4, True))
                cells.append(mean_std([scale_free(m[1], a) for m, a in zip(per_run, run_argss)], 4, True))  # step 1
            else:
                pushes = []
                for run, a in zip(runs, run_argss):
                    samples = [checkpoint_samples(c, eval_args) for _, c in evaluate.run_checkpoints(str(run))]
                    pushes.append(sum(1000 * shuffled_push(r, L, in_groups_of(a, n), draws=20)
                                      / loss_scale(r, L, in_groups_of(a, n)) for r, L, n in samples) / len(samples))
                cells.append(mean_std(pushes, 2, True))
            norms = [m[s]["loss/grad_norm"] for m in per_run for s in m if s > 0]
            clip_rows.append(f"| {task} | {cells[0]} | {sum(norms) / len(norms):.3f} | "
                             f"{sum(x > clip for x in norms)} / {len(norms)} |")
            gap = [[m[s]["length/pos_neg_gap"] for m in per_run] for s in (1, *range(36, 41))]
            coupling_rows.append(
                f"| {task} | {cells[0]} | {mean_std(gap[0])} | {mean_std([sum(g) / 5 for g in zip(*gap[1:])])} | "
                f"{mean_std([m[1]['length/cv'] for m in per_run], 2)} | "
                f"{max(abs(m[s]['loss/pg']) for m in per_run for s in m):.1e} |")
            late = [sum(m[s]["length/mean"] for s in range(36, 41)) / 5 for m in per_run]
            cells.append(mean_std(late))
            peaks_lasts = [acc(r) for r in runs]
            for k, seed in enumerate(seeds):
                signal = f"{first[k]:+.4f}" if "nogap" not in task else f"{pushes[k]:+.2f}"
                seed_rows.append(f"| {task} | {cells[0]} | {seed} | {signal} | {late[k]:.1f} | "
                                 f"{peaks_lasts[k][0]:.1f} / {peaks_lasts[k][1]:.1f} |")
            cells.append(f"{mean_std([p for p, _, _ in peaks_lasts])} / {mean_std([x for _, x, _ in peaks_lasts])}")
            at = [a for _, _, a in peaks_lasts]
            points = sorted(set.intersection(*map(set, at)))
            acc_rows[(task, cells[0])] = {s: mean_std([a[s] for a in at]) for s in points}
            if losses:
                cells.append(mean_std([sum(m[s]["loss/clip_frac"] for s in m if s > 0) / (len(m) - (0 in m))
                                  for m in per_run], 3))
            for key in ("loss/pg", "length/mean"):
                curves[(task, key)][(agg, loss)] = [[scale_free(m[s], a) if key == "loss/pg" else m[s][key]
                                                     for s in sorted(m)] for m, a in zip(per_run, run_argss)]
        print("| " + " | ".join(cells) + " |")
    if per_seed:
        ses = []  # the evaluation's own noise: Acc@n's standard error over the held-out prompts, last checkpoint
        for runs in tasks.values():
            for group in runs.values():
                for run in group:
                    r, _, n = checkpoint_samples(evaluate.run_checkpoints(str(run))[-1][1], eval_args)
                    per_prompt = r.view(-1, n).mean(1)
                    ses.append(100 * float(per_prompt.std() / len(per_prompt) ** 0.5))
        print(f"\nThe evaluation's own noise: Acc@{eval_args.n}'s standard error over the held-out prompts (the "
              f"spread of their pass fractions / sqrt(prompts)) at a run's last checkpoint, {min(ses):.1f} to "
              f"{max(ses):.1f} points; a peak is a maximum over checkpoints, biased upward by about that much.")
        print("\nPer seed: the lab's scale-free pg loss over steps 1-5 (a control's push x1000), the mean length over "
              f"steps 36-40, Acc@{eval_args.n} at the peak / last checkpoint\n")
        print("| task | rule | seed | pg loss or push | length | Acc peak / last |\n|---|---|---|---|---|---|")
        print("\n".join(seed_rows))
        print(f"\nThe gradient's norm before the clip at {clip} (ds_config.json's gradient_clipping): its mean over "
              "the steps of every seed, and the steps whose norm passed the clip\n")
        print("| task | rule | grad norm, mean | steps clipped |\n|---|---|---|---|")
        print("\n".join(clip_rows))
        print("\nThe coupling's condition and its loss: the failures' extra length (neg - pos, tokens, mixed groups) "
              "at step 1 and over steps 36-40 and the within-group length CV at step 1 (mean ± std over seeds), and "
              "the largest |pg loss| of any step of any seed\n")
        print("| task | rule | neg-pos gap, step 1 | neg-pos gap, steps 36-40 | length CV, step 1 | max abs pg loss |\n"
              "|---|---|---|---|---|---|")
        print("\n".join(coupling_rows))
        points = sorted(set.intersection(*(set(r) for r in acc_rows.values())))
        print(f"\nAcc@{eval_args.n} at every checkpoint (mean ± std over seeds)\n")
        print("| task | rule | " + " | ".join(f"step {s}" for s in points) + " |\n|---|---|" + "---|" * len(points))
        print("\n".join(f"| {task} | {rule} | " + " | ".join(r[s] for s in points) + " |"
                        for (task, rule), r in acc_rows.items()))
    if figure is not None:
        plot_summary(curves, list(tasks), figure)


def seed_band(ax, runs: list[list[float]], color: str, label: str, style: str = "-") -> None:
    """A per-step curve over seeds: its mean as a line, ± its sample std as a band (steps all runs have)."""
    n = min(map(len, runs))
    mean = [sum(r[k] for r in runs) / len(runs) for k in range(n)]
    sd = [(sum((r[k] - mean[k]) ** 2 for r in runs) / max(1, len(runs) - 1)) ** 0.5 for k in range(n)]
    x = list(range(1, n + 1))
    ax.plot(x, mean, style, color=color, label=label)
    ax.fill_between(x, [m - e for m, e in zip(mean, sd)], [m + e for m, e in zip(mean, sd)], color=color, alpha=0.12)


def plot_summary(curves: dict, tasks: list[str], path: Path) -> None:
    """The lab's scale-free pg loss and every task's mean response length per step, mean ± std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, "loss/pg") for t in tasks if "nogap" not in t] + [(t, "length/mean") for t in tasks]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), squeeze=False)
    for ax, (task, key) in zip(axes[0], panels):
        for i, ((agg, loss), runs) in enumerate(curves[(task, key)].items()):
            seed_band(ax, runs, f"C{i}", agg if loss == "ppo" else f"{agg}, {loss}",
                      "--" if agg in ("dr-grpo", "seq-sum") else "-")
        title = "pg loss / total token weight" if key == "loss/pg" else "mean response length (tokens)"
        ax.set(title=f"{task}: {title}", xlabel="step")
        if key == "loss/pg":
            ax.axhline(0, color="grey", linewidth=0.8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"figure: {path}")


def main() -> None:
    from scripts.ablation import LAB_EVAL

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ablation", nargs="?", help="an ablation.py output directory (runs MODEL-AGG-sSEED inside)")
    p.add_argument("--model", help="with --simulate: the policy whose cached samples give the lengths")
    p.add_argument("--simulate", action="store_true", help="E[push] at accuracies 0.1..0.9 over the lengths")
    p.add_argument("--predict", action="store_true", help="every rule's coupling and push on the policy's samples")
    p.add_argument("--rules", nargs="+", choices=RULES, default=None, help="with --model: these rules, in this "
                   "order (default: every rule of the trainer's; scripts/reproduce.py pins a published experiment's)")
    p.add_argument("--summary", nargs="+", help="ablation directories: docs/workbench.md's side-by-side table")
    p.add_argument("--figure", help="with --summary: write its figure here (.png)")
    p.add_argument("--per-seed", action="store_true", help="with --summary: every run's values too")
    p.add_argument("--eval-args", default=LAB_EVAL, help="evaluate.py settings the samples were cached with")
    args = p.parse_args()
    if sum(x is not None for x in (args.ablation, args.model, args.summary)) != 1:
        p.error("give an ablation directory, --model or --summary")
    if (args.simulate or args.predict) and not args.model:
        p.error("--simulate and --predict go with --model")
    if args.figure and not args.summary:
        p.error("--figure goes with --summary")
    if args.rules and not args.model:
        p.error("--rules goes with --model (an ablation's tables show the rules its runs trained)")
    args.rules = args.rules or RULES
    if twice := next((r for r in args.rules if args.rules.count(r) > 1), None):  # else its columns printed twice
        p.error(f"--rules names {twice} twice; give each rule once")
    import evaluate

    try:
        eval_args = shlex.split(args.eval_args)
    except ValueError as e:  # an unclosed quote
        p.error(f"--eval-args {args.eval_args!r}: {e}")
    ev = evaluate.parse_args(["--run", "x", *eval_args])  # its errors: one line, exit 2
    try:
        if args.figure:  # before the tables' minutes, not after them
            if Path(args.figure).is_dir():
                raise ValueError(f"--figure {args.figure} is a directory; give a .png file")
            evaluate.check_writable(Path(args.figure).parent, "the --figure goes there")
        report(args, ev)
    except (ValueError, OSError) as e:
        from grpo_utils.common import first_line

        sys.exit(f"length_drift.py: error: {first_line(e)}")


def ablation_runs(ablation: str) -> dict[str, list[Path]]:
    """An ablation directory's runs (MODEL-AGG-sSEED, each with its args.json) by rule; never none."""
    if not Path(ablation).is_dir():
        raise ValueError(f"{ablation}: no such directory (give an ablation.py --out directory)")
    by_agg = defaultdict(list)
    from grpo_utils.run_dir import read_args_json

    for run in sorted(p for p in Path(ablation).iterdir() if read_args_json(p) is not None):
        agg = run_args(run, required=("agg",)).agg
        if agg not in RULES:
            raise ValueError(f"{run / 'args.json'}: no 'agg' of train_grpo.py's rules (not the trainer's args.json)")
        by_agg[agg].append(run)
    if not by_agg:
        raise ValueError(f"{ablation}: no training runs in it (directories with an args.json, as ablation.py writes)")
    return by_agg


TABLE_STEPS = 40  # the tables read steps 1-5 and 36-40: the lab's --steps


def check_steps(runs: list[Path]) -> None:
    """Every run has logged the training steps the tables read; else one line naming the first that has not."""
    from grpo_utils.run_dir import run_metrics

    for run in runs:
        logged = {step for step, m in run_metrics(run).items() if "length/mean" in m}
        missing = [s for s in range(1, TABLE_STEPS + 1) if s not in logged]
        if missing:
            raise ValueError(f"{run}: metrics.jsonl has no step {missing[0]} ({len(logged)} training steps logged); "
                             f"the tables read steps 1-{TABLE_STEPS}, the lab's --steps: finish the run (the same "
                             "ablation.py command resumes it)")


def report(args: argparse.Namespace, ev: argparse.Namespace) -> None:
    import evaluate

    if args.summary:
        summary([Path(a) for a in args.summary], ev, Path(args.figure) if args.figure else None, args.per_seed)
        return
    if args.model and args.predict:
        from data.demo import model_dir

        rewards, lengths, n = checkpoint_samples(model_dir(args.model), ev)
        print(f"{args.model}: accuracy {rewards.mean():.3f}, mean length {lengths.double().mean():.1f} "
              f"({len(lengths)} samples, groups of {n}, each rule's arguments as the ablation trains it)\n")
        print("| rule | sum w L | coupling: pg loss at step 1 | scale-free | push x1000, as sampled | "
              "push x1000, lengths shuffled |\n|---|---|---|---|---|---|")
        for agg in args.rules:  # scale-free: over sum w L, a step's total token weight (1 for the mean rules)
            a = in_groups_of(rule_args(args.model, agg), n)
            (loss, share), total = coupling(rewards, lengths, a), loss_scale(rewards, lengths, a)
            print(f"| {agg} | {total:.3g} | {loss:+.4f} | {share:+.4f} | "
                  f"{1000 * hazard_push(rewards, lengths, a) / total:+.2f} | "
                  f"{1000 * shuffled_push(rewards, lengths, a, draws=50) / total:+.2f} |")
        return
    if args.model:
        from data.demo import model_dir

        rewards, lengths, n = checkpoint_samples(model_dir(args.model), ev)
        print(f"{args.model}: accuracy {rewards.mean():.3f}, mean length {lengths.double().mean():.1f}, "
              f"length CV {lengths.double().std() / lengths.double().mean():.2f} ({len(lengths)} samples)")
        print("| accuracy | " + " | ".join(args.rules) + " |\n|---|" + "---|" * len(args.rules))
        for acc in (0.1, 0.22, 0.3, 0.5, 0.7, 0.78, 0.9):
            pushes = [simulated_push(lengths, acc, in_groups_of(rule_args(args.model, a), n)) for a in args.rules]
            print(f"| {acc:.2f} | " + " | ".join(f"{p:+.4f}" for p in pushes) + " |")
        return

    by_agg = ablation_runs(args.ablation)
    check_steps([run for group in by_agg.values() for run in group])
    # every checkpoint's cached samples first: a run without them stops here, before any table is printed
    samples = {run: [(step, checkpoint_samples(ckpt, ev)) for step, ckpt in evaluate.run_checkpoints(str(run))]
               for group in by_agg.values() for run in group}
    steps = [1, 5, 10, 20, 30, 40]
    print(f"{args.ablation}: mean response length of the training rollouts (mean ± std over seeds)\n")
    print("| rule | " + " | ".join(f"step {s}" for s in steps) + " | steps 36-40 |\n|---|" + "---|" * (len(steps) + 1))
    for agg, group in by_agg.items():
        late = [sum(training_metric([run], "length/mean", s)[0] for s in range(36, 41)) / 5 for run in group]
        print(f"| {agg} | " + " | ".join(mean_std(training_metric(group, "length/mean", s)) for s in steps)
              + f" | {mean_std(late)} |")
    print(f"\n{args.ablation}: push towards stopping (x1000; + shorter, - longer) on each checkpoint's cached groups, "
          "as sampled / with lengths shuffled; training length and accuracy at that step (mean ± std over seeds)\n")
    print("| rule | step | accuracy | mean length | push as sampled | push, lengths shuffled | "
          "train length (next rollout) | train accuracy |\n|---|---|---|---|---|---|---|---|")
    for agg, group in by_agg.items():
        per_step = defaultdict(list)
        for run in group:
            recorded = run_args(run)
            for step, (r, L, n) in samples[run]:
                per_step[step].append((r, L, in_groups_of(recorded, n)))
        for step, at_step in sorted(per_step.items()):
            acc = [float(r.mean()) for r, _, _ in at_step]
            mean_len = [float(L.double().mean()) for _, L, _ in at_step]
            push = [1000 * hazard_push(r, L, a) for r, L, a in at_step]
            shuf = [1000 * shuffled_push(r, L, a, draws=50) for r, L, a in at_step]
            train_len = training_metric(group, "length/mean", step + 1)
            train_acc = [100 * x for x in training_metric(group, "reward/accuracy", step + 1)]
            print(f"| {agg} | {step} | {mean_std([100 * a for a in acc])} | {mean_std(mean_len)} | "
                  f"{mean_std(push)} | {mean_std(shuf)} | {mean_std(train_len)} | {mean_std(train_acc)} |")


if __name__ == "__main__":
    main()
