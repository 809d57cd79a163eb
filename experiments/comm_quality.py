"""Quality in miniature of the communication options (issue 21): fragments, delay, 8-bit.

    python -m experiments.comm_quality [--jobs 2] [--smoke] [--publish]

NoLoCo and DiLoCo at N = 8 on the Table 2 setup with the ``nano`` model (the size whose cost
fits this grid on 2 CPU cores: 0.14 CPU s per step, measured by experiments.pilot_cost), both
with H = 20 here (so the two methods sync equally often), 300 inner steps, 3 seeds. Each
option is changed one at a time from today's exchange (float32, P = 1, tau = 0):

- fragments P = 2 (a fragment every 10 steps) on nano;
- fragments P in {1, 2, 4} on nano deepened to 4 blocks (``model.num_layers=4``: P = 4 needs
  4 layer blocks, nano has 2), each compared with the 4-block P = 1 run;
- delay tau in {1, 5} inner steps;
- exchange in {bfloat16, int8, int8 + error feedback, float8_e4m3fn}.

Metric (fixed before the runs, as in the fidelity plan): pooled validation perplexity
averaged over the last 3 evaluations at sync steps (steps 100, 200, 300: multiples of H and
of the eval cadence). Each option is compared with its method's baseline run of the same
seed (``BASELINE``: the 4-block P = 1 run for the 4-block options, float32 nano otherwise): mean paired difference, a two-sided paired t-test and the sign count.
Writes experiments/results/comm_quality.{json,md} (with --publish).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from absl import flags

from experiments import options
from noloco_jax.experiments import harness, stats

for _name in options.GRID_FLAGS:
    flags.declare_key_flag(_name)

CONFIG = harness.ROOT / "configs" / "exp_table2.py"
SEEDS = (0, 1, 2)
SYNC_EVERY = 20
COMMON = {"model.preset": "nano", "num_replicas": 8, "num_steps": 300, "eval_every": 50, "log_every": 10,
          "outer.sync_every": SYNC_EVERY}  # fmt: skip
METHODS = {
    "noloco": {"method": "noloco", "outer.momentum": 0.5},
    "diloco": {"method": "diloco", "outer.momentum": 0.3},
}
OPTIONS: dict[str, dict[str, Any]] = {
    "f32": {},
    "P2": {"outer.fragments": 2},
    "tau1": {"outer.delay": 1},
    "tau5": {"outer.delay": 5},
    "bf16": {"outer.exchange_dtype": "bfloat16"},
    "int8": {"outer.exchange_dtype": "int8"},
    "int8_ef": {"outer.exchange_dtype": "int8", "outer.error_feedback": True},
    "fp8": {"outer.exchange_dtype": "float8_e4m3fn"},
    "L4_P1": {"model.num_layers": 4},
    "L4_P2": {"model.num_layers": 4, "outer.fragments": 2},
    "L4_P4": {"model.num_layers": 4, "outer.fragments": 4},
}
BASELINE = {"L4_P2": "L4_P1", "L4_P4": "L4_P1"}  # every other option: "f32"
BASELINES = {"f32", *BASELINE.values()}  # the options compared with nothing
SMOKE_OPTIONS = ("f32", "P2", "tau1", "int8_ef")


def run_name(method: str, option: str, seed: int) -> str:
    return f"comm_{method}_{option}_s{seed}"


def grid(smoke: bool) -> list[harness.Run]:
    """Every (method, option, seed) run; the smoke version: 2 options, 1 seed, N = 2."""
    runs = []
    for method, over in METHODS.items():
        for option in SMOKE_OPTIONS if smoke else OPTIONS:
            for seed in SEEDS[:1] if smoke else SEEDS:
                cfg = {**COMMON, **over, **OPTIONS[option], "seed": seed, "outer.seed": seed}
                if smoke:  # harness.smoke_overrides() sets the steps, H = 2 and the model
                    cfg = {**OPTIONS[option], **over, "num_replicas": 2, "seed": seed}
                runs.append(harness.Run(run_name(method, option, seed), cfg))
    return runs


def sync_metric(evals: list[dict], sync_every: int, last: int = 3) -> float:
    """Pooled validation perplexity averaged over the last ``last`` evaluations at sync steps
    (``stats.sync_aligned_mean``), or nan when the run has fewer of them."""
    aligned = [r for r in evals if r["step"] > 0 and r["step"] % sync_every == 0]
    if len(aligned) < last:
        return math.nan
    return stats.sync_aligned_mean(evals, sync_every, last)


def paired(option: np.ndarray, base: np.ndarray) -> dict[str, float]:
    """Mean paired difference (option - base), its two-sided paired t-test p and sign count."""
    t = stats.paired_test(option.tolist(), base.tolist())
    return {"diff": t["mean"], "p": t["p"], "better": t["negative"], "n": t["n"]}


def summarise(results: dict, smoke: bool) -> list[dict]:
    """One row per (method, option): mean +- std of the metric and the paired comparison."""
    sync_every = harness.smoke_overrides()["outer.sync_every"] if smoke else SYNC_EVERY
    seeds = SEEDS[:1] if smoke else SEEDS
    rows = []
    for method in METHODS:
        metric = {o: np.array([sync_metric(results[run_name(method, o, s)]["eval"], sync_every,
                                           last=1 if smoke else 3) for s in seeds])
                  for o in (SMOKE_OPTIONS if smoke else OPTIONS)}  # fmt: skip
        for option, values in metric.items():
            base = BASELINE.get(option, "f32")
            cmp = {} if option in BASELINES else paired(values, metric[base])
            rows.append({"method": method, "option": option, "baseline": base if cmp else "",
                         "mean": float(values.mean()),
                         "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
                         "values": values.tolist(), **cmp})  # fmt: skip
    return rows


def p_text(p: float) -> str:
    """A p-value to three decimals, or to one significant digit below 0.0005 (0.00048 read
    "0.000", a p of zero)."""
    return f"{p:.3f}" if p >= 0.0005 else f"{p:.1g}"


def report(rows: list[dict], opts: harness.Options) -> str:
    table = [[r["method"], r["option"], f"{r['mean']:.4f} ± {r['std']:.4f}",
              "" if "diff" not in r else f"{r['diff']:+.4f} vs {r['baseline']}",
              "" if "p" not in r else p_text(r["p"]),
              "" if "better" not in r else f"{r['better']}/{r['n']}"] for r in rows]  # fmt: skip
    cmd = options.command("experiments.comm_quality")
    return (
        "## Communication options: quality in miniature (issue 21)\n\n"
        f"```bash\n{cmd}\n```\n\n"
        "nano model (L4_*: nano with 4 blocks), N = 8, H = 20 for both methods, 300 inner steps, "
        "seeds 0-2. Metric: pooled validation PPL over the last 3 evaluations at sync steps "
        "(100, 200, 300). Each option against its method's baseline run of the same seed "
        "(float32 / P = 1 / tau = 0 nano; L4_P1 for the 4-block options): mean paired "
        "difference (negative = better), two-sided paired t-test p, and how many seeds "
        "improved.\n\n"
        + harness.md_table(["method", "option", "PPL (mean ± std)", "vs baseline", "p",
                            "better"],
                           table)  # fmt: skip
    )


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    opts = options.grid_options()
    results = options.train_grid(CONFIG, grid(opts.smoke), opts, runs_subdir="comm_quality",
                                 name="comm_quality")  # fmt: skip
    if results is None:
        return
    rows = summarise(results, opts.smoke)
    harness.write_outputs(opts, "comm_quality", {**results, "_rows": rows}, report(rows, opts))


if __name__ == "__main__":
    options.run(main)
