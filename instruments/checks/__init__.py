"""Verdicts on correctness, computed before anything is timed.

  gate         every mode (and peer) against mode 1's logits at a short and a long context
  correctness  logits against ``transformers``, cached == uncached, multi-token append
  bugs         the silent bugs of a KV cache, each a broken subclass of an engine module,
               switched on one at a time in a private view of a model (never in the model others
               use): the write-up's three in every family; ``bugs_rope`` those of rotary positions

``BUG_DESCRIPTIONS`` (kind -> what goes wrong) and ``BUG_POSITIONS`` (kind -> the kinds of
positions a family must have for it: RoPE's bugs need rotary ones; None: every family) are here,
torch-free, for the pages to list; ``bugs_for(family)``.
"""

BUG_DESCRIPTIONS = {
    "cache_order": "new keys/values concatenated before the cached ones (torch.cat([new, old]))",
    "positions": "decode positions restarted at 0 instead of continuing after the cache "
                 "(GPT-2: the position table; Llama: RoPE's angles)",
    "mask_offset": "causal-mask slice not offset by the cached length",
    "rope_twice": "cached keys rotated a second time: RoPE applied again to every key read back "
                  "from the cache",
    "gqa_mapping": "query head h reads K/V head h % n_kv_head (the cache tiled) instead of "
                   "h // groups",
}
BUG_POSITIONS: dict[str, tuple[str, ...] | None] = {
    "cache_order": None, "positions": None, "mask_offset": None, "rope_twice": ("rope",),
    "gqa_mapping": ("rope",)}
BUG_KINDS = tuple(BUG_DESCRIPTIONS)


def bugs_for(family: str) -> list[str]:
    """The bugs that can be switched on in a model of ``family`` (RoPE's and GQA's only where
    there are rotary positions and shared K/V heads)."""
    from instruments import lineup

    positions = lineup.family_of(family).positions
    return [k for k in BUG_KINDS if BUG_POSITIONS[k] is None or positions in BUG_POSITIONS[k]]
