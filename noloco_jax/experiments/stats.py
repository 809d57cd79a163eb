"""The statistics of the analysis plan (``plan``): the primary metric, paired tests, Fig. 3.

Small functions on plain lists, each checked in tests/test_stats.py against numbers worked
out by hand:

- ``sync_aligned_mean``: the primary metric, a metric averaged over the last k evaluations
  that fall on a sync step of a given period (DiLoCo's), the same steps for every method.
- ``paired_test``: paired two-sided t-test and sign count of per-seed differences, and the
  verdict of a cell at level alpha.
- ``split_by_phase``: evaluations at sync steps vs mid-round (Fig. 3A's two series).
- ``partial_correlation``: the correlation of two series with a third regressed out of both
  (Fig. 3B: spread vs learning rate, given the step).
- ``binomial_power`` / ``domains_for_power``: HDEE's count of domains against chance.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import scipy.integrate
import scipy.stats

from noloco_jax import errors

__all__ = ["sync_aligned_steps", "sync_aligned_mean", "paired_test", "verdict", "sign_test",
           "split_by_phase", "pearson", "run_metric", "partial_correlation", "lag1",
           "partial_correlation_ar1", "binomial_tail",
           "binomial_power", "domains_for_power", "paired_t_power", "seeds_for_power"]  # fmt: skip


def sync_aligned_steps(steps: Sequence[int], period: int, last: int) -> list[int]:
    """The last ``last`` of ``steps`` (after step 0) that are multiples of ``period``.

    Args:
      steps: evaluation steps.
      period: the sync period H whose sync steps count.
      last: how many.

    Returns:
      Sorted steps; fewer than ``last`` raises.

    Raises:
      ValueError: ``period`` or ``last`` below 1, or fewer than ``last`` aligned evaluations.

    Example:
      >>> sync_aligned_steps([25, 50, 75, 100, 125, 150, 175, 200], 20, 2)
      [100, 200]
    """
    errors.check_int("period", period, 1)
    errors.check_int("last", last, 1)  # steps[-0:] would be all of them
    aligned = sorted(s for s in steps if s > 0 and s % period == 0)
    if len(aligned) < last:
        raise ValueError(f"only {len(aligned)} evaluations fall on a multiple of {period} "
                         f"(steps {sorted(steps)}); the metric needs {last}.")  # fmt: skip
    return aligned[-last:]


def sync_aligned_mean(evals: Sequence[dict], period: int, last: int, key: str = "val_ppl"
                      ) -> float:  # fmt: skip
    """The primary metric: ``key`` averaged over the last ``last`` sync-aligned evaluations.

    Args:
      evals: eval records (``{"step": ..., key: ...}``), one per step.
      period: the reference sync period (DiLoCo's H), the same for every method of a cell.
      last: evaluations averaged.
      key: the metric (pooled ``val_ppl``; ``val_ppl_avg_model`` for the secondary one).

    Returns:
      The mean of ``key`` at those steps.
    """
    by_step = {r["step"]: r[key] for r in evals}
    return float(np.mean([by_step[s] for s in sync_aligned_steps(list(by_step), period, last)]))


def run_metric(run: dict, period: int, last: int, key: str = "val_ppl") -> float:
    """``sync_aligned_mean`` of a stored run, refusing a run that stopped before its end.

    A run whose evaluations end early would be read at other steps than its pair, which
    the plan forbids (every method at the same steps).

    Args:
      run: a results entry (``{"eval": [...], "run_info": {"config": {"num_steps": ...}}}``).
      period, last, key: as ``sync_aligned_mean``.

    Raises:
      ValueError: the evaluations end before the run's ``num_steps``.
    """
    planned = run.get("run_info", {}).get("config", {}).get("num_steps")
    reached = max((r["step"] for r in run["eval"]), default=0)
    if planned is not None and reached < planned:
        raise ValueError(f"a run's evaluations end at step {reached}, before its num_steps="
                         f"{planned}: it stopped early and would be compared at other steps "
                         f"than its pair. Finish it (rerun the experiment) or drop it.")
    return sync_aligned_mean(run["eval"], period, last, key)


def sign_test(diffs: Sequence[float]) -> dict[str, float]:
    """Two-sided exact sign test of paired differences (ties dropped).

    Returns:
      ``{"negative", "positive", "ties", "p"}``; p = P(a count at least as far from half as
      this one | each sign has probability 1/2).
    """
    if any(math.isnan(d) for d in diffs):
        raise ValueError("sign_test: a difference is NaN (a run without its metric).")
    neg = sum(d < 0 for d in diffs)
    pos = sum(d > 0 for d in diffs)
    n = neg + pos
    p = 1.0 if n == 0 else min(1.0, 2 * binomial_tail(n, max(neg, pos), 0.5))
    return {"negative": neg, "positive": pos, "ties": len(diffs) - n, "p": p}


def paired_test(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Paired two-sided t-test of ``a - b`` (one pair per seed) and the sign count.

    Args:
      a: the metric of method A per seed.
      b: the metric of method B for the same seeds, in the same order.

    Returns:
      ``mean`` and ``sd`` of the differences, ``t``, ``df``, two-sided ``p`` (nan with one
      pair), the sign test's ``negative``, ``positive``, ``ties``, ``sign_p``, and
      ``diverged``: pairs with an infinite value (a diverged run scored inf), for which the
      t-test is undefined (t and p nan; ``verdict`` names them).

    Raises:
      ValueError: unequal or empty lists, or a NaN value (a run without its metric).

    Example:
      >>> r = paired_test([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
      >>> round(r["t"], 4), r["df"], round(r["p"], 4)
      (3.4641, 2, 0.0742)
    """
    if len(a) != len(b) or len(a) == 0:  # not ``not a``: ambiguous for a numpy array
        raise ValueError(f"paired_test needs two equally long non-empty lists, got {len(a)} "
                         f"and {len(b)}.")  # fmt: skip
    values = np.stack([np.asarray(a, float), np.asarray(b, float)])
    if np.isnan(values).any():
        bad = sorted(set(np.flatnonzero(np.isnan(values).any(0)).tolist()))
        raise ValueError(f"paired_test: pair(s) {bad} hold a NaN value (a run without its "
                         f"metric); drop the pair or score a diverged run as inf.")  # fmt: skip
    diverged = int(np.isinf(values).any(0).sum())
    d = values[0] - values[1]
    n = len(d)
    mean = float(d.mean()) if not np.isnan(d).any() else float("nan")  # inf - inf: nan
    sd = float(d.std(ddof=1)) if n > 1 and not diverged else float("nan")
    if n < 2 or diverged:
        t = p = float("nan")
    elif sd == 0:
        t, p = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    else:
        t = mean / (sd / math.sqrt(n))
        p = float(2 * scipy.stats.t.sf(abs(t), df=n - 1))
    sign = sign_test(np.nan_to_num(d, nan=0.0).tolist())  # inf - inf: a tie
    return {"mean": mean, "sd": sd, "n": n, "t": t, "df": n - 1, "p": p,
            "negative": sign["negative"], "positive": sign["positive"], "ties": sign["ties"],
            "sign_p": sign["p"], "diverged": diverged}  # fmt: skip


def verdict(test: dict[str, float], alpha: float) -> str:
    """The plan's reading of a paired test of A - B (A = NoLoCo, B = DiLoCo).

    Returns:
      "A < B" when the mean difference is negative and p < alpha, "A > B" when positive and
      p < alpha, else "no difference shown" (which is not evidence of equality).
    """
    if test.get("diverged"):
        return f"not tested: {test['diverged']} of {test['n']} pairs diverged"
    if not test["p"] < alpha:  # also nan (one seed)
        return "no difference shown"
    return "A < B" if test["mean"] < 0 else "A > B"


def split_by_phase(steps: Sequence[int], values: Sequence[float], period: int
                   ) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:  # fmt: skip
    """Fig. 3A's two series: points at sync steps of ``period`` and points mid-round.

    Returns:
      (sync-aligned [(step, value)], mid-round [(step, value)]), step 0 left out.
    """
    errors.check_int("period", period, 1)
    pts = [(int(s), float(v)) for s, v in zip(steps, values) if s > 0]
    return [p for p in pts if p[0] % period == 0], [p for p in pts if p[0] % period]


# A series whose std is at most this fraction of its largest value varies by float rounding
# only: [0.1] * 3 has std 1.4e-17, an lr exactly affine in the step residuals of ~1e-19.
_ROUNDING = 1e-12


def _flat(v: np.ndarray, scale: np.ndarray) -> bool:
    """Whether ``v`` varies by no more than the rounding of numbers as large as ``scale``."""
    return bool(v.std() <= _ROUNDING * np.abs(scale).max(initial=0.0))


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation (nan when a series is constant, up to float rounding)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if _flat(x, x) or _flat(y, y):
        return float("nan")
    return float(np.mean((x - x.mean()) * (y - y.mean())) / (x.std() * y.std()))


def _residuals(y: np.ndarray, controls: np.ndarray) -> np.ndarray:
    controls = np.asarray(controls, float)
    controls = controls - controls.mean(0)  # the same fit, better conditioned (step 1e9 + t)
    design = np.column_stack([np.ones(len(y)), controls])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    return y - design @ coef


def partial_correlation(x: Sequence[float], y: Sequence[float], control: Sequence[float]
                        ) -> dict[str, float]:  # fmt: skip
    """The correlation of ``x`` and ``y`` with a linear fit on ``control`` removed from both.

    For Fig. 3B: x = spread, y = inner learning rate, control = step. A spread that only
    drifts with time correlates with any monotone schedule; the partial correlation is what the
    learning rate explains beyond the step. The p-value is the t-test of a partial correlation
    with one control: t = r sqrt((n - 3) / (1 - r^2)), n - 3 degrees of freedom.

    Args:
      x: first series.
      y: second series.
      control: the series regressed out (with an intercept) of both.

    Returns:
      ``r`` (partial), ``p`` (two-sided), ``n``, and the plain correlations ``r_xy``,
      ``r_xc``, ``r_yc``. ``r`` and ``p`` are nan when ``control`` explains ``x`` or ``y``
      fully (a constant series, or one affine in the control: only rounding is left).
    """
    x, y, c = (np.asarray(v, float) for v in (x, y, control))
    n = len(x)
    if not n == len(y) == len(c) or n < 4:
        raise ValueError(f"partial_correlation needs three equally long series of >= 4 points, "
                         f"got {len(x)}, {len(y)}, {len(c)}.")  # fmt: skip
    rx, ry = _residuals(x, c), _residuals(y, c)
    # a series the control explains fully leaves rounding residuals: no correlation is defined
    r = float("nan") if _flat(rx, x) or _flat(ry, y) else pearson(rx, ry)
    if math.isnan(r):
        p = float("nan")
    elif abs(r) >= 1:
        p = 0.0
    else:
        p = float(2 * scipy.stats.t.sf(abs(r) * math.sqrt((n - 3) / (1 - r * r)), df=n - 3))
    return {"r": r, "p": p, "n": n, "r_xy": pearson(x, y), "r_xc": pearson(x, c),
            "r_yc": pearson(y, c)}  # fmt: skip


def lag1(x: Sequence[float]) -> float:
    """Lag-1 autocorrelation of a series (the Pearson r of its neighbours)."""
    x = np.asarray(x, float)
    return pearson(x[:-1], x[1:])


def partial_correlation_ar1(x: Sequence[float], y: Sequence[float], control: Sequence[float]
                            ) -> dict[str, float]:  # fmt: skip
    """``partial_correlation`` with its p-value for autocorrelated series.

    Neighbouring evaluations of one run are not independent. With AR(1) residuals of lag-1
    autocorrelations a and b, the r of n points varies as that of Bartlett's effective
    n_eff = n (1 - a b) / (1 + a b) independent ones (at most n); the t-test then uses
    n_eff - 3 degrees of freedom (at least 1).

    Returns:
      ``partial_correlation``'s entries plus ``lag1_x``, ``lag1_y`` (of the residuals),
      ``n_eff`` and ``p_eff``.
    """
    out = partial_correlation(x, y, control)
    c = np.asarray(control, float)
    a = lag1(_residuals(np.asarray(x, float), c))
    b = lag1(_residuals(np.asarray(y, float), c))
    n_eff = min(out["n"], out["n"] * (1 - a * b) / (1 + a * b))  # never more than the points
    df, r = max(n_eff - 3, 1.0), out["r"]
    p_eff = 0.0 if abs(r) >= 1 else float(2 * scipy.stats.t.sf(abs(r) * math.sqrt(df / (1 - r * r)),
                                                                df=df))  # fmt: skip
    return {**out, "lag1_x": a, "lag1_y": b, "n_eff": n_eff, "p_eff": p_eff}


def binomial_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p) (no float overflow of comb(n, i) from n ~ 1030 on)."""
    return float(scipy.stats.binom.sf(k - 1, n, p))


def _critical_count(n: int, p0: float, alpha: float) -> int:
    """The smallest count k with P(X >= k | p0) <= alpha (n + 1 if none)."""
    for k in range(n + 1):
        if binomial_tail(n, k, p0) <= alpha:
            return k
    return n + 1


def _check_level(alpha: float, power: float | None = None, **rates: float) -> None:
    """alpha in (0, 1), a target power in (0, 1], probabilities in [0, 1] (5 for 5 % is not)."""
    errors.check_number("alpha", alpha, 0, 1, open_low=True, open_high=True)
    if power is not None:
        errors.check_number("power", power, 0, 1, open_low=True)
    for name, value in rates.items():
        errors.check_number(name, value, 0, 1)


def binomial_power(n: int, p0: float, p1: float, alpha: float) -> dict[str, float]:
    """Power of the one-sided exact binomial test of a count of n against chance p0.

    HDEE: a heterogeneous ensemble is lowest in X of n domains; under "all three ensembles are
    equally good" X ~ Binomial(n, 2/3). If the true rate is p1 (the paper: 20 / 21), the test
    that rejects for X >= k (k the smallest count with P(X >= k | p0) <= alpha) rejects with
    probability P(X >= k | p1).

    Returns:
      ``critical`` count k, ``size`` P(X >= k | p0) and ``power`` P(X >= k | p1).

    Raises:
      ValueError: ``n`` below 0, ``p0`` or ``p1`` outside [0, 1], ``alpha`` outside (0, 1).
    """
    errors.check_int("n", n, 0)
    _check_level(alpha, p0=p0, p1=p1)
    k = _critical_count(n, p0, alpha)
    return {"critical": k, "size": binomial_tail(n, k, p0) if k <= n else 0.0,
            "power": binomial_tail(n, k, p1) if k <= n else 0.0}  # fmt: skip


def domains_for_power(p0: float, p1: float, alpha: float, power: float, max_n: int = 200
                      ) -> int:  # fmt: skip
    """The fewest domains n with ``binomial_power(n, p0, p1, alpha)["power"] >= power``.

    The exact test's power is not monotone in n (the critical count moves in steps); this is
    the first n that reaches it.

    Raises:
      ValueError: ``power`` outside (0, 1], as ``binomial_power``, or no n <= ``max_n``.
    """
    _check_level(alpha, power, p0=p0, p1=p1)
    for n in range(1, max_n + 1):
        if binomial_power(n, p0, p1, alpha)["power"] >= power:
            return n
    raise ValueError(f"no n <= {max_n} reaches power {power} (p0 = {p0}, p1 = {p1}).")


def paired_t_power(n: int, effect: float, alpha: float) -> float:
    """Power of the two-sided paired t-test with n pairs at standardised effect mean/sd.

    Uses the noncentral t distribution: power = P(|T'| > t_crit), T' with n - 1 degrees of
    freedom and noncentrality effect x sqrt(n).

    Raises:
      ValueError: ``alpha`` outside (0, 1) or ``effect`` not finite.
    """
    _check_level(alpha)
    errors.require(math.isfinite(effect), "effect", f"must be a finite number, got {effect!r}.")
    if n < 2:
        return 0.0
    df, nc = n - 1, effect * math.sqrt(n)
    crit = scipy.stats.t.ppf(1 - alpha / 2, df)
    power = scipy.stats.nct.sf(crit, df, nc) + scipy.stats.nct.cdf(-crit, df, nc)
    if math.isnan(power):  # scipy's noncentral t gives nan for some large noncentralities
        power = _power_by_integration(crit, df, nc)
    return float(power)


def _power_by_integration(crit: float, df: int, nc: float) -> float:
    """P(|T'| > crit) for T' = (Z + nc) / sqrt(V / df), integrated over V ~ chi2(df)."""

    def given(v: float) -> float:
        s = crit * math.sqrt(v / df)
        return scipy.stats.norm.cdf(nc - s) + scipy.stats.norm.cdf(-nc - s)

    density = scipy.stats.chi2(df).pdf
    return float(scipy.integrate.quad(lambda v: given(v) * density(v), 0, math.inf)[0])


def seeds_for_power(effect: float, alpha: float, power: float, max_n: int = 1000) -> int:
    """The fewest pairs n >= 2 whose paired t-test reaches ``power`` at ``effect``.

    Raises:
      ValueError: ``alpha`` outside (0, 1), ``power`` outside (0, 1], or no n <= ``max_n``.
    """
    _check_level(alpha, power)
    errors.require(math.isfinite(effect), "effect", f"must be a finite number, got {effect!r}.")
    for n in range(2, max_n + 1):
        if paired_t_power(n, effect, alpha) >= power:
            return n
    raise ValueError(f"no n <= {max_n} reaches power {power} at effect {effect}.")
