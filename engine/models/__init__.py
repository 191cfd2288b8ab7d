"""The model families, one folder each, and what they share.

  gpt2/, llama/   one family each: ``model`` (the from-scratch module and its forward),
                  ``weights`` (its loader and its ``transformers`` reference), ``tokenizer``,
                  ``step`` (its one-token decode step over products passed in)
  config          every family's shapes (``GPTConfig``, ``LlamaConfig``), torch-free
  base            what every family's model is built on: construction, the forward's checks and
                  positions, the loop over its blocks
  loader          what every family's weight loader does around its own weights: the preset,
                  test shapes and random weights, the fallback of "auto", the provenance
  attention       how a forward attends (the causal-mask variants) and how a one-token step
                  meets a preallocated cache
  state           ``ModelState``: everything built on one model besides its weights
The family table that names these (``engine.families``) sits above them.
"""
