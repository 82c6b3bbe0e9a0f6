"""torchmpmd: MPMD pipeline parallelism for PyTorch.

pipe = mpmd.trace(model, example_args, split_before=["layers.4"])
print(pipe)                      # stages, transfers, tied parameters
"""

import torch  # noqa: F401  (loads libtorch before the native core)

from . import _C  # noqa: F401
from ._frontend import trace
from ._markers import mark_stage_end
from ._pipe import Pipe

__all__ = ["Pipe", "mark_stage_end", "trace"]

__version__ = "0.1.0"
