"""Gradients through paper and compact modes equal those of transformers' unmodified model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.batch import build_forward_batch
from models.checkpoint.loader import checkpoint_rows
from models.pooling import pool
from models.runner import load_runner
from models.trie import build_index, positions_from_cu_seqlens

SEQS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3], [1, 2, 9, 10], [11, 12, 13]]
PARAMS = ["embed_tokens.weight", "layers.0.self_attn.q_proj.weight",
          "layers.0.self_attn.k_norm.weight", "layers.1.self_attn.v_proj.weight",
          "layers.1.mlp.gate_proj.weight", "layers.1.mlp.down_proj.weight", "norm.weight"]


def _loss(last, mean, probe):
    return (last * probe).sum() + (mean * probe.flip(-1)).sum() * 0.5


@pytest.fixture(scope="module")
def reference_grads(tiny_embedding_dir):
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(tiny_embedding_dir), dtype=torch.float32)
    probe = torch.randn(len(SEQS), hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    last, mean = [], []
    for seq in SEQS:  # each sequence alone
        h = hf(input_ids=torch.tensor([seq])).last_hidden_state[0]  # [L, E]
        last.append(h[-1])
        mean.append(h.mean(0))
    _loss(torch.stack(last), torch.stack(mean), probe).backward()
    params = dict(hf.named_parameters())
    return probe, {name: params[name].grad.clone() for name in PARAMS}


@pytest.fixture(scope="module")
def model(tiny_embedding_dir):
    return load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32").model


@pytest.mark.parametrize("mode", ["paper", "compact", "off"])
def test_grads_match_transformers(model, reference_grads, mode):
    probe, want = reference_grads
    model.zero_grad(set_to_none=True)
    assert all(p.requires_grad for p in model.parameters())
    ids = np.concatenate([np.asarray(s, np.int32) for s in SEQS])
    cu = np.cumsum([0] + [len(s) for s in SEQS]).astype(np.int32)
    index = build_index(ids, positions_from_cu_seqlens(cu), cu)
    assert index.ratio < 0.8
    batch = build_forward_batch(ids, cu, index, mode=mode, mean_pooling=True)
    hidden = model(batch.input_ids, batch.positions, batch)
    _loss(pool(model, hidden, batch, "last-token"), pool(model, hidden, batch, "mean"), probe).backward()
    params = dict(model.named_parameters())
    for name in PARAMS:  # checkpoint names; fused projections hold them as row blocks
        fused, start, rows = checkpoint_rows(model, name)
        got, ref = params[fused].grad.narrow(0, start, rows), want[name]
        rel = ((got - ref).norm() / ref.norm()).item()
        assert ref.norm() > 0 and rel < 1e-4, (name, rel)
