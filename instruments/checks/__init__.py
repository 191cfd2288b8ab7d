"""Verdicts on correctness, computed before anything is timed.

  gate         every mode (and peer) against mode 1's logits at a short and a long context
  correctness  logits against ``transformers``, cached == uncached, multi-token append, and the
               write-up's silent bugs switched on one at a time
"""
