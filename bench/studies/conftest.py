"""The studies' own tests import their scripts by name: this folder on sys.path (bench/conftest.py's options and
fixtures still apply)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
