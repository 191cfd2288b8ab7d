"""The measuring process and how the dashboard talks to it.

  worker    ``python -m instruments.process.worker --device D``: one per device, holds the model,
            runs one experiment at a time, streams progress, rows and the finished run
  client    the server's side: starts a worker on demand, submits jobs, files their messages
  queue     one measurement per device at a time across every browser session, in a visible queue
  protocol  the line protocol between the two (JSON per line, nothing else on stdout)
  probe     ``python -m instruments.process.probe``: which devices and dtypes this machine offers
Torch-free except the worker and the probe, which run in processes of their own.
"""
