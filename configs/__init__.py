"""Experiment configs (one file per experiment, each with get_config())."""
