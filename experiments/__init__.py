"""Experiment and benchmark scripts, run from the repository root: ``python -m experiments.NAME``.

Each script is a module with absl flags (``--help`` lists them) and a ``--smoke`` version that
the tests run. The flags several scripts share are defined once, in ``experiments.options``.
"""
