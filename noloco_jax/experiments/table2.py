"""Table 2 in miniature: final validation perplexity of DP, DiLoCo and NoLoCo for N = 4, 8, 16.

The grid, the report and its figure; ``python -m experiments.table2`` is the script and
``colabs/table2_miniature.ipynb`` the notebook that run it. The figure: the
paper's relative difference (PPL_DiLoCo - PPL_NoLoCo) / PPL_DP over training
(its Fig. 3A).
"""

from __future__ import annotations

import statistics

import scipy.stats
from matplotlib.figure import Figure  # no pyplot: drawing never touches a notebook's backend

from configs.exp_table2 import METHODS
from noloco_jax.experiments import harness

CONFIG = harness.ROOT / "configs" / "exp_table2.py"


def grid(smoke: bool) -> list[harness.Run]:
    sizes, seeds_mid = ((2,), (0, 1)) if smoke else ((4, 8, 16), (0, 1, 2))
    mid = sizes[len(sizes) // 2]
    runs = []
    for n in sizes:
        for seed in seeds_mid if n == mid else (0,):
            for method, over in METHODS.items():
                over = {**over, "num_replicas": n, "seed": seed, "outer.seed": seed}
                runs.append(harness.Run(f"{method}_n{n}_s{seed}", over))
    return runs


def _final(run: dict, key: str = "val_ppl") -> float:
    return run["eval"][-1][key]


def _cells(results: dict) -> dict[tuple[str, int], list[float]]:
    cells: dict[tuple[str, int], list[float]] = {}
    for name, run in results.items():
        method, n, _ = name.split("_")
        cells.setdefault((method, int(n[1:])), []).append(_final(run))
    return cells


def _fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def _rel_diff_curves(results: dict, sizes: list[int]) -> dict[int, list[tuple[int, float]]]:
    """(PPL_DiLoCo - PPL_NoLoCo) / PPL_DP per eval step, averaged over matching seeds."""
    curves = {}
    for n in sizes:
        seeds = sorted({k.split("_")[2] for k in results if f"_n{n}_" in k})
        per_seed = []
        for s in seeds:
            ev = {m: {r["step"]: r["val_ppl"] for r in results[f"{m}_n{n}_{s}"]["eval"]}
                  for m in METHODS}  # fmt: skip
            steps = sorted(set(ev["dp"]) & set(ev["diloco"]) & set(ev["noloco"]))
            per_seed.append({t: (ev["diloco"][t] - ev["noloco"][t]) / ev["dp"][t] for t in steps})
        steps = sorted(set.intersection(*(set(p) for p in per_seed)))
        curves[n] = [(t, statistics.mean(p[t] for p in per_seed)) for t in steps if t > 0]
    return curves


def _verdict(cells: dict, results: dict, sizes: list[int], mid: int) -> str:
    lines = []
    wins = sum(statistics.mean(cells[("noloco", n)]) <= statistics.mean(cells[("diloco", n)])
               for n in sizes)  # fmt: skip
    behind = sum(min(statistics.mean(cells[(m, n)]) for m in ("noloco", "diloco"))
                 >= statistics.mean(cells[("dp", n)]) for n in sizes)  # fmt: skip
    lines.append(f"- NoLoCo's final perplexity is at most DiLoCo's in {wins} of {len(sizes)} "
                 f"replica counts; both are behind data parallel in {behind} of {len(sizes)}.")
    seeds = sorted(k.split("_")[2] for k in results if k.startswith(f"noloco_n{mid}_"))
    diffs = [_final(results[f"noloco_n{mid}_{s}"]) - _final(results[f"diloco_n{mid}_{s}"])
             for s in seeds]  # fmt: skip
    if len(diffs) > 1:
        mean, sd = statistics.mean(diffs), statistics.stdev(diffs)
        se = sd / len(diffs) ** 0.5
        t = mean / se if se > 0 else float("inf")
        p = 2 * scipy.stats.t.sf(abs(t), df=len(diffs) - 1)  # paired two-sided t-test
        verdict = "significant" if p < 0.05 else "not significant"
        lines.append(
            f"- N = {mid}, paired by seed (same init and data order): PPL_NoLoCo − PPL_DiLoCo = "
            f"{mean:+.3f} ± {sd:.3f} (mean ± std over {len(diffs)} seeds); paired t = {t:.2f}, "
            f"df = {len(diffs) - 1}, two-sided p = {p:.2f}: {verdict} at the 5 % level."
        )
    return "\n".join(lines) + "\n"


def _plot(curves: dict, path) -> None:
    fig = Figure(figsize=(6, 3.6))
    ax = fig.subplots()
    for n, pts in curves.items():
        ax.plot([t for t, _ in pts], [100 * v for _, v in pts], marker="o", ms=3, label=f"N = {n}")
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("inner step")
    ax.set_ylabel("(PPL_DiLoCo − PPL_NoLoCo) / PPL_DP  [%]")
    ax.set_title("Fig. 3A in miniature (positive: NoLoCo ahead)")
    ax.legend()
    fig.tight_layout()
    harness.save_figure(fig, path)


def report(results: dict, opts: harness.Options) -> str:
    cells = _cells(results)
    sizes = sorted({n for _, n in cells})
    mid = sizes[len(sizes) // 2]
    rows = [[f"N = {n}"] + [_fmt(cells[(m, n)]) for m in METHODS] for n in sizes]
    curves = _rel_diff_curves(results, sizes)
    fig = harness.figure_path(opts, "table2_fig3a")
    _plot(curves, fig)
    evalrows = []
    for name in sorted(results):
        last = results[name]["eval"][-1]
        evalrows.append([name, last["val_ppl"], last["val_ppl_avg_model"], last["val_ppl_ensemble"],
                         last["val_ppl_best_replica"], last["replica_spread"]])  # fmt: skip
    cmd = "python -m experiments.table2" + (" --smoke" if opts.smoke else "")
    return (
        "## Table 2 in miniature: DP vs DiLoCo vs NoLoCo\n\n"
        f"```bash\n{cmd}\n```\n\n"
        "Tiny Llama (1.1M params), byte-level Shakespeare, 600 inner steps of 32 x 64 tokens for "
        "every method (equal steps and tokens; the global batch is split over the N replicas), "
        "Adam 3e-3 with 50 warmup steps and cosine to 3e-4, clip 1.0. NoLoCo: H = 10, alpha = 0.5, "
        "beta = gamma = 0.7, pairs. DiLoCo: H = 20, alpha = 0.3, beta = 0.7. Final pooled "
        "validation perplexity (mean ± std over seeds where there are several):\n\n"
        + harness.md_table(["replicas", *METHODS], rows)
        + "\n" + _verdict(cells, results, sizes, mid)
        + "- Caveat: evaluations are every 50 steps and the last one (step 600) falls on a sync "
        "step of both outer methods, where DiLoCo's replicas are identical (spread ~1e-9 below) "
        "and its pooled perplexity is that of its averaged model; NoLoCo's replicas are never "
        "identical. Between syncs DiLoCo's pooled perplexity is higher, so the final-step "
        "comparison is the one most favourable to DiLoCo.\n"
        + f"\n![Fig. 3A in miniature](../figures/{fig.name})\n\n"
        "Relative difference over training, (PPL_DiLoCo − PPL_NoLoCo)/PPL_DP in %: "
        + "; ".join(f"N = {n}: " + ", ".join(f"{t}: {100 * v:+.2f}" for t, v in pts[-3:])
                    for n, pts in curves.items())  # fmt: skip
        + " (last three evaluations).\n\n"
        "### Pooled vs averaged-model vs ensemble evaluation (final step)\n\n"
        + harness.md_table(["run", "pooled PPL (paper)", "averaged model", "ensemble",
                            "best replica", "spread"], evalrows)  # fmt: skip
    )
