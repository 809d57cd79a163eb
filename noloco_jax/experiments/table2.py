"""Table 2 in miniature: DP, DiLoCo and NoLoCo (and DiLoCo at NoLoCo's H) for N = 4, 8, 16.

The grid, the analysis and the report, all as fixed in ``plan`` before the runs;
``python -m experiments.table2`` is the script and ``colabs/table2_miniature.ipynb`` the
notebook that run it. The figure is the paper's relative difference
(PPL_DiLoCo - PPL_NoLoCo) / PPL_DP over training (its Fig. 3A), with the evaluations at
DiLoCo's sync steps and those mid-round as two series.
"""

from __future__ import annotations

import math
import shlex
import statistics
from typing import Any

from matplotlib.figure import Figure  # no pyplot: drawing never touches a notebook's backend

from noloco_jax.experiments import harness, plan, stats

CONFIG = harness.ROOT / "configs" / "exp_table2.py"
METHODS = plan.METHODS
OUTER = ("noloco", "diloco", "diloco_h10")


def run_overrides(method: str, n: int, seed: int) -> dict[str, Any]:
    """The overrides of one run of the Table 2 family (shared by sweeps, dropout, Fig. 3B)."""
    return {**plan.REGIME, **METHODS[method], "num_replicas": n, "seed": seed,
            "outer.seed": seed}  # fmt: skip


def grid(smoke: bool) -> list[harness.Run]:
    """Every (method, N, seed) of the plan; the smoke version: N = 2, 2 seeds (DP 1)."""
    runs = []
    for n in (2,) if smoke else plan.SIZES:
        for method in METHODS:
            for seed in plan.cell_seeds(method, n, smoke):
                runs.append(harness.Run(f"{method}_n{n}_s{seed}", run_overrides(method, n, seed)))
    return runs


def parse_name(name: str) -> tuple[str, int, int]:
    """``"diloco_h10_n8_s3"`` -> ("diloco_h10", 8, 3)."""
    method, n, seed = name.rsplit("_", 2)
    return method, int(n[1:]), int(seed[1:])


def sync_period(run: dict, method: str = "diloco") -> int:
    """The sync period of a run as it was trained (its run_info), else the plan's."""
    cfg = (run.get("run_info") or {}).get("config") or {}
    return int(cfg.get("outer", {}).get("sync_every") or METHODS[method]["outer.sync_every"])


def _regime(results: dict) -> dict:
    """The settings the runs were trained with (a smoke or local-data grid's own), from the
    first run's run_info; the plan's for the fields it does not record."""
    r = plan.REGIME
    out = {"model": {"preset": r["model.preset"]}, "num_steps": r["num_steps"],
           "global_batch_size": 32, "data": {"source": "shakespeare", "seq_len": 64},
           "optim": {"warmup_steps": r["optim.warmup_steps"]}}  # fmt: skip
    cfg = next((run["run_info"]["config"] for name, run in results.items()
                if not name.startswith("_") and (run.get("run_info") or {}).get("config")), {})
    for key, value in out.items():
        got = cfg.get(key, value)
        out[key] = {**value, **got} if isinstance(value, dict) and isinstance(got, dict) else got
    return out


def _method_period(results: dict, method: str) -> int:
    """``method``'s H as trained (its first run's), else the plan's."""
    runs = [run for name, run in results.items()
            if not name.startswith("_") and parse_name(name)[0] == method]  # fmt: skip
    return sync_period(runs[0], method) if runs else int(METHODS[method]["outer.sync_every"])


def _data_text(data: dict) -> str:
    """How the report names the training text."""
    tokens = "byte-level" if data.get("tokenizer", "byte") == "byte" else data["tokenizer"]
    if data.get("source", "shakespeare") == "shakespeare":
        return f"{tokens} Shakespeare"
    return f"{tokens} text files ({data.get('path') or data.get('tfds_name')})"


def reference_period(results: dict) -> int:
    """DiLoCo's H in these results (4 in the smoke version): the steps the metric reads."""
    return _method_period(results, "diloco")


def metrics(results: dict, key: str = plan.PRIMARY) -> dict[tuple[str, int], dict[int, float]]:
    """{(method, N): {seed: metric}}: ``key`` averaged over the last plan.LAST_K evaluations
    at DiLoCo's sync steps."""
    period = reference_period(results)
    cells: dict[tuple[str, int], dict[int, float]] = {}
    for name, run in results.items():
        if name.startswith("_"):
            continue
        method, n, seed = parse_name(name)
        value = stats.run_metric(run, period, plan.LAST_K, key)
        cells.setdefault((method, n), {})[seed] = value
    return cells


def _paired(cells: dict, a: tuple, b: tuple) -> dict[str, Any] | None:
    seeds = sorted(set(cells.get(a, {})) & set(cells.get(b, {})))
    if not seeds:
        return None
    test = stats.paired_test([cells[a][s] for s in seeds], [cells[b][s] for s in seeds])
    return {**test, "seeds": seeds, "verdict": stats.verdict(test, plan.ALPHA)}


def analyse(results: dict) -> dict[str, Any]:
    """The plan's tests for every N: the cells, the DP gaps and the paired tests.

    Returns:
      JSON-able: ``period``, and per N ``cells`` {method: {seed: metric}}, ``dp_gap``
      {method: (mean - DP) / DP}, ``tests`` {comparison: paired test + verdict} for
      noloco - diloco (primary), noloco - diloco_h10 (control), diloco_h10 - diloco (the
      effect of H alone), and the secondary (NoLoCo's averaged-model PPL - DiLoCo).
    """
    cells = metrics(results)
    avg = metrics(results, plan.SECONDARY)
    out: dict[str, Any] = {"period": reference_period(results), "last_k": plan.LAST_K,
                           "alpha": plan.ALPHA, "sizes": {}}  # fmt: skip
    for n in sorted({n for _, n in cells}):
        dp = statistics.mean(cells[("dp", n)].values()) if ("dp", n) in cells else None
        per = {m: {str(s): v for s, v in cells[(m, n)].items()} for m in METHODS if (m, n) in cells}
        gap = {m: (statistics.mean(cells[(m, n)].values()) - dp) / dp
               for m in OUTER if (m, n) in cells and dp}  # fmt: skip
        both = {**cells, ("noloco_avg", n): avg.get(("noloco", n), {})}
        tests = {"noloco-diloco": _paired(cells, ("noloco", n), ("diloco", n)),
                 "noloco-diloco_h10": _paired(cells, ("noloco", n), ("diloco_h10", n)),
                 "diloco_h10-diloco": _paired(cells, ("diloco_h10", n), ("diloco", n)),
                 "noloco_avg-diloco": _paired(both, ("noloco_avg", n), ("diloco", n))}
        out["sizes"][str(n)] = {"cells": per, "dp": dp, "dp_gap": gap,
                                "tests": {k: v for k, v in tests.items() if v}}  # fmt: skip
    return out


def rel_diff_series(results: dict, n: int) -> dict[str, list[tuple[int, float]]]:
    """Fig. 3A: (PPL_DiLoCo - PPL_NoLoCo) / PPL_DP per eval step, mean over the paired seeds,
    split into DiLoCo's sync steps ("sync") and the evaluations between them ("mid")."""
    seeds = sorted(set(s for k in results if not k.startswith("_")
                       for m, nn, s in [parse_name(k)] if nn == n and m == "noloco"))  # fmt: skip
    dp_name = next(k for k in results if k.startswith(f"dp_n{n}_"))
    dp = {r["step"]: r["val_ppl"] for r in results[dp_name]["eval"]}
    per_seed = []
    for s in seeds:
        if f"diloco_n{n}_s{s}" not in results:
            continue
        ev = {m: {r["step"]: r["val_ppl"] for r in results[f"{m}_n{n}_s{s}"]["eval"]}
              for m in ("noloco", "diloco")}  # fmt: skip
        steps = set(dp) & set(ev["noloco"]) & set(ev["diloco"])
        per_seed.append({t: (ev["diloco"][t] - ev["noloco"][t]) / dp[t] for t in steps})
    steps = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
    mean = [statistics.mean(p[t] for p in per_seed) for t in steps]
    sync, mid = stats.split_by_phase(steps, mean, reference_period(results))
    return {"sync": sync, "mid": mid}


def _plot(curves: dict, path) -> None:
    fig = Figure(figsize=(6.5, 3.8))
    ax = fig.subplots()
    for i, (n, series) in enumerate(curves.items()):
        color = f"C{i}"
        for phase, style in (("sync", "-o"), ("mid", ":x")):
            pts = series[phase]
            label = f"N = {n}, {'at DiLoCo sync steps' if phase == 'sync' else 'mid-round'}"
            ax.plot([t for t, _ in pts], [100 * v for _, v in pts], style, ms=3, color=color,
                    lw=1 if phase == "sync" else 0.6, label=label)  # fmt: skip
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("inner step")
    ax.set_ylabel("(PPL_DiLoCo − PPL_NoLoCo) / PPL_DP  [%]")
    ax.set_title("Fig. 3A in miniature (positive: NoLoCo ahead)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    harness.save_figure(fig, path)


def _fmt(values: dict) -> str:
    v = list(values.values())
    if len(v) == 1:
        return f"{v[0]:.3f}"
    sd = statistics.stdev(v) if all(math.isfinite(x) for x in v) else math.nan  # inf: diverged
    return f"{statistics.mean(v):.3f} ± {sd:.3f} ({len(v)})"


_READING = {"A < B": "holds", "A > B": "reversed", "no difference shown": "not shown"}


def _test_rows(analysis: dict) -> list[list[Any]]:
    rows = []
    for n, size in analysis["sizes"].items():
        for name, t in size["tests"].items():
            p = "n/a" if t["p"] != t["p"] else f"{t['p']:.3g}"
            rows.append([f"N = {n}", name, f"{t['mean']:+.4f} ± {t['sd']:.4f}", t["n"],
                         f"{t['t']:.2f}" if t["t"] == t["t"] else "n/a", p,
                         f"{t['negative']} / {t['positive']}", f"{t['sign_p']:.3g}",
                         _READING.get(t["verdict"], t["verdict"])])  # fmt: skip
    return rows


def report(results: dict, opts: harness.Options, command: str | None = None) -> tuple[dict, str]:
    """The report of a finished grid: (analysis for the json, markdown).

    ``command`` is the one the page shows (the script passes the flags it was given); by
    default ``python -m experiments.table2``, with ``--smoke`` and ``--data_path`` from ``opts``.
    """
    analysis = analyse(results)
    sizes = [int(n) for n in analysis["sizes"]]
    curves = {n: rel_diff_series(results, n) for n in sizes}
    analysis["fig3a"] = {str(n): c for n, c in curves.items()}
    fig = harness.figure_path(opts, "table2_fig3a")
    _plot(curves, fig)
    rows, gaps = [], []
    for n in sizes:
        size = analysis["sizes"][str(n)]
        rows.append([f"N = {n}"] + [_fmt(size["cells"].get(m, {})) if m in size["cells"] else "–"
                                    for m in METHODS])  # fmt: skip
        gaps.append([f"N = {n}"] + [f"{100 * size['dp_gap'][m]:+.1f} %" if m in size["dp_gap"]
                                    else "–" for m in OUTER])  # fmt: skip
    cmd = command or " ".join(
        ["python -m experiments.table2", *(["--smoke"] if opts.smoke else []),
         *([f"--data_path={shlex.quote(opts.data_path)}"] if opts.data_path else [])])
    r, h = _regime(results), {m: _method_period(results, m) for m in OUTER}
    md = (
        "## Table 2 in miniature: DP vs DiLoCo vs NoLoCo\n\n"
        f"```bash\n{cmd}\n```\n\n"
        f"Llama preset `{r['model']['preset']}`, {_data_text(r['data'])}, {r['num_steps']} "
        f"inner steps of {r['global_batch_size']} x {r['data']['seq_len']} tokens for every "
        "method (the global batch split over the N replicas), "
        f"Adam 3e-3, {r['optim']['warmup_steps']} warmup steps, cosine to 3e-4, clip 1.0. "
        f"NoLoCo: H = {h['noloco']}, alpha = 0.5, beta = gamma = 0.7, pairs. DiLoCo: "
        f"H = {h['diloco']}, alpha = 0.3, beta = 0.7; diloco_h10: DiLoCo at NoLoCo's "
        f"H = {h['diloco_h10']} (the control). Metric (fixed before the runs, "
        f"experiments/README.md): pooled validation PPL averaged over the last {plan.LAST_K} "
        f"evaluations at DiLoCo's sync steps (multiples of {analysis['period']}); mean ± std "
        "(seeds):\n\n"
        + harness.md_table(["replicas", *METHODS], rows)
        + "\nGap to data parallel, (PPL − PPL_DP) / PPL_DP (the paper: a few %):\n\n"
        + harness.md_table(["replicas", *OUTER], gaps)
        + f"\nTests, paired by seed (same init and data order), two-sided, alpha = {plan.ALPHA}. "
        "'noloco-diloco' is the primary test; 'NoLoCo ≤ DiLoCo' holds in a cell when its mean "
        "difference is negative with p < alpha, is reversed when positive with p < alpha, and "
        "is not shown otherwise. 'noloco_avg' is NoLoCo's averaged-model PPL (secondary).\n\n"
        + harness.md_table(["cell", "A − B", "mean ± std", "pairs", "t", "p", "sign − / +",
                            "sign p", "A < B?"], _test_rows(analysis))  # fmt: skip
        + f"\n![Fig. 3A in miniature]({harness.figure_link(opts, fig)})\n\n"
        "Fig. 3A at DiLoCo's sync steps, (PPL_DiLoCo − PPL_NoLoCo)/PPL_DP in % (mean over "
        "seeds): "
        + "; ".join(f"N = {n}: " + ", ".join(f"{t}: {100 * v:+.2f}" for t, v in c["sync"])
                    for n, c in curves.items())  # fmt: skip
        + ".\n"
    )
    return analysis, md
