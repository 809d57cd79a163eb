"""Shared defaults for every experiment config: import, copy and override; never duplicate.

The table of defaults and meanings is ``noloco_jax.defaults.FIELDS`` (the trainer's settings
read it too); ``get_config()`` builds the ConfigDict from it.
"""

from noloco_jax.defaults import FIELDS, GROUPS, Unset, get_config

__all__ = ["FIELDS", "GROUPS", "Unset", "get_config"]
