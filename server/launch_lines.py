"""Other servers' launch lines -> radixserve's own flags: vLLM's ``serve MODEL ...`` and Infinity's
``v2 ...``, so a user's existing command starts this server.

Each dialect is a table of its flags: one that maps names our flag and translates its value; one
accepted as a no-op says why (logged at start); one that cannot mean anything here is refused with a
sentence naming ours. A flag of ours passes through unchanged. Anything else is refused naming the
dialect's flags that map, never with the parser's bare "unrecognized arguments". Pure text: this
runs before torch is imported, so a bad line returns at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

ONE_DEVICE = ("radixserve serves one model on one device: run one server per GPU (--device cuda:N) "
              "behind a load balancer")
CACHE_SIZE = ("use --prefix-cache-size (the K/V cache of shared prefixes, the only memory that grows "
              "with use; auto: 70% of the device memory free after warm-up, or e.g. 8GiB; 0: off)")

# Flags of other servers refused in every dialect (also on radixserve's own line): what to use instead.
REFUSED = {
    "--gpu-memory-utilization": "--gpu-memory-utilization is vLLM's; " + CACHE_SIZE,
    "--device-id": "--device-id is Infinity's flag; radixserve serves one model on one device: use "
                   "--device cuda:N (e.g. --device cuda:0), or CUDA_VISIBLE_DEVICES=N with --device cuda",
    "--tensor-parallel-size": "--tensor-parallel-size is vLLM's; " + ONE_DEVICE,
    "-tp": "-tp (tensor parallel) is vLLM's; " + ONE_DEVICE,
    "--pipeline-parallel-size": "--pipeline-parallel-size is vLLM's; " + ONE_DEVICE,
    "--data-parallel-size": "--data-parallel-size is vLLM's; " + ONE_DEVICE,
    "--max-model-len": "--max-model-len is vLLM's: use --max-input-length N (or vLLM's line, "
                       "radixserve serve MODEL --max-model-len N)",
    "--quantization": "--quantization is vLLM's: radixserve serves unquantized weights (--dtype bfloat16, "
                      "float16 or float32)",
    "--kv-cache-dtype": "--kv-cache-dtype is vLLM's: the K/V cache keeps the model's --dtype",
    "--swap-space": "--swap-space is vLLM's: nothing is swapped here; " + CACHE_SIZE,
    "--cpu-offload-gb": "--cpu-offload-gb is vLLM's: nothing is offloaded here; " + CACHE_SIZE,
    "--block-size": "--block-size is vLLM's: the prefix cache's blocks are 16 tokens; " + CACHE_SIZE,
    "--tokenizer": "--tokenizer is vLLM's: the tokenizer is read from the model directory (--model-id)",
    "--override-pooler-config": "--override-pooler-config is vLLM's: use --pooling last-token|mean|cls",
    "--pooler-config": "--pooler-config is vLLM's: use --pooling last-token|mean|cls",
    "--embedding-dtype": "--embedding-dtype is Infinity's: answers are float32 (OpenAI's base64 is their bytes)",
    "--vector-disk-cache": "--vector-disk-cache is Infinity's: " + CACHE_SIZE,
}


class LaunchError(ValueError):
    """A launch line radixserve cannot honour; the message names what to use instead."""


@dataclass(frozen=True)
class Flag:
    """One foreign flag: ``ours`` is the flag it becomes (None: accepted, no effect, ``note`` says
    why); ``value`` translates its text (None: drop the flag; raising LaunchError refuses it);
    ``fixed`` is the value of a flag that takes none."""

    ours: str | None
    value: Callable[[str], str | None] | None = None
    takes_value: bool = True
    fixed: str | None = None
    note: str = ""


def _no_op(why: str, takes_value: bool = False) -> Flag:
    return Flag(None, takes_value=takes_value, note=why)


def _choose(flag: str, table: dict[str, str | None], hint: str) -> Callable[[str], str | None]:
    def pick(text: str) -> str | None:
        key = text.strip().lower()
        if key not in table:
            raise LaunchError(f"{flag} {text}: not served here; {hint}")
        return table[key]
    return pick


_TASKS = {"embed": "embed", "embedding": "embed", "classify": "classify", "score": "score", "reward": "reward",
          "pooling": None, "auto": None, "none": None}
_TASK_HINT = ("radixserve serves pooling models only: embed (an embedding model) or classify, score, reward "
              "(a reranker's score head)")
_DTYPES = {"auto": None, "float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
           "bfloat16": "bfloat16"}
_DTYPE_HINT = "use --dtype auto, float32, float16 or bfloat16"
NO_REMOTE_CODE = "radixserve runs its own Qwen3 model code; no code from the checkpoint is loaded"

VLLM: dict[str, Flag] = {
    "--model": Flag("--model-id"),
    "--task": Flag("--model-task", _choose("--task", _TASKS, _TASK_HINT)),
    "--runner": Flag("--model-task", _choose("--runner", {"pooling": None, "auto": None}, _TASK_HINT)),
    "--convert": Flag("--model-task", _choose("--convert", _TASKS, _TASK_HINT)),
    "--max-model-len": Flag("--max-input-length"),
    "--dtype": Flag("--dtype", _choose("--dtype", _DTYPES, _DTYPE_HINT)),
    "--served-model-name": Flag("--served-model-name"),
    "--api-key": Flag("--api-key"),
    "--host": Flag("--hostname"),
    "--port": Flag("--port"),
    "--uds": Flag("--uds-path"),
    "--revision": Flag("--revision"),
    "--download-dir": Flag("--huggingface-hub-cache"),
    "--max-num-seqs": Flag("--max-batch-requests"),
    "--max-num-batched-tokens": Flag("--max-batch-tokens"),
    "--enable-prefix-caching": _no_op("the prefix cache is on by default (--prefix-cache-size auto)"),
    "--no-enable-prefix-caching": Flag("--prefix-cache-size", takes_value=False, fixed="0"),
    "--trust-remote-code": _no_op(NO_REMOTE_CODE),
    "--enforce-eager": _no_op("radixserve runs eagerly (no CUDA graphs)"),
    "--disable-log-requests": _no_op("request lines are not logged here"),
    "--disable-log-stats": _no_op("no periodic stats lines are logged here (see /metrics)"),
}

INFINITY: dict[str, Flag] = {
    "--model-id": Flag("--model-id"),
    "--served-model-name": Flag("--served-model-name"),
    "--batch-size": Flag("--max-batch-requests"),
    "--url-prefix": Flag("--url-prefix", lambda text: text.rstrip("/") or "/"),
    "--engine": Flag(None, note="radixserve runs its own PyTorch model", value=_choose("--engine", {"torch": None},
                                   "radixserve runs its own PyTorch model: --engine torch, or leave it out")),
    "--device": Flag("--device", _choose("--device", {"auto": None, "cuda": "cuda", "cpu": "cpu"},
                                         "use --device auto, cuda or cpu")),
    "--dtype": Flag("--dtype", _choose("--dtype", _DTYPES, _DTYPE_HINT)),
    "--pooling-method": Flag("--pooling", _choose("--pooling-method", {"auto": None, "mean": "mean", "cls": "cls",
                                                                       "lasttoken": "last-token"},
                                                  "use --pooling-method auto, mean, cls or lasttoken")),
    "--api-key": Flag("--api-key"),
    "--host": Flag("--hostname"),
    "--port": Flag("--port"),
    "--permissive-cors": Flag("--cors-allow-origin", takes_value=False, fixed="*"),
    "--trust-remote-code": _no_op(NO_REMOTE_CODE),
    "--no-trust-remote-code": _no_op(NO_REMOTE_CODE),
    "--model-warmup": _no_op("the server always warms up before it listens"),
    "--no-model-warmup": _no_op("the server always warms up before it listens"),
    "--bettertransformer": _no_op("radixserve runs its own attention kernels"),
    "--no-bettertransformer": _no_op("radixserve runs its own attention kernels"),
    "--compile": _no_op("radixserve does not torch.compile its model"),
    "--no-compile": _no_op("radixserve does not torch.compile its model"),
    "--lengths-via-tokenize": _no_op("inputs are always tokenized here"),
    "--no-lengths-via-tokenize": _no_op("inputs are always tokenized here"),
}

DIALECTS = {"serve": ("vLLM", VLLM, "--model-id"), "v2": ("Infinity", INFINITY, None)}
# What a dialect's server does when its line leaves a flag out, where ours differs: Infinity's
# routes are at the root unless --url-prefix says otherwise.
DIALECT_DEFAULTS = {"v2": {"--url-prefix": "/"}}


BOOL_WORDS = frozenset({"true", "false", "1", "0", "yes", "no", "on", "off"})


def translate(argv: list[str], ours: dict[str, bool | None]) -> tuple[list[str], list[str]]:
    """``argv`` -> (radixserve's own argv, notes to log at start). ``ours``: our option strings, each
    to whether it takes a value (None: an optional true|false).
    A line that does not start with ``serve`` or ``v2`` is ours: only REFUSED flags are checked."""
    if not argv or argv[0] not in DIALECTS:
        _check_refused(argv, ours)
        return list(argv), []
    name, table, positional = DIALECTS[argv[0]]
    out: list[str] = []
    notes: list[str] = []
    seen: set[str] = set()
    args = list(argv[1:])
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            out += args[i - 1:]
            break
        if not arg.startswith("-"):
            if positional is None or positional in seen:
                raise LaunchError(f"{name}'s line takes no argument {arg!r} here; give the model once "
                                  f"({'MODEL or --model' if positional else '--model-id'})")
            out += [positional, arg]
            seen.add(positional)
            continue
        flag, eq, text = arg.partition("=")
        spec = table.get(flag)
        if spec is None:
            if flag in REFUSED:
                raise LaunchError(REFUSED[flag])
            if flag in ours:
                out.append(arg)
                takes = ours[flag]
                if not eq and i < len(args) and (takes or (takes is None and args[i].lower() in BOOL_WORDS)):
                    out.append(args[i])
                    i += 1
                continue
            raise LaunchError(f"{flag} is not a {name} flag radixserve reads. Those it reads: "
                              f"{', '.join(sorted(table))}; radixserve's own flags: radixserve --help")
        value: str | None = spec.fixed
        if spec.takes_value:
            if not eq:
                if i >= len(args) or (args[i].startswith("-") and args[i] != "-"):
                    raise LaunchError(f"{flag} needs a value")
                text = args[i]
                i += 1
            value = spec.value(text) if spec.value else text
            if flag == "--served-model-name":  # vLLM takes several names: the first is reported
                while i < len(args) and not args[i].startswith("-"):
                    value = f"{value},{args[i]}"
                    i += 1
        elif eq:
            raise LaunchError(f"{flag} takes no value")
        if spec.ours is None:
            notes.append(f"{name}'s {flag} accepted, no effect here: {spec.note}" if spec.note else
                         f"{name}'s {arg} accepted: it is what radixserve does anyway")
            continue
        if spec.ours in seen and spec.ours != "--model-task":
            raise LaunchError(f"{flag} given twice (or with its alias): radixserve serves one model, with one "
                              f"value per flag")
        seen.add(spec.ours)
        if value is not None:
            out += [spec.ours, value]
    if positional and positional not in seen:
        raise LaunchError(f"{name}'s line needs the model: radixserve {argv[0]} MODEL ...")
    for flag, value in DIALECT_DEFAULTS.get(argv[0], {}).items():
        if flag not in seen and not any(a.split("=", 1)[0] == flag for a in out):
            out += [flag, value]
    return out, notes


def _check_refused(argv: list[str], ours: dict[str, bool | None]) -> None:
    for arg in argv:
        if arg == "--":
            return
        flag = arg.split("=", 1)[0]
        if flag in REFUSED and flag not in ours:
            raise LaunchError(REFUSED[flag])
