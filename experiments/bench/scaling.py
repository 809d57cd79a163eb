"""Simulation scaling: time per inner step of N vmap-simulated replicas of the tiny model on one CPU.

    python -m experiments.bench.scaling [--smoke]

NoLoCo (H = 10, one sync per measured chunk of 10 steps) with the default run's per-replica
batch. Ideal: time grows linearly in N (constant time per replica-step). Peak memory is the
compiled program's argument + output + temporary bytes (XLA's memory analysis, deterministic).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import options
from experiments.bench import common
from noloco_jax import models, replicas
from noloco_jax.trainer.optimizer import build_optimizer
from noloco_jax.trainer.settings import OptimSettings, OuterSettings
from noloco_jax.trainer import grads
from noloco_jax.trainer.step import TrainState

for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    smoke = options.SMOKE.value
    preset, ns, b, t, k, reps = (("nano", [1, 2, 4], 2, 16, 2, 2) if smoke
                                 else ("tiny", [1, 2, 4, 8, 16, 32, 64], 4, 64, 10, 3))  # fmt: skip
    cfg = models.get_preset(preset, vocab_size=256)
    graphdef, params0 = models.init_params(cfg, 0)
    rows, results = [], {"env": common.environment(), "rows": []}
    base = None
    for n in ns:
        tx = build_optimizer("noloco", OptimSettings(), OuterSettings(sync_every=k, group_size=2),
                             num_steps=10_000, num_replicas=n)  # fmt: skip
        single = TrainState(jnp.zeros([], jnp.int32), params0, tx.init(params0))
        state = replicas.replicate(single, n)
        fn = common.TrainerChunk(replicas.Replicas(n), k, k, grads_fn=grads.plain(graphdef),
                                 tx=tx, donate=False)  # each call: steps 0 .. k-1; fmt: skip
        tokens = jnp.asarray(np.random.default_rng(n).integers(1, 256, (n, k, b, t + 1)), jnp.int32)
        mem = fn.memory(state, tokens)
        peak = sum(getattr(mem, a, 0) for a in ("argument_size_in_bytes", "output_size_in_bytes",
                                                "temp_size_in_bytes"))  # fmt: skip
        times = common.interleaved({"run": functools.partial(fn, state, tokens)}, reps)["run"]
        step = common.summary([x / k for x in times])["median_s"]
        base = base or step
        tok = n * b * t / step
        rec = {"N": n, "s_per_step": step, "tokens_per_s": tok, "tokens_per_s_per_replica": tok / n,
               "peak_bytes": peak, "time_vs_linear": step / (base * n)}  # fmt: skip
        results["rows"].append(rec)
        rows.append([n, 1e3 * step, round(tok), round(tok / n), f"{step / (base * n):.2f}",
                     f"{peak / 2**20:.0f}"])  # fmt: skip
    cmd = options.command("experiments.bench.scaling")
    md = (f"### Simulation scaling (vmap replicas on one CPU)\n\n`{cmd}` — {preset} model, NoLoCo "
          f"H = {k}, {b} x {t} tokens per replica per step, median of {reps} chunks of {k} steps "
          f"({results['env']['device']}, {results['env']['num_devices']} visible devices, 2 cores)."
          " 'vs linear' = time per step / (N x time per step at N = 1): 1.00 is perfectly "
          "linear, below 1 means batching replicas uses the cores better.\n\n"
          + common.md_table(["N", "ms / step", "tokens/s", "tokens/s per replica", "vs linear",
                             "peak MiB"], rows))  # fmt: skip
    common.write("bench_scaling", results, md, options.out_dir())


if __name__ == "__main__":
    options.run(main)
