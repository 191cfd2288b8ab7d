"""The dashboard's shared pieces: sidebar state, the cached model loader, pure figure builders."""
