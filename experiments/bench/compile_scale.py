"""Compile cost of the NoLoCo sync step as the number of simulated replicas N grows.

    python -m experiments.bench.compile_scale [--smoke] [--baseline OLD.json] [--shard_map]

The sync step of ``local_steps(adam, noloco_outer(), H)`` (``sync_step=True``) for the nano
preset, vmapped over N replicas on one device, is lowered from abstract inputs
(``jax.ShapeDtypeStruct``: nothing is allocated) and compiled. With groups of two the step holds
one ``lax.switch`` branch per round-robin matching, N - 1 of them, so its program grows with N.
Reported per N: seconds to lower, seconds to compile, and the size of the compiled HLO text.
Target (issue 16): N = 1024 compiles in under 30 s and its HLO stays under 2 MB on a 2-core CPU.

``--baseline OLD.json`` adds the columns of an earlier run of this script (for example one made
with the code before the change, from another checkout) next to this run's.

The full run also reports what packing costs at run time, as the overhead benchmark measures it
(deterministic, from XLA's cost analysis): bytes accessed by the trainer's sync step of the tiny
model with 8 vmap replicas, relative to a plain-Adam step, and amortized over H = 50.

``--shard_map`` compiles the same step with one replica per (simulated CPU) device instead, as a
real run would: there every branch's collective-permute lists its N source-target pairs, so the
HLO holds N (N - 1) pairs whatever the packing. Its results go to bench_compile_scale_shard_map.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any, Sequence

import jax
import optax
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import options
from experiments.bench import common
from noloco_jax import local_steps, models, noloco_outer, replicas
from noloco_jax.errors import UserError

NS = [8, 16, 32, 64, 128, 256, 512, 1024]
SMOKE_NS = [8, 16]

NS_FLAG = flags.DEFINE_list("ns", None, "N values, comma-separated (default: all).")
flags.register_validator("ns", lambda v: v is None or all(x.isdigit() and int(x) > 0 for x in v),
                         message="takes positive integers, comma-separated (8,16,32)")
BASELINE = flags.DEFINE_string("baseline", None, "JSON of an earlier run to compare.")
LABEL = flags.DEFINE_string("label", "this code", "Name of this run's columns.")
NO_TRAFFIC = flags.DEFINE_bool("no_traffic", False, "Skip the run-time traffic.")
SHARD_MAP = flags.DEFINE_bool("shard_map", False,
                              "One replica per simulated device instead of vmap.")  # fmt: skip
options.old_spellings("no_traffic", "shard_map")
for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)


def abstract_replicated(tree, n: int, mesh=None):
    """ShapeDtypeStructs of ``tree`` in the replicated layout (shared counters keep no axis).

    With a ``mesh``, per-replica leaves are split over its axis, one replica per device.
    """

    def leaf(path, x):
        if replicas.is_shared_leaf(x, path):
            sharding = None if mesh is None else NamedSharding(mesh, P())
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        spec = P(*mesh.axis_names, *[None] * x.ndim) if mesh is not None else None
        sharding = None if mesh is None else NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, tree)


def sync_step_fn(tx: optax.GradientTransformation):
    """One replica's sync step: (params, state, grads) -> (params, state)."""

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params, sync_step=True)
        return optax.apply_updates(params, updates), state

    return step


def measure(n: int, params0, tx, shard_map: bool = False) -> dict:
    """Lower and compile time (s) and compiled HLO text size (bytes) at N = ``n``."""
    reps = replicas.make_replicas(n, backend="shard_map" if shard_map else "vmap")
    state0 = jax.eval_shape(tx.init, params0)
    args = [abstract_replicated(t, n, reps.mesh) for t in (params0, state0, params0)]
    fn = jax.jit(reps.map(sync_step_fn(tx)))
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    text = compiled.as_text()
    leaves = len(jax.tree.leaves(params0))
    return {"N": n, "lower_s": t1 - t0, "compile_s": t2 - t1, "hlo_bytes": len(text.encode()),
            "num_leaves": leaves}  # fmt: skip


_ROW_KEYS = {"N", "lower_s", "compile_s", "hlo_bytes", "load"}


def _baseline_rows(old: Any) -> list[dict]:
    """The rows of a ``--baseline`` json, refused (before any compile) unless this script
    wrote it."""
    rows = old.get("rows") if isinstance(old, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and _ROW_KEYS <= set(r)
                                             for r in rows):  # fmt: skip
        raise UserError(f"--baseline: {BASELINE.value} is not a results json of this script "
                        f"(rows with {', '.join(sorted(_ROW_KEYS))}); give a "
                        f"bench_compile_scale*.json it wrote.")
    return rows


def _row(rec: dict, old: dict | None, with_old: bool) -> list:
    row = [rec["N"]]
    if with_old and old is None:
        row += ["-"] * 4
    elif with_old:
        row += [f"{old['lower_s']:.2f}", f"{old['compile_s']:.1f}",
                f"{old['hlo_bytes'] / 1e6:.2f}", f"{old['load']:.1f}"]  # fmt: skip
    row += [f"{rec['lower_s']:.2f}", f"{rec['compile_s']:.2f}", f"{rec['hlo_bytes'] / 1e6:.3f}",
            f"{rec['load']:.1f}"]  # fmt: skip
    return row


def traffic() -> dict:
    """The overhead benchmark's memory traffic of the tiny model's sync step (8 replicas, H=50)."""
    from experiments.bench import overhead  # noqa: PLC0415

    return overhead.traffic_case("tiny", 256, 8, 4, 64, 50)[1]


def _traffic_md(new: dict, old: dict | None, labels: tuple[str, str]) -> str:
    keys = [("sync step", "sync step / plain Adam step"),
            ("H=50 amortized ratio", "amortized over H = 50"),
            ("sync step + guard", "sync step + guard / plain Adam step"),
            ("H=50 + guard amortized ratio", "amortized over H = 50, + guard")]  # fmt: skip
    header = ["bytes accessed (tiny, 8 replicas)"] + ([labels[0]] if old else []) + [labels[1]]
    plain = new["plain Adam step"]
    rows = []
    for key, name in keys:
        vals = [d[key] for d in ([old] if old else []) + [new]]
        if "amortized" in key:
            rows.append([name] + [f"{100 * (v - 1):+.2f} %" for v in vals])
        else:
            rows.append([name] + [f"{v / plain:.3f} ({v / 1e9:.3f} GB)" for v in vals])
    return common.md_table(header, rows)


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    smoke, shard_map, label = options.SMOKE.value, SHARD_MAP.value, LABEL.value
    ns = SMOKE_NS if smoke else NS
    if NS_FLAG.value:
        ns = [int(v) for v in NS_FLAG.value]
    if shard_map:  # one simulated CPU device per replica, set before JAX starts its backend
        jax.config.update("jax_num_cpu_devices", max(ns))
    baseline = None
    if BASELINE.value:  # a bad file is refused before anything compiles
        old = options.read_json("baseline", BASELINE.value)
        baseline = {r["N"]: r for r in _baseline_rows(old)}
    cfg = models.get_preset("nano", vocab_size=256)
    params0 = jax.eval_shape(lambda: models.init_params(cfg, 0)[1])  # shapes only
    tx = local_steps(optax.adam(1e-3), noloco_outer(), 10)
    results = {"env": common.environment(), "label": label, "rows": [],
               "load_before": os.getloadavg()[0]}  # fmt: skip
    rows = []
    for n in ns:
        rec = measure(n, params0, tx, shard_map)
        rec["load"] = os.getloadavg()[0]
        results["rows"].append(rec)
        print(json.dumps(rec), flush=True)
        old_rec = None if baseline is None else baseline.get(n)
        rows.append(_row(rec, old_rec, baseline is not None))
    if not (smoke or NO_TRAFFIC.value or shard_map):
        results["traffic"] = traffic()
    shown = None
    if BASELINE.value:
        base = pathlib.Path(BASELINE.value).resolve()
        shown = base.relative_to(common.ROOT) if base.is_relative_to(common.ROOT) else base
    cmd = options.command("experiments.bench.compile_scale", values={"baseline": shown})
    header = ["N"]
    if baseline is not None:
        old_label = old.get("label", "baseline")
        header += [f"{old_label}: lower s", f"{old_label}: compile s", f"{old_label}: HLO MB",
                   f"{old_label}: load"]  # fmt: skip
    header += [f"{label}: lower s", f"{label}: compile s", f"{label}: HLO MB",
               f"{label}: load"]  # fmt: skip
    leaves = results["rows"][0]["num_leaves"]
    if shard_map:
        title, where = ("with one replica per device (shard_map)",
                        "N replicas on N simulated CPU devices with `jax.shard_map`")  # fmt: skip
    else:
        title, where = "vs N (issue 16)", "N replicas vmapped on one device"
    md = (f"### Compile time of the NoLoCo sync step {title}\n\n`{cmd}` — nano preset "
          f"({leaves} parameter leaves), `local_steps(adam, noloco_outer(), 10)` sync step "
          f"(`sync_step=True`, groups of 2: N - 1 switch branches), {where}, lowered from "
          f"ShapeDtypeStructs and compiled once per N ({results['env']['device']}, 2 shared "
          "cores; 'load' is the 1-minute load average after the row, from all users of the "
          "machine: compile times grow with it). HLO = `compiled.as_text()`, MB = 10^6 bytes. "
          + ("Every branch's collective-permute lists N source-target pairs, so the HLO holds "
             "N (N - 1) pairs: quadratic in N whatever the packing.\n\n" if shard_map else
             "Target: N = 1024 compiles in < 30 s with HLO < 2 MB.\n\n")
          + common.md_table(header, rows))
    if baseline is not None and old.get("note"):
        md += f"\n'{old.get('label', 'baseline')}': {old['note']}\n"
    if "traffic" in results:
        old_traffic = None if baseline is None else old.get("traffic")
        labels = (old.get("label", "baseline") if baseline is not None else "", label)
        md += ("\nRun-time cost of the packing (the overhead benchmark's deterministic memory "
               "traffic, XLA cost analysis of the compiled trainer step): tiny model, 8 vmap "
               "replicas, relative to a plain-Adam step.\n\n"
               + _traffic_md(results["traffic"], old_traffic, labels))
    name = "bench_compile_scale" + ("_shard_map" if shard_map else "")
    common.write(name, results, md, options.out_dir())


if __name__ == "__main__":
    options.run(main)
