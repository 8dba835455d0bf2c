"""Errors that cross layers."""


class EngineDead(RuntimeError):
    """The engine can serve no more requests: a process it depends on (a tensor-parallel rank) died or stopped
    answering. Every request in flight has failed; the program should stop (or build a new engine)."""
