"""Which attention kernel the compiled training step uses on a GPU, and what that is worth.

    python -m experiments.bench.gpu_attention           # paper-small, bf16, 8 x 1024 tokens
    python -m experiments.bench.gpu_attention --smoke   # nano model, seconds, any device

``models.llama.causal_attention`` asks for cuDNN's fused (flash) attention when it runs on a
GPU with bf16 inputs. This compiles the loss and gradient of one replica, and of two replicas
under ``jax.vmap`` (how the trainer simulates replicas on one device), twice: with that function
("ours") and with plain ``jax.nn.dot_product_attention``, where XLA picks the kernel ("XLA's
choice"). It reports the cuDNN attention calls found in each compiled program and the median of
timed calls, the variants interleaved. On a CPU neither variant has cuDNN calls.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax
from absl import flags

from experiments import options
from experiments.bench import common
from noloco_jax import models, replicas
from noloco_jax.models import llama
from noloco_jax.trainer.step import loss_fn

REPS = flags.DEFINE_integer("reps", 10, "Timed calls of every variant.", lower_bound=1)
for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)


def _xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _compiled(attention: Callable, graphdef: Any, args: tuple, batched: bool) -> Any:
    """The loss-and-gradient program compiled with ``attention`` in the model."""
    ours = llama.causal_attention
    llama.causal_attention = attention  # read when the model is traced, just below
    try:
        fn = jax.value_and_grad(lambda p, t: loss_fn(p, t, graphdef=graphdef))
        return jax.jit(jax.vmap(fn) if batched else fn).lower(*args).compile()
    finally:
        llama.causal_attention = ours


def cudnn_attention_calls(hlo_text: str) -> int:
    """Custom calls to cuDNN's fused attention (forward and backward) in compiled HLO text."""
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo_text)
    return sum("cudnn$fmha" in t for t in targets)


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    options.smoke_sets("reps")
    smoke = options.SMOKE.value
    preset, vocab, b, t = ("nano", 256, 2, 32) if smoke else ("small", 32000, 8, 1024)
    cfg = models.get_preset(preset, vocab_size=vocab, max_seq_len=max(t, 64), dtype="bfloat16")
    graphdef, params = models.init_params(cfg, 0)
    tokens = jax.random.randint(jax.random.key(1), (2, b, t + 1), 1, vocab)
    two = replicas.replicate(params, 2)
    cases = {"1 replica": ((params, tokens[0]), False), "2 replicas (vmap)": ((two, tokens), True)}
    fns, calls = {}, {}
    for case, (args, batched) in cases.items():
        for name, attention in (("ours", llama.causal_attention), ("XLA's choice", _xla_attention)):
            compiled = _compiled(attention, graphdef, args, batched)
            calls[case, name] = cudnn_attention_calls(compiled.as_text())
            fns[case, name] = lambda c=compiled, a=args: c(*a)
    times = common.interleaved(fns, 2 if smoke else REPS.value)
    medians = {key: common.summary(ts)["median_s"] for key, ts in times.items()}
    rows, results = [], {"env": common.environment(), "model": preset, "rows": []}
    for case in cases:
        for name in ("ours", "XLA's choice"):
            ms = 1e3 * medians[case, name]
            rel = medians[case, "XLA's choice"] / medians[case, name]
            results["rows"].append({"case": case, "attention": name, "median_ms": ms,
                                    "cudnn_calls": calls[case, name],
                                    "speed_vs_xla_choice": rel})  # fmt: skip
            rows.append([case, name, calls[case, name], f"{ms:.2f}", f"{rel:.2f}"])
    cmd = options.command("experiments.bench.gpu_attention")
    env = results["env"]
    md = (f"### Attention kernel in the compiled step\n\n`{cmd}` — {env['device']}, jax "
          f"{env['jax']}; {preset} model, bf16 compute, {b} x {t} tokens per replica, loss and "
          "gradient of the step (no optimizer), variants interleaved. 'cuDNN attention calls' "
          "counts cuDNN fused-attention custom calls (forward and backward) in the compiled "
          "program.\n\n"
          + common.md_table(["replicas", "attention", "cuDNN attention calls", "median ms",
                             "speed vs XLA's choice"], rows))  # fmt: skip
    common.write("bench_gpu_attention", results, md, options.out_dir())


if __name__ == "__main__":
    options.run(main)
