"""``python -m spyre_jax``: the same commands as the ``spyre-jax`` script."""

import sys

from .tools.cli import main

sys.exit(main())
