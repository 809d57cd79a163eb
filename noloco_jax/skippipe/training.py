"""Training with skipped stages (SkipPipe-style partial pipelines) on the stacked-block model.

The L blocks form S stages of L / S blocks. Every sequence visits ``path_length`` stages:
stage 0 (which in SkipPipe also holds the embedding and the loss) and a random subset of
the others, in increasing order, within SkipPipe's jump limit, optionally with two
neighbouring stages swapped. The blocks of the visited stages run in path order via
``run_layers``; skipped blocks get exactly zero gradient from that sequence. Paths are
drawn per (step, replica, sequence) from the run's seed, so they are identical on every
device and reproducible on resume.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from noloco_jax import errors
from noloco_jax.models import cross_entropy
from noloco_jax.skippipe.paths import MAX_JUMP

__all__ = [
    "SkipConfig",
    "MAX_JUMP",
    "check_path_length",
    "sample_stage_paths",
    "layer_ids_for",
    "skip_loss_fn",
    "omitted_stage_loss",
    "skip_value_and_grad",
]


@dataclasses.dataclass(frozen=True)
class SkipConfig:
    """Stage skipping during training.

    Attributes:
      num_stages: S, stages the blocks are split into (must divide the layers).
      path_length: stages each sequence visits, stage 0 included.
      layers_per_stage: L / S.
      full_every: every k-th step trains the full model (0 = never).
      swaps: allow one adjacent swap per path.
      seed: seed of the path draws.
    """

    num_stages: int
    path_length: int
    layers_per_stage: int
    full_every: int = 0
    swaps: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        errors.check_int("num_stages", self.num_stages)
        check_path_length(self.path_length, self.num_stages)
        errors.check_int("layers_per_stage", self.layers_per_stage)
        errors.check_int("full_every", self.full_every, 0)

    def check_model(self, num_layers: int) -> None:
        """The stages must cover the model's blocks exactly (traced block ids are clamped)."""
        errors.require(self.num_stages * self.layers_per_stage == num_layers, "layers_per_stage",
                       f"times num_stages={self.num_stages} must equal the model's "
                       f"{num_layers} layers, got {self.layers_per_stage}.")  # fmt: skip


def check_path_length(path_length: int, num_stages: int, *, field: str = "path_length",
                      stages_field: str = "num_stages") -> None:  # fmt: skip
    """The path rule: a path visits 1 to S stages (stage 0 included); the one check of it."""
    errors.check_int(field, path_length, 1, num_stages, f"{stages_field}={num_stages}")


def sample_stage_paths(
    key: jax.Array, *, num_stages: int, path_length: int, num_paths: int, swaps: bool = False
) -> jax.Array:
    """Random stage paths, int32 [num_paths, path_length]: stage 0 then sorted others.

    Each path is uniform over the sorted paths that obey SkipPipe's rules
    (``skippipe.PathRules``): no step lands more than ``MAX_JUMP`` stages above the
    highest stage reached, which only rules paths out when ``num_stages > MAX_JUMP + 1``.

    Args:
      key: PRNG key.
      num_stages: S.
      path_length: stages visited, stage 0 included (1 <= path_length <= S).
      num_paths: how many paths.
      swaps: with probability 1/2 per path, pick one position after stage 0 and swap it
        with the next, if the two are neighbouring stages (a swap reaches back one stage)
        and the jump stays within ``MAX_JUMP``; otherwise the path stays sorted.

    Returns:
      The paths (skip ratio = (S - path_length) / S).
    """
    check_path_length(path_length, num_stages)
    errors.check_int("num_paths", num_paths)  # 0 returned an empty array
    k_pick, k_swap = jax.random.split(key)
    keys = jax.random.split(k_pick, num_paths)
    if num_stages - 1 <= MAX_JUMP:  # every subset obeys the jump limit

        def one(k: jax.Array) -> jax.Array:
            others = jax.random.permutation(k, num_stages - 1)[: path_length - 1] + 1
            return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.sort(others).astype(jnp.int32)])

        paths = jax.vmap(one)(keys)
    else:
        paths = jax.vmap(lambda k: _jump_limited_path(k, num_stages, path_length))(keys)
    if swaps and path_length >= 3:
        paths = jax.vmap(_maybe_swap)(paths, jax.random.split(k_swap, num_paths))
    return paths


def _gap_logits(num_stages: int, path_length: int) -> np.ndarray:
    """log-weights [path_length, S, MAX_JUMP] of the next gap, for uniform jump-limited paths.

    ``ways[k, s]`` counts the ways to visit k more stages above stage s (gaps 1..MAX_JUMP,
    all below S); a gap g from s with k left is drawn with weight ``ways[k - 1, s + g]``.
    """
    ways = np.zeros((path_length, num_stages + MAX_JUMP))
    ways[0, :num_stages] = 1.0
    for k in range(1, path_length):
        for s in range(num_stages):
            ways[k, s] = ways[k - 1, s + 1 : s + 1 + MAX_JUMP].sum()
    nxt = np.stack([ways[:, 1 + g : 1 + g + num_stages] for g in range(MAX_JUMP)], -1)
    with np.errstate(divide="ignore"):
        logits = np.log(np.concatenate([np.zeros_like(nxt[:1]), nxt[:-1]]))
    return logits.astype(np.float32)


def _jump_limited_path(key: jax.Array, num_stages: int, path_length: int) -> jax.Array:
    """One path, uniform over the sorted paths whose gaps are at most ``MAX_JUMP``."""
    logits = jnp.asarray(_gap_logits(num_stages, path_length))

    def step(stage: jax.Array, inputs: tuple) -> tuple[jax.Array, jax.Array]:
        k, left = inputs
        stage = stage + 1 + jax.random.categorical(k, logits[left, stage]).astype(jnp.int32)
        return stage, stage

    left = jnp.arange(path_length - 1, 0, -1)
    _, later = lax.scan(step, jnp.int32(0), (jax.random.split(key, path_length - 1), left))
    return jnp.concatenate([jnp.zeros(1, jnp.int32), later])


def _maybe_swap(path: jax.Array, key: jax.Array) -> jax.Array:
    k_do, k_pos = jax.random.split(key)
    pos = jax.random.randint(k_pos, (), 1, path.shape[0] - 1)  # swap (pos, pos + 1), pos >= 1
    swapped = path.at[pos].set(path[pos + 1]).at[pos + 1].set(path[pos])
    allowed = (path[pos + 1] - path[pos] == 1) & (path[pos + 1] - path[pos - 1] <= MAX_JUMP)
    return jnp.where(jax.random.bernoulli(k_do) & allowed, swapped, path)


def layer_ids_for(stage_paths: jax.Array, layers_per_stage: int) -> jax.Array:
    """Block indices of stage paths: [..., P] -> [..., P * layers_per_stage]."""
    offsets = jnp.arange(layers_per_stage, dtype=jnp.int32).reshape((1,) * stage_paths.ndim + (-1,))
    ids = stage_paths[..., None] * layers_per_stage + offsets
    return ids.reshape(*stage_paths.shape[:-1], -1)


def skip_loss_fn(params: Any, tokens_BxT1: jax.Array, layer_ids_BxK: jax.Array, *,
                 graphdef: Any) -> jax.Array:  # fmt: skip
    """Mean next-token loss, each sequence through its own blocks."""
    model = nnx.merge(graphdef, params)

    def one(tokens_T1: jax.Array, ids_K: jax.Array) -> jax.Array:
        x = model.run_layers(model.embed(tokens_T1[None, :-1]), ids_K)
        return cross_entropy(model.head(x), tokens_T1[None, 1:]).mean()

    return jax.vmap(one)(tokens_BxT1, layer_ids_BxK).mean()


def omitted_stage_loss(params: Any, windows_WxT1: jax.Array, stage_ids: jax.Array, *,
                       graphdef: Any, layers_per_stage: int) -> jax.Array:  # fmt: skip
    """Per-window loss of the model run with only ``stage_ids`` (e.g. 50 % of its stages)."""
    ids = np.asarray(stage_ids)[:, None] * layers_per_stage + np.arange(layers_per_stage)
    ids = ids.reshape(-1).astype(np.int32)
    model = nnx.merge(graphdef, params)

    def one(tokens_T1: jax.Array) -> jax.Array:
        x = model.run_layers(model.embed(tokens_T1[None, :-1]), ids)
        return cross_entropy(model.head(x), tokens_T1[None, 1:]).mean()

    return lax.map(one, windows_WxT1)


def skip_value_and_grad(
    params: Any, tokens_BxT1: jax.Array, step: jax.Array, *, graphdef: Any, cfg: SkipConfig,
    full_loss: Any, axis_name: str = "replica",
) -> tuple[jax.Array, Any]:  # fmt: skip
    """Loss and gradients of one replica's batch with this step's random stage paths.

    On steps where ``step % full_every == 0`` the full model is trained instead (``lax.cond``
    on the shared step: only one branch runs).
    """
    cfg.check_model(jax.tree.leaves(params["blocks"])[0].shape[0])  # stacked [L, ...] blocks
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.seed), step),
                             lax.axis_index(axis_name))  # fmt: skip
    paths = sample_stage_paths(key, num_stages=cfg.num_stages, path_length=cfg.path_length,
                               num_paths=tokens_BxT1.shape[0], swaps=cfg.swaps)  # fmt: skip
    ids = layer_ids_for(paths, cfg.layers_per_stage)
    skipped = jax.value_and_grad(lambda p: skip_loss_fn(p, tokens_BxT1, ids, graphdef=graphdef))
    if cfg.full_every <= 0:
        return skipped(params)
    full = jax.value_and_grad(lambda p: full_loss(p, tokens_BxT1, graphdef=graphdef))
    return lax.cond(step % cfg.full_every == 0, full, skipped, params)
