"""Judge N recipe mutants (``tests/unit/recipe_mutants.py``) and print the verdicts and, for any
mutant that loaded but did not work, its failure class: the figures of ``docs/reliability.md``
outside pytest (the CI fuzz is ``tests/unit/test_recipe_fuzz.py``, which fails on the first such
mutant; this script counts them, e.g. on an older commit).

    PYTHONPATH=. python scripts/fuzz_recipes.py --mutants 10000

Mutant ``i`` is base ``i mod 6`` with ``1 + i mod 3`` edits drawn from seed ``i``. Edits reach the
provenance too; ``inspect`` runs on every mutant that loads (at the context its provenance
records), and ``with_a_provenance_edit`` counts the mutants that carry such an edit. A mutant
whose judging takes over ``--seconds-per-mutant`` (default 30) is a failure too (``MutantTimeout``:
before issue 54, ``inspect`` at a recorded context of 2^63 tokens never ended).
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=10000)
    parser.add_argument("--show", type=int, default=20, help="failure classes to print")
    parser.add_argument("--seconds-per-mutant", type=float, default=30.0)
    args = parser.parse_args()

    class MutantTimeout(Exception):
        pass

    def too_long(*_):
        raise MutantTimeout(f"judging took over {args.seconds_per_mutant:g} s")

    signal.signal(signal.SIGALRM, too_long)

    from tests.unit import recipe_mutants as rm

    torch.set_flush_denormal(True)  # the random tiny model's activations reach denormals
    model, info, stats = rm.tiny_setup()
    torch.set_num_threads(1)
    bases = rm.base_recipes(info, stats)
    pool = [(k, t) for b in bases.values() for k, t in b.tensors.items()]
    ids = torch.randint(0, 128, (1, rm.PROMPT_LEN + 1), generator=torch.Generator().manual_seed(1))
    names = sorted(bases)
    verdicts: collections.Counter = collections.Counter()
    informational: collections.Counter = collections.Counter()
    failures: collections.Counter = collections.Counter()
    example: dict[str, list[str]] = {}
    start = time.perf_counter()
    for seed in range(args.mutants):
        mutant = rm.mutate(bases[names[seed % len(names)]], seed, 1 + seed % 3, pool)
        edited = any(op.startswith("doc:") and ":provenance." in op for op in mutant.ops)
        signal.setitimer(signal.ITIMER_REAL, args.seconds_per_mutant)
        try:
            verdict = rm.judge(mutant, model, info, ids)
            verdicts[verdict] += 1
            informational[verdict if edited else "-"] += 1
        except Exception as err:  # noqa: BLE001  (loaded, then failed; or loading itself crashed or hung)
            # the class is the underlying error (judge wraps what fails after loading in an AssertionError)
            cause = (err.__cause__ or err) if isinstance(err, AssertionError) else err
            key = f"{type(cause).__name__}: {str(cause).splitlines()[0][:110] if str(cause) else ''}"
            # a RecipeError after loading is a refusal that came late (after a model would have
            # loaded); anything else is a crash or an accounting that disagrees with the cache
            late = type(cause).__name__ == "RecipeError"
            verdicts["loaded_then_refused_late" if late else "loaded_then_crashed_or_wrong"] += 1
            informational["failed" if edited else "-"] += 1
            failures[key] += 1
            example.setdefault(key, mutant.ops)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = time.perf_counter() - start
    edits = {f"with_a_provenance_edit_{k}": v for k, v in sorted(informational.items()) if k != "-"}
    print(json.dumps({"mutants": args.mutants, **dict(verdicts),
                      "with_a_provenance_edit": sum(v for k, v in informational.items() if k != "-"), **edits,
                      "seconds": round(seconds, 1)}, indent=2))
    for key, n in failures.most_common(args.show):
        print(f"{n:5d}  {key}\n       e.g. {example[key]}")


if __name__ == "__main__":
    main()
