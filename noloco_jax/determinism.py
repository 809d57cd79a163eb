"""Run-to-run determinism on GPUs: the same seed gives the same numbers.

XLA's GPU backend does not keep the order of its floating-point sums from run to run
(atomic scatter-adds, for one), so two runs of one config drift apart from the first steps:
on one H100 two runs of the mini model (data parallel, float32, 300 steps) ended at
validation perplexity 5.768 and 5.690. XLA's ``--xla_gpu_deterministic_ops`` removes that:
two runs agree in every logged number, at 0.89–0.90 of the speed in float32 and 0.94–0.95 in
bfloat16 (``experiments/results/gpu_determinism_h100.md``). CPUs and TPUs are deterministic
either way and ignore the flag.

The flag is read when JAX starts its GPU backend, so it must be in ``XLA_FLAGS`` before then:
``noloco-train`` and the experiment harness call ``request`` first (the colabs' first cell
sets the flag itself, before the package is importable); a script that has already used a
GPU gets the trainer's warning (``unmet``) with the fix.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

from noloco_jax.errors import UserError, check_bool

__all__ = ["FLAG", "xla_flags", "request", "unmet", "warning"]

FLAG = "--xla_gpu_deterministic_ops"
_SET = re.compile(rf"(?:^|\s){FLAG}(?:=(\S*))?(?=\s|$)")
_TRUE, _FALSE = ("true", "1", ""), ("false", "0")


def _flag_value(flags: str) -> bool | None:
    """The flag's value in ``flags`` (``_flags_in``'s text; the last one wins), None when absent."""
    values = _SET.findall(flags)
    if not values:
        return None
    value = values[-1].lower()
    if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]  # XLA takes quoted values: --flag="true"
    if value not in _TRUE + _FALSE:
        raise UserError(f"XLA_FLAGS sets {FLAG}={values[-1]!r}; use true or false.")
    return value in _TRUE


def _flags_in(flags_text: str) -> str:
    """The flags of an ``XLA_FLAGS`` value: XLA reads one that does not start with '-' as the
    name of a file of flags."""
    if not flags_text.strip() or flags_text.lstrip().startswith("-"):
        return flags_text
    try:
        return pathlib.Path(flags_text).read_text()
    except (OSError, ValueError) as err:
        raise UserError(
            f"XLA_FLAGS={flags_text!r} does not start with '-', so XLA reads it as "
            f"the name of a file of flags, which cannot be read: {err}"
        ) from None


def xla_flags(deterministic: bool, flags_text: str) -> str:
    """``flags_text`` (an ``XLA_FLAGS`` value) with the flag added when ``deterministic``.

    Args:
      deterministic: the run's ``config.deterministic``. False adds nothing: XLA's default
        (or the flag as ``XLA_FLAGS`` gives it) decides.
      flags_text: the ``XLA_FLAGS`` the process was given ("" when unset).

    Returns:
      ``flags_text`` with ``FLAG=true`` appended when ``deterministic`` and it does not name
      the flag (when ``flags_text`` names a file of flags, as XLA allows: the file's flags
      with it appended); otherwise ``flags_text`` unchanged.

    Raises:
      UserError: ``deterministic`` but ``XLA_FLAGS`` sets the flag to false, or
        ``deterministic`` not True or False.

    Example:
      >>> xla_flags(True, "--xla_force_host_platform_device_count=8")
      '--xla_force_host_platform_device_count=8 --xla_gpu_deterministic_ops=true'
    """
    check_bool("deterministic", deterministic)  # "no" was truthy: the flag was added
    flags = _flags_in(flags_text)
    given = _flag_value(flags)
    if not deterministic or given:
        return flags_text
    if given is None:
        return f"{flags} {FLAG}=true".strip()
    raise UserError(
        f"config.deterministic=True but XLA_FLAGS sets {FLAG}=false: drop the flag from "
        f"XLA_FLAGS or set config.deterministic=False.")  # fmt: skip


def request(deterministic: bool) -> None:
    """Puts ``config.deterministic`` into ``XLA_FLAGS`` if JAX has started no backend yet.

    XLA reads ``XLA_FLAGS`` once, when the first backend starts; after that the variable is
    left as it is (a contradicting flag is still refused), so ``warning`` still sees that the
    flag is missing and says so.
    """
    flags_text = xla_flags(deterministic, os.environ.get("XLA_FLAGS", ""))
    if not _backend_started():
        os.environ["XLA_FLAGS"] = flags_text


def unmet(deterministic: bool, platform: str, flags_text: str) -> str | None:
    """Why a run asked to be deterministic will not be (a GPU without the flag), else None."""
    check_bool("deterministic", deterministic)  # "no" was truthy: a warning for a GPU run
    if not deterministic or platform != "gpu" or _flag_value(_flags_in(flags_text)):
        return None
    return (f"config.deterministic=True, but JAX started its GPU backend without {FLAG}=true, "
            "so runs of one seed will differ (the GPU sums in any order). Set "
            f"XLA_FLAGS='{FLAG}=true' before JAX starts (as noloco-train does), or "
            "config.deterministic=False to accept it.")  # fmt: skip


def warning(deterministic: bool) -> str | None:
    """``unmet`` for this process: its JAX backend and ``XLA_FLAGS``."""
    return unmet(deterministic, _platform(), os.environ.get("XLA_FLAGS", ""))


def _backend_started() -> bool:
    """Whether JAX has started a backend (JAX has no public call for it; a JAX without the
    private one counts as not started, which is this module's behaviour before it asked)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge  # noqa: PLC0415

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def _platform() -> str:
    import jax  # noqa: PLC0415  (the CLI calls ``request`` before JAX is imported)

    return jax.default_backend()
