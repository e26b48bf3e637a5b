"""Integrations with inference engines. Each submodule imports its engine lazily, if at all.

``from mmstore.integrations import vllm`` works without vLLM installed: it builds the plain
dicts vLLM accepts and never imports vLLM itself.
"""
