"""Helpers of the experiment scripts (``experiments/``) and the colabs (``colabs/``).

``harness`` trains grids of runs and writes reports; ``table2`` is Table 2 in miniature.
They need the repository's ``configs/`` folder (a clone or an editable install).
"""
