r"""Command-line entry point: ``noloco-train`` or ``python -m noloco_jax.train``.

    noloco-train --config=configs/tiny_noloco.py --workdir=runs/tiny_noloco \
        --config.num_replicas=4 --config.outer.group_size=2

Intentionally short: flags in, typed settings out, the loop lives in
``noloco_jax.trainer``. Restarting with the same --workdir resumes.

User errors (a ``ValueError``, a missing input file, a bad flag) print the
message in a line or two and exit with status 2; ``--debug`` shows their
traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import pathlib
import re
import sys
import textwrap
import threading
from typing import Any, Sequence

_REPO = pathlib.Path(__file__).resolve().parents[1]  # the default --config is in _REPO/configs

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# TensorFlow only prepares a corpus here (once); without this it logs a oneDNN notice at import.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from absl import app, flags, logging  # noqa: E402

PROG = "noloco-train"
USAGE_ERROR_EXIT = 2
RUN_FAILURE_EXIT = 1
_HELP_ARGS = ("--help", "-help", "-h", "--helpshort", "-helpshort", "-?")
_DEBUG_ARGS = ("--debug", "-debug", "--debug=true", "--debug=True", "--debug=1")
# Python's cyclic collector runs after this many new objects (its default: 700). Tracing and
# compiling allocate millions, most freed by reference counting, so the default ran thousands of
# collections a run: a tiny run (nano, 8 steps) takes 6 % less CPU. Collection is unchanged.
GC_THRESHOLD = (50_000, 20, 20)
# Flags of this program, in --help order (absl's own flags: --helpfull).
_PROJECT_FLAGS = ("config", "workdir", "progress", "debug", "coordinator_address",
                  "num_processes", "process_id", "distributed")  # fmt: skip
_START_WAIT_S = 60  # a process that stopped before it joined waits this long for the others
_join_tried = threading.Event()  # this cli() call has tried to join the others (once is enough)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input, not a bug in the program."""
    from noloco_jax.data.sources import CorpusUnavailableError  # noqa: PLC0415

    return (ValueError, FileNotFoundError, NotADirectoryError, CorpusUnavailableError,
            flags.Error)  # fmt: skip


def _run_failures() -> tuple[type[BaseException], ...]:
    """Failures of a run or its environment (failed save, unreadable or diverged run)."""
    from noloco_jax import errors  # noqa: PLC0415

    return (errors.CheckpointSaveError, errors.CorruptCheckpointError,
            errors.CheckpointRestoreError, errors.TrainingDivergedError,
            errors.MetricsWriteError)  # fmt: skip


def _define_flags() -> None:
    """Defines the flags once. Deferred to ``run`` because ml_collections parses the
    ``--config.*`` overrides while defining ``--config``; a misspelt field fails there."""
    if "workdir" in flags.FLAGS:
        return
    from ml_collections import config_flags  # noqa: PLC0415

    config_flags.DEFINE_config_file(
        "config",
        str(_REPO / "configs" / "tiny_noloco.py"),
        "Experiment config file, optionally with a variant: configs/tiny_noloco.py:quick.",
        lock_config=True,
    )
    flags.DEFINE_string(
        "workdir", "runs/tiny_noloco", "Checkpoints and metrics go here; an existing run resumes.")
    flags.DEFINE_bool("progress", True, "Show a progress bar.")
    flags.DEFINE_bool("debug", False, "Show the traceback of a user error too.")
    _define_join_flags(flags.FLAGS)


def _define_join_flags(f: flags.FlagValues) -> None:
    """The flags that say how this process joins the others of a multi-process run."""
    flags.DEFINE_string(
        "coordinator_address", None,
        "host:port of process 0 for multi-process training (jax.distributed); unset = one "
        "process (or auto-detected on Slurm/TPU pods with --distributed).", flag_values=f)
    flags.DEFINE_integer("num_processes", None, "Processes in the run.", flag_values=f)
    flags.DEFINE_integer("process_id", None, "This process's index.", flag_values=f)
    flags.DEFINE_bool("distributed", False,
                      "Call jax.distributed.initialize() with cluster auto-detection.",
                      flag_values=f)  # fmt: skip


def main(argv: list[str]) -> None:
    """Trains (or resumes) the configured run and prints its last metrics as JSON."""
    del argv
    if not flags.FLAGS["verbosity"].present:  # orbax/TFDS log every file at INFO
        logging.set_verbosity(logging.WARNING)
    from noloco_jax import determinism  # noqa: PLC0415

    determinism.request(flags.FLAGS.config.get("deterministic", True))  # before JAX's backend
    _maybe_initialize_distributed()
    from noloco_jax.trainer import from_config  # noqa: PLC0415
    from noloco_jax.trainer.loop import train_and_evaluate  # noqa: PLC0415

    config = flags.FLAGS.config
    try:
        _check_trainer_config(config)
        _fit_warmup(config, explicit="config.optim.warmup_steps" in flags.FLAGS,
                    saved=_saved_run_length(flags.FLAGS.workdir))
        settings = from_config(config)
    except _user_errors() as err:
        _start_together(err)
        raise
    _start_together(None)
    last = train_and_evaluate(settings, flags.FLAGS.workdir, progress=flags.FLAGS.progress)
    if _first_process():
        print(json.dumps(dict(last), indent=1, sort_keys=True))


def _check_trainer_config(config: Any) -> None:
    """A config of another experiment (``configs/exp_hdee.py``) has none of the trainer's fields."""
    from ml_collections import config_flags  # noqa: PLC0415

    error = _not_a_trainer_config(config, config_flags.get_config_filename(flags.FLAGS["config"]))
    if error:
        raise ValueError(error)


def _not_a_trainer_config(config: Any, path: str) -> str | None:
    missing = [k for k in ("num_steps", "method", "optim", "outer") if k not in config]
    if not missing:
        return None
    return (f"--config: {pathlib.Path(path).name} is not a noloco-train config (it has no "
            f"field {missing[0]!r}); it drives its own experiment (configs/README.md says "
            f"which: python -m experiments.NAME).")  # fmt: skip


def _fit_warmup(config: Any, explicit: bool, saved: Any = None) -> None:
    """Shortens an inherited warmup that does not fit a shorter run, with a printed note.

    ``--config.num_steps=25`` on a config that warms up for 50 steps means "the same run,
    shorter": the warmup becomes the defaults' warmup-to-run ratio (50 / 500) of the new
    length (at least 1 step; none for a one-step run) and a note says so. A run resumed or extended
    from a checkpoint whose warmup was fitted so keeps that warmup. A warmup given on the
    command line is never changed (``settings.validate`` refuses one that does not fit).

    Args:
      config: the parsed ConfigDict (changed in place).
      explicit: whether ``--config.optim.warmup_steps`` was given.
      saved: (warmup_steps, num_steps) of the workdir's newest checkpoint, or None.
    """
    from noloco_jax import defaults  # noqa: PLC0415

    steps, warmup = config.num_steps, config.optim.warmup_steps
    valid = all(isinstance(v, int) and not isinstance(v, bool) for v in (steps, warmup))
    if not explicit and valid and saved is not None:
        saved_warmup, saved_steps = saved
        if warmup >= saved_steps and saved_warmup < steps:  # that run fitted this warmup
            config.optim.warmup_steps = saved_warmup
            return
    if explicit or not valid or steps < 1 or warmup < steps:
        return  # nothing to fit, or validation reports it
    ratio = defaults.default("optim.warmup_steps") / defaults.default("num_steps")
    fitted = min(steps - 1, max(1, int(steps * ratio)))  # a one-step run: no warmup
    config.optim.warmup_steps = fitted
    if _first_process():  # every process fits the same way; one says so
        print(f"note: optim.warmup_steps={warmup} does not fit num_steps={steps}; warming up "
              f"for {fitted} steps ({ratio:.0%} of the run, as the defaults). Set "
              f"--config.optim.warmup_steps to choose.", file=sys.stderr)  # fmt: skip


def _first_process() -> bool:
    """Whether this is process 0 of the run (the one that prints for all). Starts no JAX
    backend: before ``_start_together`` that would wait for every process to start one."""
    from jax._src import distributed  # noqa: PLC0415

    return distributed.global_state.process_id == 0


def _saved_run_length(workdir: Any) -> tuple[int, int] | None:
    """(optim.warmup_steps, num_steps) of the checkpoint the trainer resumes from: the newest
    readable one (a damaged newer one is set aside, as the trainer does); None if none."""
    directory = pathlib.Path(str(workdir or "")).expanduser() / "checkpoints"
    if not str(workdir or "").strip() or not directory.is_dir():
        return None
    from noloco_jax import errors  # noqa: PLC0415
    from noloco_jax.trainer.checkpoint import Checkpointer  # noqa: PLC0415

    ckpt, meta = Checkpointer(directory), {}
    try:
        for step in reversed(ckpt.all_steps()):
            try:  # the newest alone: with it damaged, the warmup was fitted afresh and the
                meta = ckpt.read_run_meta(step)  # resume from the previous one refused
                break
            except errors.CorruptCheckpointError:
                continue  # the trainer sets it aside and restores the previous one
    except errors.CheckpointRestoreError:
        return None  # the trainer reports it when it restores
    finally:
        ckpt.close()
    saved = meta.get("settings") or {}
    pair = ((saved.get("optim") or {}).get("warmup_steps"), saved.get("num_steps"))
    return pair if all(isinstance(v, int) for v in pair) else None


def _maybe_initialize_distributed() -> None:
    """Joins a multi-process run before JAX touches any device."""
    kwargs = _distributed_args(flags.FLAGS)
    if kwargs is not None:
        import jax  # noqa: PLC0415

        _join_tried.set()
        jax.distributed.initialize(**kwargs)


def _distributed_args(f: Any) -> dict[str, Any] | None:
    """``jax.distributed.initialize``'s arguments from the flags ``f``; None for one process."""
    if f.coordinator_address is None and not f.distributed:
        if f.num_processes is not None or f.process_id is not None:  # else each trains alone
            raise ValueError("--num_processes and --process_id need --coordinator_address=HOST:PORT "
                             "(or --distributed to read the cluster from the environment).")
        return None
    if f.coordinator_address is None:  # Slurm, TPU pods, GCE: the rest read from the environment
        return dict(num_processes=f.num_processes, process_id=f.process_id)
    host, _, port = f.coordinator_address.rpartition(":")
    ipv6_unbracketed = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not host or ipv6_unbracketed or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator_address={f.coordinator_address!r} must be HOST:PORT "
                         f"with a port in 1..65535 (e.g. 10.0.0.1:1234, [::1]:1234).")
    if f.num_processes is None or f.process_id is None:
        raise ValueError("--coordinator_address needs --num_processes and --process_id.")
    if not 0 <= f.process_id < f.num_processes:
        raise ValueError(
            f"--process_id={f.process_id} must be in [0, --num_processes={f.num_processes}).")
    return dict(coordinator_address=f.coordinator_address, num_processes=f.num_processes,
                process_id=f.process_id)  # fmt: skip


def _start_together(error: BaseException | None) -> None:
    """Every process of a multi-process run says whether it can start (``error``: why not)
    and hears the others; one that cannot stops them all now, with its message.

    Raises:
      ValueError: naming the first other process that cannot start and its error.
    """
    if not _joined_others():
        return
    from jax._src import distributed  # noqa: PLC0415  (its key-value store and barriers)

    state, wait_ms = distributed.global_state, 300_000  # as jax.distributed.initialize waits
    said = "" if error is None else (str(error).strip() or type(error).__name__)
    state.client.key_value_set(f"noloco_jax/start/{state.process_id}", said)
    state.client.wait_at_barrier("noloco_jax/start/said", wait_ms)
    others = {p: state.client.blocking_key_value_get(f"noloco_jax/start/{p}", wait_ms)
              for p in range(state.num_processes) if p != state.process_id}  # fmt: skip
    stopped = [(p, message) for p, message in others.items() if message]
    if error is None and not stopped:
        return
    # All leave together (process 0 holds the store the others read): nobody is stuck yet.
    distributed.shutdown()
    if error is None:
        raise ValueError(f"process {stopped[0][0]} of the {state.num_processes} stopped before "
                         f"the run started: {stopped[0][1]}")


def _tell_others(argv: Sequence[str], error: BaseException) -> None:
    """A user error before this process joined the others (a bad flag on one process): join
    now, at most ``_START_WAIT_S`` seconds, to tell them (they would wait for this process in
    ``jax.distributed.initialize`` for 300 s and then abort without saying why)."""
    f = flags.FlagValues()  # only the flags that say how to join, whatever else failed
    _define_join_flags(f)
    try:
        f(list(argv), known_only=True)
        kwargs = _distributed_args(f)
    except (flags.Error, ValueError):
        return
    if kwargs is None or _join_tried.is_set():  # it joined (and said so), or cannot
        return
    import jax  # noqa: PLC0415

    _join_tried.set()
    sys.stderr.flush()
    give_up = threading.Timer(_START_WAIT_S, os._exit, (USAGE_ERROR_EXIT,))
    give_up.daemon = True
    give_up.start()
    try:
        jax.distributed.initialize(**kwargs)
    except Exception:  # noqa: BLE001 - no cluster found (--distributed): no one to tell
        return
    finally:
        give_up.cancel()
    _start_together(error)


# ---------------------------------------------------------------- flag parsing and errors


def _take_none(argv: list[str]) -> tuple[list[str], list[str]]:
    """Takes ``--config.<field>=None`` out of ``argv`` for fields whose default is None.

    absl would parse "None" as the field's type (a float for ``outer.gamma``). Flag files
    are expanded first, so the order of all overrides is kept; ``--`` ends the flags.

    Returns:
      ``argv`` without those arguments, and the fields whose last override is None
      (for ``_set_none`` to apply after parsing; a later value wins over None).
    """
    from noloco_jax import defaults  # noqa: PLC0415

    allowed = {n for n, v, _ in defaults.FIELDS if isinstance(v, defaults.Unset)}
    argv = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)
    kept, last, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        if i and arg == "--":
            kept.extend(argv[i:])
            break
        field = re.match(r"^--?config\.([\w.]+)(=(.*))?$", arg) if i else None
        value = field and (field.group(3) if field.group(2) else
                           argv[i + 1] if i + 1 < len(argv) else None)  # fmt: skip
        if field and value == "None" and field.group(1) in allowed:
            last[field.group(1)] = None
            i += 1 if field.group(2) else 2
            continue
        if field:
            last[field.group(1)] = arg
        kept.append(arg)
        i += 1
    return kept, [name for name, value in last.items() if value is None]


def _set_none(config: Any, names: Sequence[str]) -> None:
    """Sets each field (one whose default is None, from ``_take_none``) to None.

    ConfigDict's own dotted update, as ``harness.load_config`` uses: a config without the
    field raises ``KeyError``, which ``_parse_flags`` reports as an unknown field.
    """
    config.update_from_flattened_dict({name: None for name in names})


def _parse_flags(argv: list[str], none_fields: Sequence[str] = ()) -> list[str]:
    """absl's parser, with bad flags raised as ``ValueError`` (exit 2, no traceback).

    ``none_fields`` (from ``_take_none``) are set to None after parsing.
    """
    _check_config_file(argv)
    # A second call in one process (tests) starts afresh: ml_collections defines the
    # --config.* override flags at each parse.
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:
        delattr(flags.FLAGS, name)
    if flags.FLAGS.is_parsed():
        flags.FLAGS.unparse_flags()
    try:
        rest = flags.FLAGS(argv)
        _set_none(flags.FLAGS.config, none_fields)
    except flags.Error as err:
        raise ValueError(_config_file(argv)[0] or _clean_flag_error(str(err))) from err
    except (AttributeError, KeyError) as err:  # ml_collections: an unknown --config.<field>
        problem, other = _config_file(argv)  # or the file fails, or is another experiment's
        raise ValueError(problem or other or _unknown_field(err, argv)) from err
    except Exception as err:  # raised by the config file itself (SyntaxError, ImportError...)
        problem = _config_file(argv)[0]
        if problem is None:
            raise
        raise ValueError(problem) from err
    if len(rest) > 1:  # absl hands back what it did not parse; it was silently ignored
        raise ValueError(_stray_argument(rest[1]))
    return rest


def _stray_argument(arg: str) -> str:
    """``noloco-train configs/x.py config.num_steps=5``: say which flag was meant."""
    hint = ("" if arg.startswith("-") else f" Did you mean --config={arg}?" if arg.endswith(".py")
            else f" Did you mean --{arg}?" if arg.startswith("config.") else "")  # fmt: skip
    return f"unexpected argument {arg!r}: {PROG} takes only flags.{hint}"


def _check_config_file(argv: Sequence[str]) -> None:
    """A --config that names no file is an error now, not at its first use."""
    for path, value in _config_args(argv):
        if not pathlib.Path(path).is_file():
            raise FileNotFoundError(
                f"--config={value}: no such config file (the project's configs are "
                f"in {_REPO / 'configs'}).")  # fmt: skip
        names = _top_level_names(pathlib.Path(path))
        if names is not None and "get_config" not in names:
            # (else the default config's get_config, loaded first, was used silently)
            raise ValueError(f"--config={value}: the file defines no get_config(); a "
                             f"config file returns its ConfigDict from get_config().")


def _config_file(argv: Sequence[str]) -> tuple[str | None, str | None]:
    """After absl's parse failed, the last --config file (absl's) run once more: (why it fails
    to load, or None; whether it is another experiment's config, or None). absl gave a 40-line
    traceback, or called either an unknown field."""
    found = _config_args(argv)
    if not found:
        return None, None
    problem, config = _run_config_file(pathlib.Path(found[-1][0]), found[-1][1])
    return problem, None if config is None else _not_a_trainer_config(config, found[-1][0])


def _run_config_file(path: pathlib.Path, value: str) -> tuple[str | None, Any]:
    """(What is wrong with the file, or None; its config): get_config() run as absl would."""
    import importlib.util  # noqa: PLC0415
    import traceback  # noqa: PLC0415

    variant = value.split(":", 1)[1] if ":" in value else None
    name = "_noloco_config_check"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # as a loaded module is (dataclasses look it up)
        try:
            spec.loader.exec_module(module)
            config = module.get_config() if variant is None else module.get_config(variant)
        finally:
            sys.modules.pop(name, None)
    except Exception as err:  # noqa: BLE001 - whatever the file raises, say where
        lines = [f.lineno for f in traceback.extract_tb(err.__traceback__)
                 if pathlib.Path(f.filename).resolve() == path.resolve()]  # fmt: skip
        where = f" (line {lines[-1]})" if lines and not isinstance(err, SyntaxError) else ""
        return f"--config={value}: the file fails to load{where}: {type(err).__name__}: {err}", None
    import ml_collections  # noqa: PLC0415

    if not isinstance(config, (ml_collections.ConfigDict, dict)):
        return (f"--config={value}: get_config() returned {type(config).__name__}, not a "
                f"ml_collections.ConfigDict."), None
    return None, config


def _config_args(argv: Sequence[str]) -> list[tuple[str, str]]:
    """(file, value) of each ``--config=FILE[:variant]`` or ``--config FILE[:variant]`` (absl
    takes both) in ``argv``, in order."""
    values = []
    for i, arg in enumerate(argv):
        m = re.match(r"^--?config(=(.*))?$", arg)
        if m and (m.group(1) or i + 1 < len(argv)):
            values.append(m.group(2) if m.group(1) else argv[i + 1])
    return [(v.split(":", 1)[0], v) for v in values]


def _top_level_names(path: pathlib.Path) -> set[str] | None:
    """Names a Python file binds at module level; None when that cannot be told from the
    syntax (a star import, a definition inside if/try, a syntax error the loader reports)."""
    import ast  # noqa: PLC0415

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif not isinstance(node, ast.Expr):  # a docstring binds nothing
            return None
    return names


def _clean_flag_error(text: str) -> str:
    """A config file that fails to load: keep the last line of its traceback."""
    if "Error whilst parsing config file" in text:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return f"{lines[0].split(':')[0]}: {lines[-1]}" if lines else text
    return text


def _unknown_field(err: BaseException, argv: Sequence[str]) -> str:
    """``--config.num_replica=3``: name the flag and the closest field."""
    inner: Any = err
    while isinstance(inner, BaseException) and inner.args:
        inner = inner.args[0]
    text = str(inner)
    name = re.match(r"'?([\w]+)'?", text)
    guess = re.search(r'Did you mean "(\w+)"', text)
    # the flag up to the unknown name: --config.nosuch.deep=3 names config.nosuch
    pattern = rf"^--?((no)?config\.(\w+\.)*?{name.group(1)})([=.]|$)" if name else None
    bad = next((m.group(1) for m in (re.match(pattern, a) for a in argv) if m),
               None) if pattern else None  # fmt: skip
    flag = bad or f"config...{name.group(1) if name else text}"
    message = f"unknown config field --{flag}"
    if guess:
        return message + f"; did you mean --{flag.rsplit('.', 1)[0]}.{guess.group(1)}?"
    return message + "."


def _out_of_memory(err: BaseException) -> RuntimeError | None:
    """XLA's out-of-memory error, restated with the settings that lower memory; else None."""
    text = str(err).strip()
    if type(err).__name__ not in ("JaxRuntimeError", "XlaRuntimeError") or (
            not text.startswith("RESOURCE_EXHAUSTED")):  # fmt: skip
        return None
    return RuntimeError(
        f"out of device memory ({text.splitlines()[0][:200]}). The memory check before the "
        f"run counts the weights and optimizer state only; activations come on top. Lower "
        f"config.global_batch_size or config.data.seq_len, set config.model.remat=True, use a "
        f"smaller config.model.preset, or split each replica over devices (config.mesh.fsdp).")


def _report(err: BaseException) -> None:
    """The one- or two-line report of a user error."""
    message = str(err).strip() or type(err).__name__
    if isinstance(err, FileNotFoundError) and err.filename and str(err.filename) not in message:
        message = f"{message}: {err.filename}"
    print(f"{PROG}: error: {message}", file=sys.stderr)
    print(f"({PROG} --help lists the flags and config fields; --debug shows the traceback.)",
          file=sys.stderr)  # fmt: skip


def cli(argv: Sequence[str] | None = None) -> int:
    """Runs the command line ``argv`` (``sys.argv`` if None); returns the exit status.

    Args:
      argv: program name and arguments, as ``sys.argv``.

    Returns:
      0 on success or ``--help``, 2 for a user error, 1 for a failed run (a save that
      could not be written, a diverged run, ...). A bug raises its exception.
    """
    argv = list(sys.argv if argv is None else argv)
    _join_tried.clear()  # a call of its own: an earlier call's join told other processes
    debug = any(a in _DEBUG_ARGS for a in argv[1:])
    if not any(re.match(r"^--?config(=|$)", a) for a in argv[1:]):
        argv.insert(1, f"--config={_REPO / 'configs' / 'tiny_noloco.py'}")
    saved = sys.argv
    try:
        sys.argv = argv[:1]  # --config's default is read without the overrides
        _define_flags()
        argv, none_fields = _take_none(argv)
        sys.argv = argv  # ml_collections reads the --config.* overrides from sys.argv
        if any(a in _HELP_ARGS for a in argv[1:]):
            return _print_help()
        app.run(main, argv=argv, flags_parser=functools.partial(_parse_flags,
                                                                 none_fields=none_fields))
    except SystemExit as done:
        if any(a in ("--helpfull", "-helpfull") for a in argv[1:]):
            return 0  # absl exits 1 after its full help
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except _user_errors() as err:
        if not debug:
            _report(err)
        _tell_others(argv, err)
        if debug:
            raise
        return USAGE_ERROR_EXIT
    except _run_failures() as err:  # the run or its machine failed; the message says what
        if debug:  # was kept, so a traceback adds nothing
            raise
        _report(err)
        return RUN_FAILURE_EXIT
    except RuntimeError as err:
        oom = None if debug else _out_of_memory(err)
        if oom is None:
            raise
        _report(oom)
        return RUN_FAILURE_EXIT
    finally:
        sys.argv = saved
    return 0


def _print_help() -> int:
    try:
        print(help_text(), flush=True)
    except BrokenPipeError:  # `noloco-train --help | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def run() -> None:
    """Console-script entry point."""
    gc.set_threshold(*GC_THRESHOLD)  # the process is this program's
    try:
        code = cli()
    except BaseException:  # a bug (traceback) or a second Ctrl-C: the same barrier applies
        if not _joined_others():
            raise
        import traceback  # noqa: PLC0415

        traceback.print_exc()
        code = 130 if isinstance(sys.exc_info()[1], KeyboardInterrupt) else RUN_FAILURE_EXIT
    if code and _joined_others():
        # Leave without jax.distributed's shutdown barrier, which would wait (300 s) for
        # processes that may be stuck in a collective this one left: once it is gone, the
        # runtime's health check stops them too.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _joined_others() -> bool:
    jax = sys.modules.get("jax")  # imported by then if this process joined others
    return jax is not None and jax.distributed.is_initialized()


# ---------------------------------------------------------------- --help


def help_text() -> str:
    """Usage, this program's flags and every config field with its default and meaning.

    The fields, defaults and meanings come from ``noloco_jax.defaults.FIELDS``, the one
    place they are written, grouped as there.
    """
    from noloco_jax import defaults  # noqa: PLC0415

    lines = [
        f"{PROG}: trains replicas of a Llama with NoLoCo, DiLoCo or data parallel.",
        "",
        f"usage: {PROG} --config=configs/tiny_noloco.py[:quick] --workdir=DIR "
        "[--config.FIELD=VALUE ...]",
        "       (re-running with the same --workdir resumes the run)",
        "",
        "flags:",
    ]
    for name in _PROJECT_FLAGS:
        f = flags.FLAGS[name]
        lines.append(_entry(f"--{name}", _flag_default(f), f.help))
    lines.append(_entry("--helpfull", "",
                        "This program's flags and absl's own (not the config fields)."))
    lines += ["", "config fields (--config.FIELD=VALUE; defaults of noloco_jax/defaults.py, which",
              "a config file may change):"]  # fmt: skip
    for section, title in defaults.GROUPS:
        lines += ["", f" {title}"]
        for name, default, meaning in defaults.FIELDS:
            if name.rpartition(".")[0] == section:
                lines.append(_entry(f"--config.{name}", repr(default), meaning))
    return "\n".join(lines)


def _flag_default(f: Any) -> str:
    if f.name == "config":
        return str(pathlib.Path(f.default_as_str.strip("'")).relative_to(_REPO)) \
            if str(_REPO) in f.default_as_str else f.default_as_str  # fmt: skip
    return "" if f.default is None else repr(f.default)


def _entry(name: str, default: str, meaning: str, width: int = 38, total: int = 100) -> str:
    """``  --name=default   meaning``, the meaning wrapped into a column from ``width``."""
    left = f"  {name}={default}" if default else f"  {name}"
    wrapped = textwrap.wrap(" ".join(meaning.split()), total - width - 1) or [""]
    rows = [f"{'':<{width}} {w}" for w in wrapped]
    if len(left) < width:
        rows[0] = f"{left:<{width}} {wrapped[0]}"
    else:
        rows.insert(0, left)
    return "\n".join(rows)


if __name__ == "__main__":
    run()
