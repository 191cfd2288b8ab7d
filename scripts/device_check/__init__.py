"""The device check's parts, imported by scripts/gpu_check.py (which holds the stages table):
``runner`` (each stage isolated and bounded, summary.json, the watchdog), ``stages`` (the
measuring stages, the sweeps' plan) and ``pages`` (the dashboard's pages under AppTest)."""
