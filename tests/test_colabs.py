"""Every colab runs top to bottom with smoke settings, and is committed without outputs."""

import ast
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers import prepare_corpus

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colabs").glob("*.ipynb"))


def test_there_are_the_four_colabs():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "network_model", "table2_miniature",
                                           "own_loop"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs_and_without_redefining_the_model(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)
    source = "\n".join(c.source for c in code)
    assert "nnx.Module" not in source and "GradientTransformation(" not in source


# table2_miniature drives experiments.table2, which test_table2_smoke runs in the default
# suite; executing its notebook too is left to -m slow to keep the suite near ten minutes.
EXECUTED = [pytest.param(p, marks=pytest.mark.slow) if p.stem == "table2_miniature" else p
            for p in NOTEBOOKS]  # fmt: skip


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: p.stem)
def test_colab_executes_with_smoke_settings(path, tmp_path, monkeypatch, corpus_dir, data_dir):
    # One corpus and data dir for the file's notebooks, stored here once (TensorFlow's import
    # and the writing, ~5 s): the notebooks read it back.
    prepare_corpus(corpus_dir, data_dir)
    monkeypatch.setenv("NOLOCO_COLAB_SMOKE", "1")
    monkeypatch.setenv("NOLOCO_COLAB_DATA", str(corpus_dir))
    monkeypatch.setenv("NOLOCO_COLAB_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setenv("NOLOCO_DATA_DIR", str(data_dir))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )  # fmt: skip
    client.execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert os.environ["NOLOCO_COLAB_SMOKE"] == "1"
    if path.stem == "own_loop":
        _check_own_loop(nb)


def _check_own_loop(nb) -> None:
    """The hand-written loop's replicas behave as each method says at a sync step."""
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    spread = {m.group(1): float(m.group(2))
              for m in re.finditer(r"^(\w+) +step 8: .*replica spread (\S+)$", text, re.M)}
    assert spread.keys() == {"NoLoCo", "DiLoCo", "DP"}, text
    assert spread["DP"] == 0.0  # one gradient mean: identical replicas, bit for bit
    assert spread["DiLoCo"] < 1e-8  # one phi; theta lands within a float32 rounding of it
    assert spread["NoLoCo"] > 1e-5  # pairs only: the replicas stay apart
    assert "round 0: [[" in text


# ---------------------------------------------------------------- the first cell: setup


def test_readme_quotes_the_jax_pin_of_setup_cfg():
    """colabs/README.md said an installed jax is replaced outside >=0.10.2,<0.11 while
    setup.cfg pins <0.12 (and keeps Colab's 0.11): the cell's pip follows setup.cfg."""
    pin = re.search(r"^\s+(jax>=[^\s]+)$", (ROOT / "setup.cfg").read_text(), re.M).group(1)
    quoted = re.findall(r"`(jax>=[^`]+)`", (ROOT / "colabs" / "README.md").read_text())
    assert quoted == [pin], (quoted, pin)


def _first_cell(path=ROOT / "colabs" / "quickstart.ipynb") -> str:
    nb = nbformat.read(path, as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code")


def test_first_cell_is_the_same_runnable_python_in_every_colab():
    cells = {p.stem: _first_cell(p) for p in NOTEBOOKS}
    assert len(set(cells.values())) == 1, "the setup cells differ"
    cell = cells["quickstart"]
    ast.parse(cell)  # plain Python: no shell (!) or magic (%) lines
    assert "<" not in cell.replace("<=", "") and "!" not in cell.replace("!=", "")
    assert "sys.path" not in cell  # imports resolve from the repository root, as python -m
    # A fresh install cannot import the package in the process that installed it (810b4a7).
    nodes = list(ast.walk(ast.parse(cell)))
    imported = [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module for n in nodes if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m and m.split(".")[0] == "noloco_jax"], imported


def _setup_functions(monkeypatch, installed: bool, tensorflow: bool) -> tuple[dict, list]:
    """The first cell's functions, with pip and the installed packages faked."""
    tree = ast.parse(_first_cell())
    defs = ast.Module([n for n in tree.body if isinstance(n, (ast.Import, ast.FunctionDef))], [])
    namespace: dict = {}
    exec(compile(defs, "first_cell", "exec"), namespace)  # noqa: S102
    calls: list = []

    def version(name):
        if installed:
            return "0.1.0"
        raise importlib.metadata.PackageNotFoundError(name)

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: (object() if tensorflow else None) if n == "tensorflow"
                        else real_find_spec(n, *a))  # fmt: skip
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    return namespace, calls


@pytest.mark.parametrize("given, expected", [
    ("", "--xla_gpu_deterministic_ops=true"),
    ("--xla_force_host_platform_device_count=8",
     "--xla_force_host_platform_device_count=8 --xla_gpu_deterministic_ops=true"),
    ("--xla_gpu_deterministic_ops=false", "--xla_gpu_deterministic_ops=false"),  # the user's
])  # fmt: skip
def test_first_cell_asks_for_deterministic_gpu_ops_before_jax_starts(monkeypatch, given, expected):
    """GPU runs of one seed agree only with XLA's deterministic ops, read when JAX starts: the
    first cell is the only place a notebook can ask. (It imported noloco_jax for it, which a
    fresh install cannot do in the process that installed it: the slow venv test failed.)"""
    tree = ast.parse(_first_cell())
    ifs = [n for n in tree.body if isinstance(n, ast.If) and "xla_gpu_deterministic_ops"
           in ast.unparse(n)]  # fmt: skip
    assert len(ifs) == 1 and "noloco_jax" not in ast.unparse(ifs[0])
    monkeypatch.setenv("XLA_FLAGS", given)
    exec(compile(ast.Module(ifs, []), "first_cell", "exec"), {"os": os})  # noqa: S102
    assert os.environ["XLA_FLAGS"] == expected


@pytest.mark.parametrize("installed,tensorflow,expected", [
    (False, False, "[tf]"), (False, True, ""), (True, False, None), (True, True, None)])
def test_first_cell_adds_tensorflow_cpu_only_where_no_tensorflow_is(
        monkeypatch, installed, tensorflow, expected):  # fmt: skip
    namespace, calls = _setup_functions(monkeypatch, installed, tensorflow)
    monkeypatch.chdir(ROOT / "colabs")
    root = namespace["find_repository"]()
    assert root == ROOT
    message = namespace["install"](root)
    if expected is None:
        assert calls == [] and "is installed" in message
    else:
        assert len(calls) == 1 and calls[0][-1] == f"{ROOT}{expected}", calls
        assert calls[0][1:5] == ["-m", "pip", "install", "-q"]


def test_first_cell_says_where_to_put_the_repository(monkeypatch, tmp_path):
    namespace, _ = _setup_functions(monkeypatch, False, False)
    monkeypatch.chdir(tmp_path)
    if pathlib.Path("/content/noloco_jax/setup.cfg").exists():
        pytest.skip("a repository at /content/noloco_jax")
    with pytest.raises(FileNotFoundError, match="/content/noloco_jax"):
        namespace["find_repository"]()


@pytest.mark.slow  # a fresh venv: pip installs TensorFlow and the project (minutes, ~2 GB)
def test_first_cell_keeps_an_installed_tensorflow_in_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "tensorflow"], check=True, timeout=1800)

    def show(name):
        out = subprocess.run([py, "-m", "pip", "show", name], capture_output=True, text=True)
        return out.stdout if out.returncode == 0 else None

    before = show("tensorflow")
    assert before and show("tensorflow-cpu") is None
    repo = tmp_path / "repo"  # a copy: the editable install writes its egg-info there
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "*.egg-info", "__pycache__", ".pytest_cache"))  # fmt: skip
    cell = tmp_path / "first_cell.py"
    cell.write_text(_first_cell())
    for attempt in range(2):  # the second run finds the install and does nothing
        out = subprocess.run([py, str(cell)], cwd=repo / "colabs", capture_output=True, text=True,
                             timeout=1800)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        expected = "keeping the installed TensorFlow" if attempt == 0 else "is installed"
        assert expected in out.stdout, out.stdout
    assert show("tensorflow") == before and show("tensorflow-cpu") is None
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(f"document {i} " * 200)
    check = ("import sys, pathlib; from noloco_jax import data; "
             "c = data.load_corpus('files', path=sys.argv[1], data_dir=pathlib.Path(sys.argv[2]));"
             " print(len(c.train), len(c.validation))")  # fmt: skip
    out = subprocess.run([py, "-c", check, str(corpus), str(tmp_path / "data")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0 and out.stdout.split()[-2:] == ["2", "1"], out.stderr[-3000:]


def test_table2_notebook_shows_the_curve_as_an_image(tmp_path, monkeypatch):
    """The notebook promises the relative-difference curve, but the report's markdown links it
    relative to opts.out_dir ("table2_fig3a.png"), which a notebook resolves against its own
    folder (Colab not at all): a broken image. The last cell now displays the PNG itself."""
    import IPython.display  # noqa: PLC0415

    from noloco_jax.experiments import harness  # noqa: PLC0415

    nb = nbformat.read(ROOT / "colabs" / "table2_miniature.ipynb", as_version=4)
    last = [c.source for c in nb.cells if c.cell_type == "code"][-1]
    opts = harness.Options(smoke=True, runs_dir=tmp_path / "runs", out_dir=tmp_path / "results")
    png = harness.figure_path(opts, "table2_fig3a")
    png.write_bytes(b"\x89PNG\r\n\x1a\n the curve")
    shown: list = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.extend(objs))
    markdown = f"![Fig. 3A in miniature]({harness.figure_link(opts, png)})"
    exec(last, {"harness": harness, "opts": opts, "markdown": markdown})  # noqa: S102
    images = [o for o in shown if isinstance(o, IPython.display.Image)]
    assert [i.data for i in images] == [png.read_bytes()], shown
