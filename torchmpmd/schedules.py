"""Built-in schedules (`mpmd.schedules.OneFOneB(8)`, ...), each written with the
public `mpmd.Schedule` API; defined in `torchmpmd.schedule.builtins`."""

from .schedule.builtins import (
    ZBV,
    Combined1F1B,
    DualPipeV,
    Eager1F1B,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    ZeroBubbleH1,
)

__all__ = [
    "ZBV",
    "Combined1F1B",
    "DualPipeV",
    "Eager1F1B",
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "ZeroBubbleH1",
]
