"""kvstage: hands the KV cache from prefill to decode workers across different TP sizes via a staging ring.

Layers, imports pointing down only: cli/engine -> runtime -> transport -> dataplane -> protocol ->
layout/ring/errors (the pure core); sim/ drives protocol/ beside runtime/. docs/architecture.md in the repository
draws the layers, and tests/test_layering.py enforces them.
"""

__version__ = "0.1.0"
