# TEMPORARY during the engine move; removed before this change lands.
from .engine.sequence import *  # noqa: F401,F403
from .engine.sequence import StreamChunk, Sequence  # noqa: F401
