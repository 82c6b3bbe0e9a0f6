"""Input-gradient (I) plus weight-gradient (W) against one full backward (B) on
the same stage, timed side by side in one run.

    python benchmarks/split_backward.py [--compile]

The stage is two GPT blocks. B is autograd's backward of the traced stage;
I and W are the graphs torchmpmd cuts from one traced forward+backward. If I
redid work W needs (or W redid I's), I + W would cost well over one B.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import repo_paths  # noqa: F401  (examples/ on the import path)
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from gpt import GPT, GPTConfig
from models import PreNormLM
from torch.fx.experimental.proxy_tensor import make_fx

import torchmpmd as mpmd
from torchmpmd.graph.split import SplitStage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile the F/I/W graphs")
    p.add_argument(
        "--model",
        choices=["gpt", "prenorm"],
        default="gpt",
        help="the bundled GPT's blocks, or nn.TransformerEncoderLayer(norm_first=True) blocks",
    )
    p.add_argument("--profile", action="store_true", help="torch.profiler's op table of B, I, W")
    p.add_argument(
        "--orders",
        action="store_true",
        help="also the same backward nodes as one fx graph, in autograd's order and cut-I-first",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    if args.model == "gpt":
        model: torch.nn.Module = GPT(GPTConfig(dim=args.dim, layers=4, seq_len=args.seq, heads=4))
    else:
        model = PreNormLM(dim=args.dim, layers=4)
    pipe = mpmd.trace(model, (ids,), split_before=["blocks.1", "blocks.3"])
    stage = pipe.stage(1)  # blocks 1 and 2: input and output are activations
    spec = pipe.stage_specs[1]
    x = torch.randn(spec.input_specs[0].shape)
    grad_out = torch.randn(spec.output_specs[0].shape)

    def fn(params, buffers, xs):
        state = dict(zip([n for n, _ in stage.named_parameters()], params, strict=True))
        return list(torch.func.functional_call(stage, state, tuple(xs)))

    split = SplitStage(stage, fn, [x], [0], {} if args.compile else None)

    def clear_grads() -> None:
        # Each backward starts from no .grad (no accumulation on either side).
        for param in stage.parameters():
            param.grad = None

    def full_backward() -> float:
        leaf = x.detach().requires_grad_()
        (out,) = stage(leaf)
        start = time.perf_counter()
        torch.autograd.backward([out], [grad_out])
        elapsed = time.perf_counter() - start
        clear_grads()
        return elapsed

    def split_backward() -> tuple[float, float]:
        saved = split.forward([x])[1:]
        start = time.perf_counter()
        _, for_w = split.input_grad(saved, [grad_out])
        mid = time.perf_counter()
        split.weight_grad(for_w)
        end = time.perf_counter()
        clear_grads()
        return mid - start, end - mid

    orders = _one_graph_orders(stage, x, grad_out) if args.orders else {}
    for _ in range(3):  # warm-up (and compilation)
        full_backward()
        split_backward()
        for run in orders.values():
            run()
    b, i, w = [], [], []
    by_order: dict[str, list[float]] = {name: [] for name in orders}
    for _ in range(args.repeats):
        b.append(full_backward())
        ti, tw = split_backward()
        i.append(ti)
        w.append(tw)
        for name, run in orders.items():
            by_order[name].append(run())
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("B", full_backward), ("I + W", split_backward)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    fn()
            print(f"--- {name}, 10 runs")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    mb, mi, mw = (statistics.median(v) * 1e3 for v in (b, i, w))
    print(
        f"stage: 2 {args.model} blocks, dim {args.dim}, {args.batch}x{args.seq} tokens"
        f"{', compiled' if args.compile else ''}; median of {args.repeats}"
    )
    print(f"B (autograd)   {mb:8.2f} ms")
    print(f"I              {mi:8.2f} ms  ({mi / mb:.2f} B)")
    print(f"W              {mw:8.2f} ms  ({mw / mb:.2f} B)")
    print(f"I + W          {mi + mw:8.2f} ms  ({(mi + mw) / mb:.2f} B)")
    for name, times in by_order.items():
        t = statistics.median(times) * 1e3
        print(f"{name:38s} {t:8.2f} ms  ({t / mb:.3f} B)")


def _one_graph_orders(
    stage: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor
) -> dict[str, Any]:
    """The stage's backward nodes (traced once with make_fx, as `graph.split`
    does) run as one fx graph: in autograd's order, and with every
    input-gradient node first (the order I then W runs them, without the
    call boundary). Each returns the seconds of one backward."""
    params = [p.detach() for p in stage.parameters()]
    names = [n for n, _ in stage.named_parameters()]

    def joint(ps: list[torch.Tensor], xs: list[torch.Tensor], ts: list[torch.Tensor]) -> Any:
        outs = list(torch.func.functional_call(stage, dict(zip(names, ps, strict=True)), (*xs,)))
        return outs, list(torch.autograd.grad(outs, [*xs, *ps], ts, allow_unused=True))

    with torch.enable_grad():
        gm = make_fx(joint)(
            [p.clone().requires_grad_() for p in params], [x.clone().requires_grad_()], [grad_out]
        )
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    p_nodes, t_nodes = placeholders[: len(params)], placeholders[len(params) + 1 :]
    out_nodes = pytree.tree_leaves(gm.graph.output_node().args[0], is_leaf=lambda v: v is None)
    forward = _ancestors(out_nodes[:1])
    backward = [n for n in nodes if n.op == "call_function" and n not in forward]
    input_part = _ancestors(out_nodes[1:2])
    saved = list(
        dict.fromkeys(
            a
            for n in backward
            for a in n.all_input_nodes
            if a in forward or (a.op == "placeholder" and a not in p_nodes + t_nodes)
        )
    )
    run_forward = _graph(
        gm, [n for n in nodes if n in forward], placeholders[: len(params) + 1], saved
    )
    grads = out_nodes[1:]
    cut = [n for n in backward if n in input_part] + [n for n in backward if n not in input_part]
    result = {}
    for name, order in (
        ("one graph, autograd's order", backward),
        ("one graph, I's nodes first", cut),
    ):
        graph = _graph(gm, order, [*p_nodes, *saved, *t_nodes], grads)

        def run(graph: fx.GraphModule = graph) -> float:
            kept = run_forward(*params, x)
            start = time.perf_counter()
            graph(*params, *kept, grad_out)
            return time.perf_counter() - start

        result[name] = run
    return result


def _ancestors(roots: list[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _graph(
    gm: fx.GraphModule, order: list[fx.Node], inputs: list[fx.Node], outputs: list[Any]
) -> fx.GraphModule:
    graph = fx.Graph()
    env = {n: graph.placeholder(f"in{i}") for i, n in enumerate(inputs)}
    for n in order:
        if n.op == "call_function":
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph)


if __name__ == "__main__":
    main()
