"""Errors that cross layers (the bottom layer: every other module may raise or catch them)."""


class ModelLoadError(ValueError):
    """A model file or folder is missing, corrupt, hostile or unsupported. The message says which."""


class EngineDead(RuntimeError):
    """The engine can serve no more requests: a process it depends on (a tensor-parallel rank) died or stopped
    answering. Every request in flight has failed; the program should stop (or build a new engine)."""
