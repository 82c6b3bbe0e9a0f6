"""What running a stage on DTensors costs on the CPU (tensor parallelism,
`torchmpmd/parallel/tensor.py`): a Hugging Face Llama (its own tp plan) as
one stage, stepped by a plain runner and by a runner on a ("pp", "tp") mesh
of one rank each, so that the difference is DTensor's dispatch and sharding
propagation alone (a one-rank mesh communicates nothing). Measured in turns
in one run; the overhead per op divides it by the aten ops one plain step
dispatches (counted with a dispatch mode).

    python benchmarks/tensor_parallel.py [--rounds 9] [--hidden 256]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import repo_paths  # noqa: F401  (examples/ and the repository on the path)
import torch
import torch.distributed as dist
from gpt import lm_loss
from torch.utils._python_dispatch import TorchDispatchMode

import torchmpmd as mpmd


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1
        )
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=1024,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            use_cache=False,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
        m = 2

        def loss(out, y):  # type: ignore[no-untyped-def]
            return lm_loss(out.logits, y)

        def runner(mesh) -> mpmd.PipelineRunner:  # type: ignore[no-untyped-def]
            pipe = mpmd.trace(copy.deepcopy(model), (), {"input_ids": ids[: args.batch // m]})
            return mpmd.PipelineRunner(pipe, mpmd.schedules.GPipe(m), mesh=mesh, loss_fn=loss)

        plain = runner(None)
        tp = runner(init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "tp")))

        def step(r: mpmd.PipelineRunner) -> float:
            for q in r.parameters():
                q.grad = None
            start = time.perf_counter()
            r.step(input_ids=ids, target=ids)
            return time.perf_counter() - start

        step(plain), step(tp)  # warm up
        counter = _Count()
        with counter:
            step(plain)
        times: dict[str, list[float]] = {"plain": [], "tp": []}
        for _ in range(args.rounds):
            times["plain"].append(step(plain))
            times["tp"].append(step(tp))
        med = {k: statistics.median(v) for k, v in times.items()}
        extra = med["tp"] - med["plain"]
        print(
            f"Llama {args.layers} layers, hidden {args.hidden}, batch {args.batch}x{args.seq}, "
            f"{m} microbatches, one stage, {args.rounds} rounds in turns (medians)"
        )
        print(f"plain step:                 {med['plain'] * 1e3:8.2f} ms")
        print(
            f"on DTensors (1-rank tp):    {med['tp'] * 1e3:8.2f} ms  ({med['tp'] / med['plain']:.3f}x)"
        )
        print(f"aten ops per plain step:    {counter.ops:8d}")
        print(f"overhead per op:            {extra / counter.ops * 1e6:8.1f} us")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
