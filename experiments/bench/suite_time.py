"""Where the default test suite's time goes: per test file, per compiled function, per process.

    python -m experiments.bench.suite_time [--smoke] [--workers 2] [--tests tests] [--distinct]

Runs ``python -m pytest -n WORKERS -q -p tests.suite_profile TESTS`` from the checkout (the
README's test command plus the recording plugin) and writes what it recorded: the suite's wall
time and the CPU time of every process it started; for each test process the seconds spent in
tests, the share of them JAX spent tracing, lowering and compiling programs in that process,
and the CPU of the child processes tests waited for (runs through the CLI, notebooks, several
processes); the test files and the JAX functions that cost most. Seconds of one run on a
shared machine vary by up to 20 %; compare two commits only run side by side.

``--distinct`` also keeps every compiled program's StableHLO and counts, per test process, how
many of them differ only in their constants (numbers): programs that could be shared if those
values were inputs instead; and which functions were compiled again with the same text (the
same program placed on other devices, or a cache that missed). It slows the run (every
program is written to disk).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from absl import flags

from experiments import options
from experiments.bench import common

WORKERS = flags.DEFINE_integer("workers", 2, "pytest-xdist workers (-n).", lower_bound=1)
TESTS = flags.DEFINE_list("tests", ["tests"], "What pytest runs: folders, files or node ids.")
DISTINCT = flags.DEFINE_bool("distinct", False, "Count the compiled programs that differ only "
                             "in their constants (keeps every program's StableHLO).")
for _name in (*options.OUT_FLAGS, "workers", "tests", "distinct"):
    flags.declare_key_flag(_name)

SMOKE_TESTS = ["tests/test_quantize.py"]
TOP = 15


def run_suite(tests: list[str], workers: int, profile_dir: pathlib.Path,
              ir_dir: pathlib.Path | None = None) -> dict:  # fmt: skip
    """Runs pytest with the plugin; its wall seconds, its process tree's CPU and summary."""
    env = {**os.environ, "SUITE_PROFILE_DIR": str(profile_dir)}
    if ir_dir:
        env["SUITE_PROFILE_IR"] = str(ir_dir)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", str(workers), "-q", "-p", "no:cacheprovider",
         "-p", "tests.suite_profile", *tests],
        cwd=common.ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"pytest failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return {"wall": wall, "user": after.ru_utime - before.ru_utime,
            "sys": after.ru_stime - before.ru_stime,
            "summary": done.stdout.strip().splitlines()[-1]}  # fmt: skip


def summarize(profile_dir: pathlib.Path) -> dict:
    """Per test process, per test file and per JAX function totals of the plugin's records."""
    workers: dict[str, collections.Counter] = {}
    files = collections.defaultdict(collections.Counter)
    funs = collections.defaultdict(collections.Counter)
    for path in sorted(profile_dir.glob("*.json")):
        record = json.loads(path.read_text())
        w = workers[path.stem] = collections.Counter()
        for t in record["tests"]:
            f = files[t["id"].split("::", 1)[0]]
            for key in ("wall", "cpu", "children"):
                w[key] += t[key]
                f[key] += t[key]
            w["tests"] += 1
        for key, value in record["compile"].items():
            file, fun, kind = key.rsplit("|", 2)
            fun = fun[4:-1] if fun.startswith("jit(") and fun.endswith(")") else fun
            files[file][kind] += value
            funs[fun][kind] += value
            w[kind] += value
    return {"workers": workers, "files": files, "funs": funs}


_NAME = re.compile(r"^module @\S+", re.M)  # jit(f)'s module is named after f
_LOCATION = re.compile(r"loc\([^)]*\)|^#loc\d*\s*=.*$", re.M)
_CONSTANT = re.compile(r"dense<[^>]*>|(?<![\w%#])-?\d+(\.\d+)?(e[-+]?\d+)?(?!\w)")


def distinct_programs(ir_dir: pathlib.Path) -> dict[str, dict[str, int]]:
    """Per test process: the programs it compiled, how many differ in their text (the module's
    name and source locations aside), and how many with every number replaced by one symbol."""
    counts = {}
    for folder in sorted(p for p in ir_dir.iterdir() if p.is_dir()):
        texts, shapes, again = set(), set(), collections.Counter()
        files = sorted(folder.glob("*_compile.mlir"))
        for path in files:
            text = _LOCATION.sub("", _NAME.sub("module", path.read_text()))
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest in texts:  # jax_ir0012_jit_<function>_compile.mlir
                again[path.name.split("_", 3)[3].removesuffix("_compile.mlir")] += 1
            texts.add(digest)
            shapes.add(hashlib.sha256(_CONSTANT.sub("C", text).encode()).hexdigest())
        counts[folder.name] = {"programs": len(files), "distinct": len(texts),
                               "distinct_but_constants": len(shapes),
                               "compiled_again": dict(again.most_common())}  # fmt: skip
    return counts


def _jax_seconds(c: collections.Counter) -> float:
    return c["trace"] + c["lower"] + c["xla"]


def markdown(suite: dict, s: dict, cmd: str, commit: str) -> str:
    """The page: the suite, each test process, the costliest files and functions."""
    cpu = suite["user"] + suite["sys"]
    head = (f"### Where the test suite's time goes\n\n`{cmd}` (commit {commit}): "
            f"{suite['summary']}. Wall "
            f"{suite['wall']:.1f} s; CPU of every process it started {cpu:.1f} s "
            f"({suite['user']:.1f} user, {suite['sys']:.1f} system), "
            f"{cpu / suite['wall']:.2f} cores busy on average. 'JAX' is tracing, lowering and "
            "XLA compiling in the test process itself; 'children' the CPU of processes a test "
            "started and waited for.\n\n")  # fmt: skip
    rows = [[w, c["tests"], f"{c['wall']:.1f}", f"{c['cpu']:.1f}", f"{_jax_seconds(c):.1f}",
             f"{c['trace']:.1f} / {c['lower']:.1f} / {c['xla']:.1f}", int(c["xla_n"]),
             f"{c['children']:.1f}"] for w, c in s["workers"].items()]  # fmt: skip
    out = head + common.md_table(["process", "tests", "test wall s", "own CPU s", "JAX s",
                                  "trace / lower / XLA s", "programs", "children CPU s"], rows)
    files = sorted(s["files"].items(), key=lambda kv: -kv[1]["wall"])[:TOP]
    rows = [[f, f"{c['wall']:.1f}", f"{c['cpu']:.1f}", f"{_jax_seconds(c):.1f}",
             int(c["xla_n"]), f"{c['children']:.1f}"] for f, c in files]  # fmt: skip
    out += f"\n\nThe {TOP} test files with the most wall time:\n\n" + common.md_table(
        ["file", "wall s", "own CPU s", "JAX s", "programs", "children CPU s"], rows)
    funs = sorted(s["funs"].items(), key=lambda kv: -_jax_seconds(kv[1]))[:TOP]
    rows = [[f"`{f}`", f"{_jax_seconds(c):.1f}", f"{c['trace']:.1f}", f"{c['lower']:.1f}",
             f"{c['xla']:.1f}", int(c["xla_n"])] for f, c in funs]  # fmt: skip
    out += (f"\n\nThe {TOP} jitted functions (eager operations count as their own) that "
            "cost most to trace, lower and compile:\n\n") + common.md_table(
        ["function", "JAX s", "trace s", "lower s", "XLA s", "programs"], rows)
    if "distinct" in s:
        rows = [[w, c["programs"], c["distinct"], c["distinct_but_constants"],
                 ", ".join(f"{k} {v}" for k, v in list(c["compiled_again"].items())[:6])]
                for w, c in s["distinct"].items()]  # fmt: skip
        out += ("\n\nCompiled programs (StableHLO as compiled, `--distinct`): all, the "
                "distinct ones, and the distinct ones once every number is replaced by one "
                "symbol (what passing those values as inputs could share); the functions "
                "most often compiled again with the same text in the same process.\n\n"
                ) + common.md_table(["process", "programs", "distinct",
                                     "distinct but for constants", "compiled again"], rows)
    return out + "\n"


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    options.smoke_sets("tests")
    tests = SMOKE_TESTS if options.SMOKE.value else TESTS.value
    with tempfile.TemporaryDirectory() as tmp:
        ir_dir = pathlib.Path(tmp, "ir") if DISTINCT.value else None
        suite = run_suite(tests, WORKERS.value, pathlib.Path(tmp), ir_dir)
        s = summarize(pathlib.Path(tmp))
        if ir_dir:
            s["distinct"] = distinct_programs(ir_dir)
    cmd = options.command("experiments.bench.suite_time")
    env = common.environment()
    results = {"env": env, "suite": suite,
               **{k: {name: dict(c) for name, c in v.items()} for k, v in s.items()}}
    common.write("bench_suite_time", results, markdown(suite, s, cmd, env["commit"]),
                 options.out_dir())  # fmt: skip


if __name__ == "__main__":
    options.run(main)
