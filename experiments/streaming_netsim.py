"""Streaming fragments, overlap and 8-bit exchange in the network model (issue 21).

    python -m experiments.streaming_netsim [--smoke] [--publish] [--out_dir=DIR]

For the paper's small / medium / large models at their nominal (OPT) sizes, 125M / 1.3B /
6.8B (the Llama models as configured are larger: network_model.py uses their counts), float32
params, and a datacenter (100 Gbit/s, 0.01 ms) and an internet (1 Gbit/s, 50 ms) link: one
replica's burst per sync, sync time, the share of wall time it stalls, and the bandwidth
above which an overlap of tau steps hides the
exchange, for P in {1, 2, 5} (dividing H = 50), tau in {0, 1, 5} and float32 / bfloat16 /
int8 / float8 on the wire (H = 50). NoLoCo (n = 2) does not depend on N; DiLoCo's ring
all-reduce is listed for N in {8, 64, 1024}. This is the cost model only; the optimizer's
bytes per sync are measured from the HLO in the tests and BENCHMARKS.md.

Writes <out_dir>/streaming_netsim.json and .md and the figure streaming_netsim.png next to
them (default experiments/runs/results, git-ignored; --publish: experiments/results and
experiments/figures).
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
from typing import Sequence

from absl import app, flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments import options  # noqa: E402
from noloco_jax import netsim  # noqa: E402
from noloco_jax.experiments import harness  # noqa: E402

_SMOKE = options.SMOKE
for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)

SIZES = {"small": 125e6, "medium": 1.3e9, "large": 6.8e9}
STEP_S = {"small": 0.25, "medium": 1.0, "large": 4.0}  # assumed compute per inner step
LINKS = {"datacenter": netsim.DATACENTER, "internet": netsim.INTERNET}
COMMAND = "python -m experiments.streaming_netsim"


METHODS = (("noloco", 2), ("diloco", 8), ("diloco", 64), ("diloco", 1024))
WIRES = ("float32", "bfloat16", "int8", "float8_e4m3fn")


def rows(smoke: bool) -> list[dict]:
    sizes = ["small"] if smoke else list(SIZES)
    out = []
    for size, (link_name, link), (method, n), frags, tau, wire in itertools.product(
            sizes, LINKS.items(), METHODS, (1, 2, 5), (0, 1, 5), WIRES):  # fmt: skip
        r = netsim.streaming_sync(SIZES[size], link, step_time_s=STEP_S[size], sync_every=50,
                                  fragments=frags, delay_steps=tau, exchange=wire,
                                  method=method, num_replicas=n)  # fmt: skip
        out.append({"size": size, "link": link_name, **r})
    return out


def _fmt_gbps(bytes_per_s: float) -> str:
    """Bytes/s printed as Gbit/s; inf (no overlap) and nan (latency) in words."""
    if math.isnan(bytes_per_s):
        return "never (latency)"
    return "—" if math.isinf(bytes_per_s) else f"{bytes_per_s * 8 / 1e9:.2f}"


def _method(r: dict) -> str:
    return "NoLoCo" if r["method"] == "noloco" else f"DiLoCo N={r['num_replicas']}"


def _shown(r: dict) -> bool:
    """The markdown shows NoLoCo's grid (bf16 / fp8 at P = 1) and DiLoCo at N = 8 and 1024 with
    float32 / int8; the json holds every row."""
    if r["method"] == "noloco":
        return r["exchange"] in ("float32", "int8") or r["fragments"] == 1
    return r["num_replicas"] in (8, 1024) and r["exchange"] in ("float32", "int8")


def markdown(table: list[dict], command: str = COMMAND) -> str:
    head = ("| model | link | method | P | tau | wire | burst (MB) | sync (s) | stall share | "
            "hidden above (Gbit/s) |\n|---|---|---|---|---|---|---|---|---|---|\n")  # fmt: skip
    body = "".join(
        f"| {r['size']} | {r['link']} | {_method(r)} | {r['fragments']} | {r['delay_steps']} "
        f"| {r['exchange']} | {r['bytes_per_sync'] / 1e6:.1f} | {r['sync_time_s']:.3g} | "
        f"{100 * r['comm_fraction']:.2f} % | {_fmt_gbps(r['hidden_above_bytes_per_s'])} |\n"
        for r in table if _shown(r))
    return (f"### Streaming, overlap and 8-bit exchange in the network model\n\n`{command}` — "
            f"H = 50, NoLoCo n = 2, DiLoCo a ring all-reduce over N, float32 params; assumed compute per inner step: "
            f"{', '.join(f'{k} {v} s' for k, v in STEP_S.items())}. Burst = bytes one replica "
            "sends per sync (one fragment). 'hidden above' = the link bandwidth above which an "
            "overlap of tau steps hides the exchange; 'never (latency)' when the latency alone "
            "exceeds tau steps. bfloat16 and float8 rows are in the json (shown for P = 1).\n\n"
            + head + body)


def plot(table: list[dict]):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, link in zip(axes, LINKS):
        for (method, n), wire, tau in itertools.product(
                (("noloco", 2), ("diloco", 64)), ("float32", "int8"), (0, 5)):  # fmt: skip
            pts = [(r["fragments"], 100 * r["comm_fraction"]) for r in table
                   if r["link"] == link and r["exchange"] == wire and r["delay_steps"] == tau
                   and r["size"] == table[-1]["size"] and r["method"] == method
                   and r["num_replicas"] == n]  # fmt: skip
            name = "NoLoCo" if method == "noloco" else f"DiLoCo N={n}"
            ax.plot(*zip(*pts), marker="o", ls="-" if method == "noloco" else "--",
                    label=f"{name}, {wire}, tau={tau}")  # fmt: skip
        ax.set(title=f"{table[-1]['size']} model, {link}", xlabel="fragments P",
               ylabel="stall share of wall time (%)", xticks=[1, 2, 5])  # fmt: skip
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def run(*, smoke: bool, out_dir: pathlib.Path) -> list[dict]:
    """Computes the table; writes the json, markdown and figure.

    Args:
      smoke: the small model only.
      out_dir: where streaming_netsim.json and .md go; the figure goes next to them, or to
        experiments/figures when ``out_dir`` is experiments/results.

    Returns:
      The table's rows.
    """
    table = rows(smoke)
    command = COMMAND + (" --smoke" if smoke else "")
    publishing = out_dir.resolve() == harness.RESULTS.resolve()
    fig_path = (harness.FIGURES if publishing else out_dir) / "streaming_netsim.png"
    fig = plot(table)
    harness.save_figure(fig, fig_path)
    plt.close(fig)
    rel = "../figures/" if publishing else ""
    md = markdown(table, command) + f"\n![stall share]({rel}{fig_path.name})\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"command": command, "rows": table, "_provenance": harness.provenance_entry()}
    (out_dir / "streaming_netsim.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    (out_dir / "streaming_netsim.md").write_text(md)
    print(f"wrote {out_dir / 'streaming_netsim.json'} and {out_dir / 'streaming_netsim.md'}",
          flush=True)  # fmt: skip
    return table


def main(argv: Sequence[str]) -> None:
    """Runs the experiment with the flags' settings."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    run(smoke=_SMOKE.value, out_dir=options.out_dir())


if __name__ == "__main__":
    options.run(main)
