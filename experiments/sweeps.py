"""Beyond the paper: NoLoCo's gamma, group size n and sync period H, at N = 8, 3 seeds each.

    python -m experiments.sweeps [--jobs 2] [--part i/k] [--dry_run] [--smoke ...]

gamma is swept inside and outside the theory's sufficient range for alpha = 0.5, n = 2
(0.5 < gamma < 1.5); n over {2, 4, 8} (n = 8 = N is DiLoCo-like averaging with NoLoCo's
momentum); H over {5, 10, 20}, 50. Every other setting is the Table 2 NoLoCo run, whose
N = 8 runs of seeds 0-2 are the shared baseline (gamma = beta = 0.7, n = 2, H = 10); the values
and seeds are those of noloco_jax/experiments/plan.py. Each value is compared with the baseline
paired by seed on the plan's metric (the last 3 evaluations at multiples of DiLoCo's H, which
are sync steps of every H swept). Writes experiments/results/sweeps.{json,md} and
experiments/figures/sweeps.png.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import flags  # noqa: E402

from experiments import options  # noqa: E402
from noloco_jax.experiments import harness, plan, stats, table2  # noqa: E402
from noloco_jax.quadratic import gamma_bounds  # noqa: E402

for _name in options.GRID_FLAGS:
    flags.declare_key_flag(_name)

CONFIG = harness.ROOT / "configs" / "exp_table2.py"
# The smoke version: n = 2 has no groups > 2; one seed of each value, two of the baseline.
SMOKE_VALUES = {"gamma": [2.2], "group_size": [], "sync_every": [5]}


def grid(smoke: bool) -> list[harness.Run]:
    n = 2 if smoke else 8
    runs = []
    for seed in range(2 if smoke else plan.SWEEP_SEEDS):
        base = table2.run_overrides("noloco", n, seed)
        runs.append(harness.Run(f"noloco_n{n}_s{seed}", base))
        for sweep, (key, values, _) in plan.SWEEPS.items():
            for v in (SMOKE_VALUES[sweep] if seed == 0 else []) if smoke else values:
                runs.append(harness.Run(f"sweep_{sweep}_{v}_n{n}_s{seed}", {**base, key: v}))
    return runs


def _value(name: str, sweep: str) -> float | None:
    if name.startswith(f"sweep_{sweep}_"):
        return float(name.split("_")[-3])
    return float(plan.SWEEPS[sweep][2]) if name.startswith("noloco_") else None


def _metric(run: dict, period: int, key: str = plan.PRIMARY) -> float:
    value = stats.run_metric(run, period, plan.LAST_K, key)
    return value if math.isfinite(value) else math.inf


def _sweep_rows(results: dict, sweep: str, period: int) -> tuple[list, dict]:
    """Rows of one sweep (mean ± std over seeds, paired test vs the baseline) and the json."""
    by_value: dict[float, dict[int, str]] = {}
    for name in results:
        v = _value(name, sweep) if not name.startswith("_") else None
        if v is not None:
            by_value.setdefault(v, {})[int(name.rsplit("_s", 1)[1])] = name
    base = by_value[float(plan.SWEEPS[sweep][2])]
    rows, out = [], {}
    for v in sorted(by_value):
        names = by_value[v]
        ppl = {s: _metric(results[k], period) for s, k in names.items()}
        avg = [_metric(results[k], period, plan.SECONDARY) for k in names.values()]
        seeds = sorted(set(ppl) & set(base))
        test = stats.paired_test([ppl[s] for s in seeds],
                                 [_metric(results[base[s]], period) for s in seeds])
        out[str(v)] = {"ppl": {str(s): p for s, p in ppl.items()}, "test_vs_baseline": test}
        finite = len(ppl) > 1 and all(math.isfinite(x) for x in ppl.values())
        sd = statistics.stdev(ppl.values()) if finite else float("nan")  # inf: diverged
        rows.append([v, f"{statistics.mean(ppl.values()):.3f} ± {sd:.3f} ({len(ppl)})",
                     f"{statistics.mean(avg):.3f}", f"{test['mean']:+.3f}",
                     "baseline" if names is base else f"{test['p']:.3g}"])  # fmt: skip
    return rows, out


def metric_period(smoke: bool) -> int:
    """The plan's metric reads evaluations at multiples of DiLoCo's H (its smoke H in the smoke
    version, as table2 reads it from the DiLoCo runs): sync steps of every H swept."""
    h = plan.METHODS["diloco"]["outer.sync_every"]
    return harness.smoke_sync_every(h) if smoke else h


def report(results: dict, opts: harness.Options) -> tuple[dict, str]:
    lo, hi = gamma_bounds(0.5, 2)
    period = metric_period(opts.smoke)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    sections, analysis = [], {"period": period}
    for ax, sweep in zip(axes, plan.SWEEPS):
        rows, analysis[sweep] = _sweep_rows(results, sweep, period)
        header = [sweep, "pooled PPL", "averaged model", "Δ vs baseline (paired)", "p"]
        if sweep == "gamma":
            header.append(f"theory range ({lo:.2f}, {hi:.2f})")
            rows = [r + ["inside" if lo < r[0] < hi else "outside"] for r in rows]
        sections.append(f"### {sweep}\n\n" + harness.md_table(header, rows))
        for name, run in sorted(results.items()):
            v = None if name.startswith("_") else _value(name, sweep)
            if v is not None and name.endswith("_s0"):
                ax.plot([r["step"] for r in run["eval"]],
                        [r["replica_spread"] for r in run["eval"]], label=f"{sweep} = {v:g}")
        ax.set_yscale("log")
        ax.set_title(f"cross-replica spread vs step: {sweep} (seed 0)")
        ax.set_xlabel("inner step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = harness.save_figure(fig, harness.figure_path(opts, "sweeps"))
    plt.close(fig)
    cmd = options.command("experiments.sweeps")
    md = (
        "## Beyond the paper: gamma, group size and sync period\n\n"
        f"```bash\n{cmd}\n```\n\n"
        "NoLoCo at N = 8, the Table 2 settings otherwise (baseline: gamma = beta = 0.7, n = 2, "
        f"H = 10). PPL: the plan's metric (mean of the last {plan.LAST_K} evaluations at "
        f"multiples of {period}), mean ± std (seeds); Δ: the mean paired difference to the "
        f"baseline, p its two-sided paired t-test (a value is better or worse than the baseline "
        f"only where p < {plan.ALPHA}); inf: diverged.\n\n"
        + "\n".join(sections)
        + f"\n![sweeps]({harness.figure_link(opts, path)})\n"
    )
    return analysis, md


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    opts = options.grid_options()
    results = options.train_grid(CONFIG, grid(opts.smoke), opts, runs_subdir="table2",
                                 name="sweeps")  # fmt: skip
    if results is None:
        return
    analysis, md = report(results, opts)
    harness.write_outputs(opts, "sweeps", {**results, "_analysis": analysis}, md)


if __name__ == "__main__":
    options.run(main)
