"""Traces the bundled GPT, splits it into stages and prints the stage plan.

python examples/inspect_plan.py --stages 4 --microbatch 8
"""

from __future__ import annotations

import argparse
import sys

import torch
from gpt import GPT, GPTConfig, split_points

import torchmpmd as mpmd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()

    cfg = GPTConfig(layers=args.layers)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (args.microbatch, cfg.seq_len))
    pipe = mpmd.trace(model, (ids,), split_before=split_points(cfg, args.stages))
    print(pipe)
    same = torch.equal(pipe(ids), model(ids))
    print(f"\npipe(ids) == model(ids) bitwise: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
