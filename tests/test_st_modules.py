"""sentence-transformers modules after the Transformer: served exactly or refused with the reason.

models/checkpoint/directory.py's `read_modules` on hand-written checkpoint directories (no
weights: refusals come before any), and TEI's `--dense-path` on a zoo checkpoint against
`SentenceTransformer.encode` with the Dense module that path names.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from models.checkpoint.directory import UnsupportedModules, read_modules
from models.checkpoint.config import ModelConfig
from models.families.registry import UnsupportedArchitecture, check_remote_code

ST = "sentence_transformers.models."
TANH = "torch.nn.modules.activation.Tanh"


def _write(d, modules, pooling=None, dense=None):
    (d / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": p, "type": t} for i, (t, p) in enumerate(modules)]))
    if pooling is not None:
        (d / "1_Pooling").mkdir(exist_ok=True)
        (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    for path, conf in (dense or {}).items():
        (d / path).mkdir(exist_ok=True)
        (d / path / "config.json").write_text(json.dumps(conf))
    return d


LAST = {"pooling_mode_lasttoken": True, "include_prompt": True}
DENSE = {"in_features": 64, "out_features": 32, "bias": True, "activation_function": TANH}


def test_served_pipelines(tmp_path):
    d = _write(tmp_path, [(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling"), (ST + "Dense", "2_Dense"),
                          (ST + "Normalize", "3_Normalize")], LAST, {"2_Dense": DENSE})
    mods = read_modules(d, hidden_size=64)
    assert mods.pooling == "last-token" and [(s.path, s.out_features, s.activation) for s in mods.dense] == [
        ("2_Dense", 32, "Tanh")]
    # a CrossEncoder's modules.json (sentence-transformers 6 spelling): the Transformer alone
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "",
                                                        "type": "sentence_transformers.base.models.Transformer"}]))
    assert read_modules(d, hidden_size=64).pooling is None


@pytest.mark.parametrize("modules, pooling, dense, reason", [
    ([(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling"), ("custom.LatentAttention", "2_L")], LAST, None,
     "does not implement"),
    ([(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling"), (ST + "WordWeights", "2_W")], LAST, None,
     "does not implement"),
    ([(ST + "Transformer", ""), (ST + "Normalize", "1_N"), (ST + "Pooling", "1_Pooling")], LAST, None,
     "is not served"),
    ([(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling")], {"pooling_mode_max_tokens": True}, None,
     "pooling_mode_max_tokens"),
    ([(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling")],
     {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, None, "is not served"),
    ([(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling")], {"pooling_mode_weightedmean_tokens": True}, None,
     "weightedmean"),
    ([(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling")], {"pooling_mode_mean_tokens": True,
                                                                  "include_prompt": False}, None, "include_prompt"),
    ([(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling"), (ST + "Dense", "2_Dense")], LAST,
     {"2_Dense": {**DENSE, "activation_function": "torch.nn.modules.activation.Softmax"}}, "activation"),
    ([(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling"), (ST + "Dense", "2_Dense")], LAST,
     {"2_Dense": {**DENSE, "activation_function": "my_package.Swish"}}, "activation"),
    ([(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling"), (ST + "Dense", "2_Dense")], LAST,
     {"2_Dense": {**DENSE, "in_features": 128}}, "in_features"),
    ([(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling"), (ST + "Dense", "2_Dense")], LAST,
     {"2_Dense": {**DENSE, "use_residual": True}}, "use_residual"),
])
def test_unserved_modules_are_refused_with_the_reason(tmp_path, modules, pooling, dense, reason):
    d = _write(tmp_path, modules, pooling, dense)
    with pytest.raises(UnsupportedModules, match=reason):
        read_modules(d, hidden_size=64)


def test_dense_path_semantics(tmp_path):
    two = _write(tmp_path, [(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling"), (ST + "Dense", "2_Dense"),
                            (ST + "Dense", "3_Dense")], LAST,
                 {"2_Dense": DENSE, "3_Dense": {**DENSE, "in_features": 32, "out_features": 16}})
    assert [s.out_features for s in read_modules(two, hidden_size=64).dense] == [32, 16]
    with pytest.raises(UnsupportedModules, match="names 2"):
        read_modules(two, hidden_size=64, dense_path="3_Dense")
    (tmp_path / "modules.json").unlink()  # no modules.json: the path names the Dense module to apply
    assert [s.path for s in read_modules(two, hidden_size=64, dense_path="2_Dense").dense] == ["2_Dense"]
    assert read_modules(two, hidden_size=64).dense == ()


def test_attention_that_is_not_causal_and_remote_code_are_refused():
    base = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4}
    ModelConfig.from_dict(base)
    with pytest.raises(ValueError, match="is_causal false"):
        ModelConfig.from_dict({**base, "is_causal": False})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_dict({**base, "use_bidirectional_attention": True})
    check_remote_code({**base, "auto_map": {"AutoTokenizer": ["tokenization_qwen.Tok", None]}})  # a tokenizer only
    # gte-Qwen2's (and stella_en_1.5B_v5's) modeling_qwen.py: refused for what it computes
    for target in ("modeling_qwen.Qwen2Model", "Alibaba-NLP/gte-Qwen2-1.5B-instruct--modeling_qwen.Qwen2Model"):
        with pytest.raises(UnsupportedArchitecture, match="bidirectional"):
            check_remote_code({**base, "auto_map": {"AutoModel": target}})
    # a remote class whose source is not known: refused as unknown code, never served as the family
    with pytest.raises(UnsupportedArchitecture, match="remote code for AutoModel .* not known to equal"):
        check_remote_code({**base, "auto_map": {"AutoModel": "modeling_custom.MyQwen2"}})


def test_dense_path_picks_the_dense_module_sentence_transformers_would(fixture_root, tmp_path):
    """stella-style: several Dense folders (2_Dense, 2_Dense_16); --dense-path names the one to use.
    The oracle is sentence-transformers with modules.json pointing at that folder."""
    import torch
    from safetensors.torch import save_file
    from sentence_transformers import SentenceTransformer

    from fixtures import zoo
    from models.runner import load_runner

    d = tmp_path / "ckpt"
    shutil.copytree(zoo.cached("st-dense", root=fixture_root), d)
    other = d / "2_Dense_16"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"in_features": 64, "out_features": 16, "bias": False,
                                                   "activation_function": "torch.nn.modules.linear.Identity"}))
    save_file({"linear.weight": torch.randn(16, 64, generator=torch.Generator().manual_seed(3))},
              str(other / "model.safetensors"))
    texts = ["a short one", "the quick brown fox"]
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0, dense_path="2_Dense_16")
    assert runner.hidden_size == 16
    ids = [runner.tokenizer.encode(t).ids for t in texts]  # no prompt: the default "document" prompt is ""
    flat = np.concatenate([np.asarray(i, dtype=np.int32) for i in ids])
    cu = np.asarray([0, len(ids[0]), len(ids[0]) + len(ids[1])], dtype=np.int32)
    got = runner.run(runner.prepare(flat, cu)).numpy()
    got /= np.linalg.norm(got, axis=1, keepdims=True)
    mods = json.loads((d / "modules.json").read_text())
    for m in mods:
        if m["type"].endswith("Dense"):
            m["path"] = "2_Dense_16"
    (d / "modules.json").write_text(json.dumps(mods))
    want = SentenceTransformer(str(d), device="cpu").encode(texts, batch_size=1)
    assert want.shape == (2, 16) and np.abs(got - want).max() < 1e-4
