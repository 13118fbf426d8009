"""``python -m pmakit`` is the ``pmakit`` command."""

from pmakit._env import run_cli

run_cli()
