"""The flags that several experiment and benchmark scripts share, defined once.

absl flags live in one process-wide registry, so a flag that two scripts both read is
defined here and imported, never defined twice. Names are the trainer's style (``--out_dir``);
the hyphenated spellings of the former argparse scripts (``--out-dir``) still work. A script
lists the ones it reads with ``flags.declare_key_flag`` (so its ``--help`` shows them), calls
``start(argv)`` first in its ``main``, and turns the flags into the harness's options with
``grid_options()`` or ``out_dir()`` once ``app.run`` has parsed the command line. Scripts
start with ``options.run(main)``, which reports a user error as ``noloco-train`` does.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import shlex
import sys
from typing import Any, Callable, Iterable, Mapping, NoReturn, Sequence

from absl import app, flags, logging

from noloco_jax.errors import UserError
from noloco_jax.experiments import harness
from noloco_jax.train import RUN_FAILURE_EXIT, USAGE_ERROR_EXIT

SMOKE = flags.DEFINE_bool("smoke", False, "Seconds-long version, for tests.")
OUT_DIR = flags.DEFINE_string(
    "out_dir", None,
    "Where results go (default experiments/runs/results, git-ignored; experiments/results with "
    "--publish).")  # fmt: skip
PUBLISH = flags.DEFINE_bool(
    "publish", False,
    "Write the tracked experiments/results and experiments/figures (a given --out_dir wins).")
JOBS = flags.DEFINE_integer("jobs", 2, "Runs trained in parallel; 1 trains in this process.")
RUNS_DIR = flags.DEFINE_string(
    "runs_dir", None, "Where the runs train (default experiments/runs); finished runs are reused.")
DATA_PATH = flags.DEFINE_string("data_path", "", "Local text files instead of Shakespeare.")
DATA_DIR = flags.DEFINE_string("data_dir", "", "TFDS data dir and caches.")
REPORT_ONLY = flags.DEFINE_bool(
    "report_only", False, "Re-write the report from <out_dir>/<name>.json; train nothing.")
PART = flags.DEFINE_string(
    "part", "",
    "i/k: train only runs i, i + k, i + 2k, ... of the whole grid (e.g. 1/3; the same split "
    "on every call, finished runs skipped), for spreading a grid over several calls; the "
    "report is written once every run is done.")
DRY_RUN = flags.DEFINE_bool("dry_run", False, "List the grid's runs (done or to train); train "
                            "nothing.")


def old_spellings(*names: str) -> None:
    """Accepts ``--out-dir`` for ``--out_dir``: the former argparse spelling, kept out of --help.

    Args:
      names: flags defined already, with underscores.
    """
    for name in names:
        flags.DEFINE_alias(name.replace("_", "-"), name, module_name="argparse spellings")


old_spellings("out_dir", "runs_dir", "data_path", "data_dir", "report_only", "dry_run")

# The flags a script reads, for its flags.declare_key_flag calls.
OUT_FLAGS = ("smoke", "out_dir", "publish")
GRID_FLAGS = (*OUT_FLAGS, "jobs", "runs_dir", "data_path", "data_dir", "report_only", "part",
              "dry_run")


# Flags that say only where a run writes or reads its caches, how its runs are spread over
# processes or calls, or that it trains nothing: they change no number of a report, so the
# command a report shows (``command``) leaves them out, and no machine's paths reach the
# published pages. Every other flag a script defines changes what it computes or shows.
NOT_IN_COMMAND = frozenset({"out_dir", "publish", "runs_dir", "data_dir", "jobs", "part",
                            "dry_run", "report_only", "fig_dir", "worker"})  # fmt: skip


def command(module: str, *, values: Mapping[str, Any] | None = None,
            leave_out: Iterable[str] = ()) -> str:  # fmt: skip
    """The command that makes this run's report again: ``python -m module`` and its flags.

    Every flag of the experiment scripts (``experiments.*``, or the script run as ``python
    -m``) given on the command line with a value other than its default, except those of
    ``NOT_IN_COMMAND`` and ``leave_out``; as ``--name=value`` (``--name`` / ``--noname`` for a
    boolean, one ``--name=value`` per value of a repeatable flag), values shell-quoted,
    ``--smoke`` first and then by name.

    Args:
      module: the script, e.g. ``experiments.bench.compile_scale``.
      values: flags to show with this value whether given or not (e.g. a path shown relative
        to the checkout, or a flag the report's table needs whatever was given); None leaves
        the flag out.
      leave_out: more flags that change nothing the report shows.

    Returns:
      The command, one line.
    """
    values = dict(values or {})
    skip = NOT_IN_COMMAND | set(leave_out)
    main = sys.argv[0] if sys.argv else ""
    words: dict[str, list[str]] = {}
    for name in flags.FLAGS:
        flag = flags.FLAGS[name]
        where = flags.FLAGS.find_module_defining_flag(name) or ""
        if (flag.name != name or name in skip or name in values or not flag.present
                or flag.value == flag.default
                or not (where.startswith("experiments.") or where == main)):
            continue  # an alias or short name, not a script's, or not given
        if isinstance(flag, flags.BooleanFlag):
            words[name] = [f"--{'' if flag.value else 'no'}{name}"]
        else:
            words[name] = [f"--{name}={shlex.quote(line.partition('=')[2])}"
                           for line in flag.serialize().splitlines()]  # fmt: skip
    for name, value in values.items():
        if value is True or value is False:
            words[name] = [f"--{'' if value else 'no'}{name}"]
        elif value is not None:
            words[name] = [f"--{name}={shlex.quote(str(value))}"]
    order = sorted(words, key=lambda name: (name != "smoke", name))
    return " ".join(["python -m", module, *(w for name in order for w in words[name])])


def checked_folder(flag: str, path: pathlib.Path) -> pathlib.Path:
    """``path`` with ``~`` expanded (no shell expands it after ``--flag=``), refused now (not
    after the runs) when it or a folder above it is a file."""
    path = path.expanduser()
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise app.UsageError(f"--{flag}={path}: {folder} is a file, not a folder; name "
                                     f"a folder (it is made if missing).")
            break
    return path


def out_dir(default: pathlib.Path = harness.SCRATCH) -> pathlib.Path:
    """``--out_dir``, else experiments/results with ``--publish``, else ``default``."""
    if OUT_DIR.value:
        return checked_folder("out_dir", pathlib.Path(OUT_DIR.value))
    return harness.RESULTS if PUBLISH.value else default


def part() -> tuple[int, int] | None:
    """``--part i/k`` as (i, k); None when not given."""
    if not PART.value:
        return None
    try:
        i, k = (int(x) for x in PART.value.split("/"))
    except ValueError:
        raise app.UsageError(f"--part must be i/k (e.g. 2/3), got {PART.value!r}.") from None
    if not 1 <= i <= k:
        raise app.UsageError(f"--part i/k needs 1 <= i <= k, got {PART.value!r}.")
    return i, k


def grid_options() -> harness.Options:
    """The harness options the parsed flags ask for."""
    path = os.path.expanduser(DATA_PATH.value)  # as the trainer reads it (data/sources.py)
    if DATA_PATH.value and not REPORT_ONLY.value and not glob.glob(path, recursive=True):
        raise app.UsageError(f"--data_path={DATA_PATH.value}: no such file, directory or glob "
                             f"match (every run would fail on it).")
    return harness.Options(
        smoke=SMOKE.value,
        jobs=JOBS.value,
        runs_dir=checked_folder("runs_dir", pathlib.Path(RUNS_DIR.value)) if RUNS_DIR.value
        else harness.RUNS,
        out_dir=out_dir(),
        data_path=DATA_PATH.value,
        data_dir=DATA_DIR.value,
        report_only=REPORT_ONLY.value,
        part=part(),
        dry_run=DRY_RUN.value,
    )


def smoke_sets(*names: str) -> None:
    """Refuses ``names`` given with ``--smoke``, which sets them itself (they were ignored).

    Args:
      names: flags of the script that ``--smoke`` replaces with its own values.
    """
    given = [name for name in names if flags.FLAGS[name].present]
    if SMOKE.value and given:
        raise app.UsageError(f"{' '.join('--' + n for n in given)}: --smoke sets its own (a "
                             f"seconds-long version); drop them, or drop --smoke.")


def read_json(flag: str, path: str | pathlib.Path | None) -> Any:
    """The JSON file a flag names, or a ``UserError`` naming the flag (no file, not JSON).

    Args:
      flag: the flag's name, for the message.
      path: the file; ``~`` is expanded (no shell expands it after ``--flag=``).

    Returns:
      The parsed JSON.
    """
    if not path or not pathlib.Path(path).expanduser().is_file():
        raise UserError(f"--{flag}: no file {str(path or '')!r}; give the path of the .json an "
                        f"experiment wrote.")
    try:
        return json.loads(pathlib.Path(path).expanduser().read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"--{flag}: {path} is not JSON ({err}).") from None


def start(argv: Sequence[str]) -> None:
    """What a script's ``main`` does first: refuse words that are not flags, log quietly.

    ``app.run`` turns absl's logging up to INFO, where JAX, orbax and TFDS report every backend
    and file; like ``noloco-train``, the scripts log warnings and errors only unless
    ``--verbosity`` is given.

    Args:
      argv: what ``app.run`` passes ``main``: the program and the words that are not flags.
    """
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {list(argv[1:])}; every option is a --flag.")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


def train_grid(config: pathlib.Path, runs: list[harness.Run], opts: harness.Options, *,
               runs_subdir: str, name: str) -> dict | None:  # fmt: skip
    """``harness.run_grid``, or None (said on stdout) when ``--part`` or ``--dry_run`` left
    runs untrained: a script then writes no report."""
    try:
        return harness.run_grid(config, runs, opts, runs_subdir=runs_subdir, name=name)
    except harness.GridIncomplete as stop:
        print(stop, flush=True)
        return None


def run(main: Callable[[list[str]], Any]) -> None:
    """``app.run(main)``, with user errors reported in two lines and exit status 2.

    A bad or unknown flag, an ``app.UsageError`` or a ``UserError`` (a ``ValueError`` that
    names the field and what is allowed) prints the message and where the flags are listed,
    with no traceback and no listing of every flag. A run of the grid that failed
    (``harness.RUN_FAILURES``: diverged, a checkpoint that could not be written) prints its
    message, which names the run, and exits with status 1. Any other exception is a bug and
    keeps its traceback.

    ``--help`` (and ``--helpshort``, ``--helpfull``) exits 0 (absl exits 1 after it).

    Args:
      main: the script's ``main(argv)``.
    """
    sys.argv = [("--help" if a in ("-h", "-?") else a) for a in sys.argv]  # as noloco-train
    try:
        app.run(_reporting(main), flags_parser=_parse_flags)
    except SystemExit as done:
        asked = any(a.lstrip("-") in ("help", "helpshort", "helpfull", "h", "?")
                    for a in sys.argv[1:])  # fmt: skip
        if asked and done.code == 1:
            raise SystemExit(0) from None
        raise


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        _refuse(str(err))


def _reporting(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
    def wrapped(argv: list[str]) -> Any:
        try:
            _check_shared_flags()
            return main(argv)
        except (app.UsageError, UserError) as err:
            _refuse(str(err))
        except harness.RUN_FAILURES as err:  # a run diverged or could not save: no bug
            _failed(str(err))

    return wrapped


def _check_shared_flags() -> None:
    """Refuses a shared flag the script does not read (it would be ignored: ``--dry_run``
    would train) and ``--smoke --publish`` (smoke numbers over the published pages)."""
    read = {f.name for f in flags.FLAGS.get_key_flags_for_module(sys.argv[0])}
    given = [name for name in GRID_FLAGS if flags.FLAGS[name].present]
    unread = [name for name in given if name not in read]
    if unread:
        listed = " ".join(f"--{name}" for name in GRID_FLAGS if name in read) or "none"
        raise app.UsageError(f"{' '.join('--' + n for n in unread)}: this script does not read "
                             f"it, so it would be ignored (the shared flags it reads: {listed}).")
    if SMOKE.value and PUBLISH.value and not OUT_DIR.value:
        raise app.UsageError("--smoke with --publish would overwrite the published results with "
                             "smoke numbers; give --out_dir=DIR for a smoke run's pages.")


def _failed(message: str) -> NoReturn:
    """Prints ``<script>: error: <message>`` for a run that failed and exits with status 1."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    script = spec.name if spec is not None else pathlib.Path(sys.argv[0]).stem
    print(f"{script.rpartition('.')[2]}: error: {message.strip()}", file=sys.stderr)
    sys.exit(RUN_FAILURE_EXIT)


def _refuse(message: str) -> NoReturn:
    """Prints ``<script>: error: <message>`` and the pointer to --help; exits with status 2."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    script = spec.name if spec is not None else pathlib.Path(sys.argv[0]).stem
    command = f"python -m {spec.name}" if spec is not None else sys.argv[0]
    print(f"{script.rpartition('.')[2]}: error: {message.strip()}", file=sys.stderr)
    print(f"({command} --help lists the flags.)", file=sys.stderr)
    sys.exit(USAGE_ERROR_EXIT)
