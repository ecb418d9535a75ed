"""Makes the operator tests' factories importable as a plain module."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
