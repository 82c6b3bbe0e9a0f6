"""The mesh's layout (`torchmpmd.parallel.layout`): its dimensions are named
by the parallelisms that run over them, unknown names are refused naming
the ones there are, torchtitan's spelling is read, and a parallelism of a
user's own registers over a dimension of its own and runs inside every
stage through the protocol alone (the recipe in docs/architecture.md)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import pytest
import torch
import torch.distributed as dist

import torchmpmd as mpmd
from torchmpmd.parallel import Kind, Parallelism, RankStages, protocol
from torchmpmd.schedule.program import StageCollectives


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)
    ).double()


def _runner(mesh, model: torch.nn.Module | None = None, **options) -> mpmd.PipelineRunner:
    model = _model() if model is None else model
    x = torch.randn(2, 4, dtype=torch.float64)
    return mpmd.PipelineRunner(
        mpmd.trace(model, (x,), split_before=["2"]),
        mpmd.schedules.GPipe(2),
        mesh=mesh,
        loss_fn=lambda out, y: ((out - y) ** 2).mean(),
        options=mpmd.RunnerOptions(timeout=30, **options),
    )


@pytest.mark.parametrize(
    ("names", "options", "expected"),
    [
        (("pp", "cp"), {}, r"dimensions are named \('pp', 'cp'\).*'dp', 'dp_replicate'"),
        (("stage", "dp"), {}, r"'pp' \(the pipeline, required\)"),
        (
            ("pp", "dp_shard"),
            {"data_parallel": "replicate"},
            r"'dp_shard' dimension shards the stages \(FSDP\), but data_parallel='replicate'",
        ),
        (("pp", "dp"), {"tp_plan": {"0": "colwise"}}, r"tp_plan needs a mesh with a 'tp'"),
        (("pp", "dp"), {"data_parallel": "zero3"}, r"data_parallel='zero3': use 'replicate'"),
    ],
)
def test_a_mesh_is_named_by_the_parallelisms_that_run_over_it(
    one_rank_world, names, options, expected
):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names)
    with pytest.raises(ValueError, match=expected):
        _runner(mesh, **options)


def test_torchtitan_names_on_one_rank(one_rank_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    for names, sharded in [
        (("pp", "dp_replicate"), False),
        (("pp", "dp_shard"), True),
        (("pp", "dp_replicate", "dp_shard"), True),
        (("pp", "dp"), False),
    ]:
        mesh = init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names)
        runner = _runner(mesh)
        # FSDP's parameters are DTensor shards; replicas hold plain tensors.
        assert all(isinstance(p, DTensor) == sharded for p in runner.parameters()), names
        assert runner.dp_group is not None and runner.dp_size == 1


class _Counted(Parallelism):
    """A parallelism of a user's own over a mesh dimension "toy": it counts
    each hook and, at REDUCE_grads (placed in the program, so the simulator
    and the timeline see it), scales the stage's gradients by `scale`."""

    name = "toy"
    dims = ("toy",)
    collectives = StageCollectives(reduce_grads=True)

    def __init__(self, group: dist.ProcessGroup, scale: float) -> None:
        self._group, self.scale = group, scale
        self.calls: list[str] = []
        self.modules: dict[int, torch.nn.Module] = {}

    def groups(self) -> list[dist.ProcessGroup]:
        return [self._group]

    def attach(self, stages: RankStages) -> None:
        self.calls.append("attach")
        self.modules = stages.modules

    def on_call(self, kind: str, device: torch.device) -> None:
        self.calls.append(f"call {kind}")

    def start_step(self) -> None:
        self.calls.append("start_step")

    def reduce_grads(self, stage: int) -> None:
        self.calls.append(f"reduce {stage}")
        for p in self.modules[stage].parameters():
            if p.grad is not None:
                p.grad.mul_(self.scale)

    def finish(self, tied: Mapping[int, torch.nn.Parameter]) -> None:
        self.calls.append("finish")


def test_a_parallelism_of_your_own_runs_inside_the_stages(one_rank_world, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh

    made: list[_Counted] = []

    def make(mesh, dims, pipe, asked):
        made.append(_Counted(mesh[dims[0]].get_group(), 0.5))
        return made[-1]

    kind = Kind(
        "toy", ("toy",), lambda names, left, asked: ("toy",) if "toy" in left else (), make, 5
    )
    monkeypatch.setitem(protocol._KINDS, "toy", kind)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "toy"))
    model = _model()
    reference = copy.deepcopy(model)
    runner = _runner(mesh, model)
    x = torch.randn(4, 4, dtype=torch.float64)
    runner.step(x, target=x)
    (toy,) = made
    assert toy.calls == ["attach", "call step", "start_step", "reduce 1", "reduce 0", "finish"]
    program = "\n".join(runner.program.instructions(0))
    assert "REDUCE_grads(s0)" in program and "REDUCE_grads(s1)" in program, program
    assert {e.stage for e in runner.timeline.events if e.kind == "reduce_grads"} == {0, 1}
    # The gradients it scaled: half the unpipelined model's.
    for xb in x.chunk(2):
        (((reference(xb) - xb) ** 2).mean() / 2).backward()
    for name, p in runner.named_parameters():
        ref = reference.get_parameter(name).grad
        torch.testing.assert_close(p.grad, 0.5 * ref, rtol=1e-12, atol=1e-12, msg=name)
