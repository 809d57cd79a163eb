"""Bytes each replica sends per sync, read from the compiled HLO, for the paper's models.

    python -m experiments.bench.comm_volume [--smoke] [--replicas 8,16,32,64]
        [--sections replicas,split] [--splits 1x1,2x1,4x1,2x2]

For each paper model (abstract shapes only: jax.eval_shape, nothing allocated; bf16 params as
in the paper) and replica count N, compiles the outer update under jax.shard_map on N
(simulated) devices and sums the collective-permute / all-reduce bytes of one sync branch.
NoLoCo: gamma = beta, gamma != beta, bf16 exchange of f32 params. DiLoCo / data parallel: the
all-reduce operand, converted to bytes sent per replica by a bandwidth-optimal ring
(2 (N - 1) / N), which flatters them. Then feeds the bytes into noloco_jax.netsim.

Section "split": the trainer's own sync program (noloco_jax.trainer.aot, the paper's settings)
for N = 2 replicas, each whole on one device or split over F x T devices, NoLoCo, DiLoCo and
data parallel; the bytes per device of every collective that joins two replicas
(noloco_jax.hlo.crossing_bytes), against the whole replica's.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

import jax
import jax.numpy as jnp
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import options
from experiments.bench import common
from noloco_jax import comm, diloco_outer, hlo, models, netsim, noloco_outer

REPLICAS = flags.DEFINE_list("replicas", ["8", "16", "32", "64"],
                             "Replica counts N to compile, comma-separated.")  # fmt: skip
EXTRAPOLATE = flags.DEFINE_list(
    "extrapolate", ["128", "256", "512", "1024"],
    "Larger N from the largest compiled N's (N-independent) HLO bytes, comma-separated; "
    "empty for none.")  # fmt: skip
SECTIONS = flags.DEFINE_list("sections", ["replicas", "split"],
                             "Tables to make: replicas (N = 8 ... 1024), split (F x T).")
SPLITS = flags.DEFINE_list("splits", ["1x1", "2x1", "4x1", "2x2"],
                           "Replica splits F x T for the split table (N = 2: 2 F T devices).")
for _name in ("replicas", "extrapolate"):
    flags.register_validator(_name, lambda v: all(x.isdigit() and int(x) > 0 for x in v),
                             message="takes positive integers, comma-separated (8,16,32)")
flags.register_validator("sections", lambda v: bool(v) and set(v) <= {"replicas", "split"},
                         message="takes replicas and/or split, comma-separated")
flags.register_validator(
    "splits", lambda v: all(re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", x) for x in v),
    message="takes F x T splits such as 1x1,2x1,2x2, comma-separated")
for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)


def _use_cpu_devices(n: int) -> None:
    """``n`` simulated CPU devices, unless XLA_FLAGS sets a count already (the tests: 8).

    Before JAX starts its backend, which nothing before ``main`` does.
    """
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", n)


def _abstract_params(preset: str, param_dtype: str, vocab: int):
    cfg = models.get_preset(preset, vocab_size=vocab, param_dtype=param_dtype)
    _, params = jax.eval_shape(lambda: models.init_params(cfg, 0))
    return params


def _sync_bytes(tx, params, n: int) -> dict[str, int]:
    mesh = jax.make_mesh((n,), ("replica",), devices=jax.devices()[:n])
    stacked = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=NamedSharding(
            mesh, P("replica", *[None] * x.ndim))), params)  # fmt: skip
    state = jax.eval_shape(jax.vmap(tx.init), stacked)
    state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
            mesh, P() if x.ndim == 0 else P("replica", *[None] * (x.ndim - 1)))), state)

    def body(p, s):
        p1, s1 = jax.tree.map(lambda x: x[0], p), jax.tree.map(
            lambda x: x if x.ndim == 0 else x[0], s)
        d, _ = tx.update(p1, s1, p1)
        return jax.tree.map(lambda x: x[None], d)

    specs = lambda t: jax.tree.map(lambda x: x.sharding.spec, t)  # noqa: E731
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs(stacked), specs(state)),
                               out_specs=specs(stacked)))  # fmt: skip
    text = fn.lower(stacked, state).compile().as_text()
    out = {}
    for kind in ("collective-permute", "all-reduce", "all-gather"):
        per = hlo.bytes_by_computation(text, kind)
        out[kind] = max(per.values()) if per else 0
    return out


def _add_row(rows, results, preset: str, num: int, n: int, name: str, b: dict, label: str):
    """One table row: bytes one replica sends per sync and netsim's sync times."""
    noloco = name.startswith("NoLoCo")
    sent = b["collective-permute"] if noloco else 2 * (n - 1) / n * b["all-reduce"]
    times = {link: netsim.group_exchange_time(sent, lk) if noloco
             else netsim.ring_allreduce_time(b["all-reduce"], n, lk)
             for link, lk in (("datacenter", netsim.DATACENTER),
                              ("internet", netsim.INTERNET))}  # fmt: skip
    results["rows"].append({"model": preset, "params": num, "N": n, "method": name, "hlo": b,
                            "compiled_at": label, "bytes_sent_per_replica": sent,
                            "sync_s": times})  # fmt: skip
    rows.append([preset, label, name, f"{sent / 1e9:.3f}", f"{sent / (2 * num):.3f}",
                 f"{times['datacenter']:.3g}", f"{times['internet']:.3g}"])  # fmt: skip


def _split_row(preset: str, method: str, fsdp: int, tensor: int, vocab: int) -> dict:
    """Cross-replica bytes per device of the trainer's sync program, N = 2, split F x T."""
    from noloco_jax.trainer import aot  # noqa: PLC0415

    s = common.paper_settings(preset, method, num_replicas=2, seq_len=64, fsdp=fsdp,
                              tensor=tensor)  # fmt: skip
    compiled = aot.compile_program(s, vocab, program="sync")
    crossing = hlo.crossing_bytes(hlo.collective_ops(compiled.as_text()),
                                  aot.device_replicas(compiled))  # fmt: skip
    return {"model": preset, "method": method, "fsdp": fsdp, "tensor": tensor,
            "crossing": crossing, "bytes": sum(crossing.values())}  # fmt: skip


def split_table(sizes: list[str], methods: list[str], splits: list[tuple[int, int]],
                vocab: int, smoke: bool) -> tuple[list[dict], str]:  # fmt: skip
    """Rows and markdown of the split section."""
    rows, table = [], []
    for preset in sizes:
        for method in methods:
            whole = None
            for fsdp, tensor in splits:
                r = _split_row(preset, method, fsdp, tensor, vocab)
                whole = whole or r["bytes"]
                rows.append(r)
                kinds = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(r["crossing"].items()))
                table.append([preset, method, f"{fsdp} x {tensor}", f"{r['bytes'] / 1e6:.1f}",
                              f"{r['bytes'] * fsdp * tensor / whole:.4f}", kinds])  # fmt: skip
                print(table[-1], flush=True)
    cmd = options.command("experiments.bench.comm_volume",
                          values={} if smoke else {"sections": "split"})  # this table alone
    md = (f"### Bytes per device per sync between replicas, whole vs split replicas\n\n`{cmd}` "
          f"(commit {common.git_commit()}) — the trainer's sync program (noloco_jax.trainer.aot: "
          "the paper's settings, float32 params, Adam, guard on) for N = 2 replicas, each whole "
          "on one device (1 x 1) or split over F x T devices (fsdp x tensor), compiled on "
          "simulated CPU devices; MB (10^6 bytes) of the operands of every collective in it "
          "that joins devices of different replicas (noloco_jax.hlo.crossing_bytes; each "
          "instruction once). Data parallel's program is its step (one all-reduce of the "
          "gradients per step). 'x split' is the bytes times F x T over the whole replica's: "
          "1.0 is an exact 1 / (F x T). On the CPU backend an all-reduce is float32 whatever "
          "the dtype.\n\n"
          + common.md_table(["model", "method", "F x T", "MB per device", "x split",
                             "collectives"], table))  # fmt: skip
    return rows, md


def replica_table(sizes: list[str], ns: list[int], extrapolate: list[int], vocab: int,
                  smoke: bool) -> tuple[dict, str]:  # fmt: skip
    """Results and markdown of the replicas section (N = 8 ... 1024)."""
    rows, results = [], {"rows": []}
    per_device: dict[str, list[dict]] = {}
    for preset in sizes:
        bf16 = _abstract_params(preset, "bfloat16", vocab)
        f32 = _abstract_params(preset, "float32", vocab)
        num = comm.tree_num_elements(bf16)
        for n in ns:
            measured = {
                "NoLoCo gamma=beta (bf16 params)": _sync_bytes(noloco_outer(), bf16, n),
                "NoLoCo gamma!=beta (bf16 params)": _sync_bytes(noloco_outer(gamma=0.9), bf16, n),
                "NoLoCo bf16 exchange (f32 params)": _sync_bytes(
                    noloco_outer(exchange_dtype=jnp.bfloat16), f32, n),
                "DiLoCo all-reduce (bf16 params)": _sync_bytes(diloco_outer(), bf16, n),
            }  # fmt: skip
            for name, b in measured.items():
                assert b["all-gather"] == 0
                per_device.setdefault(name, []).append(b)
                _add_row(rows, results, preset, num, n, name, b, str(n))
        # Beyond what 2 cores can compile: every per-device collective above is the same at
        # every compiled N (checked here), so larger N reuse the largest compiled N's HLO bytes.
        for name, seen in per_device.items():
            if any(b != seen[0] for b in seen):
                raise AssertionError(f"{preset}/{name}: per-device HLO bytes change with N: {seen}")
            for n in extrapolate:
                _add_row(rows, results, preset, num, n, name, seen[-1], f"{n} (HLO at {ns[-1]})")
        per_device.clear()
    cmd = options.command("experiments.bench.comm_volume")
    md = (f"### Communication per replica per sync, read from compiled HLO\n\n`{cmd}` — bytes of "
          "the collectives in one sync branch of the compiled outer update (shard_map over N "
          "simulated CPU devices, abstract paper-size params); all-reduce operands converted to "
          "ring bytes 2(N-1)/N. 'x bf16 model' divides by the model's size in bf16. Sync times: "
          "noloco_jax.netsim, datacenter = 100 Gbit/s, 0.01 ms; internet = 1 Gbit/s, 50 ms. No "
          "all-gather appears in any of them. Note: on the CPU backend XLA promotes a bf16 all-reduce to "
          "float32, so DiLoCo's operand here is twice the bf16 model; GPU collectives reduce bf16 "
          "natively (half of DiLoCo's bytes), while NoLoCo's bf16 permutes stay bf16 either way. "
          "Data parallel all-reduces the same operand as DiLoCo, but every step. Rows marked "
          "'HLO at 64' reuse the per-device bytes compiled at the largest N (the script checks "
          "they do not change with N; compiling for 1024 simulated devices does not fit 2 cores "
          "in reasonable time), with the ring factor and netsim times for their own N.\n\n"
          + common.md_table(["model", "N", "method", "GB sent", "x bf16 model",
                             "sync s (datacenter)", "sync s (internet)"], rows))  # fmt: skip
    return results, md


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    options.smoke_sets("replicas", "extrapolate", "splits")
    smoke = options.SMOKE.value
    extrapolate = [8] if smoke else [int(x) for x in EXTRAPOLATE.value]
    sizes = ["nano"] if smoke else ["small", "medium", "large"]
    vocab = 256 if smoke else 128002
    ns = [2, 4] if smoke else [int(x) for x in REPLICAS.value]
    sections = SECTIONS.value
    splits = [(1, 1), (2, 2)] if smoke else [tuple(int(v) for v in x.split("x"))
                                             for x in SPLITS.value]  # fmt: skip
    _use_cpu_devices(max([*ns, *(2 * f * t for f, t in splits)]) if "replicas" in sections
                     else max(2 * f * t for f, t in splits))  # fmt: skip
    results, parts = {"env": common.environment(), "rows": []}, []
    if "replicas" in sections:
        found, md = replica_table(sizes, ns, extrapolate, vocab, smoke)
        results["rows"], parts = found["rows"], [md]
    if "split" in sections:
        methods = ["noloco"] if smoke else ["noloco", "diloco", "dp"]
        results["split"], md = split_table(sizes, methods, splits, vocab, smoke)
        parts.append(md)
    name = "bench_comm_volume" if "replicas" in sections else "bench_comm_volume_split"
    common.write(name, results, "\n".join(parts), options.out_dir())


if __name__ == "__main__":
    options.run(main)
