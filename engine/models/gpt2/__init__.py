"""GPT-2: its model, weights, tokenizer and one-token step.

LayerNorm, learned absolute positions, one fused q|k|v product, a GELU MLP, every head caching
its own K and V; OpenAI's weights through ``transformers``, tiktoken's tokenizer.

  model      ``GPT``: the weights and ``forward``, nothing else (nanoGPT's layout)
  weights    ``load_gpt2`` (the family's loader) and ``to_transformers`` (the gate's reference)
  tokenizer  tiktoken's ``gpt2`` encoding (UTF-8 bytes for the 256-token test fixture)
  step       the one-token decode step of modes 6-9 and 12-16's CPU path, and its one-call C++ form
"""
