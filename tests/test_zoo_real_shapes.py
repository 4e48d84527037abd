"""One checkpoint per served family at the published layer shapes (few layers) against transformers.

The zoo (fixtures/zoo.py) keeps every checkpoint's conventions at a tiny width; this file keeps
the widths: for each family the registry serves (models/families/registry.py), a random-weight
checkpoint whose layers have the shapes of a published config.json (hidden_size, heads, kv heads,
head_dim, intermediate_size, rms_norm_eps, rope_theta and rope scaling, Gemma2's soft-caps,
window and query_pre_attn_scalar), with one or two layers. It is loaded by the same loader users
hit (load_runner on the directory) and compared with transformers' AutoModel, fp32 on CPU, each
sequence alone: the last token's final hidden state, in radix modes off and compact with the
prefix cache on (each batch run twice, the second reading the cache), within 1e-4 relative to
the largest magnitude (Gemma scales its embeddings by sqrt(hidden), so states reach the tens).

Where a vocabulary is kept smaller: the embedding table keeps VOCAB_ROWS rows (config.json's
vocab_size says so, and the loader reads it as it reads any checkpoint's), so a 4096-wide table
is 134 MB instead of 2.5 GB; the token ids fed are drawn below VOCAB_ROWS. The tokenizer in the
directory is not used here (tests/test_zoo.py serves text over HTTP at the tiny widths).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from fixtures import presets, weights
from fixtures.tokenizer import tokenizer_config, tokenizer_json
from models.runner import load_runner

TOL = 1e-4
VOCAB_ROWS = 8192

# The published config.json each family's shapes are read from (one file per row; the values
# below are that file's, only num_hidden_layers and vocab_size differ). Per family: the transformers
# config class, the layers kept, the shapes, and keys written into config.json as published where
# transformers would rewrite them.
FAMILIES = {
    # Qwen3-Embedding-0.6B's shapes (Qwen3-0.6B's), read in jinaai/jina-reranker-v3's config.json
    # (https://huggingface.co/jinaai/jina-reranker-v3/blob/main/config.json, a Qwen3-0.6B base)
    "qwen3": ("Qwen3Config", 2, {}, dict(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        attention_bias=False, hidden_act="silu")),
    # gte-Qwen2-1.5B-instruct's config.json, read in a re-saved copy (q/k/v bias):
    # https://huggingface.co/FINGU-AI/FingUEm_V3/blob/3a262f6/config.json
    "qwen2": ("Qwen2Config", 2, {}, dict(
        hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        hidden_act="silu")),
    # https://huggingface.co/Skywork/Skywork-Reward-Llama-3.1-8B/raw/main/config.json (Llama-3.1-8B's
    # shapes), llama3 rope scaling included
    "llama": ("LlamaConfig", 1, {}, dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500_000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    # https://huggingface.co/Salesforce/SFR-Embedding-Mistral/blame/c2238e2/config.json (e5-mistral's)
    "mistral": ("MistralConfig", 1, {}, dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32768, sliding_window=4096,
        tie_word_embeddings=False, hidden_act="silu")),
    # google/gemma-2b's config.json (bge-reranker-v2-gemma's base), read in a fine-tune's copy:
    # https://huggingface.co/AdnanRiaz107/CodeGemma2b-300APPS/blob/fbf85c2/config.json; its legacy
    # hidden_act "gelu" means the tanh form (transformers reads it so)
    "gemma": ("GemmaConfig", 1, {"hidden_act": "gelu", "hidden_activation": None}, dict(
        hidden_size=2048, intermediate_size=16384, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh")),
    # https://huggingface.co/BAAI/bge-multilingual-gemma2/blame/refs%2Fpr%2F13/config.json (gemma-2-9b's
    # shapes); two layers: one sliding, one global
    "gemma2": ("Gemma2Config", 2, {}, dict(
        hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
}


def _seqs():
    """Two groups sharing prefixes (the radix and the prefix cache have something to share)."""
    rng = np.random.default_rng(11)
    shared = rng.integers(100, VOCAB_ROWS, 17).tolist()
    return [shared + rng.integers(100, VOCAB_ROWS, int(n)).tolist() for n in (1, 6, 11)] + [shared[:7], [42, 7]]


SEQS = _seqs()


def _pack(seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


def _build(out, family: str, tokenizer_cache):
    cls, layers, published, shapes = FAMILIES[family]
    config = getattr(transformers, cls)(
        vocab_size=VOCAB_ROWS, num_hidden_layers=layers, bos_token_id=1, eos_token_id=2,
        architectures=[presets.PREFIX[family] + "Model"], torch_dtype="float32", **shapes)
    out.mkdir(parents=True)
    conf = {**presets.hub_config_dict(config), **published}
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tokenizer_json("reranker", cache_dir=tokenizer_cache))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    weights.write_weights(out, weights.tensor_specs(config, "embedding"), seed=5)
    return conf


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_at_published_shapes_matches_transformers(tmp_path, fixture_root, family, record_property):
    t0 = time.perf_counter()
    d = tmp_path / family
    conf = _build(d, family, Path(fixture_root) / "_tokenizer")
    assert set(SEQS[0]) and max(max(s) for s in SEQS) < conf["vocab_size"]
    with torch.no_grad():
        hf = transformers.AutoModel.from_pretrained(str(d), dtype=torch.float32).eval()
        want = torch.stack([hf(input_ids=torch.tensor([s])).last_hidden_state[0, -1] for s in SEQS])
    del hf
    gc.collect()
    # keep_dense_weights=False: one copy of the weights, as the server holds them
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size="4096tokens",
                         keep_dense_weights=False)
    ids, cu = _pack(SEQS)
    scale = max(1.0, want.abs().max().item())
    for mode, threshold in (("off", 0.0), ("compact", 1.0)):
        r = dataclasses.replace(runner, radix_attention="compact", radix_mlp_threshold=threshold)
        for _ in range(2):  # the second run reads the prefix cache
            got = r.run(r.prepare(ids, cu))
            assert got.shape == want.shape == (len(SEQS), conf["hidden_size"])
            err = (got - want).abs().max().item() / scale
            assert err < TOL, (family, mode, err)
    assert runner.prefix_cache.stats()["hit_tokens"] > 0
    del runner
    shutil.rmtree(d, ignore_errors=True)
    gc.collect()
    took = time.perf_counter() - t0
    record_property("seconds", round(took, 1))
    record_property("peak_rss_gib", round(_rss_gib(), 2))
    print(f"{family}: {took:.1f}s, peak RSS {_rss_gib():.2f} GiB, scale {scale:.1f}")
