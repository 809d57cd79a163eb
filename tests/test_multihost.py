"""Two processes x 4 CPU devices on loopback train exactly like one process x 8 devices.

Two topologies: 8 replicas of one device each, and 2 replicas of 4 devices each (fsdp 4,
one replica per process, so only NoLoCo's exchange crosses the processes). A replica split
over devices sums partial results with all-reduces inside the replica. JAX's CPU runtime
runs those with its in-process collectives in a plain one-process run and with Gloo once
``jax.distributed`` is up, and the two add in different orders (seen: 44 of 128 float32
sums of 4 device partials differ by 1-2 ulp). So the fsdp reference is one process x 8
devices that joins the multi-process runtime alone (``--num_processes=1``: Gloo as well);
then every logged loss, every evaluation and every array of the checkpoint agree bit for bit.
"""

import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
from pydoc_data.topics import topics

from tests.conftest import FAST_COMPILE_FLAGS
from tests.helpers import logged_records, prepare_corpus

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(corpus, data_dir, workdir, *extra):
    return [
        sys.executable, "-m", "noloco_jax.train",
        f"--config={ROOT / 'configs' / 'tiny_noloco.py'}", f"--workdir={workdir}", "--noprogress",
        "--config.model.preset=nano", "--config.backend=shard_map",
        "--config.global_batch_size=16", "--config.log_every=2",
        "--config.eval_every=4", "--config.checkpoint_every=4", "--config.optim.warmup_steps=1",
        "--config.data.source=files", f"--config.data.path={corpus}",
        f"--config.data.data_dir={data_dir}", "--config.data.seq_len=32",
        "--config.data.eval_windows=8", "--config.outer.sync_every=2", *extra,
    ]  # fmt: skip


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(XLA_FLAGS=" ".join((f"--xla_force_host_platform_device_count={devices}",
                                   *FAST_COMPILE_FLAGS)),
               TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")  # fmt: skip
    return env


def _wait_all(procs: list, timeout: float) -> None:
    """Waits for every process; once one fails or time is up, stops the rest at once.

    A process whose peer died would otherwise wait out jax.distributed's start-up timeout
    (minutes) and the test would report that instead of the peer's error.
    """
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()


def _distributed(num_processes: int, process_id: int, port: int) -> list[str]:
    return [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}",
            f"--process_id={process_id}"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus_and_data(tmp_path_factory):
    """One corpus and one tokenized data dir for every run of this file."""
    base = tmp_path_factory.mktemp("multihost")
    corpus = base / "corpus"
    corpus.mkdir()
    for i, (_, text) in enumerate(sorted(topics.items())[:40]):
        (corpus / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    prepare_corpus(corpus, base / "data")
    return corpus, base / "data"


# (topology flags, steps, whether the one-process reference joins the multi-process runtime)
TOPOLOGIES = {
    "replica8": (["--config.num_replicas=8"], 8, False),
    "replica2_fsdp4": (["--config.num_replicas=2", "--config.mesh.fsdp=4"], 4, True),
    "replica4_stage2": (["--config.num_replicas=4", "--config.num_stages=2",
                         "--config.backend=shard_map"], 4, False),
}


SLOW_TOPOLOGIES = ("replica4_stage2",)  # the evaluator gathers stage-split weights (30 s)


@pytest.mark.parametrize("topology", [
    *(t for t in sorted(TOPOLOGIES) if t not in SLOW_TOPOLOGIES),
    *(pytest.param(t, marks=pytest.mark.slow) for t in SLOW_TOPOLOGIES)])  # fmt: skip
@pytest.mark.multiprocess
def test_two_processes_match_one_process(tmp_path, corpus_and_data, topology):
    from noloco_jax.trainer.checkpoint import Checkpointer  # noqa: PLC0415

    flags, steps, gloo = TOPOLOGIES[topology]
    flags = [*flags, f"--config.num_steps={steps}"]
    # The one-process reference runs beside the pair (they wait on each other much of the time).
    one_log = tmp_path / "one.log"
    with one_log.open("w") as out:
        one = subprocess.Popen(
            _cmd(*corpus_and_data, tmp_path / "one", *flags,
                 *(_distributed(1, 0, _free_port()) if gloo else ())),
            env=_env(8), stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    port = _free_port()
    logs = [tmp_path / f"process_{i}.log" for i in range(2)]
    with logs[0].open("w") as out0, logs[1].open("w") as out1:
        procs = [
            subprocess.Popen(_cmd(*corpus_and_data, tmp_path / "two", *flags,
                                  *_distributed(2, i, port)),
                             env=_env(4), stdout=out, stderr=subprocess.STDOUT)
            for i, out in enumerate((out0, out1))
        ]  # fmt: skip
        _wait_all(procs, timeout=600)
    one.wait(timeout=600)
    assert one.returncode == 0, one_log.read_text()[-3000:]
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} (port {port}):\n{log.read_text()[-3000:]}"
    a, b = logged_records(tmp_path / "one"), logged_records(tmp_path / "two")
    train = lambda recs: [r["train_loss"] for r in recs if r["kind"] == "train"]  # noqa: E731
    evals = lambda recs: [r["val_ppl"] for r in recs if r["kind"] == "eval"]  # noqa: E731
    assert len(train(a)) == steps // 2 and train(a) == train(b)  # a NoLoCo round each, equal
    assert len(evals(a)) == steps // 4 + 1 and evals(a) == evals(b)  # steps 0, 4, ...
    state = tmp_path / "two" / "checkpoints" / str(steps) / "state"
    assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()
    sums = [Checkpointer(w / "checkpoints").read_meta(steps)["checksums"]
            for w in (tmp_path / "one", tmp_path / "two")]  # fmt: skip
    assert sums[0] == sums[1]  # params, slow weights, Adam moments, momentum: bit for bit


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_part_one_process_cannot_read_stops_both_at_once(tmp_path, corpus_and_data):
    """A damaged shard fails only the process reading it; the other went on into a collective
    and both hung (the second until jax.distributed's 300 s shutdown timeout)."""
    def two(steps):
        port, flags = _free_port(), ["--config.num_replicas=8", f"--config.num_steps={steps}"]
        logs = [tmp_path / f"p{i}_{steps}_{len(list(tmp_path.glob('p*')))}.log" for i in range(2)]
        procs = [subprocess.Popen(_cmd(*corpus_and_data, tmp_path / "two", *flags,
                                       *_distributed(2, i, port)),
                                  env=_env(4), stdout=log.open("w"), stderr=subprocess.STDOUT)
                 for i, log in enumerate(logs)]  # fmt: skip
        start = time.monotonic()
        for p in procs:
            p.wait(timeout=300)
        return [p.returncode for p in procs], time.monotonic() - start, logs

    codes, _, _ = two(8)
    assert codes == [0, 0]
    for f in (tmp_path / "two" / "checkpoints" / "8" / "state" / "ocdbt.process_1").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[:16])
    codes, seconds, logs = two(8)
    assert codes == [1, 1] and seconds < 60, (codes, seconds)
    for log in logs:
        assert "checkpoint 8 could not be read in this run of several processes" in log.read_text()
    assert (tmp_path / "two" / "checkpoints" / "8").is_dir()  # nothing moved


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_signal_one_process_gets_stops_both_at_the_same_saved_step(tmp_path, corpus_and_data):
    """Preemption notices reach hosts at different moments, or one host only. Each process
    decided from its own signal: the one signalled entered the collective save while the
    other trained on, and the run crashed or hung with no checkpoint."""
    import signal  # noqa: PLC0415

    port, flags = _free_port(), ["--config.num_replicas=4", "--config.num_steps=400",
                                 "--config.eval_every=1000", "--config.checkpoint_every=1000"]
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [subprocess.Popen(_cmd(*corpus_and_data, tmp_path / "run", *flags,
                                   *_distributed(2, i, port)),
                              env=_env(2), stdout=log.open("w"), stderr=subprocess.STDOUT)
             for i, log in enumerate(logs)]  # fmt: skip
    deadline = time.monotonic() + 300
    metrics = tmp_path / "run" / "metrics.jsonl"
    while not (metrics.exists() and '"train"' in metrics.read_text()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
            logs[0].read_text()[-3000:])
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)  # process 0 gets none
    _wait_all(procs, timeout=150)
    texts = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(t[-2000:] for t in texts)
    from noloco_jax.trainer.checkpoint import Checkpointer  # noqa: PLC0415

    saved = Checkpointer(tmp_path / "run" / "checkpoints").latest_step()
    assert saved is not None and 0 < saved < 400
    assert f"SIGTERM: stopped at step {saved} after saving its checkpoint" in texts[0]


# Process 0's first metrics record raises a plain RuntimeError: a bug, not an environment
# failure (a metrics.jsonl that is a folder, the stand-in before, is now a short run failure).
_BUG_AT_FIRST_RECORD = """
from noloco_jax.trainer import writers

def write(self, *args, **kwargs):
    raise RuntimeError("a bug at the first metrics record")

writers.MetricWriter.write = write
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_bug_on_one_process_exits_it_at_once_with_its_traceback(tmp_path, corpus_and_data):
    """An unexpected exception on process 0 (the writer) took the normal exit through
    jax.distributed's shutdown barrier, which waited 300 s for the peer stuck in a collective."""
    (tmp_path / "bug").mkdir()
    (tmp_path / "bug" / "sitecustomize.py").write_text(_BUG_AT_FIRST_RECORD)
    port, flags = _free_port(), ["--config.num_replicas=4", "--config.num_steps=200"]
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    envs = [{**_env(2), "PYTHONPATH": os.pathsep.join([str(tmp_path / "bug"), str(ROOT)])},
            _env(2)]  # fmt: skip
    procs = [subprocess.Popen(_cmd(*corpus_and_data, tmp_path / "run", *flags,
                                   *_distributed(2, i, port)),
                              env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
             for i, (log, env) in enumerate(zip(logs, envs))]  # fmt: skip
    start = time.monotonic()
    while procs[0].poll() is None and time.monotonic() - start < 120:
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    text = logs[0].read_text()
    assert procs[0].returncode == 1, text[-3000:]
    assert "Traceback" in text and "RuntimeError: a bug at the first metrics record" in text


@pytest.mark.multiprocess
def test_processes_with_unequal_device_counts_are_refused_clearly(tmp_path, corpus_and_data):
    """3 + 1 devices: JAX's multi-process gathers and orbax's barriers need the same number of
    devices on every process; both processes died in orbax's first barrier with "cannot reshape
    array of size 4 into shape (2,3)", reported as a user error."""
    port, flags = _free_port(), ["--config.num_replicas=4", "--config.num_steps=2"]
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [subprocess.Popen(_cmd(*corpus_and_data, tmp_path / "run", *flags,
                                   *_distributed(2, i, port)),
                              env=_env(devices), stdout=log.open("w"), stderr=subprocess.STDOUT)
             for i, (log, devices) in enumerate(zip(logs, (3, 1)))]  # fmt: skip
    _wait_all(procs, timeout=120)
    text = logs[0].read_text()
    assert procs[0].returncode == 2, text[-3000:]
    assert "hold different numbers of devices (process 0: 3, process 1: 1)" in text, text[-3000:]
    assert "cannot reshape" not in text
    assert procs[1].returncode != 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("stops", [0, 1])
def test_a_flag_error_on_one_process_stops_the_others_at_once(tmp_path, corpus_and_data, stops):
    """A misspelt flag on one process exited it (2) before it joined the others, which waited
    silently in jax.distributed.initialize for 300 s and then aborted. It now joins to tell
    them: every process exits 2 within seconds, the others naming it and its error."""
    port = _free_port()
    good, bad = "--config.num_replicas=4", "--config.num_replica=4"
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    start = time.monotonic()
    # No warmup flag: the process that goes on prints the warmup note first (JAX's backend,
    # started to ask which process prints, would wait for the one that stopped).
    procs = [subprocess.Popen([a for a in _cmd(*corpus_and_data, tmp_path / "run",
                                               "--config.num_steps=2", bad if i == stops else good,
                                               *_distributed(2, i, port)) if "warmup" not in a],
                              env=_env(2), stdout=log.open("w"), stderr=subprocess.STDOUT)
             for i, log in enumerate(logs)]  # fmt: skip
    while any(p.poll() is None for p in procs) and time.monotonic() - start < 40:
        time.sleep(0.2)  # (_wait_all would stop the others once one has failed)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    texts = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [2, 2], "\n".join(t[-2000:] for t in texts)
    assert "unknown config field --config.num_replica;" in texts[stops]
    assert "note: optim.warmup_steps=50 does not fit" in texts[0] or stops == 0
    assert (f"process {stops} of the 2 stopped before the run started: unknown config field "
            f"--config.num_replica;") in texts[1 - stops]  # fmt: skip
    assert "Traceback" not in "".join(texts)
