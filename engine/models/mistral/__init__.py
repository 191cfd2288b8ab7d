"""Mistral: the Llama's blocks attending over the last ``window`` tokens only.

One folder and one row of the family table (``engine.families``), nothing else.

  config     ``MistralConfig``: a ``LlamaConfig`` with its sliding ``window``; ``cache_rows``
             is the window's, so every formula of the cache's bytes stays flat past it
  model      ``Mistral``: the Llama whose attention masks every key older than the window
  ring       its KV caches: a ring of ``window`` rows per layer written in place (the
             "prealloc" kind) and the write-up's concatenating cache cut to the window
             ("concat"): memory stays flat past the window
  weights    its readers: a checkpoint's tensors (transformers' names, as the Llama's), the
             reference ``MistralForCausalLM`` the gate holds it to
No tokenizer of its own yet (its row says None): prompts are token ids. No one-token step: the
stepping modes meet a full preallocated cache (rows 0..pos), which a window cannot be told, so
the family row offers them not (``Family.step_why``).
"""
