"""Beyond the paper: NoLoCo's gamma, group size n and sync period H, at N = 8.

    python -m experiments.sweeps [--jobs 2] [--smoke ...]

gamma is swept inside and outside the theory's sufficient range for alpha = 0.5, n = 2
(0.5 < gamma < 1.5); n over {2, 4, 8} (n = 8 = N is DiLoCo-like averaging with NoLoCo's
momentum); H over {5, 10, 20, 50}. Every other setting is the Table 2 NoLoCo run, whose
N = 8 seed-0 run is the shared baseline (gamma = beta = 0.7, n = 2, H = 10).
Writes experiments/results/sweeps.{json,md} and experiments/figures/sweeps.png.
"""

from __future__ import annotations

import math
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402

from configs.exp_table2 import METHODS  # noqa: E402
from experiments import options  # noqa: E402
from noloco_jax.experiments import harness  # noqa: E402
from noloco_jax.quadratic import gamma_bounds  # noqa: E402

for _name in options.GRID_FLAGS:
    flags.declare_key_flag(_name)

CONFIG = harness.ROOT / "configs" / "exp_table2.py"
BASE = {**METHODS["noloco"], "num_replicas": 8, "seed": 0, "outer.seed": 0}
SWEEPS = {
    "gamma": ("outer.gamma", [0.3, 1.2, 1.6, 2.2]),
    "group_size": ("outer.group_size", [4, 8]),
    "sync_every": ("outer.sync_every", [5, 20, 50]),
}
BASELINE = {"gamma": 0.7, "group_size": 2, "sync_every": 10}
SMOKE_VALUES = {"gamma": [2.2], "group_size": [], "sync_every": [5]}  # n = 2: no groups > 2


def grid(smoke: bool) -> list[harness.Run]:
    n = 2 if smoke else 8
    base = {**BASE, "num_replicas": n}
    runs = [harness.Run(f"noloco_n{n}_s0", base)]
    for sweep, (key, values) in SWEEPS.items():
        for v in SMOKE_VALUES[sweep] if smoke else values:
            runs.append(harness.Run(f"sweep_{sweep}_{v}_n{n}", {**base, key: v}))
    return runs


def _value(name: str, sweep: str) -> float | None:
    parts = name.split("_")
    if name.startswith(f"sweep_{sweep}_"):
        return float(parts[-2])
    return float(BASELINE[sweep]) if name.startswith("noloco_") else None


def report(results: dict, opts: harness.Options) -> str:
    lo, hi = gamma_bounds(0.5, 2)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    sections = []
    for ax, sweep in zip(axes, SWEEPS):
        rows = []
        for name, run in results.items():
            v = _value(name, sweep)
            if v is None:
                continue
            last = run["eval"][-1]
            note = ""
            if sweep == "gamma":
                note = "inside" if lo < v < hi else "outside"
            finite = math.isfinite(last["val_ppl"])
            rows.append([v, last["val_ppl"], last["val_ppl_avg_model"], last["val_ppl_ensemble"],
                         last["replica_spread"], note if finite else note + ", diverged"])  # fmt: skip
            steps = [r["step"] for r in run["eval"]]
            ax.plot(steps, [r["replica_spread"] for r in run["eval"]], label=f"{sweep} = {v:g}")
        rows.sort()
        header = [sweep, "pooled PPL", "averaged model", "ensemble", "spread"]
        if sweep == "gamma":
            header.append(f"theory range ({lo:.2f}, {hi:.2f})")
        else:
            rows = [r[:-1] for r in rows]
        sections.append(f"### {sweep}\n\n" + harness.md_table(header, rows))
        ax.set_yscale("log")
        ax.set_title(f"cross-replica spread vs step: {sweep}")
        ax.set_xlabel("inner step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = harness.save_figure(fig, harness.figure_path(opts, "sweeps"))
    plt.close(fig)
    cmd = "python -m experiments.sweeps" + (" --smoke" if opts.smoke else "")
    return (
        "## Beyond the paper: gamma, group size and sync period\n\n"
        f"```bash\n{cmd}\n```\n\n"
        "NoLoCo at N = 8, one seed, otherwise the Table 2 settings (baseline: gamma = beta = 0.7, "
        "n = 2, H = 10). Final pooled, averaged-model and ensemble validation perplexity and the "
        "final cross-replica weight std.\n\n"
        + "\n".join(sections)
        + f"\n![sweeps](../figures/{path.name})\n"
    )


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    opts = options.grid_options()
    results = harness.run_grid(CONFIG, grid(opts.smoke), opts, runs_subdir="table2",
                               name="sweeps")  # fmt: skip
    harness.write_outputs(opts, "sweeps", results, report(results, opts))


if __name__ == "__main__":
    app.run(main)
