"""Recipe fuzz (issue 36): at least 10,000 mutants of small fitted recipes per run, each either
refused with a RecipeError or loaded into something that works (``recipe_mutants.judge``:
memory accounting, inspect, and one decode step whose cache holds exactly the bytes counted).
Provenance and the methods' records in it are mutated too (issue 54): ``inspect`` runs on every
accepted mutant, never raises, and never reports a context or a window beyond the model's
positions.

Mutants are made in memory (document and tensors; ``Recipe.from_document`` is what loading a
file runs after parsing it), and every ``ON_DISK_EVERY``-th one also goes through a real file
and ``Recipe.load``, which must judge it the same. ``KVCALIB_FUZZ_MUTANTS`` changes the count;
``KVCALIB_FUZZ_FIGURES=PATH`` writes the counts as JSON (``docs/reliability.md`` quotes them).
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcalib.errors import RecipeError
from kvcalib.recipe import Recipe
from tests.unit import recipe_mutants as rm

MUTANTS = int(os.environ.get("KVCALIB_FUZZ_MUTANTS", "10000"))
ON_DISK_EVERY = 100


@pytest.fixture(scope="module")
def world():
    """The tiny model, its bases, the tensor pool mutants copy from, and the prompt. One intra-op
    thread: the tensors are tiny, and two threads on a shared 2-core machine wait on each other."""
    threads = torch.get_num_threads()
    torch.set_flush_denormal(True)  # the random tiny model's activations reach denormals (100x slower)
    try:
        model, info, stats = rm.tiny_setup()
        torch.set_num_threads(1)
        bases = rm.base_recipes(info, stats)
        pool = [(k, t) for b in bases.values() for k, t in b.tensors.items()]
        ids = torch.randint(0, 128, (1, rm.PROMPT_LEN + 1), generator=torch.Generator().manual_seed(1))
        yield model, info, bases, pool, ids
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)  # torch's default


def test_every_base_recipe_works(world):
    """The fuzz starts from recipes that load and work: each base is judged ``working``."""
    model, info, bases, _, ids = world
    for name, base in bases.items():
        mutant = rm.mutate(base, 0, 0, [])
        assert rm.judge(mutant, model, info, ids) == "working", name


def test_a_mutant_that_breaks_a_tensor_is_refused(world):
    """The judge can tell: a clip tensor with a row too many is refused, naming it."""
    model, info, bases, _, ids = world
    mutant = rm.mutate(bases["methods"], 0, 0, [])
    mutant.tensors["layers.1.v.clip"] = torch.cat([mutant.tensors["layers.1.v.clip"]] * 2)
    with pytest.raises(RecipeError, match=r"layers\.1\.v\.clip must have shape \(H, 1\) = \(2, 1\)"):
        Recipe.from_document(mutant.doc, mutant.tensors, "mutant")
    assert rm.judge(mutant, model, info, ids) == "refused"


def test_mutants_are_refused_or_work(world, tmp_path):
    model, info, bases, pool, ids = world
    names = sorted(bases)
    counts: collections.Counter = collections.Counter()
    on_disk: collections.Counter = collections.Counter()
    informational: collections.Counter = collections.Counter()  # verdicts of mutants with a provenance edit

    @settings(max_examples=MUTANTS, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**32 - 1), base=st.sampled_from(names), n_ops=st.integers(1, 3))
    def check(seed, base, n_ops):
        mutant = rm.mutate(bases[base], seed, n_ops, pool)
        verdict = rm.judge(mutant, model, info, ids)
        counts[verdict] += 1
        if any(op.startswith("doc:") and ":provenance." in op for op in mutant.ops):
            informational[verdict] += 1
        if sum(counts.values()) % ON_DISK_EVERY == 1:  # through a real file: the same verdict
            path = tmp_path / "mutant.safetensors"
            mutant.save(path)
            try:
                loaded = Recipe.load(path)
            except RecipeError:
                disk = "refused"
            else:
                disk = "loaded"
                assert Recipe.from_document(loaded.metadata(), loaded.tensors, "again").metadata() == loaded.metadata()
            assert (disk == "refused") == (verdict == "refused"), (mutant.ops, verdict, disk)
            on_disk[disk] += 1

    start = time.perf_counter()
    check()
    seconds = time.perf_counter() - start
    tried = sum(counts.values())
    assert tried >= MUTANTS
    # a fuzz whose mutants all die at the door, or all pass, tests little
    assert counts["refused"] > tried // 10 and counts["working"] > tried // 50, counts
    assert on_disk["refused"] and on_disk["loaded"], on_disk
    # the provenance edits reach inspect: many mutants carry one, and many of those load and work
    assert sum(informational.values()) > tried // 10 and informational["working"] > tried // 100, informational
    figures = {"mutants": tried, "refused_at_load": counts["refused"],
               "refused_for_the_model": counts["refused_for_model"], "loaded_and_working": counts["working"],
               "with_a_provenance_edit": sum(informational.values()),
               "with_a_provenance_edit_working": informational["working"],
               "failed": 0, "on_disk_sample": sum(on_disk.values()), "seconds": round(seconds, 1)}
    if os.environ.get("KVCALIB_FUZZ_FIGURES"):
        Path(os.environ["KVCALIB_FUZZ_FIGURES"]).write_text(json.dumps(figures, indent=2) + "\n")
