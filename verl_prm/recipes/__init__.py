"""End-to-end recipes built from the plugin's parts (``arithmetic``: a tiny model trained from scratch)."""
