"""The run store: one versioned results schema on disk, and the views made from it. Torch-free.

  results  atomic writes, tolerant loads (a bad file is listed as skipped, never overwritten)
  frames   runs as pandas tables with their run-level columns
  tables   small tables computed from rows (the write-up's Table 1)
  stats    p50/p90/p99 with their minimum sample counts, mean ± sd, relative spread
  exports  a run as CSV, JSON Lines (one record per timed sample) or a Markdown table
  compare  two runs of one experiment, point by point: new / old against the runs' own noise
"""
