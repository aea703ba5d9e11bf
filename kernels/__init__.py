"""Gathered low-rank (SGMV/BGMV) kernels for mixed-adapter batches; imports nothing of loraplane."""
