"""Training-step throughput vs a minimal hand-written single-replica JAX Adam loop.

    python -m experiments.bench.throughput [--smoke]
    python -m experiments.bench.throughput --case small,8,1024,10,7   # a GPU-sized step

Same model, same batch, same fused chunk of steps. "noloco_jax" is the trainer's step for one
replica (its optimizer chain: clip, local_steps(adam, noloco_outer)), with the chunk's sync
positions passed from the host as the trainer does; "hand-written" is
jax.value_and_grad of the loss plus Adam and global-norm clipping written out by hand. Both jit
with ``donate_argnums=0`` and are timed as loops that hand each chunk's state to the next, as the
trainer does. Target: noloco_jax >= 0.95 of the hand-written loop's tokens/s.

"noloco_jax, run-time trip count" is the same step in the loop the trainer had before the
number of steps per call became part of the compiled program: a ``fori_loop`` whose count is
passed at run time, so the compiled loop has no known trip count and, on a GPU, XLA checks the
loop condition on the host at every step. The pair shows what that cost.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax

from experiments import options
from experiments.bench import common
from noloco_jax import models, replicas
from noloco_jax.trainer.optimizer import build_optimizer
from noloco_jax.trainer.settings import OptimSettings, OuterSettings
from noloco_jax.trainer import grads
from noloco_jax.trainer.step import TrainState, loss_fn, train_step

CASES = flags.DEFINE_multi_string(
    "case", None, "preset,batch,seq_len,steps,reps to time instead of the default cases "
    "(repeatable); the vocabulary is 32k for small and larger presets, else 256.")
DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                          "Compute dtype of the model (weights and optimizer state stay float32).")
for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)


def parse_case(text: str) -> tuple[str, int, int, int, int]:
    """``"small,8,1024,10,7"`` -> ("small", 8, 1024, 10, 7): preset, batch, seq_len, steps, reps."""
    parts = text.split(",")
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
        raise app.UsageError(f"--case={text!r}: expected preset,batch,seq_len,steps,reps "
                             "with four positive integers, e.g. small,8,1024,10,7.", exitcode=2)
    if parts[0] not in models.PRESETS:
        raise app.UsageError(f"--case={text!r}: preset must be one of {sorted(models.PRESETS)}.",
                             exitcode=2)
    return (parts[0], *map(int, parts[1:]))


def runtime_trip_count(reps: replicas.Replicas, k: int, **step_kwargs) -> Callable:
    """The trainer's inner program as it was: ``k`` steps in a loop whose count is a run-time value."""
    step_fn = functools.partial(train_step, sync_step=False, **step_kwargs)

    def steps(state, tokens_KxBxT1, count):
        def body(i, carry):
            s, out = carry
            s, loss = step_fn(s, tokens_KxBxT1[i])
            return s, out.at[i].set(loss)

        return lax.fori_loop(0, count, body, (state, jnp.zeros((k,), jnp.float32)))

    program = jax.jit(reps.map(steps), donate_argnums=0)
    return lambda state, tokens: program(state, tokens, np.int32(k))


def hand_written(graphdef, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, clip=1.0):
    def step(carry, tokens):
        params, mu, nu, count = carry
        loss, g = jax.value_and_grad(loss_fn)(params, tokens, graphdef=graphdef)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g)))
        g = jax.tree.map(lambda x: x * jnp.minimum(1.0, clip / norm), g)
        count = count + 1
        mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, mu, g)
        nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, nu, g)
        c1, c2 = 1 - b1**count, 1 - b2**count
        params = jax.tree.map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps),
                              params, mu, nu)  # fmt: skip
        return (params, mu, nu, count), loss

    return jax.jit(lambda carry, tokens: lax.scan(step, carry, tokens), donate_argnums=0)


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    smoke = options.SMOKE.value
    cases = ([("nano", 2, 16, 4, 2)] if smoke else
             [("tiny", 8, 64, 20, 7), ("small", 1, 64, 2, 9)])  # preset, batch, seq, k, reps
    if CASES.value:
        cases = [parse_case(c) for c in CASES.value]
    rows, results = [], {"env": common.environment(), "rows": []}
    for preset, b, t, k, reps in cases:
        vocab = 256 if preset in ("nano", "tiny", "mini") else 32000
        cfg = models.get_preset(preset, vocab_size=vocab, max_seq_len=max(t, 2048),
                                dtype=DTYPE.value)  # fmt: skip
        graphdef, params = models.init_params(cfg, 0)
        tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (k, b, t + 1)),
                             jnp.int32)  # fmt: skip
        outer = OuterSettings(sync_every=10**6)
        tx = build_optimizer("noloco", OptimSettings(learning_rate=1e-3, warmup_steps=0), outer,
                             num_steps=10**6, num_replicas=1)  # fmt: skip
        state = replicas.replicate(TrainState(jnp.zeros([], jnp.int32), params, tx.init(params)), 1)
        step_kwargs = dict(grads_fn=grads.plain(graphdef), tx=tx, nonfinite_guard=True)
        variants = {
            "noloco_jax": common.TrainerChunk(replicas.Replicas(1), k, outer.sync_every,
                                              **step_kwargs),
            "noloco_jax, run-time trip count": runtime_trip_count(replicas.Replicas(1), k,
                                                                  **step_kwargs),
        }  # fmt: skip
        fns = {name: common.Carried(fn, jax.tree.map(jnp.copy, state), tokens[None])
               for name, fn in variants.items()}  # fmt: skip
        zeros = jax.tree.map(jnp.zeros_like, params)
        hand = hand_written(graphdef)
        carry = (jax.tree.map(jnp.copy, params), zeros, jax.tree.map(jnp.copy, zeros),
                 jnp.zeros([], jnp.float32))  # fmt: skip
        fns["hand-written"] = common.Carried(hand, carry, tokens)
        times = common.interleaved(fns, reps)  # all donate their state, as the trainer does
        tok = {name: k * b * t / common.summary(v)["median_s"] for name, v in times.items()}
        rec = {"model": preset, "params": models.param_count(cfg), "batch": b, "seq_len": t,
               "tokens_per_s": tok, "variants": {}}  # fmt: skip
        for name in variants:
            ratio = 1 / common.ratio(times, name, "hand-written")
            paired = common.paired_ratios(times, "hand-written", name)  # tok/s ratio
            rec["variants"][name] = {"throughput_ratio": ratio, "paired_ratio": paired}
            rows.append([preset, f"{models.param_count(cfg) / 1e6:.1f}M", f"{b} x {t}", name,
                         round(tok["hand-written"]), round(tok[name]), f"{ratio:.3f}",
                         f"{paired['median']:.3f} ({paired['q25']:.3f}-{paired['q75']:.3f})"])
        results["rows"].append(rec)
    cmd = options.command("experiments.bench.throughput")
    md = (f"### Training-step throughput vs a hand-written JAX Adam loop\n\n`{cmd}` — one replica, "
          f"fused chunks of steps, interleaved repetitions ({results['env']['device']}, "
          f"{DTYPE.value} compute; 'small' uses a 32k vocabulary). 'ratio' divides the medians; "
          "'paired' is the median (IQR) of the per-round ratios of two back-to-back chunks. "
          "'run-time trip count' is the trainer's loop before the number of steps per call "
          "was compiled into the program (as the hand-written scan and the trainer now have "
          "it).\n\n"
          + common.md_table(["model", "params", "batch", "variant", "hand-written tok/s",
                             "variant tok/s", "ratio", "paired"], rows))  # fmt: skip
    common.write("bench_throughput", results, md, options.out_dir())


if __name__ == "__main__":
    options.run(main)
