"""specdecode: a speculative-decoding inference engine for LLMs.

    from specdecode import LLM, SamplingParams
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    out = llm.generate(["def fib(n):"], SamplingParams(temperature=0.0, max_tokens=64))[0]
    out.text, out.token_ids, out.metrics
"""

from specdecode.config import EngineConfig, SamplingParams
from specdecode.speculative.config import SpeculativeConfig
from specdecode.engine.engine import LLM, RequestOutput
from specdecode.errors import SpecDecodeError

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "EngineConfig", "RequestOutput", "SpecDecodeError"]
