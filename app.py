"""KV Cache Lab: the Streamlit router. Run with `make run` (``ui.serve``: the measuring process
and the first model start with the server) or `streamlit run app.py`.

It sets the page up, starts the measuring process and the device probe in the background (the
first page never waits for either), draws the shared sidebar (model, weights, device, dtype)
and hands over to the chosen page. Pages live in views/ and stay thin: inputs -> a request to
the measuring process (ui.jobs) -> figures. This process never imports torch and never times
anything. The folder is not called pages/: Streamlit would serve such a folder by itself (its
first multipage API) until a session has run this router, so a page opened by its own URL on a
fresh server ran without it -- no sidebar, no measuring process started -- and then again.
"""

import streamlit as st

from instruments.process import client
from ui.state import sidebar

st.set_page_config(page_title="KV Cache Lab", page_icon=":material/memory:", layout="wide")

PAGES = [
    st.Page("views/overview.py", title="Overview", icon=":material/home:", default=True),
    st.Page("views/generate.py", title="Generate side by side", icon=":material/compare:"),
    st.Page("views/sweep.py", title="Latency sweep", icon=":material/timer:"),
    st.Page("views/peers.py", title="Peers", icon=":material/groups:"),
    st.Page("views/flops.py", title="FLOPs vs time", icon=":material/speed:"),
    st.Page("views/floor.py", title="Floor lab", icon=":material/troubleshoot:"),
    st.Page("views/memory.py", title="Memory", icon=":material/memory:"),
    st.Page("views/planner.py", title="KV memory planner", icon=":material/calculate:"),
    st.Page("views/prefix.py", title="Prefix cache", icon=":material/account_tree:"),
    st.Page("views/serving.py", title="Serving", icon=":material/dns:"),
    st.Page("views/correctness.py", title="Correctness lab", icon=":material/bug_report:"),
    st.Page("views/results.py", title="Results", icon=":material/folder_open:"),
]

nav = st.navigation(PAGES)
# Once per server, in the background, while this page draws: the measuring process (torch
# imports there) and the device probe (on a CPU-only torch, that process's greeting answers it).
client.prestart(client.likely_device())
client.start_probe()
sidebar()
nav.run()
