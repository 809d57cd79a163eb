"""Optimizer overhead: the trainer's step with local_steps(adam, noloco_outer, H) vs plain Adam.

    python -m experiments.bench.overhead [--smoke]

Same model, data, replicas and fused chunk of H steps (``lax.scan``); only the optimizer
differs. "inner only" never reaches a sync (the cost local_steps adds to every inner step);
"NoLoCo H" contains exactly one sync per chunk (the amortized cost). Two cases: the tiny model
with 8 replicas (compute per parameter as in training) and paper-small with one 64-token
sequence per step (memory-bound: per-parameter optimizer work dominates, so any extra pass over
the weights shows), in chunks of 10 steps, the shortest chunk (``log_every``) of the shipped
configs. Each call of a compiled chunk pays a fixed cost per state buffer it carries, so a
larger state costs more in short chunks: "plain Adam + 2 untouched param-sized buffers" carries
the size of local_steps' extra state without its work, which tells the two apart. Targets:
inner steps within 2 % of plain Adam, sync amortized under 2 % at H = 50. Besides the ratio
of medians it reports the per-round ("paired") ratios: each round runs every variant's chunk
back to back, so drifts in machine speed cancel within a round.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags

from experiments import options
from experiments.bench import common
from noloco_jax import clip_by_global_norm_fused, local_steps, models, noloco_outer, replicas
from noloco_jax.trainer import grads
from noloco_jax.trainer.step import TrainState, train_step

for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)


def chunk_fn(tx, graphdef, params0, n, guard, every, phase):
    """The trainer's two programs for ``n`` replicas, state donated as in the trainer."""
    reps = replicas.Replicas(n)
    state = replicas.replicate(TrainState(jnp.zeros([], jnp.int32), params0, tx.init(params0)), n)
    state = jax.tree.map(jnp.copy, state)  # own buffers, safe to donate
    return common.TrainerChunk(reps, H_OF_CHUNK[0], every, phase, grads_fn=grads.plain(graphdef),
                               tx=tx, nonfinite_guard=guard), state  # fmt: skip


H_OF_CHUNK = [0]  # the chunk length of the case being run
CHECK = "count"  # local_steps' phase check as the trainer sets it (trainer.optimizer)


def variants(h, with_sync):
    """name -> (tx, guard, H or None, phase): "host" (the trainer's two programs) or "device"."""
    clip = clip_by_global_norm_fused(1.0)  # the trainer's clip
    never = 10**9

    def ls(every, guard=False, host_phase=True):
        tx = optax.chain(clip, local_steps(optax.adam(1e-3), noloco_outer(), every,
                                           nonfinite_guard=guard, check_phase=CHECK))  # fmt: skip
        # The trainer's two programs (chunks start on a round boundary).
        return tx, guard, every, "host" if host_phase else "device"

    out = {
        "plain Adam": (optax.chain(clip, optax.adam(1e-3)), False, None, "host"),
        "local_steps inner only": ls(never),
    }
    if not with_sync:  # a control: plain Adam's work, local_steps' state size
        out["plain Adam + 2 untouched param-sized buffers"] = (
            optax.chain(clip, optax.adam(1e-3), _carry_two_copies()), False, None, "host")
    if with_sync:  # a chunk of H steps with one sync; the guard's cost shows there too
        out[f"NoLoCo H={h}"] = ls(h)
        out[f"NoLoCo H={h} + guard"] = ls(h, True)
        out[f"NoLoCo H={h}, phase on device"] = ls(h, host_phase=False)
    else:
        out["local_steps inner only, phase on device"] = ls(never, host_phase=False)
        out["local_steps inner only + guard"] = ls(never, True)
    return out


def _carry_two_copies() -> optax.GradientTransformation:
    """A state of two param-sized copies, passed through each step untouched (the size of
    local_steps' slow weights and outer momentum), updates unchanged."""
    return optax.GradientTransformation(lambda p: (jax.tree.map(jnp.copy, p),) * 2,
                                        lambda u, state, params=None: (u, state))


def run_case(preset, vocab, n, b, t, h, reps, with_sync):
    cfg = models.get_preset(preset, vocab_size=vocab)
    graphdef, params0 = models.init_params(cfg, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, vocab, (n, h, b, t + 1)), jnp.int32)
    txs = variants(h, with_sync)
    fns = {}
    H_OF_CHUNK[0] = h
    for name, (tx, guard, every, phase) in txs.items():
        f, state = chunk_fn(tx, graphdef, params0, n, guard, every, phase)
        fns[name] = common.Carried(f, state, tokens)
    times = common.interleaved(fns, reps)
    rows, out = [], {}
    for name in txs:
        s = common.summary([x / h for x in times[name]])
        r = common.ratio(times, name, "plain Adam")
        p = common.paired_ratios(times, name, "plain Adam")
        out[name] = {**s, "ratio_vs_plain_adam": r, "paired_ratio_vs_plain_adam": p}
        rows.append([f"{preset}: {name}", 1e3 * s["median_s"],
                     f"{1e3 * s['q25_s']:.1f}-{1e3 * s['q75_s']:.1f}", f"{100 * (r - 1):+.2f} %",
                     f"{100 * (p['median'] - 1):+.2f} % ({100 * (p['q25'] - 1):+.1f} to "
                     f"{100 * (p['q75'] - 1):+.1f})"])  # fmt: skip
    setup = {"preset": preset, "params": models.param_count(cfg), "vocab": vocab, "replicas": n,
             "batch": b, "seq_len": t, "steps_per_chunk": h, "reps": reps}  # fmt: skip
    return rows, {"setup": setup, "variants": out}


def step_bytes(tx, graphdef, params0, n, b, t, guard, sync_step) -> float:
    """Bytes accessed by one compiled trainer step, from XLA's cost analysis."""
    reps = replicas.Replicas(n)
    state = replicas.replicate(TrainState(jnp.zeros([], jnp.int32), params0, tx.init(params0)), n)
    f = jax.jit(reps.map(functools.partial(train_step, grads_fn=grads.plain(graphdef), tx=tx,
                                           nonfinite_guard=guard, sync_step=sync_step)),
                donate_argnums=0)  # fmt: skip
    cost = f.lower(state, jnp.zeros((n, b, t + 1), jnp.int32)).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])


def traffic_case(preset, vocab, n, b, t, h):
    """Deterministic: memory traffic of an inner and a sync step vs plain Adam's step.

    Timings on a shared CPU scatter by a few percent; XLA's count of bytes accessed
    does not. (It adds both branches of a ``lax.cond``, so the on-device phase is
    left out.) Amortized: ``((H - 1) inner + 1 sync) / H`` relative to plain Adam.
    """
    cfg = models.get_preset(preset, vocab_size=vocab)
    graphdef, params0 = models.init_params(cfg, 0)
    clip = clip_by_global_norm_fused(1.0)
    def ls(guard):
        return optax.chain(clip, local_steps(optax.adam(1e-3), noloco_outer(), h,
                                             nonfinite_guard=guard, check_phase=CHECK))
    plain = step_bytes(optax.chain(clip, optax.adam(1e-3)), graphdef, params0, n, b, t, False,
                       None)  # fmt: skip
    inner = {g: step_bytes(ls(g), graphdef, params0, n, b, t, g, False) for g in (False, True)}
    sync = {g: step_bytes(ls(g), graphdef, params0, n, b, t, g, True) for g in (False, True)}
    rows, out = [], {"plain Adam step": plain}
    for g, tag in ((False, ""), (True, " + guard")):
        out[f"inner step{tag}"], out[f"sync step{tag}"] = inner[g], sync[g]
        amortized = ((h - 1) * inner[g] + sync[g]) / h / plain
        out[f"H={h}{tag} amortized ratio"] = amortized
        rows.append([f"{preset}: local_steps{tag}", f"{plain / 1e9:.4f}",
                     f"{inner[g] / plain:.6f}", f"{sync[g] / plain:.3f}",
                     f"{100 * (amortized - 1):+.2f} %"])  # fmt: skip
    return rows, out


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    smoke = options.SMOKE.value
    # preset, vocab, replicas, batch, seq, steps per chunk, reps, chunk contains a sync
    cases = ([("nano", 256, 2, 2, 16, 4, 2, True)] if smoke else
             [("tiny", 256, 8, 4, 64, 50, 7, True), ("small", 32000, 1, 1, 64, 10, 11, False)])
    rows, results = [], {"env": common.environment(), "cases": []}
    for case in cases:
        r, res = run_case(*case)
        rows += r
        results["cases"].append(res)
    traffic_rows, results["traffic"] = [], {}
    for preset, vocab, n, b, t, h, *_ in cases:
        r, res = traffic_case(preset, vocab, n, b, t, h if preset != "small" else 50)
        traffic_rows += r
        results["traffic"][preset] = res
    cmd = options.command("experiments.bench.overhead")
    desc = "; ".join(
        f"{c[0]}: {c[2]} vmap replica(s), {c[3]} x {c[4]} tokens per replica, chunks of {c[5]} "
        "fused steps" for c in cases)  # fmt: skip
    md = (f"### Optimizer overhead\n\n`{cmd}` — {desc}; state donated between chunks as in the "
          f"trainer; medians of the interleaved repetitions ({results['env']['device']}). "
          "'inner only' never reaches a sync (H = 10**9). Rows without 'phase on device' run as "
          "the trainer does: the host passes each chunk's sync positions, so inner steps "
          "compile without the on-device cond. 'paired' is the median (and IQR) of "
          "the per-round ratios, each of two chunks run back to back.\n\n"
          + common.md_table(["optimizer", "ms / step", "IQR (ms)", "vs plain Adam (medians)",
                             "vs plain Adam (paired)"], rows)
          + "\nMemory traffic per step from XLA's cost analysis (bytes accessed by the compiled "
          "single step; deterministic, unlike the timings). The trainer's inner step and sync "
          "step (phase from the host) relative to a plain-Adam step of the same model and "
          "batch; 'amortized' is one sync every H steps (H = 50 for small, which the timed rows "
          "run without a sync).\n\n"
          + common.md_table(["optimizer", "plain Adam step (GB)", "inner step / plain",
                             "sync step / plain", "amortized over H"], traffic_rows))  # fmt: skip
    common.write("bench_overhead", results, md, options.out_dir())


if __name__ == "__main__":
    options.run(main)
