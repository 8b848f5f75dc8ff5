"""``python -m kvstore.demo``."""

import sys

from kvstore.demo.cli import main

sys.exit(main())
