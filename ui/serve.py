"""``make run``: the dashboard's server, its measuring process and the first model's load begun
as it starts, before any browser connects.

    python -m ui.serve [streamlit run's options]

It serves the same app as ``streamlit run app.py``. There the measuring process starts with the
first page's script run (app.py) and the model loads once that page asks for it: after the
server has started and the browser has connected. Here both begin with the server: on a 2-core
CPU torch's import and the model's load (seconds each) overlap the server's start and the
browser's first page instead of following them. The model is the sidebar's first choice on the
likeliest device (``ui.state.first_choice``); a page that asks for another loads that one as
usual. Nothing is timed before a run asks: the load is the one the first page would start.
"""

from __future__ import annotations

import sys
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app.py"


def main(argv: list[str] | None = None) -> int:
    from streamlit.web import cli as streamlit_cli

    from instruments.process import client
    from ui.state import first_choice

    device = client.likely_device()
    client.prestart(device)
    client.start_probe()
    client.load_soon(first_choice(device).spec())  # queued behind the process's start
    sys.argv = ["streamlit", "run", str(APP), *(sys.argv[1:] if argv is None else argv)]
    return int(streamlit_cli.main() or 0)


if __name__ == "__main__":
    sys.exit(main())
