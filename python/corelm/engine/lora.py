"""LoRA adapters per request: vLLM's LoRARequest, and the adapters registered on the core model.

    engine = LLMEngine(model, enable_lora=True, max_loras=4)
    engine.add_request("a", prompt, params, lora_request=LoRARequest("sql", 1, "path/to/adapter"))

Adapters are applied as separate low-rank products in the forward pass (cpp/model/lora.h), never merged
into the shared weights, so one batch mixes requests of several adapters and of the base model. An
adapter is loaded (loader/lora.py) the first time a request names its lora_int_id; at most max_loras stay
registered, the least recently used one no request holds making room for the next."""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set

from ..loader.lora import load_lora


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's vllm.lora.request.LoRARequest: a name, an id (>= 1) that stands for the adapter, and its path (a
    PEFT folder or a GGUF LoRA file). scale (corelm's) multiplies the adapter's alpha / rank."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None
    scale: float = 1.0

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"a LoRARequest needs a lora_name, got {self.lora_name!r}.")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")

    # vLLM's accessors
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class LoraRegistry:
    """The adapters on the core model, by lora_int_id. Core ids are never reused, so the prefix cache's blocks of
    an adapter removed (kept under its id's chain) are never taken for another's."""

    def __init__(self, core, spec, max_loras: int, in_use: Callable[[], Set[int]]):
        if not isinstance(max_loras, int) or isinstance(max_loras, bool) or max_loras < 1:
            raise ValueError(f"max_loras must be a positive integer, got {max_loras!r}.")
        self.core, self.spec, self.max_loras = core, spec, max_loras
        self._in_use = in_use                  # the core ids unfinished requests hold (the scheduler's)
        # held across resolve and the scheduler's add, so no other request evicts the adapter in between
        self.lock = threading.RLock()
        self.known: Dict[int, LoRARequest] = {}   # lora_int_id -> its request (reloaded from its path on demand)
        self._loaded: "collections.OrderedDict[int, int]" = collections.OrderedDict()  # lora_int_id -> core id (LRU)
        self._next_core_id = 0

    def resolve(self, request: LoRARequest) -> int:
        """The core id of the request's adapter, loaded (and registered) first if it is not; ValueError for a
        bad adapter or when max_loras adapters are all held by unfinished requests."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a corelm.lora.LoRARequest, got {type(request).__name__}")
        with self.lock:
            seen = self.known.get(request.lora_int_id)
            if seen is not None and (seen.lora_name, seen.lora_path, seen.scale) != \
                    (request.lora_name, request.lora_path, request.scale):
                raise ValueError(f"lora_int_id {request.lora_int_id} is adapter {seen.lora_name!r} "
                                 f"({seen.lora_path}); give each adapter its own id.")
            if request.lora_int_id in self._loaded:
                self._loaded.move_to_end(request.lora_int_id)
                return self._loaded[request.lora_int_id]
            adapter = load_lora(request.lora_path, self.spec, request.scale)   # ModelLoadError is a ValueError
            if len(self._loaded) >= self.max_loras:
                busy = self._in_use()
                idle = next((i for i, c in self._loaded.items() if c not in busy), None)
                if idle is None:
                    raise ValueError(f"all {self.max_loras} LoRA adapters (max_loras) are in use by running "
                                     f"requests; retry later or raise max_loras.")
                self.core.remove_lora(self._loaded.pop(idle))
            core_id = self._next_core_id
            self.core.add_lora(core_id, adapter.rank, adapter.scale, adapter.targets)
            self._next_core_id += 1
            self._loaded[request.lora_int_id] = core_id
            self.known[request.lora_int_id] = request
            return core_id

    def remove(self, lora_int_id: int) -> bool:
        """Forgets an adapter (False: none had that id); refused while requests use it."""
        with self.lock:
            if lora_int_id in self._loaded:
                if self._loaded[lora_int_id] in self._in_use():
                    raise ValueError(f"LoRA adapter {lora_int_id} is in use by running requests.")
                self.core.remove_lora(self._loaded.pop(lora_int_id))
            return self.known.pop(lora_int_id, None) is not None

    def by_name(self, name: str) -> Optional[LoRARequest]:
        with self.lock:
            return next((r for r in self.known.values() if r.lora_name == name), None)

    def list(self) -> List[LoRARequest]:
        with self.lock:
            return list(self.known.values())
