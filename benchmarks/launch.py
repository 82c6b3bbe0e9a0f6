"""Shared by the 2-rank benchmarks: run `main` under torchrun when started as a
plain script (python benchmarks/x.py), or directly when torchrun started it."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def launch(main: Callable[[], None], nproc: int = 2) -> None:
    if "RANK" in os.environ:
        main()
        return
    from torch.distributed.run import main as torchrun

    torchrun(["--standalone", f"--nproc_per_node={nproc}", sys.argv[0], *sys.argv[1:]])
