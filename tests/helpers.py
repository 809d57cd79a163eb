"""Small shared test utilities."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import optax

from noloco_jax import replicas


def assert_trees_close(a: Any, b: Any, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Same structure, and every leaf close."""
    assert jax.tree.structure(a) == jax.tree.structure(b), (
        jax.tree.structure(a),
        jax.tree.structure(b),
    )
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def random_tree(key: jax.Array, num_replicas: int | None = None) -> dict:
    """A small two-leaf pytree (optionally stacked over replicas)."""
    lead = () if num_replicas is None else (num_replicas,)
    k1, k2 = jax.random.split(key)
    return {
        "w": jax.random.normal(k1, lead + (3, 2)),
        "b": jax.random.normal(k2, lead + (5,)),
    }


def step_fn(tx: optax.GradientTransformation):
    """One optimizer step for one replica: (params, state, grads) -> (params, state)."""

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def run_steps(tx, params0, grads_seq, num_replicas, backend="vmap"):
    """Runs ``tx`` over replicas from identical ``params0``; returns final params and state."""
    reps = replicas.make_replicas(num_replicas, backend=backend)
    params = reps.put(replicas.replicate(params0, num_replicas))
    state = reps.put(replicas.replicate(tx.init(params0), num_replicas))
    step = jax.jit(reps.map(step_fn(tx)))
    history = []
    for grads in grads_seq:
        params, state = step(params, state, reps.put(grads))
        history.append(params)
    return params, state, history, step


def prepare_corpus(corpus_dir: pathlib.Path, data_dir: pathlib.Path) -> None:
    """Stores ``corpus_dir``'s files in ``data_dir`` as a run of seed 0 with the default
    validation split reads them, here: child processes given these dirs then read the stored
    files and never import TensorFlow (which writing them needs: ~3.5 s of CPU per child)."""
    from noloco_jax.data import sources  # noqa: PLC0415

    sources.load_corpus("files", path=str(corpus_dir), data_dir=data_dir)


def copy_run(workdir: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """A copy of a run's workdir (without its lock file) at ``dst``, to resume or damage."""
    shutil.copytree(workdir, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


def logged_records(workdir: pathlib.Path, kind: str | None = None) -> list[dict]:
    """Every record (or every ``kind`` record) of a run's metrics.jsonl in the order logged, a
    replayed step's record and its replay both (``read_jsonl`` keeps only the session that
    superseded it)."""
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(str.strip, lines)) if kind in (None, r["kind"])]


def variant(settings: Any, **overrides: Any) -> Any:
    """``settings`` (a ``TrainSettings``) with some fields changed (sections merged)."""
    from noloco_jax.trainer import settings as settings_lib  # noqa: PLC0415

    base = settings.to_dict()
    for key, value in overrides.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) else value
    return settings_lib.from_config(base)


def tensorboard_view(folder: pathlib.Path) -> list[tuple[str, int]]:
    """(tag, step) of each scalar TensorBoard shows: event files in order, each session's
    start with a step purging the earlier sessions' events at that step and after."""
    from tensorboardX.proto import event_pb2  # noqa: PLC0415

    shown: list[tuple[str, int]] = []
    for path in sorted(folder.glob("events.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):  # TFRecord: length (8 bytes), crc (4), payload, crc (4)
            size = int.from_bytes(data[at:at + 8], "little")
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + size])
            at += 16 + size
            if event.HasField("session_log") and event.session_log.status == 1:  # START
                shown = [(tag, step) for tag, step in shown if step < event.step]
            shown += [(v.tag, event.step) for v in event.summary.value]
    return shown


# One process imports JAX and the package once, then forks a child per case that runs the
# script as ``python -m`` would (runpy), so each case costs its script's own imports only.
FORKED = """
import json, os, runpy, sys, tempfile
import jax, matplotlib, numpy, absl.app, noloco_jax.trainer, noloco_jax.experiments.harness
results = []
for script, args in json.loads(sys.argv[1]):
    err, out = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
    pid = os.fork()
    if pid == 0:
        os.dup2(err.fileno(), 2)
        os.dup2(out.fileno(), 1)
        sys.argv = [script, *args[1:]] if script == "-c" else [script, *args]
        code = 0
        try:
            if script == "-c":  # ("-c", [code, *args]): python -c code *args
                exec(compile(args[0], "<string>", "exec"), {"__name__": "__main__"})
            else:
                runpy.run_module(script, run_name="__main__", alter_sys=True)
        except SystemExit as done:
            code = 0 if done.code is None else done.code if isinstance(done.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    err.seek(0)
    out.seek(0)
    results.append([os.waitstatus_to_exitcode(status), err.read(), out.read()])
print(json.dumps(results))
"""


def run_forked(cases: list[tuple[str, list[str]]], cwd: pathlib.Path, timeout: float
               ) -> list[list]:  # fmt: skip
    """[exit status, stderr, stdout] of each ``python -m script *args`` of ``cases`` (or
    ``python -c code *args`` for a case ``("-c", [code, *args])``), run one after another in
    children forked from one process that imported JAX once (``FORKED``)."""
    proc = subprocess.run([sys.executable, "-c", FORKED, json.dumps([list(c) for c in cases])],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

