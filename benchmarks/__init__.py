"""GPU benchmarks of kvcalib's kernels and runtime (not installed with the package; run from the
repository root, ``python -m benchmarks.NAME``, or through ``bash scripts/gpu_bench.sh STAGE``).
One script per question; each writes JSON into ``--out`` (``artifacts/bench`` by default) and
``benchmarks.report`` turns them into the tables there.

- :mod:`.grid`: the fused decode kernel against bf16 SDPA over the protocol's grid
  (``decode_attention.json``); ``--rows ab --tag NAME``: the rows an A/B of two kernels trees needs.
- :mod:`.latency`: GPU time vs host time per call at small shapes (``decode_latency.json``), and
  the split-K / tile sweeps (``--mode splits|tune``).
- :mod:`.sweep`: any DecodeConfig grid on any shapes (the experiment behind a change of a default).
- :mod:`.fitted`: what permutations, TaDA means, OTT pools and PATS tiers cost (``decode_fitted.json``).
- :mod:`.groups`: what key / value groups of 32 (and 16) cost (``decode_groups.json``).
- :mod:`.combine`: the split merge alone (``combine_sweep.json``).
- :mod:`.e2e`: end to end on random-weight models (``e2e.json``, ``e2e_pats.json``, ``e2e_sliding.json``).
- :mod:`.host`: host time of eager decoding (``host.json``, its own ``--mode report``: ``host.md``).
- :mod:`.accuracy`: the kernel's error against the float32 reference (``accuracy.json``).
- :mod:`.search_curve`: searched recipes at several budgets against the presets (CPU;
  ``scripts/search_curve.sh``; moved out of the installed ``kvcalib.optimize`` in issue 52).
- :mod:`.huffman_bits`: Huffman bits per symbol on held-out K/V and their drift during generation
  (CPU; ``scripts/huffman_bits.sh``; moved out of the installed ``kvcalib.eval`` in issue 52).
- :mod:`.report`: the shared report step (``decode_attention.md``/``.png``, ``e2e.md``; ``--compare``
  for an A/B).

Shared pieces (shapes, timing, inputs, byte counts, bf16 baselines) are in :mod:`.common`.
Nothing in ``kvcalib`` or ``kvcalib_kernels`` imports this package.
"""
