"""Assembles experiments/RESULTS.md and BENCHMARKS.md from the per-experiment markdown files.

    python -m experiments.make_results

Each experiment script writes experiments/results/<name>.md (tables, the exact command,
figure links); this stitches them under the hand-written summaries in
experiments/results/_summary.md and experiments/results/_bench_summary.md.
"""

from __future__ import annotations

import pathlib
from typing import Sequence

from absl import app

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
SECTIONS = ["table2", "spread_vs_lr", "sweeps", "quadratic_theory", "routing_ablation",
            "dropout", "network_model", "streaming_netsim", "skippipe_schedules",
            "skippipe_training", "hdee"]
BENCH = ["bench_overhead", "bench_clip_traffic", "bench_comm_volume", "bench_comm_volume_split",
         "bench_sharded_memory", "bench_scaling",
         "bench_compile_scale", "bench_compile_scale_shard_map", "bench_throughput", "bench_gpu"]


def _nest(markdown: str) -> str:
    """Pushes a section's headings one level down when it starts at level 1."""
    if not markdown.startswith("# "):
        return markdown
    return "\n".join("#" + line if line.startswith("#") else line
                     for line in markdown.splitlines()) + "\n"  # fmt: skip


def _page(title: str, summary: str, names: list[str]) -> str:
    parts = [f"# {title}\n", (RESULTS / summary).read_text() if (RESULTS / summary).exists() else ""]
    missing = []
    for name in names:
        path = RESULTS / f"{name}.md"
        if path.exists():
            parts.append(_nest(path.read_text().replace("](../figures/", "](figures/")))
        else:
            missing.append(name)
    if missing:
        parts.append("## Not yet run\n\n" + "\n".join(f"- `{m}`" for m in missing) + "\n")
    return "\n".join(p.rstrip() + "\n" for p in parts if p)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {list(argv[1:])}; it takes none.")
    (HERE / "RESULTS.md").write_text(_page("Results", "_summary.md", SECTIONS))
    (HERE / "BENCHMARKS.md").write_text(_page("Benchmarks", "_bench_summary.md", BENCH))
    print("wrote", HERE / "RESULTS.md", HERE / "BENCHMARKS.md")


if __name__ == "__main__":
    app.run(main)
