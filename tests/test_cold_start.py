"""Cold start: the model is built without random initialisation, start-up is reported stage by
stage, and the load-time kernel measurements are kept per machine and shape (and only then)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import models.linear.select as select
from models import measure_cache, startup
from models.attention import lse as attention_lse
from models.linear.packed import Linear
from models.runner import load_runner

CPU = torch.device("cpu")


@pytest.fixture
def counted_inits(monkeypatch):
    """{class name: reset_parameters calls} for the torch modules that initialise at random."""
    calls = {"Linear": 0, "Embedding": 0}
    for cls in (nn.Linear, nn.Embedding):
        real = cls.reset_parameters

        def counting(self, _real=real, _name=cls.__name__):
            calls[_name] += 1
            return _real(self)

        monkeypatch.setattr(cls, "reset_parameters", counting)
    return calls


def test_the_counter_sees_an_ordinary_build(counted_inits):
    nn.Embedding(4, 3, device="meta"), nn.Linear(3, 2, device="meta")
    assert counted_inits == {"Linear": 1, "Embedding": 1}


@pytest.mark.parametrize("fixture", ["tiny_embedding_dir", "tiny_reranker_dir"])
def test_a_loaded_model_never_initialises_at_random(fixture, request, counted_inits):
    path = request.getfixturevalue(fixture)  # a first use builds the fixture, which does initialise
    counted_inits.update(Linear=0, Embedding=0)
    runner = load_runner(str(path), device="cpu", dtype="float32")
    assert counted_inits == {"Linear": 0, "Embedding": 0}
    assert nn.Linear.reset_parameters.__name__ == "counting"  # the build put the method back
    assert not any(p.is_meta for p in runner.model.parameters())


def test_the_stage_report_has_every_stage_and_sums_to_at_most_the_total(tiny_embedding_dir, caplog):
    clock = startup.begin_process()
    clock.mark("import")
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    assert runner.report.startup is clock
    clock.mark("app")
    clock.mark("freeze")
    with caplog.at_level("INFO", logger="models.runner"):
        runner.warm_up(max_tokens=64)
    seconds = runner.report.startup.seconds
    assert set(seconds) == {*startup.STAGES, "total"}
    assert all(v >= 0 for v in seconds.values())
    assert sum(seconds[s] for s in startup.STAGES) <= seconds["total"] + 1e-3  # rounding to 0.1 ms
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up ")]
    assert len(logged) == len(startup.STAGES) + 1
    from server.config import ServerConfig
    from server.service.info import build_info

    info = build_info(ServerConfig(model_id=str(tiny_embedding_dir)), runner, max_input_length=64,
                      tokenization_workers=2)
    assert info["startup"] is runner.report.startup.seconds  # /info reads the live record
    # a runner loaded later (no command line) times its own stages only
    other = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    assert other.report.startup is not clock and set(other.report.startup.seconds) == {
        "config", "weights", "kernel choices", "cache allocation"}


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "measurements.json"
    monkeypatch.setenv(measure_cache.ENV, str(path))
    attention_lse._measure.cache_clear()
    yield path
    attention_lse._measure.cache_clear()


def test_the_attention_measurement_is_cached_per_shape(cache_file, monkeypatch):
    runs: list[tuple] = []

    def timed(*shape):
        runs.append(shape)
        return 1.5

    monkeypatch.setattr(attention_lse, "_time_tiles", timed)
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 16}
    first = attention_lse.select_cpu_kernel(True, **shape)
    attention_lse._measure.cache_clear()  # a new process
    assert attention_lse.select_cpu_kernel(True, **shape) == first and len(runs) == 1
    attention_lse._measure.cache_clear()
    attention_lse.select_cpu_kernel(True, heads=4, kv_heads=4, head_dim=16)  # another shape: measured
    assert len(runs) == 2
    cache_file.write_text("{not json")  # unreadable: measured again, then rewritten
    attention_lse._measure.cache_clear()
    attention_lse.select_cpu_kernel(True, **shape)
    assert len(runs) == 3 and json.loads(cache_file.read_text())["version"] == measure_cache.VERSION
    monkeypatch.setenv(measure_cache.ENV, "off")
    attention_lse._measure.cache_clear()
    attention_lse.select_cpu_kernel(True, **shape)
    assert len(runs) == 4


def test_the_linear_measurement_is_cached_and_an_injected_clock_bypasses_it(cache_file, monkeypatch):
    monkeypatch.delenv(select.ENV, raising=False)
    runs: list[list[str]] = []

    def measured(ops, *, timer):
        runs.append(sorted(ops))
        return {name: 1.0 + i for i, name in enumerate(ops)}

    monkeypatch.setattr(select, "measure", measured)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(Linear(64, 96), Linear(96, 64))

    first = select.choose_linears(model(), device=CPU, dtype=torch.float32)
    again = select.choose_linears(model(), device=CPU, dtype=torch.float32)
    assert len(runs) == 1 and again.kernel == first.kernel and again.seconds == first.seconds
    assert "read from the measurement cache" in again.report and "measured" in first.report
    select.choose_linears(model(), device=CPU, dtype=torch.float32, timer=lambda: 0.0)
    assert len(runs) == 2  # a test's clock always measures
    wider = nn.Sequential(Linear(64, 128), Linear(128, 64))
    select.choose_linears(wider, device=CPU, dtype=torch.float32)
    assert len(runs) == 3  # other shapes, another entry


def test_a_cache_write_that_fails_only_logs(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(measure_cache.ENV, str(blocker / "measurements.json"))  # under a file
    measure_cache.store("k", 1.0)
    assert measure_cache.lookup("k") is None
    assert any("could not write" in r.getMessage() for r in caplog.records)
