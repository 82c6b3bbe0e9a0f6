"""A traced and split model must compute exactly what the model computes.

`pipe(*args)` runs every stage in order in one process; its outputs must be
bitwise equal to `model(*args)`, and a backward through it must leave
bitwise equal gradients in every parameter, for every fixture model.
"""

import pytest
import torch
from models import CASES, assert_close

import torchmpmd as mpmd

SMALL = ["mlp", "gpt", "unet", "kwargs", "marked"]
HF = ["hf_llama", "hf_llama_sdpa", "hf_gpt2"]


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _run(case, model, fn, args, kwargs):
    """Loss and parameter gradients of fn(*args, **kwargs) (fn: model or pipe)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # dropout in the Hugging Face models
    out = case.output(fn(*args, **kwargs))
    target = _cast(case.target(args[0].shape[0] if args else 2), out.dtype)
    case.loss(out, target).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(n, d) for n in SMALL for d in (torch.float32, torch.float64)]
    + [(n, torch.float32) for n in HF],
)
@pytest.mark.slow
def test_pipe_matches_model_bitwise(name, dtype):
    case = CASES[name]
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    model = case.model(dtype)
    args, kwargs = case.inputs(2)
    args = tuple(_cast(a, dtype) for a in args)
    kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}

    pipe = mpmd.trace(model, args, kwargs, **case.split)
    assert pipe.num_stages == case.num_stages

    ref_out, ref_grads = _run(case, model, model, args, kwargs)
    out, grads = _run(case, model, pipe, args, kwargs)
    assert torch.equal(out, ref_out), f"outputs differ by {(out - ref_out).abs().max()}"
    assert grads.keys() == ref_grads.keys()
    for fqn, g in grads.items():
        assert_close(g, ref_grads[fqn], f"grad of {fqn}", exact=case.exact_grads)


@pytest.mark.slow
def test_stage_parameters_keep_model_names_and_are_shared():
    case = CASES["gpt"]
    model = case.model()
    args, kwargs = case.inputs(2)
    pipe = mpmd.trace(model, args, kwargs, **case.split)
    model_params = dict(model.named_parameters(remove_duplicate=False))
    seen = set()
    for i in range(pipe.num_stages):
        for fqn, p in pipe.stage(i).named_parameters():
            assert model_params[fqn] is p, fqn
            seen.add(fqn)
    # The tied weight appears under the name its stage uses it by.
    assert "tok.weight" in dict(pipe.stage(0).named_parameters())
    assert "head.weight" in dict(pipe.stage(3).named_parameters())
    assert seen == set(model_params)
    assert pipe.tied == {"head.weight": (0, 3)} or pipe.tied == {"tok.weight": (0, 3)}


@pytest.mark.slow
def test_state_dict_keys_match_model_including_non_persistent_buffers():
    pytest.importorskip("transformers")
    case = CASES["hf_llama"]
    model = case.model()
    args, kwargs = case.inputs(2)
    pipe = mpmd.trace(model, args, kwargs, **case.split)
    keys = set()
    for i in range(pipe.num_stages):
        keys |= set(pipe.stage(i).state_dict())
    # rotary_emb.inv_freq is a non-persistent buffer: in no state_dict.
    assert keys <= set(model.state_dict())
    assert not any("inv_freq" in k for k in keys)
    assert set(model.state_dict()) - keys <= {"lm_head.weight", "model.embed_tokens.weight"}


def test_unet_skip_is_one_direct_transfer_across_boundaries():
    case = CASES["unet"]
    model = case.model()
    args, kwargs = case.inputs(2)
    pipe = mpmd.trace(model, args, kwargs, **case.split)
    # e1 (stage 0) is read by the decoder in stage 3: one transfer 0 -> 3.
    skips = [t for t in pipe.transfers if t.src_stage == 0 and 3 in t.dst_stages]
    assert len(skips) == 1
    skip = skips[0]
    assert skip.dst_stages == (3,)
    assert skip.requires_grad
    assert skip.spec.shape == (2, 4, 8, 8)
    # Stages 1 and 2 neither receive nor relay it.
    for s in (1, 2):
        assert skip.name not in pipe.stage_specs[s].input_names
        assert skip.name not in pipe.stage_specs[s].output_names
    assert skip.name in pipe.stage_specs[3].input_names


@pytest.mark.slow
def test_rope_tables_and_masks_are_recomputed_not_sent():
    pytest.importorskip("transformers")
    case = CASES["hf_llama"]
    model = case.model()
    args, kwargs = case.inputs(2)
    pipe = mpmd.trace(model, args, kwargs, **case.split)
    # Only the residual stream crosses each boundary: RoPE cos/sin and the
    # causal mask depend on no parameter and are cheap, so each stage
    # recomputes them from its own copy of the rotary buffer.
    assert [(t.src_stage, t.dst_stages) for t in pipe.transfers] == [(0, (1,)), (1, (2,))]
    assert all(t.spec.shape == (2, 12, 32) for t in pipe.transfers)
    for i in range(pipe.num_stages):
        assert any("inv_freq" in name for name, _ in pipe.stage(i).named_buffers())


def test_print_shows_stages_transfers_and_tied_parameters():
    case = CASES["gpt"]
    model = case.model()
    args, kwargs = case.inputs(2)
    text = str(mpmd.trace(model, args, kwargs, **case.split))
    assert "Pipe with 4 stages" in text
    for heading in ("Stages", "Transfers (per microbatch)", "Tied parameters"):
        assert heading in text
    assert "(2, 16, 32)  float32  4.0 KiB" in text
    assert "tok.weight, head.weight" in text
    assert "0, 3" in text


def test_markers_and_kwargs():
    case = CASES["marked"]
    model = case.model()
    x = torch.randn(3, 16)
    pipe = mpmd.trace(model, (x,))
    assert pipe.num_stages == 3
    assert torch.equal(pipe(x), model(x))
    # Outside mpmd.trace the marker is a plain identity.
    assert mpmd.mark_stage_end(x) is x
    pair = {"a": x, "n": 3}
    assert mpmd.mark_stage_end(pair) is pair


def test_marker_result_may_be_ignored():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            mpmd.mark_stage_end(h)  # result unused: the boundary still counts
            return self.b(h)

    model = M()
    x = torch.randn(2, 4)
    pipe = mpmd.trace(model, (x,))
    assert pipe.num_stages == 2
    assert torch.equal(pipe(x), model(x))


def test_no_grad_regions_keep_their_gradient_cut():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.frozen_path = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            with torch.no_grad():
                t = self.frozen_path(h) * 2
            return self.b(h + t)

    model = M()
    x = torch.randn(2, 4)
    pipe = mpmd.trace(model, (x,), split_before=["b"])
    model(x).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    pipe(x).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert "frozen_path.weight" not in ref
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_buffer_updates_land_in_the_model_buffers():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.bn = torch.nn.BatchNorm1d(4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.bn(self.a(x)))

    model = M()
    x = torch.randn(8, 4)
    pipe = mpmd.trace(model, (x,), split_before=["b"])
    reference = M()
    reference.load_state_dict(model.state_dict())
    expected = reference(x)
    assert torch.equal(pipe(x), expected)
    for name, buf in reference.named_buffers():
        assert torch.equal(model.get_buffer(name), buf), name


def test_module_called_twice_across_stages_shares_its_parameters():
    class Reuse(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = torch.nn.Linear(6, 6)
            self.mid = torch.nn.Linear(6, 6)

        def forward(self, x):
            x = torch.relu(self.shared(x))
            x = torch.relu(self.mid(x))
            return self.shared(x)  # the same weights again, in the next stage

    torch.manual_seed(0)
    model = Reuse().double()
    x = torch.randn(3, 6, dtype=torch.float64)
    pipe = mpmd.trace(model, (x,), split_before=["mid"])
    assert pipe.tied == {"shared.weight": (0, 1), "shared.bias": (0, 1)}
    model(x).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = pipe(x)
    assert torch.equal(out, model(x))
    out.sum().backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
