"""Test setup: 8 simulated CPU devices and quick compiles, configured before JAX initialises."""

import os

DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
# Most of the suite's time is XLA:CPU compiling small programs. With LLVM's optimizations off,
# XLA:CPU's older (non-MLIR) fusion emitters and the LLVM module compiled in one part, a tiny
# run compiles in about a fifth of the time and its numbers move in the last bits only
# (experiments/bench/opt_level.py measures this). The golden test checks both these flags'
# numbers and XLA's defaults', each in a subprocess, bit for bit. XLA_FLAGS that already name
# one of these flags keep theirs.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                      "--xla_cpu_parallel_codegen_split_count=1")  # fmt: skip
for _flag in (DEVICES_FLAG, *FAST_COMPILE_FLAGS):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A small local corpus the project makes itself: Python's bundled help topics."""
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A TFDS data dir and cache of one test module's own."""
    return tmp_path_factory.mktemp("data")


def _write_corpus(d):
    from pydoc_data.topics import topics  # noqa: PLC0415

    for i, (name, text) in enumerate(sorted(topics.items())[:40]):
        (d / f"{i:02d}_{name}.txt").write_text(text, encoding="utf-8")
    return d


# ---------------------------------------------------------------- one run for several files

# The test files that read the session's NoLoCo run (``noloco_run``). Under pytest-xdist they
# go to one worker together, so that the run trains once (see ``pytest_xdist_make_scheduler``).
NOLOCO_RUN_FILES = ("test_train.py", "test_train_faults.py", "test_reliability.py")


@pytest.fixture(scope="session")
def noloco_run(tmp_path_factory):
    """(settings, workdir, last metrics) of a finished 12-step NoLoCo run on its own corpus.

    ``tiny_settings`` with ``sync_every=6``: 4 replicas, evaluations and checkpoints every 4
    steps (those of steps 8 and 12 kept). Trained once per test process and only read: a test
    that resumes or damages it works on a copy (``helpers.copy_run``).
    """
    from noloco_jax.trainer.loop import train_and_evaluate  # noqa: PLC0415
    from tests.test_train import tiny_settings  # noqa: PLC0415

    base = tmp_path_factory.mktemp("noloco_run")
    corpus = base / "corpus"
    corpus.mkdir()
    s = tiny_settings(_write_corpus(corpus), base / "data", outer={"sync_every": 6})
    last = train_and_evaluate(s, base / "run", progress=False)
    return s, base / "run", last


# ---------------------------------------------------------------- Python's garbage collector

# Tracing and compiling allocate millions of short-lived objects, so Python's cyclic collector
# ran thousands of times per worker, each older-generation pass over a heap of JAX's caches.
# After collection, what is alive (the imported modules, the test functions) is frozen out of
# those passes, and a pass runs as rarely as in ``noloco-train``. Reference counting frees what
# it did, and cycles are still collected.
def pytest_collection_finish(session):
    import gc  # noqa: PLC0415

    from noloco_jax.train import GC_THRESHOLD  # noqa: PLC0415

    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


# ---------------------------------------------------------------- pytest-xdist (CI: -n 2)

# Test files in the order they are handed to the workers: the longest first, so that the
# workers finish together; the rest follow in their usual order. The files of NOLOCO_RUN_FILES
# count as one. Seconds per file with -n 2 on 2 idle cores at 8cb03db (a timeline of one run):
# 164, 64, 60, 57, 41, 35, 32, 32, 26, 23, 22, 22, 19, 19, 18, 17, 12, 12, 11, 11, 10, 9; the
# rest under 8 each. (test_sharded_memory.py, missing here, was last on a worker: 17 s idle.)
LONGEST_FIRST = ("test_train.py", "test_sharded_replicas.py", "test_multihost.py",
                 "test_experiments.py", "test_golden.py", "test_colabs.py", "test_benchmarks.py",
                 "test_sharded_memory.py", "test_pipeline.py", "test_resize.py",
                 "test_phased_steps.py", "test_accumulation.py", "test_comm.py",
                 "test_exchange8.py", "test_optax_clients.py", "test_models.py", "test_hdee.py",
                 "test_harness_overrides.py", "test_skipping.py", "test_data.py", "test_cli.py",
                 "test_overlap.py")  # fmt: skip


def _unit(nodeid: str) -> str:
    """The scheduling unit of a test: its file, or one name for the files of NOLOCO_RUN_FILES."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return NOLOCO_RUN_FILES[0] if name in NOLOCO_RUN_FILES else name


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))  # stable


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N`` (``--dist load``, xdist's default), each unit of ``_unit`` goes whole to
    one worker (its module- and session-scoped runs train once), in the order above."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # keep the order of pytest_collection_modifyitems
    return ByUnit(config, log)
