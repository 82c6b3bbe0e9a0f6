"""The import path of a benchmark run as `python benchmarks/NAME.py`: the
repository's examples/ (the bundled GPT and its loss, `lm_loss`) and the
repository itself (an extension built in place, without an install) come
first. A benchmark imports this module before `gpt`: `import repo_paths`."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
