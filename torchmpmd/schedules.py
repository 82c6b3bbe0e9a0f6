"""Built-in schedules, each written with the public `mpmd.Schedule` API."""

from __future__ import annotations

from ._schedule import Schedule, Task

__all__ = ["GPipe", "OneFOneB"]


def _local_stages(placement: list[int], rank: int) -> list[int]:
    return [s for s, r in enumerate(placement) if r == rank]


class GPipe(Schedule):
    """All forwards, then all backwards (Huang et al. 2019).

    With several stages per rank (round-robin placement), a rank runs its
    stages breadth-first: every microbatch through its first stage, then
    through its next one, and backwards in reverse.
    """

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        placement = self.placement(num_stages, num_ranks)
        out = []
        for r in range(num_ranks):
            local = _local_stages(placement, r)
            fwd = [Task("F", s, m) for s in local for m in range(num_microbatches)]
            bwd = [Task("B", s, m) for s in reversed(local) for m in range(num_microbatches)]
            out.append(fwd + bwd)
        return out


class OneFOneB(Schedule):
    """One-forward-one-backward (PipeDream-Flush / Megatron).

    Each rank runs as many warm-up forwards as there are stages after it, then
    alternates one forward with one backward, which keeps at most `p`
    microbatches of activations alive instead of GPipe's `m`. With `v` stages
    per rank (round-robin placement) this is Megatron's interleaved 1F1B: work
    proceeds in rounds of `p` microbatches per stage, which needs the number of
    microbatches to be a multiple of the number of ranks.
    """

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        p, m = num_ranks, num_microbatches
        if num_stages % p:
            raise ValueError(
                f"OneFOneB places stages round-robin and needs a multiple of {p} stages, "
                f"got {num_stages}"
            )
        v = num_stages // p
        if v > 1 and m % p:
            raise ValueError(
                f"interleaved OneFOneB ({v} stages per rank) needs the number of microbatches "
                f"to be a multiple of the number of ranks ({p}), got {m}"
            )
        return [self._rank_tasks(r, p, v, m) for r in range(p)]

    @staticmethod
    def _rank_tasks(r: int, p: int, v: int, m: int) -> list[Task]:
        total = m * v

        def forward(k: int) -> Task:
            chunk = (k % (p * v)) // p
            mb = (k // (p * v)) * p + k % p if v > 1 else k
            return Task("F", chunk * p + r, mb)

        def backward(k: int) -> Task:
            chunk = v - 1 - (k % (p * v)) // p
            mb = (k // (p * v)) * p + k % p if v > 1 else k
            return Task("B", chunk * p + r, mb)

        warmup = min(p - r - 1, m) if v == 1 else min((p - r - 1) * 2 + (v - 1) * p, total)
        out = [forward(k) for k in range(warmup)]
        f, b = warmup, 0
        while f < total:
            out.append(forward(f))
            out.append(backward(b))
            f += 1
            b += 1
        out.extend(backward(k) for k in range(b, total))
        return out
