"""Downstream evaluation of merges through lm-evaluation-harness (``pmakit eval``)."""
