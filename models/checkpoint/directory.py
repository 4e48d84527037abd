"""What a checkpoint directory says beyond config.json: kind, pooling, prompts, head tokens.

sentence-transformers files (modules.json, 1_Pooling/, config_sentence_transformers.json) mark an
embedding model and its pooling and prompts; a ForCausalLM checkpoint without them is a yes/no
reranker; a ForSequenceClassification checkpoint carries its labels in config.json.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from models.checkpoint.config import ModelConfig

_POOLING_KEYS = (("pooling_mode_lasttoken", "last-token"), ("pooling_mode_mean_tokens", "mean"),
                 ("pooling_mode_cls_token", "cls"))


def detect_kind(model_dir: Path, cfg: ModelConfig) -> str:
    if (model_dir / "modules.json").is_file() or (model_dir / "config_sentence_transformers.json").is_file():
        return "embedding"
    if cfg.is_causal_lm:
        return "reranker"
    return "embedding"


def detect_pooling(model_dir: Path) -> str:
    path = model_dir / "1_Pooling" / "config.json"
    if path.is_file():
        conf = json.loads(path.read_text())
        for key, name in _POOLING_KEYS:
            if conf.get(key):
                return name
    return "last-token"


def read_prompts(model_dir: Path) -> tuple[dict[str, str], str | None]:
    path = model_dir / "config_sentence_transformers.json"
    if not path.is_file():
        return {}, None
    conf = json.loads(path.read_text())
    return dict(conf.get("prompts") or {}), conf.get("default_prompt_name")


def token_id(tok: Tokenizer, word: str) -> int:
    tid = tok.token_to_id(word)
    if tid is None:
        ids = tok.encode(word, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"reranker needs {word!r} to be one token, got ids {ids}")
        tid = ids[0]
    return int(tid)
