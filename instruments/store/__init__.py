"""The run store: one versioned results schema on disk, and the views made from it. Torch-free.

  results  atomic writes, tolerant loads (a bad file is listed as skipped, never overwritten)
  frames   runs as pandas tables with their run-level columns
  tables   small tables computed from rows (the write-up's Table 1)
"""
