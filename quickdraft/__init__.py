"""quickdraft: a speculative-decoding-first, low-latency LLM chat backend.

The import namespace: ``quickdraft.engine`` (scheduler, KV cache, model runner),
``quickdraft.spec`` (draft proposers, rejection sampling), ``quickdraft.kernels`` (CPU C/C++
and Triton kernels), ``quickdraft.server`` (the Starlette gateway and the CLI) and
``quickdraft.client`` (the Python SDK). In the repository they are top-level folders; this
package links them (``quickdraft/engine -> ../engine``), and the wheel holds them as real files.

Importing ``quickdraft`` is cheap: it imports nothing else (no torch).
"""

__version__ = "0.2.0"
__all__ = ["__version__"]
