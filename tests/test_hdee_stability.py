"""experiments.hdee_stability: noise against signal between two HDEE runs, hand-computed."""

import json
import math
import pathlib

import pytest

from experiments.hdee_stability import compare
from noloco_jax.errors import UserError
from tests.helpers import run_forked

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(ppl: dict[str, dict[str, float]], tiers: dict[str, str]) -> dict:
    """One seed's hdee.json entry with one rule, from {ensemble: {domain: ppl}}."""
    return {"ppl": {e: {d: {"r": v} for d, v in ds.items()} for e, ds in ppl.items()},
            "tiers": tiers}


BEFORE = {"seeds": {"0": _run({"M_Ho-I_Ho": {"a": 10.0, "b": 20.0},
                                "M_Ho-I_He": {"a": 9.0, "b": 22.0},
                                "M_He-I_Ho": {"a": 11.0, "b": 21.0}}, {"a": "easy"})}}
AFTER = {"seeds": {"0": _run({"M_Ho-I_Ho": {"a": 10.0, "b": 20.0},
                               "M_Ho-I_He": {"a": 9.0, "b": 22.0},
                               "M_He-I_Ho": {"a": 11.0, "b": 19.0}}, {"a": "hard"})}}


def test_compare_matches_hand_computation():
    r = compare(BEFORE, AFTER)["r"]
    # Changes: five cells unchanged, one 21 -> 19: median of six |log ratios| is 0.
    assert r["median_change"] == 0.0
    # Gaps |log(best hetero / homo)|: a: log(9/10) twice; b: log(21/20) before, log(19/20) after.
    gaps = sorted([abs(math.log(0.9))] * 2 + [math.log(21 / 20), abs(math.log(19 / 20))])
    assert r["median_gap"] == pytest.approx((gaps[1] + gaps[2]) / 2, rel=1e-12)
    assert (r["lowest_changed"], r["cells"]) == (1, 2)  # b: homogeneous -> M_He-I_Ho
    assert (r["tiers_changed"], r["trained"]) == (1, 1)


def test_compare_refuses_runs_of_other_seeds_or_domains():
    with pytest.raises(UserError, match="seeds"):
        compare(BEFORE, {"seeds": {"1": AFTER["seeds"]["0"]}})
    other = json.loads(json.dumps(AFTER))
    del other["seeds"]["0"]["ppl"]["M_Ho-I_Ho"]["b"]
    with pytest.raises(UserError, match="domains"):
        compare(BEFORE, other)
    # A rule or a domain only one run has was a KeyError (a traceback), in either order.
    fewer = json.loads(json.dumps(BEFORE))
    del fewer["seeds"]["0"]["ppl"]["M_He-I_Ho"]["b"]["r"]
    for x, y in ((AFTER, fewer), (fewer, AFTER)):
        with pytest.raises(UserError, match="differ in ensembles, domains or rules"):
            compare(x, y)
    fewer = json.loads(json.dumps(BEFORE))
    del fewer["seeds"]["0"]["ppl"]["M_Ho-I_He"]["b"]
    with pytest.raises(UserError, match="differ in ensembles, domains or rules"):
        compare(fewer, AFTER)


# From another directory, the package found in the checkout (imported before the change of
# directory, as PYTHONPATH would find it): the default --after must not be relative to the
# working directory.
_ELSEWHERE = """import os, runpy, sys
import experiments
os.chdir(sys.argv.pop(1))
sys.argv[0] = "experiments.hdee_stability"
runpy.run_module("experiments.hdee_stability", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """[exit status, stderr, stdout] of the script's three command lines, by name, each in its
    own process forked from one that imported JAX once (``helpers.run_forked``): "ok"
    (BEFORE against AFTER), "missing" (an --after with no file), both run from the checkout,
    and "elsewhere" (the published run against the default --after, run from another
    directory)."""
    d = tmp_path_factory.mktemp("cli")
    (d / "a.json").write_text(json.dumps(BEFORE))
    (d / "b.json").write_text(json.dumps(AFTER))
    (d / "elsewhere").mkdir()
    script, before = "experiments.hdee_stability", f"--before={d / 'a.json'}"
    published = ROOT / "experiments" / "results" / "hdee.json"
    cases = {"ok": (script, [before, f"--after={d / 'b.json'}"]),
             "missing": (script, [before, f"--after={d / 'none.json'}"]),
             "elsewhere": ("-c", [_ELSEWHERE, str(d / "elsewhere"), f"--before={published}"])}
    return dict(zip(cases, run_forked(list(cases.values()), ROOT, timeout=300)))


def test_cli_prints_table_and_missing_file_exits_2(cli):
    code, err, out = cli["ok"]
    assert code == 0, err
    assert "1 / 2" in out and "1 / 1" in out
    code, err, _ = cli["missing"]
    assert code == 2 and "--after: no file" in err
    assert "Traceback" not in err


def test_the_default_after_is_the_published_run_from_any_directory(cli):
    """--after defaulted to the relative experiments/results/hdee.json: "no file" outside the
    checkout's root."""
    code, err, _ = cli["elsewhere"]
    assert code == 0, err


def test_a_json_flag_expands_a_tilde(tmp_path, monkeypatch):
    """--before=~/a.json (no shell expands ~ after '=') said "no file '~/a.json'" for a file that
    is there; options.read_json, which the scripts' JSON flags share, now expands it."""
    from experiments import hdee_stability  # noqa: PLC0415

    (tmp_path / "a.json").write_text(json.dumps(BEFORE))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hdee_stability._load("before", "~/a.json") == BEFORE
    with pytest.raises(UserError, match=r"--before: no file '~/none.json'"):
        hdee_stability._load("before", "~/none.json")
