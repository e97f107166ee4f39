"""``python -m harts_runtime.cli`` (and ``torchrun ... -m harts_runtime.cli``): ``harts-train``."""

import sys

from harts_runtime.cli.main import main

sys.exit(main())
