"""Write a new pipeline schedule, check it, predict it, plot it, train with it.

    python examples/custom_schedule.py          # launches 2 ranks with torchrun
    torchrun --standalone --nproc_per_node=4 examples/custom_schedule.py

The schedule: 1F1B whose backward is split into input-gradient (I) and
weight-gradient (W) passes, with every W deferred until the rank has nothing
else to do: the pipeline drains at the speed of I alone. It trades memory
(activations wait for their W) for a smaller bubble than 1F1B.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, lm_loss, split_points

import torchmpmd as mpmd


class LazyWeight1F1B(mpmd.Schedule):
    """1F1B on F and I; all W passes of a rank at its end."""

    def tasks(self, num_stages, num_ranks, num_microbatches):
        m, out = num_microbatches, []
        for r in range(num_ranks):
            warmup = min(num_ranks - r - 1, m)
            fwd = [mpmd.Task("F", r, i) for i in range(m)]
            inp = [mpmd.Task("I", r, i) for i in range(m)]
            order = fwd[:warmup]
            for f, i in zip(fwd[warmup:], inp, strict=False):
                order += [f, i]
            order += inp[m - warmup :]
            order += [mpmd.Task("W", r, i) for i in range(m)]
            out.append(order)
        return out


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = GPTConfig(layers=4, dim=64, seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    m, b = 8, 4
    pipe = mpmd.trace(
        model,
        (torch.zeros(b, cfg.seq_len, dtype=torch.long),),
        split_before=split_points(cfg, world),
    )

    schedule = LazyWeight1F1B(m)
    program = mpmd.compile_schedule(schedule, pipe, world)  # validated here, or a clear error
    costs = mpmd.Costs(forward=1.0, input_grad=1.0, weight_grad=1.0)
    ours = program.simulate(costs)
    base = mpmd.compile_schedule(mpmd.schedules.OneFOneB(m), pipe, world).simulate(costs)
    if rank == 0:
        print(program)
        print(f"predicted: {ours.summary()}\n  vs 1F1B: {base.summary()}")

    runner = mpmd.PipelineRunner(pipe, schedule, loss_fn=lm_loss)
    opt = torch.optim.AdamW(runner.parameters(), lr=3e-3)
    data = torch.frombuffer(
        bytearray((Path(__file__).parent / "data" / "licenses.txt").read_bytes()), dtype=torch.uint8
    ).long()
    g = torch.Generator().manual_seed(0)
    for step in range(1, 21):
        start = torch.randint(0, data.numel() - cfg.seq_len - 1, (m * b,), generator=g).tolist()
        window = torch.stack([data[s : s + cfg.seq_len + 1] for s in start])
        opt.zero_grad(set_to_none=True)
        out = runner.step(window[:, :-1], target=window[:, 1:])
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {out.loss.item():.4f}", flush=True)

    measured = runner.gather_timeline()
    if rank == 0:
        path = Path("custom_schedule.png")
        mpmd.viz.plot([ours, measured], path, titles=["predicted (cost units)", "measured"])
        print(f"measured: {measured.summary()}\nwrote {path.resolve()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        from torch.distributed.run import main as torchrun

        torchrun(["--standalone", "--nproc_per_node=2", __file__, *sys.argv[1:]])
    else:
        main()
