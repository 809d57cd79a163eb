"""Inner/outer wrapper (``local_steps``) and the per-step all-reduce baseline.

How the two nested loops of DiLoCo-family methods become one jittable update
----------------------------------------------------------------------------
The papers write an outer loop over rounds t and an inner loop of H optimizer
steps from phi_t to theta_{t+1}. We keep phi (``slow_params``), the step
counter and the outer state inside the transformation's state, so the model
parameters seen by the user are always the fast weights theta. Every call
applies the inner optimizer. On every H-th call (after its inner step, as in
the reference code) it also forms the pseudo-gradient phi - theta, applies the
outer transformation to get phi_new, and returns the update phi_new - theta_old
so that ``optax.apply_updates`` lands theta on phi_new (theta <- phi). The
inner state is never averaged, and reset only for a replica the non-finite guard
catches (``nonfinite_guard``). The outer branch, and with it every
collective, sits under ``lax.cond`` and so runs only on sync steps.

As with ``optax.lookahead``, updates returned on a sync step must be applied
unmodified: do not chain scaling transformations *after* ``local_steps``.

Delayed application: the overlapped exchange (``delay=tau``)
------------------------------------------------------------
With ``delay=tau >= 1`` a round's exchange starts tau steps before the round
ends and its result lands when the round ends, so the tau inner steps in
between can run while the messages travel (the trainer compiles the exchange,
the tau steps and the merge as one program). Rounds still end where they end
without delay (step t = kH; with fragments, fragment p's rounds end at
t mod H = (p + 1) H / P), so a round boundary never holds a pending exchange.
The exchange starts at step s = t - tau, from theta_s and phi:

    phi_new = phi + delta(phi - theta_s)      (the outer step, computed at s)
    theta_{s+1} .. theta_t                    (tau more inner steps from theta_s)
    theta   <- phi_new + m (theta_t - theta_s)     (the merge, at step t)

with m = ``mixing``, the share of the progress made during the delay that the
merge keeps. tau = 0 is the update without delay for every m.

Why this merge, and why m = 1 by default. Without delay the replica would
restart from phi_new at s and take its tau steps from there: theta'_t =
phi_new + sum_j u_j(theta'_j). With delay it took them from theta_s:
theta_t = theta_s + sum_j u_j(theta_j). So

    phi_new + m (theta_t - theta_s) = theta'_t + (m - 1) sum_j u_j(theta_j)
                                      + sum_j [u_j(theta_j) - u_j(theta'_j)].

The last sum compares updates taken at points about theta_s - phi_new apart
(zero if the updates did not depend on the point, first order in that shift
otherwise); the middle term is exact and vanishes only for m = 1. Any m < 1
throws away (1 - m) of the tau steps of compute each round; m = 0 restarts
from phi_new as if the tau steps had not happened.

Streaming DiLoCo (Douillard et al. 2025) mixes theta <- m theta_t + (1 - m)
phi_new = phi_new + m (theta_t - phi_new), which is ours plus
m (theta_s - phi_new): it also keeps m of the drift made *before* the
exchange, which already travelled in theta_s and is inside phi_new, so it is
counted twice; at tau = 0 it equals the update without delay only for m = 0
(torchft's default ``fragment_update_alpha=0``, which is our m = 0). Ours
anchors the mix at theta_s instead of phi_new.

What NoLoCo's gamma term becomes. The outer step at s is the one without
delay, evaluated at s:

    delta_i <- alpha delta_i + beta mean_G(theta_s - phi) - gamma (phi_i - mean_G phi).

phi only moves at merges, so it is constant on (s, t]: the pull uses phi_s,
the slow weights of the previous merge, and mean_G phi_s, and the message
(theta_s, plus phi_s when gamma != beta) is today's, bytes included. No extra
gamma term acts on the tau steps: a replica's own progress during the delay
is not pulled towards its group until the next exchange, where it is part of
the pseudo-gradient phi_new - theta_{s + H} (counted once, scaled by m).
DiLoCo is the same with the all-replica mean.

State: from step s on ``slow_params`` holds phi_new (nothing reads phi before
the next exchange) and ``anchor`` holds theta_s (one more copy of the float
params, in their dtype), so a pause or checkpoint inside the window resumes
exactly. A replica the non-finite guard catches at s lands on its slow
weights there, as without delay, and its anchor is those weights; one that
breaks inside the window is caught at the merge and lands on phi_new.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from noloco_jax import comm, errors
from noloco_jax.optim import fragments as frag
from noloco_jax.optim.trees import (BATCHED_COUNTER_FIX, check_scalar_round, float_leaves,
                                    is_batched, is_float)

AxisName = Union[str, tuple[str, ...]]

__all__ = [
    "LocalStepsState",
    "local_steps",
    "data_parallel",
    "restore_nonfinite",
    "find_local_steps_state",
    "check_composition",
    "check_sync_every",
    "check_delay",
    "check_mixing",
]


class LocalStepsState(NamedTuple):
    """State of the transformation returned by ``local_steps``.

    Attributes:
      count: int32 scalar, inner steps taken so far (shared by all replicas).
      slow_params: phi, the weights at the last outer step: the params' float
        leaves in ``slow_dtype`` (default their own dtype); ``None`` where a
        param is not a float (such leaves are passed through untouched).
      local_opt_state: the inner optimizer's state (kept local, counts included).
      outer_state: the outer optimizer's state.
      nonfinite_resets: float32 scalar, syncs at which this replica's fast
        weights were not finite (only counted with ``nonfinite_guard``).
      phase_errors: int32 scalar (shared), steps whose ``sync_step`` (or
        ``merge_step``) flag disagreed with the counter (a round skipped or
        added); should stay 0.
      anchor: with ``delay > 0``, theta at the last exchange (the float
        leaves in the params' dtype; ``None`` elsewhere), which the merge
        subtracts; ``None`` without delay.
    """

    count: jax.Array
    slow_params: optax.Params
    local_opt_state: optax.OptState
    outer_state: optax.OptState
    nonfinite_resets: jax.Array
    phase_errors: jax.Array
    anchor: Any = None


def _update_dtype(p: Any) -> Any:
    """Updates to a float param travel in at least float32 (a 16-bit sync lands exactly)."""
    return jnp.promote_types(jnp.result_type(p), jnp.float32)


def _slow_dtype(p: Any, slow_dtype: Any) -> Any:
    """phi's dtype for param ``p``: ``slow_dtype`` (None: ``p``'s own); a complex ``p`` keeps a
    complex phi of at least that width (a real one dropped its imaginary part)."""
    if slow_dtype is None:
        return p.dtype
    return jnp.promote_types(slow_dtype, jnp.complex64) if jnp.iscomplexobj(p) else slow_dtype


def _check_slow_dtype(slow_dtype: Any) -> None:
    """None, or a float dtype of 2 bytes or more that JAX holds as it is; else a ``ValueError``.

    A 1-byte float (float8_e4m3fn) made phi NaN past 448 and rounded it to 3 mantissa bits;
    float64 without jax_enable_x64 was silently float32.
    """
    if slow_dtype is None:
        return
    if not _is_float_dtype(slow_dtype):
        raise ValueError(f"slow_dtype must be None or a float dtype, got {slow_dtype!r}.")
    dtype = jnp.dtype(slow_dtype)
    if dtype.itemsize < 2:
        raise ValueError(f"slow_dtype must be None or a float dtype of 2 bytes or more "
                         f"(e.g. jnp.float32), got {slow_dtype!r}.")  # fmt: skip
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise ValueError(f"slow_dtype: {dtype} needs jax_enable_x64 (JAX holds it as "
                         f"{jax.dtypes.canonicalize_dtype(dtype)}), got {slow_dtype!r}.")


def _keep_schedules(fresh: Any, old: Any) -> Any:
    """``fresh`` inner state at ``old``'s schedule positions.

    A replica the guard resets restarts Adam's moments and bias correction, not its learning
    rate schedule: it would warm up again and trail the others' cosine for the rest of the run.
    """
    # optax.inject_hyperparams makes the stateful kind (optax >= 0.2.3), with the schedules'
    # own states in `hyperparams_states`: everything but the inner state is schedule position.
    injected = tuple(k for k in (optax.InjectHyperparamsState,
                                 getattr(optax, "InjectStatefulHyperparamsState", None)) if k)
    kinds = (optax.ScaleByScheduleState, *injected)

    def keep(f: Any, o: Any) -> Any:
        if isinstance(f, optax.ScaleByScheduleState):
            return o
        if isinstance(f, injected):
            return o._replace(inner_state=_keep_schedules(f.inner_state, o.inner_state))
        return f

    return jax.tree.map(keep, fresh, old, is_leaf=lambda x: isinstance(x, kinds))


def _all_finite(tree: Any, axis_name: AxisName | None = None) -> jax.Array:
    """True when every leaf is finite; with ``axis_name``, on every shard along it."""
    leaves = [x for x in jax.tree.leaves(tree) if is_float(x)]
    # no float leaf (integer buffers only): nothing can break
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else \
        jnp.array(True)  # fmt: skip
    if axis_name is not None:  # model-parallel shards of one replica must agree
        ok = comm.all_true(ok, axis_name)
    return ok


def _counters_from(new: Any, kept: Any) -> Any:
    """Integer leaves (shared counters, which always advance) from ``new``, the rest from ``kept``."""
    return jax.tree.map(lambda n, k: n if jnp.issubdtype(n.dtype, jnp.integer) else k, new, kept)


def _same_varying_axes(a: Any, b: Any) -> tuple[Any, Any]:
    """``a`` and ``b`` with each leaf marked varying over the union of both's manual axes.

    Under ``shard_map`` a value computed from a per-shard quantity is typed as
    varying over that mesh axis; ``lax.cond`` needs both branches typed alike.
    Outside ``shard_map`` (no manual axes) this returns its inputs.
    """

    def cast(x: Any, want: frozenset) -> Any:
        missing = tuple(sorted(want - comm.varying_axes(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    want = jax.tree.map(lambda x, y: comm.varying_axes(x) | comm.varying_axes(y), a, b)
    return jax.tree.map(cast, a, want), jax.tree.map(cast, b, want)


def _pinned(new_slow: Any) -> Any:
    """phi_new as stored, in its own dtype, for the params to land on.

    XLA (excess precision allowed, its default) computes 16-bit arithmetic in
    float32 and dropped the narrowing cast of phi_new's last add together with
    the widening cast of the landing: with ``slow_dtype=jnp.bfloat16`` and
    float32 params, vmap and one-device replicas landed on phi before its
    bfloat16 rounding (up to half a bf16 ulp off the slow weights), a replica
    split over devices on phi itself. ``comm.as_stored`` keeps the rounding (a
    no-op for slow weights as wide as the params' updates).
    """
    return comm.as_stored(new_slow)


def _landing(new_slow: Any, params: Any, updates: Any) -> Any:
    """Updates that move each float param onto phi (rounded to its dtype).

    Formed in at least float32: the difference of two bf16 numbers is exact
    there, so ``params + jump`` is phi's bf16 value itself, not a rounding of
    a rounded jump. A float32 param lands within one rounding of phi (the sum
    rounds). Non-float leaves keep the inner update.
    """

    def jump(s: Any, p: Any, u: Any) -> Any:
        if s is None:
            return u
        wide = _update_dtype(p)
        return s.astype(p.dtype).astype(wide) - p.astype(wide)

    return jax.tree.map(jump, new_slow, params, updates, is_leaf=lambda x: x is None)


def _theta_like(new_slow: Any, params: Any) -> Any:
    """The params after a sync lands: phi in the params' dtypes, other leaves as they are."""
    return jax.tree.map(
        lambda s, p: p if s is None else s.astype(p.dtype), new_slow, params,
        is_leaf=lambda x: x is None,
    )  # fmt: skip


def _host_flag(flag: Any) -> Any:
    """A phase flag from NumPy (``(t + 1) % H == 0`` for a step ``t`` of ``np.arange``) as
    Python's bool or int, which the checks and branches compare by identity."""
    if isinstance(flag, np.bool_):
        return bool(flag)
    return int(flag) if isinstance(flag, np.integer) else flag


def _check_sync_step(sync_step: Any, num_frags: int, name: str = "sync_step") -> None:
    """``sync_step`` is None, a bool, or (with fragments) False or a fragment index."""
    if sync_step is None or isinstance(sync_step, bool) and (num_frags == 1 or not sync_step):
        return
    if num_frags > 1 and not isinstance(sync_step, bool) and isinstance(sync_step, int) \
            and 0 <= sync_step < num_frags:
        return
    allowed = "None, True or False" if num_frags == 1 else \
        f"None, False or the index (0..{num_frags - 1}) of the fragment that syncs"
    raise ValueError(f"{name} must be {allowed}, got {sync_step!r}.")


def _check_phases(sync_step: Any, merge_step: Any, num_frags: int, delay: int) -> None:
    """``merge_step`` goes with ``delay > 0`` and a static ``sync_step``; a step does one of them."""
    _check_sync_step(sync_step, num_frags)
    if delay == 0:
        if merge_step is not None:
            raise ValueError(f"merge_step needs delay > 0 (without delay a round's exchange "
                             f"lands on its sync step), got merge_step={merge_step!r}.")
        return
    _check_sync_step(merge_step, num_frags, "merge_step")
    if (sync_step is None) != (merge_step is None):
        raise ValueError(f"with delay={delay} give both sync_step (the exchange starts) and "
                         f"merge_step (it lands), or neither; got sync_step={sync_step!r}, "
                         f"merge_step={merge_step!r}.")  # fmt: skip
    if sync_step is not None and sync_step is not False and merge_step is not False:
        raise ValueError(f"with delay={delay} no step both starts an exchange and merges one "
                         f"(they are {delay} steps apart); got sync_step={sync_step!r}, "
                         f"merge_step={merge_step!r}.")  # fmt: skip


def _check_phase(count: jax.Array, sync_every: int, sync_step: Any, num_frags: int = 1,
                 delay: int = 0, name: str = "sync_step", print_error: bool = True
                 ) -> jax.Array:  # fmt: skip
    """1 (and a printed error) if ``sync_step`` disagrees with the counter, else 0.

    The print sits in a scalar ``lax.cond`` taken only on a mismatch, so a
    correct step moves nothing to the host. It does not raise: an exception in
    one device's callback would abort a multi-device program mid-collective.
    The count goes to ``LocalStepsState.phase_errors``. ``delay``: the flag
    names the step ``delay`` steps before the round ends (an exchange starts).
    """
    # The fragment the counter says ends its round (-1: none; one fragment is fragment 0).
    want = -1 if sync_step is False else 0 if sync_step is True else sync_step
    wrong = frag.sync_fragment(count + delay, sync_every, num_frags) != want
    extra = f", delay: {delay}" if delay else ""

    def report() -> None:
        jax.debug.print(
            "ERROR local_steps: " + name + "={flag} but this is inner step {c} and rounds end "
            "every sync_every={h} steps (fragments: {f}" + extra + "); the round was "
            + ("skipped" if sync_step is False else "added")
            + ". Pass the phase the counter gives (for a 0-based loop index t: "
            "(t + 1" + (" + delay" if delay else "") + ") % sync_every == 0), or None to let "
            "the counter decide.",
            flag=sync_step, c=count, h=sync_every, f=num_frags,
        )

    mesh = jax.sharding.get_abstract_mesh()
    if print_error and not (mesh.manual_axes and mesh.auto_axes):  # jax 0.10 cannot print
        lax.cond(wrong, report, lambda: None)  # from a partly manual shard_map: count there
    return wrong.astype(jnp.int32)


def check_sync_every(sync_every: int, field: str = "sync_every") -> int:
    """H, the inner steps per outer step: an integer >= 1; returns it."""
    return errors.check_int(field, sync_every)


def _is_float_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` names a float dtype; a name NumPy does not know (``"float33"``) is not."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # NumPy's "data type 'float33' not understood", naming no argument
        return False


def check_delay(delay: int, sync_every: int, num_fragments: int = 1, *, field: str = "delay",
                sync_field: str = "sync_every", fragments_field: str = "fragments") -> int:
    """tau, the steps between an exchange's start and its merge: 0 <= tau < H / P; returns it.

    An exchange must land before the next one (of any fragment) starts, H / P steps later.

    Args:
      delay: tau.
      sync_every: H.
      num_fragments: P (1 without fragments).
      field, sync_field, fragments_field: the names the message gives tau, H and P.

    Raises:
      UserError (a ``ValueError``): naming the value and the allowed range.
    """
    errors.check_int(sync_field, sync_every)
    errors.check_int(fragments_field, num_fragments)
    period = sync_every // num_fragments
    apart = f"{sync_field}={sync_every}" if num_fragments == 1 else \
        f"{sync_field} / {fragments_field} = {sync_every} / {num_fragments} = {period}"
    errors.check_int(field, delay, minimum=0)
    errors.require(delay < period, field,
                   f"must be an integer in [0, {period - 1}] (an exchange must land before the "
                   f"next one starts, {apart} steps later), got {delay!r}.")  # fmt: skip
    return int(delay)


def check_mixing(mixing: float, field: str = "mixing") -> float:
    """m, the share of the delay's local progress a merge keeps: a number in [0, 1]; returns it."""
    return errors.check_number(field, mixing, 0, 1)


def _accumulators(inner: Any) -> list[optax.MultiSteps]:
    """The ``optax.MultiSteps`` in ``inner``: itself, or inside the chains its update closes
    over (``optax.chain`` keeps its transformations in a closure)."""
    found, todo, seen = [], [getattr(inner, "update", None)], set()
    while todo:
        fn = todo.pop()
        if not callable(fn) or id(fn) in seen:
            continue
        seen.add(id(fn))
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, optax.MultiSteps):
            found.append(owner)
            continue
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            for item in value if isinstance(value, (tuple, list)) else (value,):
                todo.append(getattr(item, "update", item))
    return found


def _check_accumulation(inner: Any, sync_every: int, num_fragments: int = 1) -> int:
    """Every ``optax.MultiSteps`` in the inner optimizer ends its accumulations on sync steps.

    With P fragments a sync comes every H / P steps (some fragment's), so H / P must be a
    multiple of the accumulation count.

    Returns:
      How many it checked (``init`` compares it with the ``MultiStepsState``s it finds).
    """
    owners = _accumulators(inner)
    period = sync_every // num_fragments
    name = f"sync_every={sync_every}" if num_fragments == 1 else \
        f"sync_every / fragments = {sync_every} / {num_fragments} = {period}"
    for owner in owners:
        k = _constant_k(owner)
        if k > 0 and period % k:
            raise ValueError(
                f"{name} must be a multiple of the MultiSteps accumulation "
                f"count k={k} (local_steps counts micro-steps): a sync would otherwise fall in "
                f"the middle of an accumulation."
            )
    return len(owners)


def _constant_k(owner: optax.MultiSteps) -> int:
    """The accumulation count of a ``MultiSteps`` that ends an accumulation every k calls;
    ``ValueError`` for a count schedule (a function of the step) or a ``should_skip_update_fn``
    (a skipped call is not counted): either moves the ends off the sync steps, unchecked."""
    schedule = owner._every_k_schedule  # noqa: SLF001 - optax keeps the count private
    cells = [c.cell_contents for c in getattr(schedule, "__closure__", None) or ()]
    if not (schedule.__qualname__.startswith("MultiSteps.") and len(cells) == 1
            and isinstance(cells[0], int)):  # optax's wrapper of an int count
        raise ValueError("optax.MultiSteps inside local_steps needs an int every_k_schedule: a "
                         "count that changes with the step ends accumulations off the sync "
                         "steps. Pass the count as an int.")  # fmt: skip
    skip = owner._should_skip_update_fn  # noqa: SLF001 - optax's default one never skips
    if not getattr(skip, "__qualname__", "").startswith("MultiSteps."):
        raise ValueError("optax.MultiSteps inside local_steps cannot take should_skip_update_fn: "
                         "a skipped call is not counted, so its accumulations end off the sync "
                         "steps. For non-finite gradients use local_steps(..., "
                         "nonfinite_guard=True).")  # fmt: skip
    return cells[0]


def _check_accumulators_seen(state: Any, checked: int) -> None:
    """Refuses an inner state with more ``MultiStepsState``s than ``_check_accumulation`` saw."""
    kind = optax.MultiStepsState
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind))
    found = sum(isinstance(x, kind) for x in leaves)
    if found > checked:
        raise ValueError(
            "the inner optimizer accumulates gradients (optax.MultiSteps) where local_steps "
            "cannot read its count k to check that sync_every is a multiple of it; wrap the "
            "whole inner optimizer instead: local_steps(optax.MultiSteps(optax.chain(...), k), "
            "...)."
        )


def local_steps(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    sync_every: int,
    *,
    nonfinite_guard: bool = False,
    guard_axis_name: AxisName | None = None,
    slow_dtype: Any = None,
    check_phase: bool | str = True,
    fragments: Any = None,
    delay: int = 0,
    mixing: float = 1.0,
    resync_caught: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` every step and ``outer`` every ``sync_every`` steps.

    Args:
      inner: any optax transformation or chain (e.g. clipped Adam), applied to
        the gradients each step; its state stays local to the replica.
      outer: an outer transformation with the ``noloco_outer`` contract
        (``update(phi - theta, state, phi)`` returns delta), e.g.
        ``noloco_outer()`` or ``diloco_outer()``.
      sync_every: H, inner steps per outer step (paper: 50 NoLoCo, 100 DiLoCo).
      nonfinite_guard: at each sync, a replica whose fast weights are not all
        finite is passed to ``outer`` as ``active=False`` (it then sends nothing
        its partners use, so it cannot poison them), keeps its last slow
        weights and outer state (unless ``resync_caught``), restarts its inner
        optimizer from a fresh state (Adam's moments and count, so its bias
        correction starts over;
        a learning-rate schedule's position, ``optax.scale_by_schedule`` or
        ``optax.inject_hyperparams``, is kept, so it does not warm up again)
        and counts the event in ``nonfinite_resets``. Its returned update is
        not finite; repair the params with ``restore_nonfinite``.
      guard_axis_name: mesh axis (or axes) over which one replica's params are
        split (e.g. pipeline "stage"); the finiteness check is then taken over
        the whole replica, so all its shards reset together.
      slow_dtype: dtype of phi and of the outer state (e.g. ``jnp.float32``
        master weights for bf16 params; a float of 2 bytes or more); default: each
        param's own dtype. A complex param's phi is the complex dtype of that
        width (``complex64`` for float32).
        After every sync the params are phi rounded to their dtype: exactly for
        16-bit params, within one float32 rounding for float32 params (optax
        adds the jump phi - theta to theta, which rounds once).
      fragments: None (every sync moves all params), or a fragment spec
        (``noloco_jax.optim.fragments.by_layer_blocks(params, P)``): the
        params are split into P fragments and fragment p syncs at the steps t
        with ``t mod H == (p + 1) H / P``, so each sync moves one fragment
        (streaming). Each fragment keeps its own outer state (momentum and
        round counter) and draws its groups from its own stream
        (``stream=p`` to the outer step). Then ``sync_step`` is False or the
        index p of the fragment that syncs.
      check_phase: with ``sync_step`` given, check it against the counter on
        the device (a scalar branch): a mismatch prints an error and counts in
        ``phase_errors`` (a raise from the device could abort a mesh program).
        ``"count"``: count without printing, for a caller that reads
        ``phase_errors`` itself (no host callback, so the program can be cached).
      delay: tau, the overlapped exchange (module docstring): each round's
        exchange starts tau steps before the round ends, the inner steps go
        on meanwhile, and its result is merged when the round ends. 0 (the
        default) is the update without delay; needs 0 <= tau < H / P. The
        state then keeps theta at the exchange (one more copy of the params).
      mixing: m in [0, 1], the share of the progress made during the delay
        that the merge keeps: theta <- phi_new + m (theta_t - theta_s).
        1 (the default) keeps all of it, which to first order gives the
        weights the update without delay would have; 0 restarts from phi_new.
      resync_caught: with ``nonfinite_guard``, a caught replica takes the step
        ``outer`` gives an inactive replica and its new outer state instead of
        keeping its own (``diloco_outer(resync_absent=True)``: the round's shared
        step, so the slow weights stay one set); it still restarts its inner
        optimizer and lands on the new slow weights.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` acting on the model params
      (the fast weights). Extra keyword arguments go to ``inner``, except
      ``sync_step``: a Python bool that fixes the step's phase at trace time
      (True: this call ends a round; False: inner step only) instead of the
      on-device ``lax.cond`` over the counter; a loop that knows its step on
      the host uses it so that inner steps compile as the inner optimizer
      alone. For a 0-based loop index t that is ``(t + 1) % sync_every == 0``
      (``(t + 1 + delay) % sync_every == 0`` with ``delay``). With ``delay > 0``, ``sync_step`` marks the step that starts an
      exchange and ``merge_step`` (same values) the step that merges it;
      give both or neither. Non-float params (e.g. integer buffers) get the
      inner update and are never averaged or reset.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from noloco_jax import noloco_outer, replicas
      >>> tx = local_steps(optax.adam(1e-3), noloco_outer(), sync_every=50)
      >>> reps = replicas.make_replicas(8, backend="vmap")
      >>> params = jnp.zeros((8, 4))                    # 8 replicas, 4 params
      >>> state = reps.init(tx, params)                 # counters stay shared
      >>> step = jax.jit(reps.map(tx.update))           # binds axis "replica"
      >>> updates, state = step(jnp.ones((8, 4)), state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> int(state.count), state.local_opt_state[0].count.shape
      (1, (8,))
      >>> overlapped = local_steps(optax.adam(1e-3), noloco_outer(), 50, delay=2)
      >>> reps.init(overlapped, params).anchor.shape     # theta at the last exchange
      (8, 4)

    References:
      Kolehmainen et al., 2025, https://arxiv.org/abs/2506.10911;
      Douillard et al., 2023, https://arxiv.org/abs/2311.08105;
      Douillard et al., "Streaming DiLoCo with overlapping communication",
      2025, https://arxiv.org/abs/2501.18512 (fragments, delay, mixing);
      Kale et al., "Eager Updates For Overlapped Communication and
      Computation in DiLoCo", 2025, https://arxiv.org/abs/2502.12996.
    """
    check_sync_every(sync_every)
    _check_slow_dtype(slow_dtype)
    errors.check_bool("nonfinite_guard", nonfinite_guard)
    errors.check_bool("resync_caught", resync_caught)
    if not isinstance(check_phase, bool) and check_phase != "count":  # `in` took 1 and 0.0
        raise ValueError(f"check_phase must be True, False or 'count', got {check_phase!r}.")
    if isinstance(fragments, int):  # read as a one-leaf spec, it gave errors about P + 1
        raise ValueError(f"fragments must be a fragment spec, e.g. fragments.by_layer_blocks("
                         f"params, {fragments}), or None; got the int {fragments!r}.")
    num_frags, spec = frag.num_fragments(fragments), fragments
    fragments = None if num_frags == 1 else fragments  # one fragment: today's update
    frag.check_fragments(num_frags, sync_every)
    accumulators = _check_accumulation(inner, sync_every, num_frags)
    delay = check_delay(delay, sync_every, num_frags)
    mixing = check_mixing(mixing)
    inner = optax.with_extra_args_support(inner)
    outer = optax.with_extra_args_support(outer)
    rules = _Rules(inner, outer, nonfinite_guard, guard_axis_name, fragments, mixing,
                   resync_caught)

    def init_fn(params: optax.Params) -> LocalStepsState:
        params = jax.tree.map(jnp.asarray, params)  # a Python-number leaf has no dtype
        if spec is not None:
            frag.check_spec(spec, params, sync_every)
        slow = jax.tree.map(
            lambda p: jnp.array(p, dtype=_slow_dtype(p, slow_dtype), copy=True),
            float_leaves(params))  # fmt: skip
        anchor = None
        if delay:
            anchor = jax.tree.map(lambda p: jnp.array(p, copy=True), float_leaves(params))
        local_opt_state = inner.init(params)
        _check_not_an_outer_step(local_opt_state)
        _check_accumulators_seen(local_opt_state, accumulators)
        return LocalStepsState(
            count=jnp.zeros([], jnp.int32),
            slow_params=slow,
            local_opt_state=local_opt_state,
            outer_state=outer.init(slow) if fragments is None else tuple(
                outer.init(frag.take(slow, fragments, p)) for p in range(num_frags)),
            nonfinite_resets=jnp.zeros([], jnp.float32),
            phase_errors=jnp.zeros([], jnp.int32),
            anchor=anchor,
        )

    def update_fn(
        updates: optax.Updates,
        state: LocalStepsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LocalStepsState]:
        if params is None:
            raise ValueError("local_steps.update needs params= the current (fast) weights.")
        # a Python-number leaf has no dtype
        updates, params = jax.tree.map(jnp.asarray, (updates, params))
        if is_batched(state.count):
            raise ValueError(BATCHED_COUNTER_FIX)
        if jnp.ndim(state.nonfinite_resets) != 0:  # a per-replica scalar, seen with its N axis
            raise ValueError(
                "local_steps.update got the state of all replicas at once (its per-replica "
                f"leaves have a leading axis of {jnp.shape(state.nonfinite_resets)[0]}): "
                "call it per replica, e.g. jax.jit(reps.map(train_step)) with reps = "
                "noloco_jax.replicas.make_replicas(N).")
        check_scalar_round(state.count, "local_steps", "step")  # a vmap's default out_axes=0
        sync_step = _host_flag(extra_args.pop("sync_step", None))
        merge_step = _host_flag(extra_args.pop("merge_step", None))
        _check_phases(sync_step, merge_step, num_frags, delay)
        inner_updates, local_opt_state = inner.update(updates, state.local_opt_state, params, **extra_args)
        count = optax.safe_int32_increment(state.count)
        errors = state.phase_errors
        # Both branches return float updates in at least float32 (apply_updates
        # adds in that width and casts once), so a 16-bit sync lands exactly on phi.
        inner_updates = jax.tree.map(
            lambda u, p: u.astype(_update_dtype(p)) if is_float(p) else u, inner_updates, params
        )
        operands = (inner_updates, state.slow_params, state.outer_state, local_opt_state,
                    state.nonfinite_resets, state.anchor)  # fmt: skip
        if sync_step is None:
            branches = rules.on_device(params, operands, count, sync_every, num_frags, delay)
        else:  # the caller knows the phase statically (``trainer.step.make_program``)
            if check_phase:
                loud = check_phase != "count"
                errors = errors + _check_phase(count, sync_every, sync_step, num_frags, delay,
                                               print_error=loud)  # fmt: skip
                if delay:
                    errors = errors + _check_phase(count, sync_every, merge_step, num_frags,
                                                   name="merge_step", print_error=loud)  # fmt: skip
            branches = rules.static(params, operands, sync_step, merge_step, delay)
        new_updates, slow, outer_state, local_opt_state, resets, anchor = branches
        return new_updates, LocalStepsState(count, slow, local_opt_state, outer_state, resets,
                                            errors, anchor)  # fmt: skip

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _fragment(flag: Any, fragments: Any) -> int | None:
    """The fragment a phase flag names (None without fragments)."""
    return None if fragments is None else flag


class _Rules:
    """The branches of one ``local_steps`` update: the outer step, the merge, their choice.

    Every branch maps the operands ``(inner_updates, slow, outer_states,
    local_opt_state, resets, anchor)`` to new ones; ``p`` is the fragment they
    act on (None: all params).
    """

    def __init__(self, inner: Any, outer: Any, guard: bool, guard_axis: Any, fragments: Any,
                 mixing: float, resync_caught: bool = False) -> None:  # fmt: skip
        self.inner, self.outer, self.guard, self.guard_axis = inner, outer, guard, guard_axis
        self.fragments, self.mixing, self.resync_caught = fragments, mixing, resync_caught

    def view(self, tree: Any, p: int | None) -> Any:
        return tree if p is None else frag.take(tree, self.fragments, p)

    def merge(self, tree: Any, part: Any, p: int | None) -> Any:
        return part if p is None else frag.put(tree, part, self.fragments, p)

    def on_device(self, params: Any, operands: tuple, count: jax.Array, sync_every: int,
                  num_frags: int, delay: int) -> tuple:  # fmt: skip
        """The branch the counter picks, under ``lax.cond``/``lax.switch`` (only it runs)."""
        keep = lambda ops: ops  # noqa: E731
        if delay == 0 and self.fragments is None:
            return lax.cond(count % sync_every == 0, functools.partial(self.sync, params), keep,
                            operands)  # fmt: skip
        ps = [None] if self.fragments is None else list(range(num_frags))
        fns = [keep]
        index = frag.sync_fragment(count, sync_every, num_frags) + 1
        if delay == 0:  # one branch per fragment, taken on its sync steps
            fns += [functools.partial(self.sync, params, p=p) for p in ps]
        else:  # exchanges start `delay` steps before the rounds end; merges when they end
            fns += [functools.partial(self.exchange, params, p=p) for p in ps]
            fns += [functools.partial(self.land, params, p=p) for p in ps]
            start = frag.sync_fragment(count + delay, sync_every, num_frags)
            index = jnp.where(start >= 0, start + 1, jnp.where(index > 0, index + len(ps), 0))
        return lax.switch(index, fns, operands)

    def static(self, params: Any, operands: tuple, sync_step: Any, merge_step: Any,
               delay: int) -> tuple:  # fmt: skip
        """The branch the caller named (``sync_step`` / ``merge_step``)."""
        if sync_step is not False:
            fn = self.sync if delay == 0 else self.exchange
            return fn(params, operands, _fragment(sync_step, self.fragments))
        if delay and merge_step is not False:
            return self.land(params, operands, _fragment(merge_step, self.fragments))
        return operands

    def reset_inner(self, ok: jax.Array, slow: Any, params: Any, local_opt_state: Any,
                    resets: jax.Array) -> tuple[Any, jax.Array]:  # fmt: skip
        """The guard's verdict on the inner optimizer: unless ``ok``, a fresh state for weights
        landing on ``slow`` (schedules keep their place), and one more reset counted."""
        fresh = _keep_schedules(self.inner.init(_theta_like(slow, params)), local_opt_state)
        resets = resets + (~ok).astype(resets.dtype)  # (1.0 - ok: refused by strict promotion)
        return optax.tree.where(ok, local_opt_state, fresh), resets  # counts too

    def outer_step(self, params: Any, operands: tuple, p: int | None) -> tuple:
        """phi_new from theta after this step's inner update, and what the guard decided.

        Returns:
          (theta of fragment p, phi_new of fragment p, outer states, inner
          state, resets, ok) with ``ok`` None without the guard.
        """
        inner_updates, slow, outer_states, local_opt_state, resets, _ = operands
        outer_state = outer_states if p is None else outer_states[p]
        stream = {} if p is None else {"stream": p}  # fragments draw their groups apart
        theta_all = float_leaves(optax.apply_updates(params, inner_updates))
        slow_p, theta = self.view(slow, p), self.view(theta_all, p)
        outer_grad = jax.tree.map(lambda s, t: s - t.astype(s.dtype), slow_p, theta)
        ok = None
        if not self.guard:
            delta, outer_state = self.outer.update(outer_grad, outer_state, slow_p, **stream)
            new_slow = optax.apply_updates(slow_p, delta)
        else:
            ok = _all_finite(theta_all, self.guard_axis)
            safe_grad = optax.tree.where(ok, outer_grad, optax.tree.zeros_like(outer_grad))
            delta, new_outer = self.outer.update(safe_grad, outer_state, slow_p, active=ok,
                                                 **stream)  # fmt: skip
            take = jnp.ones_like(ok) if self.resync_caught else ok  # the outer's step or its own
            new_slow = optax.tree.where(take, optax.apply_updates(slow_p, delta), slow_p)
            # A cond, not a select, so no step copies the outer state (BENCHMARKS.md).
            new_outer, outer_state = _same_varying_axes(new_outer, outer_state)
            kept = lax.cond(take, lambda: new_outer, lambda: outer_state)
            outer_state = _counters_from(new_outer, kept)
            local_opt_state, resets = self.reset_inner(ok, self.merge(slow, new_slow, p), params,
                                                       local_opt_state, resets)  # fmt: skip
        new_slow = _pinned(new_slow)
        if p is not None:
            outer_state = tuple(outer_state if q == p else o for q, o in enumerate(outer_states))
        return theta, new_slow, outer_state, local_opt_state, resets, ok

    def sync(self, params: Any, operands: tuple, p: int | None = None) -> tuple:
        """The outer step that lands at once (no delay): theta <- phi_new."""
        inner_updates, slow, *_, anchor = operands
        _, new_slow, outer_state, local_opt_state, resets, _ = self.outer_step(params, operands, p)
        jump = _landing(new_slow, self.view(params, p), self.view(inner_updates, p))
        return (self.merge(inner_updates, jump, p), self.merge(slow, new_slow, p), outer_state,
                local_opt_state, resets, anchor)  # fmt: skip

    def exchange(self, params: Any, operands: tuple, p: int | None = None) -> tuple:
        """The outer step whose result waits: theta trains on, theta_s becomes the anchor.

        A replica the guard caught lands on its (kept) slow weights now, as
        without delay, and anchors there.
        """
        inner_updates, slow, *_, anchor = operands
        theta, new_slow, outer_state, local_opt_state, resets, ok = self.outer_step(
            params, operands, p)
        new_updates = inner_updates
        if ok is not None:
            jump = _landing(new_slow, self.view(params, p), self.view(inner_updates, p))
            mine = self.view(inner_updates, p)
            new_updates = self.merge(inner_updates, optax.tree.where(ok, mine, jump), p)
            theta = optax.tree.where(ok, theta, _as_params(new_slow, theta))
        return (new_updates, self.merge(slow, new_slow, p), outer_state, local_opt_state, resets,
                self.merge(anchor, theta, p))  # fmt: skip

    def land(self, params: Any, operands: tuple, p: int | None = None) -> tuple:
        """The merge: theta <- phi_new + m (theta after this step - anchor), phi_new = slow."""
        inner_updates, slow, outer_state, local_opt_state, resets, anchor = operands
        m = self.mixing

        def jump(s: Any, a: Any, x: Any, u: Any) -> Any:
            if s is None:
                return u
            wide = _update_dtype(x)
            theta = optax.apply_updates(x, u).astype(wide)  # as apply_updates will land it
            target = s.astype(wide) + m * (theta - a.astype(wide))
            return target.astype(x.dtype).astype(wide) - x.astype(wide)

        mine = jax.tree.map(jump, self.view(slow, p), self.view(anchor, p), self.view(params, p),
                            self.view(inner_updates, p), is_leaf=lambda x: x is None)
        if self.guard:  # broken inside the window: restore_nonfinite lands it on phi_new
            ok = _all_finite(float_leaves(optax.apply_updates(params, inner_updates)),
                             self.guard_axis)  # fmt: skip
            local_opt_state, resets = self.reset_inner(ok, slow, params, local_opt_state, resets)
        return (self.merge(inner_updates, mine, p), slow, outer_state, local_opt_state, resets,
                anchor)  # fmt: skip


def _as_params(new_slow: Any, like: Any) -> Any:
    """phi in the dtypes of ``like`` (the float params), None where ``like`` has none."""
    return jax.tree.map(lambda s, x: None if x is None else s.astype(x.dtype), new_slow, like,
                        is_leaf=lambda v: v is None)  # fmt: skip


def restore_nonfinite(
    params: optax.Params, opt_state: optax.OptState, axis_name: AxisName | None = None
) -> optax.Params:
    """Replaces a replica's params by its slow weights when they are not all finite.

    Call after ``optax.apply_updates`` when ``local_steps(...,
    nonfinite_guard=True)`` is in ``opt_state`` (anywhere in a chain; with several, e.g.
    one per group of an ``optax.partition``, each puts back its own params). An
    additive update cannot turn NaN back into numbers, so this is the step that
    actually resets theta <- phi for a replica the guard caught. Calling it
    after sync steps (with ``delay``, also merge steps) is enough (the guard
    resets the inner optimizer's state there; until then a broken replica's
    moments keep its updates non-finite).

    Args:
      params: the fast weights after ``optax.apply_updates``.
      opt_state: the optimizer state holding a ``LocalStepsState``.
      axis_name: mesh axis (or axes) over which one replica's params are split
        (e.g. pipeline "stage"); the check then covers the whole replica.

    Returns:
      ``params``, or the slow weights where the replica's params are not finite. Flax NNX
      trees work as they are: ``params`` from ``nnx.state(model, nnx.Param)`` and the
      ``opt_state`` of an ``nnx.Optimizer`` (their ``Variable``s are read as their values),
      and the result has the structure of ``params``.
    """
    # NNX wraps the params as Params and the state as OptVariables: compare their values.
    wrapped, params = params, _without_variables(params)
    is_state = lambda x: isinstance(x, LocalStepsState)  # noqa: E731
    for found in jax.tree.leaves(_without_variables(opt_state), is_leaf=is_state):
        if is_state(found):  # each local_steps (e.g. of an optax.partition) repairs its own
            params = _restore_one(params, found, axis_name)
    return jax.tree.unflatten(jax.tree.structure(wrapped), jax.tree.leaves(params))


def _restore_one(params: optax.Params, found: LocalStepsState, axis_name: AxisName | None
                 ) -> optax.Params:  # fmt: skip
    """``restore_nonfinite`` for the params one ``LocalStepsState`` holds slow weights of."""
    # Under optax.masked the slow weights hold MaskedNode where local_steps does not act:
    # those params are neither checked nor put back (the guard did not see them either).
    masked = lambda x: x is None or isinstance(x, optax.MaskedNode)  # noqa: E731
    try:
        slow = jax.tree.map(lambda s, p: None if masked(s) else s, found.slow_params, params,
                            is_leaf=masked)  # fmt: skip
    except ValueError as err:  # e.g. nnx.state(model): BatchStats and RNG state too
        raise ValueError(
            "restore_nonfinite: params must have the structure of the params the optimizer "
            "was built on (its slow weights'); with Flax NNX pass nnx.state(model, nnx.Param) "
            "(the wrt of nnx.Optimizer), not nnx.state(model).") from err
    mine = jax.tree.map(lambda s, p: None if s is None else p, slow, params,
                        is_leaf=lambda x: x is None)  # fmt: skip

    def put_back(carry):
        done, p = carry  # or-ing keeps the flag's shard_map varying-axes type
        return jnp.logical_or(done, True), _theta_like(slow, p)

    # A loop run once for a broken replica, never for a healthy one (BENCHMARKS.md).
    ok = _all_finite(mine, axis_name)
    _, params = lax.while_loop(lambda c: jnp.logical_not(c[0]), put_back, (ok, params))
    return params


def _without_variables(tree: Any) -> Any:
    """``tree`` with each Flax NNX ``Variable`` replaced by its value (other trees as they are)."""
    from flax import nnx  # noqa: PLC0415

    return nnx.as_pure(tree)


def _check_not_an_outer_step(inner_state: optax.OptState) -> None:
    """``local_steps(noloco_outer(), optax.adam(...), H)``: the arguments swapped."""
    from noloco_jax.optim.diloco import DiLoCoOuterState  # noqa: PLC0415
    from noloco_jax.optim.noloco import NoLoCoOuterState  # noqa: PLC0415

    kinds = (NoLoCoOuterState, DiLoCoOuterState)
    stop = lambda x: isinstance(x, (*kinds, LocalStepsState))  # noqa: E731 (nested: allowed)
    if any(isinstance(x, kinds) for x in jax.tree.leaves(inner_state, is_leaf=stop)):
        raise ValueError(
            "local_steps: its inner optimizer holds an outer step (noloco_outer or "
            "diloco_outer); the order is local_steps(inner, outer, sync_every), e.g. "
            "local_steps(optax.adam(1e-3), noloco_outer(), 50).")


def _chain_stages(x: Any) -> tuple | None:
    """The stages of an ``optax.chain`` (a tuple) or ``named_chain`` (a dict) state."""
    if type(x) is tuple:
        return x
    return tuple(x.values()) if isinstance(x, dict) else None


def _follows_local_steps(opt_state: optax.OptState) -> bool:
    """Whether a chain state holds a stage after its ``local_steps``.

    A masked stage after it (``optax.masked``) is allowed: the masks keep it on other leaves,
    as in ``chain(masked(local_steps(...), m), masked(sgd, not m))``.
    """
    stages = _chain_stages(opt_state)
    if stages is not None:
        holds = [find_local_steps_state(x) is not None for x in stages]
        later = stages[holds.index(True) + 1:] if any(holds) else ()
        if any(not isinstance(x, optax.MaskedState) for x in later):
            return True
    is_chain = lambda x: x is not opt_state and _chain_stages(x) is not None  # noqa: E731
    return any(_follows_local_steps(x)
               for x in jax.tree.leaves(opt_state, is_leaf=is_chain) if is_chain(x))  # fmt: skip


def check_composition(opt_state: optax.OptState) -> None:
    """Refuses optax wrappers that desynchronise the replicas of ``local_steps``.

    ``optax.apply_if_finite`` around ``local_steps`` skips a step on one
    replica only, so its counter and rounds fall behind its group's (under
    ``shard_map`` its partners wait for a message that never comes);
    ``optax.MultiSteps`` around it runs the update, and so a sync's exchange,
    on every micro-step. Both work *inside* ``local_steps`` (as ``inner``),
    where a ``MultiSteps`` count must divide ``sync_every``. A stage after
    ``local_steps`` in an ``optax.chain`` or ``named_chain`` is refused too: it would change the
    sync step's update.

    Args:
      opt_state: the (single-replica or replicated) optimizer state.

    Raises:
      ValueError: naming the wrapper and the fix.
    """
    if _follows_local_steps(opt_state):
        raise ValueError(
            "a transformation follows local_steps in an optax.chain: it would change the "
            "sync step's update, so theta would not land on phi. Put it before local_steps, "
            "or inside it, in the inner optimizer.")
    wrappers = (optax.ApplyIfFiniteState, optax.MultiStepsState)
    is_wrapper = lambda x: isinstance(x, wrappers)  # noqa: E731
    for node in jax.tree.leaves(opt_state, is_leaf=is_wrapper):
        if is_wrapper(node) and find_local_steps_state(node) is not None:
            finite = isinstance(node, optax.ApplyIfFiniteState)
            fix = ("or use local_steps(..., nonfinite_guard=True) for non-finite steps, with "
                   "params = restore_nonfinite(params, opt_state) after optax.apply_updates "
                   "(the guard repairs the state, restore_nonfinite the weights)." if finite
                   else "so that every call of local_steps is one inner step.")  # fmt: skip
            raise ValueError(
                f"optax.{'apply_if_finite' if finite else 'MultiSteps'} wraps local_steps: it "
                f"would run or skip steps per replica and desynchronise the replicas' rounds. "
                f"Put it inside, as local_steps' inner optimizer, {fix}")


def find_local_steps_state(opt_state: optax.OptState) -> LocalStepsState | None:
    """The first ``LocalStepsState`` in ``opt_state`` (e.g. inside a chain), or None."""
    is_state = lambda x: isinstance(x, LocalStepsState)  # noqa: E731
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
    return found[0] if found else None


def _averaged(updates: optax.Updates, params: optax.Params | None) -> Any:
    """The updates ``data_parallel`` averages: float ones, and integer ones of a float param
    (in its dtype; left out, they moved each replica by its own gradient); others ``None``."""
    if params is None:
        return float_leaves(updates)

    def pick(u: Any, p: Any) -> Any:
        if u is None or is_float(u):
            return u
        return u.astype(jnp.result_type(p)) if is_float(p) else None

    return jax.tree.map(pick, updates, params, is_leaf=lambda x: x is None)


def data_parallel(
    inner: optax.GradientTransformation, axis_name: str | None = "replica"
) -> optax.GradientTransformationExtraArgs:
    """Averages gradients over all replicas every step, then applies ``inner``.

    The paper's "FSDP" baseline (really DDP: an all-reduce every step, no
    parameter sharding). To clip each replica's gradient before the mean, as
    the reference code does, chain the clipping before this transformation;
    to clip the mean, put it inside ``inner``. Integer leaves (buffers) are not
    averaged: each replica passes its own to ``inner``, as ``local_steps`` does.

    Args:
      inner: any optax transformation or chain.
      axis_name: replica axis bound by ``jax.vmap``/``jax.shard_map``; ``None``
        for a single replica (then this is just ``inner``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is ``inner``'s.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from noloco_jax import replicas
      >>> tx = data_parallel(optax.sgd(0.1))
      >>> reps = replicas.make_replicas(4, backend="vmap")
      >>> params, grads = jnp.zeros((4, 2)), jnp.arange(8.0).reshape(4, 2)
      >>> updates, _ = reps.map(tx.update)(grads, reps.init(tx, params), params)
      >>> updates[0].tolist()  # -0.1 * mean over replicas
      [-0.30000001192092896, -0.4000000059604645]
    """
    inner = optax.with_extra_args_support(inner)

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        if axis_name is not None:
            comm.axis_size(axis_name)  # integer buffers are per replica: never averaged
            mean = comm.all_replica_mean(_averaged(updates, params), axis_name)
            updates = jax.tree.map(lambda m, u: u if m is None else m, mean, updates,
                                   is_leaf=lambda x: x is None)  # fmt: skip
        return inner.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)
