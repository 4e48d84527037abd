"""ModelConfig parsing: every family's switches and both rope_theta layouts."""
from __future__ import annotations

import pytest
import torch

from models.checkpoint.config import ModelConfig, rope_inv_freq

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512}


def cfg(**kw) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **kw})


def test_rope_theta_from_top_level_or_rope_parameters():
    assert cfg(model_type="qwen3", rope_theta=1e6, rope_scaling=None).rope_theta == 1e6
    c = cfg(model_type="qwen3", rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert c.rope_theta == 5e5 and c.rope_scaling.rope_type == "default"
    assert cfg(model_type="qwen3").rope_theta == 10000.0  # transformers' own default


def test_family_switches():
    q3 = cfg(model_type="qwen3", tie_word_embeddings=True, head_dim=32)
    assert q3.qk_norm and not q3.qkv_bias and q3.tie_word_embeddings and q3.head_dim == 32
    q2 = cfg(model_type="qwen2", sliding_window=4096, use_sliding_window=False)
    assert not q2.qk_norm and q2.qkv_bias and not q2.o_bias and q2.sliding_window is None
    assert q2.head_dim == 16  # hidden / heads
    llama = cfg(model_type="llama", attention_bias=True, mlp_bias=True)
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias and not llama.qk_norm
    mistral = cfg(model_type="mistral", sliding_window=4096)
    assert not mistral.qkv_bias and mistral.sliding_window == 4096
    assert cfg(model_type="llama", num_key_value_heads=None).num_key_value_heads == 4


def test_rope_scaling_linear_and_llama3_and_rejection():
    base = rope_inv_freq(cfg(model_type="llama", rope_theta=1e4, head_dim=16))
    lin = cfg(model_type="llama", rope_theta=1e4, head_dim=16,
              rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert torch.allclose(rope_inv_freq(lin), base / 4.0)
    l3 = cfg(model_type="llama", rope_theta=5e5, head_dim=16,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert torch.allclose(rope_inv_freq(l3), want)
    with pytest.raises(ValueError, match="yarn"):
        cfg(model_type="qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="model_type"):
        cfg(model_type="gpt2")


def test_mlp_bias_only_where_transformers_builds_it():
    """Only Llama's MLP honours mlp_bias; the other families' classes ignore the key."""
    import transformers

    for model_type, cls in (("llama", "LlamaMLP"), ("qwen3", "Qwen3MLP"), ("qwen2", "Qwen2MLP"),
                            ("mistral", "MistralMLP")):
        ours = cfg(model_type=model_type, mlp_bias=True)
        hf_cfg = transformers.AutoConfig.for_model(model_type, **BASE, mlp_bias=True)
        module = getattr(transformers.models, model_type)
        mlp = getattr(getattr(module, f"modeling_{model_type}"), cls)(hf_cfg)
        assert ours.mlp_bias == (mlp.gate_proj.bias is not None), model_type
