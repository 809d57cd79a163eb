"""Which attention shapes get cuDNN's fused attention on this GPU, and whether the fallback holds.

    PYTHONPATH=. python experiments/gpu_runs/cudnn_probe.py

For each [B, T, N, H] bf16 shape: where cuDNN attention with its gradient fails when asked
for directly (when traced, when compiled, or not at all), what
``models.llama._cudnn_compiles`` (the probe ``causal_attention`` consults) answers, and
whether the gradient of ``causal_attention`` runs and agrees with XLA's kernel (largest
difference over the loss and the three gradients, relative to the reference's largest value).
On a CPU the direct call fails when traced and the probe says False for every shape.
Results: experiments/results/gpu_cudnn_probe_h200.md.
"""
import time

import jax
import jax.numpy as jnp

from noloco_jax.models import llama

SHAPES = [(2, 128, 4, 64), (2, 1024, 12, 64), (2, 128, 4, 12), (2, 128, 4, 72), (2, 128, 4, 160),
          (2, 128, 4, 256), (2, 100, 4, 64), (2, 128, 4, 512), (1, 8, 2, 8)]


def direct(shape: tuple[int, ...]) -> str:
    """Where cuDNN attention and its gradient fail for ``shape`` when asked for directly."""
    def loss(q, k, v):
        return llama._cudnn_attention(q, k, v).astype(jnp.float32).sum()

    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3
    try:
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args)
    except Exception as e:  # noqa: BLE001 - reported, not handled
        return f"fails when traced ({type(e).__name__}: {str(e)[:80]})"
    try:
        lowered.compile()
    except Exception as e:  # noqa: BLE001
        return f"fails when compiled ({type(e).__name__}: {str(e)[:80]})"
    return "compiles"


def against_xla(shape: tuple[int, ...]) -> str:
    """``causal_attention``'s loss and gradients against XLA's kernel on random inputs."""
    q, k, v = (jax.random.normal(key, shape, jnp.bfloat16)
               for key in jax.random.split(jax.random.key(0), 3))

    def run(attention):
        loss = lambda a, b, c: (attention(a, b, c).astype(jnp.float32) ** 2).sum()  # noqa: E731
        return jax.tree.leaves(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v))

    try:
        ours = run(llama.causal_attention)
    except Exception as e:  # noqa: BLE001
        return f"FAILS ({type(e).__name__}: {str(e)[:120]})"
    ref = run(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=True))
    rel = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
              / max(float(jnp.max(jnp.abs(y.astype(jnp.float32)))), 1e-30)
              for x, y in zip(ours, ref))  # fmt: skip
    return f"runs, differs from XLA's kernel by {rel:.2e} (relative)"


if __name__ == "__main__":
    print(jax.__version__, jax.devices(), flush=True)
    for shape in SHAPES:
        t0 = time.perf_counter()
        print(f"{shape}: direct cuDNN {direct(shape)} | probe "
              f"{llama._cudnn_compiles((shape,) * 3, 'bfloat16')} | causal_attention "
              f"{against_xla(shape)} | {time.perf_counter() - t0:.1f} s", flush=True)
