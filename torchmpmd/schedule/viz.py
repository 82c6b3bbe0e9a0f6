"""Gantt charts of timelines (matplotlib), predicted and measured side by side."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .timeline import COLLECTIVES, EXCHANGES, Timeline, TimelineEvent

__all__ = ["plot"]

_COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#C44E52"}
_OTHER = "#8172B3"  # any other task kind
# A fused task's frame around the bands of its parts.
_FUSED_EDGE = "#222222"
_EXCHANGE_COLOR = "#111111"  # expert parallelism's all-to-alls inside tasks
# Data-parallel collectives: a thin bar under the rank's tasks.
_COLLECTIVE_COLORS = {"unshard": "#937860", "reduce_grads": "#8C8C8C"}


def plot(
    timeline: Timeline | Sequence[Timeline],
    path: str | Path | None = None,
    *,
    titles: Sequence[str] | None = None,
    labels: bool = True,
) -> Any:
    """Draws one Gantt chart per timeline (rows: ranks; boxes: tasks colored by
    kind and named '{stage}{kind}{microbatch}', a fused task framed, a band
    per part in its kind's color, named by its parts '0F3+1B2'; a stage's
    data-parallel unshard
    and gradient reduction as thin bars under them), stacked so that a
    predicted and a measured run of the same schedule can be compared. Saves a PNG to
    `path` if given; returns the matplotlib Figure.
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    timelines = [timeline] if isinstance(timeline, Timeline) else list(timeline)
    if not timelines:
        raise ValueError("plot: no timeline given")
    for k, tl in enumerate(timelines):
        if not isinstance(tl, Timeline):
            raise TypeError(f"plot: timeline {k} is a {type(tl).__name__}, not an mpmd.Timeline")
        tl._check(f"plot: timeline {k}")
        if not tl.tasks:
            raise ValueError(
                f"plot: timeline {k} ({tl.source}) has no tasks; plot a program's simulation or "
                "a runner's timeline after a step"
            )
    if titles is not None and len(titles) != len(timelines):
        raise ValueError(
            f"plot: {len(titles)} titles for {len(timelines)} timelines; give one title each"
        )
    if path is not None:
        target = Path(path)
        if target.is_dir() or target.suffix.lower() not in (".png", ".svg", ".pdf", ".jpg"):
            raise ValueError(
                f"plot: path {str(path)!r} is not an image file; name one, e.g. "
                f"'{target / 'timeline.png' if target.is_dir() else target.with_suffix('.png')}'"
            )
    fig, axes = plt.subplots(
        len(timelines),
        1,
        figsize=(12, 0.5 + sum(0.45 * max(t.num_ranks, 1) + 0.8 for t in timelines)),
        squeeze=False,
    )
    for k, (tl, ax) in enumerate(zip(timelines, axes[:, 0], strict=True)):
        tasks = tl.tasks
        collectives = [e for e in tl.events if e.kind in COLLECTIVES]
        exchanges: dict[tuple[int, int, int], list[TimelineEvent]] = {}
        for x in tl.events:
            if x.kind in EXCHANGES:
                exchanges.setdefault((x.rank, x.stage, x.microbatch), []).append(x)
        start = min((e.start for e in tasks + collectives), default=0.0)
        scale, unit = (1e3, "ms") if tl.unit == "s" else (1.0, tl.unit)
        span = max((e.end - start for e in tasks + collectives), default=1.0) * scale or 1.0
        for e in collectives:
            ax.barh(
                e.rank + 0.47,
                max(e.duration * scale, span / 400),
                left=(e.start - start) * scale,
                height=0.14,
                color=_COLLECTIVE_COLORS[e.kind],
            )
        for e in tasks:
            x0 = (e.start - start) * scale
            width = e.duration * scale
            # A fused task: one band per part, in its kind's color, top to
            # bottom in part order, framed; each over the interval it ran
            # where measured (sides at once overlap), else the task's.
            parts = e.sub_tasks or (None,)
            band = 0.8 / len(parts)
            spans = [(a, b) for a, b, _ in e.part_spans] or [(e.start, e.end)] * len(parts)
            for j, (part, (a, b)) in enumerate(zip(parts, spans, strict=True)):
                y = e.rank - 0.4 + band * (j + 0.5)
                ax.barh(
                    y,
                    (b - a) * scale,
                    left=(a - start) * scale,
                    height=band,
                    color=_COLORS.get(part.kind if part else e.kind, _OTHER),
                    edgecolor="white",
                    linewidth=0.5 if part is None else 0,
                )
                # The exchanges (all-to-alls) inside this part, as dark
                # strips across its band.
                for x in exchanges.get(
                    (e.rank, *((part.stage, part.microbatch) if part else (e.stage, e.microbatch))),
                    [],
                ):
                    if a <= x.start and x.end <= b:
                        ax.barh(
                            y,
                            max(x.duration * scale, span / 800),
                            left=(x.start - start) * scale,
                            height=band * 0.3,
                            color=_EXCHANGE_COLOR,
                        )
            if e.is_fused:
                ax.barh(
                    e.rank,
                    width,
                    left=x0,
                    height=0.8,
                    fill=False,
                    edgecolor=_FUSED_EDGE,
                    linewidth=1,
                )
            if labels and width > span / 60:
                ax.text(
                    x0 + width / 2,
                    e.rank,
                    "+".join(str(p) for p in e.sub_tasks) if e.is_fused else e.name,
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
        title = titles[k] if titles is not None else f"{tl.source}: {tl.summary()}"
        ax.set_title(title, fontsize=9)
        ax.set_yticks(range(tl.num_ranks))
        ax.set_yticklabels([f"rank {r}" for r in range(tl.num_ranks)])
        ax.invert_yaxis()
        ax.set_xlim(0, span * 1.01)
        ax.set_xlabel(unit)
    order = list(_COLORS)
    kinds = sorted(
        {p.kind for t in timelines for e in t.tasks for p in (e.sub_tasks or (e,))},
        key=lambda k: (order.index(k) if k in order else len(order), k),
    )
    shown = sorted({e.kind for t in timelines for e in t.events if e.kind in COLLECTIVES})
    handles = [Patch(color=_COLORS.get(k, _OTHER), label=k) for k in kinds]
    if any(e.is_fused for t in timelines for e in t.tasks):
        handles.append(
            Patch(facecolor="white", edgecolor=_FUSED_EDGE, label="fused: a band per part")
        )
    handles += [Patch(color=_COLLECTIVE_COLORS[k], label=k) for k in shown]
    if any(e.kind in EXCHANGES for t in timelines for e in t.events):
        handles.append(Patch(color=_EXCHANGE_COLOR, label="all-to-all"))
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    if path is not None:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig
