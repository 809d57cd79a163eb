"""Tokens/s and model FLOPs utilization of a training step on one accelerator.

    python -m experiments.bench.gpu                  # paper-small, bf16, on a GPU
    python -m experiments.bench.gpu --smoke          # nano model, seconds, any device

Times, side by side and interleaved, one fused chunk of H = ``--sync_every`` steps (so
each outer method's sync is amortized as in training) for: the plain train step (clipped
Adam, nothing else), data parallel, DiLoCo and NoLoCo, each with ``--replicas`` replicas
vmap-simulated on the one device (bf16 compute, f32 master weights). MFU = model FLOPs /
(time x peak), model FLOPs per token = 6 x (params without the input embedding) + 12 x
layers x seq_len x hidden (causal attention counted in full, as PaLM's appendix B does).
On a CPU it writes ``bench_gpu_dryrun`` with "not a GPU" in its title, so a dry run never
replaces the GPU table (``bench_gpu``, measured on a lent GPU).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import options
from experiments.bench import common
from noloco_jax import models, replicas
from noloco_jax.trainer.optimizer import build_optimizer
from noloco_jax.trainer.settings import OptimSettings, OuterSettings
from noloco_jax.trainer import grads
from noloco_jax.trainer.step import TrainState

# Dense bf16 datasheet peaks; the PCIe and NVL cards run slower than the SXM ones.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.0,
                    "H200 NVL": 835.0, "A100": 312.0}  # fmt: skip

REPLICAS = flags.DEFINE_integer("replicas", 2, "Replicas of the outer methods.", lower_bound=1)
BATCH = flags.DEFINE_integer("batch", 8, "Sequences per replica per step.", lower_bound=1)
SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "Tokens per sequence.", lower_bound=1)
SYNC_EVERY = flags.DEFINE_integer("sync_every", 50, "Steps per timed chunk (H).", lower_bound=1)
REPS = flags.DEFINE_integer("reps", 5, "Timed repetitions of every method.", lower_bound=1)
PEAK_TFLOPS = flags.DEFINE_float("peak_tflops", 0.0, "Override the peak (0: from the device).",
                                  lower_bound=0.0)
options.old_spellings("seq_len", "sync_every", "peak_tflops")
for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)


def model_flops_per_token(cfg: models.LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 N (no input embedding) + 12 L T d (attention).

    N counts the output head's [D, V] matmul whether or not it is tied to the input table.
    """
    n = models.param_count(cfg, non_embedding=True) + cfg.vocab_size * cfg.hidden_size
    return 6.0 * n + 12.0 * cfg.num_layers * seq_len * cfg.hidden_size


def peak_flops(device_kind: str, override_tflops: float) -> float | None:
    """Peak FLOP/s: the override, else the longest name in ``PEAK_BF16_TFLOPS`` in the kind."""
    if override_tflops > 0:
        return override_tflops * 1e12
    hit = max((k for k in PEAK_BF16_TFLOPS if k in device_kind), key=len, default=None)
    return PEAK_BF16_TFLOPS[hit] * 1e12 if hit else None


def _chunk_fn(method: str, graphdef, params, n: int, h: int):
    optim = OptimSettings(learning_rate=1e-4, warmup_steps=0)
    tx = build_optimizer("local" if method == "plain" else method, optim,
                         OuterSettings(sync_every=h), num_steps=10**6,
                         num_replicas=1 if method == "plain" else n)  # fmt: skip
    reps = 1 if method == "plain" else n
    state = replicas.replicate(TrainState(jnp.zeros([], jnp.int32), params, tx.init(params)), reps)
    # Each call starts from step 0, so the chunk's last step syncs: the trainer's two programs.
    every = h if method in ("noloco", "diloco") else None
    fn = common.TrainerChunk(replicas.Replicas(reps), h, every, grads_fn=grads.plain(graphdef),
                             tx=tx, donate=False)  # fmt: skip
    return state, fn


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    options.smoke_sets("batch", "seq_len", "sync_every", "replicas", "reps")
    smoke = options.SMOKE.value
    preset, vocab = ("nano", 256) if smoke else ("small", 32000)
    b, t, h, n = ((2, 32, 4, 2) if smoke else
                  (BATCH.value, SEQ_LEN.value, SYNC_EVERY.value, REPLICAS.value))  # fmt: skip
    cfg = models.get_preset(preset, vocab_size=vocab, max_seq_len=max(t, 64), dtype="bfloat16")
    graphdef, params = models.init_params(cfg, 0)
    rng = np.random.default_rng(0)
    fns, tokens = {}, {}
    for method in ("plain", "dp", "diloco", "noloco"):
        reps = 1 if method == "plain" else n
        state, fn = _chunk_fn(method, graphdef, params, n, h)
        tokens[method] = jnp.asarray(rng.integers(1, vocab, (reps, h, b, t + 1)), jnp.int32)
        fns[method] = functools.partial(fn, state, tokens[method])
    times = common.interleaved(fns, 1 if smoke else REPS.value)
    env = common.environment()
    peak = peak_flops(env["device"], PEAK_TFLOPS.value)
    per_token = model_flops_per_token(cfg, t)
    rows, results = [], {"env": env, "model": preset, "rows": []}
    for method, ts in times.items():
        tok_s = tokens[method][..., 1:].size / common.summary(ts)["median_s"]
        mfu = tok_s * per_token / peak if peak else None
        rel = common.ratio(times, "plain", method) * (tokens[method].shape[0])
        results["rows"].append({"method": method, "tokens_per_s": tok_s, "mfu": mfu,
                                "per_replica_speed_vs_plain": rel})  # fmt: skip
        rows.append([method, round(tok_s), f"{100 * mfu:.1f} %" if mfu else "n/a", f"{rel:.3f}"])
    gpu = jax.default_backend() == "gpu"
    cmd = options.command("experiments.bench.gpu")
    title = "Accelerator throughput and MFU" + ("" if gpu else " (not a GPU: a dry run)")
    md = (f"### {title}\n\n`{cmd}` — {env['device']}, jax {env['jax']}; {preset} model, bf16 "
          f"compute, {n} replicas x {b} x {t} tokens per step, chunks of H = {h} steps "
          "(one sync each). Per-replica speed is relative to the plain train step.\n\n"
          + common.md_table(["method", "tokens/s", "MFU", "per-replica speed vs plain"], rows))
    common.write("bench_gpu" if gpu else "bench_gpu_dryrun", results, md, options.out_dir())


if __name__ == "__main__":
    options.run(main)
