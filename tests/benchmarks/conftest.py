"""benchmarks/ is a folder of scripts, not a package: its modules import each other by bare name
(as the scripts do when run), so the tests put that folder on sys.path too."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
