"""How many threads a process uses by default: shared by the engine (model_builder) and conversion
(convert.py's quantizer search), so it sits in the bottom layer with options."""
from __future__ import annotations

import os
from typing import Optional

from .options import choose_optional


def check_numa(numa: Optional[str]) -> Optional[str]:
    """None (the default plan, memory where first touch puts it), "distribute" (threads on every node,
    each matrix's rows and the KV blocks split by node) or "isolate" (threads and memory on the node the
    process started on), as llama.cpp's --numa."""
    return choose_optional("numa", numa)


def default_threads(numa: Optional[str] = None) -> int:
    """The physical cores of the first NUMA node this process may use (P- and E-cores on hybrid CPUs),
    as the C++ thread plan counts them: SMT siblings share execution units and only add contention to
    bandwidth-bound decode, and another node's cores would read the weights across the interconnect.
    numa="distribute": the physical cores of every node; "isolate": of the node this process runs on."""
    check_numa(numa)
    try:
        from . import _core   # lazy: importing corelm never loads the C++ core by itself
        return max(1, len(_core.plan_threads(numa=numa)))
    except Exception:   # the core is not built (or predates the plan): count cores with psutil
        pass
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:
        allowed = os.cpu_count() or 1
    try:
        import psutil
        physical = psutil.cpu_count(logical=False) or allowed
        logical = psutil.cpu_count(logical=True) or allowed
        per_core = max(1, logical // physical)
        return max(1, min(physical, allowed // per_core))
    except Exception:
        return max(1, allowed)
