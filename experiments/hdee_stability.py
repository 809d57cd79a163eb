"""How much of the HDEE count is noise: two hdee.json runs of the same seeds, compared.

    python -m experiments.hdee_stability --before OLD.json [--after experiments/results/hdee.json]

Two runs of experiments.hdee with the same seeds whose data differ slightly (e.g. a fix to one
domain's text) train every expert on a slightly different stream. If the count of domains
where a heterogeneous ensemble is lowest measured the method, it would barely move. For each
weighting rule this prints: the median change of one ensemble's perplexity on one domain
between the runs (the noise), the median gap between the best heterogeneous ensemble and the
homogeneous one (the signal), how many (domain, seed) cells changed their lowest ensemble, and
how many training domains changed tier. Reads only the two files; trains nothing.
"""

from __future__ import annotations

import pathlib
import statistics
from typing import Sequence

import numpy as np
from absl import flags

from experiments import options
from noloco_jax.errors import UserError

BEFORE = flags.DEFINE_string("before", None, "The earlier run's hdee.json.")
AFTER = flags.DEFINE_string(  # the published one; it was relative to the current directory
    "after", str(pathlib.Path(__file__).resolve().parent / "results" / "hdee.json"),
    "The later run's hdee.json (default: the published experiments/results/hdee.json).")
HOMO = "M_Ho-I_Ho"


def _lowest(ppl: dict, domain: str, rule: str) -> str:
    return min(ppl, key=lambda e: ppl[e][domain][rule])


def _hetero_gap(ppl: dict, domain: str, rule: str) -> float:
    """|log(best heterogeneous PPL / homogeneous PPL)| on one domain."""
    best = min(ppl[e][domain][rule] for e in ppl if e != HOMO)
    return abs(float(np.log(best / ppl[HOMO][domain][rule])))


def _design(run: dict) -> dict[str, dict[str, list[str]]]:
    """{ensemble: {domain: sorted rules}} of one seed's entry."""
    return {e: {d: sorted(rules) for d, rules in ds.items()} for e, ds in run["ppl"].items()}


def compare(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Noise against signal per weighting rule; see the module docstring.

    Args:
      before: one hdee.json (``{"seeds": {seed: {"ppl", "tiers"}}}``).
      after: another, with the same seeds, ensembles, domains and rules.

    Returns:
      ``{rule: {"median_change", "median_gap", "lowest_changed", "cells", "tiers_changed",
      "trained"}}``; the first two are fractions (0.03 = 3 %).

    Raises:
      UserError: the runs differ in seeds, ensembles, domains or rules.
    """
    if sorted(before["seeds"]) != sorted(after["seeds"]):
        raise UserError(f"seeds: the runs have {sorted(before['seeds'])} and "
                        f"{sorted(after['seeds'])}; compare runs of the same seeds.")
    out: dict[str, dict[str, float]] = {}
    for seed in sorted(before["seeds"]):
        a, b = before["seeds"][seed], after["seeds"][seed]
        if _design(a) != _design(b):
            raise UserError(f"seed {seed}: the runs differ in ensembles, domains or rules; "
                            "compare runs of the same design.")
        domains = sorted(a["ppl"][HOMO])
        tier_moves = sum(a["tiers"][d] != b["tiers"].get(d) for d in a["tiers"])  # rule-free
        for rule in sorted(a["ppl"][HOMO][domains[0]]):
            r = out.setdefault(rule, {"changes": [], "gaps": [], "lowest_changed": 0, "cells": 0,
                                      "tiers_changed": 0, "trained": 0})
            for d in domains:
                r["changes"] += [abs(float(np.log(b["ppl"][e][d][rule] / a["ppl"][e][d][rule])))
                                 for e in a["ppl"]]
                r["gaps"] += [_hetero_gap(a["ppl"], d, rule), _hetero_gap(b["ppl"], d, rule)]
                r["lowest_changed"] += _lowest(a["ppl"], d, rule) != _lowest(b["ppl"], d, rule)
                r["cells"] += 1
            r["tiers_changed"] += tier_moves
            r["trained"] += len(a["tiers"])
    for r in out.values():
        r["median_change"] = statistics.median(r.pop("changes"))
        r["median_gap"] = statistics.median(r.pop("gaps"))
    return out


def report(result: dict[str, dict[str, float]]) -> str:
    lines = ["rule         median change between runs   median best-hetero vs homo gap   "
             "lowest changed   tiers changed"]
    for rule, r in sorted(result.items()):
        change, gap = 100 * r["median_change"], 100 * r["median_gap"]
        lines.append(f"{rule:<12} {change:>26.1f} % {gap:>31.1f} % "
                     f"{r['lowest_changed']:>9} / {r['cells']:<4} "
                     f"{r['tiers_changed']:>7} / {r['trained']}")
    return "\n".join(lines)


def _load(flag: str, path: str | None) -> dict:
    if not path:
        raise UserError(f"--{flag}: required; give the path of an hdee.json.")
    run = options.read_json(flag, path)
    if not isinstance(run, dict) or not isinstance(run.get("seeds"), dict):
        raise UserError(f"--{flag}: {path} is not an hdee.json (no 'seeds'); give the hdee.json "
                        f"that experiments.hdee wrote.")
    return run


def main(argv: Sequence[str]) -> None:
    options.start(argv)  # a UserError below exits with status 2 (options.run)
    print(report(compare(_load("before", BEFORE.value), _load("after", AFTER.value))))


if __name__ == "__main__":
    options.run(main)
