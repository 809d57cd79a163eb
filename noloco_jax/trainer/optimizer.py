"""Builds the per-replica optimizer of a run and accounts for its communication."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from noloco_jax import comm
from noloco_jax.errors import check_choice
from noloco_jax.optim.fragments import by_layer_blocks, take
from noloco_jax.optim.trees import is_float
from noloco_jax.optim import (
    clip_by_global_norm_fused,
    data_parallel,
    diloco_outer,
    local_steps,
    noloco_outer,
)
from noloco_jax.pipeline.routed import STAGE as STAGE_AXIS
from noloco_jax.pipeline.routed import stage_leaf_axes
from noloco_jax.pipeline.stages import clip_by_stage_norm
from noloco_jax.sharding import path_names
from noloco_jax.trainer.settings import (METHODS, FaultSettings, OptimSettings, OuterSettings,
                                         packs_replica)

__all__ = ["learning_rate_schedule", "inner_optimizer", "build_optimizer", "bytes_sent"]

AXIS = "replica"


def learning_rate_schedule(o: OptimSettings, num_steps: int) -> optax.Schedule:
    """Linear warmup ``lr * (step + 1) / warmup`` then cosine to ``lr * min_lr_ratio``.

    As in the reference code's scheduler (warmup 1000, cosine over the rest).
    """
    peak, warmup = o.learning_rate, o.warmup_steps
    floor = peak * o.min_lr_ratio
    decay_steps = max(num_steps - warmup, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1.0) / max(warmup, 1)
        frac = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        cosine = floor + 0.5 * (peak - floor) * (1.0 + jnp.cos(jnp.pi * frac))
        return jnp.where(step < warmup, warm, cosine)

    return schedule


def inner_optimizer(o: OptimSettings, num_steps: int) -> optax.GradientTransformation:
    """Adam (AdamW if weight_decay > 0) on the schedule, without clipping.

    ``o.decay_norms=False`` masks the decay off the RMSNorm scales (leaves named ``scale``).
    """
    lr = learning_rate_schedule(o, num_steps)
    if o.weight_decay > 0:
        mask = None if o.decay_norms else _not_norm_scales
        return _in_float32(optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps,
                                       weight_decay=o.weight_decay, mask=mask))  # fmt: skip
    return _in_float32(optax.adam(lr, b1=o.b1, b2=o.b2, eps=o.eps))


def _in_float32(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on float leaves widened to at least float32: its state (Adam's moments) too.

    optax keeps Adam's second moment in the params' dtype; in bfloat16, ``b2 * nu`` with
    b2 = 0.999 rounds back to ``nu``, so it never decayed after a large gradient. The
    updates come back in float32 (``optax.apply_updates`` casts them to the params').
    """
    def wide(tree: Any) -> Any:
        return jax.tree.map(lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32))
                            if is_float(x) else x, tree)  # fmt: skip

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return tx.update(wide(updates), state, None if params is None else wide(params))

    return optax.GradientTransformation(lambda params: tx.init(wide(params)), update)


def _not_norm_scales(params: Any) -> Any:
    """True for every leaf but the norms' scales (a path through a key named ``scale``)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "scale" not in path_names(path),
                                            params)  # fmt: skip


# outer.exchange_dtype and outer.slow_dtype as the optimizers take them ("": the params' own
# dtype; the 8-bit formats of noloco_jax.quantize by name; float32 slow weights: master weights).
_EXCHANGE_DTYPES = {"": None, "bfloat16": jnp.bfloat16, "float32": jnp.float32, "int8": "int8",
                    "float8_e4m3fn": "float8_e4m3fn"}  # fmt: skip
_SLOW_DTYPES = {"": None, "float32": jnp.float32}


def build_optimizer(
    method: str,
    optim: OptimSettings,
    outer: OuterSettings,
    *,
    num_steps: int,
    num_replicas: int,
    num_stages: int = 1,
    stage: Any = None,
    fault: FaultSettings = FaultSettings(),
    fragment_spec: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """The per-replica transformation for ``method``, collectives on axis "replica".

    Each replica's gradient is clipped before any averaging (the reference
    code clips local gradients, also before data parallel's all-reduce); with
    pipeline stages each stage is clipped on its own, as each reference rank
    clips only its own parameters. ``stage`` is the local stage index on a
    (replica, stage) device mesh.
    """
    check_choice("method", method, METHODS)
    inner = inner_optimizer(optim, num_steps)
    if optim.clip_norm <= 0:
        clip = optax.identity()
    elif num_stages > 1:
        clip = clip_by_stage_norm(optim.clip_norm, num_stages, stage=stage)
    else:
        clip = clip_by_global_norm_fused(optim.clip_norm)  # fuses into Adam; optax's does not
    axis = AXIS if num_replicas > 1 else None
    if method == "local":  # independent replicas: no communication at all
        return optax.with_extra_args_support(optax.chain(clip, inner))
    if method == "dp":
        return optax.chain(clip, data_parallel(inner, axis_name=axis))
    out = _outer_step(method, outer, axis, fault)
    guard = fault.nonfinite_guard and axis is not None
    guard_axis = STAGE_AXIS if stage is not None else None  # a replica spans its stages
    return optax.chain(clip, local_steps(inner, out, outer.sync_every, nonfinite_guard=guard,
                                         guard_axis_name=guard_axis, fragments=fragment_spec,
                                         delay=outer.delay, mixing=outer.mixing,
                                         resync_caught=method == "diloco" and fault.resync_absent,
                                         slow_dtype=_SLOW_DTYPES[outer.slow_dtype],
                                         check_phase="count"))  # fmt: skip


def _outer_step(method: str, outer: OuterSettings, axis: str | None, fault: FaultSettings
                ) -> optax.GradientTransformation:  # fmt: skip
    """DiLoCo's or NoLoCo's outer step, from the settings."""
    common = dict(axis_name=axis, seed=outer.seed, nesterov=outer.nesterov,
                  exchange_dtype=_EXCHANGE_DTYPES[outer.exchange_dtype],
                  dropout_prob=fault.dropout_prob, error_feedback=outer.error_feedback)  # fmt: skip
    if method == "diloco":
        return diloco_outer(outer.learning_rate, outer.momentum,
                            resync_absent=fault.resync_absent, **common)  # fmt: skip
    return noloco_outer(outer.learning_rate, outer.momentum, gamma=outer.gamma,
                        group_size=outer.group_size, **common)  # fmt: skip


def bytes_sent(
    method: str,
    outer: OuterSettings,
    params: Any,
    *,
    num_replicas: int,
    steps: int,
    fault: FaultSettings = FaultSettings(),
    stage_copies: int = 1,
    devices_per_replica: int = 1,
) -> float:
    """Bytes one replica has sent after ``steps`` inner steps.

    NoLoCo: per sync, what ``comm.noloco_bytes_per_sync`` reports (checked
    against the compiled HLO in the tests). DiLoCo: ``comm.diloco_bytes_per_sync``
    (a ring all-reduce, or the exact all-to-all + all-gather bytes of a
    narrower exchange dtype). Data parallel: a bandwidth-optimal ring all-reduce per
    step (``comm.mean_bytes_per_replica``: 16-bit grads are summed in float32).
    ``stage_copies``: on a (replica, stage) mesh of S stages each of a replica's S devices
    sends two messages: its 1/S of the blocks, and its own copy of the other leaves
    (embedding, head, final norm).
    ``devices_per_replica``: F x T of a replica split over ``mesh.fsdp`` x ``mesh.tensor``
    devices. Each device sends its own shard, except where the exchange packs the whole
    replica into one flat message (``packs_replica``): then every device sends all of it.
    """
    if stage_copies > 1:
        once = functools.partial(bytes_sent, method, outer, num_replicas=num_replicas,
                                 steps=steps, fault=fault,
                                 devices_per_replica=devices_per_replica)  # fmt: skip
        if method == "noloco":  # one message per kind of leaf (split over stages or not)
            return stage_copies * sum(once(_stage_local(params, stage_copies, (split,)))
                                      for split in (True, False))  # fmt: skip
        return stage_copies * once(_stage_local(params, stage_copies))  # DiLoCo, dp: one message
    if num_replicas <= 1 or method == "local":
        return 0.0
    if method == "dp":
        return steps * comm.mean_bytes_per_replica(params, num_replicas)
    per_sync = functools.partial(_sync_bytes, method, outer, num_replicas, fault)
    if devices_per_replica > 1 and packs_replica(method, outer.exchange_dtype):
        per_sync = lambda tree, once=per_sync: devices_per_replica * once(tree)  # noqa: E731
    frags, h = outer.fragments, outer.sync_every
    spec = by_layer_blocks(params, frags) if frags > 1 else None
    total = 0.0
    for p in range(frags):  # fragment p's exchanges start at t = (p + 1) H / P - delay (mod H)
        start = (p + 1) * h // frags - outer.delay
        sent = 0 if steps < start else (steps - start) // h + 1
        total += sent * per_sync(params if spec is None else
                                 jax.eval_shape(lambda x, p=p: take(x, spec, p), params))
    return float(total)


def _sync_bytes(method: str, outer: OuterSettings, num_replicas: int, fault: FaultSettings,
                tree: Any) -> float:  # fmt: skip
    """Bytes one replica sends in one exchange of ``tree`` (the params or a fragment)."""
    presence = bool(fault.nonfinite_guard or fault.dropout_prob > 0)  # a NumPy bool is refused
    wire = _EXCHANGE_DTYPES[outer.exchange_dtype]
    slow = _SLOW_DTYPES[outer.slow_dtype]
    if slow is not None:  # the outer step exchanges the slow weights: "" sends them as held,
        # and a float32 wire on float32 slow weights is DiLoCo's plain all-reduce
        tree = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, slow) if is_float(x) else x,
                            tree)  # fmt: skip
    if method == "diloco":
        return comm.diloco_bytes_per_sync(tree, num_replicas, exchange_dtype=wire,
                                          with_presence=presence)  # fmt: skip
    return comm.noloco_bytes_per_sync(
        tree, group_size=outer.group_size, exchange_dtype=wire, with_presence=presence,
        gamma_equals_beta=bool(outer.gamma is None or outer.gamma == outer.learning_rate))


def _stage_local(params: Any, num_stages: int, keep: tuple[bool, ...] = (True, False)) -> Any:
    """One stage device's leaves: its 1/S of the blocks, the other leaves whole; ``keep``: the
    kinds kept (True: the leaves split over the stages, False: the others), the rest None."""

    def cut(path: tuple, x: Any) -> Any:
        split = bool(stage_leaf_axes(path, x))
        if split not in keep:
            return None
        if not split:
            return x
        return jax.ShapeDtypeStruct((x.shape[0] // num_stages, *x.shape[1:]), x.dtype)

    return jax.tree_util.tree_map_with_path(cut, params)
