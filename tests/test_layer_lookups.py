"""The families' forwards read submodules and parameters from ``_modules``/``_parameters``
(models/families/layers.py): what they compute must stay what attribute access would give.

- A parameter replaced by assignment (what ``pack_linears`` does when it drops a dense weight)
  is the one the next forward uses, in a Linear and in an RMSNorm.
- Every submodule a decoder layer runs is still called as a module, so forward hooks fire (a
  fixture builder and the launch-count benchmark hook them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.families.layers import RMSNorm
from models.linear.packed import Linear


def test_a_linear_uses_the_weight_and_bias_assigned_after_it_was_built():
    torch.manual_seed(0)
    layer = Linear(8, 4, bias=True)
    x = torch.randn(3, 8)
    before = layer(x)
    layer.weight = nn.Parameter(torch.randn(4, 8))
    layer.bias = nn.Parameter(torch.randn(4))
    after = layer(x)
    assert torch.equal(after, F.linear(x, layer.weight, layer.bias))
    assert not torch.equal(after, before)


def test_an_rms_norm_uses_the_weight_assigned_after_it_was_built():
    torch.manual_seed(0)
    for offset in (0.0, 1.0):
        norm = RMSNorm(8, 1e-6, offset=offset)
        x = torch.randn(3, 8)
        norm.weight = nn.Parameter(torch.randn(8))
        want = F.rms_norm(x, (8,), None, 1e-6) * (offset + norm.weight)
        torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)


def test_every_submodule_of_a_forward_is_called_as_a_module():
    import fixtures
    from server.app import load_runner
    from server.cli import parse_config

    for preset in ("tiny-embedding", "tiny-gemma2"):
        model = str(fixtures.cached(preset))
        runner = load_runner(parse_config(["--model-id", model, "--prefix-cache-size", "0"]))
        seen: set[str] = set()
        handles = [m.register_forward_hook(lambda mod, args, res, name=name: seen.add(name))
                   for name, m in runner.model.named_modules() if name]
        try:
            ids = [int(t) for t in runner.tokenizer.encode("hooks see every layer").ids]
            runner.run(runner.prepare(torch.tensor(ids).numpy(), torch.tensor([0, len(ids)]).numpy()))
        finally:
            for h in handles:
                h.remove()
        layer0 = {name.removeprefix("layers.0.") for name in seen if name.startswith("layers.0.")}
        want = {"input_layernorm", "self_attn", "self_attn.qkv_proj", "self_attn.o_proj",
                "post_attention_layernorm", "mlp", "mlp.gate_up_proj", "mlp.down_proj"}
        if preset == "tiny-gemma2":
            want |= {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
        assert want <= layer0, (preset, sorted(want - layer0))
        assert {"embed_tokens", "layers.0", f"layers.{runner.config.num_hidden_layers - 1}"} <= seen
