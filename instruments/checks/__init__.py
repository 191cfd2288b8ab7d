"""Verdicts on correctness, computed before anything is timed.

  gate         every mode (and peer) against mode 1's logits at a short and a long context
  correctness  logits against ``transformers``, cached == uncached, multi-token append
  bugs         the write-up's silent bugs, each a broken subclass of an engine module, switched
               on one at a time in a private view of a model (never in the model others use)

``BUG_DESCRIPTIONS`` (kind -> what goes wrong) is here, torch-free, for the pages to list.
"""

BUG_DESCRIPTIONS = {
    "cache_order": "new keys/values concatenated before the cached ones (torch.cat([new, old]))",
    "positions": "decode positions restarted at 0 instead of continuing after the cache",
    "mask_offset": "causal-mask slice not offset by the cached length",
}
BUG_KINDS = tuple(BUG_DESCRIPTIONS)
