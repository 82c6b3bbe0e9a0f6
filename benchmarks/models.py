"""The models the planning benchmarks measure: three with uneven layers (an
LM with a heavy head, an encoder-decoder, a U-Net) and a pre-norm
transformer built, as a new user would, from `nn.TransformerEncoderLayer`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import repo_paths  # noqa: F401  (examples/ on the import path)
import torch
import torch.nn as nn
import torch.nn.functional as F
from gpt import GPT, GPTConfig, lm_loss


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.cross = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln3 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.self_attn(h, h, h, need_weights=False, is_causal=False)[0]
        h = self.ln2(x)
        x = x + self.cross(h, memory, memory, need_weights=False)[0]
        return x + self.mlp(self.ln3(x))


class Seq2Seq(nn.Module):
    """Long source, short target: heavy encoder layers, light decoder layers
    (each reading the encoder's output), a large output vocabulary."""

    def __init__(
        self, src_vocab: int = 1024, tgt_vocab: int = 8192, dim: int = 64, heads: int = 4
    ) -> None:
        super().__init__()
        self.src_emb = nn.Embedding(src_vocab, dim)
        self.enc = nn.ModuleList(EncoderLayer(dim, heads) for _ in range(4))
        self.enc_norm = nn.LayerNorm(dim)
        self.tgt_emb = nn.Embedding(tgt_vocab, dim)
        self.dec = nn.ModuleList(DecoderLayer(dim, heads) for _ in range(2))
        self.dec_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, tgt_vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.src_emb(src)
        for layer in self.enc:
            memory = layer(memory)
        memory = self.enc_norm(memory)
        x = self.tgt_emb(tgt)
        for layer in self.dec:
            x = layer(x, memory)
        return self.head(self.dec_norm(x))


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.c2(F.relu(self.c1(x))))


class UNet(nn.Module):
    """Few channels per level, so the full-resolution levels dominate; the
    decoder (with a refinement block at full resolution) outweighs the
    encoder, and every encoder level skips to its decoder mirror."""

    def __init__(self, ch: tuple[int, ...] = (12, 16, 24, 32)) -> None:
        super().__init__()
        c1, c2, c3, c4 = ch
        self.enc1, self.enc2, self.enc3 = ConvBlock(3, c1), ConvBlock(c1, c2), ConvBlock(c2, c3)
        self.mid = ConvBlock(c3, c4)
        self.up3, self.dec3 = nn.ConvTranspose2d(c4, c3, 2, stride=2), ConvBlock(2 * c3, c3)
        self.up2, self.dec2 = nn.ConvTranspose2d(c3, c2, 2, stride=2), ConvBlock(2 * c2, c2)
        self.up1, self.dec1 = nn.ConvTranspose2d(c2, c1, 2, stride=2), ConvBlock(2 * c1, c1)
        self.refine = ConvBlock(c1, c1)
        self.out = nn.Conv2d(c1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        m = self.mid(F.max_pool2d(e3, 2))
        d3 = self.dec3(torch.cat([self.up3(m), e3], dim=1))
        d2 = self.dec2(torch.cat([self.up2(d3), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.out(self.refine(d1))


@dataclass
class Case:
    name: str
    model: nn.Module
    batch: tuple[torch.Tensor, ...]  # the whole step's inputs (dim 0: samples)
    target: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cases(m: int, b: int) -> list[Case]:
    g = torch.Generator().manual_seed(1)
    n = m * b
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=16384, seq_len=32, dim=64, heads=4, layers=6))
    torch.manual_seed(0)
    s2s = Seq2Seq()
    torch.manual_seed(0)
    unet = UNet()
    return [
        Case(
            "gpt (vocab 16k)",
            gpt,
            (torch.randint(0, 16384, (n, 32), generator=g),),
            torch.randint(0, 16384, (n, 32), generator=g),
            lm_loss,
        ),
        Case(
            "encoder-decoder",
            s2s,
            (
                torch.randint(0, 1024, (n, 96), generator=g),
                torch.randint(0, 8192, (n, 16), generator=g),
            ),
            torch.randint(0, 8192, (n, 16), generator=g),
            lm_loss,
        ),
        Case(
            "u-net",
            unet,
            (torch.randn(n, 3, 48, 48, generator=g),),
            torch.randn(n, 1, 48, 48, generator=g),
            F.mse_loss,
        ),
    ]


class PreNormLM(nn.Module):
    """Embedding, `nn.TransformerEncoderLayer(norm_first=True)` blocks, a final
    norm and a head: the layers torch itself ships, used as they come."""

    def __init__(self, vocab: int = 2048, dim: int = 160, heads: int = 4, layers: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim,
                heads,
                4 * dim,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def prenorm_case(m: int, b: int, seq: int = 128) -> Case:
    """8 pre-norm blocks of dim 160, as the issue that found the split
    backward's cost tried them."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model = PreNormLM()
    return Case(
        "pre-norm transformer",
        model,
        (torch.randint(0, 2048, (m * b, seq), generator=g),),
        torch.randint(0, 2048, (m * b, seq), generator=g),
        lm_loss,
    )
