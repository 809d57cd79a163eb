"""Diagnosis of the paper-small throughput miss: local_steps without any sync vs plain Adam.

    python experiments/bench/diag_local_steps_small.py   # ~3 min on 2 CPU cores
"""
import sys, functools, time
sys.path.insert(0, "/work/main/experiments/bench"); sys.path.insert(0, "/work/main")
import common, jax, jax.numpy as jnp, numpy as np, optax
from noloco_jax import local_steps, models, noloco_outer, replicas
from noloco_jax.trainer.step import TrainState, train_chunk
cfg = models.get_preset("small", vocab_size=32000)
graphdef, p0 = models.init_params(cfg, 0)
tok = jnp.asarray(np.random.default_rng(0).integers(1, 32000, (1, 2, 1, 65)), jnp.int32)
clip = optax.clip_by_global_norm(1.0)
vs = {"adam": optax.chain(clip, optax.adam(1e-3)),
      "local_steps(no sync)": optax.chain(clip, local_steps(optax.adam(1e-3), noloco_outer(), 10**9))}
fns = {}
for k, tx in vs.items():
    st = replicas.replicate(TrainState(jnp.zeros([], jnp.int32), p0, tx.init(p0)), 1)
    f = jax.jit(replicas.Replicas(1).map(functools.partial(train_chunk, graphdef=graphdef, tx=tx)))
    fns[k] = functools.partial(f, st, tok)
t = common.interleaved(fns, 3)
print({k: common.summary(v)["median_s"] for k, v in t.items()})
