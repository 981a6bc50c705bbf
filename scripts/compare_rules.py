"""Does the aggregation rule change what is learned? A prediction from the formulas, then paired seeds
and a test declared before the runs (docs/lab.md, "Can the coupling cost accuracy?").

    python -m scripts.compare_rules --predict lab-check          # before any run: each rule's first-step gain
    python -m scripts.compare_rules runs/compare-lab-check       # after: the paired comparison, per seed
    python -m scripts.compare_rules --factorial runs/factorial   # token vs balanced x the failures' length gap

The prediction. On the initial policy, sample steps of 32 prompts x G=8 (the lab's), weigh them by
each rule (train_grpo.aggregation_weights; on-policy every policy loss's token term has the gradient
-A grad log pi), clip the gradient at 1.0 and take Adam's first step (lr 2e-4: lr g / (|g| + eps),
as the trainer's first update), and measure the exact change of J, the probability of a right answer
on the 200 held-out prompts (summed over the task's right responses). The mean over steps is the rule's
expected first-step gain: which rules learn faster, and by how much, before training moves the policy.

The comparison. Every rule runs with the same seeds; a seed fixes the prompts of every step and the
sampling of step 1, so step 1's rollouts are the same across rules (checked: step 1's accuracy and mean
length must agree). The measure, declared before the runs: the area under the training-accuracy
curve, the mean of `reward/accuracy` over steps 1..T (the run's --steps). Per seed s and rule a,
d_s = M(a, s) - M(reference, s); a two-sided paired t-test on the d_s (n - 1 degrees of freedom), with
Holm's correction over the rules compared with the reference.

The factorial (docs/lab.md, "The paper's contrast"). token and balanced on the three lab-check tasks that
differ only in how long a failed loop is: GAPS. Per seed s and gap g, d_g(s) = M(token, s) - M(balanced, s);
the primary test is the difference-in-differences D(s) = d_long(s) - d_none(s), a two-sided paired t-test
(seeds pair the runs within each gap), alpha 0.05, with its 95% CI and an equivalence test (TOST, the two
one-sided tests at 0.05) against the declared margin MARGIN, so that "no difference" can be a result.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from grpo_utils.common import writable_problem
from grpo_utils.run_dir import read_args_json, run_metrics
from scripts.ablation import rule_args
from train_grpo import AGGS

ROOT = Path(__file__).resolve().parent.parent  # the project's root

# The comparison's rules: the paper's three, the peer trainers' two token means and Dr. GRPO (its
# normaliser with unscaled advantages, ablation.RULE_ARGS). seq-sum is the normaliser times L_max, a
# constant that Adam divides out up to the gradient clip.
RULES = [a for a in AGGS if a != "seq-sum"]  # the trainer's rules, in its order
REFERENCE = "balanced"  # the paper's rule: every other rule is tested against it

# The factorial: the failure-length gap's levels, as the offline task that has each (data/demo.py, CHECK_LOOP:
# a failed loop of 2 checks, 2-26, 30-70; in the warm-up targets failures are 1x, ~1.6x, ~3.5x as long as
# successes), and the equivalence margin of its primary test, in AUC points (declared before any run).
GAPS = {"none": "lab-check-nogap", "middle": "lab-check", "long": "lab-check-long"}
FACTORIAL_RULES = ("token", REFERENCE)
MARGIN = {"AUC": 0.5, "J": 1.0}  # the primary measure's, and the last checkpoint's held-out J (secondary)
# The LoRA study (docs/lora.md, "Does the paper's effect survive LoRA?"; declared before any run): token and
# balanced on the long gap under full fine-tuning and LoRA of ranks 1 and 8, each arm an ablation.py --out
# directory of its own (DIR/full, DIR/r1, DIR/r8) trained with its flags (after the factorial's). LoRA's learning
# rate is 10x the lab's 2e-4 at both ranks, alpha 32: LoRA Without Regret's rule, not tuned on any run.
LORA_TASK = GAPS["long"]
LORA_ARMS = {"full": [], "r1": ["--lora-rank", "1", "--lr", "2e-3"], "r8": ["--lora-rank", "8", "--lr", "2e-3"]}
LORA_MARGIN = 1.5  # AUC points: LoRA learns as full fine-tuning does if TOST puts their difference within this
LATE_STEPS = 5  # compare's late accuracy (the last 5 steps) and coupling (the first 5): the fewest --steps it reads


# -----------------------------------------------------------------------------
# The prediction


def right_responses(task: str, a: int, b: int) -> list[str]:
    """Every right response a lab-check policy gives with non-negligible probability: the sum after
    any number of checks (only one check is taught)."""
    if not task.startswith("lab-check"):
        raise ValueError(f"--predict knows the right responses of the lab-check tasks, not {task!r}")
    return [" check" * k + f" \\boxed{{{a + b}}}" for k in range(27)]


def success_probability(model, tok, task: str, pairs: list[tuple[int, int]]) -> dict:
    """J: the probability of a right answer, mean over the prompts (exact over right_responses), and each
    prompt's own (per_prompt); and the two decisions: check first, and answer after one check."""
    from data.templates import render_prompt

    eos, texts, spans = tok.eos_token_id, [], []
    for a, b in pairs:
        p = tok(render_prompt(f"What is {a}+{b}?", "plain"))["input_ids"]
        for r in right_responses(task, a, b):
            texts.append(p + tok(r, add_special_tokens=False)["input_ids"] + [eos])
            spans.append(len(p))
    logp = []
    with torch.no_grad():
        for i in range(0, len(texts), 512):
            chunk = texts[i : i + 512]
            width = max(map(len, chunk))
            ids = torch.tensor([t + [eos] * (width - len(t)) for t in chunk])
            mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in chunk])
            lp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].double(), -1)
            logp += list(lp.gather(-1, ids[:, 1:, None])[..., 0])
    per = len(right_responses(task, 0, 0))
    J = check = stop = 0.0
    each = [0.0] * len(pairs)
    for k, (t, start) in enumerate(zip(texts, spans)):
        tokens = logp[k][start - 1 : len(t) - 1]  # the response's tokens, EOS included
        J += float(tokens.sum().exp())
        each[k // per] += float(tokens.sum().exp())
        if k % per == 1:  # " check \boxed{c}": the first token, and the answer after one check
            check += float(tokens[0].exp())
            stop += float(tokens[1].exp())
    n = len(pairs)
    return {"J": J / n, "check_first": check / n, "answer_after_check": stop / n, "per_prompt": each}


def sample_step(model, tok, pairs: list[tuple[int, int]], gen: torch.Generator, args: argparse.Namespace
                ) -> tuple[list, torch.Tensor]:
    """One rollout step of the initial policy as the run `args` samples it: G responses per prompt, as
    (prompt + response token ids, prompt length) and the 0/1 math rewards."""
    from data.templates import render_prompt
    from rewards import math_reward

    tok.padding_side = "left"
    prompts = [render_prompt(f"What is {a}+{b}?", "plain") for a, b in pairs]
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=args.temperature, top_p=args.top_p,
                             max_new_tokens=args.max_response_len, num_return_sequences=args.group_size,
                             pad_token_id=tok.eos_token_id)
    seqs, rewards = [], []
    for j, row in enumerate(out):
        a, b = pairs[j // args.group_size]
        prompt = enc["input_ids"][j // args.group_size][enc["attention_mask"][j // args.group_size].bool()].tolist()
        resp = row[enc["input_ids"].shape[1] :].tolist()
        n = resp.index(tok.eos_token_id) + 1 if tok.eos_token_id in resp else len(resp)  # EOS counted
        seqs.append((prompt + resp[:n], len(prompt)))
        rewards.append(math_reward(tok.decode(resp[:n], skip_special_tokens=True), str(a + b)))
    return seqs, torch.tensor(rewards, dtype=torch.float64)


def step_gradient(model, seqs: list, rewards: torch.Tensor, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The gradient of sum_i w_i sum_t (-A_i log pi(y_it)) on one step's rollouts, with the advantages and
    weights the trainer computes from the run's arguments `args`, clipped as its DeepSpeed config clips."""
    from train_grpo import advantages, aggregation_weights

    adv = advantages(rewards, args)
    lengths = torch.tensor([len(s) - p for s, p in seqs])
    w = aggregation_weights(adv, lengths, args.group_size, args.agg, max_len=args.max_response_len)
    model.zero_grad(set_to_none=True)
    eos = model.config.eos_token_id
    width = max(len(s) for s, _ in seqs)
    ids = torch.tensor([s + [eos] * (width - len(s)) for s, _ in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s, _ in seqs])
    lp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
    lp = lp.gather(-1, ids[:, 1:, None])[..., 0]
    pos = torch.arange(width - 1)[None]
    first, end = torch.tensor([p - 1 for _, p in seqs])[:, None], torch.tensor([len(s) - 1 for s, _ in seqs])[:, None]
    resp = (pos >= first) & (pos < end)  # the positions whose next token is a response token
    coef = (w * adv).float()[:, None]
    (-(coef * lp * resp).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    scale = min(1.0, optimizer_settings(args)["clip"] / (float(norm) + 1e-6))
    return {n: g * scale for n, g in grads.items()}


def optimizer_settings(args: argparse.Namespace) -> dict[str, float]:
    """The run's learning rate, Adam's eps and the gradient clip, as its DeepSpeed config sets them."""
    from train_grpo import deepspeed_config

    cfg = deepspeed_config(args, 1)
    return {"lr": args.lr, "eps": cfg["optimizer"]["params"]["eps"], "clip": cfg["gradient_clipping"]}


def first_step(grads: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Adam's first update: lr m / (sqrt(v) + eps) with m = g, v = g^2 after bias correction."""
    opt = optimizer_settings(args)
    return {n: opt["lr"] * g / (g.abs() + opt["eps"]) for n, g in grads.items()}


def steady_step(steps: list[dict[str, torch.Tensor]], args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """An update of Adam whose moments have averaged over these steps' gradients: lr E[g] / sqrt(E[g^2])
    per coordinate (a coordinate whose gradient flips sign between steps barely moves)."""
    opt = optimizer_settings(args)
    return {n: opt["lr"] * sum(g[n] for g in steps) / len(steps)
            / ((sum(g[n] ** 2 for g in steps) / len(steps)).sqrt() + opt["eps"]) for n in steps[0]}


def gain(model, tok, task: str, pairs: list, update: dict[str, torch.Tensor], base: dict) -> dict[str, float]:
    """The change (x1000) of J and the two decisions when `update` is subtracted from the weights."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        before = {n: params[n].detach().clone() for n in update}
        for n, u in update.items():
            params[n].sub_(u)
        after = success_probability(model, tok, task, pairs)
        for n, w in before.items():
            params[n].copy_(w)  # exactly the initial policy again
    return {k: 1000 * (after[k] - base[k]) for k in base}


def predict(task: str, steps: int, seed: int = 0, steady: bool = False, extra: tuple[str, ...] = (),
            rules: list[str] = RULES) -> None:
    """Print each rule's expected gain in J from one update at the initial policy, for the runs the ablation
    trains on `task` with the trainer arguments `extra`: Adam's first step, and with `steady` also the
    update of moments averaged over the sampled steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.demo import TASKS, model_dir, split_pairs

    if task not in TASKS or not task.startswith("lab-check"):
        raise ValueError(f"--predict {task}: it knows the right responses of the lab-check tasks only "
                         f"({', '.join(t for t in TASKS if t.startswith('lab-check'))})")
    path = model_dir(task)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    train_pairs, test_pairs = split_pairs()
    base = success_probability(model, tok, task, test_pairs)
    del base["per_prompt"]  # the gains are of the means
    gen = torch.Generator().manual_seed(seed)
    args = {agg: rule_args(task, agg, list(extra)) for agg in rules}  # each rule's run, as the ablation trains it
    sampling = args[REFERENCE]  # how every rule's run samples (the rules differ in the update only)
    if sampling.lora_rank:  # the update moves the adapters only: B = 0, so the first policy is the base's
        from train_grpo import with_adapters

        torch.manual_seed(seed)  # A's random start (the runs' own A differ: a prediction, not a replay)
        model = with_adapters(model, sampling.lora_rank, sampling.lora_alpha)
    rollouts = []
    for _ in range(steps):
        idx = torch.randperm(len(train_pairs), generator=gen)[: sampling.prompts_per_step].tolist()
        rollouts.append(sample_step(model, tok, [train_pairs[i] for i in idx], gen, sampling))
    right = torch.cat([r for _, r in rollouts]) > 0
    lengths = torch.tensor([len(s) - p for seqs, _ in rollouts for s, p in seqs], dtype=torch.float64)
    fail, success = lengths[~right].mean().item(), lengths[right].mean().item()  # the sign-length coupling
    print(f"{task}: J {base['J']:.4f} (right answers, held-out prompts), check first {base['check_first']:.3f}, "
          f"answer after one check {base['answer_after_check']:.3f}; {steps} steps sampled: accuracy "
          f"{right.double().mean().item():.3f}, failures {fail:.1f} tokens against successes' {success:.1f} "
          f"({fail / success:.1f}x), mean length {lengths.mean().item():.1f}\n")
    print("| rule | first-step gain in J x1000 (mean ± s.e. over steps) | check first x1000 | answer after one "
          "check x1000 | relative to balanced |\n|---|---|---|---|---|")
    rows, grads = {}, {}
    for agg in rules:
        grads[agg] = [step_gradient(model, seqs, rewards, args[agg]) for seqs, rewards in rollouts
                      if rewards.min() != rewards.max()]
        rows[agg] = [gain(model, tok, task, test_pairs, first_step(g, args[agg]), base) for g in grads[agg]]
    ref = sum(g["J"] for g in rows[REFERENCE]) / len(rows[REFERENCE])
    for agg, gains in rows.items():
        m = {k: sum(g[k] for g in gains) / len(gains) for k in base}
        se = (sum((g["J"] - m["J"]) ** 2 for g in gains) / max(1, len(gains) - 1) / len(gains)) ** 0.5
        print(f"| {agg} | {m['J']:+.2f} ± {se:.2f} | {m['check_first']:+.2f} | {m['answer_after_check']:+.2f} | "
              f"{m['J'] / ref:.2f} |")
    if steady:  # lab-check: added after its runs (docs/lab.md says why); the factorial: declared before them
        after = {agg: gain(model, tok, task, test_pairs, steady_step(grads[agg], args[agg]), base) for agg in rules}
        print(f"\nSteady: one update of Adam with moments averaged over the {len(grads[REFERENCE])} steps' "
              "gradients, lr E[g] / sqrt(E[g^2]) (x1000)\n")
        print("| rule | gain in J | check first | answer after one check | relative to balanced |\n"
              "|---|---|---|---|---|")
        for agg, g in after.items():
            print(f"| {agg} | {g['J']:+.2f} | {g['check_first']:+.2f} | {g['answer_after_check']:+.2f} | "
                  f"{g['J'] / after[REFERENCE]['J']:.2f} |")


# -----------------------------------------------------------------------------
# The comparison


def t_test(d: list[float]) -> tuple[float, float]:
    """(t, two-sided p) of a paired t-test on the differences d (n - 1 degrees of freedom)."""
    import mpmath  # a dependency of torch (through sympy)

    n = len(d)
    mean = sum(d) / n
    sd = (sum((x - mean) ** 2 for x in d) / (n - 1)) ** 0.5
    if sd <= 1e-12 * max(1.0, abs(mean)):  # equal differences (up to rounding): no spread to test against
        return (math.inf if mean else 0.0), (0.0 if mean else 1.0)
    t, df = mean / (sd / n**0.5), n - 1
    return t, float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment of p-values (family-wise error over the comparisons)."""
    order = sorted(range(len(ps)), key=ps.__getitem__)
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    import mpmath

    tail = 0.5 * float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))
    return 1 - tail if t >= 0 else tail


def t_quantile(q: float, df: int) -> float:
    """The q-quantile of Student's t (0 < q < 1)."""
    import mpmath

    return float(mpmath.findroot(lambda x: t_cdf(float(x), df) - q, 0.0 if q == 0.5 else 2.0 * (q - 0.5) / 0.45))


def p_text(p: float) -> str:
    """A p value as the tables print it: three decimals, or its first significant digit below 0.001."""
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1g}"


def paired(d: list[float], margin: float) -> dict[str, float]:
    """The paired test of the differences d: mean, sd, Cohen's d_z (mean / sd), t and two-sided p, the 95%
    CI, and TOST against +-margin: p_tost, the larger of the two one-sided p values (equivalence at 0.05
    when below it: the 90% CI inside (-margin, margin))."""
    n, mean = len(d), sum(d) / len(d)
    sd = (sum((x - mean) ** 2 for x in d) / (n - 1)) ** 0.5
    if sd <= 1e-12 * max(1.0, abs(mean)):  # equal differences (up to rounding), as t_test takes them
        sd = 0.0
    se, df = sd / n**0.5, n - 1
    t, p = t_test(d)
    half = t_quantile(0.975, df) * se
    p_tost = max(1 - t_cdf((mean + margin) / se, df), t_cdf((mean - margin) / se, df)) if se > 0 else \
        float(abs(mean) >= margin)
    dz = mean / sd if sd > 0 else (math.copysign(math.inf, mean) if mean else 0.0)
    return {"n": n, "mean": mean, "sd": sd, "dz": dz, "t": t, "p": p, "lo": mean - half, "hi": mean + half,
            "p_tost": p_tost}


def run_table(runs_dir: Path, model: str | None = None, rules: list[str] = RULES) -> dict[str, dict[int, Path]]:
    """The directory's runs (of `model`, if given) as {rule: {seed: run}}; one line if it holds none of the
    comparison's."""
    out: dict[str, dict[int, Path]] = {}
    if not runs_dir.is_dir():
        raise ValueError(f"{runs_dir}: no such directory (give an ablation.py --out directory)")
    for run in sorted(runs_dir.iterdir()):
        if (a := read_args_json(run)) is None:  # not a run (a log, a .commit file)
            continue
        if a.get("policy_loss", "ppo") == "ppo" and a.get("agg") in rules and model in (None, a.get("model")):
            out.setdefault(a["agg"], {})[a["seed"]] = run
    if not out:
        raise ValueError(f"{runs_dir}: no runs of {', '.join(rules)}{f' on {model}' if model else ''} in it "
                         f"(ablation.py --aggs ... --out {runs_dir})")
    return out


def training_curve(run: Path) -> dict[int, dict]:
    return {s: m for s, m in run_metrics(run).items() if "reward/accuracy" in m}


def paired_curves(runs_dir: Path, table: dict[str, dict[int, Path]], rules: list[str]
                  ) -> tuple[list[int], dict[tuple[str, int], dict[int, dict]], int]:
    """The seeds every rule ran, each (rule, seed)'s training curve and the runs' --steps T; one line if
    the runs are not finished, not of one length or not paired."""
    seeds = sorted(set.intersection(*(set(table[a]) for a in rules)))
    if len(seeds) < 2:
        raise ValueError(f"{runs_dir}: fewer than 2 seeds shared by every rule ({', '.join(rules)}); "
                         "a paired test needs at least 2")
    curves = {(a, s): training_curve(table[a][s]) for a in rules for s in seeds}
    planned = {read_args_json(table[a][s]).get("steps") for a in rules for s in seeds}
    if len(planned) != 1:
        raise ValueError(f"{runs_dir}: the runs differ in --steps ({sorted(map(str, planned))}); "
                         "compare runs of one length")
    T = planned.pop()
    for (a, s), c in curves.items():
        missing = [k for k in range(1, T + 1) if k not in c]
        if missing:
            raise ValueError(f"{table[a][s]}: no training step {missing[0]} in metrics.jsonl; finish the run "
                             "(the same ablation.py command resumes it)")
    for s in seeds:  # paired: a seed's first rollouts are the same under every rule
        first = {(round(curves[(a, s)][1]["reward/accuracy"], 6), round(curves[(a, s)][1]["length/mean"], 4))
                 for a in rules}
        if len(first) != 1:
            raise ValueError(f"seed {s}: step 1's rollouts differ across rules ({sorted(first)}); the runs are "
                             "not paired (the same --seed and settings but the rule)")
    return seeds, curves, T


def compare(runs_dir: Path, rules: list[str] = RULES) -> str:
    """The paired comparison as markdown: per seed and rule the declared measure (AUC, the mean training
    accuracy over steps 1..T), the late accuracy (steps T-4..T), and the tests against REFERENCE."""
    table = run_table(runs_dir, rules=rules)
    rules = [r for r in rules if r in table]
    seeds, curves, T = paired_curves(runs_dir, table, rules)
    if T < LATE_STEPS:  # the late accuracy reads steps T-4..T and the coupling steps 1-5 (once a KeyError)
        raise ValueError(f"{table[rules[0]][seeds[0]]}: {T} training steps (its --steps); the comparison needs at "
                         f"least {LATE_STEPS} (it reads steps 1-{LATE_STEPS} and the last {LATE_STEPS}): train "
                         f"runs of --steps {LATE_STEPS} or more (ablation.py ... -- --steps N)")
    auc = {k: 100 * sum(c[t]["reward/accuracy"] for t in range(1, T + 1)) / T for k, c in curves.items()}
    late = {k: 100 * sum(c[t]["reward/accuracy"] for t in range(T - 4, T + 1)) / 5 for k, c in curves.items()}
    length = {k: sum(c[t]["length/mean"] for t in range(T - 4, T + 1)) / 5 for k, c in curves.items()}
    gap = {k: sum(c[t]["length/pos_neg_gap"] for t in range(1, 6)) / 5 for k, c in curves.items()}
    pg = {k: sum(c[t]["loss/pg"] for t in range(1, 6)) / 5 for k, c in curves.items()}  # the coupling

    def ms(xs: list[float], digits: int = 1) -> str:
        m = sum(xs) / len(xs)
        sd = (sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)) ** 0.5
        return f"{m:.{digits}f} ± {sd:.{digits}f}"

    lines = [f"{runs_dir.name}: {len(seeds)} paired seeds ({', '.join(map(str, seeds))}), {T} steps; AUC = mean "
             f"training accuracy over steps 1-{T} (%), the declared measure; late = steps {T - 4}-{T}\n",
             "| rule | " + " | ".join(f"AUC s{s}" for s in seeds) + " | AUC | late accuracy | length, late | "
             "neg-pos gap, steps 1-5 | pg loss, steps 1-5 |", "|---|" + "---|" * (len(seeds) + 5)]
    for a in rules:
        lines.append(f"| {a} | " + " | ".join(f"{auc[(a, s)]:.1f}" for s in seeds)
                     + f" | {ms([auc[(a, s)] for s in seeds])} | "
                     f"{ms([late[(a, s)] for s in seeds])} | {ms([length[(a, s)] for s in seeds])} | "
                     f"{ms([gap[(a, s)] for s in seeds])} | {ms([pg[(a, s)] for s in seeds], 4)} |")
    others = [a for a in rules if a != REFERENCE]
    if REFERENCE in rules and others:
        tests = [t_test([auc[(a, s)] - auc[(REFERENCE, s)] for s in seeds]) for a in others]
        adjusted = holm([p for _, p in tests])
        lines += ["", f"Paired against {REFERENCE} (d = AUC(rule) - AUC({REFERENCE}) per seed; two-sided paired "
                  f"t-test, {len(seeds) - 1} degree{'s' if len(seeds) > 2 else ''} of freedom; Holm over the "
                  f"{len(others)} rules)\n",
                  "| rule | d per seed | mean d | t | p | p (Holm) |", "|---|---|---|---|---|---|"]
        for a, (t, p), ph in zip(others, tests, adjusted):
            d = [auc[(a, s)] - auc[(REFERENCE, s)] for s in seeds]
            lines.append(f"| {a} | {' '.join(f'{x:+.1f}' for x in d)} | {sum(d) / len(d):+.2f} | {t:+.2f} | "
                         f"{p:.3f} | {ph:.3f} |")
    model = read_args_json(table[rules[0]][seeds[0]]).get("model", "")
    if str(model).startswith("lab-check"):
        lines += ["", mechanism(table, rules, seeds, model)]
    # The evaluation's own noise: a step's accuracy is a mean of 0/1 rewards over its responses (binomial).
    n = curves[(rules[0], seeds[0])][1].get("sample/groups", 32) * 8
    p0 = sum(late.values()) / len(late) / 100
    lines += ["", f"Noise of one step's accuracy (binomial, {n} responses at {100 * p0:.0f}%): ± "
              f"{100 * (p0 * (1 - p0) / n) ** 0.5:.1f} points; of an AUC over {T} steps, if the steps were "
              f"independent: ± {100 * (p0 * (1 - p0) / n / T) ** 0.5:.2f}."]
    return "\n".join(lines)


def checkpoint_decisions(ckpt: str, task: str) -> dict:
    """success_probability of a checkpoint on the 200 held-out prompts: J and the two decisions, exact."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.demo import split_pairs

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    return success_probability(model, tok, task, split_pairs()[1])


def last_checkpoint_J(run: Path, task: str) -> float:
    """The held-out J (%) of the run's last checkpoint."""
    from evaluate import run_checkpoints

    return 100 * checkpoint_decisions(run_checkpoints(str(run))[-1][1], task)["J"]


def plot_factorial(curves: dict[tuple[str, str, int], dict[int, dict]], rules: list[str], seeds: list[int], T: int,
                   path: Path, panels: dict[str, str] | None = None) -> None:
    """Per gap (or the panels' keys of `curves`, with their titles): each rule's training accuracy over the steps,
    and token - balanced per step (mean ± sd over the paired seeds, as bands)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scripts.length_drift import seed_band as band

    acc = {k: [100 * c[t]["reward/accuracy"] for t in range(1, T + 1)] for k, c in curves.items()}
    panels = panels or {gap: f"{gap} gap ({task})" for gap, task in GAPS.items()}
    fig, axes = plt.subplots(2, len(panels), figsize=(4.4 * len(panels), 6.4), sharex=True, squeeze=False)
    for j, (gap, title) in enumerate(panels.items()):
        for i, a in enumerate(rules):
            band(axes[0][j], [acc[(gap, a, s)] for s in seeds], f"C{i}", a)
        band(axes[1][j], [[x - y for x, y in zip(acc[(gap, rules[0], s)], acc[(gap, rules[1], s)])] for s in seeds],
             "C2", f"{rules[0]} - {rules[1]}")
        axes[0][j].set(title=title, ylabel="training accuracy (%)")
        axes[1][j].set(xlabel="step", ylabel=f"{rules[0]} - {rules[1]} (points)")
        axes[1][j].axhline(0, color="grey", linewidth=0.8)
    axes[0][0].legend(fontsize=8)
    axes[1][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"figure: {path}")


def factorial(runs_dir: Path, last_J=last_checkpoint_J, figure: Path | None = None) -> str:
    """The factorial's report as markdown: per gap, seed and rule the AUC and the last checkpoint's J; per gap
    the paired difference d = token - balanced; then the declared tests on the difference-in-differences
    D = d_gap - d_none per seed (long, the primary test; middle, secondary), with 95% CIs and TOST."""
    rules = list(FACTORIAL_RULES)
    tables = {gap: run_table(runs_dir, task) for gap, task in GAPS.items()}
    seeds = sorted(set().union(*(set(t.get(a, {})) for t in tables.values() for a in rules)))
    for gap, task in GAPS.items():  # every cell runs every seed: none is dropped from the test unsaid
        for a in rules:
            if missing := [s for s in seeds if s not in tables[gap].get(a, {})]:
                raise ValueError(f"{runs_dir}: {task}: no {a} run of seed {missing[0]} (every cell runs every seed; "
                                 "the same ablation.py command trains it)")
    measures: dict[str, dict[tuple[str, str, int], float]] = {"AUC": {}, "J": {}}
    coupling: dict[tuple[str, str, int], tuple[float, float]] = {}  # the pg loss and neg-pos gap, steps 1-5
    every: dict[tuple[str, str, int], dict[int, dict]] = {}
    steps = set()
    for gap, task in GAPS.items():
        _, curves, T = paired_curves(runs_dir, tables[gap], rules)
        steps.add(T)
        for (a, s), c in curves.items():
            every[(gap, a, s)] = c
            measures["AUC"][(gap, a, s)] = 100 * sum(c[t]["reward/accuracy"] for t in range(1, T + 1)) / T
            measures["J"][(gap, a, s)] = last_J(tables[gap][a][s], task)
            first = range(1, min(5, T) + 1)
            coupling[(gap, a, s)] = tuple(sum(c[t][k] for t in first) / len(first)
                                          for k in ("loss/pg", "length/pos_neg_gap"))
    if len(steps) != 1:
        raise ValueError(f"{runs_dir}: the gaps' runs differ in --steps ({sorted(steps)}); the factorial compares "
                         "runs of one length")
    from scripts.length_drift import mean_std as ms

    T = steps.pop()
    if figure is not None:
        plot_factorial(every, rules, seeds, T, figure)
    levels = ", ".join(f"{g}: {t}" for g, t in GAPS.items())
    lines = [f"factorial: {', '.join(rules)} x the failures' length gap ({levels}), {len(seeds)} paired seeds "
             f"({', '.join(map(str, seeds))}), {T} steps; AUC = mean training accuracy "
             f"over steps 1-{T} (%), the declared measure; J = the last checkpoint's held-out probability of a right "
             "answer (%), exact\n",
             "| gap | rule | " + " | ".join(f"AUC s{s}" for s in seeds) + " | AUC | J, last | pg loss, steps 1-5 | "
             "neg-pos gap, steps 1-5 |", "|---|---|" + "---|" * (len(seeds) + 4)]
    for gap in GAPS:
        for a in rules:
            auc = [measures["AUC"][(gap, a, s)] for s in seeds]
            lines.append(f"| {gap} | {a} | " + " | ".join(f"{x:.1f}" for x in auc) + f" | {ms(auc)} | "
                         f"{ms([measures['J'][(gap, a, s)] for s in seeds])} | "
                         f"{ms([coupling[(gap, a, s)][0] for s in seeds], 4)} | "
                         f"{ms([coupling[(gap, a, s)][1] for s in seeds])} |")
    d = {(m, gap): [v[(gap, rules[0], s)] - v[(gap, rules[1], s)] for s in seeds]
         for m, v in measures.items() for gap in GAPS}
    lines += ["", f"Per gap, d = {rules[0]} - {rules[1]} per seed (what the declared tests below contrast)\n",
              "| measure | gap | d per seed | mean d | d_z |", "|---|---|---|---|---|"]
    for (m, gap), x in d.items():
        r = paired(x, MARGIN[m])
        lines.append(f"| {m} | {gap} | {' '.join(f'{v:+.1f}' for v in x)} | {r['mean']:+.2f} | {r['dz']:+.2f} |")
    # the primary test (AUC, long - none) alone at 0.05; the three secondary ones with Holm's correction
    tests = {(m, gap): paired([a - b for a, b in zip(d[(m, gap)], d[(m, "none")])], MARGIN[m])
             for m in measures for gap in ("long", "middle")}
    secondary = [k for k in tests if k != ("AUC", "long")]
    adjusted = dict(zip(secondary, holm([tests[k]["p"] for k in secondary]), strict=True))
    lines += ["", "The declared tests: D = d(gap) - d(none) per seed, two-sided paired t-test, alpha 0.05; the "
              "primary is AUC, long - none (its p as it is), the three others are secondary (p Holm-adjusted over "
              "them); 95% CI; for the primary, TOST against the declared margin (equivalence where its p < 0.05)\n",
              "| measure | contrast | D per seed | mean D | 95% CI | d_z | t | p | margin | TOST p |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for (m, gap), r in tests.items():
        D = [a - b for a, b in zip(d[(m, gap)], d[(m, "none")])]
        p = p_text(r["p"]) if (m, gap) == ("AUC", "long") else f"{p_text(adjusted[(m, gap)])} (Holm)"
        lines.append(f"| {m} | {gap} - none | {' '.join(f'{v:+.1f}' for v in D)} | {r['mean']:+.2f} | "
                     f"[{r['lo']:+.2f}, {r['hi']:+.2f}] | {r['dz']:+.2f} | {r['t']:+.2f} | {p} | "
                     + (f"± {MARGIN[m]} | {p_text(r['p_tost'])} |" if (m, gap) == ("AUC", "long") else "- | - |"))
    return "\n".join(lines)


def lora_study(runs_dir: Path, last_J=last_checkpoint_J, figure: Path | None = None) -> str:
    """The LoRA study's report as markdown: per arm (LORA_ARMS), rule and seed the AUC and the last checkpoint's J;
    then the declared tests. Primary: token's deficit under each rank, d_r = AUC(token) - AUC(balanced) per seed
    (two-sided paired t-tests, Holm over the two ranks), and LoRA against full fine-tuning under balanced,
    L_r = AUC(LoRA r) - AUC(full) per seed (TOST against LORA_MARGIN, Holm over the two ranks, with its t-test).
    Secondary (Holm over the five): d_full, L_r under token, and D_r = d_r - d_full."""
    rules = list(FACTORIAL_RULES)
    tables, curves_of, steps = {}, {}, set()
    for arm, flags in LORA_ARMS.items():
        rank = int(flags[flags.index("--lora-rank") + 1]) if "--lora-rank" in flags else 0
        tables[arm] = run_table(runs_dir / arm, LORA_TASK, rules)
        for runs in tables[arm].values():
            for run in runs.values():
                if (got := read_args_json(run).get("lora_rank", 0)) != rank:
                    raise ValueError(f"{run}: --lora-rank {got}, in {runs_dir / arm}, the {arm} arm's directory "
                                     f"(--lora-rank {rank}); train each arm into its own (ablation.py --out)")
    seeds = sorted(set().union(*(set(t.get(a, {})) for t in tables.values() for a in rules)))
    for arm, table in tables.items():  # every cell runs every seed: none is dropped from the test unsaid
        for a in rules:
            if missing := [s for s in seeds if s not in table.get(a, {})]:
                raise ValueError(f"{runs_dir / arm}: no {a} run of seed {missing[0]} (every cell runs every seed; "
                                 "the same ablation.py command trains it)")
        _, curves, T = paired_curves(runs_dir / arm, table, rules)
        steps.add(T)
        curves_of.update({(arm, a, s): c for (a, s), c in curves.items()})
    if len(steps) != 1:
        raise ValueError(f"{runs_dir}: the arms' runs differ in --steps ({sorted(steps)}); compare runs of one length")
    T = steps.pop()
    for s in seeds:  # B = 0 at the start: every arm's first rollouts are the base policy's
        first = {(round(c[1]["reward/accuracy"], 6), round(c[1]["length/mean"], 4))
                 for (_, _, t), c in curves_of.items() if t == s}
        if len(first) != 1:
            raise ValueError(f"seed {s}: step 1's rollouts differ across the arms ({sorted(first)}); the arms are "
                             "not paired (the same --seed and settings but the fine-tuning)")
    auc = {k: 100 * sum(c[t]["reward/accuracy"] for t in range(1, T + 1)) / T for k, c in curves_of.items()}
    J = {(arm, a, s): last_J(tables[arm][a][s], LORA_TASK) for arm, a, s in curves_of}
    first5 = range(1, min(5, T) + 1)
    pg = {k: sum(c[t]["loss/pg"] for t in first5) / len(first5) for k, c in curves_of.items()}
    if figure is not None:
        plot_factorial(curves_of, rules, seeds, T, figure,
                       {arm: f"{arm} ({' '.join(f) or 'lr 2e-4'}), {LORA_TASK}" for arm, f in LORA_ARMS.items()})
    from scripts.length_drift import mean_std as ms

    lines = [f"LoRA study: {', '.join(rules)} on {LORA_TASK} x {', '.join(LORA_ARMS)} ("
             + "; ".join(f"{arm}: {' '.join(f) or 'full fine-tuning, the lab lr 2e-4'}" for arm, f in LORA_ARMS.items())
             + f"), {len(seeds)} paired seeds ({', '.join(map(str, seeds))}), {T} steps; AUC = mean training accuracy "
             f"over steps 1-{T} (%), the declared measure; J = the last checkpoint's held-out probability of a right "
             "answer (%), exact\n",
             "| arm | rule | " + " | ".join(f"AUC s{s}" for s in seeds) + " | AUC | J, last | pg loss, steps 1-5 |",
             "|---|---|" + "---|" * (len(seeds) + 3)]
    for arm in LORA_ARMS:
        for a in rules:
            lines.append(f"| {arm} | {a} | " + " | ".join(f"{auc[(arm, a, s)]:.1f}" for s in seeds)
                         + f" | {ms([auc[(arm, a, s)] for s in seeds])} | {ms([J[(arm, a, s)] for s in seeds])} | "
                         f"{ms([pg[(arm, a, s)] for s in seeds], 4)} |")
    d = {arm: [auc[(arm, rules[0], s)] - auc[(arm, rules[1], s)] for s in seeds] for arm in LORA_ARMS}
    ranks = [arm for arm in LORA_ARMS if arm != "full"]
    contrasts = {  # name: (per-seed values, family)
        **{f"d, {arm}": (d[arm], "primary") for arm in ranks},
        **{f"L, {arm}, {REFERENCE}": ([auc[(arm, REFERENCE, s)] - auc[("full", REFERENCE, s)] for s in seeds],
                                      "equivalence") for arm in ranks},
        "d, full": (d["full"], "secondary"),
        **{f"L, {arm}, {rules[0]}": ([auc[(arm, rules[0], s)] - auc[("full", rules[0], s)] for s in seeds],
                                     "secondary") for arm in ranks},
        **{f"D, {arm} - full": ([x - y for x, y in zip(d[arm], d["full"])], "secondary") for arm in ranks}}
    tests = {k: paired(v, LORA_MARGIN) for k, (v, _) in contrasts.items()}
    adjusted = {}
    for family in ("primary", "secondary"):
        names = [k for k, (_, f) in contrasts.items() if f == family]
        adjusted.update(zip(names, holm([tests[k]["p"] for k in names]), strict=True))
    names = [k for k, (_, f) in contrasts.items() if f == "equivalence"]
    tost = dict(zip(names, holm([tests[k]["p_tost"] for k in names]), strict=True))
    lines += ["", f"The declared tests (per seed: d = {rules[0]} - {rules[1]} within an arm; L = LoRA - full within a "
              f"rule; D = d(LoRA) - d(full)); two-sided paired t-tests, alpha 0.05, 95% CIs. Primary: d under each "
              f"rank (p Holm-adjusted over the two), and L under {REFERENCE} by TOST against ± {LORA_MARGIN} AUC "
              "points (TOST p Holm-adjusted over the two; equivalence where it is below 0.05; its t-test's p as it "
              "is). Secondary: the other five (p Holm-adjusted over them)\n",
              "| contrast | family | values per seed | mean | 95% CI | d_z | t | p | TOST p |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k, (v, family) in contrasts.items():
        r = tests[k]
        p = p_text(r["p"]) if family == "equivalence" else f"{p_text(adjusted[k])} (Holm)"
        lines.append(f"| {k} | {family} | {' '.join(f'{x:+.1f}' for x in v)} | {r['mean']:+.2f} | "
                     f"[{r['lo']:+.2f}, {r['hi']:+.2f}] | {r['dz']:+.2f} | {r['t']:+.2f} | {p} | "
                     + (f"{p_text(tost[k])} (Holm) |" if k in tost else "- |"))
    return "\n".join(lines)


def mechanism(table: dict, rules: list[str], seeds: list[int], task: str) -> str:
    """J and the two decisions at every checkpoint, exact on the held-out prompts (success_probability):
    what each rule did to the check that successes need (mean ± std over seeds)."""
    from evaluate import run_checkpoints

    values: dict[tuple[str, int], list[dict]] = {}
    measured: dict[str, dict] = {}  # by checkpoint: step 0, the initial policy, is every run's
    for a in rules:
        for s in seeds:
            for step, ckpt in run_checkpoints(str(table[a][s])):
                if ckpt not in measured:
                    measured[ckpt] = checkpoint_decisions(ckpt, task)
                values.setdefault((a, step), []).append(measured[ckpt])
    steps = sorted({step for _, step in values})
    out = ["Held-out J (exact probability of a right answer, %) / check first / answer after one check, at each "
           "checkpoint (mean ± std over seeds)\n", "| rule | " + " | ".join(f"step {s}" for s in steps) + " |",
           "|---|" + "---|" * len(steps)]
    for a in rules:
        cells = []
        for step in steps:
            v = values.get((a, step), [])
            m = {k: sum(x[k] for x in v) / len(v) for k in ("J", "check_first", "answer_after_check")}
            sd = (sum((x["J"] - m["J"]) ** 2 for x in v) / max(1, len(v) - 1)) ** 0.5
            cells.append(f"{100 * m['J']:.1f} ± {100 * sd:.1f} / {m['check_first']:.2f} / "
                         f"{m['answer_after_check']:.2f}")
        out.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="?", help="an ablation.py --out directory of the comparison's runs")
    p.add_argument("--predict", metavar="TASK", help="the first-step prediction on an offline lab-check policy")
    p.add_argument("--factorial", metavar="DIR", help="the token vs balanced x gap factorial's runs (GAPS)")
    p.add_argument("--lora", metavar="DIR", help="the LoRA study's runs: DIR/full, DIR/r1, DIR/r8 (LORA_ARMS)")
    p.add_argument("--figure", metavar="PNG", help="with --factorial or --lora: training accuracy per gap (arm) and "
                   "rule, and token - balanced, over the steps (seed bands)")
    p.add_argument("--steps", type=int, default=None, help="with --predict: rollout steps sampled (default 12)")
    p.add_argument("--rules", nargs="+", choices=RULES, default=None, help="with --predict or a runs directory: "
                   f"these rules, in this order (default: every rule of the trainer's but seq-sum, {REFERENCE} "
                   "among them; scripts/reproduce.py pins a published experiment's)")
    p.add_argument("--steady", action="store_true", help="with --predict: also the steady-state Adam update "
                   "(lab-check: added after its runs; the factorial: declared before them)")
    argv = sys.argv[1:]
    train_extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # with --predict: the runs' trainer flags
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if sum(x is not None for x in (args.runs, args.predict, args.factorial, args.lora)) != 1:
        p.error("give one of: a runs directory, --predict TASK, --factorial DIR, --lora DIR")
    if (args.steps is not None or args.steady) and not args.predict:
        p.error("--steps and --steady go with --predict")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be at least 1 (got {args.steps})")
    if args.figure and not (args.factorial or args.lora):
        p.error("--figure goes with --factorial or --lora")
    if args.rules and (args.factorial or args.lora):
        p.error(f"--rules goes with --predict or a runs directory (the factorial and the LoRA study compare "
                f"{' and '.join(FACTORIAL_RULES)})")
    rules = args.rules or RULES
    if twice := next((r for r in rules if rules.count(r) > 1), None):  # else its rows and tests printed twice
        p.error(f"--rules names {twice} twice; give each rule once")
    if REFERENCE not in rules:  # every rule is measured against it
        p.error(f"--rules must include {REFERENCE}, the rule every other is measured against")
    try:
        if args.figure:  # before the runs are read and their checkpoints scored, not after
            if Path(args.figure).is_dir():
                raise ValueError(f"--figure {args.figure} is a directory; give a .png file")
            if problem := writable_problem(Path(args.figure).parent):
                raise ValueError(f"{Path(args.figure).parent} is not writable ({problem}): the --figure goes there")
        if args.predict:
            predict(args.predict, args.steps or 12, steady=args.steady, extra=tuple(train_extra), rules=rules)
        elif args.factorial:
            print(factorial(Path(args.factorial), figure=Path(args.figure) if args.figure else None))
        elif args.lora:
            print(lora_study(Path(args.lora), figure=Path(args.figure) if args.figure else None))
        else:
            table = run_table(Path(args.runs), rules=rules)
            if args.rules and (missing := [r for r in rules if r not in table]):  # the default: the rules there are
                raise ValueError(f"{args.runs}: no runs of --rules {', '.join(missing)} in it (train them with "
                                 f"ablation.py --aggs {' '.join(missing)} --out {args.runs}, or leave them out of "
                                 "--rules)")
            print(compare(Path(args.runs), rules))
    except ValueError as e:
        sys.exit(f"compare_rules.py: error: {e}")


if __name__ == "__main__":
    main()
