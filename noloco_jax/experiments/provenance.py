"""Which code made a result: the git commit, whether the tree was dirty, the config and seeds.

Every training run of the harness gets a ``run_info.json`` in its workdir when it starts, and
every results json a ``_provenance`` entry, so that a page built from several results files can
check that they all come from one version of the code (``experiments.make_results``).

Changes under the output folders (``experiments/results``, ``experiments/figures`` and the two
pages built from them) do not make the tree dirty: publishing one experiment must not mark the
runs of the next one as made by uncommitted code.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import pathlib
import subprocess
from typing import Any

from noloco_jax import defaults

__all__ = ["OUTPUT_PATHS", "git_state", "version_label", "run_info", "config_differences",
           "versions_of", "ABSENT"]  # fmt: skip

# Paths (relative to the repository) whose changes do not count as a dirty tree.
OUTPUT_PATHS = ("experiments/results", "experiments/figures", "experiments/RESULTS.md",
                "experiments/BENCHMARKS.md", "experiments/runs")  # fmt: skip


def _git(root: pathlib.Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                             timeout=30, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def git_state(root: pathlib.Path) -> dict[str, Any]:
    """The commit checked out at ``root`` and whether tracked or new files differ from it.

    Args:
      root: a folder inside the git checkout.

    Returns:
      ``{"commit": sha or None, "dirty": bool or None, "diff_sha256": str or None}``; None
      where ``root`` is not in a git checkout or holds no tracked file (an installed package,
      inside another project's checkout or not); ``dirty`` None with a commit where
      ``git status`` failed (a damaged index, its timeout): not known clean. ``diff_sha256``
      hashes the uncommitted changes (``git diff HEAD``, and the names and contents of new
      files) so that two dirty runs can still be told apart.

    Example:
      >>> from noloco_jax.experiments.harness import ROOT  # this checkout
      >>> git_state(ROOT)["commit"]  # doctest: +SKIP
      '8158966...'
    """
    commit = _git(root, "rev-parse", "HEAD")
    # "": git tracks nothing under root, an installed copy inside another project's checkout
    # (its .venv), whose commit is not this code's.
    if commit is None or _git(root, "ls-files", "--", ".") == "":
        return {"commit": None, "dirty": None, "diff_sha256": None}
    excluded = [f":(exclude){p}" for p in OUTPUT_PATHS]
    status = _git(root, "status", "--porcelain", "--", ".", *excluded)
    if status is None:  # not "" (clean): a tree that could not be checked is not clean
        return {"commit": commit.strip(), "dirty": None, "diff_sha256": None}
    dirty = bool(status.strip())
    digest = None
    if dirty:
        diff = (_git(root, "diff", "HEAD", "--", ".", *excluded) or "") + status
        h = hashlib.sha256(diff.encode())
        top = pathlib.Path(_git(root, "rev-parse", "--show-toplevel").strip())
        new_files = _git(root, "ls-files", "-z", "--others", "--exclude-standard", "--full-name",
                         "--", ".", *excluded) or ""  # fmt: skip
        for name in sorted(filter(None, new_files.split("\0"))):  # -z: names unquoted
            h.update(name.encode() + b"\0")
            path = top / name
            if path.is_file():
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
        digest = h.hexdigest()[:16]
    return {"commit": commit.strip(), "dirty": dirty, "diff_sha256": digest}


def version_label(state: dict[str, Any]) -> str:
    """One string per code version: the commit, ``+dirty.<hash>`` if dirty (``+dirty.unknown``
    if its state could not be read), else "unrecorded"."""
    if not state or not state.get("commit"):
        return "unrecorded"
    label = state["commit"][:12]
    if "dirty" in state and state["dirty"] is None:
        return label + "+dirty.unknown"
    return label + f"+dirty.{state.get('diff_sha256')}" if state.get("dirty") else label


def run_info(config: Any, root: pathlib.Path, state: dict[str, Any] | None = None
             ) -> dict[str, Any]:  # fmt: skip
    """What ``run_info.json`` records for a run: code version, full config and seeds.

    Args:
      config: the run's ``ConfigDict`` as trained.
      root: the repository.
      state: ``git_state(root)`` if already known (one look-up for a whole grid).

    Returns:
      A JSON-able dict.
    """
    cfg = json.loads(json.dumps(config.to_dict(), default=repr))
    return {**(state if state is not None else git_state(root)), "config": cfg, "seed": cfg.get("seed"),
            "outer_seed": cfg.get("outer", {}).get("seed"),
            "jax": _version("jax"), "flax": _version("flax")}  # fmt: skip


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


ABSENT = "(absent)"  # config_differences' old value of a field the old config lacks


def config_differences(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Dotted fields whose values differ: {field: (old, new)}.

    A field only ``new`` has (an option added to the code since ``old`` was recorded) is a
    difference, ``(ABSENT, value)``, unless its value is the field's default, which the older
    code behaved as; a field only ``old`` has (an option removed since) is not. The commits
    recorded next to the configs tell those versions apart.
    """
    a, b = defaults.dotted(old), defaults.dotted(new)
    diff = {k: (a[k], b[k]) for k in set(a) & set(b) if a[k] != b[k]}
    diff.update({k: (ABSENT, b[k]) for k in set(b) - set(a) if not _is_default(k, b[k])})
    return dict(sorted(diff.items()))


def _is_default(name: str, value: Any) -> bool:
    """Whether ``value`` (as JSON keeps it) is the default of field ``name`` (False: no field)."""
    try:
        default = defaults.default(name)
    except KeyError:
        return False
    return json.loads(json.dumps(default, default=repr)) == value


def versions_of(results: dict) -> dict[str, list[str]]:
    """{version label: [what has it]} over a results json: its writer and every run in it.

    Args:
      results: a results json as written by ``harness.write_outputs``.

    Returns:
      Labels of ``version_label``; a file without ``_provenance`` is all "unrecorded".
    """
    prov = results.get("_provenance") if isinstance(results, dict) else None
    if not prov:
        return {"unrecorded": ["(no _provenance)"]}
    found: dict[str, list[str]] = {version_label(prov.get("writer", {})): ["(report)"]}
    for name, state in sorted(prov.get("runs", {}).items()):
        for part in (state, *state.get("resumed_at", [])):  # a run resumed by other code
            found.setdefault(version_label(part), []).append(name)
    if prov.get("earlier"):  # the report was re-written from a json made by other code
        for label, what in versions_of({"_provenance": prov["earlier"]}).items():
            found.setdefault(label, []).extend(f"earlier {w}" for w in what)
    return found
