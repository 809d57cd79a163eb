"""SkipPipe in miniature: convergence with skipped stages, and robustness to omitted stages.

    python -m experiments.skippipe_training [--jobs 2] [--smoke ...]

Runs (configs/exp_skippipe.py): the full pipeline (no skipping), 25 % and 50 % skip, and 50 %
skip with the full model every 10th step. Reports validation perplexity of the full model per
step and per simulated second (iteration times from skippipe_schedules.json in --out_dir, else
experiments/results; geo-distributed setting, when present), and the perplexity increase when 25 % / 50 % of the
stages are omitted at inference (stage 0 kept plus a sorted random subset; averaged over
subsets and replicas) for skip-trained vs normally trained models (paper: +7 % at 50 %).
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import options
from noloco_jax.experiments import harness

CONFIG = harness.ROOT / "configs" / "exp_skippipe.py"

for _name in options.GRID_FLAGS:
    flags.declare_key_flag(_name)


def grid(smoke: bool) -> list[harness.Run]:
    s = 2 if smoke else 4  # the nano smoke model has 2 blocks
    runs = [harness.Run("full", {"skip.num_stages": 0})]
    for pct, length in ((25, s - s // 4), (50, s // 2)):
        runs.append(harness.Run(f"skip{pct}", {"skip.num_stages": s, "skip.path_length": length}))
    runs.append(harness.Run("skip50_full10", {"skip.num_stages": s, "skip.path_length": s // 2,
                                              "skip.full_every": 10}))  # fmt: skip
    return [r for r in runs if r.name != "skip25" or s >= 4]


def _omission(run: harness.Run, opts: harness.Options, keep_fraction: float,
              subsets: int) -> float:  # fmt: skip
    """Mean perplexity with only a fraction of the 4 stages (stage 0 always kept)."""
    from noloco_jax.trainer import from_config
    from noloco_jax.trainer.loop import load_run
    from noloco_jax.skippipe.training import omitted_stage_loss

    over = {**run.overrides, **(harness.smoke_overrides() if opts.smoke else {}),
            **harness.data_overrides(opts)}  # fmt: skip
    settings = from_config(harness.load_config(CONFIG, over))
    root = opts.runs_dir / ("skippipe" + ("_smoke" if opts.smoke else ""))
    graphdef, params, data = load_run(settings, root / run.name)
    num_layers = jax.tree.leaves(params["blocks"])[0].shape[1]
    stages = num_layers  # one block per stage
    keep = max(1, round(keep_fraction * stages))
    rng = np.random.default_rng(0)
    windows = jnp.asarray(data.eval_windows)
    losses = []
    for _ in range(subsets):
        ids = np.concatenate([[0], np.sort(rng.choice(np.arange(1, stages), keep - 1, False))])
        one = functools.partial(omitted_stage_loss, stage_ids=ids, graphdef=graphdef,
                                layers_per_stage=1)  # fmt: skip
        # All replicas in one compiled call: [N, W] per-window losses.
        per_window = jax.jit(jax.vmap(one, in_axes=(0, None)))(params, windows)
        losses.append(float(per_window.mean()))
    return math.exp(float(np.mean(losses)))


def _iteration_times(out_dir: pathlib.Path) -> dict[str, float]:
    """The simulated iteration times of experiments.skippipe_schedules: its run into the same
    --out_dir if there is one, else the published one."""
    for folder in (out_dir, harness.RESULTS):
        path = folder / "skippipe_schedules.json"
        if path.exists():
            print(f"simulated iteration times from {path}", flush=True)
            return json.loads(path.read_text()).get("training_iteration_times", {})
    return {}


def _seconds_per_iteration(run: harness.Run, times: dict[str, float]) -> float | None:
    """Simulated s / iteration; with full_every = k, every k-th iteration runs the full model."""
    base = times.get(run.name.split("_")[0])
    k = run.overrides.get("skip.full_every", 0)
    if base is None or (k and "full" not in times):
        return None
    return (base * (k - 1) + times["full"]) / k if k else base


def report(results: dict, runs: list[harness.Run], opts: harness.Options) -> str:
    times = _iteration_times(opts.out_dir)
    full_evals = results["full"]["eval"]
    rows = []
    for run in runs:
        last = results[run.name]["eval"][-1]
        sec = _seconds_per_iteration(run, times)
        at_same_time = "n/a"
        if sec and times.get("full"):  # the full pipeline's PPL after the same simulated time
            t_full = [e["step"] * times["full"] for e in full_evals]
            at_same_time = f"{np.interp(last['step'] * sec, t_full, [e['val_ppl'] for e in full_evals]):.3f}"
        rows.append([run.name, last["val_ppl"], f"{sec:.3g}" if sec else "n/a",
                     f"{last['step'] * sec:.4g}" if sec else "n/a", at_same_time])  # fmt: skip
    rob = []
    subsets = 2 if opts.smoke else 8
    for run in runs:
        full = math.exp(results[run.name]["eval"][-1]["val_loss"])
        row = [run.name, full]
        for frac in (0.75, 0.5):
            ppl = _omission(run, opts, frac, subsets)
            row.append(f"{ppl:.3f} ({100 * (ppl / full - 1):+.1f} %)")
        rob.append(row)
    cmd = "python -m experiments.skippipe_training" + (" --smoke" if opts.smoke else "")
    return (
        "## SkipPipe in miniature: training with skipped stages\n\n"
        f"```bash\n{cmd}\n```\n\n"
        "Tiny Llama, 4 blocks = 4 stages of one block, data parallel over 4 pipelines, Table 2 "
        "schedule (600 steps). Validation perplexity of the full model, and the simulated "
        "wall time to reach it (iteration makespan of the matching schedule from "
        "skippipe_schedules, geo-distributed network, where available; with the full model every "
        "10th step, a tenth of the iterations take the full pipeline's time). The last column "
        "reads the full pipeline's validation curve (linear interpolation between evaluations) "
        "at the run's final simulated time: equal wall-clock instead of equal steps.\n\n"
        + harness.md_table(["run", "final PPL (full model)", "s / iteration (sim.)",
                            "simulated seconds", "full pipeline's PPL at that time"],
                           rows)  # fmt: skip
        + "\nRobustness: perplexity when only 75 % / 50 % of the stages run at inference "
        f"(stage 0 + a sorted random subset, {subsets} subsets x all replicas; change vs the "
        "full model; paper: +2 % at 75 %, +7 % at 50 % for skip-trained models):\n\n"
        + harness.md_table(["run", "full model", "75 % of stages", "50 % of stages"], rob)
    )


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    opts = options.grid_options()
    runs = grid(opts.smoke)
    results = harness.run_grid(CONFIG, runs, opts, runs_subdir="skippipe",
                               name="skippipe_training")  # fmt: skip
    harness.write_outputs(opts, "skippipe_training", results, report(results, runs, opts))


if __name__ == "__main__":
    app.run(main)
