"""Domain experts trained embarrassingly parallel, and the three equal-compute ensembles.

A seed model per expert size is trained on the mixture of the training domains; every expert
starts from the seed of its size and trains on its own domain only. Experts of one size and
one step budget train together as the independent replicas of one ``local`` run (the
trainer's optimizer and step, no communication), each on its own data stream.

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

from noloco_jax import errors, models
from noloco_jax.replicas import make_replicas
from noloco_jax.trainer import grads
from noloco_jax.trainer.optimizer import build_optimizer
from noloco_jax.trainer.settings import OptimSettings, OuterSettings
from noloco_jax.trainer.step import TrainState, run_steps, train_step

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

    def __post_init__(self) -> None:
        errors.check_int("steps", self.steps)  # compute() counted steps=-1 as negative compute


def size_config(base: models.LlamaConfig, size: str, mlp_widths: dict[str, int]) -> models.LlamaConfig:
    """``base`` with the MLP width of ``size``; everything else is shared."""
    if size not in mlp_widths:
        raise ValueError(f"size must be one of {sorted(mlp_widths)}, got {size!r}.")
    return dataclasses.replace(base, mlp_hidden_size=mlp_widths[size])


def plan_ensemble(kind: str, tiers: dict[str, str], steps: int, delta: int) -> list[ExpertPlan]:
    """The experts of ensemble ``kind`` for ``tiers`` ({domain: easy|medium|hard})."""
    if kind not in ENSEMBLES:
        raise ValueError(f"kind must be one of {ENSEMBLES}, got {kind!r}.")
    errors.check_int("steps", steps)
    errors.check_int("delta", delta, minimum=0, maximum=steps - 1,
                     maximum_text=f"steps - 1 = {steps - 1}")  # fmt: skip
    by_tier = {"easy": -1, "medium": 0, "hard": 1}
    unknown = {d: t for d, t in tiers.items() if t not in by_tier}
    if unknown:
        raise ValueError(f"tiers must map each domain to one of {list(by_tier)}, got {unknown}.")
    counts = {t: sum(v == t for v in tiers.values()) for t in by_tier}
    if kind != "M_Ho-I_Ho" and counts["easy"] != counts["hard"]:
        raise ValueError(
            f"{kind} matches the homogeneous ensemble's compute only with as many easy as hard "
            f"domains, got {counts['easy']} easy and {counts['hard']} hard of {len(tiers)} "
            f"(assign_tiers splits a multiple of 3 domains evenly).")
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


@functools.partial(jax.jit, static_argnames=("steps", "batch"))
def _window_starts(key: jax.Array, high: jax.Array, *, steps: int, batch: int) -> jax.Array:
    """[steps, batch] window starts in [0, high); step t draws from fold_in(key, t)."""
    draw = lambda t: jax.random.randint(jax.random.fold_in(key, t), (batch,), 0, high)  # noqa
    return jax.vmap(draw)(jnp.arange(steps))


def _draw_windows(stream: np.ndarray, key: jax.Array, steps: int, batch: int,
                  seq_len: int) -> np.ndarray:  # fmt: skip
    """[steps, batch, seq_len + 1] random windows of ``stream``, one batch per training step."""
    high = jnp.asarray(len(stream) - seq_len, jnp.int32)  # the last window starts at len - T - 1
    starts = np.asarray(_window_starts(key, high, steps=steps, batch=batch))
    return np.asarray(stream, np.int32)[starts[..., None] + np.arange(seq_len + 1)]


def _vocab_size(graphdef: Any, params_K: Any) -> int:
    """The models' vocabulary size, from the shape of their logits (nothing is computed)."""
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), params_K)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda p: models.apply(graphdef, p, tokens), one).shape[-1]


def _check_ids(streams: list[np.ndarray], vocab: int) -> None:
    """Token ids outside [0, vocab) would train silently: negative ids wrap, larger give NaN."""
    for i, s in enumerate(streams):
        lo, hi = int(np.min(s)), int(np.max(s))
        if lo < 0 or hi >= vocab:
            raise ValueError(f"streams[{i}] must hold token ids in [0, {vocab}) (the models' "
                             f"vocabulary), got ids from {lo} to {hi}.")  # fmt: skip


@functools.partial(jax.jit, static_argnames=("graphdef", "optim"))
def _train_replicas(params_K: Any, windows_KxSxBxT1: jax.Array, *, graphdef: Any,
                    optim: OptimSettings) -> tuple[Any, jax.Array]:  # fmt: skip
    """K independent replicas (the library's "local" method), S steps each: params and losses."""
    k, steps = windows_KxSxBxT1.shape[:2]
    tx = build_optimizer("local", optim, OuterSettings(), num_steps=steps, num_replicas=k)
    replicas = make_replicas(k, backend="vmap")
    state = TrainState(jnp.zeros([], jnp.int32), params_K, replicas.init(tx, params_K))
    step_fn = functools.partial(train_step, grads_fn=grads.plain(graphdef), tx=tx)
    run = replicas.map(functools.partial(run_steps, step_fn=step_fn))
    state, losses_KxS = run(state, windows_KxSxBxT1)
    return state.params, losses_KxS


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
    """Trains K same-shaped models, one per token stream, as independent replicas.

    Models with the same step budget train together as the replicas of one
    ``local`` run (no communication), with the trainer's optimizer
    (``build_optimizer``: gradients clipped to norm 1, then Adam on
    ``learning_rate_schedule``: linear warmup, then cosine to a tenth at the
    model's own last step) and its ``train_step``. HDEE's released configs differ here: their
    experts are early stops of one cosine run as long as the longest (the per-model schedule
    used here is the ablation in its paper).

    Args:
      graphdef: the models' graphdef.
      params_K: the K starting parameter trees stacked on a leading axis.
      streams: K token arrays, one per model.
      steps_K: each model's number of Adam steps.
      batch: windows per step.
      seq_len: window length (plus one target).
      learning_rate: peak Adam learning rate.
      seed: seed of the window draws (model k draws from ``split(key(seed), K)[k]``).
      warmup: warmup steps.

    Returns:
      (trained params [K, ...], each model's training loss at its last step [K]).
    """
    k = len(streams)
    if k < 1:
        raise ValueError("streams must hold at least one token stream, got none.")
    if len(steps_K) != k:
        raise ValueError(f"steps_K must hold {k} positive integer step counts, got {steps_K!r}.")
    for i, s in enumerate(steps_K):
        errors.check_int(f"steps_K[{i}]", s)
    leading = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(params_K)}
    if leading != {k}:  # a JAX gather would clamp a missing model's index to the last one
        raise ValueError(f"params_K must stack {k} models (one per stream) on a leading axis, "
                         f"got leading sizes {sorted(leading, key=str)}.")  # fmt: skip
    errors.check_int("batch", batch)
    errors.check_int("seq_len", seq_len)
    errors.check_number("learning_rate", learning_rate, open_low=True)
    errors.check_int("warmup", warmup, minimum=0)
    lengths = [len(s) for s in streams]
    if min(lengths) < seq_len + 1:
        raise ValueError(f"streams: every stream needs at least seq_len + 1 = {seq_len + 1} "
                         f"tokens, got lengths {lengths}.")  # fmt: skip
    _check_ids(streams, _vocab_size(graphdef, params_K))
    optim = OptimSettings(learning_rate=float(learning_rate), warmup_steps=warmup,
                          min_lr_ratio=0.1, clip_norm=1.0)  # fmt: skip
    keys = jax.random.split(jax.random.key(seed), k)
    order, parts, last = [], [], np.zeros(k, np.float32)
    for steps in sorted(set(int(s) for s in steps_K)):
        members = [i for i in range(k) if int(steps_K[i]) == steps]
        windows = np.stack([_draw_windows(streams[i], keys[i], steps, batch, seq_len)
                            for i in members])  # fmt: skip
        params = jax.tree.map(lambda x: jnp.asarray(x)[np.asarray(members)], params_K)
        params, losses_KxS = _train_replicas(params, jnp.asarray(windows), graphdef=graphdef,
                                             optim=optim)  # fmt: skip
        order += members
        parts.append(params)
        last[members] = np.asarray(losses_KxS)[:, -1]
    back = np.argsort(order)  # position of model i among the concatenated groups
    params = jax.tree.map(lambda *xs: jnp.concatenate(xs)[back], *parts)
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
    errors.check_bool("full", full)  # "no" was truthy: [K, W, T, V] came back
    return _token_logprobs(params_K, jnp.asarray(windows_WxT1), graphdef=graphdef, full=full)
