"""What the test suite's compile flags buy and cost, on the suite's standard training run.

    python -m experiments.bench.opt_level [--smoke] [--reps 3]

The test suite (tests/conftest.py) runs XLA:CPU with ``--xla_backend_optimization_level=0``
(LLVM's optimizations off), ``--xla_cpu_use_fusion_emitters=false`` (XLA:CPU's older fusion
emitters, not the MLIR ones) and ``--xla_cpu_parallel_codegen_split_count=1`` (the LLVM module
compiled in one part, not split for parallel compiling). This trains the tests' shared NoLoCo run
(nano preset, 4 vmap replicas, H = 6, 12 steps, evaluations and checkpoints every 4, on Python's
bundled help topics) in a fresh process per repetition, with XLA's default flags and with these
flags added one at a time, interleaved (default, 0, 0 + old, 0 + old + one part, default, ...).
Reported per flag set: XLA compile seconds summed over every program of the run
(jax.monitoring's backend-compile events) and how many programs, the run's wall seconds, the
final train loss and validation perplexity, and whether the final checkpoint's checksums equal
the default's. Ratios are against the default flags, medians over repetitions.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import numpy as np
from absl import flags

from experiments import options
from experiments.bench import common

for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)
REPS = flags.DEFINE_integer("reps", 3, "Fresh processes per flag set (1 with --smoke).",
                            lower_bound=1)  # fmt: skip
WORKER = flags.DEFINE_string("worker", None, "Internal: train once in this process and write "
                             "the record to this JSON file.")  # fmt: skip

LEVELS = {"default": "", "0": "--xla_backend_optimization_level=0",
          "0, old emitters": "--xla_backend_optimization_level=0 "
                             "--xla_cpu_use_fusion_emitters=false",
          "0, old emitters, one part": "--xla_backend_optimization_level=0 "
                                       "--xla_cpu_use_fusion_emitters=false "
                                       "--xla_cpu_parallel_codegen_split_count=1"}  # fmt: skip
STEPS = 12


def _settings(corpus: pathlib.Path, data_dir: pathlib.Path):
    from noloco_jax.trainer import settings as settings_lib  # noqa: PLC0415

    return settings_lib.from_config({
        "method": "noloco", "num_replicas": 4, "backend": "vmap", "global_batch_size": 8,
        "num_steps": STEPS, "log_every": 2, "eval_every": 4, "checkpoint_every": 4,
        "model": {"preset": "nano"},
        "data": {"source": "files", "path": str(corpus), "data_dir": str(data_dir),
                 "seq_len": 32, "eval_windows": 8},
        "optim": {"learning_rate": 3e-3, "warmup_steps": 2}, "outer": {"sync_every": 6},
    })  # fmt: skip


def _train_once(out: pathlib.Path) -> None:
    """The worker: one run in this process, its compile events counted."""
    import jax  # noqa: PLC0415
    from pydoc_data.topics import topics  # noqa: PLC0415

    from noloco_jax.trainer.checkpoint import Checkpointer  # noqa: PLC0415
    from noloco_jax.trainer.loop import train_and_evaluate  # noqa: PLC0415

    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: compiles.append(secs)
        if event == "/jax/core/compile/backend_compile_duration" else None)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp)
        (base / "corpus").mkdir()
        for i, (name, text) in enumerate(sorted(topics.items())[:40]):
            (base / "corpus" / f"{i:02d}_{name}.txt").write_text(text, encoding="utf-8")
        start = time.perf_counter()
        last = train_and_evaluate(_settings(base / "corpus", base / "data"), base / "run",
                                  progress=False)  # fmt: skip
        wall = time.perf_counter() - start
        checksums = Checkpointer(base / "run" / "checkpoints").read_meta(STEPS)["checksums"]
    out.write_text(json.dumps({
        "wall_s": wall, "compile_s": sum(compiles), "programs": len(compiles),
        "train_loss": last["train_loss"], "val_ppl": last["val_ppl"], "checksums": checksums}))


def _spawn(level: str, out: pathlib.Path) -> dict:
    env = {**os.environ, "XLA_FLAGS": LEVELS[level], "JAX_PLATFORMS": "cpu",
           "TF_CPP_MIN_LOG_LEVEL": "3"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "experiments.bench.opt_level", "--worker",
                           str(out)], env=env, capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"the level-{level} run failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _row(level: str, runs: list[dict], base: list[dict]) -> list:
    med = {k: float(np.median([r[k] for r in runs])) for k in ("compile_s", "wall_s")}
    ref = {k: float(np.median([r[k] for r in base])) for k in ("compile_s", "wall_s")}
    same = all(r["checksums"] == base[0]["checksums"] for r in runs)
    return [level, runs[0]["programs"], f"{med['compile_s']:.2f}",
            f"{med['compile_s'] / ref['compile_s']:.3f}", f"{med['wall_s']:.2f}",
            f"{med['wall_s'] / ref['wall_s']:.3f}", repr(runs[0]["train_loss"]),
            f"{runs[0]['val_ppl']:.6f}", "yes" if same else "no"]  # fmt: skip


def main(argv: Sequence[str]) -> None:
    if WORKER.value:
        return _train_once(pathlib.Path(WORKER.value))
    options.start(argv)
    options.smoke_sets("reps")
    reps = 1 if options.SMOKE.value else REPS.value
    runs: dict[str, list[dict]] = {level: [] for level in LEVELS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(reps):
            for j, level in enumerate(LEVELS):
                runs[level].append(_spawn(level, pathlib.Path(tmp) / f"{j}_{i}.json"))
    env = common.environment()
    results = {"env": env, "commit": env["commit"], "steps": STEPS, "runs": runs}
    rows = [_row(level, runs[level], runs["default"]) for level in LEVELS]
    cmd = options.command("experiments.bench.opt_level")
    md = (f"### Compile flags of the test suite: XLA:CPU's defaults vs LLVM at level 0, the older "
          f"fusion emitters and one codegen part\n\n"
          f"`{cmd}` — the tests' shared NoLoCo run (nano, 4 vmap replicas, H = 6, {STEPS} steps, "
          f"evaluations and checkpoints every 4), one fresh process per run, flag sets "
          f"interleaved, {reps} run(s) per set, medians; ratios against the default flags "
          f"({results['env']['cpu']}, commit {results['commit']}).\n\n"
          + common.md_table(["XLA:CPU flags", "programs", "compile s", "compile ratio", "wall s",
                             "wall ratio", "final train loss", "final val ppl",
                             "checksums = default"], rows))  # fmt: skip
    common.write("bench_opt_level", results, md, options.out_dir())


if __name__ == "__main__":
    options.run(main)
