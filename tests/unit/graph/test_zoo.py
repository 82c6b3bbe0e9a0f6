"""Real models as their authors wrote them: Hugging Face `transformers`
architectures from tiny configs (no downloads), each traced into 3 stages
and trained one step with 1F1B and ZB-H1 on in-process ranks; loss and every
gradient must equal eager gradient accumulation. Float64 within 1e-10, except
the MoE models, whose grouped-matmul kernel has no float64 (float32 within
1e-5 there)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as T
from models import HF_DECODER, _gen, lm_loss

import torchmpmd as mpmd
from torchmpmd.testing import LocalPipeline

# Every test here takes over ~2 s on 2 cores.
pytestmark = pytest.mark.slow

M = 4
_DROPOUTS = (
    "p",
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "dropout_rate",
    "hidden_dropout",
    "attn_dropout",
    "resid_dropout",
    "embed_dropout",
    "drop_prob",
)


def _logits_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out["logits"]
    return lm_loss(logits.double(), y)


def _input_ids(b: int) -> tuple[tuple, dict]:
    return (), {"input_ids": torch.randint(0, 96, (b, 8), generator=_gen(b)), "use_cache": False}


def _masked_tokens(b: int) -> tuple[tuple, dict]:
    mask = torch.ones(b, 8, dtype=torch.long)
    mask[:, -2:] = 0  # padding the attention mask must hide
    return (), {
        "input_ids": torch.randint(0, 96, (b, 8), generator=_gen(b)),
        "attention_mask": mask,
    }


def _seq2seq(b: int) -> tuple[tuple, dict]:
    g = _gen(b)
    return (), {
        "input_ids": torch.randint(0, 96, (b, 8), generator=g),
        "decoder_input_ids": torch.randint(0, 96, (b, 6), generator=g),
        "use_cache": False,
    }


def _images(b: int) -> tuple[tuple, dict]:
    return (torch.randn(b, 3, 16, 16, generator=_gen(b)),), {}


@dataclass(frozen=True)
class Arch:
    build: Callable[[], nn.Module]
    split_before: list[str]
    inputs: Callable[[int], tuple[tuple, dict]] = _input_ids
    target: Callable[[int], torch.Tensor] = lambda b: torch.randint(
        0, 96, (b, 8), generator=_gen(b + 7)
    )
    loss: Callable[[Any, torch.Tensor], torch.Tensor] = _logits_loss
    attention: tuple[str, ...] = ("eager", "sdpa")
    dtype: torch.dtype = torch.float64


def _decoder(
    config: Callable[..., Any], model: Callable[[Any], nn.Module], **extra: Any
) -> Callable[[], nn.Module]:
    settings = {**HF_DECODER, **extra}  # a model's own settings override the common ones

    def build() -> nn.Module:
        return model(config(**settings))

    return build


def _convnext(
    config: Callable[..., Any], model: Callable[[Any], nn.Module]
) -> Callable[[], nn.Module]:
    return lambda: model(
        config(
            image_size=16,
            patch_size=4,
            num_stages=3,
            hidden_sizes=[8, 16, 24],
            depths=[1, 1, 1],
            num_labels=4,
        )
    )


_CLASSIFY: dict[str, Any] = {
    "inputs": _images,
    "target": lambda b: torch.randint(0, 4, (b,), generator=_gen(b + 7)),
    "loss": lambda out, y: F.cross_entropy(out.logits, y),
}

_LAYERS = ["model.layers.1", "model.layers.3"]
_MOE = {"dtype": torch.float32}

ARCHS: dict[str, Arch] = {
    "llama": Arch(_decoder(lambda **k: T.LlamaConfig(**k), T.LlamaForCausalLM), _LAYERS),
    "mistral": Arch(_decoder(lambda **k: T.MistralConfig(**k), T.MistralForCausalLM), _LAYERS),
    "qwen2": Arch(_decoder(lambda **k: T.Qwen2Config(**k), T.Qwen2ForCausalLM), _LAYERS),
    "qwen3": Arch(
        _decoder(lambda **k: T.Qwen3Config(**k), T.Qwen3ForCausalLM, head_dim=8), _LAYERS
    ),
    "gemma": Arch(
        _decoder(lambda **k: T.GemmaConfig(**k), T.GemmaForCausalLM, head_dim=8), _LAYERS
    ),
    # Gemma 2's attention soft-capping has no SDPA kernel in transformers.
    "gemma2": Arch(
        _decoder(lambda **k: T.Gemma2Config(**k), T.Gemma2ForCausalLM, head_dim=8),
        _LAYERS,
        attention=("eager",),
    ),
    "phi3": Arch(
        _decoder(lambda **k: T.Phi3Config(**k), T.Phi3ForCausalLM, pad_token_id=0), _LAYERS
    ),
    "mixtral": Arch(
        _decoder(
            lambda **k: T.MixtralConfig(**k),
            T.MixtralForCausalLM,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        _LAYERS,
        **_MOE,
    ),
    "qwen2_moe": Arch(
        _decoder(
            lambda **k: T.Qwen2MoeConfig(**k),
            T.Qwen2MoeForCausalLM,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
        _LAYERS,
        **_MOE,
    ),
    "olmoe": Arch(
        _decoder(
            lambda **k: T.OlmoeConfig(**k), T.OlmoeForCausalLM, num_experts=4, num_experts_per_tok=2
        ),
        _LAYERS,
        **_MOE,
    ),
    "qwen3_moe": Arch(
        _decoder(
            lambda **k: T.Qwen3MoeConfig(**k),
            T.Qwen3MoeForCausalLM,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
        _LAYERS,
        attention=("eager",),
        **_MOE,
    ),
    # Multi-head latent attention (low-rank queries and keys/values, every
    # head its own key) and a dense first layer before the routed ones.
    "deepseek_v3": Arch(
        _decoder(
            lambda **k: T.DeepseekV3Config(**k),
            T.DeepseekV3ForCausalLM,
            num_key_value_heads=4,  # its eager attention needs one per head
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
        _LAYERS,
        attention=("eager",),
        **_MOE,
    ),
    # Routes with data-dependent shapes: ZB-H1 runs its MoE stages' whole
    # backward (B) in place of I/W, and says so.
    "jetmoe": Arch(
        lambda: T.JetMoeForCausalLM(
            T.JetMoeConfig(
                vocab_size=96,
                hidden_size=32,
                num_hidden_layers=4,
                num_key_value_heads=2,
                kv_channels=8,
                intermediate_size=32,
                num_local_experts=4,
                num_experts_per_tok=2,
                max_position_embeddings=64,
            )
        ),
        _LAYERS,
        attention=("eager",),
        **_MOE,
    ),
    "gpt2": Arch(
        lambda: T.GPT2LMHeadModel(
            T.GPT2Config(
                vocab_size=96,
                n_embd=32,
                n_layer=4,
                n_head=4,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        ["transformer.h.1", "transformer.h.3"],
    ),
    "gpt_neox": Arch(
        lambda: T.GPTNeoXForCausalLM(
            T.GPTNeoXConfig(
                vocab_size=96,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                max_position_embeddings=64,
            )
        ),
        ["gpt_neox.layers.1", "gpt_neox.layers.3"],
    ),
    "opt": Arch(
        lambda: T.OPTForCausalLM(
            T.OPTConfig(
                vocab_size=96,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                max_position_embeddings=64,
                word_embed_proj_dim=32,
            )
        ),
        ["model.decoder.layers.1", "model.decoder.layers.3"],
    ),
    "bert": Arch(
        lambda: T.BertForMaskedLM(
            T.BertConfig(
                vocab_size=96,
                hidden_size=32,
                num_hidden_layers=4,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=64,
            )
        ),
        ["bert.encoder.layer.1", "bert.encoder.layer.3"],
        inputs=_masked_tokens,
    ),
    # Encoder-decoders split inside the encoder and inside the decoder: the
    # encoder's output crosses from stage 1 to every decoder stage.
    "t5": Arch(
        lambda: T.T5ForConditionalGeneration(
            T.T5Config(
                vocab_size=96,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                decoder_start_token_id=0,
            )
        ),
        ["encoder.block.1", "decoder.block.1"],
        inputs=_seq2seq,
        target=lambda b: torch.randint(0, 96, (b, 6), generator=_gen(b + 7)),
    ),
    "bart": Arch(
        lambda: T.BartForConditionalGeneration(
            T.BartConfig(
                vocab_size=96,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
            )
        ),
        ["model.encoder.layers.1", "model.decoder.layers.1"],
        inputs=_seq2seq,
        target=lambda b: torch.randint(0, 96, (b, 6), generator=_gen(b + 7)),
    ),
    "vit": Arch(
        lambda: T.ViTForImageClassification(
            T.ViTConfig(
                image_size=16,
                patch_size=4,
                hidden_size=32,
                num_hidden_layers=4,
                num_attention_heads=4,
                intermediate_size=64,
                num_labels=4,
            )
        ),
        ["vit.layers.1", "vit.layers.3"],
        **_CLASSIFY,
    ),
    "swin": Arch(
        lambda: T.SwinForImageClassification(
            T.SwinConfig(
                image_size=16,
                patch_size=2,
                embed_dim=16,
                depths=[1, 1, 1],
                num_heads=[2, 2, 2],
                window_size=2,
                num_labels=4,
            )
        ),
        ["swin.encoder.layers.1", "swin.encoder.layers.2"],
        **_CLASSIFY,
        attention=("eager",),
    ),
    # Its layers end in a permute: a stage's output (and so the gradient the
    # next stage sends back) is laid out channels-last, not contiguous.
    "convnext": Arch(
        _convnext(T.ConvNextConfig, T.ConvNextForImageClassification),
        ["convnext.encoder.stages.1", "convnext.encoder.stages.2"],
        **_CLASSIFY,
        attention=("eager",),
    ),
    # ConvNeXt V2's global response norm reduces over the channels-last
    # layout its permute made.
    "convnextv2": Arch(
        _convnext(T.ConvNextV2Config, T.ConvNextV2ForImageClassification),
        ["convnextv2.encoder.stages.1", "convnextv2.encoder.stages.2"],
        **_CLASSIFY,
        attention=("eager",),
    ),
}


def _model(arch: Arch, attention: str) -> nn.Module:
    torch.manual_seed(0)
    model = arch.build()
    model.config._attn_implementation = attention
    model = model.to(arch.dtype).train()
    for module in model.modules():  # dropout off: the reference must be deterministic
        for name in _DROPOUTS:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    return model


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return (
        value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
    )


def _chunk(value: Any, i: int) -> Any:
    return value.chunk(M)[i] if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize(
    ("name", "attention"), [(n, a) for n, arch in ARCHS.items() for a in arch.attention]
)
def test_architecture_trains_like_eager(name, attention):
    arch = ARCHS[name]
    args, kwargs = arch.inputs(2 * M)
    args = tuple(_cast(a, arch.dtype) for a in args)
    target = arch.target(2 * M)
    ref = _model(arch, attention)
    losses = []
    for i in range(M):
        out = ref(*(_chunk(a, i) for a in args), **{k: _chunk(v, i) for k, v in kwargs.items()})
        loss = arch.loss(out, _chunk(target, i))
        (loss / M).backward()
        losses.append(loss.detach().double())
    ref_loss = torch.stack(losses).mean()
    tol = 1e-10 if arch.dtype == torch.float64 else 1e-5
    model = _model(arch, attention)
    pipe = mpmd.trace(
        model,
        tuple(_chunk(a, 0) for a in args),
        {k: _chunk(v, 0) for k, v in kwargs.items()},
        split_before=arch.split_before,
    )
    assert pipe.num_stages == 3
    for schedule in (mpmd.schedules.OneFOneB(M), mpmd.schedules.ZeroBubbleH1(M)):
        local = LocalPipeline(pipe, schedule, 3, loss_fn=arch.loss, timeout=120)
        for out in local.step(*args, target=target, **kwargs):
            torch.testing.assert_close(out.loss, ref_loss, rtol=tol, atol=tol)
        seen = set()
        for runner in local.runners:
            for fqn, p in runner.named_parameters():
                expected = ref.get_parameter(fqn).grad
                if expected is None:
                    assert p.grad is None or not p.grad.any(), (schedule, fqn)
                    continue
                scale = expected.abs().max().clamp_min(1.0)
                torch.testing.assert_close(
                    p.grad / scale, expected / scale, rtol=tol, atol=tol, msg=f"{schedule}: {fqn}"
                )
                seen.add(fqn)
        assert seen, "no parameter was checked"
