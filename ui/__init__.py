"""The dashboard's shared pieces: sidebar state, page header, job panels, launcher, pure figure
builders."""
