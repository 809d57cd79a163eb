"""Streaming fragments: which part of the parameters each sync of ``local_steps`` moves.

With ``local_steps(..., fragments=spec)`` the parameters are split into P fragments and
fragment p is synchronised at the steps t with ``t mod H == (p + 1) H / P`` (the last one at
``t mod H == 0``, as without fragments). Every sync then moves one fragment: the same bytes
per round as one full sync, with a lower peak (Douillard et al., 2025, "Streaming DiLoCo",
arXiv:2501.18512). The peak falls P-fold only when the fragments are equal in size:
``fragment_sizes`` gives them.

A *spec* is a tree shaped like the params whose leaves say where each param goes:

* an ``int`` p: the whole leaf belongs to fragment p;
* a ``tuple`` of ints, one per row of the leaf's leading axis: row r belongs to fragment
  ``spec[r]`` (rows of one fragment must be contiguous). Stacked ``lax.scan`` blocks (a
  leading layer axis) are split this way, so a fragment is a run of consecutive layers.

``by_layer_blocks`` builds the spec of the Llama model here: layers in P contiguous runs,
the token embedding with the first run, everything else (final norm, head) with the last.
Where the vocabulary tables are a large part of the model, the first and last fragments are
then the largest: for the paper's small model (V = 128,002, 310M parameters, 197M of them in
the two tables) at P = 4 the largest fragment holds 127M parameters, not 78M, and the peak
falls 2.45-fold, not 4-fold.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from noloco_jax import errors

__all__ = ["by_layer_blocks", "num_fragments", "fragment_sizes", "take", "put", "check_spec",
           "check_fragments", "sync_fragment"]

PyTree = Any


def _names(path: tuple) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def by_layer_blocks(
    params: PyTree,
    num_fragments: int,
    *,
    stacked: str = "blocks",
    first: Sequence[str] = ("embedding",),
    field: str = "fragments",
) -> PyTree:
    """Fragments of consecutive layers, for params with stacked blocks.

    Args:
      params: one replica's params (arrays or ``jax.ShapeDtypeStruct``).
      num_fragments: P, at least 1 and at most the number of layers.
      stacked: the key under which every leaf carries a leading layer axis.
      first: keys of leaves that go with the first fragment (the rest of the
        unstacked leaves go with the last).
      field: the name the error messages give P ("config.outer.fragments" in the trainer).

    Returns:
      A spec tree (see the module docstring).

    Raises:
      ValueError: if P is out of range or no leaf is stacked.
    """
    check_fragments(num_fragments, field=field)
    layers = {x.shape[0] for p, x in _leaves_with_path(params) if stacked in _names(p)}
    if not layers:
        raise ValueError(f"no parameter sits under a '{stacked}' key: nothing to split by layer.")
    (num_layers,) = layers
    if num_fragments > num_layers:
        raise ValueError(
            f"{field}={num_fragments} exceeds the model's {num_layers} layers (each fragment "
            f"needs at least one layer block); use {field} <= {num_layers}."
        )

    def leaf(path: tuple, x: Any) -> Any:
        names = _names(path)
        if stacked in names:
            return tuple(r * num_fragments // num_layers for r in range(num_layers))
        return 0 if any(n in first for n in names) else num_fragments - 1

    return jax.tree_util.tree_map_with_path(leaf, params)


def _leaves_with_path(tree: PyTree) -> list:
    return jax.tree_util.tree_leaves_with_path(tree)


def _is_row_spec(s: Any) -> bool:
    """A tuple of ints (one per row); a tuple holding tuples is a container of the params."""
    return isinstance(s, tuple) and not any(isinstance(i, tuple) for i in s)


def _spec_leaves(spec: PyTree, params: PyTree = None) -> list:
    """The leaf specs; with ``params``, one per param (a tuple container of the params is a
    container, not a row spec). Raises ``ValueError`` if ``spec`` is not shaped like them."""
    if params is None:
        return jax.tree.leaves(spec, is_leaf=_is_row_spec)
    treedef = jax.tree.structure(params)
    try:
        return treedef.flatten_up_to(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the fragment spec must be shaped like the params ({treedef.num_leaves}"
                         f" leaves): {e}") from None


def num_fragments(spec: PyTree) -> int:
    """P: one more than the largest fragment index in ``spec`` (1 for ``None``)."""
    if spec is None:
        return 1
    return 1 + max(max(s) if isinstance(s, tuple) else s for s in _spec_leaves(spec))


def fragment_sizes(spec: PyTree, params: PyTree) -> list[int]:
    """The number of parameters in each fragment, in fragment order.

    Args:
      spec: a fragment spec (e.g. ``by_layer_blocks(params, P)``).
      params: one replica's params (arrays or ``jax.ShapeDtypeStruct``).

    Returns:
      P counts; their largest over ``sum / P`` is how far the peak burst stays above the
      P-fold cut of equal fragments.

    Example:
      >>> import jax, numpy as np
      >>> params = {"blocks": np.zeros((4, 3)), "embedding": np.zeros(6), "head": np.zeros(2)}
      >>> fragment_sizes(by_layer_blocks(params, 2), params)
      [12, 8]
    """
    parts = [jax.eval_shape(lambda x, p=p: take(x, spec, p), params)
             for p in range(num_fragments(spec))]  # fmt: skip
    return [sum(int(np.prod(x.shape)) for x in jax.tree.leaves(part)) for part in parts]


def _check_index(spec: PyTree, p: int) -> None:
    """p names one of the spec's fragments: past them ``take`` gave all None, ``put`` no change."""
    errors.check_int("p", p, 0, num_fragments(spec) - 1)


def _rows(s: Any, p: int) -> tuple[int, int] | None:
    """The [start, stop) rows of fragment p in a leaf spec, None if the leaf has none of p."""
    if isinstance(s, tuple):
        idx = np.flatnonzero(np.asarray(s) == p)
        return None if idx.size == 0 else (int(idx[0]), int(idx[-1]) + 1)
    return "all" if s == p else None  # type: ignore[return-value]


def check_spec(spec: PyTree, params: PyTree, sync_every: int) -> int:
    """Validates a spec against the params and H; returns P.

    Raises:
      ValueError: naming the leaf or value that is wrong.
    """
    p_count = num_fragments(spec)
    specs = _spec_leaves(spec, params)
    seen = set()
    for (path, x), s in zip(_leaves_with_path(params), specs):
        name = "/".join(_names(path))
        ids = list(s) if isinstance(s, tuple) else [s]
        if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0 for i in ids):
            raise ValueError(f"fragment of {name} must be integers >= 0, got {s!r}.")
        if isinstance(s, tuple):
            if not len(x.shape):
                raise ValueError(f"{name}: a scalar has no rows to split; give it one int "
                                 f"fragment, got {s!r}.")  # fmt: skip
            if len(s) != x.shape[0]:
                raise ValueError(f"{name}: {len(s)} row fragments for a leading axis of "
                                 f"{x.shape[0]}.")  # fmt: skip
            if list(s) != sorted(s):
                raise ValueError(f"{name}: the rows of a fragment must be contiguous, got {s}.")
        seen.update(int(i) for i in ids)
    missing = sorted(set(range(p_count)) - seen)
    if missing:
        raise ValueError(f"fragments {missing} hold no parameters; number them 0..P-1 densely.")
    check_fragments(p_count, sync_every)
    return p_count


def check_fragments(num_fragments: int, sync_every: int | None = None, *,
                    field: str = "fragments", sync_field: str = "sync_every") -> None:  # fmt: skip
    """The fragment rule: P is an integer >= 1 and divides H (the one check of it).

    Fragment p syncs at the steps t with t mod H = (p + 1) H / P, so H / P must be whole.

    Args:
      num_fragments: P.
      sync_every: H; None checks P alone.
      field: the name the message gives P ("config.outer.fragments" in the settings).
      sync_field: the name the message gives H.

    Raises:
      UserError (a ``ValueError``): naming both fields and the allowed values.
    """
    errors.check_int(field, num_fragments)
    if sync_every is not None and sync_every % num_fragments:
        allowed = [d for d in range(1, sync_every + 1) if sync_every % d == 0]
        raise errors.UserError(
            f"{sync_field}={sync_every} must be a multiple of the number of fragments "
            f"{field}={num_fragments} (fragment p syncs at steps t with t mod H = (p + 1) H / P); "
            f"allowed {field}: {allowed}.")  # fmt: skip


def take(tree: PyTree, spec: PyTree, p: int) -> PyTree:
    """Fragment p of ``tree``: its leaves or rows, ``None`` where it has none."""
    _check_index(spec, p)

    def leaf(x: Any, s: Any) -> Any:
        if x is None:
            return None
        rows = _rows(s, p)
        if rows is None:
            return None
        return x if rows == "all" else x[rows[0]:rows[1]]

    return jax.tree.map(leaf, tree, spec, is_leaf=lambda v: v is None)


def put(tree: PyTree, part: PyTree, spec: PyTree, p: int) -> PyTree:
    """``tree`` with fragment p replaced by ``part`` (a ``take`` of the same spec)."""
    _check_index(spec, p)

    def leaf(x: Any, y: Any, s: Any) -> Any:
        rows = _rows(s, p)
        if x is None or rows is None:
            return x
        return y if rows == "all" else x.at[rows[0]:rows[1]].set(y)

    return jax.tree.map(leaf, tree, part, spec, is_leaf=lambda v: v is None)


def sync_fragment(count: Any, sync_every: int, p_count: int) -> Any:
    """Which fragment ends its round at step ``count`` (1-based), or -1 for none.

    Fragment p syncs when ``count mod H == (p + 1) H / P (mod H)``.

    Raises:
      UserError (a ``ValueError``): ``sync_every`` is not an integer >= 1, or ``p_count`` not
        an integer >= 1 that divides it.
    """
    errors.check_int("sync_every", sync_every)
    check_fragments(p_count, sync_every, field="p_count")
    stride = sync_every // p_count
    due = count % stride == 0
    return jax.numpy.where(due, ((count // stride) - 1) % p_count, -1)
