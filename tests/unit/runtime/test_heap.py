"""`mpmd.tune_cpu()` before a CPU runner keeps the memory a microbatch frees
in the heap (glibc's mmap and trim thresholds fixed high), so the next
microbatch's tensors do not come back as page faults; a user's own malloc
settings and a runner alone leave malloc alone. Each case runs in a fresh
process: the policy is process-wide and for good.

glibc's own thresholds adapt to what the process freed before, so how often
they hand pages back varies from process to process. The page-fault
measurements therefore start from a known policy, MALLOC_TRIM_THRESHOLD_
(which also pins the mmap threshold at 128 KiB): every 1 MiB tensor is then
mapped afresh and faults, unless the thresholds are fixed over it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Every test here takes over ~2 s on 2 cores and spawns processes.
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    import torchmpmd as mpmd
    from torchmpmd import _C
    from torchmpmd.runtime import LocalWorld, heap

    how = sys.argv[1]
    returned = None
    if how == "native":  # the thresholds, set whatever the environment says
        returned = _C.runtime.keep_freed_memory(heap.MMAP_THRESHOLD, heap.TRIM_THRESHOLD)
    elif how == "call":
        returned = heap.keep_freed_memory()
    elif how in ("runner", "runner off"):
        # A training script's start-up: mpmd.tune_cpu() (or not), then a runner.
        if how == "runner":
            mpmd.tune_cpu(gloo_sched_batch=False)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        pipe = mpmd.trace(model, (torch.zeros(2, 4),), split_before=["1"])
        mpmd.PipelineRunner(
            pipe,
            mpmd.schedules.GPipe(2),
            transport=LocalWorld(1).transport(0),
            loss_fn=lambda out, y: out.sum(),
        )

    def one_round():
        # What a microbatch does: many 1 MiB tensors, written, then freed.
        kept = [torch.empty(2**18).fill_(1.0) for _ in range(96)]
        del kept

    for _ in range(2):  # the heap grows to what a round needs
        one_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        one_round()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"faults": faults, "returned": returned, "applied": heap.applied()}))
    """
)

# 3 rounds of 96 MiB are 73728 pages if every one faults again.
PAGES = 3 * 96 * 2**20 // 4096
PINNED = {"MALLOC_TRIM_THRESHOLD_": "131072"}


def _start(how, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUN"))}
    full.update(env)
    return subprocess.Popen(
        # The child is outside pytest's filterwarnings: it refuses the runner's
        # deprecated keywords itself.
        [sys.executable, "-W", "error:PipelineRunner(:DeprecationWarning", "-c", CHILD, how],
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _runs(*cases):
    """Each (how, env) case's report, its child started at once with the
    others (they count page faults, not time; each imports torch)."""
    children = [_start(how, **env) for how, env in cases]
    reports = []
    for (how, _), child in zip(cases, children, strict=True):
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, (how, err)
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc's malloc only",
)
def test_freed_memory_stays_in_the_heap():
    none, native, called, runner, runner_off, tuned = _runs(
        ("none", PINNED),
        ("native", PINNED),
        ("call", {}),
        ("runner", {}),
        ("runner off", {}),
        ("call", PINNED),
    )
    # Pages go back to the kernel and fault again under a low trim threshold...
    assert none["faults"] > PAGES // 2
    # ... and stay in the heap once the thresholds are fixed.
    assert native["returned"] is True
    assert native["faults"] < PAGES // 20
    # The module applies them once, where the user chose no thresholds.
    assert (called["returned"], called["applied"]) == (True, True)
    assert runner["applied"] is True  # tune_cpu() before a CPU runner does
    assert runner_off["applied"] is False  # a runner alone does not
    # The user's own choice of thresholds is left alone.
    assert (tuned["returned"], tuned["applied"]) == (False, False)
    assert tuned["faults"] > PAGES // 2
