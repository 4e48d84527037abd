"""What a loaded runner reports about itself: the choices made at load, why, and what they cost.

`RunnerReport` holds what `load_runner` decided or measured and serving never reads back: the
attention backends and tree paths that do not run and why, the gather kernels, the CPU linear
kernel and weights' precision, the CPU's attention blocks, the memory after load, the prefix
cache's size and why, the start-up stages and the warm-up's time. GET /info and the start-up line
(server/service/info.py) and a front end's copy of the runner (server/frontends/view.py) read it;
`Runner` (models/runner.py) keeps the serving state.

Frozen: a change is a new report (`dataclasses.replace`), so a runner copied by
`dataclasses.replace` keeps the report it had until either reports something else. The start-up
clock is the one live record in it: its stages are filled in place as they end. Torch-free, so a
front end process reads it without the model code.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from models.startup import StartupClock


@dataclass(frozen=True)
class RunnerReport:
    # {backend: why it is not the one running} (start-up log, /info attention_backend_rejected)
    attention_rejected: dict[str, str] = field(default_factory=dict)
    # {tree-attention path: why it does not run}; `Runner.tree_report` describes the choice with it
    tree_rejected: dict[str, str] = field(default_factory=dict)
    kernels: str = ""  # the gather kernels (kernels.describe)
    linear: str = "F.linear"  # the CPU linear kernel chosen at load (models.linear.select)
    linear_choice: str = ""  # cpu_weights and why that kernel: "int8: int8-dynamic (1.31x ...)"
    # the CPU's attention blocks: "flash (why)" or "onednn-tiles ..." (models.attention.lse.select_cpu_kernel)
    cpu_attention: str = "flash"
    # weights_bytes; on CUDA allocated_bytes and reserved_bytes after load (models.checkpoint.loader.memory_report)
    memory: dict[str, int] = field(default_factory=dict)
    # the prefix cache's size: tokens, bytes, bytes_per_token and why (`auto`'s rule and figures)
    prefix_cache: dict = field(default_factory=dict)
    # launch to healthy per stage (models/startup.py); warm_up adds its own and the total
    startup: StartupClock = field(default_factory=StartupClock)
    warmup_ms: float | None = None  # the warm-up's wall time (models/warmup.py)
    # CUDA graphs (models/graphs.py): mode, state, and per bucket graph or eager and why; filled in place
    cuda_graphs: dict = field(default_factory=dict)
