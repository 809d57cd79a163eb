"""Optimizer overhead: the trainer's step with local_steps(adam, noloco_outer, H) vs plain Adam.

    python experiments/bench/overhead.py [--smoke]

Same model, data, replicas and fused chunk of H steps (``lax.scan``); only the optimizer
differs. "inner only" never reaches a sync (the cost local_steps adds to every inner step);
"NoLoCo H" contains exactly one sync per chunk (the amortized cost). Targets: inner steps within
2 % of plain Adam, sync amortized under 2 % at H = 50.
"""

from __future__ import annotations

import argparse
import functools
import pathlib

import common  # noqa: F401  (sets sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import optax

from noloco_jax import local_steps, models, noloco_outer, replicas
from noloco_jax.trainer.step import TrainState, train_chunk


def chunk_fn(tx, graphdef, params0, n, guard):
    reps = replicas.Replicas(n)
    state = replicas.replicate(TrainState(jnp.zeros([], jnp.int32), params0, tx.init(params0)), n)
    f = jax.jit(reps.map(functools.partial(train_chunk, graphdef=graphdef, tx=tx,
                                           nonfinite_guard=guard)))  # fmt: skip
    return f, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out-dir", default=str(common.RESULTS))
    args = parser.parse_args()
    preset, n, b, t, h, reps = ("nano", 2, 2, 16, 4, 2) if args.smoke else ("tiny", 8, 4, 64, 50, 5)
    cfg = models.get_preset(preset, vocab_size=256)
    graphdef, params0 = models.init_params(cfg, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 256, (n, h, b, t + 1)), jnp.int32)
    adam = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    variants = {
        "plain Adam": (adam, False),
        "local_steps inner only": (optax.chain(optax.clip_by_global_norm(1.0),
                                               local_steps(optax.adam(1e-3), noloco_outer(),
                                                           10**9)), False),
        f"NoLoCo H={h}": (optax.chain(optax.clip_by_global_norm(1.0),
                                      local_steps(optax.adam(1e-3), noloco_outer(), h)), False),
        f"NoLoCo H={h} + guard": (optax.chain(optax.clip_by_global_norm(1.0),
                                              local_steps(optax.adam(1e-3), noloco_outer(), h,
                                                          nonfinite_guard=True)), True),
    }  # fmt: skip
    fns = {}
    for name, (tx, guard) in variants.items():
        f, state = chunk_fn(tx, graphdef, params0, n, guard)
        fns[name] = functools.partial(f, state, tokens)
    times = common.interleaved(fns, reps)
    base = "plain Adam"
    rows, results = [], {"env": common.environment(), "setup": {
        "preset": preset, "replicas": n, "batch": b, "seq_len": t, "steps_per_chunk": h,
        "reps": reps}, "variants": {}}  # fmt: skip
    for name in variants:
        s = common.summary([x / h for x in times[name]])
        r = common.ratio(times, name, base)
        results["variants"][name] = {**s, "ratio_vs_plain_adam": r}
        rows.append([name, 1e3 * s["median_s"], f"{1e3 * s['q25_s']:.1f}-{1e3 * s['q75_s']:.1f}",
                     f"{100 * (r - 1):+.2f} %"])  # fmt: skip
    cmd = "python experiments/bench/overhead.py" + (" --smoke" if args.smoke else "")
    md = (f"### Optimizer overhead\n\n`{cmd}` — {preset} model, {n} vmap replicas, {b} x {t} "
          f"tokens per replica, chunks of {h} fused steps, median of {reps} interleaved "
          f"repetitions ({results['env']['device']}).\n\n"
          + common.md_table(["optimizer", "ms / step", "IQR (ms)", "vs plain Adam"], rows))
    common.write("bench_overhead", results, md, pathlib.Path(args.out_dir))


if __name__ == "__main__":
    main()
