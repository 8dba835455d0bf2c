# TEMPORARY during the engine move; removed before this change lands.
from .engine.sampling import *  # noqa: F401,F403
from .engine.sampling import SamplingParams, Sampler, compute_logprobs, apply_penalties  # noqa: F401
