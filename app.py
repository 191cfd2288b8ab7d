"""KV Cache Lab: the Streamlit router. Run with `streamlit run app.py` (or `make run`).

It sets the page up, draws the shared sidebar (model, weights, device, dtype) and hands over
to the chosen page. Pages live in pages/ and stay thin: inputs -> engine -> figures.
"""

import streamlit as st

from ui.state import sidebar

st.set_page_config(page_title="KV Cache Lab", page_icon="🧮", layout="wide")

PAGES = [
    st.Page("pages/generate.py", title="Generate side by side", icon="🔤", default=True),
]

nav = st.navigation(PAGES)
sidebar()
nav.run()
