"""What a checkpoint directory says beyond config.json: kind, pooling, prompts, head tokens.

sentence-transformers files (modules.json, 1_Pooling/, config_sentence_transformers.json) mark an
embedding model and its pooling and prompts; a ForCausalLM checkpoint without them is a yes/no
reranker; a ForSequenceClassification checkpoint carries its labels in config.json.

Invariant (`read_modules`): every sentence-transformers module after the Transformer is either
served exactly (Pooling in a mode we serve with `include_prompt`, Dense, Normalize) or refused at
load with the reason (UnsupportedModules); none is skipped, or the vectors would differ from
`SentenceTransformer.encode` in silence.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
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


class UnsupportedModules(ValueError):
    """A sentence-transformers module or setting this server does not implement."""


# sentence-transformers' Dense activations (their class path as the module's config.json names
# it) that the server implements; any other is refused
DENSE_ACTIVATIONS = ("Tanh", "Identity", "ReLU", "Sigmoid", "GELU", "SiLU")
_MODULE_TYPES = ("Transformer", "Pooling", "Dense", "Normalize")
_UNSERVED_POOLING = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class DenseSpec:
    """One sentence-transformers Dense module: act(x @ W.T + b), from its folder's config.json."""

    path: str  # the module's folder, relative to the checkpoint
    in_features: int
    out_features: int
    bias: bool
    activation: str  # one of DENSE_ACTIVATIONS


@dataclass(frozen=True)
class Modules:
    """The sentence-transformers pipeline after the Transformer, as far as serving needs it."""

    pooling: str | None  # from the Pooling module's config (None: no Pooling module)
    dense: tuple[DenseSpec, ...] = ()  # applied in order to the pooled rows, before normalizing


def read_modules(model_dir: Path, *, hidden_size: int, dense_path: str | None = None) -> Modules:
    """modules.json's pipeline, checked: Transformer -> Pooling -> Dense* -> Normalize?.

    ``dense_path`` (TEI's --dense-path): the folder of the one Dense module; it replaces the path
    modules.json gives its single Dense module, or, without modules.json, names the Dense module
    applied after pooling. Raises UnsupportedModules for any module or setting not served.
    """
    path = model_dir / "modules.json"
    if not path.is_file():
        alone = (read_dense(model_dir, dense_path, hidden_size),) if dense_path else ()
        return Modules(pooling=None, dense=alone)
    entries = json.loads(path.read_text())
    kinds = []
    for entry in entries:
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        if not str(entry.get("type", "")).startswith("sentence_transformers.") or kind not in _MODULE_TYPES:
            raise UnsupportedModules(
                f"modules.json names module {entry.get('type')!r} ({entry.get('path')!r}), which this server "
                f"does not implement (served: sentence-transformers {', '.join(_MODULE_TYPES)})")
        kinds.append(kind)
    order = "".join({"Transformer": "T", "Pooling": "P", "Dense": "D", "Normalize": "N"}[k] for k in kinds)
    # a CrossEncoder's modules.json holds the Transformer alone (its head is in config.json)
    if not re.fullmatch(r"T(PD*N?)?", order):
        raise UnsupportedModules(
            f"modules.json's pipeline {' -> '.join(kinds)} is not served; served: Transformer -> Pooling "
            f"-> Dense (any number) -> Normalize (optional)")
    pooling = None
    dense_entries = [e for e, k in zip(entries, kinds) if k == "Dense"]
    for entry, kind in zip(entries, kinds):
        if kind == "Pooling":
            pooling = _pooling_mode(model_dir / str(entry.get("path", "")) / "config.json", hidden_size)
    if dense_path is not None:
        if len(dense_entries) != 1:
            raise UnsupportedModules(
                f"--dense-path {dense_path!r} replaces the checkpoint's one Dense module, but modules.json "
                f"names {len(dense_entries)}")
        dense_entries = [{**dense_entries[0], "path": dense_path}]
    dense: list[DenseSpec] = []
    width = hidden_size
    for entry in dense_entries:
        spec = read_dense(model_dir, str(entry.get("path", "")), width)
        dense.append(spec)
        width = spec.out_features
    return Modules(pooling=pooling, dense=tuple(dense))


def _pooling_mode(path: Path, hidden_size: int) -> str:
    """The one pooling mode a Pooling config sets, if we serve it (refused otherwise)."""
    conf = json.loads(path.read_text()) if path.is_file() else {}
    modes = [name for key, name in _POOLING_KEYS if conf.get(key)]
    unserved = [key for key in _UNSERVED_POOLING if conf.get(key)]
    if unserved or len(modes) != 1:
        raise UnsupportedModules(
            f"{path}: pooling {', '.join(unserved + modes) or '(none set)'} is not served; served: one of "
            f"{', '.join(name for _, name in _POOLING_KEYS)}")
    if conf.get("include_prompt", True) is False:
        raise UnsupportedModules(
            f"{path}: include_prompt false (pooling without the prompt's tokens) is not served")
    dim = conf.get("word_embedding_dimension")
    if dim is not None and int(dim) != hidden_size:
        raise UnsupportedModules(f"{path}: word_embedding_dimension {dim} is not the model's hidden size {hidden_size}")
    return modes[0]


def read_dense(model_dir: Path, folder: str, in_features: int) -> DenseSpec:
    """A Dense module's settings from ``folder``/config.json, checked against what we serve."""
    path = model_dir / folder / "config.json"
    if not path.is_file():
        raise UnsupportedModules(f"Dense module {folder!r}: no config.json in {path.parent}")
    conf = json.loads(path.read_text())
    act_path = str(conf.get("activation_function") or "torch.nn.modules.activation.Tanh")  # ST's default: Tanh
    act = act_path.rsplit(".", 1)[-1]
    if not act_path.startswith("torch.nn.") or act not in DENSE_ACTIVATIONS:
        raise UnsupportedModules(
            f"Dense module {folder!r}: activation {act_path!r} is not served; served: "
            f"{', '.join(DENSE_ACTIVATIONS)} (torch.nn)")
    for key, default in (("module_input_name", "sentence_embedding"), ("module_output_name", None),
                         ("use_residual", False)):
        if conf.get(key, default) not in (default, "sentence_embedding"):
            raise UnsupportedModules(f"Dense module {folder!r}: {key}={conf[key]!r} is not served")
    if int(conf["in_features"]) != in_features:
        raise UnsupportedModules(
            f"Dense module {folder!r}: in_features {conf['in_features']} but its input is {in_features} wide")
    return DenseSpec(path=folder, in_features=int(conf["in_features"]), out_features=int(conf["out_features"]),
                     bias=bool(conf.get("bias", True)), activation=act)


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
