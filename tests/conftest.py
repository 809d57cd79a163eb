"""Test setup: 8 simulated CPU devices, configured before JAX initialises."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# Many tests compile the same tiny programs (each train_and_evaluate builds fresh
# closures); a compilation cache shared by the session's workers avoids recompiling them.
# It only skips XLA compilation: the programs, and so the results, are the same.
_CACHE = os.path.join(os.environ.get("PYTEST_JAX_CACHE_DIR", "/tmp"), "noloco_jax_test_xla_cache")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
