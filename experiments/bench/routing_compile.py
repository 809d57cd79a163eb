"""Compile time of the simulated routed pipeline: one ppermute per pool entry vs one gather.

    python -m experiments.bench.routing_compile [--smoke] [--reps 2]

The trainer simulates pipeline stages under ``vmap`` (``trainer.grads.routed``). Each stage
boundary sends every micro-batch along a bijection drawn from a pool of ``routing_pool_size``
(``pipeline.routed.routed_loss``). Routed with ``ppermute``, each micro-batch needs a
``lax.switch`` over the whole pool, so the program grows with pool size x micro-batches;
routed with ``gather=True`` (what the trainer uses), each boundary is one gather. Both variants
of the loss and gradient (nano, 2 layers, N = 6 replicas, S = 2 stages) are lowered and compiled
from scratch, interleaved; the table gives the medians and the largest difference of their
losses and gradients on one batch.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import options
from experiments.bench import common
from noloco_jax import models, replicas
from noloco_jax import pipeline as pl

N, S, T = 6, 2, 8
CASES = [(64, 2), (64, 8), (256, 8)]  # (routing_pool_size, micro-batches per replica)
SMOKE_CASES = [(8, 2)]
REPS = flags.DEFINE_integer("reps", 2, "Compiles per variant and case.", lower_bound=1)
for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)


def _step(graphdef, pool, batch: int, gather: bool):
    """Loss and gradient of every replica, routed by the draw of step ``step`` (traced, as in
    the trainer: a constant draw would let the compiler fold the switches away)."""

    def one(params, tokens, step):
        idx = pl.route_indices(step, num_boundaries=S - 1, num_microbatches=batch,
                               pool_size=len(pool), seed=0)  # fmt: skip
        loss = lambda p: pl.routed_loss(p, tokens, idx, graphdef=graphdef, pool=pool,  # noqa: E731
                                        num_stages=S, gather=gather)
        return jax.value_and_grad(loss)(params)

    return jax.jit(replicas.Replicas(N).map(one))


def _compile_seconds(fn, *args) -> float:
    start = time.perf_counter()
    fn.lower(*args).compile()
    return time.perf_counter() - start


def _case(pool_size: int, batch: int, reps: int) -> dict:
    cfg = models.get_preset("nano", vocab_size=32, num_layers=2, max_seq_len=64)
    graphdef, _ = models.init_params(cfg, 0)
    params = jax.jit(jax.vmap(lambda k: models.init_params(cfg, k)[1]))(jax.random.split(
        jax.random.key(1), N))  # fmt: skip
    tokens = jax.random.randint(jax.random.key(2), (N, batch, T + 1), 1, 32)
    pool = pl.permutation_pool(N, pool_size, 0)
    step = jnp.asarray(3, jnp.int32)  # shared by the replicas, as the trainer's step counter
    times: dict[str, list[float]] = {"ppermute": [], "gather": []}
    for _ in range(reps):
        for name in times:  # a fresh jit each time: nothing is reused between compiles
            times[name].append(_compile_seconds(_step(graphdef, pool, batch, name == "gather"),
                                                params, tokens, step))  # fmt: skip
    out = {name: _step(graphdef, pool, batch, name == "gather")(params, tokens, step)
           for name in times}  # fmt: skip
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree.leaves(out["ppermute"]), jax.tree.leaves(out["gather"])))  # fmt: skip
    return {"pool": len(pool), "batch": batch, "times": times, "max_abs_diff": diff}


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    options.smoke_sets("reps")
    smoke = options.SMOKE.value
    reps = 1 if smoke else REPS.value
    rows = [_case(p, b, reps) for p, b in (SMOKE_CASES if smoke else CASES)]
    env = common.environment()
    results = {"env": env, "commit": env["commit"], "N": N, "S": S, "rows": rows}
    table = [[r["pool"], r["batch"], f"{np.median(r['times']['ppermute']):.2f}",
              f"{np.median(r['times']['gather']):.2f}",
              f"{np.median(r['times']['ppermute']) / np.median(r['times']['gather']):.1f}",
              f"{r['max_abs_diff']:.1e}"] for r in rows]  # fmt: skip
    cmd = options.command("experiments.bench.routing_compile")
    md = (f"### Compile time of the simulated routed pipeline\n\n`{cmd}` — loss and gradient of "
          f"N = {N} vmapped replicas, S = {S} stages (nano, 2 layers), routed with one ppermute "
          f"per pool entry (a switch per micro-batch) or with one gather per boundary; lower + "
          f"compile seconds, medians of {reps}, interleaved ({env['cpu']}, commit "
          f"{env['commit']}).\n\n"
          + common.md_table(["routing_pool_size", "micro-batches", "ppermute s", "gather s",
                             "ratio", "max |loss, grad diff|"], table))  # fmt: skip
    common.write("bench_routing_compile", results, md, options.out_dir())


if __name__ == "__main__":
    options.run(main)
