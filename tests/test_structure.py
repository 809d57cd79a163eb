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
