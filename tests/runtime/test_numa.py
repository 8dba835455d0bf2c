"""NUMA: the thread plan under --numa distribute/isolate and where each node's share of the weights and
KV cache goes, decided on the fake topologies (machines we do not have), and applied on this machine
(one node: mbind and move_pages must succeed and every page must be on node 0)."""
import mmap
import os

import numpy as np
import pytest

from conftest import DATA, core_forward

from corelm import _core
from corelm.engine import system
from corelm.entrypoints import cli
from corelm.engine import model_builder
from corelm.engine.model_builder import core_config, updated
from corelm.loader.spec import ModelSpec, weight_shapes

TREES = os.path.join(DATA, "topology")
XEON, ALDERLAKE, EPYC = (os.path.join(TREES, n) for n in ("xeon-2s-smt", "alderlake-8p8e", "epyc-4node"))
ENOENT = -2   # move_pages' status for a page never touched


def plan(root, n=None, **kw):
    return _core.numa_plan(n, root, **kw)


# --------------------------------------------------------------------------------------------------
# The thread plan under each policy (fake trees)

def test_distribute_deals_threads_to_the_nodes_in_turn():
    p = plan(XEON, numa="distribute")
    assert p["thread_cpus"] == [c for k in range(8) for c in (k, 8 + k)]       # every core of both sockets
    assert p["shares"] == [(0, 8), (1, 8)]
    assert plan(XEON, 3, numa="distribute")["thread_node"] == [0, 1, 0]
    assert plan(XEON, 3, numa="distribute")["shares"] == [(0, 2), (1, 1)]
    p = plan(XEON, 34, numa="distribute")                                        # cores, then siblings, then unpinned
    assert p["thread_cpus"][16:32] == [c for k in range(8) for c in (16 + k, 24 + k)]
    assert p["thread_cpus"][32:] == [-1, -1] and p["thread_node"][32:] == [-1, -1]
    assert p["shares"] == [(0, 16), (1, 16)]
    p = plan(EPYC, numa="distribute")
    assert p["thread_cpus"][:4] == [0, 4, 8, 12] and p["shares"] == [(n, 4) for n in range(4)]
    # Only the nodes this process may use; one node's worth of CPUs is just that node.
    assert plan(EPYC, numa="distribute", allowed=list(range(8, 16)))["thread_cpus"] == [8, 12, 9, 13, 10, 14, 11, 15]
    assert plan(XEON, numa="distribute", allowed=list(range(8, 16)))["shares"] == [(1, 8)]
    # One node (the hybrid laptop): the same as the default plan.
    assert plan(ALDERLAKE, numa="distribute")["thread_cpus"] == _core.plan_threads(root=ALDERLAKE)


def test_isolate_keeps_threads_on_the_home_node():
    assert plan(XEON, numa="isolate", home_node=1)["thread_cpus"] == list(range(8, 16))
    assert plan(XEON, 10, numa="isolate", home_node=1)["thread_cpus"] == list(range(8, 16)) + [24, 25]
    assert plan(XEON, 18, numa="isolate", home_node=1)["thread_cpus"][16:] == [-1, -1]   # never another node
    assert plan(EPYC, numa="isolate", home_node=3)["thread_cpus"] == [12, 13, 14, 15]
    assert plan(EPYC, numa="isolate", home_node=3)["shares"] == [(3, 4)]
    # No home given for a fake tree, or a home without allowed CPUs: the first allowed node.
    assert plan(XEON, numa="isolate")["thread_cpus"] == list(range(8))
    assert plan(EPYC, numa="isolate", home_node=1, allowed=list(range(8, 16)))["thread_cpus"] == [8, 9, 10, 11]
    assert plan(EPYC, numa="isolate", home_node=9)["thread_cpus"] == [0, 1, 2, 3]


def test_the_default_plan_is_unchanged():
    for root in (XEON, ALDERLAKE, EPYC):
        for n in (None, 3, 20):
            assert plan(root, n)["thread_cpus"] == _core.plan_threads(n, root)
    assert plan(XEON, 16)["shares"] == [(0, 8), (1, 8)]      # the default spills over; shares say so


def test_bad_policy_names_are_refused():
    with pytest.raises(ValueError):
        _core.plan_threads(numa="interleave")
    with pytest.raises(ValueError):
        model_builder.check_numa("numactl")
    assert model_builder.check_numa(None) is None and model_builder.check_numa("isolate") == "isolate"


# --------------------------------------------------------------------------------------------------
# Where rows and KV blocks go (pure decisions)

def check_split(rows, grain, shares):
    ranges = _core.numa_split(rows, grain, shares)
    assert [r[0] for r in ranges] == [s[0] for s in shares]
    assert ranges[0][1] == 0 and ranges[-1][2] == rows
    total, groups, before = sum(t for _, t in shares), -(-rows // grain), 0
    for (node, begin, end), (_, threads) in zip(ranges, shares):
        assert begin <= end and (begin % grain == 0 or begin == rows)
        # within one group of the exact proportional share
        assert abs((end - begin) / grain - groups * threads / total) <= 1 + 1e-9
        before += threads
    for a, b in zip(ranges, ranges[1:]):
        assert a[2] == b[1]                                  # contiguous, no gaps or overlaps
    return ranges


def test_rows_split_in_proportion_to_threads_in_whole_grains():
    xeon = plan(XEON, numa="distribute")["shares"]
    # Qwen2.5-0.5B: wqkv is 18 heads of 64 rows, w_gate_up 2 x 4864 rows, lm_head 151936 rows.
    assert _core.numa_split(18 * 64, 64, xeon) == [(0, 0, 576), (1, 576, 1152)]
    assert _core.numa_split(2 * 4864, 32, xeon) == [(0, 0, 4864), (1, 4864, 9728)]
    epyc = plan(EPYC, numa="distribute")["shares"]
    assert _core.numa_split(151936, 16, epyc) == [(n, 37984 * n, 37984 * (n + 1)) for n in range(4)]
    # Unequal nodes: 2 threads and 1 thread.
    assert _core.numa_split(18 * 64, 64, plan(XEON, 3, numa="distribute")["shares"]) == [(0, 0, 768), (1, 768, 1152)]
    for rows in (1, 7, 100, 896, 1000, 4865):
        for grain in (1, 8, 16, 32, 64):
            for shares in ([(0, 1)], [(0, 8), (1, 8)], [(0, 3), (1, 1)], [(0, 4), (1, 4), (2, 4), (3, 5)], [(2, 0), (5, 2)]):
                check_split(rows, grain, shares)
    # More nodes than groups: some nodes get nothing, the rows still all go somewhere.
    assert _core.numa_split(16, 16, [(0, 1), (1, 1), (2, 1)]) == [(0, 0, 0), (1, 0, 0), (2, 0, 16)]
    assert _core.numa_split(100, 16, []) == [] and _core.numa_split(0, 16, [(0, 1)]) == []
    with pytest.raises(ValueError):
        _core.numa_split(10, 0, [(0, 1)])
    with pytest.raises(ValueError):
        _core.numa_split(10, 1, [(-1, 1)])


def test_row_grains_follow_the_parallel_loops():
    assert _core.numa_row_grain("wqkv", 64) == 64                    # whole heads
    assert _core.numa_row_grain("w_gate_up", 64) == 32               # gate/up block pairs
    assert {_core.numa_row_grain(m, 64) for m in ("wo", "w_down", "lm_head")} == {32}
    with pytest.raises(ValueError):
        _core.numa_row_grain("tok_embeddings", 64)


@pytest.mark.parametrize("wtype", ["fp32", "bf16", "q8", "q4", "q4m"])
def test_row_offsets_match_the_packed_layouts(wtype):
    """Every table stores rows in order in equal strides per 32 rows (the AVX-512 quantized layout
    interleaves 4 groups of 8 rows block by block), so row r, a multiple of 32, of a matrix whose row
    count is a multiple of 32 starts at nbytes * r / rows; checked against the size of 32 packed rows."""
    rows, cols = 96, 96
    for isa in _core.kernel_tables():
        nbytes = _core.testing.kernel_packed_bytes(isa, np.zeros((rows, cols), np.float32), wtype)
        per_32 = _core.testing.kernel_packed_bytes(isa, np.zeros((32, cols), np.float32), wtype)
        for r in (0, 32, 64, 96):
            assert _core.testing.numa_row_offset(r, rows, nbytes) == r // 32 * per_32
    assert _core.testing.numa_row_offset(5, 10, 1000) == 500 and _core.testing.numa_row_offset(99, 10, 1000) == 1000


# --------------------------------------------------------------------------------------------------
# mbind / move_pages on this machine

@pytest.fixture
def pages():
    """An mmap-backed buffer of 8 pages (page-aligned, sharing no page), as aligned_buffer makes them."""
    size = 8 * _core.testing.page_bytes()
    m = mmap.mmap(-1, size)
    yield np.frombuffer(m, dtype=np.uint8), size
    # the numpy view must go before the mapping closes


def test_place_and_read_back_pages(pages):
    buf, size = pages
    page = _core.testing.page_bytes()
    assert _core.testing.numa_page_nodes(buf, 0, size) == [ENOENT] * 8      # nothing touched yet
    buf[: 3 * page] = 1
    assert _core.testing.numa_page_nodes(buf, 0, size) == [0] * 3 + [ENOENT] * 5
    assert _core.testing.numa_place(buf, 0, 4 * page, 0, True) == ""        # bind (and move) the first half
    assert _core.testing.numa_place(buf, 4 * page, size, 0, False) == ""    # prefer node 0 for the rest
    buf[:] = 2
    assert _core.testing.numa_page_nodes(buf, 0, size) == [0] * 8
    # A range covers the pages whose first byte lies in it: [100, page + 100) holds one page start.
    assert len(_core.testing.numa_page_nodes(buf, 100, page + 100)) == 1
    assert _core.testing.numa_place(buf, 100, 200, 0, True) == ""            # no page starts there: nothing to do


def test_placement_errors_are_reported_not_raised(pages):
    buf, size = pages
    assert "mbind" in _core.testing.numa_place(buf, 0, size, 1000, True)     # no such node: the kernel refuses
    assert _core.testing.numa_place(buf, 0, size, -1, True) != ""
    with pytest.raises(ValueError):
        _core.testing.numa_place(buf, 0, size + 1, 0, True)


# --------------------------------------------------------------------------------------------------
# A model's weights and KV cache

SPEC = ModelSpec(arch="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4)


def random_model(numa, kv_type="fp32", pin_threads=True, threads=2, kv_sparsity=0.0):
    """Matrices of 256 KiB to 1 MiB (each its own mapping) and a 256 KiB KV buffer per kind (fp32, dense)."""
    cfg = core_config(SPEC, "fp32", threads, 256, pin_threads=pin_threads, numa=numa)
    m = _core.Model(updated(cfg, kv_type=kv_type, kv_sparsity=kv_sparsity))
    rng = np.random.default_rng(0)
    for name, shape in weight_shapes(SPEC).items():
        m.set_weight(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    m.finalize()
    return m


@pytest.mark.parametrize("numa", [None, "distribute", "isolate"])
def test_the_pool_runs_the_plan_of_the_policy(numa):
    """The workers sit where the policy's plan puts them, and split their regions by the plan's nodes
    exactly where memory is split by node (a policy and pinned threads)."""
    m = random_model(numa)
    info = m.numa_info()
    assert m.thread_cpus == [-1] + info["thread_cpus"][1:]          # the caller is not pinned
    assert info["pool_thread_node"] == (info["thread_node"] if numa else [-1, -1])
    assert random_model(numa, pin_threads=False).numa_info()["pool_thread_node"] == [-1, -1]


def test_default_policy_places_nothing():
    info = random_model(None).numa_info()
    assert info["policy"] == "default" and info["shares"] == [] and info["placed"] == []
    assert info["status"] == "numa default: memory stays where first touch puts it"


def test_unpinned_threads_place_nothing(monkeypatch):
    monkeypatch.setenv("CORELM_NUMA_FORCE", "1")
    info = random_model("distribute", pin_threads=False).numa_info()
    assert info["shares"] == [] and info["placed"] == [] and "threads are not pinned" in info["status"]


@pytest.mark.skipif(len(_core.topology()["nodes"]) > 1, reason="checks the one-node no-op")
def test_one_node_places_nothing_and_says_so(monkeypatch):
    monkeypatch.delenv("CORELM_NUMA_FORCE", raising=False)
    info = random_model("distribute").numa_info()
    assert info["placed"] == [] and "one NUMA node, nothing to place" in info["status"]
    assert info["shares"] == [(0, 2)]


@pytest.mark.parametrize("kv_type,kv_sparsity", [("fp32", 0.0), ("int8", 0.0), ("fp32", 0.5), ("int8", 0.5)])
def test_forced_placement_puts_every_page_where_the_split_says(monkeypatch, kv_type, kv_sparsity):
    """CORELM_NUMA_FORCE=1 runs the multi-node path here: every range mbind'ed to its node (node 0),
    the weights' pages there at once, the KV cache's as they are first written."""
    monkeypatch.setenv("CORELM_NUMA_FORCE", "1")
    m = random_model("distribute", kv_type, kv_sparsity=kv_sparsity)
    numa = m.numa_info(pages=True)
    assert numa["thread_node"] == [0, 0] and numa["shares"] == [(0, 2)]
    placed = {p["name"]: p for p in numa["placed"]}
    # int8 scales here are 8 KiB, sparse masks 8 KiB and sparse int8 values 32 KiB: buffers under 64 KiB
    # share pages with other data and stay put.
    kv = [] if (kv_type, kv_sparsity) == ("int8", 0.5) else ["kv.k", "kv.v"]
    assert sorted(placed) == sorted([f"layers.{l}.{w}" for l in range(2) for w in ("wqkv", "wo", "w_gate_up", "w_down")]
                                    + ["lm_head"] + kv)
    assert f"{9 + len(kv)} buffers placed by node" in numa["status"] and "failed" not in numa["status"]
    page = _core.testing.page_bytes()
    for name, p in placed.items():
        assert p["error"] == "", (name, p["error"])
        assert all(r["node"] == 0 for r in p["ranges"])
        if not name.startswith("kv."):
            assert [(r["begin"], r["end"]) for r in p["ranges"]] == [(0, p["bytes"])]
            assert p["ranges"][0]["pages"] == {0: -(-p["bytes"] // page)}      # packed, so all touched, on node 0
        else:
            # one range of kv heads per layer: [layer][kv_head][block][slot][head_dim], split as decided
            assert len(p["ranges"]) == SPEC.num_layers
            assert [(r["node"], r["begin"], r["end"]) for r in p["ranges"]] == \
                _core.testing.numa_split_per_layer(SPEC.num_layers, SPEC.num_kv_heads, p["bytes"], [(0, 2)])
            assert all(set(r["pages"]) == {ENOENT} for r in p["ranges"])       # untouched until used
    core_forward(m, np.arange(40, dtype=np.int32), 0, False)
    for name in kv:
        placed = {p["name"]: p for p in m.numa_info(pages=True)["placed"]}
        for r in placed[name]["ranges"]:
            assert r["pages"].get(0, 0) >= 1 and set(r["pages"]) <= {0, ENOENT}  # written pages: node 0


def test_placement_does_not_change_results(monkeypatch):
    toks = np.arange(1, 30, dtype=np.int32)
    ref = core_forward(random_model(None), toks, 0, True)
    monkeypatch.setenv("CORELM_NUMA_FORCE", "1")
    for policy in ("distribute", "isolate"):
        assert np.array_equal(core_forward(random_model(policy), toks, 0, True), ref)


def test_kv_heads_split_by_node_per_layer():
    """The KV cache is [layer][kv_head][...]: each layer's kv heads go to nodes as split_by_node cuts
    them (grain 1), the same for keys, values and int8 scales (any buffer of layers x heads rows)."""
    S = 1000                                                   # bytes per (layer, kv head)
    two = [(0, 8), (1, 8)]
    assert _core.testing.numa_split_per_layer(2, 2, 4 * S, two) == [(0, 0, S), (1, S, 2 * S), (0, 2 * S, 3 * S), (1, 3 * S, 4 * S)]
    # 8 kv heads on 4 unequal nodes: heads in proportion to threads, per layer.
    epyc = [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert _core.testing.numa_split_per_layer(3, 8, 24 * S, epyc)[4:8] == [(n, (8 + 2 * n) * S, (10 + 2 * n) * S) for n in range(4)]
    assert _core.testing.numa_split_per_layer(1, 8, 8 * S, [(0, 3), (1, 1)]) == [(0, 0, 6 * S), (1, 6 * S, 8 * S)]
    # Fewer kv heads than nodes: some nodes get none (empty ranges), every head still goes somewhere.
    assert _core.testing.numa_split_per_layer(1, 2, 2 * S, [(0, 1), (1, 1), (2, 1)]) == [(0, 0, 0), (1, 0, S), (2, S, 2 * S)]
    assert _core.testing.numa_split_per_layer(2, 2, 4 * S, []) == []


def run_steps(m):
    """A prompt, decode steps and a batch of two sequences (their own block tables) on one model."""
    out = [core_forward(m, np.arange(1, 30, dtype=np.int32), 0, True)]
    out += [core_forward(m, np.array([t], np.int32), 29 + i, False) for i, t in enumerate((7, 300, 11))]
    a, b = np.array([3, 4, 5], np.int32), np.array([9, 10], np.int32)
    out.append(m.forward_batch(np.arange(40, 61, dtype=np.int32), [(19, 0, a, True), (2, 0, b, True)]))
    out.append(m.forward_batch(np.array([1, 2], np.int32), [(1, 19, a, False), (1, 2, b, False)]))
    return out


@pytest.mark.parametrize("kv_type", ["fp32", "bf16", "int8"])
def test_attention_split_by_kv_head_node_gives_the_same_bits(monkeypatch, kv_type):
    """Fake nodes: each node's threads attend over its own kv heads first (then steal); the logits of
    prompts, decode steps and batches must be those of the unsplit pool, bit for bit."""
    ref = run_steps(random_model(None, kv_type))
    monkeypatch.setenv("CORELM_NUMA_FORCE", "1")
    for nodes in ([0, 1], [1, 0, 1], [0, 1, 2], [-1, 0, 1], [0, 0, 1, 1]):
        m = random_model("distribute", kv_type, threads=len(nodes))
        m.set_thread_nodes(nodes)
        assert m.numa_info()["pool_thread_node"] == nodes
        for schedule in ("dynamic", "static"):
            m.schedule = schedule
            for got, want in zip(run_steps(m), ref):
                assert np.array_equal(got, want), (nodes, schedule)


# --------------------------------------------------------------------------------------------------
# Python API and CLI

def test_default_threads_per_policy():
    topo = _core.topology()
    allowed = set(topo["allowed_cpus"])
    cores_allowed = [c for c in topo["cores"] if allowed & set(c["cpus"])]
    assert model_builder.default_threads("distribute") == len(cores_allowed)
    assert model_builder.default_threads("isolate") <= len(cores_allowed)
    with pytest.raises(ValueError):
        model_builder.default_threads("spread")


def test_cli_passes_numa_to_the_engine(monkeypatch):
    seen = {}

    def fake_llm(**kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(cli.flags, "_make_llm", fake_llm)
    for cmd in (["generate", "m.gguf", "-p", "hi"], ["chat", "m.gguf"]):
        seen.clear()
        assert cli.main(cmd + ["--numa", "distribute"]) == 1 and seen["numa"] == "distribute"
        seen.clear()
        assert cli.main(cmd) == 1 and seen["numa"] is None
    seen.clear()
    assert cli.main(["generate", "m.gguf", "--numa", "interleave"]) == 2 and not seen   # argparse refuses it


def test_info_shows_the_policy_and_where_weights_go(capsys):
    assert cli.main(["info", "--numa", "isolate"]) == 0
    out = capsys.readouterr().out
    assert "Placement: --numa isolate" in out
    topo = system.topology_info(XEON, numa="distribute")
    assert topo["numa"] == {"policy": "distribute", "shares": [[0, 8], [1, 8]]}
    model = dict(head_dim=64, hidden_size=896, intermediate_size=4864, heads=14, kv_heads=2, vocab_size=151936)
    split = system.numa_split(model, topo["numa"]["shares"])
    assert split["wqkv"] == [[0, 0, 576], [1, 576, 1152]] and split["lm_head"][1] == [1, 75968, 151936]
    lines = cli.info.format_numa(dict(topo["numa"], model_split=split), n_nodes=2)
    assert "node 0 50% (8 threads), node 1 50% (8 threads)" in lines[0]
    assert "           w_gate_up: rows 0-4863 on node 0, rows 4864-9727 on node 1" in lines
    assert cli.info.format_numa({"policy": "default", "shares": [[0, 2]]}, 1)[0].startswith("Placement: --numa not set")


def test_batch_takes_numa(monkeypatch, tmp_path):
    import corelm.entrypoints.batch
    from corelm.entrypoints.batch import runner
    with pytest.raises(ValueError, match="numa"):
        runner.run_batch(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), numa="interleave")
    seen = {}
    summary = dict(requests=0, errors=0, skipped=0, generated_tokens=0, seconds=0.0, restarts=0)
    monkeypatch.setattr(corelm.entrypoints.batch, "run_batch", lambda *a, **kw: seen.update(kw) or summary)
    assert cli.main(["batch", "in.jsonl", "-o", "out.jsonl", "--numa", "isolate"]) == 0
    assert seen["numa"] == "isolate"


def test_experts_placed_by_node_and_results_unchanged(monkeypatch):
    """A mixture of experts under --numa distribute: every expert's matrices are placed by node like
    any matrix (each expert's rows split across the nodes, so a node's threads read their own rows of
    whichever experts a token picks), and the logits are those of the unplaced model, bit for bit, also
    with the pool split over fake nodes."""
    spec = ModelSpec(arch="mixtral", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4, num_experts=4,
                     num_experts_used=2, moe_norm_topk=True)

    def moe_model(numa, threads=2):
        m = _core.Model(core_config(spec, "fp32", threads, 256, numa=numa))
        rng = np.random.default_rng(1)
        for name, shape in weight_shapes(spec).items():
            m.set_weight(name, (rng.standard_normal(shape) * (0.5 if name.endswith("router") else 0.1)).astype(np.float32))
        m.finalize()
        return m

    ref = run_steps(moe_model(None))
    monkeypatch.setenv("CORELM_NUMA_FORCE", "1")
    m = moe_model("distribute")
    placed = {p["name"] for p in m.numa_info()["placed"]}
    assert {f"layers.{l}.experts.{e}.{w}" for l in range(2) for e in range(4) for w in ("w_gate_up", "w_down")} <= placed
    for a, b in zip(run_steps(m), ref):
        assert np.array_equal(a, b)
    for nodes in ([0, 1], [0, 1, 1]):
        m = moe_model("distribute", threads=len(nodes))
        m.set_thread_nodes(nodes)
        for a, b in zip(run_steps(m), ref):
            assert np.array_equal(a, b)
