"""Quick demo: 8 simulated replicas fit a small regression with NoLoCo.

Each replica sees its own noisy samples of the same linear-tanh teacher, runs
Adam locally and averages with one random partner every H steps. Prints the
mean training loss falling and the cross-replica spread.

    python -m experiments.demo [--replicas 8] [--steps 300] [--sync_every 20]
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax
from absl import flags

from experiments import options
from noloco_jax import local_steps, noloco_outer, replica_spread, replicas

REPLICAS = flags.DEFINE_integer("replicas", 8, "Simulated replicas.", lower_bound=1)
STEPS = flags.DEFINE_integer("steps", 300, "Inner steps.", lower_bound=1)
SYNC_EVERY = flags.DEFINE_integer("sync_every", 20, "Inner steps between syncs (H).",
                                  lower_bound=1)  # fmt: skip
flags.register_validator("replicas", lambda n: n % 2 == 0,
                         message="must be even: NoLoCo's groups here are pairs")
options.old_spellings("sync_every")


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    n, dim, hidden, batch = REPLICAS.value, 16, 32, 64
    sync_every = SYNC_EVERY.value
    key = jax.random.key(0)
    teacher = jax.random.normal(jax.random.fold_in(key, 1), (dim,)) / jnp.sqrt(dim)

    def init(k):
        k1, k2 = jax.random.split(k)
        return {
            "w1": jax.random.normal(k1, (dim, hidden)) / jnp.sqrt(dim),
            "w2": jax.random.normal(k2, (hidden,)) / jnp.sqrt(hidden),
        }

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    tx = local_steps(optax.adam(3e-3), noloco_outer(), sync_every=sync_every)
    params0 = init(jax.random.fold_in(key, 2))  # identical start on every replica
    reps = replicas.make_replicas(n, backend="vmap")
    params = replicas.replicate(params0, n)
    state = replicas.replicate(tx.init(params0), n)

    def step(p, s, k):
        x = jax.random.normal(k, (batch, dim))
        y = jnp.tanh(x @ teacher) + 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (batch,))
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, replica_spread(p, "replica")

    step = jax.jit(reps.map(step))
    for t in range(1, STEPS.value + 1):
        keys = jax.random.split(jax.random.fold_in(key, 100 + t), n)
        params, state, loss, spread = step(params, state, keys)
        if t % sync_every == 0 or t == STEPS.value:
            print(
                f"step {t:4d}  round {int(state.outer_state.round):3d}  "
                f"mean loss {float(loss.mean()):.4f}  replica spread {float(spread[0]):.2e}"
            )


if __name__ == "__main__":
    options.run(main)
