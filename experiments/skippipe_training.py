"""SkipPipe in miniature: convergence with skipped stages, and robustness to omitted stages.

    python -m experiments.skippipe_training [--jobs 2] [--smoke ...]

Runs (configs/exp_skippipe.py): the full pipeline (no skipping), 25 % and 50 % skip, and 50 %
skip with the full model every 10th step. Reports validation perplexity of the full model per
step and per simulated second (iteration times from skippipe_schedules.json in --out_dir, else
experiments/results; geo-distributed setting, when present), and the perplexity increase when
25 % / 50 % of the stages are omitted at inference (stage 0 kept plus a sorted random subset;
averaged over subsets and replicas) for skip-trained vs normally trained models (paper: +7 %
at 50 %), relative to the model itself and to the normally trained full model.

Equal simulated time: for each skip run, a full-pipeline run (``full_until_<run>``) whose
length, and so its warmup-cosine schedule, ends at the skip run's simulated time budget, so
that it is compared finished, not read mid-schedule before its learning rate has decayed.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import options
from noloco_jax.experiments import harness

CONFIG = harness.ROOT / "configs" / "exp_skippipe.py"

for _name in options.GRID_FLAGS:
    flags.declare_key_flag(_name)


def grid(smoke: bool, times: dict[str, float] | None = None) -> list[harness.Run]:
    """The runs; with simulated iteration ``times``, also the equal-time full-pipeline runs."""
    s = 2 if smoke else 4  # the nano smoke model has 2 blocks
    runs = [harness.Run("full", {"skip.num_stages": 0})]
    for pct, length in ((25, s - s // 4), (50, s // 2)):
        runs.append(harness.Run(f"skip{pct}", {"skip.num_stages": s, "skip.path_length": length}))
    runs.append(harness.Run("skip50_full10", {"skip.num_stages": s, "skip.path_length": s // 2,
                                              "skip.full_every": 10}))  # fmt: skip
    runs = [r for r in runs if r.name != "skip25" or s >= 4]
    return runs + equal_time_runs(runs, times or {}, smoke)


def equal_time_runs(runs: list[harness.Run], times: dict[str, float], smoke: bool
                    ) -> list[harness.Run]:  # fmt: skip
    """A full-pipeline run per skip run, as many steps as fit in the skip run's simulated time
    (rounded to whole log chunks), its schedule ending there."""
    if "full" not in times:
        return []
    base = harness.load_config(CONFIG, harness.smoke_overrides() if smoke else {})
    out = []
    for run in runs[1:]:
        sec = _seconds_per_iteration(run, times)
        if sec is None:
            continue
        fit = base.num_steps * sec / times["full"] / base.log_every  # chunks in the budget
        chunks = max(1, math.floor(fit + 1e-9))  # not round(): 29.7 chunks would overrun it
        steps = chunks * base.log_every
        out.append(harness.Run(f"full_until_{run.name}", {"skip.num_stages": 0},
                               pinned={"num_steps": steps, "checkpoint_every": steps}))
    return out[:1] if smoke else out  # the smoke version checks the mechanism once


def _omission(run: harness.Run, opts: harness.Options, keep_fractions: Sequence[float],
              subsets: int) -> dict[float, float]:  # fmt: skip
    """Mean perplexity with only a fraction of the stages (stage 0 always kept), per fraction:
    the run's checkpoint read once, one compiled program per subset of stages (runs share it)."""
    from noloco_jax.trainer import from_config
    from noloco_jax.trainer.loop import load_run

    over = {**run.overrides, **(harness.smoke_overrides(run.overrides) if opts.smoke else {}),
            **harness.data_overrides(opts), **run.pinned}  # fmt: skip
    settings = from_config(harness.load_config(CONFIG, over))
    root = opts.runs_dir / ("skippipe" + ("_smoke" if opts.smoke else ""))
    graphdef, params, data = load_run(settings, root / run.name)
    num_layers = jax.tree.leaves(params["blocks"])[0].shape[1]
    stages = num_layers  # one block per stage
    windows = jnp.asarray(data.eval_windows)
    out = {}
    for keep_fraction in keep_fractions:
        keep = max(1, round(keep_fraction * stages))
        rng = np.random.default_rng(0)
        losses = []
        for _ in range(subsets):
            ids = np.concatenate([[0], np.sort(rng.choice(np.arange(1, stages), keep - 1, False))])
            per_window = _replica_losses(params, windows, tuple(int(i) for i in ids), graphdef)
            losses.append(float(per_window.mean()))
        out[keep_fraction] = math.exp(float(np.mean(losses)))
    return out


@functools.partial(jax.jit, static_argnums=(2, 3))
def _replica_losses(params: Any, windows: jax.Array, stage_ids: tuple[int, ...],
                    graphdef: Any) -> jax.Array:  # fmt: skip
    """All replicas in one compiled call: [N, W] per-window losses with only ``stage_ids``."""
    from noloco_jax.skippipe.training import omitted_stage_loss

    one = functools.partial(omitted_stage_loss, stage_ids=np.asarray(stage_ids),
                            graphdef=graphdef, layers_per_stage=1)  # fmt: skip
    return jax.vmap(one, in_axes=(0, None))(params, windows)


def _iteration_times(out_dir: pathlib.Path, smoke: bool) -> dict[str, float]:
    """The simulated iteration times of experiments.skippipe_schedules: its run into the same
    --out_dir if there is one, else the published one. A full run never takes a smoke run's
    times (they set the control runs' lengths)."""
    for folder in (out_dir, harness.RESULTS):
        path = folder / "skippipe_schedules.json"
        if not path.exists():
            continue
        saved = json.loads(path.read_text())
        if not smoke and "--smoke" in saved.get("command", ""):
            print(f"not using the smoke-run times in {path}", flush=True)
            continue
        print(f"simulated iteration times from {path}", flush=True)
        return saved.get("training_iteration_times", {})
    return {}


def _stored_analysis(opts: harness.Options) -> dict:
    """The analysis a --report_only rewrite reads back: the runs' checkpoints may be gone."""
    path = opts.out_dir / "skippipe_training.json"
    if not opts.report_only or not path.exists():
        return {}
    return json.loads(path.read_text()).get("_analysis", {})


def _seconds_per_iteration(run: harness.Run, times: dict[str, float]) -> float | None:
    """Simulated s / iteration; with full_every = k, every k-th iteration runs the full model."""
    base = times.get(run.name.split("_")[0])
    k = run.overrides.get("skip.full_every", 0)
    if base is None or (k and "full" not in times):
        return None
    return (base * (k - 1) + times["full"]) / k if k else base


def _equal_time(results: dict, runs: list[harness.Run], times: dict) -> tuple[list, dict]:
    """Rows and json of the per-step and equal-simulated-time comparison."""
    full_evals = results["full"]["eval"]
    rows, out = [], {}
    for run in runs:
        if run.name.startswith("full_until_"):
            continue
        last = results[run.name]["eval"][-1]
        sec = _seconds_per_iteration(run, times)
        entry = {"final_ppl": last["val_ppl"], "steps": last["step"], "s_per_iteration": sec,
                 "simulated_s": last["step"] * sec if sec else None}  # fmt: skip
        if sec and times.get("full"):  # the full pipeline's curve read at that time (mid-schedule)
            t_full = [e["step"] * times["full"] for e in full_evals]
            entry["full_mid_schedule_ppl"] = float(np.interp(
                entry["simulated_s"], t_full, [e["val_ppl"] for e in full_evals]))
        eq = results.get(f"full_until_{run.name}")
        if eq:  # the full pipeline trained with a schedule that ends at that time
            entry["full_equal_time_ppl"] = eq["eval"][-1]["val_ppl"]
            entry["full_equal_time_steps"] = eq["eval"][-1]["step"]
            entry["full_equal_time_s"] = eq["eval"][-1]["step"] * times["full"]
        out[run.name] = entry

        def f(key, fmt="{:.3f}"):
            return fmt.format(entry[key]) if entry.get(key) is not None else "n/a"

        rows.append([run.name, f"{last['val_ppl']:.3f}", f("s_per_iteration", "{:.3g}"),
                     f("simulated_s", "{:.4g}"), f("full_mid_schedule_ppl"),
                     f("full_equal_time_ppl") + (f" ({entry['full_equal_time_steps']} steps)"
                                                 if "full_equal_time_steps" in entry else "")])
    return rows, out


def _robustness(runs: list[harness.Run], results: dict, opts: harness.Options,
                subsets: int, stored: dict) -> tuple[list, dict]:  # fmt: skip
    """Rows and json: PPL with 75 % / 50 % of the stages, vs the model itself and vs the
    normally trained full model (``stored``: values read back instead of measured)."""
    rows, out = [], {}
    reference = math.exp(results["full"]["eval"][-1]["val_loss"])
    for run in runs:
        if run.name.startswith("full_until_"):
            continue
        full = math.exp(results[run.name]["eval"][-1]["val_loss"])
        entry = {"full_model": full, "normally_trained_full_model": reference}
        row = [run.name, f"{full:.3f}"]
        saved = stored.get(run.name, {})
        missing = [frac for frac in (0.75, 0.5) if not saved.get(str(frac))]
        measured = _omission(run, opts, missing, subsets) if missing else {}
        for frac in (0.75, 0.5):
            ppl = saved.get(str(frac)) or measured[frac]
            entry[str(frac)] = ppl
            row.append(f"{ppl:.3f} ({100 * (ppl / full - 1):+.1f} % / "
                       f"{100 * (ppl / reference - 1):+.1f} %)")
        out[run.name] = entry
        rows.append(row)
    return rows, out


def report(results: dict, runs: list[harness.Run], opts: harness.Options
           ) -> tuple[dict, str]:  # fmt: skip
    stored = _stored_analysis(opts)
    times = stored.get("iteration_times") or _iteration_times(opts.out_dir, opts.smoke)
    rows, equal = _equal_time(results, runs, times)
    subsets = 2 if opts.smoke else 8
    rob, robustness = _robustness(runs, results, opts, subsets, stored.get("robustness", {}))
    cmd = options.command("experiments.skippipe_training")
    md = (
        "## SkipPipe in miniature: training with skipped stages\n\n"
        f"```bash\n{cmd}\n```\n\n"
        "Tiny Llama, 4 blocks = 4 stages of one block, data parallel over 4 pipelines, Table 2 "
        "schedule (600 steps). Validation perplexity of the full model, and the simulated "
        "wall time to reach it (iteration makespan of the matching schedule from "
        "skippipe_schedules, geo-distributed network, where available; with the full model every "
        "10th step, a tenth of the iterations take the full pipeline's time). Equal simulated "
        "time: 'mid-schedule' reads the 600-step full pipeline's validation curve at the run's "
        "final simulated time (before its learning rate has decayed, which favours the skip "
        "run); 'schedule ending there' is a full-pipeline run as long as fits in that time, its "
        "cosine ending there (the fair comparison).\n\n"
        + harness.md_table(["run", "final PPL (full model)", "s / iteration (sim.)",
                            "simulated seconds", "full pipeline, mid-schedule",
                            "full pipeline, schedule ending there"], rows)  # fmt: skip
        + "\nRobustness: perplexity when only 75 % / 50 % of the stages run at inference "
        f"(stage 0 + a sorted random subset, {subsets} subsets x all replicas); in brackets the "
        "change vs the model itself with all stages / vs the normally trained full model with "
        "all stages (paper: +2 % at 75 %, +7 % at 50 % for skip-trained models, vs themselves):"
        "\n\n"
        + harness.md_table(["run", "full model", "75 % of stages", "50 % of stages"], rob)
    )
    return {"equal_time": equal, "robustness": robustness, "iteration_times": times}, md


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    opts = options.grid_options()
    stored = _stored_analysis(opts)
    runs = grid(opts.smoke, stored.get("iteration_times") or _iteration_times(opts.out_dir,
                                                                              opts.smoke))
    results = options.train_grid(CONFIG, runs, opts, runs_subdir="skippipe",
                                 name="skippipe_training")  # fmt: skip
    if results is None:
        return
    analysis, md = report(results, runs, opts)
    harness.write_outputs(opts, "skippipe_training", {**results, "_analysis": analysis}, md)


if __name__ == "__main__":
    options.run(main)
