"""``python -m poros_fx.bench``."""

import sys

from .options import main

sys.exit(main())
