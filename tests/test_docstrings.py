"""The docstring examples of the public optimizer API run as written (the first path a user takes)."""

import doctest
import importlib

import pytest

from noloco_jax import comm, determinism, metrics, replicas
from noloco_jax.data import sources
from noloco_jax.experiments import provenance, stats
from noloco_jax.trainer import aot

_OPTIM = [importlib.import_module(f"noloco_jax.optim.{m}")
          for m in ("local_steps", "noloco", "diloco", "clipping", "fragments")]  # fmt: skip


@pytest.mark.parametrize("module", [*_OPTIM, comm, replicas, metrics, stats, aot, determinism,
                                    sources, provenance],
                         ids=lambda m: m.__name__)  # fmt: skip
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0, module.__name__  # conftest gives 8 devices, replicas' needs
    assert result.failed == 0, module.__name__
