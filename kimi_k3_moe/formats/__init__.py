"""Bit-exact weight formats: MXFP4 as checkpoints hold it, int4 as gfx942 runs it."""
