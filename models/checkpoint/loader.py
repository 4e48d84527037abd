"""Finding a checkpoint and loading its weights by a name walk.

Invariant: module attribute names are checkpoint names, so loading is "strip an optional
`model.` prefix, then assign", except the fused projections in FUSED, whose parameter is the
concatenation (along output rows, dim 0) of the checkpoint tensors it replaces, and parameters
given a row subset (`take_rows`). Each parameter reaches the device in one copy, built on the host. Every parameter
the model declares must be found in the checkpoint (a clear error lists the missing checkpoint
names); extra checkpoint keys are ignored.
"""
from __future__ import annotations

import json
import os
from fnmatch import fnmatch
from pathlib import Path

import torch
from torch import nn

from models.checkpoint.preflight import looks_like_path
from models.linear.packed import Linear

# What a snapshot download needs (weights, config, tokenizer, sentence-transformers files).
ALLOW_PATTERNS = (
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "merges.txt",
    "vocab.json",
    "1_Pooling/*",
    "README.md",  # the model card: a one-label score head's reranker template (checkpoint/reranker_mark.py)
)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, float16 or bfloat16")
    return names[dtype]


def resolve_model_dir(model_id: str | Path, revision: str | None = None) -> Path:
    """A local checkpoint directory for `model_id` (a path, or a hub id fetched into the cache)."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        check_readable(path)
        return path
    if looks_like_path(str(model_id)):
        raise FileNotFoundError(f"model directory {str(model_id)!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(str(model_id), revision=revision,
                                          allow_patterns=list(ALLOW_PATTERNS)))
    except Exception as exc:  # offline, unknown id, no access: all the same to the caller
        raise FileNotFoundError(
            f"could not find model {str(model_id)!r} (revision {revision or 'default'}): not a local "
            f"directory, and the hub download failed ({type(exc).__name__}: {exc})"
        ) from exc
    check_readable(snapshot)  # a cache volume filled by another user
    return snapshot


def check_readable(model_dir: Path) -> None:
    """Raise PermissionError, in one line naming the uid to grant, when this process cannot read
    the directory or one of the checkpoint files in it (those ALLOW_PATTERNS names).

    A model directory mounted into a container often belongs to another user, and save_pretrained
    writes model.safetensors as 0600: safetensors then reports "No such file or directory" for a
    file that is there, hiding the permission problem. Checked once at start, before any read.
    """
    uid = os.getuid()
    grant = f"grant uid {uid} read access (e.g. `chmod -R a+rX {model_dir}` or `chown -R {uid} {model_dir}`)"
    if not os.access(model_dir, os.R_OK | os.X_OK):
        raise PermissionError(f"cannot read model directory {model_dir} as uid {uid} "
                              f"({_owner_mode(model_dir)}): {grant}")
    files = [f for f in sorted(model_dir.iterdir()) if f.is_file() and any(fnmatch(f.name, p) for p in ALLOW_PATTERNS)]
    pooling = model_dir / "1_Pooling"
    if pooling.is_dir() and os.access(pooling, os.R_OK | os.X_OK):
        files += sorted(f for f in pooling.iterdir() if f.is_file())
    elif pooling.is_dir():
        files.append(pooling)
    denied = [f for f in files if not os.access(f, os.R_OK)]
    if denied:
        more = f" and {len(denied) - 1} more" if len(denied) > 1 else ""
        raise PermissionError(f"cannot read {denied[0]}{more} as uid {uid} ({_owner_mode(denied[0])}): {grant}")


def _owner_mode(path: Path) -> str:
    st = path.stat()
    return f"owner uid {st.st_uid}, mode {st.st_mode & 0o7777:04o}"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


# Fused module name -> the checkpoint modules it concatenates, in row order.
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_names(param: str) -> tuple[str, ...]:
    """The checkpoint tensors behind a model parameter, in the order they are concatenated.

    "layers.0.self_attn.qkv_proj.weight" -> (".q_proj.weight", ".k_proj.weight", ".v_proj.weight"
    under the same prefix); an unfused name maps to itself.
    """
    *path, module, leaf = param.split(".")
    if module not in FUSED:
        return (param,)
    return tuple(".".join([*path, part, leaf]) for part in FUSED[module])


def checkpoint_rows(model: nn.Module, name: str) -> tuple[str, int, int]:
    """(model parameter, first row, row count) that hold checkpoint tensor `name`.

    E.g. "layers.0.self_attn.k_proj.weight" -> ("layers.0.self_attn.qkv_proj.weight", H*D, Hkv*D).
    The fused module's parent declares the row counts (`fused_rows`). Narrow the parameter, or
    its .grad, with these to compare against the unfused model.
    """
    *path, part, leaf = name.split(".")
    for fused, parts in FUSED.items():
        if part in parts:
            sizes: tuple[int, ...] = getattr(model.get_submodule(".".join(path)), "fused_rows")[fused]
            k = parts.index(part)
            return ".".join([*path, fused, leaf]), sum(sizes[:k]), sizes[k]
    param = model.get_parameter(name)
    return name, 0, param.shape[0] if param.dim() else 1


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def load_weights(model: nn.Module, model_dir: str | Path, *, device: torch.device,
                 dtype: torch.dtype, take_rows: dict[str, tuple[int, ...]] | None = None) -> None:
    """Assign checkpoint tensors to `model`'s parameters (which may live on the meta device).

    Each parameter is built on the host (cast, fused parts concatenated, `take_rows` kept: a
    parameter name -> the checkpoint rows it holds, e.g. a reranker head's two) and copied to the
    device once, as soon as its last part is read: on a GPU no temporary device tensor leaves a
    freed fragment behind, and the host holds only parameters whose parts are still being read.
    """
    from safetensors import safe_open

    sources = {name: checkpoint_names(name) for name, _ in model.named_parameters()}
    owner = {ckpt: name for name, parts in sources.items() for ckpt in parts}
    found: dict[str, torch.Tensor] = {}  # host tensors of parameters not complete yet
    state: dict[str, torch.Tensor] = {}
    rows = take_rows or {}
    for file in checkpoint_files(Path(model_dir)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = _strip(key)
                param = owner.get(name)
                if param is None or param in state or name in found:
                    continue
                found[name] = f.get_tensor(key)
                if all(part in found for part in sources[param]):
                    state[param] = _to_device(param, [found.pop(part) for part in sources[param]],
                                              rows.get(param), device=device, dtype=dtype)
    missing = sorted(ckpt for param, parts in sources.items() if param not in state
                     for ckpt in parts if ckpt not in found)
    if missing:
        shown = ", ".join(missing[:10]) + (f" ... ({len(missing)} in all)" if len(missing) > 10 else "")
        raise KeyError(f"checkpoint {model_dir} lacks weights: {shown}")
    model.load_state_dict(state, strict=False, assign=True)


def _to_device(param: str, parts: list[torch.Tensor], rows: tuple[int, ...] | None, *,
               device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One parameter from its checkpoint parts: fused and cut on the host, one copy to the device."""
    host = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # [sum of rows, ...]
    if rows is not None:
        host = host[list(rows)]  # [len(rows), ...]
    return host.to(dtype=dtype).to(device=device)


def memory_report(model: nn.Module, device: torch.device) -> dict[str, int]:
    """Bytes of the weights as served (`weights_bytes`) and, on CUDA, what the allocator holds.

    Read after the linear kernels are installed (models/linear/select.py): int8 or bf16 weights
    count at their own size. On CUDA the allocator's cached blocks are released first, so
    ``reserved_bytes`` is what the weights really keep; reserved well above allocated means
    fragments the next batch cannot use.
    """
    report = {"weights_bytes": weights_bytes(model)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        report["allocated_bytes"] = int(torch.cuda.memory_allocated(device))
        report["reserved_bytes"] = int(torch.cuda.memory_reserved(device))
    return report


def weights_bytes(model: nn.Module) -> int:
    """Bytes of the weights as served: every parameter and buffer (a dense weight freed after
    packing is an empty placeholder), plus each linear layer's packed or reduced-precision copy
    (its int8 values and scales, or bf16 values); a tensor held twice (a bias a kernel shares with
    its layer) counts once."""
    tensors = [*model.parameters(), *model.buffers()]
    opaque = 0
    for m in model.modules():
        if isinstance(m, Linear):
            if m.kernel is not None:
                tensors += m.kernel.tensors()
                opaque += m.kernel.opaque_bytes()
            elif m.packed is not None:  # oneDNN-reordered float32: no plain storage to share
                opaque += m.packed.numel() * m.packed.element_size()
    held = {(t.device, t.data_ptr(), t.numel(), t.dtype): t.numel() * t.element_size() for t in tensors}
    return int(sum(held.values()) + opaque)


def describe_memory(report: dict[str, int]) -> str:
    """The start-up line's words for `memory_report`: weights, and allocated vs reserved on CUDA."""
    text = f"{report['weights_bytes'] / 2**30:.2f} GiB of weights"
    if "reserved_bytes" in report:
        text += (f"; device memory allocated {report['allocated_bytes'] / 2**30:.2f} GiB, "
                 f"reserved {report['reserved_bytes'] / 2**30:.2f} GiB")
    return text
