"""Benchmark scripts of kvcalib_kernels (run as scripts; never imported by the library or tests)."""
