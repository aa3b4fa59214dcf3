"""Kernel internals of the Triton backend (importing these imports triton)."""
