"""Per-device memory of the trainer's compiled programs, from shapes alone.

``step_memory(settings, vocab_size)`` builds the trainer's own topology and
programs for ``settings``, lowers one of them with abstract inputs
(``jax.ShapeDtypeStruct`` placed with the trainer's shardings), compiles it
and reads ``memory_analysis()``. Nothing is allocated and no data is read,
so it answers "how many bytes does each device hold?" for models far larger
than the machine asking.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from noloco_jax import replicas
from noloco_jax.trainer.step import TrainState

__all__ = ["StepMemory", "abstract_state", "compile_program", "memory_of", "step_memory",
           "device_replicas"]

_OUTER_FIELDS = frozenset({"slow_params", "outer_state", "anchor"})
_INNER_FIELDS = frozenset({"local_opt_state"})


class StepMemory(NamedTuple):
    """Bytes on one device for one compiled program of the trainer.

    The first five split the program's inputs by what they hold, from the
    compiled input shardings; the others are ``memory_analysis()``'s totals.

    Attributes:
      params: the model weights (fast weights).
      optimizer: the inner optimizer's state (Adam moments; for data parallel,
        all of its state).
      outer: the outer state of NoLoCo / DiLoCo: slow weights and outer momentum (with
        ``outer.delay``, also the anchor: theta at the last exchange).
      counters: step counters and other scalars.
      tokens: the batches the program reads.
      argument: all inputs, as the compiler counts them.
      output: all outputs (aliased onto the donated inputs: see ``alias``).
      alias: output bytes that reuse donated input buffers.
      temp: scratch the program needs while it runs: activations kept for the
        backward pass, gradients, gathered weights, buffers.
      generated_code: the compiled code.
    """

    params: int
    optimizer: int
    outer: int
    counters: int
    tokens: int
    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int

    @property
    def state(self) -> int:
        """Params + optimizer + outer state + counters: what the device holds between steps."""
        return self.params + self.optimizer + self.outer + self.counters

    @property
    def peak(self) -> int:
        """Inputs + scratch + outputs that are not aliased onto inputs: the program's footprint."""
        return self.argument + self.temp + self.output - self.alias


def _category(path: tuple, x: Any) -> str:
    """The ``StepMemory`` field of an input leaf; ``path`` starts at (state, tokens)."""
    if replicas.key_name(path[0]) != "0":  # the tokens
        return "tokens"
    field, rest = replicas.key_name(path[1]), {replicas.key_name(k) for k in path[2:]}
    if field == "params":
        return "params"
    if field == "opt_state" and rest & _OUTER_FIELDS:
        return "outer"
    if field == "opt_state" and (rest & _INNER_FIELDS or len(x.shape) > 1):
        return "optimizer"
    return "counters"


def abstract_state(reps: replicas.Replicas, tx: Any, params: Any) -> TrainState:
    """The trainer's replicated, placed ``TrainState`` as ``jax.ShapeDtypeStruct`` leaves.

    Args:
      reps: the topology.
      tx: the per-replica optimizer.
      params: one replica's params (abstract or concrete).

    Returns:
      The state as the trainer places it (``trainer.state.first_state``): split over the mesh,
      or on the default device for ``vmap``; nothing is allocated. A checkpoint restores onto it.
    """
    single = jax.eval_shape(lambda p: TrainState(jnp.zeros([], jnp.int32), p, tx.init(p)), params)
    return _placed(reps, single, lead=False)


def _placed(reps: replicas.Replicas, single: Any, lead: bool) -> Any:
    """Abstract leaves in the replicated layout with the shardings ``reps.put`` gives them
    (for ``vmap``, the default device, where an eager array lands).

    ``lead``: the leaves already carry their leading replica axis.
    """
    n = reps.num_replicas
    device = jnp.zeros(()).sharding if reps.mesh is None else None

    def place(path: tuple, x: Any) -> jax.ShapeDtypeStruct:
        shared = not lead and replicas.is_shared_leaf(x, path)
        local = x.shape[1:] if lead else x.shape
        out = jax.ShapeDtypeStruct(local if shared else (n, *local), x.dtype)
        sharding = device if reps.mesh is None else reps.sharding_of(path, out)
        return jax.ShapeDtypeStruct(out.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(place, single)


def compile_program(settings: Any, vocab_size: int, *, program: str = "sync") -> Any:
    """Compiles one of the trainer's two programs for ``settings`` with abstract inputs.

    The topology, optimizer and programs are the trainer's own (``trainer.build``);
    the inputs are ``jax.ShapeDtypeStruct`` placed as the trainer places them.

    Args:
      settings: ``TrainSettings`` (model preset, method, replicas, mesh split,
        batch and sequence length are read from it).
      vocab_size: the tokenizer's vocabulary size (the model's: ``build.model_vocab``).
      program: "sync" (the step that ends a round, one step; data parallel has
        no rounds and gets its one program) or "inner" (a block of
        gcd(log_every, period) inner steps, the longest block the trainer can run; it
        runs one step fewer where every block ends on a sync step).

    Returns:
      The ``jax.stages.Compiled`` program (``memory_analysis()``, ``as_text()``).

    Raises:
      ValueError: ``program`` is not "sync" or "inner", ``build.model_vocab`` refuses the
        vocabulary (the model's smaller than ``vocab_size``, ...), or
        ``config.mesh.fsdp`` / ``config.mesh.tensor`` does not divide the dims it splits:
        the trainer refuses these too.
    """
    from noloco_jax.trainer import build  # noqa: PLC0415 (build imports aot)

    if program not in ("sync", "inner"):
        raise ValueError(f"program must be 'sync' or 'inner', got {program!r}.")
    s = settings
    cfg, graphdef, params = build.abstract_model(s, vocab_size)
    build.check_split(s, params)
    spec, build_tx = build.optimizer_factory(s, params)
    reps, step_kwargs, inner, sync = build.run_programs(s, cfg, graphdef, build_tx, spec)
    period, steps, delay = build.schedule(s)
    run = sync if program == "sync" and sync is not None else inner
    if delay and run is sync:  # the trainer's sync program: fragment 0's overlap window, with
        # the state leaves it does not read kept as arguments (they stay on the device)
        run = jax.jit(sync[0].__wrapped__, donate_argnums=0, keep_unused=True)
    if run is not inner:
        steps = 1
    elif delay:  # inner blocks stop where a window of delay + 1 steps starts
        steps = max(1, min(steps, period - delay - 1))
    tokens = jax.ShapeDtypeStruct((s.num_replicas, steps, s.batch_per_replica, s.data.seq_len + 1),
                                  jnp.int32)  # fmt: skip
    tokens = _placed(reps, tokens, lead=True)
    if delay and run is not inner:  # one [N, 1, B, T + 1] array per step of the window
        tokens = (tokens,) * (delay + 1)
    state = abstract_state(reps, step_kwargs["tx"], params)
    return run.lower(state, tokens).compile()


def step_memory(settings: Any, vocab_size: int, *, program: str = "sync") -> StepMemory:
    """Per-device bytes of one of the trainer's programs, compiled from shapes alone.

    Args:
      settings: ``TrainSettings``.
      vocab_size: the tokenizer's vocabulary size; the model's is ``config.model.vocab_size``
        when set (padded, >= it), the ``init_from`` config's, else this.
      program: "sync" or "inner" (see ``compile_program``).

    Returns:
      ``memory_of`` the compiled program.

    Example:
      >>> from noloco_jax.trainer import settings as st
      >>> s = st.from_config({"model": {"preset": "nano"}, "num_replicas": 1})
      >>> m = step_memory(s, 256)
      >>> m.state == m.params + m.optimizer + m.outer + m.counters
      True
    """
    return memory_of(compile_program(settings, vocab_size, program=program))


def memory_of(compiled: Any) -> StepMemory:
    """Sorts a compiled trainer program's per-device input bytes by what they hold.

    Args:
      compiled: a program of ``compile_program`` (arguments: state, tokens).

    Returns:
      ``StepMemory``: the categories from the compiled input shardings, the
      totals from ``memory_analysis()``.
    """
    totals = dict.fromkeys(("params", "optimizer", "outer", "counters", "tokens"), 0)
    flat = jax.tree_util.tree_flatten_with_path(compiled.args_info[0])[0]
    for (path, x), sh in zip(flat, jax.tree.leaves(compiled.input_shardings[0]), strict=True):
        shape = sh.shard_shape(x.shape) if x.shape else ()
        totals[_category(path, x)] += math.prod(shape) * np.dtype(x.dtype).itemsize
    m = compiled.memory_analysis()
    return StepMemory(**totals, argument=int(m.argument_size_in_bytes),
                      output=int(m.output_size_in_bytes), alias=int(m.alias_size_in_bytes),
                      temp=int(m.temp_size_in_bytes),
                      generated_code=int(m.generated_code_size_in_bytes))  # fmt: skip


def device_replicas(compiled: Any) -> dict[int, int]:
    """The HLO's device number -> replica index, from the mesh of a ``compile_program``
    program's state. The HLO numbers devices by their place in the mesh (its flat order),
    not by their ids, which differ when the mesh reorders devices."""
    shardings = [s for s in jax.tree.leaves(compiled.input_shardings[0])
                 if isinstance(s, NamedSharding)]  # fmt: skip
    if not shardings:  # vmap: every replica on one device
        return {0: 0}
    devices = shardings[0].mesh.devices
    return {k: i[0] for k, i in enumerate(np.ndindex(devices.shape))}
