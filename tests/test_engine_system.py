"""corelm.engine.system: what `corelm info` shows of the machine, read through the C++ core."""
import os
import sys

import pytest

from corelm.engine import system

EPYC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "topology", "epyc-4node")


def test_system_info_reads_a_recorded_topology():
    pytest.importorskip("corelm._core")
    info = system.system_info(threads=8, numa="distribute", root=EPYC)
    assert info["cpu"]["numa_nodes"] == 4 and info["topology"]["nodes"] == [0, 1, 2, 3]
    assert info["topology"]["numa"]["policy"] == "distribute"
    assert len(info["thread_plan"]) == 8 and {t["node"] for t in info["thread_plan"]} == {0, 1, 2, 3}
    assert info["features_source"] == "corelm._core" and info["kernels"]


def test_system_info_without_the_core(monkeypatch):
    monkeypatch.setitem(sys.modules, "corelm._core", None)   # import raises ImportError
    info = system.system_info()
    assert info["kernels"] is None and "core_error" in info and "topology" not in info
    assert info["cpu"]["numa_nodes"] is None    # only the C++ core reads sysfs
