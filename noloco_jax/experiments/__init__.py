"""Helpers of the experiment scripts (``python -m experiments.NAME``) and the colabs (``colabs/``).

``harness`` trains grids of runs and writes reports; ``table2`` is Table 2 in miniature.
They read the repository's ``configs/`` (installed with the project, or the clone's when run
from its root).
"""
