"""Diagnosis of the paper-small throughput miss: local_steps without any sync vs plain Adam.

    python experiments/bench/diag_local_steps_small.py   # ~3 min on 2 CPU cores

Same model (paper-small, 32k vocabulary), one 64-token sequence per step, chunks of 2 fused
steps, interleaved repetitions; ``local_steps`` with H = 10**9 never reaches its outer step, so
any difference is the cost of its every-step path.
"""

from __future__ import annotations

import functools

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax

from noloco_jax import local_steps, models, noloco_outer, replicas
from noloco_jax.trainer.step import TrainState, train_chunk


def main() -> None:
    cfg = models.get_preset("small", vocab_size=32000)
    graphdef, params = models.init_params(cfg, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 32000, (1, 2, 1, 65)), jnp.int32)
    clip = optax.clip_by_global_norm(1.0)
    variants = {
        "adam": optax.chain(clip, optax.adam(1e-3)),
        "local_steps(no sync)": optax.chain(clip, local_steps(optax.adam(1e-3), noloco_outer(),
                                                              10**9)),
    }  # fmt: skip
    fns = {}
    for name, tx in variants.items():
        state = replicas.replicate(TrainState(jnp.zeros([], jnp.int32), params, tx.init(params)), 1)
        step = jax.jit(replicas.Replicas(1).map(functools.partial(train_chunk, graphdef=graphdef,
                                                                  tx=tx)))  # fmt: skip
        fns[name] = functools.partial(step, state, tokens)
    times = common.interleaved(fns, 3)
    print({name: common.summary(t)["median_s"] for name, t in times.items()})


if __name__ == "__main__":
    main()
