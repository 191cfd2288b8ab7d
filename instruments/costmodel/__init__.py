"""The cost model: what a step should cost, by formula and from calibrated parts. Torch-free.

  costs     FLOPs, bytes and memory of a step by formula (units in names, gpt2 numbers inline)
  predict   a step as the sum of its calibrated parts, against the measured step
  estimate  how long a sweep will take, fitted on the last sweep of the same model and device
  kv_plan   the KV memory planner's formulas (what fits, contiguous / exact / paged)
"""
