"""`corelm batch --ray ADDRESS`: the same run with its workers as Ray actors.

ADDRESS is a Ray cluster address ("ray://host:10001", "host:6379"), "auto" (the cluster this
machine belongs to, as `ray start` left it), or "local" (start a private single-machine cluster in
this process). Each actor asks Ray for `threads` CPUs (default 1) and builds its own engine with
that many threads; Ray places it. The model path must exist on every node. Ray is an optional
extra: pip install 'corelm[ray]'.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional


class _ActorBody:
    def __init__(self, model, threads, options):
        from .worker import BatchWorker
        self.worker = BatchWorker(model, threads, options)

    def ready(self) -> Dict[str, Any]:
        return self.worker.info()

    def run(self, requests):
        return self.worker.run_task(requests)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray, which is not installed: pip install 'corelm[ray]'") from None
    return ray


class RayBackend:
    def __init__(self, address: str, workers: int, threads: Optional[int], model: Optional[str],
                 options: Dict[str, Any]):
        ray = self.ray = _import_ray()
        self._owns_ray = False
        if not ray.is_initialized():
            import corelm   # actors import corelm from where this process did
            here = os.path.dirname(os.path.dirname(os.path.abspath(corelm.__file__)))
            env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}}
            if address == "local":
                ray.init(runtime_env=env, log_to_driver=False, include_dashboard=False)
            else:
                ray.init(address=address, runtime_env=env, log_to_driver=False)
            self._owns_ray = True
        self.threads = threads or 1
        self.model = os.path.abspath(model) if isinstance(model, str) and os.path.exists(model) else model
        self.args = (self.model, self.threads, options)
        self.actor_cls = ray.remote(num_cpus=self.threads, max_restarts=0)(_ActorBody)
        self.actors: Dict[int, Any] = {}
        self.refs: Dict[Any, tuple] = {}     # object ref -> (slot, task_id or None for ready)
        for slot in range(workers):
            self.start(slot)

    def start(self, slot: int) -> None:
        actor = self.actor_cls.remote(*self.args)
        self.actors[slot] = actor
        self.refs[actor.ready.remote()] = (slot, None)

    def live(self) -> bool:
        return bool(self.actors)

    def pids(self) -> Dict[int, int]:
        return {}

    def send(self, slot: int, task_id: int, requests) -> None:
        self.refs[self.actors[slot].run.remote(requests)] = (slot, task_id)

    def wait(self, timeout: float) -> List[tuple]:
        if not self.refs:
            return []
        ready, _ = self.ray.wait(list(self.refs), num_returns=1, timeout=timeout)
        events = []
        for ref in ready:
            slot, task_id = self.refs.pop(ref)
            try:
                value = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as e:
                if self.actors.pop(slot, None) is not None:
                    for r, (s, _) in list(self.refs.items()):
                        if s == slot:
                            self.refs.pop(r)
                    events.append(("died", slot, type(e).__name__))
                continue
            except self.ray.exceptions.RayTaskError as e:
                if task_id is None:                  # the engine could not be built
                    events.append(("fatal", slot, str(e.cause) if getattr(e, "cause", None) else str(e)))
                    continue
                raise
            events.append(("ready", slot, value) if task_id is None else ("result", slot, task_id, value))
        return events

    def close(self) -> Dict[int, Dict[str, Any]]:
        """Stops every actor; returns {slot: info} of those whose "ready" had not been collected."""
        late: Dict[int, Dict[str, Any]] = {}
        pending = [ref for ref, (_, task_id) in self.refs.items() if task_id is None]
        if pending:
            done, _ = self.ray.wait(pending, num_returns=len(pending), timeout=10)
            for ref in done:
                try:
                    late[self.refs[ref][0]] = self.ray.get(ref)
                except Exception:
                    pass
        for actor in self.actors.values():
            try:
                self.ray.kill(actor)
            except Exception:
                pass
        self.actors.clear()
        self.refs.clear()
        if self._owns_ray:
            self.ray.shutdown()
        return late
