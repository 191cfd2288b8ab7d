"""Measuring: clocks, the one Sampler, device facts and peaks, memory counters, calibration.

  timing       sync -> clock -> run -> sync; ``StepClock`` for a caller-driven loop; ``CpuWatch``
               (was a CPU sample disturbed by another process?)
  sampler      the one ``Sampler``: adaptive samples per point, the quiet watch and retakes
  device       what a device is and the one peak routine per device (matmul, read bandwidth)
  specs        listed datasheet peaks (torch-free)
  memory       weights / KV cache / mask buffers / workspace, by tensor bytes and allocator
  calibration  the parts of a decode step, each timed alone (summed by ``costmodel.predict``)
  busy         the device's own time in a call (kernels on a GPU), apart from the host's
  energy       the device's energy counter around timed work (NVML, RAPL), or why there is none
"""
