"""Our kernels for a decode step, one folder per device.

  ``cpu`` is C++, built once per machine (``python -m engine.kernels.cpu build``); ``gpu`` is
  Triton, compiled on first use.

  cpu   ``torch.ops.kvlab``: matrix-vector products over fp32 / bf16 / int8 rows and GGUF blocks,
        one query's attention over a cache, and a whole decode step in one call
        (``decode_layers``, ``decode_layers_llama``); the build and the loader
  gpu   decode attention split over the cache, the products with their norm, bias, activation
        and residual folded in, q|k|v with RoPE and the cache write, the embedding
Importing this package imports neither torch, a compiler nor triton.
"""
