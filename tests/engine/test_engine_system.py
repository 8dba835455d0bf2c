"""corelm.engine.system: what `corelm info` shows of the machine, read through the C++ core."""
import os
import sys

import pytest

from corelm.engine import system

EPYC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "topology", "epyc-4node")


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


def test_model_info_reads_no_weights(monkeypatch):
    """`corelm info` says how the matrices will be stored from the file's header: no weight is read (a
    7B mixture of experts once cost its whole 3.9 GB of pages)."""
    from corelm import loader
    from conftest import DEFAULT_GGUF
    real = loader.load_model

    def no_reads(path):
        loaded = real(path)

        def fail(name):
            raise AssertionError(f"weight {name} was read")
        loaded.get_weight = loaded.get_raw_weight = fail
        return loaded
    monkeypatch.setattr(loader, "load_model", no_reads)
    info = system.model_info(DEFAULT_GGUF)
    assert info["matrices_stored_as"].startswith("q4_1")
