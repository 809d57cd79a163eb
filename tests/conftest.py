"""Test setup: 8 simulated CPU devices, configured before JAX initialises."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")



import pytest  # noqa: E402


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A small local corpus the project makes itself: Python's bundled help topics."""
    from pydoc_data.topics import topics  # noqa: PLC0415

    d = tmp_path_factory.mktemp("corpus")
    for i, (name, text) in enumerate(sorted(topics.items())[:40]):
        (d / f"{i:02d}_{name}.txt").write_text(text, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A TFDS data dir and cache of one test module's own."""
    return tmp_path_factory.mktemp("data")
