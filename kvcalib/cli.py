"""The ``kvcalib`` command line: thin Typer commands that build a config and call one function.

One error boundary (:func:`user_errors`, and :class:`_Group` for the parsing itself) decides what
reaches the terminal:

- a problem a user can fix -- a :class:`~kvcalib.errors.KvcalibError`, a bad flag, an OS error
  (a full or read-only disk, a file that vanished), a study storage that went away -- is one line
  on stderr naming it and the fix, exit code 2, no traceback;
- Ctrl-C is one line and exit code 130 (``kvcalib search`` names the exact command that resumes);
- anything else is a bug: its traceback, then one line asking to report it, exit code 1.

Checks that need only the arguments and the files run before any model loads
(:mod:`kvcalib.preflight`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shlex
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer
from typer.core import TyperGroup

try:  # typer >= 0.22 vendors click as typer._click; earlier ones run on click itself
    from typer._click import exceptions as _cx
    from typer._click.globals import get_current_context as _current_context
except ImportError:  # pragma: no cover
    from click import exceptions as _cx
    from click import get_current_context as _current_context

from kvcalib.errors import KvcalibError, StorageFailed, environment_error, interrupted
from kvcalib.io import WriteFailed
from kvcalib.paths import default_run_dir

_ABORT = (typer.Abort, getattr(_cx, "Abort", typer.Abort))  # Ctrl-C during parsing, in either click

EXIT_USER_ERROR = 2
EXIT_BUG = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
REPORT_BUG = ("this is a bug in kvcalib, not a problem with your input: please report it with the command line "
              "and the traceback above")


def _err(message: str) -> None:
    """One line on stderr: a message with line breaks is joined (one problem, one line)."""
    print("kvcalib: error: " + " ".join(str(message).split()), file=sys.stderr, flush=True)


class _Group(TyperGroup):
    """Typer's group with one-line usage errors: ``kvcalib: error: No such option: --sampels
    (see `kvcalib collect --help`)`` and exit code 2, instead of a framed usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _cx.NoArgsIsHelpError as err:  # `kvcalib` alone: the help, as before
            err.show()
            code = err.exit_code
        except _cx.UsageError as err:
            where = f" (see `{err.ctx.command_path} --help`)" if err.ctx is not None else ""
            _err(f"{err.format_message()}{where}")
            code = EXIT_USER_ERROR
        except _cx.ClickException as err:
            _err(err.format_message())
            code = err.exit_code
        except _ABORT:  # Ctrl-C while parsing
            _err("interrupted; nothing was written.")
            code = EXIT_INTERRUPTED
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    name="kvcalib",
    help="Offline calibration and precision search for KV-cache compression, and a runtime that "
    "decodes from the compressed cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    cls=_Group,
)


def user_errors(fn: Callable) -> Callable:
    """The error boundary of a command (module docstring): user and environment errors become
    one line and exit code 2, Ctrl-C exit code 130, anything else a traceback and a report line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, _cx.ClickException, *_ABORT):
            raise
        except KvcalibError as err:
            _err(str(err))
            raise typer.Exit(EXIT_USER_ERROR) from None
        except KeyboardInterrupt:
            _err("interrupted; nothing half-written was kept (outputs are written whole or not at all).")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as err:  # noqa: BLE001  (the boundary: sorted into environment or bug)
            if interrupted(err):  # Ctrl-C inside Optuna's trial bookkeeping comes out as its error
                _err("interrupted; nothing half-written was kept (outputs are written whole or not at all).")
                raise typer.Exit(EXIT_INTERRUPTED) from None
            line = environment_error(err)
            if line is not None:
                _err(line)
                raise typer.Exit(EXIT_USER_ERROR) from None
            traceback.print_exc()
            _err(REPORT_BUG)
            raise typer.Exit(EXIT_BUG) from None

    return wrapper


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """A rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right" if col not in ("name", "recipe", "model") else "left")
    for row in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row])
    Console(width=max(100, 12 * len(columns))).print(table)


# --------------------------------------------------------------------------- collect


@app.command(epilog="Examples:\n\n    kvcalib collect --out runs/smol\n\n    kvcalib collect --model qwen2.5-coder-0.5b --data longtext --samples 8 --seq-len 2048 --out runs/qwen")
@user_errors
def collect(
    model: str = typer.Option("smollm2-135m", help="Embedded alias, hub alias/id, local folder or .gguf file."),
    data: str = typer.Option("embedded", help="embedded | longtext | gsm8k-100 | hotpotqa | gsm8k | wikitext2 | a .txt/.jsonl/.parquet file | a hub dataset id."),
    split: str = typer.Option("calib", help="Split: calib|eval for embedded text, a dataset split name for hub datasets."),
    text_field: Optional[str] = typer.Option(None, help="Column holding the text in .jsonl/.parquet/hub datasets."),
    samples: int = typer.Option(32, help="Calibration samples of --seq-len tokens."),
    seq_len: int = typer.Option(512, help="Tokens per calibration sample."),
    batch_size: int = typer.Option(4, help="Samples per forward pass."),
    reservoir_blocks: int = typer.Option(8, help="Blocks of consecutive tokens kept per layer for calibration."),
    block_len: int = typer.Option(128, help="Tokens per reservoir block (>= the largest group size you will try)."),
    seed: int = typer.Option(0, help="Seed for sample order and reservoir sampling."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder to create (must not exist or be empty). Default: artifacts/runs/collect-<time>."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="bf16 | fp16 | fp32 (default: bf16 on GPU, fp32 on CPU)."),
    trust_remote_code: bool = typer.Option(False, help="Allow custom model code from the model's repository."),
) -> None:
    """Record K/V statistics (post-RoPE keys, as the cache stores them) on calibration text."""
    from kvcalib import preflight
    from kvcalib.collection import CollectConfig
    from kvcalib.collection import collect as run_collect

    config = CollectConfig(model=model, data=data, split=split, text_field=text_field, samples=samples,
                           seq_len=seq_len, batch_size=batch_size, reservoir_blocks=reservoir_blocks,
                           block_len=block_len, seed=seed, device=device, dtype=dtype,
                           trust_remote_code=trust_remote_code)
    out = out or default_run_dir("collect")
    _preflight_run(model, data, split, text_field, device, dtype)
    info = preflight.collect_inputs(model, data, split, text_field, seq_len)  # the text, --seq-len: before the model loads
    preflight.check_output_dir(out, "--out", preflight.stats_bytes(info, reservoir_blocks, block_len) if info else 0)
    result = run_collect(config, out)
    rows = [[r["layer"], r["k_absmax"], r["k_outlier_ratio"], r["k_std"], r["v_absmax"], r["v_std"]]
            for r in result.summary]
    print_table(
        f"{result.stats.model.name}: K/V statistics over {result.n_tokens} tokens "
        f"({result.n_samples} samples), {result.wall_seconds:.1f} s",
        ["layer", "key |max|", "key outlier ratio", "key std", "value |max|", "value std"], rows,
    )
    print(f"statistics: {result.out_dir / 'stats.safetensors'}")
    print(f"run record: {result.out_dir / 'run.json'}")


# --------------------------------------------------------------------------- search


@app.command(epilog="Examples:\n\n    kvcalib search --model smollm2-135m --data embedded --budget-bits 3.0 --out runs/smol-search\n\n    kvcalib search --out runs/smol-search --resume --trials 60\n\n    kvcalib search --out runs/w1 --storage postgresql://user@db/optuna --study smol   (one per machine)\n\n    kvcalib search --out runs/smol-2gpu --workers auto   (one worker per visible GPU)\n\n    kvcalib search --out runs/smol-front --objective pareto --trials 40   (the whole front; export any budget)\n\n    kvcalib search --out runs/smol-learned --rotate learned   (rotations fitted on the statistics where a layer rotates)")
@user_errors
def search(
    model: str = typer.Option("smollm2-135m", help="Embedded alias, hub alias/id, local folder or .gguf file."),
    data: str = typer.Option("embedded", help="Calibration text (--data of `kvcalib collect`); its eval split is used for the held-out proof."),
    text_field: Optional[str] = typer.Option(None, help="Column holding the text in .jsonl/.parquet/hub datasets."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (new, or one from `kvcalib collect`, or an interrupted search with --resume). Default: artifacts/runs/search-<time>."),
    budget_bits: float = typer.Option(3.0, help="Memory budget: effective bits per element at --context (bf16 = 16 on every model, so B bits is 16/B times smaller than the model's bf16 cache)."),
    trials: int = typer.Option(30, help="Finished trials the study should hold (all workers together)."),
    samples: int = typer.Option(8, help="Calibration windows for the statistics (collect phase)."),
    seq_len: int = typer.Option(256, help="Tokens per calibration window (statistics)."),
    score_samples: int = typer.Option(2, help="Held calibration windows the KL objective is computed on (after the collected ones)."),
    score_seq_len: Optional[int] = typer.Option(None, help="Tokens per scoring window [default: --context]. Given without --score-last, every position is scored (the short-context search of earlier versions: --score-seq-len 256)."),
    score_last: Optional[int] = typer.Option(None, help="Score only the last N positions of each scoring window, as decode steps after a compressed prompt of the rest [default: --context / 8 when the window is --context]."),
    copy_weight: Optional[float] = typer.Option(None, help="Weight W in [0, 1) of copy windows in the objective, KL = KL^(1-W) x (KL of copy windows)^W (a weighted geometric mean: a relative change counts the same in either part): one copy window per scoring window, its last tokens a copy of its start, so the --score-last decode steps must read far back through the compressed cache (a recipe cannot trade copying for perplexity). 0: none. [default: 0.5 with --score-last (the default long-context scoring), when N is at most half the window; 0 for windows scored at every position (--score-seq-len without --score-last, e.g. `make demo`), which have no decode steps to copy into]. Each trial scores twice the windows."),
    space: Optional[Path] = typer.Option(None, help="Search space file (JSON/YAML: bits, groups, windows, sinks, layer_methods, schedules)."),
    storage: Optional[str] = typer.Option(None, help="Optuna storage shared by workers on any machine: sqlite:///PATH (one machine), postgresql+psycopg://USER:PW@HOST/DB, or journal:PATH. Default: RUN_DIR/study.db (see docs/search-at-scale.md)."),
    study: str = typer.Option("kvcalib-search", help="Study name inside --storage."),
    objective: str = typer.Option("budget", help="budget: the lowest KL under --budget-bits; pareto: the whole KL vs effective-bits front in one study (multi-objective TPE), --budget-bits picking the recipe written and `kvcalib export RUN --budget-bits B` any other."),
    workers: str = typer.Option("1", help="Worker processes sharing the study from this command: N, or auto (one per visible GPU, each pinned to it; 1 without CUDA). Run folders RUN/worker-I. On CPU N processes share the same cores: no faster."),
    points_from: Optional[Path] = typer.Option(None, help="An earlier search's run folder (or its search.json): its finished trials' points are scored first, in its order, before the warm start's and the sampler's (e.g. a short-context search's points re-scored at long context)."),
    heartbeat: int = typer.Option(60, help="Seconds between a running trial's heartbeats in a database storage; a trial silent for 3 beats (its worker died) is retried by another worker."),
    resume: bool = typer.Option(False, help="Continue the interrupted study in --out: finished trials are kept, trials left unfinished by Ctrl-C or a kill run again."),
    sweep: bool = typer.Option(True, help="Per-layer sensitivity sweep to warm-start the study."),
    timeout: Optional[float] = typer.Option(None, help="Stop the trial phase after this many seconds."),
    context: Optional[int] = typer.Option(None, help="The context you deploy (tokens): the search scores windows of this length whose last tokens are decode steps, counts effective bits at it, and the recipe records it [default: min(8192, the model's maximum)]. On a CPU a short one (e.g. 1024) keeps a search to minutes."),
    eval_samples: int = typer.Option(4, help="Held-out perplexity sequences for the final proof."),
    eval_seq_len: Optional[int] = typer.Option(None, help="Tokens per held-out perplexity sequence [default: --context]."),
    no_eval: bool = typer.Option(False, "--no-eval", help="Skip the held-out proof."),
    finish: Optional[str] = typer.Option(None, help="Methods applied to the chosen recipe only, comma-separated, or 'none' (default: every such method: Huffman codebooks where coding shrinks a side)."),
    rotate: str = typer.Option("auto", help="The rotation the space's per-layer rotate switch fits: hadamard (a seed), learned (a (D, D) matrix per layer and side shared by the kv heads, fitted on the reservoir: about 1 point less perplexity at 3 bits, twice the search time on a GPU, ~1.5 s a side on a CPU; its bytes counted in the budget), learned-head or pca; auto: learned on a CUDA device, hadamard on a CPU. Recorded in the run: `kvcalib export RUN --trial N` rebuilds with it."),
    seed: int = typer.Option(0, help="Seed for data, sampler and calibration."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda."),
    dtype: Optional[str] = typer.Option(None, help="bf16 | fp16 | fp32."),
    check: bool = typer.Option(False, "--check", help="Check the options, the --space file, the data and the budget against the space's floor (no model loads, nothing is written), print what the search would run, and exit: seconds, before a long run on a GPU."),
) -> None:
    """Optuna per-layer {2,3,4,8}-bit search for the best recipe under a memory budget (every width
    of the default space decodes in the fused GPU kernel; a --space file may narrow or widen it)."""
    from kvcalib import preflight
    from kvcalib.optimize import SearchConfig
    from kvcalib.optimize.workers import search_any as run_search
    from kvcalib.optimize.provenance import command_line

    config = SearchConfig(model=model, data=data, text_field=text_field, out=out, samples=samples, seq_len=seq_len,
                          score_samples=score_samples, score_seq_len=score_seq_len, score_last=score_last,
                          copy_weight=copy_weight, trials=trials, budget_bits=budget_bits, context=context, score_at_context=True,
                          space=space, storage=storage, study=study, resume=resume, sweep=sweep, timeout=timeout,
                          seed=seed, eval=not no_eval, eval_samples=eval_samples, eval_seq_len=eval_seq_len,
                          device=device, dtype=dtype, command=command_line(), objective=objective,
                          workers=_parse_workers(workers), heartbeat=heartbeat, points_from=points_from, rotate=rotate,
                          chosen_methods=None if finish is None else tuple(
                              m.strip() for m in finish.split(",") if m.strip() and m.strip() != "none"))
    config.out = Path(config.out) if config.out is not None else default_run_dir("search")
    _preflight_run(model, data, "calib", text_field, device, dtype)
    _search_context_preflight(config)
    has_stats = (config.out / "stats.safetensors").is_file()  # a collect folder, or a search to resume
    info = preflight.search_inputs(config, collects=not has_stats)  # the text, lengths, budget: before the model loads
    info = None if has_stats else info
    stats = preflight.stats_bytes(info, config.reservoir_blocks, min(config.block_len, seq_len)) if info else 0
    # a --workers run folder (workers.json, worker-N/): the workers module says what it holds and how to go on
    workers_run = (config.out / "workers.json").is_file()
    preflight.check_output_dir(config.out, "--out", stats + SEARCH_OUTPUT_BYTES,
                               may_exist=has_stats or resume or workers_run)
    if check:
        print(_search_check_line(config, preflight.model_geometry(config.model)))
        return
    ctx = _current_context(silent=True)
    try:
        with _trial_failures_reported_once():
            result = run_search(config)
    except KeyboardInterrupt:
        _err(f"interrupted; {_search_left(config, ctx)}")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except StorageFailed as err:  # what failed, then the exact command that goes on
        _err(f"{err.problem}. {_search_left(config, ctx, failed=True)}")
        raise typer.Exit(EXIT_USER_ERROR) from None
    except WriteFailed as err:  # a run-folder file its disk could not take (kvcalib.io): the same
        _err(f"{err}. {_search_left(config, ctx, failed=True)}")
        raise typer.Exit(EXIT_USER_ERROR) from None
    except KvcalibError:
        raise
    except Exception as err:  # noqa: BLE001  (a storage or disk that failed mid-search; else a bug)
        if interrupted(err):  # Ctrl-C that landed inside Optuna's trial bookkeeping
            _err(f"interrupted; {_search_left(config, ctx)}")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        from kvcalib.optimize.guards import storage_lost

        line = environment_error(err) or storage_lost(config)
        if line is None:
            raise
        _err(f"{line}. {_search_left(config, ctx, failed=True)}")
        raise typer.Exit(EXIT_USER_ERROR) from None
    if result.table:
        print(result.table)
    if result.recipe_path is not None:
        parts = (f" (ordinary {result.kl_ordinary:.4g}, copy {result.kl_copy:.4g})"
                 if result.kl_copy is not None and result.kl_ordinary is not None else "")
        print(f"chosen: trial {result.chosen_trial}, KL {result.kl:.4g}{parts} at {result.effective_bits:.3f} effective bits, "
              f"{16.0 / result.effective_bits:.2f}x smaller than bf16 (budget {budget_bits:g}, floor "
              f"{result.floor_bits:.3f}); {result.n_trials} trials, {result.seconds:.0f} s")
        print(f"recipe: {result.recipe_path}")
    else:
        print(f"no finished trial is within {budget_bits:g} bits yet: run more trials with --resume")
    if objective == "pareto":
        print(f"front: {len(result.pareto)} trial(s); any budget: kvcalib export {result.run_dir} --budget-bits B -o R")
    print(f"report: {result.report_path}")


def _search_check_line(config: Any, geometry: dict | None) -> str:
    """``kvcalib search --check``'s summary: what the search would run, with the space's floor where
    the model's geometry is known without loading it."""
    space = config.space
    floor = ""
    info = (geometry or {}).get("info")
    if info is not None:
        from kvcalib.optimize.study import floor_bits
        from kvcalib.preflight import bits_counter

        floor = f" (the space's floor: {floor_bits(bits_counter(config, info), space):.3f})"
    methods = ",".join(space.layer_methods) or "none"
    return (f"search check passed: {config.model} on {config.data}, context {config.context}, budget "
            f"{config.budget_bits:g} bits{floor}; bits {list(space.bits)}, groups {list(space.groups)}, windows "
            f"{list(space.windows)}, sinks {list(space.sinks)}, layer methods {methods}, rotation {config.rotate}; "
            f"{config.trials} trials into {config.out}. Nothing was run or written.")


def _search_context_preflight(config: Any) -> None:
    """Before the model loads: the default --context from the model's config where it is on this
    machine, and a --context beyond the model's maximum refused."""
    from kvcalib import preflight

    info = preflight.model_info_offline(config.model)
    if info is not None:
        if config.context is not None and info.max_positions and config.context > info.max_positions:
            raise KvcalibError(f"--context {config.context} is beyond {info.name}'s maximum of {info.max_positions} "
                               f"tokens: pass --context {info.max_positions} or less.")
        config.resolve_context(info.max_positions)


SEARCH_OUTPUT_BYTES = 16 << 20  # study.db, search.json, plots, report and recipe of a search (well above)


def _preflight_run(model: str, data: str, split: str, text_field: Optional[str], device: Optional[str],
                   dtype: Optional[str]) -> None:
    """What ``collect`` and ``search`` check first: the model names something (alias, folder,
    file, hub id), the text source is of a known kind, the device and dtype are usable (the text
    itself and the lengths: :func:`kvcalib.preflight.collect_inputs` / ``search_inputs``)."""
    from kvcalib import preflight
    from kvcalib.data import resolve_text_source
    from kvcalib.models import resolve_model_source

    resolve_model_source(model)
    resolve_text_source(data, split, text_field)
    preflight.check_device(device)
    preflight.check_dtype(dtype)


def rerun_command(ctx: Any, **set_options: Any) -> str:
    """The command line that runs the current command again: every option given on the command
    line (its value as parsed), then ``set_options`` (``out=Path(...)``, ``resume=True``) in place
    of those options' given values. Flags print as ``--flag`` / ``--no-flag``."""
    parts = ["kvcalib", ctx.info_name]
    given = []
    for param in ctx.command.params:
        if getattr(param, "param_type_name", "") != "option" or param.name in set_options:
            continue
        source = ctx.get_parameter_source(param.name)
        if source is None or source.name in ("DEFAULT", "DEFAULT_MAP"):
            continue
        given.append((param, ctx.params.get(param.name)))
    given += [(next(p for p in ctx.command.params if p.name == name), value) for name, value in set_options.items()]
    for param, value in given:
        long = next((o for o in param.opts if o.startswith("--")), param.opts[0])
        if getattr(param, "is_flag", False) or isinstance(value, bool):
            if value:
                parts.append(long)
            elif param.secondary_opts:
                parts.append(param.secondary_opts[0])
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            parts += [long, str(item)]
    return shlex.join(parts)


def _search_left(config: Any, ctx: Any, failed: bool = False) -> str:
    """What an interrupted search left in its run folder (``failed``: what a search stopped by its
    disk or storage left, once that is fixed), and the command that goes on from there: the same
    options, ``--out`` named, and ``--resume`` where a study was started."""
    out = Path(config.out)
    if config.storage is None:
        started = (out / "study.db").is_file()
    else:  # a shared storage: the study is there once this worker got past the statistics
        started = (out / "stats.safetensors").is_file()
    if ctx is None:
        return f"the run folder is {out}"
    if started and failed:
        return (f"Once that is fixed, the study (its finished trials are kept where the storage is intact) goes on "
                f"with: {rerun_command(ctx, out=out, resume=True)}")
    if started:
        return (f"the study keeps every finished trial, and unfinished ones run again with: "
                f"{rerun_command(ctx, out=out, resume=True)}")
    if (out / "stats.safetensors").is_file():
        return (f"the statistics in {out} are kept; the search starts from them with: "
                f"{rerun_command(ctx, out=out, resume=False)}")
    return f"nothing was written; run it again with: {rerun_command(ctx, out=out, resume=False)}"


class _DropTrialFailure(logging.Filter):
    """Optuna logs a failed trial (with its traceback) before re-raising its error; the error
    boundary reports that error once (one line, or the traceback of a bug), so the record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Trial ") and " failed with " in message)


@contextlib.contextmanager
def _trial_failures_reported_once() -> Iterator[None]:
    """:class:`_DropTrialFailure` on Optuna's optimize logger while a search runs."""
    drop, logger = _DropTrialFailure(), logging.getLogger("optuna.study._optimize")
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _parse_workers(text: str) -> int | str:
    """``--workers``: ``auto`` or a positive integer."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise KvcalibError(f"--workers {text!r} must be auto or an integer >= 1 (worker processes sharing the study).")
    return value


def _with_method_flags(fn: Callable) -> Callable:
    """Add every registered method's ``kvcalib export`` flags (:attr:`Method.flags`) to ``fn``'s
    options: the command passes them on as ``**method_flags``, so a new method's flag appears
    without touching this file."""
    import inspect

    from kvcalib.export import method_flags

    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    for flag_name, (_, flag) in method_flags().items():
        if flag.kind is bool:
            option = typer.Option(False, flag.option, help=flag.help)
            annotation: Any = bool
        else:
            option = typer.Option(None, flag.option, help=flag.help)
            annotation = Optional[flag.kind]
        params.append(inspect.Parameter(flag_name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=annotation))
    fn.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return fn


@app.command(epilog="Examples:\n\n    kvcalib export runs/smol -o smol-k2v2.safetensors --bits k2v2 --group 32 --window 128\n\n    kvcalib export runs/smol-search --budget-bits 3.5 -o smol-3.5.safetensors\n\n    kvcalib export runs/smol -o smol-all.safetensors --bits k4v2 --reorder --clip --center\n\n    kvcalib export runs/smol -o smol-ott-pats.safetensors --bits k8v8 --outliers 3 --schedule middle-heavy")
@_with_method_flags
@user_errors
def export(
    run_dir: Path = typer.Argument(..., help="Run folder written by `kvcalib collect` (holds stats.safetensors)."),
    out: Path = typer.Option(..., "-o", "--out", help="Recipe file to write (.safetensors)."),
    bits: Optional[str] = typer.Option(None, help="Key and value bits, k<2|3|4|8|16>v<2|3|4|8|16> (default k2v2)."),
    group: int = typer.Option(32, help="Group size: tokens per key group, channels per value group."),
    window: Optional[int] = typer.Option(None, help="Recent tokens kept in full precision (0 or >= group; default 128, 0 with --schedule new-heavy)."),
    sinks: Optional[int] = typer.Option(None, help="First tokens kept in full precision (attention sinks; default 0, 4 with --schedule middle-heavy/new-heavy)."),
    name: Optional[str] = typer.Option(None, help="Recipe name (default from the settings)."),
    seed: int = typer.Option(0, help="Seed for KMeans."),
    force: bool = typer.Option(False, help="Replace an existing output file."),
    budget_bits: Optional[float] = typer.Option(None, help="From a search run folder: the lowest-KL trial at or under this many effective bits."),
    trial: Optional[int] = typer.Option(None, help="From a search run folder: this trial's recipe."),
    format: str = typer.Option("kvcalib", "--format", help="kvcalib (a recipe file) or compressed-tensors (FP8 k_scale/v_scale folder for vLLM/SGLang)."),
    model: Optional[str] = typer.Option(None, help="compressed-tensors: the model folder whose config.json to extend (default: from the run)."),
    per_head: bool = typer.Option(False, help="compressed-tensors: per-head scales (vLLM with Flash Attention only)."),
    **method_flags: Any,
) -> None:
    """Build a fitted recipe from collected statistics, with the methods given as flags; or pick
    a point of a `kvcalib search` run with --budget-bits / --trial (no new search)."""
    from kvcalib.export import ExportConfig, export_fp8_scales, export_recipe, export_search_point

    if format not in ("kvcalib", "compressed-tensors"):
        raise KvcalibError(f"--format {format!r} is not known: use kvcalib or compressed-tensors.")
    given = sorted(name_ for name_, val in method_flags.items() if val is not None and val is not False)
    searched_point = budget_bits is not None or trial is not None
    if format == "compressed-tensors":
        written = export_fp8_scales(run_dir, out, bits=bits, methods=given, searched_point=searched_point,
                                    model=model, per_head=per_head, force=force)
        print(f"wrote FP8 KV-cache scales and config.json to {written}")
    elif searched_point:
        rotate = method_flags.get("rotate")
        recipe, record = export_search_point(run_dir, out, budget_bits=budget_bits, trial=trial,
                                             methods=[g for g in given if g != "rotate"], force=force, rotate=rotate)
        at = recipe.provenance.get("context", 4096)
        if rotate is None:
            kind = recipe.provenance.get("rotate", "hadamard")  # the search's (--rotate), rebuilt as it fitted them
            print(f"wrote {out}: trial {record['number']} of the search, KL {record['kl']:.4g}, "
                  f"{record['effective_bits']:.3f} effective bits at {at}"
                  + ("" if kind == "hadamard" else f", {kind} rotations as searched"))
        else:  # the search's KL is of its own rotations: the refitted recipe is not scored here
            print(f"wrote {out}: trial {record['number']} of the search (KL {record['kl']:.4g} with its own "
                  f"rotations, {record['searched_bits']:.3f} bits), rotations refitted as {rotate}: "
                  f"{record['effective_bits']:.3f} effective bits at {at}; score it with kvcalib eval")
            if not any(k.endswith((".rotation", ".rotate")) for k in recipe.tensors):
                print("note: this point rotates no layer (under --budget-bits the better points had no room for "
                      "their matrices): pick one with --trial, or search at a lower budget and refit that")
    else:
        config = ExportConfig(bits=bits or "k2v2", group=group, window=window, sinks=sinks, name=name, seed=seed,
                              **method_flags)
        recipe = export_recipe(run_dir, out, config, force=force)
        mem = recipe.memory(recipe.model, 4096)
        print(f"wrote {out}: recipe {recipe.name} for {recipe.model.name}, {mem.effective_bits:.3f} effective bits "
              "at 4096")


@app.command(epilog="Examples:\n\n    kvcalib run --recipe kivi-2 --prompt 'The capital of France is'\n\n    kvcalib run --recipe runs/smol/recipe.safetensors --prompt-file prompt.txt --max-new-tokens 128 --compare\n\n    kvcalib run --recipe kivi-4 --prompt 'Once upon a time' --temperature 0.8 --top-p 0.95 --seed 0")
@user_errors
def run(
    recipe: str = typer.Option(..., help="Recipe file or preset name (fp16, kivi-2, kivi-4, pertoken-4)."),
    model: Optional[str] = typer.Option(None, help="Model (default: the one the recipe was fitted for, else smollm2-135m)."),
    prompt: Optional[str] = typer.Option(None, help="Prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, help="Read the prompt from this file."),
    max_new_tokens: int = typer.Option(64, help="Tokens to generate."),
    compare: bool = typer.Option(False, help="Also generate with full precision and report token agreement "
                                 "(a measure of the cache with greedy decoding; with sampling, mostly of chance)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    trust_remote_code: bool = typer.Option(False, help="Allow custom model code."),
    cuda_graph: bool = typer.Option(False, "--cuda-graph", help="CUDA only: replay each decode step of the "
                                    "compressed cache from a CUDA graph (no per-kernel launch cost; no streaming)."),
    temperature: float = typer.Option(0.0, help="0 decodes greedily; > 0 samples with this temperature."),
    top_k: int = typer.Option(0, help="Sample among the k most likely tokens (0: off; needs --temperature > 0)."),
    top_p: float = typer.Option(1.0, help="Sample among the most likely tokens holding this probability, in "
                                "(0, 1] (1: off; needs --temperature > 0)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling: the same seed repeats a run (--cuda-graph "
                                       "and eager runs draw differently)."),
) -> None:
    """Generate with the compressed cache; print KV bytes, effective bits and tokens/s."""
    import dataclasses
    import random

    from kvcalib.models import DEFAULT_MODEL, default_device, load_model
    from kvcalib.recipe import resolve_recipe
    from kvcalib.runtime.generate import generate, token_agreement, too_short_note
    from kvcalib.runtime.sampling import sampling_from_flags

    from kvcalib import preflight

    if (prompt is None) == (prompt_file is None):
        raise KvcalibError("pass exactly one of --prompt TEXT or --prompt-file FILE.")
    if max_new_tokens < 1:
        raise KvcalibError(f"--max-new-tokens {max_new_tokens} generates nothing: pass 1 or more.")
    preflight.check_device(device)
    if prompt_file is not None:
        try:
            prompt = prompt_file.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise KvcalibError(f"cannot read --prompt-file {prompt_file}: {err.strerror if hasattr(err, 'strerror') else err}.") from None
    if not prompt or not prompt.strip():
        raise KvcalibError("the prompt is empty: pass some text with --prompt or --prompt-file.")
    sampling = sampling_from_flags(temperature, top_k, top_p, seed)
    if sampling is not None and compare and sampling.seed is None:
        # one seed for both runs, so that they draw from the same stream
        sampling = dataclasses.replace(sampling, seed=random.randrange(2**31))
    rec = resolve_recipe(recipe)
    if cuda_graph and not (device or default_device()).startswith("cuda"):
        raise KvcalibError("--cuda-graph needs a CUDA device (none here): leave --cuda-graph out.")
    model_name = model or (rec.model.name if rec.model else DEFAULT_MODEL)
    preflight.check_recipe_model(rec, model_name)  # another model's recipe: refused before anything is fetched
    preflight.run_inputs(model_name, max_new_tokens)
    loaded = load_model(model_name, device=device, trust_remote_code=trust_remote_code)
    rec.check_model(loaded.info)
    _beyond_searched([rec], len(loaded.tokenizer(prompt)["input_ids"]) + max_new_tokens)
    print(f"[{rec.name}] ", end="", flush=True)
    result = generate(loaded, prompt, rec, max_new_tokens, stream=True, cuda_graph=cuda_graph, sampling=sampling)

    def row(r: Any, bits16: float) -> list[Any]:
        first = "-" if r.first_token_seconds is None else round(r.first_token_seconds, 3)
        return [r.label, len(r.new_tokens), first, r.decode_tokens_per_second, r.tokens_per_second, r.kv_bytes,
                r.kv_bytes_allocated, r.effective_bits, bits16]

    rows = [row(result, result.effective_bits_16)]
    if compare:
        print("[full precision] ", end="", flush=True)
        ref = generate(loaded, prompt, None, max_new_tokens, stream=True, sampling=sampling)
        rows.append(row(ref, 16.0))
    print_table(f"{loaded.info.name}: generation ({result.prompt_tokens}-token prompt)",
                ["name", "new tokens", "first token s", "decode tokens/s", "tokens/s (all)", "KV bytes",
                 "KV bytes allocated", "bits/elem (held)", "bits/elem (16-bit accounting)"], rows)
    print("first token s: the prefill, and on first use the Triton kernels' compilation (Triton keeps them "
          "on disk; later runs skip it); decode tokens/s: the tokens after the first (warm); KV bytes: the "
          "tokens held (what bits/elem divides); allocated: every byte of the cache's tensors (capacity "
          "reserved past the live tokens and the recipe's fitted tensors included)"
          + ("; --cuda-graph runs without per-token times: tokens/s (all) counts its captures" if cuda_graph else ""))
    note = too_short_note(result, rec)
    if note:
        print(note)
    if compare:
        line = f"token agreement with full precision: {token_agreement(result.new_tokens, ref.new_tokens):.3f}"
        if sampling is not None:
            why = ("--cuda-graph and the full-precision run draw differently" if cuda_graph
                   else "past the first token that differs")
            line += f" (sampled, seed {sampling.seed}: {why}, agreement is mostly chance; --temperature 0 measures the cache)"
        print(line)


@app.command(name="eval", epilog="Examples:\n\n    kvcalib eval --preset fp16 --preset kivi-4 --preset kivi-2 --preset pertoken-4\n\n    kvcalib eval --model qwen2.5-coder-0.5b --recipe runs/qwen/recipe.safetensors --preset kivi-2 --metrics ppl,passkey --json out.json\n\n    kvcalib eval --preset kivi-2 --data plays --metrics ppl,copy --ppl-seq-len 8192 --ppl-samples 8 --decode --device cuda\n\n    kvcalib eval --preset kivi-2 --tasks niah_single_1,niah_multikey_2,ruler_vt --context-len 8192 --limit 50 --output-path runs/ruler --device cuda")
@user_errors
def eval_(
    model: str = typer.Option("smollm2-135m", help="Model to evaluate on."),
    recipe: list[str] = typer.Option([], "--recipe", help="Recipe file (repeatable)."),
    preset: list[str] = typer.Option([], "--preset", help="Preset name (repeatable)."),
    data: str = typer.Option("embedded", help="Text source; only its evaluation split is read (longtext: the Britannica article; plays: eight tragedies, held out)."),
    metrics: Optional[str] = typer.Option(None, help="Comma-separated subset of ppl,agreement,passkey,copy,gsm8k [default: ppl,agreement,passkey; none with --tasks]."),
    tasks: Optional[str] = typer.Option(None, help="lm-evaluation-harness tasks, comma-separated (e.g. the offline RULER tasks niah_single_1,niah_multikey_2,niah_multikey_3,ruler_vt,ruler_cwe,ruler_fwe), run at --context-len tokens through each recipe and full precision; needs `pip install \"kvcalib[eval]\"`."),
    limit: int = typer.Option(50, help="--tasks: samples per task."),
    max_gen_toks: Optional[int] = typer.Option(None, help="--tasks: cap on generated tokens per sample (default: each task's own)."),
    output_path: Optional[Path] = typer.Option(None, help="--tasks: folder for lm-eval's own result and sample files (one subfolder per recipe)."),
    context_len: int = typer.Option(4096, help="Context length for effective bits and KV bytes, and the sequence length of --tasks."),
    ppl_samples: int = typer.Option(16, help="Held-out windows for perplexity (a 95% bootstrap interval over them is reported)."),
    ppl_seq_len: int = typer.Option(1024, help="Tokens per perplexity window."),
    ppl_overlap: float = typer.Option(0.0, help="When the text holds fewer disjoint windows than --ppl-samples, let neighbouring windows share up to this fraction of their tokens (0: refuse)."),
    copy_len: int = typer.Option(3000, help="copy: tokens per passage (each sequence holds it twice)."),
    copy_tail: int = typer.Option(256, help="copy: scored tokens at the end of the second copy."),
    copy_samples: int = typer.Option(4, help="copy: passages."),
    decode: bool = typer.Option(False, "--decode", help="copy: also score through a real token-by-token decode with the compressed cache (slow on CPU)."),
    agreement_prompts: int = typer.Option(8, help="Prompts for greedy token agreement."),
    agreement_tokens: int = typer.Option(64, help="Generated tokens per agreement prompt."),
    passkey_lengths: str = typer.Option("512,1024,2048", help="Passkey context lengths (tokens), comma-separated."),
    passkey_depths: str = typer.Option("0.1,0.3,0.5,0.7,0.9", help="Passkey depths (0 = start of the context, 1 = end), comma-separated."),
    passkey_trials: int = typer.Option(4, help="Passkey trials per (length, depth)."),
    batch_size: int = typer.Option(2, help="Sequences per forward (lower it for long contexts)."),
    gsm8k_limit: int = typer.Option(100, help="gsm8k-100 problems to score."),
    seed: int = typer.Option(0, help="Seed for sampling texts and passkeys."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write one JSON object per recipe (with --tasks: per recipe and task) here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of perplexity vs full precision by token position here."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda."),
    dtype: Optional[str] = typer.Option(None, help="bf16 | fp16 | fp32 (default: bf16 on CUDA, fp32 on CPU)."),
) -> None:
    """Evaluate recipes side by side on identical inputs: perplexity (overall, by token position,
    with a bootstrap interval), copy, agreement, passkey, gsm8k, memory; or lm-eval tasks (RULER)."""
    from kvcalib import preflight
    from kvcalib.eval.harness import EvalConfig, evaluate, results_table_columns, results_table_rows, write_json
    from kvcalib.models import resolve_model_source
    from kvcalib.recipe import resolve_recipe

    try:
        lengths = tuple(int(x) for x in passkey_lengths.split(",") if x.strip())
    except ValueError:
        raise KvcalibError(f"--passkey-lengths {passkey_lengths!r} must be comma-separated integers.") from None
    try:
        depths = tuple(float(x) for x in passkey_depths.split(",") if x.strip())
    except ValueError:
        raise KvcalibError(f"--passkey-depths {passkey_depths!r} must be comma-separated numbers in [0, 1].") from None
    if plot is not None and plot.suffix.lower() != ".png":
        raise KvcalibError(f"--plot {plot} must name a .png file.")
    if tasks is not None:
        if metrics is not None:
            raise KvcalibError("--tasks runs lm-eval tasks and --metrics kvcalib's own metrics: run them as two "
                               "commands (their --json files hold different rows).")
        _eval_tasks(model, [*recipe, *preset], tasks, context_len, limit, max_gen_toks, output_path, batch_size, seed,
                    json_out, device, dtype)
        return
    config = EvalConfig(model=model, recipes=[*recipe, *preset], data=data, metrics=metrics or "ppl,agreement,passkey",
                        context_len=context_len, ppl_samples=ppl_samples, ppl_seq_len=ppl_seq_len,
                        ppl_overlap=ppl_overlap, copy_len=copy_len, copy_tail=copy_tail, copy_samples=copy_samples,
                        copy_decode=decode,
                        agreement_prompts=agreement_prompts, agreement_tokens=agreement_tokens,
                        passkey_lengths=lengths, passkey_depths=depths, passkey_trials=passkey_trials,
                        gsm8k_limit=gsm8k_limit, seed=seed, batch_size=batch_size, device=device, dtype=dtype)
    resolve_model_source(model)
    preflight.eval_inputs(config)  # the text and the lengths against the model's positions
    preflight.check_device(device)
    if json_out is not None:  # written after the evaluation: checked before it
        preflight.check_output_file(json_out, "--json")
        preflight.check_output_file(json_out.with_name(f"{json_out.stem}.config.json"), "--json (its .config.json)")
    if plot is not None:
        preflight.check_output_file(plot, "--plot")
    resolved = [resolve_recipe(spec) for spec in config.recipes]
    for rec in resolved:  # every recipe against the model, from its metadata, before the model loads
        preflight.check_recipe_model(rec, model)
    _check_context(model, config.max_tokens(), "the evaluation's longest sequence (--ppl-seq-len, --copy-len, "
                   "--passkey-lengths, agreement)")
    _beyond_searched(resolved, max(config.max_tokens(), context_len))
    results = evaluate(config)
    print_table(f"{model}: held-out evaluation (effective bits and KV bytes per sequence at {context_len})",
                results_table_columns(results), results_table_rows(results))
    if json_out is not None:
        write_json(results, json_out, config)
        print(f"results: {json_out}")
    if plot is not None and any(r.ppl_by_position for r in results):
        from kvcalib.eval.harness import plot_positions

        plot_positions(results, plot, f"{model}: perplexity by position, {ppl_seq_len}-token windows")
        print(f"plot: {plot}")


def _check_context(model: str, tokens: int, what: str) -> None:
    """Refuse ``tokens`` beyond the model's maximum before it loads, where its config is on this
    machine (else :func:`kvcalib.eval.harness.evaluate` refuses it after loading)."""
    from kvcalib import preflight

    info = preflight.model_info_offline(model)
    if info is not None and info.max_positions and tokens > info.max_positions:
        raise KvcalibError(f"{what} is {tokens} tokens, beyond {info.name}'s maximum of {info.max_positions}: "
                           f"pass {info.max_positions} or less.")


def _beyond_searched(recipes: list[Any], context: int) -> None:
    """Say once per recipe when it is used far beyond the context it was searched for."""
    from kvcalib.recipe import beyond_searched_note

    for rec in recipes:
        note = beyond_searched_note(rec, context)
        if note:
            print(note, file=sys.stderr)


def _eval_tasks(model: str, recipes: list[str], tasks: str, context_len: int, limit: int, max_gen_toks: Optional[int],
                output_path: Optional[Path], batch_size: int, seed: int, json_out: Optional[Path],
                device: Optional[str], dtype: Optional[str]) -> None:
    """``kvcalib eval --tasks``: lm-eval tasks through each recipe beside full precision."""
    from kvcalib import preflight
    from kvcalib.eval.tasks import TaskConfig, check_tasks, run_tasks
    from kvcalib.io import write_json_atomic
    from kvcalib.models import resolve_model_source
    from kvcalib.recipe import resolve_recipe

    config = TaskConfig(model=model, recipes=recipes, tasks=tuple(tasks.split(",")), context=context_len, limit=limit,
                        max_gen_toks=max_gen_toks, batch_size=batch_size, seed=seed, output_path=output_path,
                        device=device, dtype=dtype)
    resolve_model_source(model)
    preflight.check_device(device)
    if json_out is not None:
        preflight.check_output_file(json_out, "--json")
    if output_path is not None:
        preflight.check_output_dir(output_path, "--output-path", may_exist=True)
    resolved = [resolve_recipe(spec) for spec in recipes]
    for rec in resolved:
        preflight.check_recipe_model(rec, model)
    check_tasks(config.tasks)  # lm-eval installed, every task known: before the model loads
    _check_context(model, context_len, "--context-len")
    _beyond_searched(resolved, context_len)
    rows = run_tasks(config)
    print_table(f"{model}: lm-eval tasks at {context_len} tokens ({limit} samples per task)",
                ["task", "recipe", "eff. bits", "score", "score fp", "n"],
                [[r.task, r.name, round(r.effective_bits, 3), r.score, r.score_fp, r.n] for r in rows])
    if json_out is not None:
        write_json_atomic(json_out, [r.to_dict() for r in rows])
        print(f"results: {json_out}")
    if output_path is not None:
        print(f"lm-eval output files: {output_path}")


@app.command(epilog="Examples:\n\n    kvcalib inspect kivi-2\n\n    kvcalib inspect runs/smol/recipe.safetensors --json\n\n    kvcalib inspect runs/smol/searched.safetensors --diff kivi-2")
@user_errors
def inspect(
    recipe: str = typer.Argument(..., help="Recipe file or preset name."),
    diff: Optional[str] = typer.Option(None, "--diff", metavar="OTHER", help="Compare with this recipe (file or preset) layer by layer; only differing layers are shown."),
    model: Optional[str] = typer.Option(None, help="Model geometry for a preset's memory numbers (default smollm2-135m)."),
    context: Optional[int] = typer.Option(None, help="Context length for effective bits and bytes [default: the "
                                          "context the recipe was searched for, else 4096]."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Show a recipe's per-layer configuration, memory at a context length, and where it came from
    (model, data, samples, search budget, objective, held-out result: whatever it records)."""
    if diff is not None:
        _inspect_diff(recipe, diff, model, context, as_json)
        return
    from kvcalib.inspect import inspect_recipe

    report = inspect_recipe(recipe, model=model, context=context)
    context = report["context"]
    if as_json:
        print(json.dumps(report, indent=2))
        return
    rows = [[r["layer"], r["k_bits"], r["v_bits"], r["k_axis"], r["k_group"], r["v_group"], r["window"],
             r["sinks"], r["effective_bits"], "kernel" if r["decode"] == "kernel" else "reference"]
            for r in report["layers"]]
    print_table(f"recipe {report['name']} for {report['model']['name']} (context {context})",
                ["layer", "K bits", "V bits", "K axis", "K group", "V group", "window", "sinks",
                 "eff. bits", "GPU decode"], rows)
    from kvcalib.inspect import decode_summary

    print(decode_summary(report["layers"]))
    mem = report["memory"]
    print(f"effective bits per element at {context}: {mem['effective_bits']:.3f} (bf16 = 16.0); compression vs "
          f"the model's bf16 cache ({mem['bf16_bytes']:,.0f} bytes): {mem['compression_ratio']:.2f}x; "
          f"KV bytes per sequence: {mem['total_bytes']:,.0f}")
    if mem["held_tokens"] != len(report["layers"]) * context:
        print(f"sliding-window layers hold only their window: elements counted over the {mem['held_tokens']:,} "
              f"tokens the {len(report['layers'])} layers hold, not {len(report['layers'])} x {context}")
    if report["context_note"]:
        print(f"note: {report['context_note']}")
    if report["recorded_bits_factor"] != 1.0:
        print(f"note: the bits this recipe records (provenance) were counted the old way ({report['recorded_accounting']}: "
              f"every layer at {context} tokens); multiply them by {report['recorded_bits_factor']:.4f} to compare")
    print("bytes by component: " + ", ".join(f"{k} {v:,.0f}" for k, v in mem["components"].items()))
    from kvcalib.inspect import method_lines

    for line in method_lines(report):
        print(line)
    if report["tensors"]:
        print(f"fitted tensors: {len(report['tensors'])}")
    if report["searched_context"]:
        from kvcalib.recipe import BEYOND_FACTOR

        print(f"searched for: {report['searched_context']}-token contexts (kvcalib run/eval say so when it is used "
              f"beyond {BEYOND_FACTOR * report['searched_context']})")
    if report["origin"]:
        print("made from: " + "; ".join(f"{k}: {v}" for k, v in report["origin"]))
    else:
        print("made from: no provenance recorded (a preset or a hand-written recipe)")


def _inspect_diff(a: str, b: str, model: Optional[str], context: Optional[int], as_json: bool) -> None:
    """``kvcalib inspect A --diff B``: differing layers as a table, then a summary."""
    from kvcalib.inspect import diff_recipes

    report = diff_recipes(a, b, model=model, context=context)
    if as_json:
        print(json.dumps(report, indent=2))
        return
    na, nb = report["a"]["name"], report["b"]["name"]

    def pair(v: Any) -> str:
        if isinstance(v[0], list):  # fitted tensors present
            return f"{','.join(v[0]) or '-'} -> {','.join(v[1]) or '-'}"
        return f"{v[0]} -> {v[1]}"

    fields = [f for f in ("k_bits", "v_bits", "k_axis", "k_group", "v_group", "window", "sinks", "fitted")
              if f in report["summary"]["fields"]]
    if report["layers"]:
        rows = [[r["layer"], *[pair(r["changes"][f]) if f in r["changes"] else "=" for f in fields],
                 f"{r['effective_bits'][0]:.3f} -> {r['effective_bits'][1]:.3f}"] for r in report["layers"]]
        print_table(f"{na} -> {nb} on {report['model']}: {len(rows)} of {report['num_layers']} layers differ",
                    ["layer", *fields, "eff. bits"], rows)
    else:
        print(f"{na} and {nb} have the same configuration and fitted tensors in all {report['num_layers']} layers.")
    s = report["summary"]
    print(f"effective bits at {report['context']}: {na} {report['a']['effective_bits']:.3f} "
          f"({report['a']['compression_ratio']:.2f}x vs bf16), {nb} {report['b']['effective_bits']:.3f} "
          f"({report['b']['compression_ratio']:.2f}x) (delta {s['effective_bits_delta']:+.3f}); "
          f"differing layers: {s['differing_layers']}, identical: {s['identical_layers']}")
    if s["fields"]:
        print("layers differing by field: " + ", ".join(f"{k} {v}" for k, v in s["fields"].items()))
    for side in ("a", "b"):
        origin = report[side]["origin"]
        print(f"{report[side]['name']} made from: " + ("; ".join(f"{k}: {v}" for k, v in origin) if origin else "no provenance recorded"))


BENCHMARKS = ("grid", "latency", "sweep", "fitted", "groups", "combine", "e2e", "host", "accuracy", "report")


def _bench_command(args: list[str]) -> tuple[str, list[str]]:
    """(script, its arguments) of ``kvcalib bench``'s arguments ``NAME ARGS...``."""
    if args and not args[0].startswith("-"):
        return args[0], args[1:]
    raise KvcalibError(f"kvcalib bench needs a benchmark name: kvcalib bench NAME [ARGS...], NAME one of "
                       f"{', '.join(BENCHMARKS)}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             epilog="Examples (from the repository root, on a CUDA machine):\n\n    kvcalib bench grid --rows quick"
                    "\n\n    kvcalib bench e2e --context 32768\n\n    kvcalib bench report   (any machine: tables from "
                    "the JSON in artifacts/bench/)\n\nResults go to artifacts/bench/ (decode_attention.json/md/png, "
                    "e2e.json/md, ...).")
@user_errors
def bench(ctx: typer.Context) -> None:
    """GPU decode-attention and end-to-end benchmarks against bf16 (DESIGN.md protocol): kvcalib bench NAME [ARGS...].

    Runs ``python -m benchmarks.NAME [ARGS...]`` of a source checkout (the benchmarks are not part
    of the installed package): run it from the repository root. NAME: grid, latency, sweep, fitted,
    groups, combine, e2e, host, accuracy or report; ARGS go to the script (``--out DIR``, ...;
    ``python -m benchmarks.NAME --help`` lists them).
    """
    import subprocess

    name, args = _bench_command(list(ctx.args))
    if name not in BENCHMARKS:
        raise KvcalibError(f"unknown benchmark {name!r}: use one of {', '.join(BENCHMARKS)}")
    if name != "report":
        import torch

        if not torch.cuda.is_available():
            raise KvcalibError(f"kvcalib bench {name} needs a CUDA GPU (the Triton kernels are what it measures); "
                               "on a CPU machine `kvcalib bench report` rebuilds the tables from the JSON.")
    root = Path.cwd()
    if not (root / "benchmarks" / f"{name}.py").is_file():
        raise KvcalibError(f"no benchmarks/{name}.py under {root}: the benchmarks ship with the source, not the "
                           "installed package; run `kvcalib bench` from the repository root")
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=root)
    if done.returncode:
        raise typer.Exit(done.returncode)


def main() -> None:
    """Console-script entry point (and ``python -m kvcalib.cli``). A Ctrl-C ends the process as
    soon as its line is out: Python's own teardown of torch and a loaded model took 2-4 s more on
    a loaded 2-core machine, and nothing is left for it to do -- every output is written whole or
    not at all (:mod:`kvcalib.io`), every study write has committed before the interrupt is raised
    (:func:`kvcalib.optimize.study.storage_call`), and ``--workers`` children have been waited for."""
    try:
        app()
    except SystemExit as done:
        if done.code == EXIT_INTERRUPTED:
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(EXIT_INTERRUPTED)
        raise


if __name__ == "__main__":  # pragma: no cover
    main()
