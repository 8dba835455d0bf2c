"""The runtime: CPU topology from sysfs (fake trees of machines we do not have, broken trees, this
machine), the thread plan, the pinned thread pool and what a parallel region costs."""
import json
import math
import os
import re
import runpy
import shutil

import numpy as np
import pytest

from conftest import DATA, MODELS, ROOT, core_forward

from corelm import _core
from corelm.engine import system
from corelm.entrypoints import cli
from corelm.engine import model_builder
from corelm.loader import load_model

TREES = os.path.join(DATA, "topology")
XEON, ALDERLAKE, EPYC = (os.path.join(TREES, n) for n in ("xeon-2s-smt", "alderlake-8p8e", "epyc-4node"))


def cpu(topo, cpu_id):
    return next(c for c in topo["cpus"] if c["id"] == cpu_id)


def same_core(topo, a, b):
    return cpu(topo, a)["core"] == cpu(topo, b)["core"]


def caches(topo, level, kind="Unified"):
    return [c for c in topo["caches"] if c["level"] == level and c["type"] == kind]


def assert_consistent(topo):
    """Invariants every topology must keep, however broken its sysfs."""
    ids = [c["id"] for c in topo["cpus"]]
    assert ids == sorted(set(ids)) and ids
    in_cores = sorted(i for core in topo["cores"] for i in core["cpus"])
    assert in_cores == ids                                  # every CPU in exactly one core
    for c in topo["cpus"]:
        core = topo["cores"][c["core"]]
        assert core["cpus"][c["smt_index"]] == c["id"] and core["node"] == cpu(topo, core["cpus"][0])["node"]
        assert c["node"] in topo["nodes"] and c["package"] in topo["packages"]
        for key, level in (("l1d", 1), ("l2", 2), ("l3", 3)):
            if c[key] >= 0:
                assert topo["caches"][c[key]]["level"] == level and c["id"] in topo["caches"][c[key]]["cpus"]
    assert topo["threads_per_core"] == max(len(core["cpus"]) for core in topo["cores"])


def assert_plan_shape(topo, plan):
    """Physical cores before any SMT sibling, no CPU twice."""
    used = [p for p in plan if p >= 0]
    assert len(used) == len(set(used))
    smt = [cpu(topo, p)["smt_index"] for p in used]
    assert smt == sorted(smt)


# --------------------------------------------------------------------------------------------------
# Fake trees

def test_fake_trees_match_their_generator():
    tool = runpy.run_path(os.path.join(ROOT, "tools", "fixtures", "make_fake_topology.py"))
    for name in tool["MACHINES"]:
        assert tool["read_tree"](os.path.join(TREES, name)) == tool["tree_files"](name), \
            f"{name} is stale: run tools/fixtures/make_fake_topology.py"


def test_xeon_two_sockets_with_smt():
    t = _core.topology(XEON)
    assert_consistent(t)
    assert (t["packages"], t["nodes"], len(t["cores"]), len(t["cpus"])) == ([0, 1], [0, 1], 16, 32)
    assert t["threads_per_core"] == 2 and not t["hybrid"] and t["type_source"] == "" and t["notes"] == []
    assert same_core(t, 0, 16) and same_core(t, 8, 24) and cpu(t, 16)["smt_index"] == 1
    assert not same_core(t, 0, 8)                          # core_id 0 on both sockets: still two cores
    assert cpu(t, 8)["package"] == 1 and cpu(t, 24)["node"] == 1
    assert [c["size"] for c in caches(t, 2)] == [2 << 20] * 16
    assert [(c["size"], len(c["cpus"])) for c in caches(t, 3)] == [(60 << 20, 16)] * 2
    assert [c["size"] for c in caches(t, 1, "Data")] == [48 << 10] * 16
    assert len(caches(t, 1, "Instruction")) == 16
    assert cpu(t, 0)["l3"] == cpu(t, 23)["l3"] != cpu(t, 8)["l3"]


def test_xeon_plan_fills_node_0_cores_then_node_1_then_siblings():
    assert _core.plan_threads(root=XEON) == list(range(8))                  # default: node 0's cores
    assert _core.plan_threads(16, root=XEON) == list(range(16))             # then node 1's
    plan = _core.plan_threads(34, root=XEON)
    assert plan[16:32] == list(range(16, 32)) and plan[32:] == [-1, -1]     # then siblings; then unpinned
    assert_plan_shape(_core.topology(XEON), plan)
    assert _core.plan_threads(20, root=XEON, smt_siblings=False)[16:] == [-1] * 4


def test_plan_respects_the_allowed_cpus():
    # Only node 1: the default is node 1's cores.
    assert _core.plan_threads(root=XEON, allowed=list(range(8, 16)) + list(range(24, 32))) == list(range(8, 16))
    # Only second siblings: they stand in for their cores.
    assert _core.plan_threads(root=XEON, allowed=list(range(16, 24))) == list(range(16, 24))
    # Both threads of one core: one thread by default, the sibling only when asked for.
    assert _core.plan_threads(root=XEON, allowed=[1, 17]) == [1]
    assert _core.plan_threads(2, root=XEON, allowed=[17, 1]) == [1, 17]
    assert _core.plan_threads(2, root=XEON, allowed=[1, 17], smt_siblings=False) == [1, -1]
    # CPUs the tree does not know: nothing to pin to.
    assert _core.plan_threads(2, root=XEON, allowed=[999]) == [-1, -1]
    with pytest.raises(ValueError):
        _core.plan_threads(2, root=XEON, allowed=[])
    with pytest.raises(ValueError):
        _core.plan_threads(0, root=XEON)


def test_alderlake_hybrid_core_types():
    t = _core.topology(ALDERLAKE)
    assert_consistent(t)
    assert (t["packages"], t["nodes"], len(t["cores"]), len(t["cpus"])) == ([0], [0], 16, 24)
    assert t["hybrid"] and t["type_source"] == "sysfs"
    assert [c["type"] for c in t["cores"]] == ["P"] * 8 + ["E"] * 8
    assert [len(c["cpus"]) for c in t["cores"]] == [2] * 8 + [1] * 8
    assert same_core(t, 0, 1) and not same_core(t, 1, 2)
    assert cpu(t, 1)["type"] == "P" and cpu(t, 20)["type"] == "E"
    l2 = caches(t, 2)
    assert sorted((c["size"], len(c["cpus"])) for c in l2) == [(1280 << 10, 2)] * 8 + [(2 << 20, 4)] * 2
    assert cpu(t, 16)["l2"] == cpu(t, 19)["l2"] != cpu(t, 20)["l2"]        # E-core modules share an L2
    assert [(c["size"], len(c["cpus"])) for c in caches(t, 3)] == [(30 << 20, 24)]


def test_alderlake_plan_p_cores_then_e_cores_then_siblings():
    p_first = [0, 2, 4, 6, 8, 10, 12, 14]
    assert _core.plan_threads(root=ALDERLAKE) == p_first + list(range(16, 24))   # P+E cores by default
    assert _core.plan_threads(4, root=ALDERLAKE) == [0, 2, 4, 6]
    plan = _core.plan_threads(24, root=ALDERLAKE)
    assert plan[16:] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert_plan_shape(_core.topology(ALDERLAKE), plan)
    assert _core.plan_threads(root=ALDERLAKE, e_cores=False) == p_first
    assert _core.plan_threads(10, root=ALDERLAKE, e_cores=False)[8:] == [1, 3]
    # A process confined to E-cores still gets them, whatever the policy says.
    assert _core.plan_threads(root=ALDERLAKE, allowed=[20, 21], e_cores=False) == [20, 21]


def test_epyc_four_nodes():
    t = _core.topology(EPYC)
    assert_consistent(t)
    assert (t["packages"], t["nodes"], len(t["cores"]), len(t["cpus"])) == ([0], [0, 1, 2, 3], 16, 32)
    assert same_core(t, 5, 21) and cpu(t, 21)["node"] == 1 and t["notes"] == []
    assert [(c["size"], c["cpus"]) for c in caches(t, 3)][1] == (32 << 20, [4, 5, 6, 7, 20, 21, 22, 23])
    assert [c["size"] for c in caches(t, 2)] == [512 << 10] * 16
    assert _core.plan_threads(root=EPYC) == [0, 1, 2, 3]
    assert _core.plan_threads(8, root=EPYC) == list(range(8))
    assert _core.plan_threads(root=EPYC, allowed=list(range(8, 16))) == [8, 9, 10, 11]   # node 2 first


# --------------------------------------------------------------------------------------------------
# Broken trees: never crash, fall back, say so

@pytest.fixture
def xeon_copy(tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(XEON, root)
    return root


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def test_empty_tree_falls_back_to_one_package_node_and_core_per_cpu(tmp_path):
    t = _core.topology(str(tmp_path))
    assert_consistent(t)
    assert t["packages"] == [0] and t["nodes"] == [0] and t["threads_per_core"] == 1
    assert len(t["cores"]) == len(t["cpus"]) >= 1 and t["caches"] == [] and t["notes"]
    assert _core.plan_threads(root=str(tmp_path)) == [c["id"] for c in t["cpus"]]


def test_missing_online_list_uses_the_cpu_directories(xeon_copy):
    os.remove(xeon_copy / "devices/system/cpu/online")
    t = _core.topology(str(xeon_copy))
    assert len(t["cpus"]) == 32 and len(t["cores"]) == 16 and any("online" in n for n in t["notes"])


def test_offline_cpus_are_left_out(xeon_copy):
    write(xeon_copy, "devices/system/cpu/online", "0-15\n")             # SMT switched off
    t = _core.topology(str(xeon_copy))
    assert_consistent(t)
    assert len(t["cpus"]) == 16 and len(t["cores"]) == 16 and t["threads_per_core"] == 1
    assert [c["cpus"] for c in caches(t, 3)] == [list(range(8)), list(range(8, 16))]  # lists cut to online CPUs
    write(xeon_copy, "devices/system/cpu/online", "0-7,16-23\n")        # socket 1 offline
    t = _core.topology(str(xeon_copy))
    assert len(t["cpus"]) == 16 and t["packages"] == [0] and t["nodes"] == [0]


@pytest.mark.parametrize("junk", ["", "garbage", "0-", "-3", "3-1", "0-999999999", "1,,2", "0x10", "\xff\xfe",
                                  "0-3\n4-7"])
def test_malformed_lists_are_ignored(xeon_copy, junk):
    for cpu_id in range(32):
        write(xeon_copy, f"devices/system/cpu/cpu{cpu_id}/topology/thread_siblings_list", junk)
    write(xeon_copy, "devices/system/node/node1/cpulist", junk)
    write(xeon_copy, "devices/system/cpu/cpu3/cache/index3/shared_cpu_list", junk)
    t = _core.topology(str(xeon_copy))
    assert_consistent(t)
    # Cores come from (package, core_id) instead; node 1's CPUs join node 0.
    assert len(t["cores"]) == 16 and same_core(t, 8, 24) and not same_core(t, 0, 8)
    assert t["nodes"] == [0] and any("node" in n for n in t["notes"])   # "" is a CPU-less node (CXL, HBM)
    assert cpu(t, 3)["l3"] >= 0 and t["caches"][cpu(t, 3)["l3"]]["cpus"] == [3]


def test_missing_topology_files_make_each_cpu_its_own_core(xeon_copy):
    for cpu_id in range(32):
        shutil.rmtree(xeon_copy / f"devices/system/cpu/cpu{cpu_id}/topology")
    t = _core.topology(str(xeon_copy))
    assert_consistent(t)
    assert len(t["cores"]) == 32 and t["packages"] == [0] and t["threads_per_core"] == 1
    assert t["nodes"] == [0, 1]                                       # nodes do not depend on them


def test_bad_values_and_odd_files(xeon_copy):
    write(xeon_copy, "devices/system/cpu/cpu0/topology/physical_package_id", "-1\n")   # some ARM boards
    write(xeon_copy, "devices/system/cpu/cpu1/topology/thread_siblings_list", "2,18\n")  # not itself
    write(xeon_copy, "devices/system/cpu/cpu2/cache/index2/size", "lots\n")
    write(xeon_copy, "devices/system/cpu/cpu2/cache/index3/level", "9\n")
    write(xeon_copy, "devices/system/cpu/cpu4/cache/index0/type", "Weird\n")
    write(xeon_copy, "devices/system/cpu/cpu5/cache/index9/level", "2\n")          # half an entry
    write(xeon_copy, "devices/system/cpu/cpu6/topology/core_id", b"\x00" * 100000)
    shutil.rmtree(xeon_copy / "devices/system/cpu/cpu7/cache/index2")
    os.makedirs(xeon_copy / "devices/system/cpu/cpu7/cache/index2/size")            # a directory, not a file
    os.makedirs(xeon_copy / "devices/system/node/nodeX")
    os.makedirs(xeon_copy / "devices/system/node/node7")                           # no cpulist
    t = _core.topology(str(xeon_copy))
    assert_consistent(t)
    assert cpu(t, 0)["package"] == 0 and len(t["cpus"]) == 32 and t["nodes"] == [0, 1]
    assert same_core(t, 1, 17)            # cpu 17's own list still names cpu 1
    assert t["caches"][cpu(t, 2)["l2"]]["size"] == 0 and cpu(t, 2)["l3"] == -1 and cpu(t, 4)["l1d"] == -1
    assert len(t["notes"]) >= 2


def test_malformed_hybrid_lists_leave_types_unknown(tmp_path):
    root = tmp_path / "sys"
    shutil.copytree(ALDERLAKE, root)
    write(root, "devices/cpu_core/cpus", "zero to fifteen\n")
    write(root, "devices/cpu_atom/cpus", "16-23\n")
    t = _core.topology(str(root))
    assert not t["hybrid"] and {c["type"] for c in t["cores"]} == {"?", "E"}
    os.remove(root / "devices/cpu_core/cpus")
    os.remove(root / "devices/cpu_atom/cpus")
    t = _core.topology(str(root))                    # a fake root never probes this machine's CPUID
    assert t["type_source"] == "" and {c["type"] for c in t["cores"]} == {"?"}


# --------------------------------------------------------------------------------------------------
# This machine

def test_this_machine():
    t = _core.topology()
    assert_consistent(t)
    assert t["root"] == "/sys" and t["allowed_cpus"]
    plan = _core.plan_threads()
    assert 1 <= len(plan) <= len(t["cores"]) and set(plan) <= set(t["allowed_cpus"])
    assert len({cpu(t, p)["core"] for p in plan}) == len(plan)              # one thread per core
    assert len({cpu(t, p)["node"] for p in plan}) == 1                      # one node
    assert model_builder.default_threads() == len(plan)
    big = _core.plan_threads(len(t["allowed_cpus"]) + 1)
    assert sorted(big[:-1]) == sorted(t["allowed_cpus"]) and big[-1] == -1
    assert_plan_shape(t, big)
    if hasattr(os, "sched_getaffinity"):
        assert t["allowed_cpus"] == sorted(os.sched_getaffinity(0))


def test_pin_threads_env_switch(monkeypatch):
    monkeypatch.delenv("CORELM_PIN_THREADS", raising=False)
    assert model_builder.default_pin_threads()
    monkeypatch.setenv("CORELM_PIN_THREADS", "0")
    assert not model_builder.default_pin_threads()


# --------------------------------------------------------------------------------------------------
# The pool

def test_pool_pins_workers_only_when_asked():
    allowed = _core.topology()["allowed_cpus"]
    n = min(len(allowed), 4)
    pinned = _core.testing.bench_parallel_regions(n, 100, pin=True)
    assert pinned["pinned_workers"] == n - 1         # plan CPUs lie in the affinity mask, so pinning works
    assert _core.testing.bench_parallel_regions(n, 100, pin=False)["pinned_workers"] == 0


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_regions_complete_and_stay_cheap(threads):
    # More threads than CPUs (3, 8 on a small machine) still finish: descheduled threads' slots are
    # taken by whoever runs. The bound only catches a region that sleeps or waits on the kernel every
    # time (hundreds of microseconds), not noise from other processes.
    before = os.sched_getaffinity(0)
    r = _core.testing.bench_parallel_regions(threads, 2000, work=0, pin=True, pin_caller=True)
    assert r["slots_ok"] and math.isfinite(r["region_us"]) and 0 <= r["region_us"] < 200
    assert os.sched_getaffinity(0) == before          # the benchmark unpins the caller it pinned
    r = _core.testing.bench_parallel_regions(threads, 20000, work=20, pin=False)
    assert r["slots_ok"] and 0 <= r["worker_share"] <= 1
    r = _core.testing.bench_parallel_regions(threads, 200, work=200, pin=True, idle_us=3000.0)  # sleepers woken
    assert r["slots_ok"] and r["region_us"] < 20000


@pytest.fixture(scope="module")
def stories():
    return load_model(os.path.join(MODELS, "stories260K"))


@pytest.mark.parametrize("threads", [2, 3])
def test_pinned_model_matches_unpinned(stories, threads):
    pinned = model_builder.build_core_model(stories, dtype="fp32", threads=threads, pin_threads=True)
    loose = model_builder.build_core_model(stories, dtype="fp32", threads=threads, pin_threads=False)
    assert loose.thread_cpus == [-1] * threads
    plan = _core.plan_threads(threads)
    assert pinned.thread_cpus[0] == -1 and pinned.thread_cpus[1:] == plan[1:]   # the caller is never pinned
    tokens = np.array([1, 403, 407, 261, 378, 317, 378], dtype=np.int32)
    a = core_forward(pinned, tokens, 0, all_logits=True)
    b = core_forward(loose, tokens, 0, all_logits=True)
    assert np.array_equal(a, b)                      # the same split of work, so the same bits
    for step, tok in enumerate([262, 300]):          # decode steps too
        assert np.array_equal(core_forward(pinned, np.array([tok], np.int32), len(tokens) + step),
                              core_forward(loose, np.array([tok], np.int32), len(tokens) + step))


# --------------------------------------------------------------------------------------------------
# corelm info

def test_info_shows_topology_and_plan(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["topology"]["cpus"] and info["pin_threads"] in (True, False)
    assert [t["cpu"] for t in info["thread_plan"]] == _core.plan_threads()
    assert cli.main(["info", "-t", "3"]) == 0
    out = capsys.readouterr().out
    assert "Topology:" in out and "thread 2 -> " in out
    assert cli.main(["info", "-t", "0"]) == 1


def test_weights_move_onto_huge_pages_after_a_slow_load():
    """Where auto found 2 MiB pages slow (here: every page counts as slow), the weights load on 4 KiB pages and
    a thread of idle priority then moves them onto 2 MiB pages (MADV_COLLAPSE): all of them where the kernel
    can (Linux 6.1+, THP not off), without changing a token; wait_for_huge_pages waits for it."""
    import subprocess
    import sys
    from conftest import DEFAULT_GGUF
    code = r"""
import json, corelm
from corelm import _core
def huge_kib():
    return sum(int(l.split()[1]) for l in open("/proc/self/smaps") if l.startswith("AnonHugePages:"))
llm = corelm.LLM(%r, threads=2, max_seq_len=64)
params = corelm.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
before = llm.generate("Once upon a time", params)[0].outputs[0].token_ids
done = llm.wait_for_huge_pages(timeout=300)
p = llm.engine.core.huge_page_promotion
after = llm.generate("Once upon a time", params)[0].outputs[0].token_ids
print("R" + json.dumps(dict(in_use=_core.huge_pages_in_use(), done=done, p=p, same=before == after, huge_kib=huge_kib())))
""" % DEFAULT_GGUF
    env = dict(os.environ, CORELM_HUGE_PAGES="auto", CORELM_HUGE_PAGE_SLOW_MS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads([line for line in out.stdout.splitlines() if line.startswith("R")][0][1:])
    assert r["in_use"] is False and r["done"] and r["same"]
    p = r["p"]
    assert p["total_bytes"] >= 50 << 20 and not p["running"]     # SmolLM2's ~90 MB of weights
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read() if os.path.exists(
        "/sys/kernel/mm/transparent_hugepage/enabled") else "[never]"
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)   # e.g. "6.18.44-fc", "6.1-rc3"
    if release and tuple(map(int, release.groups())) >= (6, 1) and "[never]" not in thp:
        assert p["moved_bytes"] == p["total_bytes"]
        assert r["huge_kib"] * 1024 >= p["moved_bytes"]     # they are on 2 MiB pages now
    else:
        assert p["moved_bytes"] < p["total_bytes"]


def test_info_formats_a_hybrid_plan():
    topo = system.topology_info(ALDERLAKE)
    text = "\n".join(cli.info.format_topology(topo, topo.pop("thread_plan"), pinned=True))
    assert "16 cores (8 P + 8 E), 24 logical CPUs, SMT 2" in text
    assert "thread 0 -> cpu 0 (core 0, node 0, P)" in text and "thread 8 -> cpu 16 (core 8, node 0, E)" in text
    assert "L2 2 MiB x2 (shared by 4 CPUs)" in text
    topo = system.topology_info(EPYC, threads=20)
    text = "\n".join(cli.info.format_topology(topo, topo.pop("thread_plan"), pinned=False))
    assert "4 NUMA nodes" in text and "node 3: CPUs 12-15,28-31 (4 cores)" in text and "4 more" in text


@pytest.mark.parametrize("setting,expect", [("0", False), ("1", True), ("", None), ("auto", None)])
def test_huge_pages_setting(setting, expect):
    """CORELM_HUGE_PAGES=0 never asks for 2 MiB pages, 1 always, auto (and unset) until one is slow to come."""
    import subprocess
    import sys
    code = ("import numpy as np, corelm._core as c; "
            "w = c.testing.kernel_packed_bytes('avx2' if 'avx2' in c.kernel_tables() else 'scalar', "
            "np.ones((2048, 1024), np.float32), 'bf16'); print(c.huge_pages_in_use())")
    env = dict(os.environ, CORELM_HUGE_PAGES=setting)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in (("True", "False") if expect is None else (str(expect),))
