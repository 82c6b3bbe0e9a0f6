"""Random numbers drawn outside torch in forward (numpy, Python's `random`)
are run once by torch.export and would be frozen into the graph: the pipeline
would replay the training-time mask or layer drop drawn while tracing at every
step. `mpmd.trace` refuses such a model, naming the module that drew, rather
than train it silently wrong; torch's own generators stay traced."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import torchmpmd as mpmd


class _NumpyMask(nn.Module):
    """Zeroes a random column, chosen with numpy (as SpecAugment-style masks are)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        column = int(np.random.randint(h.shape[-1]))
        mask = torch.ones(h.shape[-1], device=h.device)
        mask[column] = 0.0
        return h * mask


class _PythonLayerDrop(nn.Module):
    """Skips its layer with probability 0.5, drawn with Python's random."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h if random.random() < 0.5 else self.layer(h)


class _Net(nn.Module):
    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.middle = middle
        self.last = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.middle(torch.tanh(self.first(x))))


class _OwnGenerator(nn.Module):
    """Draws its noise from a torch.Generator of its own (export lifts it as an object)."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.rand(h.shape, generator=self.generator)


class _TorchDropout(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.bernoulli(torch.full_like(h, 0.5))


x = torch.randn(2, 4)


@pytest.mark.parametrize(
    ("middle", "where", "which"),
    [
        (_NumpyMask(), r"module 'middle' \(_NumpyMask\)", "numpy.random"),
        (_PythonLayerDrop(), r"module 'middle' \(_PythonLayerDrop\)", "Python's random"),
    ],
    ids=["numpy", "python-random"],
)
def test_a_draw_outside_torch_is_refused_naming_the_module(middle, where, which):
    model = _Net(middle)
    with pytest.raises(RuntimeError, match=rf"{where} draws random numbers with {which}.*To fix"):
        mpmd.trace(model, (x,), split_before=["last"])


def test_the_draw_is_found_in_the_model_built_on_meta():
    with torch.device("meta"):
        model = _Net(_NumpyMask())
    with pytest.raises(RuntimeError, match=r"'middle' \(_NumpyMask\) draws random numbers"):
        mpmd.trace(model, (x,), split_before=["last"])


def test_torch_draws_and_draws_outside_forward_still_trace():
    np.random.rand(3)  # the caller's own draws, before and between traces
    random.random()
    pipe = mpmd.trace(_Net(_TorchDropout()), (x,), split_before=["last"])
    torch.manual_seed(0)
    first = pipe(x)
    second = pipe(x)
    assert not torch.equal(first, second)  # a fresh mask at each call, as in eager


def test_a_generator_of_its_own_is_refused_naming_the_module():
    with pytest.raises(
        RuntimeError,
        match=r"module 'middle' \(_OwnGenerator\) draws random numbers from its own "
        r"torch.Generator.*To fix: drop generator=",
    ):
        mpmd.trace(_Net(_OwnGenerator()), (x,), split_before=["last"])


@pytest.mark.slow
def test_hugging_face_wav2vec2_in_training_mode():
    import transformers

    config = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=[8, 8],
        conv_stride=[5, 2],
        conv_kernel=[10, 3],
        num_feat_extract_layers=2,
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        layerdrop=0.0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        mask_time_length=2,
    )
    audio = {"input_values": torch.randn(2, 400)}
    torch.manual_seed(0)
    masked = transformers.Wav2Vec2Model(transformers.Wav2Vec2Config(**config, mask_time_prob=0.3))
    with pytest.raises(RuntimeError, match=r"root module \(Wav2Vec2Model\) draws.*mask_time_prob"):
        mpmd.trace(masked, (), audio)
    masked.eval()  # no masks in eval mode: nothing to freeze
    assert torch.equal(mpmd.trace(masked, (), audio)(**audio)[0], masked(**audio)[0])

    torch.manual_seed(0)
    plain = transformers.Wav2Vec2Model(transformers.Wav2Vec2Config(**config, mask_time_prob=0.0))
    assert torch.equal(mpmd.trace(plain, (), audio)(**audio)[0], plain(**audio)[0])
