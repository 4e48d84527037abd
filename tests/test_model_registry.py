"""The registry: checkpoints we cannot serve correctly are refused at load, naming the architecture."""
from __future__ import annotations

import json
import shutil

import pytest

from models.families.registry import UnsupportedArchitecture, check_kind, resolve
from models.runner import load_runner


def _with_arch(src, dst, archs):
    shutil.copytree(src, dst)
    path = dst / "config.json"
    conf = json.loads(path.read_text())
    conf["architectures"] = archs
    path.write_text(json.dumps(conf))
    return dst


@pytest.mark.parametrize("arch", ["Qwen3ForTokenClassification", "Qwen3ForQuestionAnswering",
                                  "Qwen3SomethingNew"])
def test_unknown_heads_are_refused_at_load_naming_the_architecture(tiny_embedding_dir, tmp_path, arch):
    d = _with_arch(tiny_embedding_dir, tmp_path / "m", [arch])
    with pytest.raises(UnsupportedArchitecture, match=arch):
        load_runner(str(d), device="cpu", dtype="float32")


def test_base_and_causal_lm_checkpoints_resolve():
    assert resolve("qwen3", ("Qwen3ForCausalLM",)).kinds == ("embedding", "reranker")
    assert resolve("llama", ("LlamaModel",)).kinds == ("embedding",)
    assert resolve("mistral", ()).head == "Model"
    with pytest.raises(UnsupportedArchitecture, match="several"):
        resolve("qwen3", ("Qwen3Model", "Qwen3ForCausalLM"))
    with pytest.raises(UnsupportedArchitecture, match="model_type"):
        resolve("bert", ("BertModel",))


def test_a_kind_the_head_cannot_serve_is_refused():
    with pytest.raises(UnsupportedArchitecture, match="reranker"):
        check_kind(resolve("qwen2", ("Qwen2Model",)), "reranker")


def test_a_seq_cls_config_over_base_weights_fails_naming_the_head(tiny_embedding_dir, tmp_path):
    d = _with_arch(tiny_embedding_dir, tmp_path / "m", ["Qwen3ForSequenceClassification"])
    with pytest.raises(KeyError, match="score.weight"):
        load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0)


def test_the_config_reader_reads_every_family_the_registry_serves():
    from models.checkpoint.config import READ_TYPES
    from models.families.registry import FAMILIES

    assert sorted(READ_TYPES) == sorted(FAMILIES)
