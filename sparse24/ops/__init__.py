"""Launchers, pure-torch reference twins and backend choice (layer 3)."""
