"""Built-in schedules, each written with the public `mpmd.Schedule` API."""

from __future__ import annotations

from .task import Schedule, Task

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


class Eager1F1B(OneFOneB):
    """1F1B with eager warm-up (JaxPP): rank r runs 2(p - r) - 1 forwards before
    its first backward instead of p - r, so forward sends leave earlier and
    overlap more with compute, for up to 2p - 1 microbatches of activations.
    One stage per rank."""

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        p, m = num_ranks, num_microbatches
        if num_stages != p:
            raise ValueError(f"Eager1F1B runs one stage per rank: {num_stages} stages on {p} ranks")
        out = []
        for r in range(p):
            warmup = min(2 * (p - r) - 2, m)
            tasks = [Task("F", r, i) for i in range(warmup)]
            f, b = warmup, 0
            while f < m:
                tasks += [Task("F", r, f), Task("B", r, b)]
                f, b = f + 1, b + 1
            tasks += [Task("B", r, i) for i in range(b, m)]
            out.append(tasks)
        return out


class Interleaved1F1B(OneFOneB):
    """Megatron's interleaved 1F1B: v > 1 stages per rank, dealt round-robin.
    The bubble shrinks by v; the number of microbatches must be a multiple of
    the number of ranks."""

    stages_per_rank = 2

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        if num_stages < 2 * num_ranks:
            raise ValueError(
                f"Interleaved1F1B needs at least two stages per rank, got {num_stages} stages on "
                f"{num_ranks} ranks; use OneFOneB for one"
            )
        return super().tasks(num_stages, num_ranks, num_microbatches)


class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al., 2024): 1F1B with each backward split into I (input
    gradient, on the critical path) and W (weight gradient, deferrable). Rank r
    keeps up to r weight-gradient passes pending, which fills the cool-down
    bubble: step time m(F+I+W) + (p-1)(F+I-W), with 1F1B's activation memory.
    One stage per rank."""

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        p, m = num_ranks, num_microbatches
        if num_stages != p:
            raise ValueError(
                f"ZeroBubbleH1 runs one stage per rank: {num_stages} stages on {p} ranks"
            )
        return [self._rank_tasks(r, p, m) for r in range(p)]

    @staticmethod
    def _rank_tasks(r: int, p: int, m: int) -> list[Task]:
        tasks = [Task("F", r, f) for f in range(min(p - r - 1, m))]
        f, i, w = len(tasks), 0, 0
        while i < m:
            if f < m:
                tasks.append(Task("F", r, f))
                f += 1
            tasks.append(Task("I", r, i))
            i += 1
            if i - w > r:  # at most r weight passes pending
                tasks.append(Task("W", r, w))
                w += 1
        return tasks + [Task("W", r, k) for k in range(w, m)]


def _v_placement(num_stages: int, num_ranks: int, name: str) -> list[int]:
    if num_stages != 2 * num_ranks:
        raise ValueError(
            f"{name} places two stages per rank in a V (rank r holds stages r and "
            f"{2 * num_ranks - 1}-r): needs {2 * num_ranks} stages, got {num_stages}"
        )
    return [s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(num_stages)]


class ZBV(Schedule):
    """ZB-V (Qi et al., 2024, section 6): two stages per rank in a V, so the
    first and last stages share rank 0; backward split into I and W with W
    filling the bubbles. Near zero bubble when F, I and W cost the same, with
    1F1B's peak activation memory."""

    stages_per_rank = 2

    def placement(self, num_stages: int, num_ranks: int) -> list[int]:
        return _v_placement(num_stages, num_ranks, "ZBV")

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        _v_placement(num_stages, num_ranks, "ZBV")
        return [self._rank_tasks(r, num_ranks, num_microbatches) for r in range(num_ranks)]

    @staticmethod
    def _rank_tasks(r: int, p: int, m: int) -> list[Task]:
        n = max(m, 2 * p - 1)  # generate for a full pipeline, then drop extras
        down, up = r, 2 * p - 1 - r  # the rank's stage on the way down, and up
        seq: list[Task] = []
        f0 = f1 = i0 = i1 = 0
        for _ in range(2 * (p - r) - 1):
            seq.append(Task("F", down, f0))
            f0 += 1
        for _ in range(r):
            seq += [Task("F", up, f1), Task("F", down, f0)]
            f1, f0 = f1 + 1, f0 + 1
        for _ in range(p - r):
            seq += [Task("F", up, f1), Task("I", up, i1), Task("W", up, i1)]
            f1, i1 = f1 + 1, i1 + 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                seq.append(Task("F", down, f0))
                f0 += 1
            seq += [Task("I", down, i0), Task("W", down, i0)]
            seq += [Task("F", up, f1), Task("I", up, i1), Task("W", up, i1)]
            i0, f1, i1 = i0 + 1, f1 + 1, i1 + 1
        w0, w1 = i0, i1
        for _ in range(r):
            seq += [Task("I", down, i0), Task("I", up, i1)]
            i0, i1 = i0 + 1, i1 + 1
        for _ in range(p - r):
            seq += [Task("I", down, i0), Task("W", down, w0)]
            i0, w0 = i0 + 1, w0 + 1
        seq += [Task("W", up, k) for k in range(w1, i1)]
        seq += [Task("W", down, k) for k in range(w0, i0)]
        return [t for t in seq if t.microbatch < m]


class Combined1F1B(Schedule):
    """1F1B whose steady state pairs each forward with the backward of an
    earlier microbatch as one fused task (Megatron-Core's combined 1F1B,
    `--overlap-moe-expert-parallel-comm`): with `RunnerOptions.overlap` the
    two run at once, one's communication (expert parallelism's all-to-alls)
    under the other's compute. One stage per rank.

    A fused task starts once both parts' inputs are there, so the warm-up
    is longer than 1F1B's: `2 (p - r) - 1` forwards on rank r (with `p - r`,
    each rank's pair would wait for the next rank's pair of the same step,
    and the ranks would take turns). It holds up to that many microbatches
    of activations, as interleaved 1F1B does."""

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        p, m = num_ranks, num_microbatches
        if num_stages != p:
            raise ValueError(
                f"Combined1F1B runs one stage per rank: {p} stages for {p} ranks, got {num_stages}"
            )
        out = []
        for r in range(p):
            warmup = min(2 * (p - r) - 1, m)
            row = [Task("F", r, k) for k in range(warmup)]
            row += [
                Task.fused(Task("F", r, warmup + i), Task("B", r, i)) for i in range(m - warmup)
            ]
            row += [Task("B", r, k) for k in range(m - warmup, m)]
            out.append(row)
        return out


class DualPipeV(Schedule):
    """DualPipeV (DeepSeek-V3's DualPipe, cut in half): two stages per rank in a
    V; in the steady state each rank pairs the forward of one stage with the
    backward of the other, as one fused task (`Task.fused`, torch's
    OVERLAP_F_B; run one after the other for now), and the tail switches to
    split backward (I, then W to fill the bubbles). Needs at least as many
    microbatches as stages."""

    stages_per_rank = 2

    def placement(self, num_stages: int, num_ranks: int) -> list[int]:
        return _v_placement(num_stages, num_ranks, "DualPipeV")

    def tasks(self, num_stages: int, num_ranks: int, num_microbatches: int) -> list[list[Task]]:
        _v_placement(num_stages, num_ranks, "DualPipeV")
        p, m = num_ranks, num_microbatches
        if m < num_stages:
            raise ValueError(
                f"DualPipeV needs at least as many microbatches as stages ({num_stages}), got {m}"
            )
        return [self._rank_tasks(r, p, m) for r in range(p)]

    @staticmethod
    def _rank_tasks(r: int, p: int, m: int) -> list[Task]:
        down, up = r, 2 * p - 1 - r
        seq: list[Task] = []
        next_f = {down: 0, up: 0}
        next_b = {down: 0, up: 0}
        pending_w: list[Task] = []

        def forward(stage: int) -> None:
            seq.append(Task("F", stage, next_f[stage]))
            next_f[stage] += 1

        def backward(stage: int, split: bool) -> None:
            mb = next_b[stage]
            next_b[stage] += 1
            if split:
                seq.append(Task("I", stage, mb))
                pending_w.append(Task("W", stage, mb))
            else:
                seq.append(Task("B", stage, mb))

        def paired(forward_stage: int, backward_stage: int) -> None:
            # The forward of one stage and the backward of the other, one step.
            forward(forward_stage)
            backward(backward_stage, split=False)
            f, b = seq.pop(-2), seq.pop()
            seq.append(Task.fused(f, b))

        def weight() -> None:
            if pending_w:
                seq.append(pending_w.pop(0))

        for _ in range(2 * (p - r - 1)):
            forward(down)
        for _ in range(r + 1):
            forward(down)
            forward(up)
        for _ in range(p - r - 1):
            backward(up, split=True)
            weight()
            forward(up)
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:
                # As torch's DualPipeV: the last rank's first pair stays
                # apart (its stages are consecutive, the backward is ready
                # before the forward's successor needs it).
                forward(down)
                backward(up, split=False)
            else:
                paired(down, up)
            paired(up, down)
        for _ in range(p - r - 1):
            backward(up, split=False)
            paired(up, down)
        split = False
        steps = r + 1
        for k in range(steps):
            if k == steps // 2 and r % 2 == 1:
                split = True
            backward(up, split)
            if k == steps // 2 and r % 2 == 0:
                split = True
            backward(down, split)
        for _ in range(p - r - 1):
            weight()
            backward(down, split)
        while pending_w:
            weight()
        return seq
