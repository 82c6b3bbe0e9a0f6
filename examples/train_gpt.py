"""Trains a small GPT (tied embeddings) on the bundled corpus, pipelined with torchmpmd.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py
    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --schedule gpipe
    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --dp 2 --meta-init
    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --tp 2
    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --moe --ep 2

Gloo on CPU, NCCL on GPUs (one per process, chosen by LOCAL_RANK; pick the
backend with --device). The processes form a (pp, dp[, tp]) DeviceMesh:
`--dp N` makes N data-parallel replicas of a pipeline over world / N ranks,
each stepping on its shard of the global batch; `--tp N` runs every stage on
N ranks with its parameters sharded as the model's `_tp_plan` says (world =
pp x dp x tp; keep tp inside a node). `--moe` makes every block's MLP a
mixture of `--experts` experts, and `--ep N` shards each block's experts
over N ranks (a (pp, dp, ep) mesh, world = pp x dp x ep): each holds
experts / N of every block, the tokens travel to their experts' ranks by
all-to-all, and the ep ranks are data-parallel for the rest (each steps on
its own shard of the batch); the log shows the busiest expert's tokens
against the mean. Every rank reads the same batches
and keeps only its stages; `--meta-init` builds the model on the meta device
and initialises each rank's stages in place, so no rank ever holds the whole
model. Shows a progress bar with the loss and tokens/s on rank 0, writes
every step's metrics to --log-dir as JSON lines (and TensorBoard events
when tensorboard is installed), then prints how long it trained and the
loss on held-out text, and draws the last step's measured timeline under
the simulator's prediction as timeline.png next to the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, lm_loss, split_points
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import torchmpmd as mpmd

CORPUS = Path(__file__).parent / "data" / "licenses.txt"
SCHEDULES = {
    "gpipe": mpmd.schedules.GPipe,
    "1f1b": mpmd.schedules.OneFOneB,
    "eager1f1b": mpmd.schedules.Eager1F1B,
    "interleaved1f1b": mpmd.schedules.Interleaved1F1B,
    "zbh1": mpmd.schedules.ZeroBubbleH1,
    "zbv": mpmd.schedules.ZBV,
    "dualpipev": mpmd.schedules.DualPipeV,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    p.add_argument(
        "--stages-per-rank",
        type=int,
        default=None,
        help="default: the schedule's own (2 for V and interleaved, else 1)",
    )
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (world = pp x dp)")
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks per stage (world = pp x dp x tp)"
    )
    p.add_argument("--moe", action="store_true", help="a mixture of experts in every block")
    p.add_argument("--experts", type=int, default=4, help="with --moe: experts per block")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="with --moe: expert-parallel ranks sharing each block's experts (world = pp x dp x ep)",
    )
    p.add_argument(
        "--data-parallel",
        choices=["replicate", "fsdp"],
        default="replicate",
        help="with --dp or --ep > 1: average replicated gradients, or shard each stage with FSDP2",
    )
    p.add_argument(
        "--meta-init",
        action="store_true",
        help="build the model on the meta device; each rank initialises only its stages",
    )
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=30, help="steps of linear warm-up")
    p.add_argument(
        "--min-lr", type=float, default=0.1, help="cosine decay to this fraction of --lr"
    )
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument(
        "--log-dir",
        default="runs/train_gpt",
        help="rank 0 writes metrics.jsonl here (and TensorBoard events, if installed), and the "
        "last step's timeline.png unless --checkpoint-dir is given",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck peer fails")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save checkpoints here (step-N); on start, resume from the newest complete one",
    )
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    p.add_argument(
        "--loss-log", default=None, help="rank 0 appends 'step loss' (exact, repr) per step here"
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def batches(data: torch.Tensor, size: int, seq: int, seed: int, start_step: int = 1):
    """Random windows of the corpus; the same on every rank (same seed). The
    batch of step i depends only on (seed, i): a resumed run continues the
    same stream from its step (the data position is the step)."""
    step = start_step
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        start = torch.randint(0, data.numel() - seq - 1, (size,), generator=g)
        window = torch.stack([data[s : s + seq + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]
        step += 1


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to --lr, then cosine decay to --min-lr x --lr at --steps."""
    if step <= args.warmup:
        return args.lr * step / max(1, args.warmup)
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr + (1 - args.min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))


class Metrics:
    """Rank 0's metrics: JSON lines, TensorBoard when installed, a progress bar."""

    def __init__(self, log_dir: Path, steps: range, progress: bool) -> None:
        from tqdm import tqdm

        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self.tensorboard = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(log_dir))
        except ImportError:  # tensorboard is optional
            pass
        self.bar = tqdm(steps, disable=not progress, unit="step", dynamic_ncols=True)

    def log(self, step: int | None, **values: float) -> None:
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        if self.tensorboard is not None and step is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, step)

    def close(self) -> None:
        self.bar.close()
        self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def save_timeline_png(runner: mpmd.PipelineRunner, path: Path) -> str:
    """The last step's measured timeline under the simulator's prediction from
    the same step's task costs (collective: every rank calls it)."""
    measured = runner.gather_timeline()
    if dist.get_rank() != 0:
        return ""
    program = runner.program
    predicted = program.simulate(mpmd.Costs.from_timeline(measured, program.num_stages))
    try:
        mpmd.viz.plot([predicted, measured], str(path))
    except ImportError:
        return "(matplotlib is not installed: no timeline.png)"
    return (
        f"timeline of the last step: measured {measured.step_time:.3f} s, predicted "
        f"{predicted.step_time:.3f} s -> {path}"
    )


def expert_balance(metrics: dict) -> dict[str, float | int]:
    """From a step's metrics under expert parallelism: the busiest expert's
    tokens over the mean (1.0: balanced), and the all-to-all bytes this rank
    sent; nothing without it."""
    tokens = metrics.get("tokens_per_expert")
    if not tokens:
        return {}
    counts = torch.stack([t.double() for t in tokens.values()])
    return {
        "busiest_expert_over_mean": float((counts.max(1).values / counts.mean(1)).max()),
        "all_to_all_bytes": int(metrics["all_to_all_sent_bytes"]),
    }


def main() -> None:
    args = parse_args()
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if not use_cuda:
        # Process-wide CPU policies for pipelines over Gloo (what it changes:
        # torchmpmd.runtime.tune, or print(tuning)).
        tuning = mpmd.tune_cpu()
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"tune_cpu: malloc {tuning.malloc}; Gloo threads {tuning.gloo_threads}")
    rank, world = dist.get_rank(), dist.get_world_size()
    # One write (atomic on a pipe), so that ranks' lines never interleave.
    sys.stdout.write(f"rank {rank} pid {os.getpid()}\n")
    sys.stdout.flush()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if not use_cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.ep > 1 and (not args.moe or args.tp > 1):
        raise SystemExit("--ep shards the experts of --moe, without --tp")
    if world % (args.dp * args.tp * args.ep):
        raise SystemExit(
            f"--dp {args.dp} x --tp {args.tp} x --ep {args.ep} does not divide the {world} "
            "processes"
        )
    pp_size = world // (args.dp * args.tp * args.ep)
    if args.tp > 1:
        shape, names = (pp_size, args.dp, args.tp), ("pp", "dp", "tp")
    elif args.ep > 1:
        shape, names = (pp_size, args.dp, args.ep), ("pp", "dp", "ep")
    else:
        shape, names = (pp_size, args.dp), ("pp", "dp")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    pp_rank = mesh.get_local_rank("pp")
    replicas = args.dp * args.ep  # data-parallel ranks: each steps on its own shard

    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    split = int(0.9 * data.numel())
    train, held_out = data[:split], data[split:]

    cfg = GPTConfig(
        seq_len=args.seq_len,
        dim=args.dim,
        heads=args.heads,
        layers=args.layers,
        experts=args.experts if args.moe else 0,
    )
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    if args.meta_init:
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    per_rank = args.stages_per_rank or SCHEDULES[args.schedule].stages_per_rank
    num_stages = pp_size * per_rank
    example = torch.zeros(args.microbatch_size, args.seq_len, dtype=torch.long)
    pipe = mpmd.trace(model, (example,), split_before=split_points(cfg, num_stages))
    if rank == 0:
        print(pipe, flush=True)

    schedule = SCHEDULES[args.schedule](args.microbatches)
    runner = mpmd.PipelineRunner(
        pipe,
        schedule,
        mesh=mesh,
        device=device,
        loss_fn=lm_loss,
        options=mpmd.RunnerOptions(
            data_parallel=args.data_parallel if replicas > 1 else None, timeout=args.timeout
        ),
    )
    if args.meta_init:
        # The same weights on every data-parallel replica of a pipeline rank.
        torch.manual_seed(args.seed + pp_rank)
        runner.init_weights(GPT.init_weights)
    opt = torch.optim.AdamW(runner.parameters(), lr=args.lr, weight_decay=0.1)
    local_bytes = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in runner.parameters()
    )
    all_bytes: list[int | None] = [None] * world
    dist.all_gather_object(all_bytes, local_bytes)
    batch_size = args.microbatches * args.microbatch_size  # per data-parallel rank
    tokens_per_step = batch_size * args.seq_len * replicas
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(
            f"\n{n / 1e6:.2f}M parameters, {num_stages} stages on {pp_size} pipeline ranks x "
            f"{args.dp} data-parallel x {args.tp} tensor-parallel x {args.ep} expert-parallel "
            f"({dist.get_backend()}), "
            f"{type(schedule).__name__}, "
            f"{args.microbatches} x {args.microbatch_size} sequences of {args.seq_len} per "
            "step and replica",
            flush=True,
        )
        for r, nbytes in enumerate(all_bytes):
            print(f"rank {r}: {(nbytes or 0) / 2**20:.2f} MiB of parameters", flush=True)

    first_step = 1
    resume = mpmd.checkpoint.latest(args.checkpoint_dir) if args.checkpoint_dir else None
    if resume is not None:
        extra = mpmd.checkpoint.load(resume, runner, opt)
        first_step = int(extra["step"]) + 1
        if int(extra.get("ranks", -1)) == world and "per_rank" in extra:
            torch.set_rng_state(extra["per_rank"]["rng"])  # dropout continues the same draws
        else:
            # Another number of ranks: stages moved, so no rank's saved draws
            # are its own any more; each starts afresh from (seed, step, rank).
            torch.manual_seed((args.seed * 1_000_003 + first_step) * 4099 + rank)
            if rank == 0:
                print(
                    f"the checkpoint was written by {extra.get('ranks', '?')} ranks, this job "
                    f"has {world}: random generator states start afresh",
                    flush=True,
                )
        if rank == 0:
            print(f"resumed from {resume} at step {first_step}", flush=True)
    stream = batches(train, batch_size * replicas, args.seq_len, args.seed, first_step)
    dp_rank = dist.get_rank(runner.dp_group) if runner.dp_group is not None else 0
    shard = slice(dp_rank * batch_size, (dp_rank + 1) * batch_size)
    steps = range(first_step, args.steps + 1)
    metrics = Metrics(Path(args.log_dir), steps, not args.no_progress) if rank == 0 else None
    say = metrics.bar.write if metrics is not None else print
    window_start, window_tokens = time.perf_counter(), 0
    train_start = time.perf_counter()
    for step in steps:
        x, y = next(stream)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        opt.zero_grad(set_to_none=True)
        out = runner.step(x[shard], target=y[shard])
        norm = runner.clip_grad_norm_(args.clip) if args.clip > 0 else None
        opt.step()
        if rank == 0 and args.loss_log:
            with open(args.loss_log, "a") as log:
                log.write(f"{step} {out.loss.item()!r}\n")
        if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
            started = time.perf_counter()
            mpmd.checkpoint.save(
                Path(args.checkpoint_dir) / f"step-{step}",
                runner,
                opt,
                extra={"step": step, "ranks": world, "per_rank": {"rng": torch.get_rng_state()}},
            )
            if rank == 0:
                say(f"checkpoint step-{step} in {time.perf_counter() - started:.2f} s")
        window_tokens += tokens_per_step
        if metrics is not None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - window_start
            rate = window_tokens / elapsed
            loss = out.loss.item()
            metrics.bar.update(1)
            metrics.bar.set_postfix(loss=f"{loss:.3f}", tokens_s=f"{rate:,.0f}", refresh=False)
            balance = expert_balance(out.metrics)
            metrics.log(
                step,
                loss=loss,
                lr=opt.param_groups[0]["lr"],
                tokens_per_s=rate,
                elapsed_s=time.perf_counter() - train_start,
                **({"grad_norm": float(norm)} if norm is not None else {}),
                **balance,
            )
            if step % args.log_every == 0 or step == first_step:
                moe = "".join(
                    f"  {k.replace('_', ' ')} {v:,.2f}" if isinstance(v, float) else f"  {k} {v:,}"
                    for k, v in balance.items()
                )
                say(f"step {step:4d}  loss {loss:.4f}  {rate:,.0f} tokens/s{moe}")
            window_start, window_tokens = time.perf_counter(), 0
    trained = time.perf_counter() - train_start

    x, y = next(batches(held_out, batch_size, args.seq_len, args.seed + 1))
    logits = runner.eval_step(x)
    held_out_loss = lm_loss(logits.float(), y.to(logits.device)).item()
    png = Path(args.checkpoint_dir or args.log_dir) / "timeline.png"
    timeline_note = save_timeline_png(runner, png)  # collective: every rank's last step
    if metrics is not None:
        metrics.log(None, held_out_loss=held_out_loss, train_seconds=trained)
        metrics.close()
        print(
            f"trained {len(steps)} steps in {trained:.1f} s; held-out loss {held_out_loss:.4f} "
            "nats per byte",
            flush=True,
        )
        print(timeline_note, flush=True)
        print(f"metrics: {metrics.path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
