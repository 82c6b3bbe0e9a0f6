"""Fine-tunes a Hugging Face causal LM pipelined, from its checkpoint and back.

    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py
    torchrun --standalone --nproc_per_node=4 examples/finetune_hf.py --dp 2 --data-parallel fsdp
    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py --source DIR --out DIR

Without `--source`, rank 0 first writes a small Llama built from a config
with `save_pretrained` (nothing is downloaded), as a stand-in for a
pretrained checkpoint. Then every rank builds the model from the config on
the meta device (no rank ever holds the whole model), cuts it between
decoder layers, fills its own stages with `mpmd.checkpoint.load_hf` (each
rank reads only its tensors), trains a few steps on the bundled corpus (one
token per byte), writes the result with `mpmd.checkpoint.save_hf`, and
reloads it with `AutoModelForCausalLM.from_pretrained` to check that the
reloaded model holds bitwise the pipeline's parameters and computes the
pipeline's loss.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import torchmpmd as mpmd

CORPUS = Path(__file__).parent / "data" / "licenses.txt"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default=None, help="a save_pretrained directory (default: built)")
    p.add_argument("--out", default=None, help="where save_hf writes (default: a temporary dir)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (world = pp x dp)")
    p.add_argument("--data-parallel", choices=["replicate", "fsdp"], default="replicate")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=float, default=120.0)
    return p.parse_args()


def write_source(path: Path, seq_len: int) -> None:
    """A small Llama over bytes (vocabulary 256), saved as a pretrained one would be."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def loss_fn(out, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out["logits"]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batch(data: torch.Tensor, size: int, seq: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the corpus, the same on every rank (seeded by the step)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, data.numel() - seq - 1, (size,), generator=g)
    window = torch.stack([data[s : s + seq + 1] for s in start.tolist()])
    return window[:, :-1], window[:, 1:]


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    mpmd.tune_cpu()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the {world} processes")
    pp = world // args.dp
    mesh = init_device_mesh("cpu", (pp, args.dp), mesh_dim_names=("pp", "dp"))
    needed = args.source is None or args.out is None
    scratch = tempfile.TemporaryDirectory() if needed and rank == 0 else None
    shared = [scratch.name if scratch is not None else None]
    dist.broadcast_object_list(shared, src=0)  # rank 0's directory for every rank (one machine)
    source = Path(args.source or Path(shared[0]) / "source")
    out = Path(args.out or Path(shared[0]) / "finetuned")
    if args.source is None and rank == 0:
        write_source(source, args.seq_len)
    dist.barrier()

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = config.num_hidden_layers
    if pp > layers:
        raise SystemExit(f"{pp} pipeline ranks for {layers} decoder layers: use fewer processes")
    split = [f"model.layers.{i * layers // pp}" for i in range(1, pp)]
    example = torch.zeros(args.microbatch_size, args.seq_len, dtype=torch.long, device="meta")
    pipe = mpmd.trace(model, (), {"input_ids": example, "use_cache": False}, split_before=split)
    if rank == 0:
        print(pipe, flush=True)
    runner = mpmd.PipelineRunner(
        pipe,
        mpmd.schedules.OneFOneB(args.microbatches),
        mesh=mesh,
        loss_fn=loss_fn,
        options=mpmd.RunnerOptions(
            timeout=args.timeout, data_parallel=args.data_parallel if args.dp > 1 else None
        ),
    )
    loaded = mpmd.checkpoint.load_hf(source, runner)
    local = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in runner.parameters()
    )
    sys.stdout.write(
        f"rank {rank}: load_hf read {loaded.bytes_read / 1024:.1f} KiB for its "
        f"{local / 1024:.1f} KiB of parameters (stages {runner.local_stages})\n"
    )
    sys.stdout.flush()

    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    size = args.microbatches * args.microbatch_size
    opt = torch.optim.AdamW(runner.parameters(), lr=args.lr)
    for step in range(1, args.steps + 1):
        x, y = batch(data, size * args.dp, args.seq_len, step)
        mine = slice(mesh.get_local_rank("dp") * size, (mesh.get_local_rank("dp") + 1) * size)
        opt.zero_grad(set_to_none=True)
        result = runner.step(input_ids=x[mine], use_cache=False, target=y[mine])
        opt.step()
        if rank == 0 and result.losses is not None:
            print(f"step {step:3d}  loss {result.losses.mean().item():.4f}", flush=True)

    mpmd.checkpoint.save_hf(out, runner)

    # Back through from_pretrained: the same parameters, bit for bit, and the
    # same loss on a held-out batch.
    reloaded = AutoModelForCausalLM.from_pretrained(
        out, attn_implementation=config._attn_implementation
    )
    differ = [
        name
        for name, p in runner.named_parameters()
        if not torch.equal(
            (p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()),
            reloaded.get_parameter(name).detach(),
        )
    ]
    counts = torch.tensor([len(differ), sum(1 for _ in runner.parameters())])
    dist.all_reduce(counts)
    x, y = batch(data, size, args.seq_len, 10**6)
    pipelined = runner.eval_step(input_ids=x, use_cache=False)
    with torch.no_grad():
        expected = loss_fn(reloaded(input_ids=x, use_cache=False), y).item()
    got = loss_fn(pipelined, y).item()
    if rank == 0:
        print(
            f"held-out loss: pipeline {got:.6f}, from_pretrained({out.name}) {expected:.6f}",
            flush=True,
        )
    if abs(got - expected) > 1e-5 * max(1.0, abs(expected)):
        raise SystemExit("the reloaded model's loss differs from the pipeline's")
    if differ:
        raise SystemExit(f"rank {rank}: {differ[:5]} differ after from_pretrained")
    if rank == 0:
        print(
            f"round trip: {int(counts[1])} parameter tensors over {world} ranks, all bitwise "
            "equal after save_hf -> from_pretrained",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    if scratch is not None:
        scratch.cleanup()


if __name__ == "__main__":
    main()
