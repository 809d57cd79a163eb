"""Two processes x 4 CPU devices on loopback train exactly like one process x 8 devices."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
from pydoc_data.topics import topics

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(corpus, data_dir, workdir, *extra):
    return [
        sys.executable, "-m", "noloco_jax.train",
        f"--config={ROOT / 'configs' / 'tiny_noloco.py'}", f"--workdir={workdir}", "--noprogress",
        "--config.model.preset=nano", "--config.num_replicas=8", "--config.backend=shard_map",
        "--config.global_batch_size=16", "--config.num_steps=8", "--config.log_every=2",
        "--config.eval_every=4", "--config.checkpoint_every=4", "--config.optim.warmup_steps=1",
        "--config.data.source=files", f"--config.data.path={corpus}",
        f"--config.data.data_dir={data_dir}", "--config.data.seq_len=32",
        "--config.data.eval_windows=8", "--config.outer.sync_every=2", *extra,
    ]  # fmt: skip


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")  # fmt: skip
    return env


def _records(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


@pytest.mark.multiprocess
def test_two_processes_match_one_process(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, (_, text) in enumerate(sorted(topics.items())[:40]):
        (corpus / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    data_dir = tmp_path / "data"
    one = subprocess.run(_cmd(corpus, data_dir, tmp_path / "one"), env=_env(8),
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    port = _free_port()
    procs = [
        subprocess.Popen(
            _cmd(corpus, data_dir, tmp_path / "two", f"--coordinator_address=127.0.0.1:{port}",
                 "--num_processes=2", f"--process_id={i}"),
            env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    a, b = _records(tmp_path / "one"), _records(tmp_path / "two")
    train = lambda recs: [r["train_loss"] for r in recs if r["kind"] == "train"]  # noqa: E731
    evals = lambda recs: [r["val_ppl"] for r in recs if r["kind"] == "eval"]  # noqa: E731
    assert len(train(a)) == 4 and train(a) == train(b)  # 4 NoLoCo rounds, exactly equal
    assert evals(a) == evals(b)
    assert (tmp_path / "two" / "checkpoints" / "8").is_dir()
