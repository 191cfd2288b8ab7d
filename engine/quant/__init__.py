"""Weight formats: how the lossy rungs store a step's weights.

  weight_only  rungs 12-13: int8 rows with a scale per output channel, or bf16 rows, swapped
               into a view of the model (the model itself never changes); the view machinery
               every stored format uses
  blocks       rungs 14-15: GGUF's Q8_0 / Q4_1 blocks, multiplied as stored (from the GGUF file
               the model's weights were read from, byte for byte where they are its, else
               quantized here)
Reading GGUF files is a weights format of the families' readers: ``engine.models.gguf``.
"""
