"""Code-shape rules of issue 18 that a refactor must keep."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "noloco_jax"


def test_no_trainer_function_is_longer_than_50_lines():
    long = []
    for path in sorted((PACKAGE / "trainer").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 50:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert not long, long


def test_one_train_step():
    """train_step is defined once; the pipeline has no train step of its own."""
    defs = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.FunctionDef) and n.name == "train_step"]  # fmt: skip
    assert defs == ["trainer/step.py"], defs


# A probe of the model's cuDNN check, run by hand on a GPU: it reads the private functions on
# purpose (what the model consults is what it measures).
_READS_PRIVATE_ON_PURPOSE = {("experiments/gpu_runs/cudnn_probe.py", "llama._cudnn_attention"),
                             ("experiments/gpu_runs/cudnn_probe.py", "llama._cudnn_compiles")}
_NAMEDTUPLE_API = {"_asdict", "_replace", "_fields", "_make"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in _NAMEDTUPLE_API


def _private_uses(path: pathlib.Path, root: pathlib.Path) -> list[str]:
    """``module._name`` and ``from module import _name`` of another module of the project; a
    private module (``pkg._mod``) is open to the modules of its own package."""
    rel = path.relative_to(root).as_posix()
    own_package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found, bound = [], set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                "noloco_jax", "experiments"):
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if _private(alias.name) and not (node.module == own_package
                                                 and alias.name[1:].isidentifier()
                                                 and (root / node.module.replace(".", "/")
                                                      / f"{alias.name}.py").exists()):
                    found.append(f"{rel}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("noloco_jax", "experiments"):
                    bound.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and _private(node.attr)):
            use = f"{node.value.id}.{node.attr}"
            if (rel, use) not in _READS_PRIVATE_ON_PURPOSE:
                found.append(f"{rel}:{node.lineno}: {use}")
    return found


def test_no_module_reads_another_modules_private_names():
    """An underscore name is its module's own (a private module, its package's): what another
    module needs is public, with a docstring, so a change to it is seen as an API change."""
    root = PACKAGE.parent
    paths = [*sorted(PACKAGE.rglob("*.py")), *sorted((root / "experiments").rglob("*.py"))]
    found = [use for p in paths for use in _private_uses(p, root)]
    assert not found, found
