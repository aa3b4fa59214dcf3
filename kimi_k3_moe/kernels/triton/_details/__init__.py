"""Kernel internals of the Triton backend (importing these imports triton; constants.py aside, which
the torch-side layout code and table.py read too)."""
