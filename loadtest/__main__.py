"""`python -m kvserve.loadtest` is `kvserve-bench`."""

import sys

from .cli import main

sys.exit(main())
