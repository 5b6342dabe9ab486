"""The test harness shared by every suite that starts vLLM.

- ``ports``: free and dead addresses (no vLLM, no heavy import).
- ``offline``: one offline vLLM engine in a child process, driven over a pipe.
- ``pool``: the pytest plugin that shares engines and one xPyD deployment across test modules
  and counts every vLLM start.
- ``checks``: prompts, greedy comparison up to near-ties, waiting for an engine to hold nothing.
"""
