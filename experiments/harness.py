"""The experiment harness lives in the package: ``noloco_jax.experiments.harness``.

Kept so that the scripts here (``import harness``) and older notebooks keep working.
"""

from noloco_jax.experiments.harness import *  # noqa: F401,F403
from noloco_jax.experiments.harness import __all__  # noqa: F401
