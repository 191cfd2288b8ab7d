"""Qwen2: the Llama's blocks with biases on q, k and v.

One folder and one row of the family table (``engine.families``), nothing else.

  config     ``Qwen2Config``: a ``LlamaConfig`` whose q, k and v carry biases, read from
             ``Qwen2ForCausalLM``'s config.json
  model      ``Qwen2``: the Llama with biased q, k, v projections
  weights    its readers: a checkpoint's tensors (transformers' names, as the Llama's), the
             reference ``Qwen2ForCausalLM`` the gate holds it to
No tokenizer of its own yet (its row says None): prompts are token ids.
Its one-token step is the Llama family's (``engine.models.llama.step``): every product there
carries its own bias, so the fast, fused, weight-only, block and Triton steps take q/k/v's.
"""
