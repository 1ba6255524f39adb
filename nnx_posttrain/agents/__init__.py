"""Agents: tool calling and environments in online RL (TRL 1.16's ``tools`` and
``environment_factory``).

- ``schema``: a typed function with a Google-style docstring -> its JSON schema
  (``function_schema``, as ``transformers.utils.get_json_schema``);
- ``toolset``: the run's functions and environment classes, one ``Episode`` (environment
  instance, tools, schemas) per rollout, calls with a time limit;
- ``calls``: tool calls read from generated text per chat format (Gemma 4's, Qwen 3.5's and
  harmony's in ``gemma4_calls``, ``qwen35_calls``, ``harmony_calls``), and the tokens that hand
  the results back;
- ``loop``: the tool-calling loop of a rollout on the KV-cache sampler (``ToolLoop``).
"""

from nnx_posttrain.agents.calls import PARSED_FORMATS, Malformed, continuation, parse
from nnx_posttrain.agents.loop import Exchange, ToolLoop
from nnx_posttrain.agents.schema import SchemaError, function_schema
from nnx_posttrain.agents.toolset import EnvironmentFailed, Episode, Toolset

__all__ = ["EnvironmentFailed", "Episode", "Exchange", "Malformed", "PARSED_FORMATS", "SchemaError",
           "ToolLoop", "Toolset", "continuation", "function_schema", "parse"]
