"""KV Cache Lab's instruments: everything that measures the engine, and where measuring happens.

Timing, the cost model, device facts and peaks, the experiments (each one
``run(loaded, params, progress, should_stop) -> run``), correctness checks, the results store,
the measuring process and its client, and the CLI (``python -m instruments``). Imports the
engine; never streamlit, plotly or the UI. The modules the dashboard's server uses (``client``,
``queue``, ``params``, ``results``, ``costs``, ``contexts``, ``specs``, ``tables``, ``spine``,
``experiments``) import no torch.
"""
