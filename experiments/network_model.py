"""Network model of NoLoCo vs all-reduce: the paper's Fig. 5A/5B and a bandwidth + latency table.

    python -m experiments.network_model            # full run, about a minute or two
    python -m experiments.network_model --publish  # ... into experiments/results and figures
    python -m experiments.network_model --smoke --out_dir=/tmp/nm/results   # seconds

(a) Fig. 5A: E[tree all-reduce] / E[pairwise averaging] against std(t)/t_c of
    log-normal message times, N = 4 ... 1024 (Monte Carlo).
(b) Fig. 5B: total training time DiLoCo / NoLoCo when slow workers block the
    others (log-normal inner-step times, communication ignored).
(c) Sync time and fraction of wall time spent communicating for the paper's
    small / medium / large models over a datacenter and an internet link.

Writes <out_dir>/network_model.json and .md, and network_fig5a.png and
network_fig5b.png in <fig_dir> (default: <out_dir>, which defaults to experiments/runs/results,
git-ignored; --publish: experiments/results and experiments/figures).

With --params, prints one sync report instead (data parallel, DiLoCo and NoLoCo for P
parameters on N replicas over one link, no compute/comm overlap) and writes nothing:

    python -m experiments.network_model --params=125e6 --replicas=1024 \\
        --bandwidth_gbps=1 --latency_ms=50 --step_time=0.5
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from typing import Any, Sequence

from absl import app, flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments import options  # noqa: E402
from noloco_jax import netsim  # noqa: E402
from noloco_jax.experiments import harness  # noqa: E402

_SMOKE = options.SMOKE
for _name in options.OUT_FLAGS:
    flags.declare_key_flag(_name)
_FIG_DIR = flags.DEFINE_string(
    "fig_dir", None, "Where figures go (default --out_dir; experiments/figures with --publish).")
_SEED = flags.DEFINE_integer("seed", 0, "NumPy seed of the Monte Carlo runs.", lower_bound=0)
# One sync report instead of the experiment (--params given).
_PARAMS = flags.DEFINE_float("params", None, "Number of parameters P, e.g. 125e6: print one "
                             "sync report and nothing else.")  # fmt: skip
_REPLICAS = flags.DEFINE_integer("replicas", None, "Number of replicas N (>= 2).")
_BANDWIDTH_GBPS = flags.DEFINE_float("bandwidth_gbps", None, "Link bandwidth in Gbit/s.")
_LATENCY_MS = flags.DEFINE_float("latency_ms", None, "One-way message latency in ms.")
_STEP_TIME = flags.DEFINE_float("step_time", None, "Compute time of one inner step in seconds.")
_BYTES_PER_PARAM = flags.DEFINE_integer("bytes_per_param", 4, "Bytes per parameter (1, 2, 4, 8).")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 2, "NoLoCo group size n.")
_EXCHANGE_BYTES_PER_PARAM = flags.DEFINE_integer(
    "exchange_bytes_per_param", None, "Bytes per parameter NoLoCo sends (default: "
    "--bytes_per_param).")  # fmt: skip
_NOLOCO_SYNC_EVERY = flags.DEFINE_integer("noloco_sync_every", 50, "NoLoCo inner steps per sync.")
_DILOCO_SYNC_EVERY = flags.DEFINE_integer("diloco_sync_every", 100, "DiLoCo inner steps per sync.")
_ALLREDUCE = flags.DEFINE_enum("allreduce", "ring", list(netsim.ALLREDUCE_ALGORITHMS),
                               "All-reduce algorithm of data parallel and DiLoCo.")  # fmt: skip
_GAMMA_DIFFERS = flags.DEFINE_bool(
    "gamma_differs", False, "NoLoCo with gamma != beta (slow weights travel too: twice the bytes).")

COMMAND = "python -m experiments.network_model"
_REPORT_FLAGS = ("replicas", "bandwidth_gbps", "latency_ms", "step_time", "bytes_per_param",
                 "group_size", "exchange_bytes_per_param", "noloco_sync_every",
                 "diloco_sync_every", "allreduce", "gamma_differs")

# Paper models: total parameters with untied embeddings at vocab 128,002, and global batch tokens.
MODELS = {
    "small": {"params": 309.9e6, "global_batch_tokens": 0.5e6},
    "medium": {"params": 2135.0e6, "global_batch_tokens": 1.0e6},
    "large": {"params": 9638.8e6, "global_batch_tokens": 2.0e6},
}
LINKS = {"datacenter": netsim.DATACENTER, "internet": netsim.INTERNET}
PEAK_FLOPS = 400e12  # bf16 FLOP/s per accelerator (assumed)
MFU = 0.4  # model FLOP utilisation (assumed)
BYTES_PER_PARAM = 2  # bf16 parameters, gradients and exchanges, as in the paper
H_NOLOCO, H_DILOCO = 50, 100  # the paper's inner steps per outer step

FULL = {
    "fig5a_n": [4, 16, 64, 256, 1024],
    "fig5a_ratios": [round(x, 2) for x in np.linspace(0.0, 2.5, 26)],
    "fig5a_trials": 20_000,
    "fig5b_n": [8, 16, 32, 64, 128, 256, 512, 1024],
    "fig5b_outer_steps": 250,
    "fig5b_trials": 10,
    "table_n": [8, 64, 256, 1024],
    "eq7_samples": 2_000_000,
}
SMOKE = {
    "fig5a_n": [4, 16],
    "fig5a_ratios": [0.0, 1.0, 2.5],
    "fig5a_trials": 200,
    "fig5b_n": [8, 16],
    "fig5b_outer_steps": 5,
    "fig5b_trials": 2,
    "table_n": [8, 64],
    "eq7_samples": 10_000,
}
FIG5B_TABLE_N = [8, 64, 256, 1024]
FIG5A_TABLE_RATIOS = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]


def step_time_s(params: float, global_batch_tokens: float, num_replicas: int) -> float:
    """Compute time of one inner step: 6·P·(global batch / N) FLOPs at PEAK_FLOPS·MFU."""
    return 6.0 * params * global_batch_tokens / num_replicas / (PEAK_FLOPS * MFU)


# --------------------------------------------------------------------------- (a) Fig. 5A


def run_fig5a(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """Ratio curves E[all-reduce]/E[pairwise] and an Eq. 7 check."""
    curves = {}
    for n in cfg["fig5a_n"]:
        pts = [netsim.allreduce_pairwise_ratio(n, r, num_trials=cfg["fig5a_trials"], seed=seed)
               for r in cfg["fig5a_ratios"]]
        curves[str(n)] = {"ratio": [p[0] for p in pts], "stderr": [p[1] for p in pts]}
    eq7 = []
    for r in (0.5, 1.0, 2.5):
        mu, sigma = netsim.lognormal_params(r)
        eq7.append({
            "std_ratio": r, "sigma": sigma,
            "closed_form": netsim.expected_max_of_two(mu, sigma),
            "monte_carlo": netsim.expected_max_of_two_mc(
                mu, sigma, num_samples=cfg["eq7_samples"], seed=seed),
        })
    return {"std_ratios": cfg["fig5a_ratios"], "trials": cfg["fig5a_trials"],
            "curves": curves, "eq7_check": eq7}


def plot_fig5a(res: dict[str, Any], path: pathlib.Path) -> None:
    """Fig. 5A: one curve per N, with log2(N) marked at std = 0."""
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    for n, c in res["curves"].items():
        ax.errorbar(res["std_ratios"], c["ratio"], yerr=c["stderr"], label=f"N = {n}")
        ax.plot([0.0], [np.log2(int(n))], "k+", ms=8)
    ax.set_xlabel("std(t) / t_c")
    ax.set_ylabel("E[tree all-reduce] / E[pairwise averaging]")
    ax.set_title(f"Fig. 5A model ({res['trials']} trials per point; + = log2 N)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------- (b) Fig. 5B


def _blocking(n: int, steps: int, h_d: int, h_n: int, trials: int, seed: int) -> dict[str, Any]:
    out = netsim.simulate_global_blocking(
        n, steps, diloco_sync_every=h_d, noloco_sync_every=h_n, num_trials=trials, seed=seed)
    r = out["ratio"]
    se = float(r.std(ddof=1) / np.sqrt(r.size)) if r.size > 1 else 0.0
    return {"ratio": float(r.mean()), "stderr": se,
            "diloco_time": float(out["diloco"].mean()), "noloco_time": float(out["noloco"].mean())}


def run_fig5b(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """DiLoCo / NoLoCo total-time ratios at equal H and at the paper's H = 100 vs 50."""
    r_outer, trials = cfg["fig5b_outer_steps"], cfg["fig5b_trials"]
    settings = {
        "H=50 both": (H_NOLOCO, H_NOLOCO, r_outer * H_NOLOCO),
        "H=100 both": (H_DILOCO, H_DILOCO, r_outer * H_DILOCO),
        "DiLoCo H=100, NoLoCo H=50": (H_DILOCO, H_NOLOCO, r_outer * H_DILOCO),
    }
    series = {}
    for name, (h_d, h_n, steps) in settings.items():
        series[name] = {
            "diloco_sync_every": h_d, "noloco_sync_every": h_n, "inner_steps": steps,
            "by_n": {str(n): _blocking(n, steps, h_d, h_n, trials, seed) for n in cfg["fig5b_n"]},
        }
    return {"outer_steps": r_outer, "trials": trials, "mu": 1.0, "sigma2": 0.5,
            "n": cfg["fig5b_n"], "series": series}


def plot_fig5b(res: dict[str, Any], path: pathlib.Path) -> None:
    """Fig. 5B: time(DiLoCo) / time(NoLoCo) against N for each setting."""
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    for name, s in res["series"].items():
        ns = [int(n) for n in s["by_n"]]
        ax.errorbar(ns, [v["ratio"] for v in s["by_n"].values()],
                    yerr=[v["stderr"] for v in s["by_n"].values()], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers N")
    ax.set_ylabel("training time DiLoCo / NoLoCo")
    ax.set_title(f"Fig. 5B model: step time LogNormal(1, 0.5), {res['trials']} runs per point",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------- (c) sync table


def run_sync_table(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per (link, model, N): sync_report rows for ring and tree all-reduce."""
    out = []
    for link_name, link in LINKS.items():
        for model, spec in MODELS.items():
            for n in cfg["table_n"]:
                step = step_time_s(spec["params"], spec["global_batch_tokens"], n)
                reports = {
                    algo: netsim.sync_report(
                        spec["params"], n, link, step_time_s=step,
                        noloco_sync_every=H_NOLOCO, diloco_sync_every=H_DILOCO,
                        bytes_per_param=BYTES_PER_PARAM, allreduce=algo)
                    for algo in netsim.ALLREDUCE_ALGORITHMS
                }
                equal_h = netsim.sync_report(
                    spec["params"], n, link, step_time_s=step,
                    noloco_sync_every=H_DILOCO, diloco_sync_every=H_DILOCO,
                    bytes_per_param=BYTES_PER_PARAM)
                reports["noloco_at_diloco_h"] = [r for r in equal_h if r["method"] == "noloco"]
                out.append({"link": link_name, "bytes_per_second": link.bytes_per_second,
                            "latency_s": link.latency_s, "model": model,
                            "params": spec["params"], "replicas": n, "step_time_s": step,
                            "reports": reports})
    return out


# --------------------------------------------------------------------------- markdown


def _g(x: float) -> str:
    return f"{x:.3g}"


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def _md_fig5a(res: dict[str, Any]) -> list[str]:
    idx = [res["std_ratios"].index(r) for r in FIG5A_TABLE_RATIOS if r in res["std_ratios"]]
    head = "| N | " + " | ".join(f"std/t_c = {res['std_ratios'][i]:g}" for i in idx) + " |"
    lines = [head, "|---|" + "---:|" * len(idx)]
    for n, c in res["curves"].items():
        cells = [f"{c['ratio'][i]:.2f} ± {c['stderr'][i]:.2f}" for i in idx]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def _md_fig5b(res: dict[str, Any]) -> list[str]:
    ns = [n for n in res["n"] if n in FIG5B_TABLE_N] or res["n"]
    lines = ["| setting | inner steps | " + " | ".join(f"N = {n}" for n in ns) + " |",
             "|---|---:|" + "---:|" * len(ns)]
    for name, s in res["series"].items():
        cells = [f"{s['by_n'][str(n)]['ratio']:.3f} ± {s['by_n'][str(n)]['stderr']:.3f}"
                 for n in ns]
        lines.append(f"| {name} | {s['inner_steps']} | " + " | ".join(cells) + " |")
    return lines


def _md_sync(rows: list[dict[str, Any]], link_name: str) -> list[str]:
    lines = [
        "| model | N | compute / step (s) | GB sent / sync DiLoCo | GB sent / sync NoLoCo "
        "| sync DP ring (s) | sync DiLoCo ring (s) | sync DiLoCo tree (s) | sync NoLoCo (s) "
        "| comm share DP | comm share DiLoCo (best of ring/tree) | comm share NoLoCo "
        f"| comm share NoLoCo at H = {H_DILOCO} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in (r for r in rows if r["link"] == link_name):
        ring = {r["method"]: r for r in e["reports"]["ring"]}
        tree = {r["method"]: r for r in e["reports"]["tree"]}
        dil = min(ring["diloco"]["comm_fraction"], tree["diloco"]["comm_fraction"])
        dp = min(ring["dp"]["comm_fraction"], tree["dp"]["comm_fraction"])
        lines.append(
            f"| {e['model']} | {e['replicas']} | {_g(e['step_time_s'])} "
            f"| {_g(ring['diloco']['bytes_per_sync'] / 1e9)} "
            f"| {_g(ring['noloco']['bytes_per_sync'] / 1e9)} "
            f"| {_g(ring['dp']['sync_time_s'])} | {_g(ring['diloco']['sync_time_s'])} "
            f"| {_g(tree['diloco']['sync_time_s'])} | {_g(ring['noloco']['sync_time_s'])} "
            f"| {_pct(dp)} | {_pct(dil)} | {_pct(ring['noloco']['comm_fraction'])} "
            f"| {_pct(e['reports']['noloco_at_diloco_h'][0]['comm_fraction'])} |"
        )
    return lines


def write_markdown(result: dict[str, Any], path: pathlib.Path, figs: dict[str, str]) -> None:
    """The results page: intro, then each table preceded by its command, then figures."""
    cmd, a, b = result["command"], result["fig5a"], result["fig5b"]
    md = [
        "# Network model: NoLoCo's group exchange vs all-reduce",
        "",
        "Simulated and analytical sync costs of NoLoCo (random pairs), DiLoCo (all-reduce every "
        "100 steps) and data parallel (all-reduce every step), following the paper's §5.3 "
        "latency model and extending it with bandwidth. All numbers come from "
        "`noloco_jax/netsim/`; `network_model.json` holds every value.",
        "",
        "## (a) Fig. 5A: tree all-reduce / pairwise averaging, log-normal message times",
        "",
        f"Monte Carlo over {a['trials']} all-reduces per point (± one standard error); the "
        "pairwise cost 2·E[max(t1, t2)] uses the closed form (Eq. 7). At std = 0 the ratio is "
        "log2(N) exactly.",
        "", "```bash", cmd, "```", "", *_md_fig5a(a), "",
        f"![Fig. 5A]({figs['fig5a']})", "",
        "Eq. 7 check (closed form vs Monte Carlo, "
        f"{result['config']['eq7_samples']} samples): "
        + "; ".join(f"std/t_c = {e['std_ratio']:g}: {e['closed_form']:.4f} vs "
                    f"{e['monte_carlo']:.4f}" for e in a["eq7_check"]) + ".",
        "",
        "## (b) Fig. 5B: total training time DiLoCo / NoLoCo under global blocking",
        "",
        f"Inner-step time LogNormal(μ = 1, σ² = 0.5) i.i.d. per worker and step, communication "
        f"ignored; R = {b['outer_steps']} outer steps of the DiLoCo H (the mixed row keeps the "
        f"same total inner steps, so NoLoCo takes twice as many outer steps); mean ± standard "
        f"error over {b['trials']} runs, both methods on the same step times.",
        "", "```bash", cmd, "```", "", *_md_fig5b(b), "",
        f"![Fig. 5B]({figs['fig5b']})", "",
        "## (c) Sync time and share of wall time spent communicating",
        "",
        f"bf16 ({BYTES_PER_PARAM} bytes/param) weights, gradients and exchanges; NoLoCo H = "
        f"{H_NOLOCO} with pairs (γ = β: one tensor travels), DiLoCo H = {H_DILOCO}, data "
        f"parallel syncs every step. Compute per inner step = 6·P·(global batch tokens / N) "
        f"FLOPs at {PEAK_FLOPS / 1e12:g} TFLOP/s bf16 and {MFU:.0%} MFU (global batch "
        "0.5M / 1M / 2M tokens; P = 309.9M / 2,135.0M / 9,638.8M total parameters). "
        "Communication does not overlap compute; comm share = comm / (compute + comm) per inner "
        "step. Bytes are those one replica sends (ring count for all-reduces). Ring all-reduce: "
        "2(N−1) latency hops + 2(N−1)/N·bytes/bandwidth; tree: 2·ceil(log2 N) hops each "
        "carrying the whole buffer; NoLoCo pair: one message. The last column runs NoLoCo "
        f"at DiLoCo's H = {H_DILOCO}.",
        "",
        "Reading the tables: a NoLoCo pair exchange sends about half the bytes of a ring "
        "all-reduce and pays one latency instead of 2(N−1) (or 2·ceil(log2 N) hops of the "
        f"whole buffer for a tree), so each sync is faster. At the paper's H = {H_NOLOCO} "
        f"vs {H_DILOCO}, though, NoLoCo syncs twice as often, so its share of wall time is "
        "close to DiLoCo's wherever bandwidth dominates; it pulls ahead where latency and N "
        "are large. With the assumed tokens per replica = global batch / N, compute per step "
        "shrinks as N grows, which is why every share rises with N.",
    ]
    for name, link in LINKS.items():
        md += ["", f"### {name} link: {link.describe()}",
               "", "```bash", cmd, "```", "", *_md_sync(result["sync_table"], name)]
    md += ["", f"Wall time of this run: {result['seconds']:.0f} s.", ""]
    path.write_text("\n".join(md))


# --------------------------------------------------------------------------- main


def run(*, smoke: bool, seed: int, out_dir: pathlib.Path, fig_dir: pathlib.Path) -> dict[str, Any]:
    """Runs (a), (b), (c); writes the json, markdown and figures.

    Args:
      smoke: the tiny configuration (seconds) instead of the full one.
      seed: NumPy seed of the Monte Carlo runs.
      out_dir: where network_model.json and .md go.
      fig_dir: where the two figures go.

    Returns:
      The dict written to network_model.json.
    """
    cfg = SMOKE if smoke else FULL
    out_dir.mkdir(parents=True, exist_ok=True)
    fig_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    command = COMMAND + (" --smoke" if smoke else "") + (f" --seed={seed}" if seed else "")
    result = {"command": command, "config": cfg, "seed": seed,
              "fig5a": run_fig5a(cfg, seed), "fig5b": run_fig5b(cfg, seed),
              "sync_table": run_sync_table(cfg),
              "assumptions": {"peak_flops": PEAK_FLOPS, "mfu": MFU,
                              "bytes_per_param": BYTES_PER_PARAM, "models": MODELS,
                              "links": {k: dataclasses.asdict(v) for k, v in LINKS.items()}}}
    result["seconds"] = time.time() - start
    figs = {"fig5a": fig_dir / "network_fig5a.png", "fig5b": fig_dir / "network_fig5b.png"}
    plot_fig5a(result["fig5a"], figs["fig5a"])
    plot_fig5b(result["fig5b"], figs["fig5b"])
    (out_dir / "network_model.json").write_text(
        json.dumps({**result, "_provenance": harness.provenance_entry(cfg)}, indent=1))
    rel = {k: os.path.relpath(v, out_dir) for k, v in figs.items()}
    write_markdown(result, out_dir / "network_model.md", rel)
    print(f"wrote {out_dir / 'network_model.json'}, {out_dir / 'network_model.md'} and "
          f"{', '.join(str(v) for v in figs.values())} in {result['seconds']:.1f} s")
    return result


# --------------------------------------------------------------------------- one sync report

# sync_report's and Link.from_gbit_ms's argument names -> the flag that sets them.
_FLAG_OF_ARGUMENT = {"num_params": "params", "num_replicas": "replicas",
                     "gbit_per_s": "bandwidth_gbps", "step_time_s": "step_time"}  # fmt: skip


def sync_report_text() -> str:
    """The --params report from the flags: a line naming the setting, then the markdown table.

    Returns:
      The text to print.

    Raises:
      ValueError: naming the flag, when a value is missing or out of range.
    """
    try:
        link = netsim.Link.from_gbit_ms(_BANDWIDTH_GBPS.value, _LATENCY_MS.value)
        rows = netsim.sync_report(
            _PARAMS.value, _REPLICAS.value, link, step_time_s=_STEP_TIME.value,
            noloco_sync_every=_NOLOCO_SYNC_EVERY.value,
            diloco_sync_every=_DILOCO_SYNC_EVERY.value,
            bytes_per_param=_BYTES_PER_PARAM.value, group_size=_GROUP_SIZE.value,
            gamma_equals_beta=not _GAMMA_DIFFERS.value,
            exchange_bytes_per_param=_EXCHANGE_BYTES_PER_PARAM.value,
            allreduce=_ALLREDUCE.value,
        )
    except ValueError as err:
        argument, _, rest = str(err).partition(" ")
        raise ValueError(f"--{_FLAG_OF_ARGUMENT.get(argument, argument)} {rest}") from None
    return (f"P = {_PARAMS.value:.4g} parameters, N = {_REPLICAS.value} replicas, link "
            f"{link.describe()}, {_ALLREDUCE.value} all-reduce, {_STEP_TIME.value:g} s compute "
            f"per inner step:\n\n{netsim.report_markdown(rows)}")  # fmt: skip


def main(argv: Sequence[str]) -> None:
    """Prints one sync report (--params given) or runs the experiment."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    report_flags = [f for f in _REPORT_FLAGS if flags.FLAGS[f].present]
    experiment_flags = [f for f in ("smoke", "out_dir", "publish", "fig_dir", "seed")
                        if flags.FLAGS[f].present]  # fmt: skip
    if _PARAMS.value is not None:
        if experiment_flags:
            raise app.UsageError(f"--params prints one sync report; "
                                 f"{' '.join('--' + f for f in experiment_flags)}: for the "
                                 f"experiment only (without --params).")  # fmt: skip
        try:
            print(sync_report_text())
        except ValueError as err:
            raise app.UsageError(str(err)) from err
        return
    if report_flags:
        raise app.UsageError(f"{' '.join('--' + f for f in report_flags)} apply only to a sync "
                             f"report: give --params too (e.g. --params=125e6).")
    out_dir = options.out_dir()
    publishing = out_dir.resolve() == harness.RESULTS.resolve()
    fig_dir = (options.checked_folder("fig_dir", pathlib.Path(_FIG_DIR.value)) if _FIG_DIR.value
               else harness.FIGURES if publishing else out_dir)
    run(smoke=_SMOKE.value, seed=_SEED.value, out_dir=out_dir, fig_dir=fig_dir)


if __name__ == "__main__":
    options.run(main)
