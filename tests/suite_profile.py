"""A pytest plugin that records where the test suite's time goes (not a test file).

    python -m pytest -n 2 -q -p tests.suite_profile     # with SUITE_PROFILE_DIR=<folder>

Each test process writes ``<worker>.json`` into ``$SUITE_PROFILE_DIR``: per test, its wall
seconds, the CPU seconds of its own process and of the child processes it waited for; per test
file and JAX function, the seconds JAX spent tracing, lowering and compiling (XLA) and how many
programs it compiled. With ``$SUITE_PROFILE_IR`` set too, JAX writes every program it
compiles as StableHLO into ``$SUITE_PROFILE_IR/<worker>/``. ``experiments/bench/suite_time.py``
runs the suite with it and writes the tables.
"""

import collections
import json
import os
import pathlib
import time

import pytest

_file = ["<collection>"]
_tests: list[dict] = []
_compile: collections.Counter = collections.Counter()  # "file|fun|event" -> seconds or count
_EVENTS = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
           "backend_compile_duration": "xla"}  # fmt: skip


def _on_event(event: str, seconds: float, **kwargs) -> None:
    kind = _EVENTS.get(event.rsplit("/", 1)[-1])
    if kind and event.startswith("/jax/core/compile/"):
        key = f"{_file[0]}|{kwargs.get('fun_name', '?')}"
        _compile[f"{key}|{kind}"] += seconds
        _compile[f"{key}|{kind}_n"] += 1


def pytest_configure(config):
    if os.environ.get("SUITE_PROFILE_DIR"):
        import jax  # noqa: PLC0415

        jax.monitoring.register_event_duration_secs_listener(_on_event)
        if os.environ.get("SUITE_PROFILE_IR"):
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            jax.config.update("jax_dump_ir_to", f"{os.environ['SUITE_PROFILE_IR']}/{worker}")
            jax.config.update("jax_include_debug_info_in_dumps", False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _file[0] = item.nodeid.split("::", 1)[0]
    wall, cpu = time.perf_counter(), os.times()
    yield
    now = os.times()
    _tests.append({
        "id": item.nodeid,
        "wall": time.perf_counter() - wall,
        "cpu": now.user + now.system - cpu.user - cpu.system,
        "children": max(0.0, now.children_user + now.children_system
                        - cpu.children_user - cpu.children_system),
    })  # fmt: skip
    _file[0] = "<between tests>"


def pytest_sessionfinish(session):
    out = os.environ.get("SUITE_PROFILE_DIR")
    if out and _tests:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        pathlib.Path(out, f"{worker}.json").write_text(
            json.dumps({"tests": _tests, "compile": dict(_compile)}))
