"""The generation engine: continuous batching over a paged KV cache, sampling, stop strings (issue 39).

`Engine` (engine.py) drives requests; `token_logps` (score.py) scores whole sequences with the same bits.
"""

import kiln.engine.padded
import kiln.engine.v4  # noqa: F401  engv4: DeepSeek-V4's runner registers itself
from kiln.engine import dsa, hybrid, mamba, mla  # noqa: F401  (each registers its runner)
from kiln.engine.engine import Completion, Engine, RequestOutput
from kiln.engine.params import SamplingParams
from kiln.engine.score import token_logps

__all__ = ["Completion", "Engine", "RequestOutput", "SamplingParams", "token_logps"]
