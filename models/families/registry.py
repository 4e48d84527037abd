"""Which checkpoints we serve: `model_type` -> family, architecture -> head.

Invariant: a checkpoint is served only when both its family and its head are known here; every
other one is refused at load with the architecture named, never served as something else (a
sequence-classification checkpoint read as an embedding model would answer hidden states with its
head ignored). Adding a family is one row in FAMILIES (and its module under models/families/).

Heads, from the architecture's suffix (the class transformers would build):
- "Model" (or no `architectures`): the base model; serves embeddings.
- "ForCausalLM": the language model; serves embeddings (sentence-transformers checkpoints such as
  Qwen3-Embedding name this class too) or a yes/no reranker (the lm_head's "yes" and "no" rows,
  or "Yes" alone: the template's RerankSpec decides, see rerank_template_for / rerank_spec).
- "ForSequenceClassification": a `score` head [labels, E] on the last non-pad token; more than
  one label serves a classifier; one label a reward model (its score raw), or a reranker where a
  template is known for it.

Reranker templates: a checkpoint is served through the rerank routes only with a template its
own family publishes for its head (RERANK_TEMPLATES: Qwen3-Reranker and its seq-cls conversions;
bge-reranker-v2-gemma), or one the operator names (--rerank-template); never another family's
by default. A one-label score head takes its family's template only where its files mark it as
the reranker's conversion (models/checkpoint/reranker_mark.py), since a reward model has the same
shape; without one it is a reward model. A ForCausalLM without sentence-transformers files and
without one is refused (it would be neither).
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from models.attention.spec import AttentionSpec
    from models.families.protocol import RerankSpec, ScoringModel

log = logging.getLogger(__name__)

# model_type -> family module under models/families/ (importing torch is left to the caller)
FAMILIES: dict[str, str] = {
    "qwen3": "qwen3",
    "qwen2": "qwen3",
    "llama": "qwen3",
    "mistral": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma",
}
# architecture suffix -> the runner kinds it can serve, the default first
HEADS: dict[str, tuple[str, ...]] = {
    "Model": ("embedding",),
    "ForCausalLM": ("embedding", "reranker"),
    "ForSequenceClassification": ("classifier", "reranker", "reward"),
}
SCORE_HEAD = "ForSequenceClassification"
SINGLE_SCORE_KINDS = ("reranker", "reward")  # kinds that read one score row of a `score` head


class UnsupportedArchitecture(ValueError):
    """A checkpoint whose family or head this server cannot serve correctly."""


@dataclass(frozen=True)
class Entry:
    """What the loader builds: the family module and the head kinds the checkpoint allows."""

    family: str  # module name under models/families/
    architecture: str  # the checkpoint's class name ("" when config.json names none)
    head: str  # the architecture's suffix: a key of HEADS
    kinds: tuple[str, ...]  # runner kinds this head serves, the default first


def _suffix(model_type: str, architecture: str) -> str | None:
    """The head part of an architecture name: "Qwen3ForCausalLM" -> "ForCausalLM"."""
    for head in sorted(HEADS, key=len, reverse=True):
        if architecture.endswith(head):
            return head
    return None


def resolve(model_type: str, architectures: tuple[str, ...]) -> Entry:
    """The family and head of a checkpoint, or UnsupportedArchitecture saying why not."""
    if model_type not in FAMILIES:
        raise UnsupportedArchitecture(
            f"unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    if len(architectures) > 1:
        raise UnsupportedArchitecture(
            f"config.json names several architectures {list(architectures)}; serving one needs one")
    arch = architectures[0] if architectures else ""
    head = _suffix(model_type, arch) if arch else "Model"
    if head is None:
        served = ", ".join(f"*{h}" for h in HEADS)
        raise UnsupportedArchitecture(
            f"architecture {arch!r} is not served: its head would be ignored and the answers "
            f"wrong; served architectures for {model_type!r}: {served}")
    return Entry(family=FAMILIES[model_type], architecture=arch, head=head, kinds=HEADS[head])


# (model_type, head) -> the reranker template the family publishes for that head
RERANK_TEMPLATES: dict[tuple[str, str], str] = {
    ("qwen3", "ForCausalLM"): "qwen3-reranker",  # Qwen3-Reranker (yes/no)
    ("qwen3", SCORE_HEAD): "qwen3-reranker",  # its seq-cls conversions (one label: yes - no), when marked
    ("gemma", "ForCausalLM"): "bge-reranker-gemma",  # BAAI bge-reranker-v2-gemma ("Yes")
    ("gemma2", "ForCausalLM"): "bge-reranker-gemma",
}
# template name -> the family module whose RERANK spec (words, default instruction) it is
TEMPLATE_SPECS: dict[str, str] = {"qwen3-reranker": "qwen3", "bge-reranker-gemma": "gemma"}


def rerank_template_for(entry: Entry, model_type: str, override: str | None = None, *,
                        mark: str | None = None, kind: str | None = None) -> tuple[str | None, str]:
    """The reranker template this checkpoint is served with, and why (/info says both).

    The operator's (--rerank-template) first. A causal LM: the one its family publishes for its
    head. A one-label score head is the same shape as a reward model (Skywork-Reward-V2-Qwen3 is
    a one-label Qwen3ForSequenceClassification too), so the family's template applies only where
    the checkpoint marks itself as the reranker's conversion (``mark``:
    models/checkpoint/reranker_mark.py) or the operator asks for a reranker (``kind``); otherwise
    None, a reward model. UnsupportedArchitecture for an unknown template name."""
    if override is not None:
        if override not in TEMPLATE_SPECS:
            raise UnsupportedArchitecture(
                f"unknown reranker template {override!r}; known: {', '.join(TEMPLATE_SPECS)}")
        return override, "--rerank-template"
    family = RERANK_TEMPLATES.get((model_type, entry.head))
    if entry.head != SCORE_HEAD:
        return family, f"the {model_type} family's template for {entry.head}" if family else ""
    if family is not None and mark is not None:
        return family, mark
    if family is not None and kind == "reranker":
        return family, f"--model-task reranker: the {model_type} family's template"
    return None, ("one score, no reranker template: the checkpoint carries no marker of a reranker "
                  "conversion (config.json's classifier_from_token / is_original_qwen3_reranker, or its "
                  "card's template); --rerank-template or --model-task reranker serves it as one")


# auto_map class (module.Class, without a "repo--" prefix) -> why the published code is not served:
# the remote classes whose source is known and differs from the family served here. There is no
# remote class known to equal a built-in family, so every other one is refused as unknown code.
REMOTE_CODE: dict[str, str] = {
    # Alibaba-NLP/gte-Qwen2-1.5B-instruct, -7B-instruct and NovaSearch/stella_en_1.5B_v5 (built on
    # gte-Qwen2-1.5B, its modeling_qwen.py): bidirectional attention over the whole input (config.json
    # is_causal false; vLLM runs it as encoder-only attention, TEI's Qwen2 reads is_causal)
    "modeling_qwen.Qwen2Model": "gte-Qwen2's modeling_qwen.py, whose attention is bidirectional (not causal)",
    "modeling_qwen.Qwen2ForCausalLM": "gte-Qwen2's modeling_qwen.py, whose attention is bidirectional (not causal)",
    "modeling_qwen.Qwen2ForSequenceClassification":
        "gte-Qwen2's modeling_qwen.py, whose attention is bidirectional (not causal)",
    # nvidia/NV-Embed-v2: bidirectional Mistral and latent-attention pooling
    "modeling_nvembed.NVEmbedModel": "NV-Embed's bidirectional attention and latent-attention pooling",
}


def check_remote_code(raw: dict[str, Any]) -> None:
    """Refuse a checkpoint whose config.json maps a model class to the repository's own Python
    (``auto_map``), with what that code does where its source is known (REMOTE_CODE): causal
    kernels and RadixMLP's shared prefixes cannot serve bidirectional attention, and serving it
    through our family would be wrong in silence. A tokenizer-only auto_map is not refused."""
    auto = raw.get("auto_map") or {}
    remote = {k: _class_name(auto[k]) for k in sorted(auto) if str(k).startswith("AutoModel")}
    if not remote:
        return
    known = next(((name, REMOTE_CODE[name]) for name in remote.values() if name in REMOTE_CODE), None)
    if known is not None:
        raise UnsupportedArchitecture(
            f"config.json's auto_map runs {known[0]!r}: {known[1]}; RadixMLP and the causal kernels cannot serve it")
    key, name = next(iter(remote.items()))
    raise UnsupportedArchitecture(
        f"config.json's auto_map runs remote code for {key} ({name!r}); its attention and pooling are "
        f"the repository's own Python, not known to equal a family served here")


def _class_name(target: Any) -> str:
    """An auto_map value as "module.Class": a list's first entry, without a "repo--" prefix."""
    first = target[0] if isinstance(target, (list, tuple)) and target else target
    return str(first).split("--")[-1]


def default_kind(entry: Entry, labels: int, *, template: str | None = None) -> str | None:
    """The kind a score head serves unless told: one label a reranker where a template is known
    (``template``), else a reward model; more labels a classifier. None for other heads (the
    checkpoint directory decides: models/checkpoint/directory.py)."""
    if entry.head != SCORE_HEAD:
        return None
    if labels != 1:
        return "classifier"
    return "reranker" if template is not None else "reward"


def check_kind(entry: Entry, kind: str, labels: int = 0) -> None:
    """Refuse a runner kind the checkpoint's head cannot serve (e.g. a reranker without lm_head,
    a reward model from a head of three labels)."""
    if kind not in entry.kinds:
        raise UnsupportedArchitecture(
            f"architecture {entry.architecture or '(none: base model)'!r} serves "
            f"{' or '.join(entry.kinds)}, not {kind!r}")
    if entry.head == SCORE_HEAD and kind in SINGLE_SCORE_KINDS and labels != 1:
        raise UnsupportedArchitecture(
            f"a {kind} reads one score, but {entry.architecture!r} has {labels} labels; serve it "
            f"as a classifier")


def check_template(entry: Entry, kind: str, template: str | None, *, given: bool) -> None:
    """Refuse a reranker without a template (it would be scored through another family's layout)
    and a --rerank-template on a checkpoint that is not served as a reranker."""
    if kind == "reranker" and template is None:
        what = ("a yes/no reranker (a causal LM without sentence-transformers files)" if entry.head != SCORE_HEAD
                else "a reranker")
        raise UnsupportedArchitecture(
            f"{entry.architecture or '(base model)'!r} would be served as {what}, but its family publishes no "
            f"reranker template; name one with --rerank-template ({', '.join(TEMPLATE_SPECS)})"
            + (", or serve its score head as a reward model" if entry.head == SCORE_HEAD else
               ", or add sentence-transformers files (modules.json) for an embedding model"))
    if given and kind != "reranker":
        raise UnsupportedArchitecture(f"--rerank-template applies to a reranker, not to this {kind}")


def build_model(entry: Entry, cfg: Any, ops: Any, *, rope_device: Any, lm_head: bool = False,
                num_labels: int = 0) -> "ScoringModel":
    """The family's model for `cfg` (models/families/<family>.py's `build`), its parameters
    allocated but never initialised (`models.families.layers.no_init`): the checkpoint fills every one."""
    from models.families.layers import no_init

    module = importlib.import_module(f"models.families.{entry.family}")
    with no_init():
        return module.build(cfg, ops, rope_device=rope_device, lm_head=lm_head, num_labels=num_labels)


def family_spec(entry: Entry, cfg: Any) -> "AttentionSpec":
    """What the family's attention needs of a backend for `cfg` (its `attention_spec`)."""
    module = importlib.import_module(f"models.families.{entry.family}")
    return module.attention_spec(cfg)


def rerank_spec(template: str, entry: Entry, *, log_choice: bool = False) -> "RerankSpec":
    """The RerankSpec (template, words, instruction) of a template name (rerank_template_for's).
    ``log_choice``: say which template and score the loaded reranker uses (start-up log)."""
    spec: "RerankSpec" = importlib.import_module(f"models.families.{TEMPLATE_SPECS[template]}").RERANK
    if log_choice:
        score = f"logit({spec.yes!r})" + (f" - logit({spec.no!r})" if spec.no else " alone")
        log.info("reranker template %s for %s (family %s): score %s", spec.template,
                 entry.architecture or "(base model)", entry.family, score)
    return spec
