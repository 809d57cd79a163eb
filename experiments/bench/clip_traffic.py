"""Does the fused clip still matter? Memory traffic of a clipped-Adam step, optax vs fused.

    python -m experiments.bench.clip_traffic [--smoke]

XLA's cost analysis of one compiled trainer step (bytes accessed; deterministic, unlike
timings) with ``optax.clip_by_global_norm`` and with ``clip_by_global_norm_fused`` before
``optax.adam``, for the tiny model (8 replicas x 4 x 64 tokens) and paper-small (1 x 64 tokens,
where the per-parameter optimizer traffic dominates). The fused clip stays in the library only
while the ratio shows it saves a pass over the weights.
"""

from __future__ import annotations

from typing import Sequence

import optax
from absl import flags

from experiments import options
from experiments.bench import common
from experiments.bench.overhead import step_bytes
from noloco_jax import clip_by_global_norm_fused, models

for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    smoke = options.SMOKE.value
    cases = [("nano", 256, 2, 2, 16)] if smoke else [("tiny", 256, 8, 4, 64),
                                                     ("small", 32000, 1, 1, 64)]
    rows, results = [], {"env": common.environment(), "cases": {}}
    for preset, vocab, n, b, t in cases:
        cfg = models.get_preset(preset, vocab_size=vocab)
        graphdef, params0 = models.init_params(cfg, 0)
        got = {}
        for name, clip in (("optax", optax.clip_by_global_norm(1.0)),
                           ("fused", clip_by_global_norm_fused(1.0))):  # fmt: skip
            tx = optax.chain(clip, optax.adam(1e-3))
            got[name] = step_bytes(tx, graphdef, params0, n, b, t, False, None)
        ratio = got["optax"] / got["fused"]
        results["cases"][preset] = {**got, "optax_over_fused": ratio}
        rows.append([preset, f"{got['optax'] / 1e9:.4f}", f"{got['fused'] / 1e9:.4f}",
                     f"{ratio:.3f}"])  # fmt: skip
    cmd = options.command("experiments.bench.clip_traffic")
    md = (f"### Clipping: optax vs fused\n\n`{cmd}` — bytes accessed by one compiled trainer "
          "step (XLA cost analysis), clipped Adam with each clip.\n\n"
          + common.md_table(["model", "optax clip (GB)", "fused clip (GB)", "optax / fused"],
                            rows))  # fmt: skip
    common.write("bench_clip_traffic", results, md, options.out_dir())
    print(md)


if __name__ == "__main__":
    options.run(main)
