"""``python -m poros_fx.tools.bench``."""

import sys

from .cli import main

sys.exit(main())
