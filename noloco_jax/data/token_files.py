"""Token streams on disk, read window by window: data larger than RAM.

A stream is stored once as a ``.npy`` file of the smallest unsigned dtype that holds the
vocabulary (uint8 for the byte tokenizer, uint16 up to 65,536 ids, else uint32).
``TokenFile`` reads only the windows a batch needs with ``os.pread``: nothing of the stream is
mapped into the process, so its resident memory does not grow with the corpus (a memory map
would keep every touched page resident until unmapped) and the operating system's page cache
serves repeated reads. Full passes (the stream's hash, its largest id) read fixed-size chunks.

Why not grain: the batch is already a pure function of the step (``ReplicaBatcher``: window
ids from seeded permutations), so what is missing is only a random-access reader of fixed
windows. A pread per window does that in a few lines and keeps the ``.npy`` cache format;
grain would add a dependency and a record format (ArrayRecord) for the same reads.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import socket
import uuid
from typing import Any, Iterable, Iterator

import jax
import numpy as np

from noloco_jax.errors import UserError

__all__ = ["TokenFile", "token_dtype", "write_tokens", "open_token_dir", "sharded_batches"]

_CHUNK = 1 << 24  # tokens per chunk of a full pass (16M)
_SCAN_CHUNK = 1 << 20  # tokens per piece hashed as int32: 4 MB, whatever the stream's size
_PREAD_MAX = 1 << 30  # bytes asked of one pread (Linux returns at most 0x7ffff000)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids ``0 .. vocab_size - 1``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32.")


def write_tokens(path: str | pathlib.Path, parts: Iterator[np.ndarray], vocab_size: int) -> int:
    """Streams token arrays into one ``.npy`` file of ``token_dtype(vocab_size)``.

    The parts are written as they come (a corpus never has to be in memory at once); the file
    appears atomically when complete.

    Args:
      path: the ``.npy`` file to write.
      parts: 1-D integer arrays, concatenated in order.
      vocab_size: every id must be below it.

    Returns:
      The number of tokens written.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    # Unique names: processes on several hosts may share this folder and a process id.
    unique = f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}"
    tmp = path.with_name(f"{path.stem}.tmp.{unique}.raw")
    out = path.with_name(f"{path.stem}.tmp.{unique}.npy")
    try:
        total = _write_raw(tmp, parts, vocab_size, dtype)
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                  "shape": (total,)}  # fmt: skip
        with open(out, "wb") as f, open(tmp, "rb") as src:
            np.lib.format.write_array_header_1_0(f, header)
            while block := src.read(1 << 24):
                f.write(block)
        out.replace(path)
    finally:  # a refused part or a full disk leaves no temporary file behind
        tmp.unlink(missing_ok=True)
        out.unlink(missing_ok=True)
    return total


def _write_raw(tmp: pathlib.Path, parts: Iterable[Any], vocab_size: int, dtype: np.dtype) -> int:
    total = 0
    with open(tmp, "wb") as f:
        for part in parts:
            part = np.asarray(part)
            if part.size and not np.issubdtype(part.dtype, np.integer):  # 7.9 -> 7, NaN -> 0
                raise ValueError(f"token ids must be integers, got a part of dtype {part.dtype}.")
            if part.size and (part.min() < 0 or part.max() >= vocab_size):
                raise ValueError(f"token ids must lie in [0, {vocab_size}), got "
                                 f"[{part.min()}, {part.max()}].")  # fmt: skip
            f.write(part.astype(dtype).tobytes())
            total += part.size
    return total


class TokenFile:
    """A 1-D ``.npy`` token stream read on demand (``pread``), never loaded whole.

    Args:
      path: a ``.npy`` file holding a 1-D array of unsigned (or int32) ids.

    Raises:
      ValueError: not a 1-D integer ``.npy`` array.
    """

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:
            try:
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)  # fmt: skip
                shape, _, dtype = read_header(f)  # the order of a 1-D array is moot
            except ValueError as err:
                raise ValueError(f"{self.path} is not a .npy file: {err}") from err
            self.offset = f.tell()
        if len(shape) != 1 or not np.issubdtype(dtype, np.integer):
            raise ValueError(f"{self.path} must hold a 1-D integer array, got {dtype}{shape}.")
        self.dtype, self.shape, self.ndim = np.dtype(dtype), tuple(shape), 1
        need = self.offset + self.shape[0] * self.dtype.itemsize
        if self.path.stat().st_size < need:
            raise ValueError(f"{self.path} is truncated: {self.path.stat().st_size} bytes, the "
                             f"header promises {need}.")  # fmt: skip
        self._fd = os.open(self.path, os.O_RDONLY)
        self._digest: str | None = None
        self._max: int | None = None
        self._min = 0

    def __len__(self) -> int:
        return self.shape[0]

    def __del__(self, _close: Any = os.close) -> None:  # bound now: at exit os.close is gone
        fd = getattr(self, "_fd", None)
        if fd is not None:
            _close(fd)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` in the file's dtype."""
        start, stop = max(0, start), min(len(self), stop)
        item = self.dtype.itemsize
        size, at = max(stop - start, 0) * item, self.offset + start * item
        first = os.pread(self._fd, min(size, _PREAD_MAX), at)
        if len(first) == size:  # one read (under 2 GiB): the common case, no extra copy
            return np.frombuffer(first, self.dtype)
        out = np.empty(size // item, self.dtype)
        buf, done = memoryview(out.view(np.uint8)), len(first)
        buf[:done] = first
        while done < size:  # a read may return less (Linux: at most 0x7ffff000 bytes)
            got = os.preadv(self._fd, [buf[done : done + _PREAD_MAX]], at + done)
            if not got:
                raise EOFError(f"{self.path} ended {size - done} bytes early.")
            done += got
        return out

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int32 windows ``tokens[s : s + length]`` for every start: [*starts.shape, length]."""
        starts = np.asarray(starts)
        flat = starts.reshape(-1)
        out = np.empty((flat.size, length), np.int32)
        for i, s in enumerate(flat.tolist()):
            window = self.read(s, s + length)
            if window.size != length:
                raise IndexError(f"window [{s}, {s + length}) runs past the stream's end "
                                 f"({len(self)} tokens).")  # fmt: skip
            out[i] = window
        return out.reshape(*starts.shape, length)

    def chunks(self, size: int = _CHUNK) -> Iterator[np.ndarray]:
        """The whole stream in order, ``size`` tokens at a time."""
        for start in range(0, len(self), size):
            yield self.read(start, start + size)

    def _scan(self) -> None:
        h, top, low = hashlib.sha256(), -1, 0
        for chunk in self.chunks(_SCAN_CHUNK):
            h.update(chunk.astype(np.int32))  # same hash as an in-memory int32 stream (no copy)
            if chunk.size:
                top, low = max(top, int(chunk.max())), min(low, int(chunk.min()))
        self._digest, self._max, self._min = h.hexdigest()[:16], top, low

    def digest(self) -> str:
        """sha256 (16 hex digits) of the stream as int32 bytes, read in chunks (once)."""
        if self._digest is None:
            self._scan()
        return self._digest

    def max_id(self) -> int:
        """The largest id in the stream (-1 when empty)."""
        if self._max is None:
            self._scan()
        return self._max

    def min_id(self) -> int:
        """The smallest id in the stream if negative, else 0 (0 when empty)."""
        if self._max is None:
            self._scan()
        return self._min

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The whole stream in memory (small streams and tests only)."""
        out = self.read(0, len(self))
        return out.astype(dtype) if dtype is not None else out.copy()


def open_token_dir(directory: str | pathlib.Path, vocab_size: int) -> tuple[TokenFile, TokenFile]:
    """The pre-tokenized streams ``DIR/train.npy`` and ``DIR/validation.npy`` (data.source=tokens).

    Args:
      directory: holds the two 1-D integer ``.npy`` files (e.g. written by ``write_tokens``).
      vocab_size: the tokenizer's vocabulary; every id must be below it.

    Returns:
      (train, validation) ``TokenFile``s.

    Raises:
      FileNotFoundError: a missing directory or file.
      ValueError: an id outside the vocabulary (below 0 or not below ``vocab_size``), or a
        dtype too narrow for the vocabulary (uint16 for more than 65,536 ids).
    """
    directory = pathlib.Path(directory).expanduser()
    out = []
    for split in ("train", "validation"):
        path = directory / f"{split}.npy"
        if not path.is_file():
            raise FileNotFoundError(
                f"config.data.source='tokens' needs {str(path)!r}: a 1-D .npy array of token "
                f"ids per split (noloco_jax.data.token_files.write_tokens writes one)."
            )
        try:
            stream = TokenFile(path)
        except PermissionError as err:  # was a traceback (the CLI's user errors exit 2)
            raise UserError(f"config.data.path: {str(path)!r} cannot be read ({err.strerror}); "
                            f"fix its permissions.") from err  # fmt: skip
        _check_wide_enough(stream, path, vocab_size)  # before the range: wrapped ids pass it
        if stream.min_id() < 0:
            raise ValueError(
                f"{path} holds token id {stream.min_id()}; ids must be in [0, {vocab_size}) "
                f"(a negative id, e.g. -1 padding, would be read as id {vocab_size - 1} by the "
                f"model). Drop the padding: documents are joined into one stream.")  # fmt: skip
        if stream.max_id() >= vocab_size:
            raise ValueError(
                f"{path} holds token id {stream.max_id()}, outside the tokenizer's vocabulary "
                f"of {vocab_size}; use the tokenizer the ids were made with."
            )
        out.append(stream)
    return out[0], out[1]


def _check_wide_enough(stream: TokenFile, path: pathlib.Path, vocab_size: int) -> None:
    """Refuses a file whose dtype has fewer values than the tokenizer has ids (uint16 for
    Llama-3's 128,256): ids written into it wrapped around onto ids in range, silently (a
    signed dtype with enough values wraps the large ids to negatives, which are refused)."""
    values = 2 ** (8 * stream.dtype.itemsize)
    if values < vocab_size:
        raise ValueError(
            f"{path} is {stream.dtype}, which holds {values} distinct ids, but the tokenizer "
            f"has {vocab_size}: larger ids written into it wrapped around. Write the ids as "
            f"{token_dtype(vocab_size)} (noloco_jax.data.token_files.write_tokens does).")


def sharded_batches(batcher: Any, reps: Any, start: int, count: int) -> jax.Array:
    """Batches for steps ``[start, start + count)`` as one global array over the replica mesh.

    Each process reads only the replicas its own devices hold (``make_array_from_callback``
    asks for those slices only), so with P processes each reads 1/P of every batch.

    Args:
      batcher: a ``ReplicaBatcher``.
      reps: the ``Replicas`` (with a mesh).
      start: first step.
      count: number of steps.

    Returns:
      int32 [N, count, B, T + 1], sharded over the replica axis.
    """
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    n, b, t = batcher.num_replicas, batcher.batch_size, batcher.seq_len + 1
    shape = (n, count, b, t)
    sharding = NamedSharding(reps.mesh, P(reps.axis_name, None, None, None))

    def read(index: tuple) -> np.ndarray:
        mine = list(range(n))[index[0]]
        rows = np.stack([batcher.batch(s, replicas=mine) for s in range(start, start + count)], 1)
        return rows[(slice(None), *index[1:])]

    return jax.make_array_from_callback(shape, sharding, read)
