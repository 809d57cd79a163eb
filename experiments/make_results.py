"""Assembles experiments/RESULTS.md and BENCHMARKS.md from the per-experiment markdown files.

    python -m experiments.make_results [--allow_mixed_commits] [--results_dir DIR]

Each experiment script writes experiments/results/<name>.{md,json} (tables, the exact command,
figure links; the json records the commit of the code that made it, see
noloco_jax.experiments.provenance); this stitches the markdown under the hand-written summaries
in experiments/results/_summary.md and experiments/results/_bench_summary.md.

RESULTS.md is built only from results of one version of the code: if the results jsons of its
sections (their reports and every run in them) were made by different commits, by a dirty tree
or without a recorded commit, it says which and exits with status 2, unless
``--allow_mixed_commits``, which builds the page and lists the versions at its top.
BENCHMARKS.md (timings measured on purpose at different times) is not checked.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Sequence

from absl import app, flags

from experiments import options
from noloco_jax.experiments import provenance

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
SECTIONS = ["table2", "spread_vs_lr", "sweeps", "quadratic_theory", "routing_ablation",
            "dropout", "network_model", "streaming_netsim", "comm_quality", "skippipe_schedules",
            "skippipe_training", "hdee"]
ALLOW_MIXED = flags.DEFINE_bool(
    "allow_mixed_commits", False,
    "Build RESULTS.md even from results of different code versions (listed on the page).")
RESULTS_DIR = flags.DEFINE_string("results_dir", None, "Where the results are and the pages go "
                                  "(default: experiments/results and experiments/).")
BENCH = ["bench_overhead", "bench_overhead_gpu_h200", "bench_clip_traffic", "bench_comm_volume",
         "bench_diloco_exchange", "bench_comm_volume_split", "bench_sharded_memory",
         "bench_micro_batches", "bench_micro_batches_gpu_h200", "bench_scaling",
         "bench_compile_scale", "bench_compile_scale_shard_map", "bench_throughput",
         "bench_throughput_gpu", "bench_throughput_gpu_bf16", "bench_gpu", "bench_gpu_attention",
         "bench_overlap", "pilot_cost", "bench_opt_level", "bench_routing_compile",
         "bench_suite_time"]


def _nest(markdown: str) -> str:
    """Pushes a section's headings one level down when it starts at level 1."""
    if not markdown.startswith("# "):
        return markdown
    return "\n".join("#" + line if line.startswith("#") else line
                     for line in markdown.splitlines()) + "\n"  # fmt: skip


def versions(results: pathlib.Path, names: list[str]) -> dict[str, list[str]]:
    """{code version: ["<name>: <run or (report)>", ...]} over the results jsons of ``names``."""
    found: dict[str, list[str]] = {}
    for name in names:
        path = results / f"{name}.json"
        if (results / f"{name}.md").exists() and not path.exists():
            raise app.UsageError(
                f"{results / name}.md has no {name}.json beside it, so the code version of "
                f"its numbers cannot be checked; rerun the experiment or remove the .md.")
        if path.exists():
            saved = options.read_json("results_dir", path)  # a cut-short file: a UserError
            for label, what in provenance.versions_of(saved).items():
                found.setdefault(label, []).extend(f"{name}: {w}" for w in what)
    return found


def _versions_md(found: dict[str, list[str]]) -> str:
    lines = ["## Code versions of these results\n",
             "Built with `--allow_mixed_commits` from results of more than one version:\n"]
    for label, what in sorted(found.items()):
        shown = ", ".join(what[:6]) + (f" and {len(what) - 6} more" if len(what) > 6 else "")
        lines.append(f"- `{label}`: {shown}")
    return "\n".join(lines) + "\n"


def _bench_version(results: pathlib.Path, name: str) -> str:
    """The line under a benchmark section that says which code and stack measured it."""
    path = results / f"{name}.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    env = saved.get("env") if isinstance(saved, dict) else None
    writer = saved.get("_provenance", {}).get("writer") if isinstance(saved, dict) else None
    if (not env or not env.get("commit")) and isinstance(writer, dict) and writer.get("commit"):
        env = {**(env or {}), "commit": provenance.version_label(writer)}
    if not env or not env.get("commit"):
        return "_Code version: not recorded (measured before the benchmarks recorded it)._\n"
    stack = ", ".join(f"{k} {env[k]}" for k in ("jax", "device") if env.get(k))
    return f"_Code version: commit `{env['commit']}`" + (f"; {stack}" if stack else "") + "._\n"


def _page(results: pathlib.Path, title: str, summary: str, names: list[str],
          header: str = "", stamp: bool = False) -> str:  # fmt: skip
    parts = [f"# {title}\n", header,
             (results / summary).read_text() if (results / summary).exists() else ""]
    missing = []
    for name in names:
        path = results / f"{name}.md"
        if path.exists():
            parts.append(_nest(path.read_text().replace("](../figures/", "](figures/"))
                         + (_bench_version(results, name) if stamp else ""))  # fmt: skip
        else:
            missing.append(name)
    if missing:
        parts.append("## Not yet run\n\n" + "\n".join(f"- `{m}`" for m in missing) + "\n")
    return "\n".join(p.rstrip() + "\n" for p in parts if p)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {list(argv[1:])}; it takes only flags.")
    results = pathlib.Path(RESULTS_DIR.value) if RESULTS_DIR.value else RESULTS
    pages = results.parent if RESULTS_DIR.value else HERE
    if not any(results.glob("*.json")):  # a typo would write "Not yet run" pages over real ones
        raise app.UsageError(f"--results_dir={results}: no experiment results (*.json) there; "
                             f"give the folder the experiments wrote (--out_dir).")
    found = versions(results, SECTIONS)
    header = ""
    if len(found) > 1 or "unrecorded" in found or any("+dirty" in v for v in found):
        listing = "\n".join(f"  {label}: {', '.join(what[:4])}"
                            + (f" and {len(what) - 4} more" if len(what) > 4 else "")
                            for label, what in sorted(found.items()))  # fmt: skip
        if not ALLOW_MIXED.value:
            print(f"make_results: the results in {results} are not all from one clean commit "
                  f"({len(found)} version(s); 'unrecorded' = made before commits were "
                  f"recorded, '+dirty' = uncommitted changes):\n{listing}\nRe-run the experiments "
                  "from one commit, or pass --allow_mixed_commits to build the page anyway "
                  "(it then lists the versions).", file=sys.stderr)  # fmt: skip
            sys.exit(2)
        header = _versions_md(found)
    elif found:
        header = f"All results below come from commit `{next(iter(found))}`.\n"
    (pages / "RESULTS.md").write_text(_page(results, "Results", "_summary.md", SECTIONS, header))
    (pages / "BENCHMARKS.md").write_text(_page(results, "Benchmarks", "_bench_summary.md", BENCH,
                                               stamp=True))
    print("wrote", pages / "RESULTS.md", pages / "BENCHMARKS.md")


if __name__ == "__main__":
    options.run(main)
