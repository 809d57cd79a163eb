"""The project frame: README commands, CI script, top-level layout."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [b.strip() for b in blocks]


def test_ci_runs_exactly_the_readme_test_command():
    test_cmds = [c for c in _readme_commands() if "pytest" in c]
    assert len(test_cmds) == 1, test_cmds
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmds[0] in ci


def test_readme_main_job_command_exists_and_points_at_real_files():
    main_cmds = [c for c in _readme_commands() if "pytest" not in c and "pip install" in c]
    assert main_cmds, "README must give the main-job command"
    paths = re.findall(r"python (\S+\.py)", main_cmds[0])
    paths += re.findall(r"--config=(\S+\.py)", main_cmds[0])
    assert paths
    for path in paths:
        assert (ROOT / path).is_file(), path


def test_top_level_folders_exist():
    for name in ["noloco_jax", "experiments", "configs", "tests", "colabs"]:
        assert (ROOT / name).is_dir(), name
        assert any((ROOT / name).iterdir()), f"{name}/ is empty"
    assert (ROOT / "setup.cfg").is_file() and (ROOT / "pyproject.toml").is_file()


# sys.path changed in code: insert/append/extend/remove, or an assignment to it.
_PATH_EDIT = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend|remove)\s*\(|\+?=[^=])")


def test_nothing_edits_sys_path():
    """Imports resolve from the repository root (python -m) or the installed project alone."""
    skip = {".git", ".venv", "runs", "__pycache__"}
    files = [p for ext in ("py", "ipynb") for p in ROOT.rglob(f"*.{ext}")
             if not skip & set(p.relative_to(ROOT).parts)]  # fmt: skip
    assert len(files) > 50
    edits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files
             for m in _PATH_EDIT.finditer(p.read_text(encoding="utf-8"))]  # fmt: skip
    assert edits == []


def test_accelerator_extras_pin_the_same_jax_as_the_install():
    """``.[cuda12]``, ``.[cuda13]`` and ``.[tpu]`` must not pull a jax other than the pinned one."""
    import configparser  # noqa: PLC0415

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    pins = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
    jax_range = next(r for r in pins if r.startswith("jax>="))[len("jax"):]
    extras = cfg["options.extras_require"]
    for name in ("cuda12", "cuda13", "tpu"):
        assert extras[name].split() == [f"jax[{name}]{jax_range}"], name


def test_sdist_manifest_carries_the_tests_experiments_and_colabs(monkeypatch):
    """setuptools' sdist held only the packages: no tests/ for the README's pytest command,
    no experiments/ the tests import, no colabs/ or .ci/run."""
    egg_info = pytest.importorskip("setuptools.command.egg_info", reason="needs setuptools")
    monkeypatch.chdir(ROOT)  # MANIFEST.in's paths are relative to the project
    manifest = egg_info.FileList()
    for line in (ROOT / "MANIFEST.in").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            manifest.process_template_line(line)
    files = [p.relative_to(ROOT) for d in ("tests", "experiments", "colabs", ".ci")
             for p in (ROOT / d).rglob("*") if p.is_file()]  # fmt: skip
    needed = {str(p) for p in files if p.parts[:2] != ("experiments", "runs")  # git-ignored
              and not {"__pycache__", ".ipynb_checkpoints"} & set(p.parts)}  # fmt: skip
    assert "tests/conftest.py" in needed and "experiments/__init__.py" in needed
    assert sorted(needed - set(manifest.files)) == []
