"""Loading: key prefixes, sharding, both config layouts, and clear errors."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.checkpoint.loader import resolve_model_dir
from models.runner import load_runner

SEQS = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [9]]


def _embed(model_dir):
    runner = load_runner(str(model_dir), device="cpu", dtype="float32")
    ids = np.concatenate([np.asarray(s, np.int32) for s in SEQS])
    cu = np.cumsum([0] + [len(s) for s in SEQS]).astype(np.int32)
    return runner.run(runner.prepare(ids, cu))


@pytest.fixture(scope="module")
def reference(tiny_embedding_dir):
    return _embed(tiny_embedding_dir)


def _variant(src, dst, *, rename=None, config=None):
    shutil.copytree(src, dst)
    if rename is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        save_file({rename(k): v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    if config is not None:
        path = dst / "config.json"
        path.write_text(json.dumps(config(json.loads(path.read_text()))))
    return dst


def test_keys_with_model_prefix(tiny_embedding_dir, tmp_path, reference):
    names = load_file(str(tiny_embedding_dir / "model.safetensors")).keys()
    assert not any(k.startswith("model.") for k in names)  # the fixture stores bare keys
    d = _variant(tiny_embedding_dir, tmp_path / "prefixed", rename=lambda k: "model." + k)
    assert torch.equal(_embed(d), reference)


def test_rope_parameters_layout_is_read(tiny_embedding_dir, tmp_path, reference):
    def t5_layout(c, theta=None):
        top = c.pop("rope_theta")
        theta = top if theta is None else theta
        c.pop("rope_scaling", None)
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        return c

    d = _variant(tiny_embedding_dir, tmp_path / "t5", config=t5_layout)
    assert torch.equal(_embed(d), reference)
    # The value has teeth: theta 10000 (the silent default) changes the embeddings.
    d2 = _variant(tiny_embedding_dir, tmp_path / "t5-10k", config=lambda c: t5_layout(c, 1e4))
    assert (_embed(d2) - reference).abs().max() > 1e-3


def test_sharded_checkpoint(tmp_path, reference):
    import fixtures

    d = fixtures.build(tmp_path / "sharded", "tiny-embedding", shards=2,
                       tokenizer_cache=tmp_path / "tok")
    assert (d / "model.safetensors.index.json").is_file() and not (d / "model.safetensors").exists()
    assert torch.equal(_embed(d), reference)


def test_missing_keys_are_listed(tiny_embedding_dir, tmp_path):
    d = _variant(tiny_embedding_dir, tmp_path / "broken",
                 rename=lambda k: k.replace("layers.1.mlp.up_proj", "layers.1.mlp.upp"))
    with pytest.raises(KeyError, match="layers.1.mlp.up_proj.weight"):
        load_runner(str(d), device="cpu")


def test_untied_reranker_keeps_only_the_yes_and_no_rows_and_scores_like_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    import fixtures

    d = fixtures.build(tmp_path / "untied", "tiny-reranker-untied", tokenizer_cache=tmp_path / "tok")
    runner = load_runner(str(d), device="cpu", dtype="float32")
    assert runner.kind == "reranker" and runner.model.head_weight() is runner.model.lm_head.weight
    lm_head = load_file(str(d / "model.safetensors"))["lm_head.weight"]  # [V, E]
    assert runner.model.lm_head.weight.shape == (2, lm_head.shape[1])
    assert torch.equal(runner.model.lm_head.weight, lm_head[[runner.yes_id, runner.no_id]])
    # The parameters shrink by the V - 2 rows not kept, and /info's weights figure says so.
    params = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    full = params + (lm_head.shape[0] - 2) * lm_head.shape[1] * 4
    checkpoint = sum(t.numel() * 4 for k, t in load_file(str(d / "model.safetensors")).items())
    assert full == checkpoint and runner.report.memory["weights_bytes"] >= params
    # Scores: transformers' full head, each pair alone, is the oracle.
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [9, 8]]
    ids = np.concatenate([np.asarray(s, np.int32) for s in seqs])
    cu = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int32)
    got = runner.run(runner.prepare(ids, cu))
    with torch.no_grad():
        want = torch.tensor([(lambda z: (z[runner.yes_id] - z[runner.no_id]).item())(
            hf(input_ids=torch.tensor([s]), logits_to_keep=1).logits[0, -1]) for s in seqs])
    assert (got - want).abs().max().item() < 1e-4


def test_weights_reach_the_device_once_each_built_on_the_host(tiny_embedding_dir, monkeypatch):
    """Every parameter is copied host -> device in one piece: fused q/k/v and gate/up included."""
    from models.checkpoint import loader
    seen: list[tuple[str, tuple[int, ...]]] = []
    real = loader._to_device

    def spy(param, parts, rows, *, device, dtype):
        out = real(param, parts, rows, device=device, dtype=dtype)
        assert all(p.device.type == "cpu" for p in parts)  # the parts never left the host
        seen.append((param, tuple(out.shape)))
        return out

    monkeypatch.setattr(loader, "_to_device", spy)
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", cpu_packed_weights=False)
    params = dict(runner.model.named_parameters())
    assert sorted(n for n, _ in seen) == sorted(params)  # one copy per parameter, no more
    assert dict(seen)["layers.0.self_attn.qkv_proj.weight"] == tuple(params["layers.0.self_attn.qkv_proj.weight"].shape)


def test_missing_directory_and_offline_hub_id(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        resolve_model_dir(str(tmp_path / "does-not-exist"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="no-such-org/no-such-model"):
        resolve_model_dir("no-such-org/no-such-model")


def test_kind_pooling_prompts_detection(tiny_embedding_dir, tiny_reranker_dir):
    emb = load_runner(str(tiny_embedding_dir), device="cpu")
    st = json.loads((tiny_embedding_dir / "config_sentence_transformers.json").read_text())
    assert emb.kind == "embedding" and emb.pooling == "last-token"
    assert emb.prompts == st["prompts"] and emb.default_prompt_name == st["default_prompt_name"]
    assert emb.dtype == torch.float32 and emb.attention_backend == "sdpa"
    assert load_runner(str(tiny_embedding_dir), device="cpu", pooling="mean").pooling == "mean"
    rr = load_runner(str(tiny_reranker_dir), device="cpu")
    assert rr.kind == "reranker"
    assert rr.tokenizer.decode([rr.yes_id]) == "yes" and rr.tokenizer.decode([rr.no_id]) == "no"
    assert load_runner(str(tiny_reranker_dir), device="cpu", kind="embedding").kind == "embedding"


def test_bf16_stored_checkpoint_runs_in_fp32_like_transformers(tiny_embedding_dir, tmp_path):
    """Hub Qwen3 checkpoints are stored in bfloat16; on CPU we compute in float32.

    Oracle: transformers loading the same bf16 file with dtype=float32, each sequence alone.
    """
    from transformers import AutoModel

    def bf16_config(c):
        c["torch_dtype"] = "bfloat16"
        c.pop("dtype", None)
        return c

    d = _variant(tiny_embedding_dir, tmp_path / "bf16", config=bf16_config)
    tensors = load_file(str(d / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              str(d / "model.safetensors"))
    assert {t.dtype for t in load_file(str(d / "model.safetensors")).values()} == {torch.bfloat16}
    got = _embed(d)
    hf = AutoModel.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([hf(input_ids=torch.tensor([s])).last_hidden_state[0, -1] for s in SEQS])
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() < 1e-4
    # the weights really changed: bf16 rounding moves the embeddings off the fp32 fixture's
    assert (got - _embed(tiny_embedding_dir)).abs().max().item() > 1e-4


def test_fused_projections_hold_the_checkpoint_tensors_row_for_row(tiny_embedding_dir):
    """qkv_proj = [q_proj | k_proj | v_proj] and gate_up_proj = [gate_proj | up_proj], exactly."""
    from models.checkpoint.loader import FUSED, checkpoint_names, checkpoint_rows

    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    model, tensors = runner.model, load_file(str(tiny_embedding_dir / "model.safetensors"))
    params = dict(model.named_parameters())
    unfused = {part for parts in FUSED.values() for part in parts}
    assert not any(name.split(".")[-2] in unfused for name in params)
    covered = set()
    for name in params:
        for ckpt in checkpoint_names(name):
            fused, start, rows = checkpoint_rows(model, ckpt)
            assert fused == name
            assert torch.equal(params[fused].detach().narrow(0, start, rows), tensors[ckpt]), ckpt
            covered.add(ckpt)
    assert covered == set(tensors)  # every checkpoint tensor lands somewhere, exactly once
    assert checkpoint_names("layers.3.mlp.gate_up_proj.weight") == (
        "layers.3.mlp.gate_proj.weight", "layers.3.mlp.up_proj.weight")
