"""``python -m loraplane.cli``: what the harnesses spawn servers and routers with."""

import sys

from loraplane.cli import main

sys.exit(main())
