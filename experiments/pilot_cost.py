"""The measured cost of one run of the planned Table 2 regime, to size the full grid from.

    python -m experiments.pilot_cost [--presets nano,tiny] [--lengths 100,300] [--replicas 8]

Trains NoLoCo (the method with the most syncs) in the regime of
``noloco_jax.experiments.plan`` for two lengths, each run alone in a fresh process (as the
harness trains a grid with ``--jobs 2``), and fits wall seconds = fixed + per_step x steps:
``fixed`` is the process start, imports and compilation; ``per_step`` includes the
evaluations at the plan's cadence. It then prints the estimated CPU time of every grid of
the plan. The machine's load average is recorded next to the numbers: on a shared machine
the times are upper bounds of an idle machine's. Writes pilot_cost.{json,md}.
"""

from __future__ import annotations

import os
import pathlib
import resource
import tempfile
import time
from typing import Sequence

from absl import flags

from experiments import options
from noloco_jax.experiments import harness, plan
from noloco_jax.models.presets import preset_names

CONFIG = harness.ROOT / "configs" / "exp_table2.py"
PRESETS = flags.DEFINE_list("presets", ["nano", "tiny"], "Model presets to time.")
LENGTHS = flags.DEFINE_list("lengths", ["100", "300"], "Two run lengths in steps.")
REPLICAS = flags.DEFINE_integer("replicas", 8, "Replicas N of the timed runs.", lower_bound=1)
flags.register_validator("presets", lambda v: bool(v) and set(v) <= set(preset_names()),
                         message=f"takes model presets, comma-separated: {preset_names()}")
_LOG, _WARMUP = plan.REGIME["log_every"], plan.REGIME["optim.warmup_steps"]
flags.register_validator(  # a run as short as the plan's warmup failed on a field never set
    "lengths", lambda v: len(v) == 2 and all(
        x.isdigit() and int(x) > _WARMUP and int(x) % _LOG == 0 for x in v)
    and int(v[0]) != int(v[1]),  # 100,0100: two runs, then a ZeroDivisionError in the fit
    message=f"takes two different step counts above the plan's warmup of {_WARMUP} steps and "
            f"multiples of its log_every={_LOG} (e.g. 100,300)")

for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)


# --smoke: seconds-long runs that go through every step of the measurement (not a cost).
SMOKE_RUNS = {"presets": ["nano"], "lengths": [10, 20], "replicas": 2,
              "overrides": {"optim.warmup_steps": 2, "log_every": 2, "eval_every": 10}}


def time_run(preset: str, steps: int, n: int, root: pathlib.Path, extra: dict | None = None
             ) -> dict:  # fmt: skip
    """Wall seconds of one NoLoCo run in a fresh process, and its summed chunk times."""
    over = {**plan.REGIME, **plan.METHODS["noloco"], "model.preset": preset, "num_steps": steps,
            "num_replicas": n, "checkpoint_every": steps, **(extra or {})}  # fmt: skip
    cfg = harness.load_config(CONFIG, over)
    workdir = root / f"{preset}_{steps}"
    load = os.getloadavg()[0]
    t0, cpu0 = time.perf_counter(), _children_cpu()
    harness.train_in_processes([(workdir, cfg)], jobs=1)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    chunks = harness.read_run(workdir)["train"]
    tokens = cfg.log_every * cfg.global_batch_size * cfg.data.seq_len
    steady = [tokens / r["tokens_per_sec"] for r in chunks[2:]]  # the first chunks compile
    return {"preset": preset, "steps": steps, "wall_s": wall, "cpu_s": cpu, "load_before": load,
            "load_after": os.getloadavg()[0],
            "train_s_per_step": sum(steady) / (len(steady) * cfg.log_every)}  # fmt: skip


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished child processes."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def fit(a: dict, b: dict, key: str = "cpu_s") -> dict[str, float]:
    """fixed + per_step x steps through two timed runs (CPU seconds by default)."""
    per_step = (b[key] - a[key]) / (b["steps"] - a["steps"])
    return {"per_step_s": per_step, "fixed_s": a[key] - per_step * a["steps"]}


def planned_runs() -> dict[str, int]:
    """{run name: steps} of every run the plan trains in the Table 2 family (shared once)."""
    from experiments import dropout, sweeps  # noqa: PLC0415
    from noloco_jax.experiments import table2  # noqa: PLC0415

    runs = [*table2.grid(False), *sweeps.grid(False), *dropout.grid(False)]
    return {r.name: int(r.overrides["num_steps"]) for r in runs}


def report(timed: list[dict], fits: dict[str, dict], n: int, smoke: bool = False) -> str:
    rows = [[t["preset"], t["steps"], f"{t['wall_s']:.1f}", f"{t['cpu_s']:.1f}",
             f"{1e3 * t['train_s_per_step']:.1f}",
             f"{t['load_before']:.1f} / {t['load_after']:.1f}"] for t in timed]  # fmt: skip
    runs = planned_runs()
    h = plan.METHODS["noloco"]["outer.sync_every"]
    cost = []
    for preset, f in fits.items():
        run_s = f["fixed_s"] + f["per_step_s"] * plan.REGIME["num_steps"]
        total = sum(f["fixed_s"] + f["per_step_s"] * steps for steps in runs.values())
        cost.append([preset, f"{f['fixed_s']:.1f}", f"{1e3 * f['per_step_s']:.1f}",
                     f"{f['per_step_s'] * h:.2f}", f"{run_s / 60:.1f}",
                     f"{total / 3600:.1f}"])  # fmt: skip
    return (
        "## Cost of one run of the planned regime\n\n"
        + ("```bash\npython -m experiments.pilot_cost --smoke\n```\n\n(smoke: the "
           "measurement's every step on seconds-long runs; not a cost)\n\n" if smoke else
           f"```bash\npython -m experiments.pilot_cost --presets {','.join(fits)} "
           f"--lengths {','.join(str(t['steps']) for t in timed[:2])} --replicas {n}\n```\n\n")
        + f"NoLoCo, N = {n}, the regime of noloco_jax/experiments/plan.py, each run alone in a "
        "fresh process. CPU s = user + system seconds of that process (all its threads); "
        "load = the machine's 1-minute load average before / after the run (2 cores).\n\n"
        + harness.md_table(["preset", "steps", "wall s", "CPU s", "train ms / step (wall, "
                            "no eval)", "load"], rows)  # fmt: skip
        + "\nFit CPU s = fixed + per_step x steps (per_step includes the evaluations), and the "
        f"estimated CPU time of the {len(runs)} distinct runs of the Table 2 family (table2, "
        "sweeps, dropout; spread_vs_lr reuses table2's), assuming the N = "
        f"{n} cost per step for every N (the global batch is the same):\n\n"
        + harness.md_table(["preset", "fixed CPU s", "CPU ms / step",
                            f"CPU s / NoLoCo round (H = {h})",
                            f"CPU min / run of {plan.REGIME['num_steps']} steps",
                            "CPU h, whole family"], cost)  # fmt: skip
    )


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    options.smoke_sets("presets", "lengths", "replicas")
    smoke = options.SMOKE.value
    lengths = sorted(int(x) for x in (SMOKE_RUNS["lengths"] if smoke else LENGTHS.value))
    presets = SMOKE_RUNS["presets"] if smoke else PRESETS.value
    n = SMOKE_RUNS["replicas"] if smoke else REPLICAS.value
    timed, fits = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            pair = [time_run(preset, s, n, pathlib.Path(tmp),
                             SMOKE_RUNS["overrides"] if smoke else None) for s in lengths]
            print(pair, flush=True)
            timed += pair
            fits[preset] = fit(*pair)
    harness.write_outputs(harness.Options(out_dir=options.out_dir(), smoke=smoke), "pilot_cost",
                          {"timed": timed, "fits": fits}, report(timed, fits, n, smoke))


if __name__ == "__main__":
    options.run(main)
