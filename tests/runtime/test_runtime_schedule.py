"""The pool's chunked regions under the static and dynamic schedules: every unit committed exactly
once with its own region's value, a chunk held by a descheduled (here: sleeping) worker redone by the
caller without a second or late write, and models giving the same bits under either schedule."""
import math
import os

import numpy as np
import pytest

from conftest import MODELS, core_forward

from corelm import _core
from corelm.entrypoints import cli
from corelm.engine import model_builder
from corelm.loader import load_model


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("units,align,grain", [(1, 1, 1), (7, 1, 2), (257, 16, 64), (1000, 1, 3), (333, 16, 1000)])
def test_every_unit_is_committed_exactly_once(schedule, threads, units, align, grain):
    r = _core.testing.bench_chunk_regions(threads, 200, units=units, align=align, grain=grain, work=5,
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
        r = _core.testing.bench_chunk_regions(threads, 100, units=512, grain=4, work=200, schedule="dynamic", pin=False,
                                      stall_every=25, stall_us=20000.0)
        assert r["exactly_once"] and r["no_late_commits"]
        redone = redone or (r["stalls"] > 0 and r["redone"] > 0)
    assert redone


def test_static_schedule_waits_for_a_descheduled_worker():
    r = _core.testing.bench_chunk_regions(2, 50, units=512, grain=4, work=200, schedule="static", pin=False,
                                  stall_every=10, stall_us=2000.0)
    assert r["exactly_once"] and r["no_late_commits"] and r["redone"] == 0


def test_speed_shares_follow_a_slower_worker():
    # Workers run three times the caller's steps per unit. Only the direction is checked: other
    # processes on a loaded machine blur the ratio.
    for _ in range(5):
        r = _core.testing.bench_chunk_regions(2, 3000, units=256, grain=4, work=100, schedule="dynamic", pin=False,
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
    out = [core_forward(model, prompt, 0, all_logits=True)]
    for step, tok in enumerate([5, 9]):
        out.append(core_forward(model, np.array([tok], np.int32), len(prompt) + step, all_logits=False)[None])
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
        model = model_builder.build_core_model(models[name], dtype=dtype, threads=threads, pin_threads=False,
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
    assert model_builder.default_schedule() == "dynamic"
    monkeypatch.setenv("CORELM_SCHEDULE", "static")
    assert model_builder.default_schedule() == "static"
    assert model_builder.build_core_model(models["stories260K"], dtype="fp32", threads=2).schedule == "static"
    assert model_builder.build_core_model(models["stories260K"], dtype="fp32", threads=2, schedule="dynamic").schedule == "dynamic"
    monkeypatch.setenv("CORELM_SCHEDULE", "fastest")
    with pytest.raises(ValueError, match="schedule"):
        model_builder.default_schedule()
    with pytest.raises(ValueError, match="schedule"):
        model_builder.build_core_model(models["stories260K"], dtype="fp32", threads=2, schedule="round-robin")
    model = model_builder.build_core_model(models["stories260K"], dtype="fp32", threads=2, schedule="dynamic")
    with pytest.raises(ValueError, match="schedule"):
        model.schedule = "other"
    seen = {}
    monkeypatch.setattr(cli.flags, "_make_llm", lambda **kw: seen.update(kw))
    cli.flags.llm_from_args(cli.build_parser().parse_args(["generate", "m", "--schedule", "static", "-p", "hi"]))
    assert seen["schedule"] == "static"


# --------------------------------------------------------------------------------------------------
# Split by node (NUMA): home ranges inside each node's rows, on the fake multi-node topologies

TREES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "topology")


def fake_layouts():
    """(thread -> node) maps of NUMA plans on machines we do not have, and a few odd ones."""
    layouts = []
    for tree, counts in (("xeon-2s-smt", (2, 3, 16, 34)), ("epyc-4node", (4, 6, 16))):
        for n in counts:
            layouts.append(_core.numa_plan(n, os.path.join(TREES, tree), numa="distribute")["thread_node"])
    layouts.append(_core.numa_plan(None, os.path.join(TREES, "xeon-2s-smt"), numa="isolate", home_node=1)["thread_node"])
    layouts += [[1, 1, 0], [3, -1, 0, 0, 3, 5], [2, 2, 2], [-1, -1], [0, -1, 0]]
    return layouts


def node_shares(nodes):
    return [(n, nodes.count(n)) for n in sorted({n for n in nodes if n >= 0})]


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
@pytest.mark.parametrize("units,align,grain", [(1, 1, 1), (18, 1, 2), (57, 1, 4), (151936, 16, 256), (4864, 16, 48), (100, 16, 32)])
def test_home_ranges_lie_in_their_nodes_rows(schedule, units, align, grain):
    rng = np.random.default_rng(units)
    for nodes in fake_layouts():
        weights = list(rng.uniform(0.2, 3.0, len(nodes)))
        got = _core.testing.pool_home_ranges(nodes, units, align, grain, schedule, weights)
        groups, homes = got["groups"], got["homes"]
        shares = node_shares(nodes)
        if len(shares) < 2:            # one node, or none: one group of everything, every thread in it
            assert groups == [(-1, 0, units, 0, -(-units // grain))]
            assert all(h[0] == 0 for h in homes)
        else:                          # the node ranges the weights are placed by (numa_split), each cut on its own
            assert [g[:3] for g in groups] == _core.numa_split(units, align, shares)
            chunk = 0
            for node, u0, u1, c0, c1 in groups:
                assert (c0, c1) == (chunk, chunk + -(-(u1 - u0) // grain))
                chunk = c1
        # Every unit (static) or chunk (dynamic) in exactly one thread's home, inside that thread's node's range.
        end = units if schedule == "static" else groups[-1][4]
        covered = np.zeros(end, np.int32)
        for t, (g, begin, stop) in enumerate(homes):
            if g < 0:
                assert nodes[t] < 0 and begin == stop          # no node of its own: only steals
                continue
            node, u0, u1, c0, c1 = groups[g]
            assert node == (nodes[t] if len(shares) >= 2 else -1)
            lo, hi = (u0, u1) if schedule == "static" else (c0, c1)
            assert lo <= begin <= stop <= hi, (nodes, t, homes[t], groups[g])
            covered[begin:stop] += 1
        assert (covered == 1).all(), nodes
        # Static: equal parts of the node's units in multiples of align; dynamic: chunks by weight.
        for g, (node, u0, u1, c0, c1) in enumerate(groups):
            members = [t for t in range(len(nodes)) if homes[t][0] == g]
            sizes = [homes[t][2] - homes[t][1] for t in members]
            if schedule == "static":
                assert max(sizes) - min(sizes) <= align
                assert all(homes[t][1] % align == 0 or homes[t][1] == units for t in members)
            else:
                total = sum(weights[t] for t in members)
                for t, size in zip(members, sizes):
                    assert abs(size - (c1 - c0) * weights[t] / total) <= 2


def test_one_node_splits_as_without_numa():
    """Threads of one node (or none) get the ranges the pool gave before the split by node existed."""
    for nodes in ([0, 0], [-1, -1, -1], [0, 0, -1], [5, 5, 5, 5, 5]):
        n, units, align = len(nodes), 1000, 16
        static = _core.testing.pool_home_ranges(nodes, units, align, 64, "static")["homes"]
        blocks = -(-units // align)
        assert [h[1:] for h in static] == [(min(units, blocks * t // n * align), min(units, blocks * (t + 1) // n * align))
                                           for t in range(n)]
        weights = [0.5, 0.3, 0.2, 0.4, 0.6][:n]
        dynamic = _core.testing.pool_home_ranges(nodes, units, align, 64, "dynamic", weights)["homes"]
        chunks, cum, front, want = -(-units // 64), 0.0, 0, []
        for t in range(n):
            cum += weights[t] / sum(weights)
            back = chunks if t == n - 1 else min(chunks, math.floor(cum * chunks + 0.5))   # llround
            want.append((0, front, max(front, back)))
            front = max(front, back)
        assert dynamic == want


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
@pytest.mark.parametrize("nodes", [[0, 1], [1, 0, 1], [0, 1, 2, 3], [3, -1, 0]])
@pytest.mark.parametrize("units,align,grain", [(7, 1, 2), (257, 16, 64), (1000, 1, 3)])
def test_split_by_node_commits_every_unit_exactly_once(schedule, nodes, units, align, grain):
    r = _core.testing.bench_chunk_regions(len(nodes), 200, units=units, align=align, grain=grain, work=5,
                                  schedule=schedule, pin=False, nodes=nodes)
    assert r["exactly_once"] and r["no_late_commits"]


def test_split_by_node_redoes_a_descheduled_workers_chunk_once():
    redone = False
    for _ in range(10):
        r = _core.testing.bench_chunk_regions(3, 100, units=512, grain=4, work=200, schedule="dynamic", pin=False,
                                      stall_every=25, stall_us=20000.0, nodes=[0, 1, 1])
        assert r["exactly_once"] and r["no_late_commits"]
        redone = redone or (r["stalls"] > 0 and r["redone"] > 0)
    assert redone


@pytest.mark.parametrize("name", ["stories260K", "tiny-qwen2"])
@pytest.mark.parametrize("dtype", ["fp32", "q4"])
def test_split_by_node_gives_the_same_bits(models, name, dtype, monkeypatch):
    """Fake nodes on this machine's pool: every region cut by node (odd chunk edges, stealing across
    nodes) must give the logits of the unsplit pool; with CORELM_NUMA_FORCE=1 and a policy, too."""
    prompt = ((np.arange(40) * 37 + 1) % 250).astype(np.int32)
    ref = run_all(model_builder.build_core_model(models[name], dtype=dtype, threads=1, pin_threads=False), prompt)
    monkeypatch.setenv("CORELM_NUMA_FORCE", "1")
    for numa in (None, "distribute"):
        for nodes in ([0, 1], [1, 0, 1], [0, 1, 2], [-1, 0, 1]):
            model = model_builder.build_core_model(models[name], dtype=dtype, threads=len(nodes),
                                            pin_threads=numa is not None, numa=numa)
            model.set_thread_nodes(nodes)
            for schedule in ("dynamic", "static"):
                model.schedule = schedule
                assert np.array_equal(run_all(model, prompt), ref), (nodes, schedule, numa)
