"""Weight formats: how the lossy rungs store a step's weights, and the GGUF files.

  weight_only  rungs 12-13: int8 rows with a scale per output channel, or bf16 rows, swapped
               into a view of the model (the model itself never changes); the view machinery
               every stored format uses
  blocks       rungs 14-15: GGUF's Q8_0 / Q4_1 blocks, multiplied as stored (from the model's
               own GGUF file byte for byte where its weights are one, else quantized here)
  gguf         our reader of GGUF files (llama.cpp's format): header, metadata, tensor table,
               dequantizer
"""
