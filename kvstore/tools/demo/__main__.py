"""``python -m kvstore.tools.demo``."""

import sys

from kvstore.tools.demo.cli import main

sys.exit(main())
