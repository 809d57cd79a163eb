"""DiLoCo's bytes per sync for each exchange dtype, read from the compiled HLO.

    python -m experiments.bench.diloco_exchange [--smoke] [--replicas 8,16,64]

For a paper model (abstract float32 params: jax.eval_shape, nothing allocated) and each
replica count N, compiles ``diloco_outer(exchange_dtype=...)``'s update under jax.shard_map on
N simulated CPU devices and reads its collectives. float32: one all-reduce, counted as a
bandwidth-optimal ring (2 (N - 1) / N of the operand), which flatters it. bfloat16, int8,
float8_e4m3fn: an all-to-all and an all-gather of N encoded shards (comm.all_replica_mean_wire),
of which each replica sends (N - 1) / N (its own shard stays). The script checks that the HLO
bytes equal ``comm.diloco_bytes_per_sync`` and that no other collective appears.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import options
from experiments.bench import common
from noloco_jax import comm, diloco_outer, hlo, models, netsim

REPLICAS = flags.DEFINE_list("replicas", ["8", "16", "64"], "Replica counts N, comma-separated.")
flags.register_validator("replicas", lambda v: all(x.isdigit() and int(x) > 1 for x in v),
                         message="takes integers >= 2, comma-separated (8,16,64)")  # fmt: skip
for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)

WIRES = {"float32": None, "bfloat16": jnp.bfloat16, "int8": "int8",
         "float8_e4m3fn": "float8_e4m3fn"}  # fmt: skip


def _sync_ops(tx: Any, params: Any, n: int) -> list[hlo.CollectiveOp]:
    """The collectives of one compiled outer update on N devices (one replica each)."""
    mesh = jax.make_mesh((n,), ("replica",), devices=jax.devices()[:n])
    put = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype,  # noqa: E731
                                               sharding=NamedSharding(mesh, spec))
    stacked = jax.tree.map(lambda x: put(jax.ShapeDtypeStruct((n, *x.shape), x.dtype),
                                         P("replica", *[None] * x.ndim)), params)  # fmt: skip
    state = jax.eval_shape(jax.vmap(tx.init), stacked)
    state = jax.tree.map(lambda x: put(x, P() if x.ndim == 0 else P("replica")), state)

    def body(p, s):
        one = lambda t: jax.tree.map(lambda x: x if x.ndim == 0 else x[0], t)  # noqa: E731
        d, _ = tx.update(one(p), one(s), one(p))
        return jax.tree.map(lambda x: x[None], d)

    specs = lambda t: jax.tree.map(lambda x: x.sharding.spec, t)  # noqa: E731
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs(stacked), specs(state)),
                               out_specs=specs(stacked)))  # fmt: skip
    return hlo.collective_ops(fn.lower(stacked, state).compile().as_text())


def _sent(ops: list[hlo.CollectiveOp], n: int) -> float:
    """Bytes one replica sends: ring all-reduce 2 (N-1)/N, all-to-all / all-gather (N-1)/N."""
    share = {"all-reduce": 2 * (n - 1) / n, "all-to-all": (n - 1) / n, "all-gather": (n - 1) / n}
    unknown = [op.kind for op in ops if op.kind not in share]
    if unknown:
        raise AssertionError(f"unexpected collectives {unknown}")
    return sum(share[op.kind] * op.bytes for op in ops)


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    options.smoke_sets("replicas")
    smoke = options.SMOKE.value
    preset, vocab = ("nano", 256) if smoke else ("small", 128002)
    ns = [2, 4] if smoke else [int(x) for x in REPLICAS.value]
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", max(ns))
    cfg = models.get_preset(preset, vocab_size=vocab, param_dtype="float32")
    params = jax.eval_shape(lambda: models.init_params(cfg, 0))[1]
    num = comm.tree_num_elements(params)
    rows, results = [], {"env": common.environment(), "model": preset, "params": num, "rows": []}
    for n in ns:
        f32 = None
        for name, wire in WIRES.items():
            ops = _sync_ops(diloco_outer(exchange_dtype=wire), params, n)
            sent = _sent(ops, n)
            want = comm.diloco_bytes_per_sync(params, n, exchange_dtype=wire)
            if sent != want:
                raise AssertionError(f"N={n} {name}: HLO {sent} bytes, formula {want}")
            f32 = f32 or sent
            hlo_bytes = {op.kind: op.bytes for op in ops}
            internet = netsim.ring_allreduce_time(sent * n / (2 * (n - 1)), n, netsim.INTERNET)
            results["rows"].append({"N": n, "exchange": name, "hlo": hlo_bytes,
                                    "bytes_sent_per_replica": sent, "internet_s": internet})
            kinds = " + ".join(f"{k} {v / 1e6:.2f} MB" for k, v in hlo_bytes.items())
            rows.append([n, name, kinds, f"{sent / 1e6:.2f}", f"{sent / f32:.4f}",
                         f"{internet:.3g}"])  # fmt: skip
    cmd = options.command("experiments.bench.diloco_exchange")
    md = (f"### DiLoCo bytes per sync by exchange dtype, from compiled HLO\n\n`{cmd}` — "
          f"{preset} model, {num / 1e6:.1f}M float32 params (abstract), one replica per "
          "simulated CPU device. 'HLO operands': the collectives' buffer sizes in the compiled "
          "update. 'MB sent': per replica, a ring's 2(N-1)/N of the all-reduce operand, (N-1)/N "
          "of the all-to-all and all-gather buffers (checked equal to "
          "comm.diloco_bytes_per_sync). Internet sync: noloco_jax.netsim ring model, 1 Gbit/s, "
          "50 ms per hop.\n\n"
          + common.md_table(["N", "exchange", "HLO operands", "MB sent per replica",
                             "x float32 ring", "sync s (internet)"], rows))  # fmt: skip
    common.write("bench_diloco_exchange", results, md, options.out_dir())


if __name__ == "__main__":
    options.run(main)
