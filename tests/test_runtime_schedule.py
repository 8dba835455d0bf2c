"""The pool's chunked regions under the static and dynamic schedules: every unit committed exactly
once with its own region's value, a chunk held by a descheduled (here: sleeping) worker redone by the
caller without a second or late write, and models giving the same bits under either schedule."""
import os

import numpy as np
import pytest

from conftest import MODELS

from corelm import _core, cli, engine
from corelm.loader import load_model


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("units,align,grain", [(1, 1, 1), (7, 1, 2), (257, 16, 64), (1000, 1, 3), (333, 16, 1000)])
def test_every_unit_is_committed_exactly_once(schedule, threads, units, align, grain):
    r = _core.bench_chunk_regions(threads, 200, units=units, align=align, grain=grain, work=5,
                                  schedule=schedule, pin=False)
    assert r["exactly_once"] and r["no_late_commits"]
    assert r["redone"] == 0 or schedule == "dynamic"      # the static split never redoes
    assert len(r["shares"]) == threads and abs(sum(r["shares"]) - 1) < 1e-9 and min(r["shares"]) > 0


@pytest.mark.parametrize("threads", [2, 3])
def test_chunks_of_a_descheduled_worker_are_redone_once(threads):
    # A worker sleeps 20 ms inside its first chunk of every 25th region: the caller redoes that chunk,
    # the worker's own result must then be dropped, in that region or (finishing late) in a later one.
    redone = False
    for _ in range(10):   # a worker starved by other processes may miss every stalled region; retry
        r = _core.bench_chunk_regions(threads, 100, units=512, grain=4, work=200, schedule="dynamic", pin=False,
                                      stall_every=25, stall_us=20000.0)
        assert r["exactly_once"] and r["no_late_commits"]
        redone = redone or (r["stalls"] > 0 and r["redone"] > 0)
    assert redone


def test_static_schedule_waits_for_a_descheduled_worker():
    r = _core.bench_chunk_regions(2, 50, units=512, grain=4, work=200, schedule="static", pin=False,
                                  stall_every=10, stall_us=2000.0)
    assert r["exactly_once"] and r["no_late_commits"] and r["redone"] == 0


def test_speed_shares_follow_a_slower_worker():
    # Workers run three times the caller's steps per unit. Only the direction is checked: other
    # processes on a loaded machine blur the ratio.
    for _ in range(5):
        r = _core.bench_chunk_regions(2, 3000, units=256, grain=4, work=100, schedule="dynamic", pin=False,
                                      slow_worker=3)
        assert r["exactly_once"]
        if r["shares"][0] > 0.55:
            break
    assert r["shares"][0] > 0.55


@pytest.fixture(scope="module")
def models():
    return {name: load_model(os.path.join(MODELS, name)) for name in ("stories260K", "tiny-qwen2")}


def run_all(model, prompt):
    """Prefill logits of every token, two decode steps and a two-sequence batch, in one array."""
    out = [model.forward(prompt, 0, all_logits=True)]
    for step, tok in enumerate([5, 9]):
        out.append(model.forward(np.array([tok], np.int32), len(prompt) + step, all_logits=False)[None])
    table = list(range(model.kv_blocks))
    out.append(model.forward_batch(np.concatenate([prompt[:3], prompt[:5]]),
                                   [(3, 0, table[:4], True), (5, 0, table[4:8], False)]))
    return np.concatenate(out)


@pytest.mark.parametrize("name", ["stories260K", "tiny-qwen2"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "q8", "q4"])
def test_static_and_dynamic_give_the_same_bits(models, name, dtype):
    prompt = ((np.arange(40) * 37 + 1) % 250).astype(np.int32)   # past 32 rows: the GEMM kernels too
    ref = None
    for threads in (1, 2, 3):
        model = engine.build_core_model(models[name], dtype=dtype, threads=threads, pin_threads=False,
                                        schedule="static")
        for schedule in ("static", "dynamic", "static"):   # switched on the same model, too
            model.schedule = schedule
            assert model.schedule == schedule
            got = run_all(model, prompt)
            if ref is None:
                ref = got
            assert np.array_equal(got, ref), (threads, schedule)   # rows never depend on the split


def test_schedule_option_env_and_cli(monkeypatch, models):
    monkeypatch.delenv("CORELM_SCHEDULE", raising=False)
    assert engine.default_schedule() == "dynamic"
    monkeypatch.setenv("CORELM_SCHEDULE", "static")
    assert engine.default_schedule() == "static"
    assert engine.build_core_model(models["stories260K"], dtype="fp32", threads=2).schedule == "static"
    assert engine.build_core_model(models["stories260K"], dtype="fp32", threads=2, schedule="dynamic").schedule == "dynamic"
    monkeypatch.setenv("CORELM_SCHEDULE", "fastest")
    with pytest.raises(ValueError, match="schedule"):
        engine.default_schedule()
    with pytest.raises(ValueError, match="schedule"):
        engine.build_core_model(models["stories260K"], dtype="fp32", threads=2, schedule="round-robin")
    model = engine.build_core_model(models["stories260K"], dtype="fp32", threads=2, schedule="dynamic")
    with pytest.raises(ValueError, match="schedule"):
        model.schedule = "other"
    seen = {}
    monkeypatch.setattr(cli, "_make_llm", lambda **kw: seen.update(kw))
    cli.llm_from_args(cli.build_parser().parse_args(["generate", "m", "--schedule", "static", "-p", "hi"]))
    assert seen["schedule"] == "static"
