"""The model families, one folder each, and what they share.

  gpt2/, llama/,  one family each: ``model`` (the from-scratch module and its forward),
  qwen2/,         ``weights`` (its readers and its ``transformers`` reference), ``step`` (its
  mistral/        one-token decode step, where it has one), ``tokenizer``, ``config`` (a new
                  family's shapes; GPT-2's and the Llama's are ``config``'s)
  config          GPT-2's and the Llama's shapes (``GPTConfig``, ``LlamaConfig``), torch-free
  base            what every family's model is built on (``CausalLM``): construction, the
                  forward's checks and positions, the loop over its blocks
  steps           what a family's step module offers (``KernelLayout`` for the Triton step)
  loader          what every family's loading does around its own weights: test shapes,
                  random weights, the fallback of "auto", the provenance, room in memory
  checkpoint      a user's checkpoint folder (config.json + safetensors) or GGUF file, read
                  without running anything of it
  gguf            our reader of GGUF files: header, metadata, tensor table, dequantizer
  attention       how a forward attends (the causal-mask variants) and how a one-token step
                  meets a preallocated cache
  rope            rotary positions (RoPE), every family's with ``positions="rope"``
  state           ``ModelState``: everything built on one model besides its weights
The family table that names these (``engine.families``) sits above them; nothing here imports it.
"""
