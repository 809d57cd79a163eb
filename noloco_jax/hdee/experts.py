"""Domain experts trained embarrassingly parallel, and the three equal-compute ensembles.

A seed model per expert size is trained on the mixture of the training domains; every expert
starts from the seed of its size and trains on its own domain only. Experts of one size train
together as vmapped replicas (no communication), each with its own data stream, step budget
and cosine schedule; an expert whose budget is spent stops updating (its later steps are
masked, so a heterogeneous-steps group still shares one compiled program).

Ensembles (HDEE's naming, "He" = heterogeneous, "Ho" = homogeneous; size x steps):

* ``M_Ho-I_Ho``: every expert size M, T steps.
* ``M_Ho-I_He``: size M, T - delta / T / T + delta steps for easy / medium / hard domains.
* ``M_He-I_Ho``: sizes S / M / L (MLP width only, S + L = 2 M) for easy / medium / hard, T steps.

With as many easy as hard domains all three cost the same ``sum(non-embedding params x
steps)``: ``compute`` computes it, and the tests check the equality.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from noloco_jax import models
from noloco_jax.trainer.step import loss_fn

__all__ = ["ExpertPlan", "ENSEMBLES", "plan_ensemble", "compute", "train_group",
           "token_logprobs", "size_config"]  # fmt: skip

ENSEMBLES = ("M_Ho-I_Ho", "M_Ho-I_He", "M_He-I_Ho")


@dataclasses.dataclass(frozen=True)
class ExpertPlan:
    """One expert: its domain, tier, size ("S" / "M" / "L") and number of training steps."""

    domain: str
    tier: str
    size: str
    steps: int


def size_config(base: models.LlamaConfig, size: str, mlp_widths: dict[str, int]) -> models.LlamaConfig:
    """``base`` with the MLP width of ``size``; everything else is shared."""
    if size not in mlp_widths:
        raise ValueError(f"size must be one of {sorted(mlp_widths)}, got {size!r}.")
    return dataclasses.replace(base, mlp_hidden_size=mlp_widths[size])


def plan_ensemble(kind: str, tiers: dict[str, str], steps: int, delta: int) -> list[ExpertPlan]:
    """The experts of ensemble ``kind`` for ``tiers`` ({domain: easy|medium|hard})."""
    if kind not in ENSEMBLES:
        raise ValueError(f"kind must be one of {ENSEMBLES}, got {kind!r}.")
    if not 0 <= delta < steps:
        raise ValueError(f"delta must be in [0, steps={steps}), got {delta!r}.")
    by_tier = {"easy": -1, "medium": 0, "hard": 1}
    plans = []
    for domain in sorted(tiers, key=lambda d: (by_tier[tiers[d]], d)):
        tier = tiers[domain]
        if kind == "M_Ho-I_He":
            plans.append(ExpertPlan(domain, tier, "M", steps + by_tier[tier] * delta))
        elif kind == "M_He-I_Ho":
            plans.append(ExpertPlan(domain, tier, {"easy": "S", "medium": "M", "hard": "L"}[tier],
                                    steps))  # fmt: skip
        else:
            plans.append(ExpertPlan(domain, tier, "M", steps))
    return plans


def compute(plans: list[ExpertPlan], configs: dict[str, models.LlamaConfig]) -> int:
    """sum over experts of (non-embedding params x training steps)."""
    return sum(models.param_count(configs[p.size], non_embedding=True) * p.steps for p in plans)


def _lr(step: jax.Array, total: jax.Array, peak: float, warmup: int) -> jax.Array:
    """Linear warmup, then cosine to peak / 10 at the expert's own last step."""
    t = step.astype(jnp.float32)
    warm = peak * (t + 1) / warmup
    frac = jnp.clip((t - warmup) / jnp.maximum(total - warmup, 1), 0.0, 1.0)
    cos = peak * (0.1 + 0.9 * 0.5 * (1 + jnp.cos(jnp.pi * frac)))
    return jnp.where(t < warmup, warm, cos)


def _windows(key: jax.Array, stream: jax.Array, length: jax.Array, batch: int, seq: int):
    starts = jax.random.randint(key, (batch,), 0, length - seq - 1)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(stream, (s,), (seq + 1,)))(starts)


_TX = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam())


@functools.partial(jax.jit, static_argnames=("graphdef", "batch", "seq_len", "learning_rate",
                                             "warmup", "total"))  # fmt: skip
def _run_group(params, opt, streams_K, lengths_K, budgets_K, keys, *, graphdef, batch, seq_len,
               learning_rate, warmup, total):  # fmt: skip
    def one(params, opt, stream, length, budget, key, t):
        tokens = _windows(jax.random.fold_in(key, t), stream, length, batch, seq_len)
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, graphdef=graphdef)
        updates, new_opt = _TX.update(grads, opt, params)
        lr = _lr(t, budget, learning_rate, warmup)
        new_params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        live = t < budget
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(live, a, b), new, old)  # noqa
        return keep(new_params, params), keep(new_opt, opt), jnp.where(live, loss, jnp.nan)

    def body(carry, t):
        p, o = carry
        p, o, loss = jax.vmap(one, in_axes=(0, 0, 0, 0, 0, 0, None))(
            p, o, streams_K, lengths_K, budgets_K, keys, t)
        return (p, o), loss

    (p, _), losses = jax.lax.scan(body, (params, opt), jnp.arange(total))
    return p, losses


def train_group(
    graphdef: Any,
    params_K: Any,
    streams: list[np.ndarray],
    steps_K: list[int],
    *,
    batch: int,
    seq_len: int,
    learning_rate: float,
    seed: int,
    warmup: int = 10,
) -> tuple[Any, np.ndarray]:
    """Trains K same-shaped models, one per token stream, as vmapped independent replicas.

    Args:
      graphdef: the models' graphdef.
      params_K: the K starting parameter trees stacked on a leading axis.
      streams: K token arrays, one per model.
      steps_K: each model's number of Adam steps (the group runs max(steps_K) steps; a model's
        updates after its own budget are masked out).
      batch: windows per step.
      seq_len: window length (plus one target).
      learning_rate: peak Adam learning rate (warmup, then cosine to a tenth at each model's
        own last step); gradients clipped to norm 1.
      seed: seed of the window draws.
      warmup: warmup steps.

    Returns:
      (trained params [K, ...], each model's training loss at its last step [K]).
    """
    k = len(streams)
    if len(steps_K) != k or any(int(s) < 1 for s in steps_K):
        raise ValueError(f"steps_K must hold {k} positive step counts, got {steps_K!r}.")
    lengths = np.array([len(s) for s in streams])
    if lengths.min() < seq_len + 2:
        raise ValueError(f"streams: every stream needs more than seq_len + 1 = {seq_len + 1} "
                         f"tokens, got lengths {lengths.tolist()}.")  # fmt: skip
    padded = np.zeros((k, int(lengths.max())), np.int32)
    for i, s in enumerate(streams):
        padded[i, : len(s)] = s
    params, losses_TxK = _run_group(
        params_K, jax.vmap(_TX.init)(params_K), jnp.asarray(padded), jnp.asarray(lengths),
        jnp.asarray(steps_K), jax.random.split(jax.random.key(seed), k), graphdef=graphdef,
        batch=batch, seq_len=seq_len, learning_rate=float(learning_rate), warmup=warmup,
        total=int(max(steps_K)))  # fmt: skip
    losses = np.asarray(losses_TxK)
    last = np.array([losses[s - 1, i] for i, s in enumerate(steps_K)])
    return params, last


@functools.partial(jax.jit, static_argnames=("graphdef", "full"))
def _token_logprobs(params_K: Any, windows_WxT1: jax.Array, *, graphdef: Any, full: bool) -> jax.Array:
    def one(p):
        logits = models.apply(graphdef, p, windows_WxT1[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        if full:
            return logp
        return jnp.take_along_axis(logp, windows_WxT1[:, 1:, None], axis=-1)[..., 0]

    return jax.vmap(one)(params_K)


def token_logprobs(graphdef: Any, params_K: Any, windows_WxT1: jax.Array, *,
                   full: bool = False) -> jax.Array:  # fmt: skip
    """log p_k(x_t | x_<t) of every model k on every window position, [K, W, T].

    With ``full``, the whole next-token distributions instead, [K, W, T, V] (the targets are
    ``windows_WxT1[:, 1:]``).
    """
    return _token_logprobs(params_K, jnp.asarray(windows_WxT1), graphdef=graphdef, full=full)
