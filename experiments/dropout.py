"""Replica drop-out: NoLoCo vs what DiLoCo must do instead (skip the round, or wait).

    python -m experiments.dropout [--jobs 2] [--smoke ...]

N = 8, the settings of the Table 2 runs (noloco_jax.experiments.table2.run_overrides; its
N = 8 seed-0 runs are p = 0). Each replica misses each outer round with probability p
(deterministic from the seed). NoLoCo: a replica without its partner takes a local-only outer
step; nothing blocks. DiLoCo "skip": the
present replicas all-reduce among themselves, absent ones step alone (and stay apart: DiLoCo has
no pull back). DiLoCo "skip, re-sync" (fault.resync_absent): an absent replica takes the present
ones' step, as when a returning replica is sent the shared weights; its round's work is lost.
DiLoCo "wait": the math of p = 0, but every round in which some replica is absent waits for it;
with an absence lasting one round, the expected time per round grows by the factor
1 + (1 - (1 - p)^N).
Writes experiments/results/dropout.{json,md}.
"""

from __future__ import annotations

from typing import Sequence

from absl import flags

from experiments import options
from noloco_jax.experiments import harness, plan, stats, table2

for _name in options.GRID_FLAGS:
    flags.declare_key_flag(_name)

CONFIG = harness.ROOT / "configs" / "exp_table2.py"
PROBS = (0.1, 0.3)


def grid(smoke: bool) -> list[harness.Run]:
    n = 2 if smoke else 8
    runs = []
    for method in ("noloco", "diloco"):
        base = table2.run_overrides(method, n, 0)  # the Table 2 run is p = 0
        runs.append(harness.Run(f"{method}_n{n}_s0", base))
        for p in PROBS:
            runs.append(harness.Run(f"dropout_{method}_p{p}_n{n}", {**base, "fault.dropout_prob": p}))
    base = table2.run_overrides("diloco", n, 0)  # re-sync: DiLoCo's runs with one field more
    for p in PROBS:
        runs.append(harness.Run(f"dropout_diloco_resync_p{p}_n{n}",
                                {**base, "fault.dropout_prob": p, "fault.resync_absent": True}))
    return runs


def _metric(run: dict, period: int, key: str) -> float:
    return stats.run_metric(run, period, plan.LAST_K, key)


def report(results: dict, opts: harness.Options) -> str:
    n = 2 if opts.smoke else 8
    period = table2.sync_period(results[f"diloco_n{n}_s0"])
    rows = []
    variants = (("noloco", "noloco", "NoLoCo"), ("diloco", "diloco", "DiLoCo (skip)"),
                ("diloco_resync", "diloco", "DiLoCo (skip, re-sync)"))  # (name, p = 0 run, label)
    for method, at_zero, label in variants:
        for p in (0.0, *PROBS):
            name = f"{at_zero}_n{n}_s0" if p == 0 else f"dropout_{method}_p{p}_n{n}"
            run = results[name]
            rows.append([label, p, _metric(run, period, "val_ppl"),
                         _metric(run, period, "val_ppl_avg_model"),
                         run["eval"][-1]["replica_spread"], "1.00"])  # fmt: skip
    base = results[f"diloco_n{n}_s0"]
    for p in (0.0, *PROBS):
        slow = 1 + (1 - (1 - p) ** n)
        rows.append(["DiLoCo (wait)", p, _metric(base, period, "val_ppl"),
                     _metric(base, period, "val_ppl_avg_model"),
                     base["eval"][-1]["replica_spread"], f"{slow:.2f}"])  # fmt: skip
    cmd = options.command("experiments.dropout")
    return (
        "## Replica drop-out: NoLoCo steps alone, DiLoCo must skip or wait\n\n"
        f"```bash\n{cmd}\n```\n\n"
        f"N = {n} replicas, Table 2 settings, one seed; each replica misses each outer round "
        "with probability p. 'time factor' is the expected wall time per outer round relative "
        "to p = 0 (NoLoCo and DiLoCo-skip never wait; DiLoCo-wait waits whenever any of the N "
        "replicas is absent, assuming it returns one round later; compute time only). "
        "DiLoCo-skip: an absent replica steps alone and its slow weights stay apart; with "
        "re-sync it takes the present replicas' step instead (its round's work is lost; the "
        "download of the shared weights on return is not timed).\n\n"
        + f"PPL: the plan's metric (mean of the last {plan.LAST_K} evaluations at DiLoCo's "
        f"sync steps, multiples of {period}); spread: at the last evaluation.\n\n"
        + harness.md_table(["method", "p", "pooled PPL", "averaged model", "spread",
                            "time factor"], rows)  # fmt: skip
    )


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    opts = options.grid_options()
    results = options.train_grid(CONFIG, grid(opts.smoke), opts, runs_subdir="table2",
                                 name="dropout")  # fmt: skip
    if results is None:
        return
    harness.write_outputs(opts, "dropout", results, report(results, opts))


if __name__ == "__main__":
    options.run(main)
