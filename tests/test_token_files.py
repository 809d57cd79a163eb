"""Token streams on disk (data larger than RAM): same batches, bounded memory, local reads."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from noloco_jax import data, errors, replicas
from noloco_jax.data import token_files
from noloco_jax.data.token_files import (
    TokenFile,
    open_token_dir,
    sharded_batches,
    token_dtype,
    write_tokens,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_refused_part_leaves_no_temporary_file(tmp_path):
    """Each failed write left its ``.tmp.*.raw`` behind, as large as what it had written."""
    parts = [np.arange(10, dtype=np.int64), np.array([0, 300])]  # 300 >= vocab_size
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        write_tokens(tmp_path / "t.npy", iter(parts), vocab_size=256)
    assert list(tmp_path.iterdir()) == []


def test_token_dtype_is_the_smallest_unsigned():
    assert [token_dtype(v) for v in (256, 257, 65536, 65537)] == [
        np.uint8, np.uint16, np.uint16, np.uint32]  # fmt: skip


def test_batches_from_disk_equal_batches_in_memory(tmp_path):
    corpus = data.Corpus(train=["hello world " * 300, "second doc " * 200], validation=["v" * 500],
                         name="t")  # fmt: skip
    tok = data.ByteTokenizer()
    disk = data.load_token_stream(corpus, tok, "train", tmp_path, on_disk=True)
    memory = data.load_token_stream(corpus, tok, "train", tmp_path)
    assert isinstance(disk, TokenFile) and disk.dtype == np.uint8 and memory.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(disk), memory)
    np.testing.assert_array_equal(memory, data.tokenize_documents(corpus.train, tok))
    kw = dict(num_replicas=4, batch_size=3, seq_len=16, seed=5)
    a, b = data.ReplicaBatcher(disk, **kw), data.ReplicaBatcher(memory, **kw)
    assert a.state() == b.state()  # same stream hash: old checkpoints stay resumable
    for step in [0, 1, 7, a.steps_per_epoch, 3 * a.steps_per_epoch + 2]:
        np.testing.assert_array_equal(a.batch(step), b.batch(step))
        assert a.batch(step).dtype == np.int32
        np.testing.assert_array_equal(a.batch(step, replicas=[2, 0]), b.batch(step)[[2, 0]])
    val = data.load_token_stream(corpus, tok, "validation", tmp_path, on_disk=True)
    np.testing.assert_array_equal(data.eval_windows(val, seq_len=16, max_windows=5),
                                  data.eval_windows(np.asarray(val), seq_len=16, max_windows=5))


def _traced_peak(fn) -> int:
    """Peak bytes that Python and numpy hold while ``fn()`` runs, over what they held before
    (tracemalloc; left on if it already was)."""
    import tracemalloc  # noqa: PLC0415

    was_tracing = tracemalloc.is_tracing()
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        held = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - held
    finally:
        if not was_tracing:
            tracemalloc.stop()


def test_a_full_scan_of_a_token_file_holds_a_few_megabytes(tmp_path):
    """The hash and id range read the stream in 1M-token pieces: under 8 MB held for a
    16M-token file (hashed as int32 in one piece it was 80 MB: 16 MB read, 64 MB converted)."""
    write_tokens(tmp_path / "t.npy", (np.full(1 << 22, i, np.uint8) for i in range(4)),
                 vocab_size=256)  # fmt: skip
    stream = TokenFile(tmp_path / "t.npy")
    assert _traced_peak(stream.digest) < 8 * 2**20
    assert (stream.min_id(), stream.max_id()) == (0, 3)


def test_the_batcher_holds_int32_window_ids(tmp_path):
    """Dealing 2M windows holds under 10 bytes per window at its peak (the int32 permutation
    and the shards; an int64 permutation and its int32 copy held 12), and the shards and epoch
    orders are int32."""
    n = 1 << 21
    write_tokens(tmp_path / "t.npy", [np.zeros(n + 1, np.uint8)], vocab_size=256)
    kw = dict(num_replicas=2, batch_size=4, seq_len=1, seed=3)
    built = []
    peak = _traced_peak(lambda: built.append(data.ReplicaBatcher(TokenFile(tmp_path / "t.npy"),
                                                                 **kw)))  # fmt: skip
    assert peak < 10 * n, peak / n
    b = built[0]
    assert b._shards.dtype == np.int32 and b._order(1, 0).dtype == np.int32


def test_sharded_batches_read_only_the_local_replicas(tmp_path):
    write_tokens(tmp_path / "train.npy", [np.arange(5000) % 300], vocab_size=300)
    stream = TokenFile(tmp_path / "train.npy")
    assert stream.dtype == np.uint16
    batcher = data.ReplicaBatcher(stream, num_replicas=8, batch_size=2, seq_len=8, seed=1)
    asked = []
    original = batcher.batch

    def spy(step, replicas=None):
        asked.append(tuple(replicas))
        return original(step, replicas=replicas)

    batcher.batch = spy
    reps = replicas.make_replicas(8, backend="shard_map")
    out = sharded_batches(batcher, reps, start=3, count=2)
    expected = np.stack([original(3), original(4)], axis=1)
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert sorted(set(asked)) == [(r,) for r in range(8)]  # one replica per device, no more


def test_a_token_file_alive_at_interpreter_exit_closes_quietly(tmp_path):
    write_tokens(tmp_path / "t.npy", [np.arange(10)], vocab_size=256)
    code = ("import sys; from noloco_jax.data.token_files import TokenFile; "
            f"KEPT = TokenFile({str(tmp_path / 't.npy')!r}); print(len(KEPT))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "10", out.stderr[-2000:]
    assert "Exception ignored" not in out.stderr, out.stderr[-2000:]  # os.close was gone


def test_tokens_source_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.npy"):
        open_token_dir(tmp_path, 256)
    write_tokens(tmp_path / "train.npy", [np.array([1, 2, 299])], vocab_size=300)
    write_tokens(tmp_path / "validation.npy", [np.array([1, 2])], vocab_size=300)
    with pytest.raises(ValueError, match="token id 299, outside the tokenizer's vocabulary of 256"):
        open_token_dir(tmp_path, 256)
    padded = np.array([5, -1, 7, -1], np.int32)  # -1 padding in a hand-made int32 stream
    np.save(tmp_path / "train.npy", padded)  # was accepted; the model read -1 as id 255
    with pytest.raises(ValueError, match=r"token id -1; ids must be in \[0, 256\)"):
        open_token_dir(tmp_path, 256)
    with pytest.raises(ValueError, match=r"must lie in \[0, 10\)"):
        write_tokens(tmp_path / "x.npy", [np.array([10])], vocab_size=10)
    np.save(tmp_path / "y.npy", np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="1-D integer"):
        TokenFile(tmp_path / "y.npy")



@pytest.mark.parametrize("dtype", [np.uint16, np.int16])
def test_a_token_file_too_narrow_for_the_tokenizer_is_refused(tmp_path, dtype):
    """Llama-3 ids (128,256) saved as uint16, as nanoGPT-style scripts do, wrapped around
    (70,000 became 4,464) and passed the range check: the model trained on the wrong ids."""
    ids = np.array([5, 70_000, 128_000, 9])
    for split in ("train", "validation"):
        np.save(tmp_path / f"{split}.npy", ids.astype(dtype))
    with pytest.raises(ValueError, match=rf"train\.npy is {np.dtype(dtype)}, which holds 65536 "
                                         r"distinct ids, but the tokenizer has 128256.*as uint32"):
        open_token_dir(tmp_path, 128_256)
    for split in ("train", "validation"):  # a byte stream as int8: its ids >= 128 are negative
        np.save(tmp_path / f"{split}.npy", np.array([65, 66, 67], np.int8))
    assert open_token_dir(tmp_path, 256)[0].max_id() == 67
    for split in ("train", "validation"):
        np.save(tmp_path / f"{split}.npy", ids.astype(np.uint32))
    assert open_token_dir(tmp_path, 128_256)[0].max_id() == 128_000


def test_a_tokens_file_the_process_cannot_read_is_a_user_error_naming_it(tmp_path, monkeypatch):
    """A train.npy without read permission was a PermissionError traceback, not exit 2."""
    for split in ("train", "validation"):
        write_tokens(tmp_path / f"{split}.npy", [np.arange(10)], vocab_size=256)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(token_files, "open", refuse, raising=False)  # TokenFile's open()
    with pytest.raises(errors.UserError, match=r"config.data.path: '.*train\.npy' cannot be "
                                               r"read \(Permission denied\)"):  # fmt: skip
        open_token_dir(tmp_path, 256)

_RSS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import numpy as np
    from noloco_jax.trainer import settings as settings_lib
    from noloco_jax.trainer.loop import train_and_evaluate

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    def settings(path, steps):
        return settings_lib.from_config({
            "method": "noloco", "num_replicas": 2, "backend": "vmap", "global_batch_size": 4,
            "num_steps": steps, "log_every": 2, "eval_every": 2, "checkpoint_every": 2,
            "model": {"preset": "nano"}, "optim": {"warmup_steps": 1},
            "outer": {"sync_every": 2},
            "data": {"source": "tokens", "path": path, "seq_len": 256, "eval_windows": 8,
                     "data_dir": sys.argv[3]}})

    def grow(path, name):  # peak and retained growth of RSS over one run
        open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
        before = rss("VmRSS")
        last = train_and_evaluate(settings(path, 4), sys.argv[4] + "/" + name, progress=False)
        return max(rss("VmHWM"), rss("VmRSS")) - before, last

    # Warm up every code path (imports, compilation, orbax) on a small stream, then measure a
    # run on the small stream (the control) and one on the big stream.
    # The warm-up has the measured runs' settings, so neither of them compiles (a 2-step warm-up
    # left the control compiling, 95 to 237 MB, and the comparison meaningless). The control
    # runs before and after the big one; the larger growth counts. The big one runs twice and
    # the smaller growth counts: a one-off peak (seen once, 44 MB, beside a busy machine) is
    # noise, a reader that holds the corpus (1.6 GB) grows both times.
    train_and_evaluate(settings(sys.argv[1], 4), sys.argv[4] + "/warm", progress=False)
    control, _ = grow(sys.argv[1], "small")
    big, last = grow(sys.argv[2], "big")
    big = min(big, grow(sys.argv[2], "big_again")[0])
    control = max(control, grow(sys.argv[1], "small_again")[0])
    print(json.dumps({"control": control, "big": big, "step": last["step"],
                      "loss": last["train_loss"]}))
""")


@pytest.mark.slow  # writes a 400 MB corpus and trains twice in a subprocess (~1 min)
def test_training_on_a_corpus_larger_than_its_memory_growth(tmp_path):
    """400 MB of tokens train with the process growing by < 40 MB more than for a 200 kB
    stream (the old reader held the stream in RAM as int32: 1.6 GB)."""
    rng = np.random.default_rng(0)
    size = 400 * 2**20
    chunks = (rng.integers(0, 256, 2**24, dtype=np.uint8) for _ in range(size // 2**24))
    (tmp_path / "big").mkdir()
    (tmp_path / "small").mkdir()
    write_tokens(tmp_path / "big" / "train.npy", chunks, vocab_size=256)
    for split, n in [("validation", 20_000), ("train", 200_000)]:
        part = [rng.integers(0, 256, n, dtype=np.uint8)]
        write_tokens(tmp_path / "small" / f"{split}.npy", part, vocab_size=256)
    (tmp_path / "big" / "validation.npy").symlink_to(tmp_path / "small" / "validation.npy")
    script = tmp_path / "rss.py"
    script.write_text(_RSS_SCRIPT)
    cmd = [sys.executable, str(script), str(tmp_path / "small"), str(tmp_path / "big"),
           str(tmp_path / "data"), str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    m = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    print(m)
    assert m["step"] == 4 and np.isfinite(m["loss"])
    assert m["big"] - m["control"] < size / 10, m  # what the corpus size adds: < 40 MB


def test_two_writers_of_one_token_file_do_not_corrupt_it(tmp_path):
    """Hosts sharing a data folder may run trainers with one process id (PID 1 in containers):
    their temporary files had one name, so one truncated the other's (24,000 of 50,000 tokens
    read back as 0) and the other failed. Two threads of one process stand in for them."""
    import threading  # noqa: PLC0415

    path = tmp_path / "tokens" / "corpus-train.npy"
    corpus = [np.arange(1, 1001, dtype=np.int32) % 255 + 1 for _ in range(20)]
    half, opened, errors = threading.Event(), threading.Event(), []

    def first():
        for i, part in enumerate(corpus):
            if i == 10:  # half written: let the other writer open its file now
                half.set()
                opened.wait(5)
            yield part

    def second():
        opened.set()
        yield from corpus

    def run(parts):
        try:
            write_tokens(path, parts, 256)
        except Exception as err:  # noqa: BLE001 - reported by the assert below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(first(),))]
    threads[0].start()
    half.wait(5)
    threads.append(threading.Thread(target=run, args=(second(),)))
    threads[1].start()
    for t in threads:
        t.join()
    assert not errors
    np.testing.assert_array_equal(np.asarray(TokenFile(path)), np.concatenate(corpus))


@pytest.mark.parametrize("part", [np.array([5.0, 7.9]), np.array([1.0, np.nan]),
                                  np.array([True, False])])  # fmt: skip
def test_write_tokens_refuses_non_integer_parts(tmp_path, part):
    """7.9 was written as id 7 and NaN (which passes every range check) as id 0."""
    with pytest.raises(ValueError, match=f"token ids must be integers, got .*{part.dtype}"):
        write_tokens(tmp_path / "t.npy", iter([np.array([1, 2]), part]), vocab_size=10)
    assert list(tmp_path.iterdir()) == []
    assert write_tokens(tmp_path / "t.npy", iter([np.array([1, 2]), []]), vocab_size=10) == 2


@pytest.mark.parametrize("ids", [np.array([3, -1, 4, -1, 5, 9, 2, 6, 5], np.int32),
                                 np.array([3, 2**31 + 7, 4, 1, 5, 9, 2, 6, 5], np.uint32)])
def test_a_token_file_s_ids_are_range_checked_as_in_memory(tmp_path, ids):
    """Refused in memory, a file's -1 reached the model and its 2**31 + 7 came back as
    -2**31 + 7 (int32 windows)."""
    np.save(tmp_path / "t.npy", ids)
    bad = ids[1]
    with pytest.raises(ValueError, match=rf"\[0, 2\*\*31 - 1\].*holds id {bad}"):
        data.ReplicaBatcher(TokenFile(tmp_path / "t.npy"), num_replicas=1, batch_size=1,
                            seq_len=8)  # fmt: skip
    with pytest.raises(ValueError, match=rf"\[0, 2\*\*31 - 1\].*holds id {bad}"):
        data.eval_windows(TokenFile(tmp_path / "t.npy"), seq_len=8)


def test_an_empty_token_file_is_read_as_an_empty_stream(tmp_path):
    """An empty file's max_id is -1: the range check took it for a held id -1 ("holds id -1")
    where an empty in-memory stream gives no windows."""
    np.save(tmp_path / "t.npy", np.zeros(0, np.uint16))
    empty = TokenFile(tmp_path / "t.npy")
    assert data.eval_windows(empty, seq_len=8).shape == data.eval_windows([], seq_len=8).shape
    kw = dict(num_replicas=1, batch_size=1, seq_len=8)
    with pytest.raises(ValueError) as memory:
        data.ReplicaBatcher(np.zeros(0, np.int32), **kw)
    with pytest.raises(ValueError) as disk:
        data.ReplicaBatcher(empty, **kw)
    assert "holds id" not in str(disk.value) and str(disk.value) == str(memory.value)


def test_a_1d_token_file_marked_fortran_order_is_read(tmp_path):
    """A 1-D array's order is moot (np.load reads it), but the header's fortran_order=True was
    refused as 'must hold a 1-D integer array, got uint16(6,)'."""
    path = tmp_path / "t.npy"
    ids = np.array([3, 1, 4, 1, 5, 9], np.uint16)
    stream = np.lib.format.open_memmap(path, "w+", np.uint16, (6,), fortran_order=True)
    stream[:] = ids
    del stream
    np.testing.assert_array_equal(np.asarray(TokenFile(path)), ids)


def test_a_read_longer_than_one_pread_returns_is_whole(tmp_path, monkeypatch):
    # Linux's pread returns at most 0x7ffff000 bytes: TokenFile.read (and np.asarray of a
    # TokenFile) of a range over 2 GiB raised "buffer is smaller than requested size".
    ids = np.arange(1000) % 300
    write_tokens(tmp_path / "t.npy", [ids], vocab_size=300)
    stream = TokenFile(tmp_path / "t.npy")
    pread, preadv = os.pread, os.preadv
    monkeypatch.setattr(os, "pread", lambda fd, n, at: pread(fd, min(n, 7), at))  # short reads
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: preadv(fd, [bufs[0][:7]], at))
    np.testing.assert_array_equal(stream.read(3, 1000), ids[3:])
    np.testing.assert_array_equal(np.asarray(stream), ids)
