"""Validation of N replicas: pooled, best and worst replica, averaged model and ensemble.

``make_evaluator`` compiles the evaluation once per run; the loop calls it at each
``eval_every`` with the replicas' current weights.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax import ensemble, replicas
from noloco_jax.errors import check_int
from noloco_jax.metrics import replica_spread
from noloco_jax.models import LlamaConfig
from noloco_jax.trainer.observability import distance_to_mean
from noloco_jax.trainer.step import eval_token_losses

__all__ = ["make_evaluator", "eval_layout", "ppl"]


def ppl(loss: float) -> float:
    """exp(loss): inf for a large loss instead of an OverflowError, NaN for a NaN loss."""
    return math.exp(loss) if loss < 700 else float("inf") if loss >= 700 else float("nan")


def eval_layout(num_windows: int, limit: int = 16) -> tuple[int, int]:
    """(batch size, windows after padding): an even split when a divisor of at least half the
    limit exists, else batches of ``limit``, the last padded with the first windows (dropped).
    Both arguments must be integers >= 1."""
    num_windows, limit = check_int("num_windows", num_windows), check_int("limit", limit)
    most = min(limit, num_windows)
    best = max(d for d in range(1, most + 1) if num_windows % d == 0)
    return (best, num_windows) if best >= most // 2 else (limit, -(-num_windows // limit) * limit)


def _check_windows(windows: np.ndarray, graphdef: Any) -> int:
    """How many validation windows there are: at least one, every id in [0, vocab_size) of the
    ``LlamaConfig`` the graphdef holds (a static attribute), if it holds one."""
    if len(windows) == 0:
        raise ValueError(
            f"make_evaluator needs at least one validation window, got windows of shape "
            f"{tuple(np.shape(windows))}: the validation stream holds fewer than seq_len + 1 "
            f"tokens (eval_windows returns no window then); use more validation data or a "
            f"shorter seq_len.")  # fmt: skip
    if windows.min() < 0:  # the gathers wrap -1 to the last id: a finite, wrong loss
        raise ValueError(f"make_evaluator's windows must hold token ids >= 0, got "
                         f"{int(windows.min())}.")  # fmt: skip
    vocab_size = next((attr.value.vocab_size for _, attr in getattr(graphdef, "attributes", ())
                       if isinstance(getattr(attr, "value", None), LlamaConfig)), None)
    if vocab_size is not None and windows.max() >= vocab_size:  # the gathers gave NaN
        raise ValueError(f"make_evaluator's windows hold token id {int(windows.max())}, outside "
                         f"the model's vocabulary: ids must be in [0, {vocab_size}); tokenize "
                         f"with the model's tokenizer or give the model its vocab_size.")  # fmt: skip
    return len(windows)


@functools.lru_cache(maxsize=8)
def _programs(reps: replicas.Replicas, graphdef: Any, batch: int, num: int) -> tuple:
    """The evaluation's jitted programs, shared by runs of one model and topology (so a second
    run in a process, e.g. a notebook's, compiles nothing): per-replica token losses, the
    weight spread and the averaged model's token losses."""
    token_losses = functools.partial(eval_token_losses, graphdef=graphdef, batch_size=batch)
    per_replica = jax.jit(reps.map(token_losses))
    spread = jax.jit(reps.map(lambda p: replica_spread(p, reps.axis_name)))
    averaged = jax.jit(lambda p, w: token_losses(jax.tree.map(lambda x: x.mean(0), p), w)[:num])
    return per_replica, spread, averaged


def make_evaluator(reps: replicas.Replicas, graphdef: Any, windows: np.ndarray) -> Callable:
    """``evaluate(params) -> metrics`` over ``windows`` for the N replicas of ``reps``.

    Args:
      reps: the run's topology (the replicas' weights carry its leading N axis).
      graphdef: the model's graph definition.
      windows: [W, T + 1] int32 validation windows.

    Returns:
      A function of the replicated params giving ``val_ppl`` (exp of the per-sequence mean
      loss pooled over replicas), ``val_loss``, the best and worst replica's perplexity, the
      averaged model's (``val_ppl_avg_model``), the ensemble's (``val_ppl_ensemble``),
      ``replica_spread`` and ``distance_to_mean_per_replica``.
    """
    if reps.manual_axes - {reps.axis_name}:  # stages split by hand: evaluate a host copy
        on_host = make_evaluator(replicas.Replicas(reps.num_replicas), graphdef, windows)
        return lambda params: on_host(jax.tree.map(replicas.to_host, params))  # all processes
    n, num = reps.num_replicas, _check_windows(windows, graphdef)
    batch, padded = eval_layout(num)
    windows = np.concatenate([windows, windows[: padded - num]])  # padding dropped below
    per_replica, spread, averaged = _programs(reps, graphdef, batch, num)
    stacked = reps.put(np.broadcast_to(windows, (n, *windows.shape)).copy())
    single = jnp.asarray(windows)

    def evaluate(params: Any) -> dict[str, float]:
        per = replicas.to_host(per_replica(params, stacked))[:, :num]  # [N, W, T] token losses
        seq = per.mean(-1)  # [N, W] per-sequence mean CE
        mixture = -np.asarray(ensemble.uniform_mixture(-jnp.asarray(per)))  # [W, T]
        return {
            # The paper's metric: exp of the mean per-sequence CE pooled over replicas.
            "val_ppl": ppl(float(seq.mean())),
            "val_loss": float(seq.mean()),
            "val_ppl_best_replica": ppl(float(np.fmin.reduce(seq.mean(1)))),  # skips NaN replicas
            "val_ppl_worst_replica": ppl(float(seq.mean(1).max())),
            "val_ppl_avg_model": ppl(float(replicas.to_host(averaged(params, single)).mean())),
            # All replicas as one model: the mean of their next-token distributions.
            "val_ppl_ensemble": ppl(float(mixture.mean())),
            "replica_spread": (float(replicas.to_host(spread(params)).reshape(-1)[0]) if n > 1
                               else 0.0),
            "distance_to_mean_per_replica": distance_to_mean(params),
        }

    return evaluate
