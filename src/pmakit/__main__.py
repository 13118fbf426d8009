"""``python -m pmakit`` is the ``pmakit`` command."""

import pmakit._env  # noqa: F401  (before torch)
from pmakit.cli import main

main()
