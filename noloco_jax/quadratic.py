"""The paper's noisy quadratic model, for checking NoLoCo against its theory.

Each replica minimises L(theta) = 1/2 (theta - c)^T A (theta - c) with a fresh
c ~ N(0, sigma^2 I) per replica and inner step, using SGD with learning rate
omega for H steps between outer steps (Kolehmainen et al. 2025, Sec. 3.2 and
App. A). The optimum of the expected loss is theta = 0.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import optax

from noloco_jax import comm, errors, replicas
from noloco_jax.optim.local_steps import local_steps

__all__ = ["QuadraticRun", "simulate_quadratic", "gamma_bounds"]


def gamma_bounds(momentum: float, group_size: int) -> tuple[float, float]:
    """The range for gamma of paper Eq. 74 (as reconstructed).

    alpha sqrt(n / (2 (n - 1))) < gamma < sqrt(n (2 + alpha^2) / (2 (n - 1))).

    It is not a sufficient condition on this model in general. An exact second-moment
    analysis (review, 2026-11-26) gives the stability limit of the spread for n = 2 as
    2.0, 1.82, 1.5, 0.72 at alpha = 0, 0.3, 0.5, 0.8 (small inner lr, large N), against
    this upper end's 1.41, 1.45, 1.5, 1.63: they agree only at alpha = 0.5, and at
    alpha = 0.8 gamma = 1.2 lies inside the range and diverges
    (``tests/test_theory.py``). The exact limit rises with n (1.8 at n = 3, 2.0 at 4)
    while this upper end falls, and no gamma > 0 below the lower end is unstable.

    Raises:
      ValueError: ``momentum`` outside [0, 1) or ``group_size`` not an integer >= 2 (the
        formula divides by n - 1).
    """
    momentum = errors.check_number("momentum", momentum, 0, 1, open_high=True)
    comm.check_group_size(None, group_size)  # the group-size rule (N is not known here)
    n = group_size
    lower = momentum * (n / (2 * (n - 1))) ** 0.5
    upper = (n * (2 + momentum**2) / (2 * (n - 1))) ** 0.5
    return lower, upper


@dataclasses.dataclass(frozen=True)
class QuadraticRun:
    """Per-round traces of one simulation.

    Attributes:
      mean_norm: ||mean over replicas of phi||, per outer round.
      spread: pooled cross-replica std of phi, per outer round.
    """

    mean_norm: jax.Array
    spread: jax.Array


def simulate_quadratic(
    outer: optax.GradientTransformation,
    *,
    num_replicas: int = 16,
    dim: int = 8,
    inner_lr: float = 0.05,
    sync_every: int = 10,
    num_rounds: int = 200,
    noise: float = 1.0,
    init: float = 5.0,
    seed: int = 0,
    axis_name: str = "replica",
    delay: int = 0,
    mixing: float = 1.0,
) -> QuadraticRun:
    """Simulates N replicas on the noisy quadratic with SGD inner steps.

    Args:
      outer: the outer transformation (e.g. ``noloco_outer(...)``) bound to
        ``axis_name``.
      num_replicas: N.
      dim: dimension of theta; A = diag(linspace(1, 0.1, dim)).
      inner_lr: omega, the SGD learning rate.
      sync_every: H.
      num_rounds: outer rounds to simulate.
      noise: sigma, std of the target noise c.
      init: every coordinate of the common starting point.
      seed: seed of the noise.
      axis_name: the replica axis name used by ``outer``.
      delay, mixing: the overlapped exchange of ``local_steps`` (tau, m).

    Returns:
      A ``QuadraticRun`` with one entry per outer round.

    Raises:
      ValueError: ``dim`` or ``num_rounds`` below 1, ``inner_lr`` not positive or ``noise``
        negative (or either not finite), ``init`` not finite.
    """
    errors.check_int("dim", dim, 1)  # 0: a NaN spread (a mean over no coordinates)
    errors.check_int("num_rounds", num_rounds, 1)
    errors.check_number("inner_lr", inner_lr, 0, open_low=True)  # < 0: gradient ascent
    errors.check_number("noise", noise, 0)
    real = isinstance(init, numbers.Real) and not isinstance(init, bool)  # "a": math's TypeError
    errors.require(real and math.isfinite(init), "init", f"must be a finite number, got {init!r}.")
    curvature = jnp.linspace(1.0, 0.1, dim)
    tx = local_steps(optax.sgd(inner_lr), outer, sync_every, delay=delay, mixing=mixing)
    reps = replicas.Replicas(num_replicas, axis_name)
    theta0 = jnp.full((dim,), init, jnp.float32)
    params = replicas.replicate(theta0, num_replicas)
    state = replicas.replicate(tx.init(theta0), num_replicas)
    key = jax.random.key(seed)

    def inner_step(theta, opt_state, c):
        grads = curvature * (theta - c)
        updates, opt_state = tx.update(grads, opt_state, theta)
        return optax.apply_updates(theta, updates), opt_state

    step = reps.map(inner_step)

    def inner(carry, noise_key):
        c = noise * jax.random.normal(noise_key, (num_replicas, dim))
        return step(*carry, c), None

    def one_round(carry, r):
        theta, opt_state = carry
        noise_keys = jax.random.split(jax.random.fold_in(key, r), sync_every)
        # A loop over the H inner steps, not H copies: H = 50 compiled in 10 s unrolled.
        (theta, opt_state), _ = jax.lax.scan(inner, (theta, opt_state), noise_keys)
        phi = opt_state.slow_params
        mean = phi.mean(0, keepdims=True)
        spread = jnp.sqrt(jnp.mean((phi - mean) ** 2))
        return (theta, opt_state), (jnp.linalg.norm(mean), spread)

    run = jax.jit(lambda c: jax.lax.scan(one_round, c, jnp.arange(num_rounds)))
    _, (mean_norm, spread) = run((params, state))
    return QuadraticRun(mean_norm=mean_norm, spread=spread)
