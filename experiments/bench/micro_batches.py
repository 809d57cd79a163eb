"""Gradient accumulation: bytes per device and speed with k micro-batches per step.

    python -m experiments.bench.micro_batches [--smoke] [--sizes small,medium,large]
    python -m experiments.bench.micro_batches --nomemory --speed_case=small,16,1024 \
        --speed_dtype=bfloat16                      # speed only, a GPU-sized step

1. Memory: the trainer's NoLoCo sync program for each paper size at the paper's batch per
   replica (sequences of 1024 tokens), one device per replica, with the batch taken in
   k = 1, 8 and batch slices (``config.optim.micro_batches``; k = batch is one sequence per
   slice), activations recomputed or not; compiled with abstract inputs
   (``noloco_jax.trainer.aot.step_memory``), nothing allocated. Whether it fits an H100 and
   a TPU v5e chip using ``--usable`` of it.
2. Speed: the tiny model's loss and gradients on 16 sequences of 128 tokens, whole and in
   k = 2, 4, 16 slices, timed side by side and interleaved on this machine; the ratio to the
   whole batch, on whatever device JAX uses (``--speed_case`` sets the model and shape).
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
from absl import flags

from experiments import options
from experiments.bench import common, memory_flags
from experiments.bench.memory_flags import SIZES, USABLE
from noloco_jax import models
from noloco_jax.models.presets import preset_names

REPS = flags.DEFINE_integer("reps", 30, "Timed repetitions of each variant.", lower_bound=1)
MEMORY = flags.DEFINE_bool("memory", True, "Measure the footprints (part 1); --nomemory skips it.")
SPEED_CASE = flags.DEFINE_list(
    "speed_case", ["tiny", "16", "128"], "The timed step: model preset, sequences, tokens each.")
flags.register_validator(
    "speed_case", lambda v: len(v) == 3 and v[0] in preset_names() and all(
        x.isdigit() and int(x) > 0 for x in v[1:]),
    message=f"takes PRESET,SEQUENCES,TOKENS with a preset of {preset_names()} and two "
            "positive integers")  # fmt: skip
SPEED_DTYPE = flags.DEFINE_enum("speed_dtype", "float32", ["float32", "bfloat16"],
                                "Compute dtype of the timed step (parameters stay float32).")
for _name in (*options.OUT_FLAGS, *memory_flags.KEY_FLAGS):
    flags.declare_key_flag(_name)

VOCAB, BATCH, CHIPS = common.PAPER_VOCAB, common.PAPER_BATCH, common.CHIPS
_GB = 1e9


def memory_rows(sizes: list[str], vocab: int, seq_len: int) -> list[dict]:
    """The sync program's ``StepMemory`` per size, remat and k (one device per replica)."""
    from noloco_jax.trainer import aot  # noqa: PLC0415

    rows = []
    for size in sizes:
        batch = BATCH[size]
        for remat in (False, True):
            for k in sorted({1, min(8, batch), batch}):
                t0 = time.perf_counter()
                s = common.paper_settings(size, batch_per_replica=batch, seq_len=seq_len,
                                          remat=remat, micro_batches=k)  # fmt: skip
                m = aot.step_memory(s, vocab, program="sync")
                rows.append({"size": size, "batch": batch, "remat": remat, "k": k,
                             "state": m.state, "temp": m.temp, "peak": m.peak,
                             "compile_s": time.perf_counter() - t0})  # fmt: skip
                print(_brief(rows[-1]), flush=True)
    return rows


def _brief(r: dict) -> str:
    return (f"{r['size']} B={r['batch']} remat={r['remat']} k={r['k']}: state "
            f"{r['state'] / _GB:.2f} GB, scratch {r['temp'] / _GB:.2f} GB, footprint "
            f"{r['peak'] / _GB:.2f} GB ({r['compile_s']:.0f} s)")  # fmt: skip


def speed_rows(preset: str, batch: int, seq_len: int, ks: Sequence[int], reps: int,
               dtype: str = "float32") -> list[dict]:
    """Seconds per loss-and-gradient call, whole batch and k slices, interleaved.

    Also times one slice's gradient on its own: k times that, against the whole batch, is
    what the smaller slice costs by itself, so the rest is the loop's own cost.
    """
    from noloco_jax.trainer import grads  # noqa: PLC0415

    cfg = models.get_preset(preset, vocab_size=256, dtype=dtype)
    graphdef, params = models.init_params(cfg, 0)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq_len + 1), 0, 256)
    step = jnp.int32(0)
    plain = jax.jit(grads.plain(graphdef))
    fns = {f"k={k}": functools.partial(jax.jit(grads.accumulated(grads.plain(graphdef), k)),
                                       params, tokens, step) for k in (1, *ks)}  # fmt: skip
    fns.update({f"slice of k={k}": functools.partial(plain, params, tokens[: batch // k], step)
                for k in ks})  # fmt: skip
    times = common.interleaved(fns, reps)
    whole = common.summary(times["k=1"])["median_s"]
    return [{"k": k, **common.summary(times[f"k={k}"]),
             "ratio": common.ratio(times, f"k={k}", "k=1"),
             "paired": common.paired_ratios(times, f"k={k}", "k=1"),
             "slice_alone_ratio": 1.0 if k == 1 else
             k * common.summary(times[f"slice of k={k}"])["median_s"] / whole}
            for k in (1, *ks)]  # fmt: skip


def _device(env: dict) -> str:
    kind = env["device"]
    return "this machine (XLA:CPU)" if kind.lower() == "cpu" else f"{kind} (jax {env['jax']})"


def _fits(peak: int) -> list[str]:
    return ["yes" if peak <= cap * USABLE.value else "no" for cap in CHIPS.values()]


def _memory_markdown(mem: list[dict]) -> str:
    """The footprint table and its caption ("" without footprints: ``--nomemory``)."""
    if not mem:
        return ""
    rows = [[r["size"], r["batch"], "on" if r["remat"] else "off", r["k"],
             r["batch"] // r["k"], f"{r['state'] / _GB:.2f}", f"{r['temp'] / _GB:.2f}",
             f"{r['peak'] / _GB:.2f}", *_fits(r["peak"])] for r in mem]  # fmt: skip
    return (
        "Footprint per device of the trainer's NoLoCo sync program, one device per replica, "
        "at the paper's batch per replica (configs/paper.py: float32 params, bfloat16 compute, "
        "Adam, 1024-token sequences), the batch taken in k slices "
        "(`config.optim.micro_batches`), compiled with abstract inputs on XLA:CPU "
        f"(`aot.step_memory`). GB = 10^9 bytes; 'fits' uses {USABLE.value:.0%} of the chip.\n\n"
        + common.md_table(["model", "batch", "remat", "k", "sequences per slice", "state GB",
                           "scratch GB", "footprint GB", *(f"fits {c}" for c in CHIPS)], rows)
        + "\n")  # fmt: skip


def _markdown(cmd: str, commit: str, mem: list[dict], speed: list[dict], shape: str,
              device: str) -> str:
    speed_table = [[r["k"], f"{r['median_s'] * 1e3:.2f}", f"{r['ratio']:.3f}",
                    f"{r['paired']['median']:.3f} ({r['paired']['q25']:.3f}–"
                    f"{r['paired']['q75']:.3f})", f"{r['slice_alone_ratio']:.3f}"]
                   for r in speed]  # fmt: skip
    what = "bytes per device and speed" if mem else "speed"
    return (
        f"### Gradient accumulation: {what}\n\n`{cmd}` (commit {commit}).\n\n"
        + _memory_markdown(mem)
        + f"Speed on {device}, {shape}: milliseconds per loss-and-gradient "
        "call, and its ratio to the whole batch (medians; paired: per round, median and IQR); "
        "the last column is k times one slice's call on its own, against the whole batch: "
        "what the smaller slices cost without the loop.\n\n"
        + common.md_table(["k", "ms", "vs whole (medians)", "vs whole (paired)",
                           "k x one slice alone"], speed_table))


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    options.smoke_sets("sizes", "reps", "speed_case", "speed_dtype", "memory")
    smoke = options.SMOKE.value
    sizes = ["nano"] if smoke else SIZES.value
    vocab, seq_len = (256, 64) if smoke else (VOCAB, 1024)
    mem = memory_rows(sizes, vocab, seq_len) if MEMORY.value else []
    preset, batch, seq = ("nano", 4, 32) if smoke else (
        SPEED_CASE.value[0], int(SPEED_CASE.value[1]), int(SPEED_CASE.value[2]))
    ks = [k for k in ((2, 4) if smoke else (2, 4, 16)) if batch % k == 0]
    speed = speed_rows(preset, batch, seq, ks, 3 if smoke else REPS.value, SPEED_DTYPE.value)
    shape = f"the {preset} model, {SPEED_DTYPE.value} compute, {batch} sequences of {seq} tokens"
    env = common.environment()
    results = {"env": env, "commit": env["commit"], "memory": mem, "speed": speed,
               "usable": USABLE.value, "chips": CHIPS, "speed_shape": shape}  # fmt: skip
    cmd = options.command("experiments.bench.micro_batches")
    common.write("bench_micro_batches", results,
                 _markdown(cmd, results["commit"], mem, speed, shape, _device(env)),
                 options.out_dir())


if __name__ == "__main__":
    options.run(main)
