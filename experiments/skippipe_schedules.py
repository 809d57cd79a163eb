"""SkipPipe schedules: simulated iteration time of four schedules at 25 / 33 / 50 % skip.

    python -m experiments.skippipe_schedules            # full run, about a minute or two
    python -m experiments.skippipe_schedules --publish  # ... into experiments/results
    python -m experiments.skippipe_schedules --smoke --out_dir /tmp/sp/results   # seconds

For each setting (18 nodes / 4 stages, 20 / 6, 42 / 8; SkipPipe's sizes, stage 0
bigger), network (12-region geo-distributed, 5 clusters, single cluster) and
seed, the nodes are partitioned (``noloco_jax.skippipe.partition_nodes``) and
the four schedules of ``noloco_jax.skippipe.SCHEDULES`` are planned and
simulated for one iteration (``simulate``): the full pipeline (DT-FM-like
chains, every microbatch through all stages), cost-agnostic skip paths,
SkipPipe without collision avoidance (TC2) and SkipPipe. All schedules send
the same microbatches (3 per stage-0 node).

Workload (SkipPipe's HEAD configuration, reference note §1.2-1.3): forward
w = 0.055 s per sample and layer x 4 layers per stage x 8 samples = 1.76 s,
activations 8 x 1024 tokens x 1024 dims x 4 bytes = 33.5 MB per message,
0.35 s host/device overhead per message, 3 activation slots per node.

Writes <out-dir>/skippipe_schedules.json and .md (default experiments/runs/results,
git-ignored; --publish: experiments/results). The JSON's
``training_iteration_times`` ({"full", "skip25", "skip50"}: simulated seconds
per iteration, mean over seeds) is the 18-node / 4-stage geo-distributed
setting with path length 4 / 3 / 2 (``full`` / ``skippipe``), which
experiments.skippipe_training uses to put its runs on a simulated clock.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any, Sequence

import numpy as np
from absl import flags

from experiments import options
from noloco_jax import skippipe as sp
from noloco_jax.experiments import harness

COMMAND = "python -m experiments.skippipe_schedules"

for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)

FORWARD_S = 0.055 * 4 * 8
MESSAGE_BYTES = 8 * 1024 * 1024 * 4
OVERHEAD_S = 0.35
MEMORY = 3
MICROBATCHES = 3
NETWORKS = {"geo-distributed (12 regions)": sp.geo_distributed,
            "5 clusters": sp.five_clusters,
            "single cluster": sp.single_cluster}  # fmt: skip
# (nodes, stages, path lengths) -> skip ratios (S - L) / S.
SETTINGS = [(18, 4, (3, 2)), (20, 6, (4, 3)), (42, 8, (6, 4))]
TRAINING = {"nodes": 18, "stages": 4, "network": "geo-distributed (12 regions)",
            "path_lengths": {"full": 4, "skip25": 3, "skip50": 2}}  # fmt: skip
FULL = {"settings": SETTINGS, "networks": list(NETWORKS), "seeds": [0, 1, 2, 3, 4],
        "max_restarts": 16, "time_limit_s": 20.0}  # fmt: skip
SMOKE = {"settings": [(18, 4, (3, 2))], "networks": ["geo-distributed (12 regions)",
                                                      "single cluster"],
         "seeds": [0], "max_restarts": 2, "time_limit_s": 5.0}  # fmt: skip


def run_case(network_name: str, nodes: int, stages: int, lengths: Sequence[int], seed: int,
             cfg: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """Plans and simulates every schedule of one (network, setting, seed).

    Args:
      network_name: a key of ``NETWORKS``.
      nodes: number of nodes.
      stages: number of stages S.
      lengths: path lengths to schedule (one skip ratio each).
      seed: seed of the partition and the schedulers.
      cfg: ``FULL`` or ``SMOKE``.

    Returns:
      One record per (schedule, path length): makespan and scheduler runtime.
    """
    net = NETWORKS[network_name](nodes, forward_s=FORWARD_S, overhead_s=OVERHEAD_S)
    part = sp.partition_nodes(net, sp.default_stage_sizes(nodes, stages),
                              message_bytes=MESSAGE_BYTES, seed=seed)  # fmt: skip
    out = []
    for length in (stages, *lengths):
        rules = sp.PathRules(stages, length)
        kinds = ["full"] if length == stages else [k for k in sp.SCHEDULES if k != "full"]
        for kind in kinds:
            sched = sp.make_schedule(kind, net, part, rules, microbatches=MICROBATCHES,
                                     memory=MEMORY, message_bytes=MESSAGE_BYTES, seed=seed,
                                     max_restarts=cfg["max_restarts"],
                                     time_limit_s=cfg["time_limit_s"])  # fmt: skip
            res = sp.simulate(net, sched.paths, memory=MEMORY, message_bytes=MESSAGE_BYTES)
            out.append({"network": network_name, "nodes": nodes, "stages": stages,
                        "path_length": length, "skip_pct": round(100 * rules.skip_ratio),
                        "schedule": kind, "seed": seed, "makespan_s": res.makespan_s,
                        "scheduler_s": sched.runtime_s, "restarts": sched.restarts})  # fmt: skip
    return out


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and sample std (n - 1) over seeds per (network, setting, skip); change vs full.

    Args:
      records: ``run_case`` outputs.

    Returns:
      One row per (network, nodes, stages, skip_pct > 0) with a dict per schedule.
    """
    groups: dict[tuple, dict[str, list]] = {}
    for r in records:
        key = (r["network"], r["nodes"], r["stages"], r["skip_pct"], r["path_length"])
        groups.setdefault(key, {}).setdefault(r["schedule"], []).append(r)
    rows = []
    for (net, n, s, pct, length), by_kind in groups.items():
        if pct == 0:
            continue
        full = groups[(net, n, s, 0, s)]["full"]
        both = {"full": full, **by_kind}
        row = {"network": net, "nodes": n, "stages": s, "skip_pct": pct, "path_length": length}
        full_mean = float(np.mean([r["makespan_s"] for r in full]))
        for kind, rs in both.items():
            spans = np.array([r["makespan_s"] for r in rs])
            sd = float(spans.std(ddof=1)) if spans.size > 1 else 0.0  # over seeds, as elsewhere
            row[kind] = {"mean_s": float(spans.mean()), "std_s": sd,
                         "vs_full_pct": 100 * (float(spans.mean()) / full_mean - 1),
                         "scheduler_s": float(np.mean([r["scheduler_s"] for r in rs]))}  # fmt: skip
        rows.append(row)
    return rows


def training_times(records: list[dict[str, Any]]) -> dict[str, float]:
    """Simulated s/iteration of the training experiment's setting (mean over seeds)."""
    out = {}
    for name, length in TRAINING["path_lengths"].items():
        kind = "full" if name == "full" else "skippipe"
        spans = [r["makespan_s"] for r in records
                 if r["network"] == TRAINING["network"] and r["nodes"] == TRAINING["nodes"]
                 and r["stages"] == TRAINING["stages"] and r["path_length"] == length
                 and r["schedule"] == kind]  # fmt: skip
        out[name] = float(np.mean(spans))
    return out


def _reading(rows: list[dict[str, Any]]) -> list[str]:
    n = len(rows)
    geo = [r for r in rows if r["network"].startswith("geo")]

    def count(pred, rs=rows):
        return sum(bool(pred(r)) for r in rs)

    best = min(rows, key=lambda r: r["skippipe"]["vs_full_pct"])
    gain_agn = [100 * (1 - r["skippipe"]["mean_s"] / r["skip_agnostic"]["mean_s"]) for r in rows]
    gain_tc2 = [100 * (1 - r["skippipe"]["mean_s"] / r["skippipe_no_tc2"]["mean_s"])
                for r in rows]  # fmt: skip
    faster = count(lambda r: r["skippipe"]["vs_full_pct"] < 0)
    tc2_wins = count(lambda r: r["skippipe"]["mean_s"] <= r["skippipe_no_tc2"]["mean_s"] + 1e-9)
    return [
        f"- SkipPipe is faster than the full pipeline in {faster}/{n} cases; its largest "
        f"reduction is {-best['skippipe']['vs_full_pct']:.0f} % "
        f"({best['network']}, {best['nodes']} nodes, {best['skip_pct']} % skip). Paper: up to "
        "55 % (v1) / 50 % (ICLR) lower than the full pipeline; the repo's own simulator "
        "-58 % at 33 % skip.",
        f"- SkipPipe <= SkipPipe without TC2 in {tc2_wins}/{n} cases (TC2 gain "
        f"{min(gain_tc2):.0f} ... {max(gain_tc2):.0f} %, mean "
        f"{np.mean(gain_tc2):.0f} %); SkipPipe < cost-agnostic skipping in "
        f"{count(lambda r: r['skippipe']['mean_s'] < r['skip_agnostic']['mean_s'])}/{n} "
        f"(gain {min(gain_agn):.0f} ... {max(gain_agn):.0f} %, mean {np.mean(gain_agn):.0f} %; "
        "reviewer estimate of the scheduler's own share: ~10-20 %).",
        f"- Cost-agnostic skipping is slower than the full pipeline in "
        f"{count(lambda r: r['skip_agnostic']['vs_full_pct'] > 0)}/{n} cases "
        f"({count(lambda r: r['skip_agnostic']['vs_full_pct'] > 0, geo)}/{len(geo)} "
        "geo-distributed). In the paper's 42-location figure and the note's 20-node re-run it "
        "is (8x, +81 %): there, skip paths with 8-sample microbatches over slow WAN links "
        "cost more than the compute they save. Here links are cheaper relative to compute "
        "(generated bandwidths, pure link delays without contention), so most of the gain "
        "comes from doing less compute and the network-aware schedulers add less.",
        "- SkipPipe without TC2 plans each path as if alone and sends every microbatch of a "
        "head down the cheapest path until the node caps bind, so its paths collide; it can "
        "then be slower than random skip paths, most visibly in the single cluster where all "
        "paths cost the same.",
        "- The reductions exceed the skip fraction (e.g. about -50 % at 25 % skip) because the "
        "full-pipeline baseline follows SkipPipe's DT-FM baseline: min(stage sizes) chains, so "
        "the surplus stage-0 nodes idle and each chain node serves more microbatches than a "
        "node in the skip schedules (4-5 vs 3 at 18 nodes / 4 stages), each through all S "
        "stages (a longer "
        "critical path) and through 3 activation slots. They are therefore larger than the "
        "paper's 'up to 55 %'; compare orderings, not absolute gaps.",
    ]


def write_markdown(result: dict[str, Any], path: pathlib.Path) -> None:
    """The results page: command, table, reading, training times."""
    cfg, rows = result["config"], result["rows"]
    md = [
        "# SkipPipe schedules: simulated iteration time",
        "",
        "One training iteration simulated by `noloco_jax.skippipe.simulate` (discrete events: "
        "forward w, backward 1.5 w, loss w/4 on the microbatch's stage-0 node, link delay = "
        "latency + bytes/bandwidth + 0.35 s, FIFO per node, 3 activation slots per node) for "
        "four schedules planned by `noloco_jax.skippipe.make_schedule`. Workload: SkipPipe's "
        f"HEAD configuration, w = {FORWARD_S:.2f} s, {MESSAGE_BYTES / 1e6:.1f} MB per message, "
        f"{MICROBATCHES} microbatches per stage-0 node (same microbatches for all schedules). "
        "Skip = (S - path length) / S. Latency/bandwidth of the 12 regions are generated from "
        "city coordinates (see `noloco_jax/skippipe/network.py`), not measured. Mean ± std over "
        f"seeds {cfg['seeds']} (partition and scheduler seeds); 'vs full' = change of the mean "
        "against the full pipeline of the same network and node set. SkipPipe tries up to "
        f"{cfg['max_restarts']} priority orders (time cap {cfg['time_limit_s']:g} s).",
        "",
        "```bash",
        result["command"],
        "```",
        "",
        "| network | nodes / stages | skip | full pipeline (s) | cost-agnostic skip (s) "
        "| SkipPipe no TC2 (s) | SkipPipe (s) | agnostic vs full | no TC2 vs full "
        "| SkipPipe vs full | SkipPipe scheduler (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [f"{r[k]['mean_s']:.1f} ± {r[k]['std_s']:.1f}" for k in sp.SCHEDULES]
        pcts = [f"{r[k]['vs_full_pct']:+.0f} %" for k in sp.SCHEDULES[1:]]
        md.append(f"| {r['network']} | {r['nodes']} / {r['stages']} | {r['skip_pct']} % "
                  f"(L = {r['path_length']}) | " + " | ".join(cells + pcts)
                  + f" | {r['skippipe']['scheduler_s']:.2f} |")  # fmt: skip
    t = result["training_iteration_times"]
    md += ["", "## Reading", "", *_reading(rows), "",
           "## Iteration times used by the training experiment", "",
           f"{TRAINING['nodes']} nodes, {TRAINING['stages']} stages, {TRAINING['network']}, "
           "path length 4 / 3 / 2 (full pipeline / SkipPipe / SkipPipe), mean over seeds: "
           + ", ".join(f"{k} {v:.2f} s" for k, v in t.items())
           + " (`training_iteration_times` in skippipe_schedules.json).", "",
           "Limitations: links are pure delays (no bandwidth sharing between concurrent "
           "messages), nodes are homogeneous in compute, the planner is prioritised planning "
           "with restarts rather than the paper's CBS, and the partition is a swap local search "
           "instead of DT-FM's genetic algorithm; only orderings and relative gaps are "
           "meaningful.", "",
           f"Wall time of this run: {result['seconds']:.0f} s.", ""]
    path.write_text("\n".join(md))


def run(smoke: bool, out_dir: pathlib.Path) -> dict[str, Any]:
    """Runs every case; writes skippipe_schedules.json and .md.

    Args:
      smoke: the seconds-long version (``SMOKE``) instead of ``FULL``.
      out_dir: where the two files go.

    Returns:
      The JSON-serialisable result.
    """
    cfg = SMOKE if smoke else FULL
    t0 = time.perf_counter()
    records = []
    for net_name in cfg["networks"]:
        for nodes, stages, lengths in cfg["settings"]:
            for seed in cfg["seeds"]:
                records += run_case(net_name, nodes, stages, lengths, seed, cfg)
    result = {"command": COMMAND + (" --smoke" if smoke else ""), "config": cfg,
              "rows": summarise(records),
              "training_iteration_times": training_times(records),
              "training_setting": TRAINING, "records": records,
              "seconds": time.perf_counter() - t0}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "skippipe_schedules.json").write_text(
        json.dumps({**result, "_provenance": harness.provenance_entry(cfg)}, indent=1))
    write_markdown(result, out_dir / "skippipe_schedules.md")
    print(f"wrote {out_dir / 'skippipe_schedules.json'} and "
          f"{out_dir / 'skippipe_schedules.md'} in {result['seconds']:.0f} s", flush=True)
    return result


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    run(options.SMOKE.value, options.out_dir())


if __name__ == "__main__":
    options.run(main)
