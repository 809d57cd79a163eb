"""Bytes per device of the paper's models on split replicas, from compiled programs alone.

    python -m experiments.bench.sharded_memory [--smoke] [--sizes small,medium,large]

For each paper size, the trainer's own sync program (``noloco_jax.trainer.aot``: its
topology, Adam inside NoLoCo, the paper's settings from configs/paper.py) is compiled with
abstract inputs on simulated CPU devices; nothing is allocated. Two tables:

1. State: params, Adam moments and NoLoCo's outer state (slow weights, momentum) per device
   for one replica whole on one device and split over F x T = 2, 4, 8 devices (8 simulated
   devices; one replica, as the bytes per device do not depend on N).
2. Fit: the program's whole footprint per device (inputs + scratch + outputs not written in
   place) at the paper's batch per replica and 1024 tokens, with and without recomputing
   activations (``--config.model.remat``), for F = 1, 2, 4, ... until it fits a 16 GiB
   TPU v5e chip; the smallest F for an 80 GiB H100 and for the v5e. ``--devices`` simulated
   CPU devices (the splits above 8 need more than the tests' 8).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Sequence

import jax
from absl import flags

from experiments import options
from experiments.bench import common, memory_flags
from experiments.bench.memory_flags import SIZES, USABLE

DEVICES = flags.DEFINE_integer("devices", 256, "Simulated CPU devices (the largest split).",
                               lower_bound=1)
for _name in (*options.OUT_FLAGS, *memory_flags.KEY_FLAGS):
    flags.declare_key_flag(_name)

VOCAB, BATCH, CHIPS = common.PAPER_VOCAB, common.PAPER_BATCH, common.CHIPS
STATE_SPLITS = ((1, 1), (2, 1), (4, 1), (8, 1), (4, 2))
_GB = 1e9


@dataclasses.dataclass(frozen=True)
class Case:
    size: str
    batch: int
    seq_len: int
    fsdp: int
    tensor: int = 1
    remat: bool = False


def measure(case: Case, vocab: int) -> dict:
    """The compiled sync program's ``StepMemory`` for one case, and its compile seconds."""
    from noloco_jax.trainer import aot  # noqa: PLC0415

    t0 = time.perf_counter()
    settings = common.paper_settings(case.size, batch_per_replica=case.batch,
                                      seq_len=case.seq_len, fsdp=case.fsdp, tensor=case.tensor,
                                      remat=case.remat)  # fmt: skip
    m = aot.step_memory(settings, vocab, program="sync")
    return {**dataclasses.asdict(case), **m._asdict(), "state": m.state, "peak": m.peak,
            "compile_s": time.perf_counter() - t0}  # fmt: skip


def _state_rows(sizes: list[str], vocab: int, seq_len: int, splits: tuple) -> list[dict]:
    out = []
    for size in sizes:
        for fsdp, tensor in splits:
            out.append(measure(Case(size, 1, seq_len, fsdp, tensor), vocab))
            print(_brief(out[-1]), flush=True)
    return out


def _splits(batch: int, max_split: int) -> list[tuple[int, int]]:
    """F = 1, 2, 4, ... up to the batch (each device needs a sequence), then tensor 2."""
    out = [(1 << k, 1) for k in range(batch.bit_length()) if 1 << k <= min(batch, max_split)]
    return out + ([(out[-1][0], 2)] if 2 * out[-1][0] <= max_split else [])


def _fit_rows(sizes: list[str], vocab: int, seq_len: int, max_split: int) -> list[dict]:
    """Larger splits per size and remat until the v5e fits (or the devices run out)."""
    out = []
    small_chip = min(CHIPS.values()) * USABLE.value
    for size in sizes:
        for remat in (False, True):
            for fsdp, tensor in _splits(BATCH[size], max_split):
                row = measure(Case(size, BATCH[size], seq_len, fsdp, tensor, remat), vocab)
                out.append(row)
                print(_brief(row), flush=True)
                if row["peak"] <= small_chip:
                    break
    return out


def _brief(row: dict) -> str:
    return (f"{row['size']} B={row['batch']} F={row['fsdp']} T={row['tensor']} "
            f"remat={row['remat']}: state {row['state'] / _GB:.3f} GB, temp "
            f"{row['temp'] / _GB:.2f} GB, peak {row['peak'] / _GB:.2f} GB "
            f"({row['compile_s']:.0f} s)")  # fmt: skip


def _state_table(rows: list[dict]) -> list[list]:
    whole = {r["size"]: r for r in rows if r["fsdp"] * r["tensor"] == 1}
    table = []
    for r in rows:
        split = r["fsdp"] * r["tensor"]
        table.append([r["size"], f"{r['fsdp']} x {r['tensor']}", f"{r['params'] / _GB:.3f}",
                      f"{r['optimizer'] / _GB:.3f}", f"{r['outer'] / _GB:.3f}",
                      f"{r['state'] / _GB:.3f}",
                      f"{r['state'] * split / whole[r['size']]['state']:.4f}"])  # fmt: skip
    return table


def _smallest(rows: list[dict]) -> list[list]:
    table = []
    for size in dict.fromkeys(r["size"] for r in rows):
        for remat in (False, True):
            mine = [r for r in rows if r["size"] == size and r["remat"] == remat]
            cells = []
            for cap in CHIPS.values():
                ok = [r["fsdp"] * r["tensor"] for r in mine if r["peak"] <= cap * USABLE.value]
                tried = max(r["fsdp"] * r["tensor"] for r in mine)
                cells.append(str(min(ok)) if ok else f"> {tried}")
            table.append([size, BATCH[size], "on" if remat else "off", *cells])
    return table


def _markdown(cmd: str, state: list[dict], fits: list[dict], commit: str, vocab: int,
              seq_len: int) -> str:  # fmt: skip
    fit_rows = [[r["size"], r["batch"], "on" if r["remat"] else "off",
                 f"{r['fsdp']} x {r['tensor']}",
                 f"{r['state'] / _GB:.2f}", f"{r['temp'] / _GB:.2f}", f"{r['peak'] / _GB:.2f}"]
                for r in fits]  # fmt: skip
    return (
        f"### Bytes per device on split replicas, from compiled programs (issue 19)\n\n`{cmd}` "
        f"(commit {commit}): the trainer's NoLoCo sync program compiled with abstract inputs "
        "on simulated CPU devices (`noloco_jax.trainer.aot.step_memory`; nothing allocated); "
        "paper settings (configs/paper.py: float32 params, bfloat16 compute, Adam, "
        f"vocabulary {vocab:,}). GB = 10^9 bytes.\n\n"
        "State per device (one replica split over F x T <= 8 devices; batch 1): params, Adam "
        "moments, NoLoCo's "
        "slow weights and momentum. 'x split' is the state times F x T over the whole "
        "replica's: 1.0 is an exact 1 / (F x T).\n\n"
        + common.md_table(["model", "F x T", "params GB", "Adam GB", "outer GB", "state GB",
                           "x split"], _state_table(state))
        + "\nFootprint per device at the paper's batch per replica (sequences of "
        f"{seq_len} tokens, the whole batch in one pass as the trainer runs it), F = 1, 2, 4, "
        "... up to the batch (each device runs at least one sequence), then tensor 2: "
        "inputs + scratch "
        "(activations kept for the backward pass, gradients, gathered weights) + outputs not "
        "written in place, as XLA:CPU plans it.\n\n"
        + common.md_table(["model", "batch", "remat", "F x T", "state GB", "scratch GB",
                           "footprint GB"], fit_rows)
        + f"\nSmallest F x T that fits, using {USABLE.value:.0%} of the chip:\n\n"
        + common.md_table(["model", "batch", "remat", *CHIPS], _smallest(fits)))


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    options.smoke_sets("devices", "sizes")
    smoke = options.SMOKE.value
    devices = 8 if smoke else DEVICES.value
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", devices)
    sizes = ["nano"] if smoke else SIZES.value
    vocab, seq_len = (256, 64) if smoke else (VOCAB, 1024)
    max_split = min(jax.device_count(), 4 if smoke else jax.device_count())
    state = _state_rows(sizes, vocab, seq_len, ((1, 1), (2, 2)) if smoke else STATE_SPLITS)
    fits = _fit_rows(sizes, vocab, seq_len, max_split)
    cmd = options.command("experiments.bench.sharded_memory")
    env = common.environment()
    results = {"env": env, "commit": env["commit"], "state": state,
               "fit": fits, "usable": USABLE.value, "chips": CHIPS}  # fmt: skip
    common.write("bench_sharded_memory", results,
                 _markdown(cmd, state, fits, results["commit"], vocab, seq_len),
                 options.out_dir())  # fmt: skip


if __name__ == "__main__":
    options.run(main)
