import sys
from pathlib import Path

# The GPU checks reuse helpers of tests/model.
sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
