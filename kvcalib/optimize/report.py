"""Search outputs for people: ``pareto.png``, ``bits_per_layer.png`` and ``report.md``.

Comparisons are made at equal memory (:func:`at_equal_memory`): the chosen recipe is set beside a
preset only where the preset holds the same or more effective bits; a cheaper preset is marked
"not comparable (fewer bits)", never counted as a loss or a win (issue 38).

Matplotlib is imported inside the functions (Agg backend: no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

NOT_COMPARABLE = "not comparable (fewer bits)"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(records: Sequence[dict[str, Any]], front: Sequence[int], presets: Sequence[dict[str, Any]],
                budget: float, chosen: int | None, path: Path, context: int = 4096, copy_weight: float = 0.0) -> None:
    """Effective bits vs KL of every scored trial, the front, the budget and the presets (a preset
    with fewer bits than the chosen trial is drawn hollow: it is not comparable with it).
    ``copy_weight``: the search's (with copy windows the axis is their combined objective)."""
    from kvcalib.io import atomic_path

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    done = [r for r in records if r["state"] == "COMPLETE" and r["kl"] is not None]
    pruned = [r for r in records if r["state"] == "PRUNED" and r["kl"] is not None]
    floor = 1e-6
    if done:
        ax.scatter([r["effective_bits"] for r in done], [max(r["kl"], floor) for r in done], s=14, c="tab:blue",
                   alpha=0.6, label="trials")
    if pruned:
        ax.scatter([r["effective_bits"] for r in pruned], [max(r["kl"], floor) for r in pruned], s=10, c="0.6",
                   marker="x", alpha=0.6, label="pruned (partial KL)")
    by_num = {r["number"]: r for r in records}
    fr = [by_num[n] for n in front if n in by_num]
    if fr:
        ax.step([r["effective_bits"] for r in fr], [max(r["kl"], floor) for r in fr], where="post", c="tab:blue", lw=1)
    chosen_bits = by_num[chosen]["effective_bits"] if chosen is not None and chosen in by_num else None
    for p in presets:
        if p.get("kl") is not None:
            cheaper = chosen_bits is not None and at_equal_memory(chosen_bits, None, p["effective_bits"], None) == NOT_COMPARABLE
            ax.scatter([p["effective_bits"]], [max(p["kl"], floor)], marker="s", s=40,
                       facecolors="none" if cheaper else "tab:red", edgecolors="tab:red")
            ax.annotate(p["name"] + (" (fewer bits)" if cheaper else ""), (p["effective_bits"], max(p["kl"], floor)),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
    if chosen is not None and chosen in by_num:
        c = by_num[chosen]
        ax.scatter([c["effective_bits"]], [max(c["kl"], floor)], marker="*", s=160, c="tab:green", label=f"chosen (trial {chosen})", zorder=5)
    ax.axvline(budget, ls="--", c="0.4", lw=1, label=f"budget {budget:g} bits")
    ax.set_yscale("log")
    ax.set_xlabel(f"effective bits per element (context {context}; bf16 = 16, compression = 16 / bits)")
    ax.set_ylabel("KL(full || compressed), nats/token" if not copy_weight else
                  f"KL^{1 - copy_weight:g} x copy KL^{copy_weight:g}, nats/token")
    ax.set_title("search: quality vs memory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def _method_letters() -> dict[str, str]:
    """Each registered method's tag on the bits-per-layer plot (``Method.letter``)."""
    from kvcalib.methods import registry

    return {name: m.letter or name[0] for name, m in registry().items()}


def plot_bits_per_layer(point: dict[str, Any], sensitivity: Sequence[float] | None, path: Path) -> None:
    """K and V bits per layer of the chosen point (bars), and the layer sensitivity (line)."""
    from kvcalib.io import atomic_path

    plt = _plt()
    k, v = point["k_bits"], point["v_bits"]
    n = len(k)
    xs = list(range(n))
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * n + 2), 3.8))
    ax.bar([x - 0.2 for x in xs], k, width=0.4, label="K bits")
    ax.bar([x + 0.2 for x in xs], v, width=0.4, label="V bits")
    methods = point.get("methods") or []
    letters = _method_letters()
    for x, m in zip(xs, methods):
        if m:
            ax.annotate("".join(letters.get(s, s[0]) for s in m), (x, max(k[x], v[x]) + 0.2), ha="center",
                        fontsize=6)
    ax.set_xlabel("layer")
    ax.set_ylabel("bits")
    ax.set_yticks(sorted({2, 4, 8, *k, *v} - {16}))  # 3-bit layers get their tick only when present
    used = sorted({s for m in methods for s in m})
    legend = "/".join(letters.get(s, s[0]) for s in used) + " = " + "/".join(used) if used else "no method switches"
    ax.set_title(f"chosen recipe: bits per layer ({legend})")
    if sensitivity:
        ax2 = ax.twinx()
        ax2.plot(xs, [max(s, 1e-9) for s in sensitivity], c="k", lw=1, marker=".", label="sensitivity")
        ax2.set_yscale("log")
        ax2.set_ylabel("KL, layer alone at fewest bits")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def at_equal_memory(recipe_bits: float, recipe_score: float | None, other_bits: float,
                    other_score: float | None) -> str:
    """How another recipe (a preset) compares with ``recipe`` at equal memory, from the recipe's
    side: ``NOT_COMPARABLE`` when the other holds fewer effective bits (its quality was bought with
    less memory), else ``win`` / ``loss`` / ``tie`` on the scores (lower is better: KL, ppl delta)
    or ``comparable`` without them, with how much memory the other holds."""
    from kvcalib.recipe import isclose_bits

    same = isclose_bits(other_bits, recipe_bits)
    if other_bits < recipe_bits and not same:
        return NOT_COMPARABLE
    memory = "same bits" if same else f"it holds {other_bits / recipe_bits:.3f}x the memory"
    if recipe_score is None or other_score is None:
        return f"comparable ({memory})"
    verdict = "win" if recipe_score < other_score else "loss" if recipe_score > other_score else "tie"
    return f"{verdict} ({memory})"


def _or_dash(v: Any) -> Any:
    return "-" if v is None else v


def copy_ratio(row: dict[str, Any]) -> float | None:
    """A held-out row's copy NLL over full precision's on the same tokens (1.0: copies as well)."""
    nll, fp = row.get("copy_nll"), row.get("copy_nll_fp")
    return nll / fp if nll is not None and fp else None


def held_out_rows(held_out: Sequence[dict[str, Any]], kl_by_name: dict[str, float],
                  chosen_name: str | None = None) -> tuple[list[str], list[list[Any]]]:
    """The held-out table; copy columns where the proof scored the copy metric (NLL of the second
    copy's tail, full precision's, and their ratio); with ``chosen_name`` (the searched recipe's row)
    a last column says how each other row compares with it at equal memory (:func:`at_equal_memory`,
    on Δppl)."""
    cols = ["recipe", "eff. bits", "search KL", "held-out ppl", "ppl fp", "Δppl %"]
    rows = [[h["name"], round(h["effective_bits"], 3), kl_by_name.get(h["name"], "-"),
             _or_dash(h.get("ppl")), _or_dash(h.get("ppl_fp")),
             round(h["ppl_delta_pct"], 3) if h.get("ppl_delta_pct") is not None else "-"] for h in held_out]
    if any(h.get("copy_nll") is not None for h in held_out):
        cols += ["copy NLL", "copy NLL fp", "copy × fp"]
        for h, row in zip(held_out, rows):
            ratio = copy_ratio(h)
            row += [_or_dash(h.get("copy_nll")), _or_dash(h.get("copy_nll_fp")),
                    "-" if ratio is None else round(ratio, 3)]
    ref = next((h for h in held_out if h["name"] == chosen_name), None)
    if ref is not None:
        cols.append("chosen vs it")
        for h, row in zip(held_out, rows):
            row.append("chosen" if h is ref else at_equal_memory(ref["effective_bits"], ref.get("ppl_delta_pct"),
                                                                 h["effective_bits"], h.get("ppl_delta_pct")))
    return cols, rows


def _storage_md(storage: str) -> str:
    """The storage for report.md: the run folder's ``study.db`` as a relative link; any other
    storage as recorded (already free of machine paths and passwords), in code style."""
    if storage == "study.db":
        return "[`study.db`](study.db)"
    return f"`{storage}`"


def held_out_table(doc: dict[str, Any]) -> str:
    """The held-out table (markdown) of a ``search.json`` document; "" without a held-out proof."""
    if not doc.get("held_out"):
        return ""
    kl_by_name = {p["name"]: p["kl"] for p in doc.get("presets", [])}
    chosen = next((r for r in doc["trials"] if r["number"] == doc.get("chosen")), None)
    if chosen is not None:
        kl_by_name[doc.get("recipe_name", "searched")] = chosen["kl"]
    cols, rows = held_out_rows(doc["held_out"], kl_by_name, doc.get("recipe_name"))
    return markdown_table(cols, rows)


def decode_path_line(paths: Sequence[str | None]) -> str:
    """Where the chosen recipe's layers decode on a GPU (``search.json``'s ``decode_paths``: None =
    the fused kernel, else why the reference path), as one line of the report."""
    slow = {i: why for i, why in enumerate(paths) if why is not None}
    if not slow:
        return f"Decode on a GPU: all {len(paths)} layers in the fused Triton kernel."
    return (f"Decode on a GPU: **{len(slow)} of {len(paths)} layers on the PyTorch reference path** (tens of times "
            "slower than bf16 at long context; no whole-step CUDA graphs): "
            + "; ".join(f"layer {i}: {why}" for i, why in slow.items()) + ".")


def _copy_objective(doc: dict[str, Any]) -> str:
    """The objective line's account of the copy windows ("" for a search without them)."""
    weight = doc.get("copy_weight")
    if not weight:
        return ""
    return (f"; plus {doc.get('copy_sequences')} copy window(s) of the same length whose last "
            f"{doc.get('copy_span')} tokens repeat the window's first (the scored {doc.get('score_last')} decode steps "
            f"can only be read back from far in the compressed cache): KL = KL ordinary^{1 - weight:g} x "
            f"KL copy^{weight:g} (a weighted geometric mean: a relative change counts the same in either part)")


def _parts_text(record: dict[str, Any], doc: dict[str, Any]) -> str:
    """`` (ordinary A, copy B)`` for a record of a search that scored copy windows, else ""."""
    if not doc.get("copy_weight") or record.get("kl_copy") is None or record.get("kl_ordinary") is None:
        return ""
    return f" (ordinary {record['kl_ordinary']:.4g}, copy {record['kl_copy']:.4g})"


def _rotation_line(cfg: dict[str, Any]) -> str:
    """Which rotation kind the space's rotate switch fitted (``--rotate``; a search before the flag:
    the Hadamard one)."""
    kind = cfg.get("rotate") or "hadamard"
    kept = ("; a side whose learned fit does not beat the Hadamard rotation keeps its seed, `kvcalib inspect` "
            "shows which" if kind.startswith("learned") else "")
    return (f"- rotation: where a layer's rotate switch is on, its sides are fitted `{kind}` rotations "
            f"(`--rotate {kind}`{kept}); what they store is counted in every trial's effective bits")


def write_report(doc: dict[str, Any], path: Path) -> str:
    """``report.md`` from the ``search.json`` document; returns the held-out table (markdown)."""
    from kvcalib.io import atomic_path

    chosen = doc.get("chosen")
    by_num = {r["number"]: r for r in doc["trials"]}
    c = by_num.get(chosen) if chosen is not None else None
    states: dict[str, int] = {}
    for r in doc["trials"]:
        states[r["state"]] = states.get(r["state"], 0) + 1
    lines = [f"# kvcalib search: {doc['model']['name']}", ""]
    cfg = doc["config"]
    lines += [f"- budget: **{doc['budget_bits']:g}** effective bits per element at context {doc['context']}, i.e. "
              f"{16.0 / doc['budget_bits']:.2f}x smaller than the model's bf16 cache (bf16 = 16; a sliding-window "
              f"layer counts the tokens it holds; floor of the space: {doc['floor_bits']:.3f})",
              f"- objective: decode-faithful KL(full || compressed) on {doc['score_sequences']} held calibration "
              f"sequence(s) of {doc['score_seq_len']} tokens, disjoint from the {doc['stats_samples']} "
              f"collection sample(s); data `{cfg['data']}`, seed {cfg['seed']}" + _copy_objective(doc),
              f"- study `{doc['study']}` in {_storage_md(doc['storage'])}: {len(doc['trials'])} trials "
              f"({', '.join(f'{v} {k.lower()}' for k, v in sorted(states.items()))})"
              + (f"; {len(doc['recovered'])} interrupted trial(s) retried" if doc.get("recovered") else ""),
              f"- search time: {doc.get('seconds', 0):.0f} s"]
    if "rotate" in (doc.get("space") or {}).get("layer_methods", ()):
        lines.append(_rotation_line(cfg))
    if doc.get("run_dir"):
        lines.append(f"- run folder: `{doc['run_dir']}`")
    if doc.get("command"):
        lines.append(f"- made by: `{doc['command']}`")
    lines.append("")
    if doc.get("accounting_converted"):
        conv = doc["accounting_converted"]
        lines += [f"- effective bits converted from the {conv['from']!r} accounting this run was searched with "
                  f"(x {conv['factor']:.4f}: same bytes, sliding layers counted over the tokens they hold)"]
    if c is not None:
        lines += [f"**Chosen: trial {chosen}**, KL {c['kl']:.4g}{_parts_text(c, doc)} at {c['effective_bits']:.3f} effective bits, "
                  f"{16.0 / c['effective_bits']:.2f}x smaller than bf16 (group {c['point']['group']}, window {c['point']['window']}, sinks {c['point']['sinks']}"
                  + (f", schedule {c['point']['schedule']}" if c["point"].get("schedule", "none") != "none" else "")
                  + f") -> [`{doc.get('recipe')}`]({doc.get('recipe')})", ""]
    if c is not None and doc.get("decode_paths") is not None:
        lines += [decode_path_line(doc["decode_paths"]), ""]
    table = held_out_table(doc)
    if table:
        ho = doc.get("held_out_config", {})
        copied = next((h for h in doc["held_out"] if h.get("copy_nll") is not None), None)
        copy_line = (f" Copy: a passage of {ho.get('copy_len')} tokens repeated, NLL (nats/token) of the last "
                     f"{copied.get('copy_tail')} tokens of the second copy on {copied.get('copy_passages')} passage(s), "
                     "beside full precision's on the same tokens (copy × fp: 1 copies as well as full precision)."
                     if copied is not None else "")
        lines += ["## Held-out proof", "",
                  f"Decode-faithful perplexity on {ho.get('ppl_samples')} sequence(s) of {ho.get('ppl_seq_len')} tokens "
                  f"of the evaluation split (never seen by collection or search); effective bits at {doc['context']}."
                  f"{copy_line} The chosen recipe is compared only with presets at the same or more bits (win/loss on "
                  f"Δppl); a preset with fewer bits is {NOT_COMPARABLE}.", "",
                  table, ""]
    lines += ["## Quality vs memory", "", "![pareto](pareto.png)", "", "## Bits per layer", "",
              "![bits per layer](bits_per_layer.png)", ""]
    front = [by_num[n] for n in doc.get("pareto", []) if n in by_num]
    copies = bool(doc.get("copy_weight"))  # the KL's two parts get their columns
    parts_cols = ["KL ordinary", "KL copy"] if copies else []

    def parts(r: dict[str, Any]) -> list[Any]:
        return [_or_dash(r.get("kl_ordinary")), _or_dash(r.get("kl_copy"))] if copies else []

    if front:
        lines += ["## Pareto front", "", "Pick any of these with `kvcalib export RUN_DIR --trial N -o recipe.safetensors`.", "",
                  markdown_table(["trial", "eff. bits", "KL", *parts_cols, "mean K bits", "mean V bits"],
                                 [[r["number"], round(r["effective_bits"], 3), r["kl"], *parts(r),
                                   round(sum(r["point"]["k_bits"]) / len(r["point"]["k_bits"]), 2),
                                   round(sum(r["point"]["v_bits"]) / len(r["point"]["v_bits"]), 2)] for r in front]), ""]
    if doc.get("presets"):
        cols = ["preset", "eff. bits", "KL", *parts_cols]
        rows = [[p["name"], round(p["effective_bits"], 3), p["kl"], *parts(p)] for p in doc["presets"]]
        if c is not None:  # the chosen trial's KL against each preset's, at equal memory only
            cols.append(f"chosen (KL {c['kl']:.4g}) vs it")
            for p, row in zip(doc["presets"], rows):
                row.append(at_equal_memory(c["effective_bits"], c["kl"], p["effective_bits"], p.get("kl")))
        lines += ["## Presets on the same objective", "", markdown_table(cols, rows), ""]
    lines += ["Every trial is in [`search.json`](search.json).", ""]
    with atomic_path(Path(path)) as tmp:
        tmp.write_text("\n".join(lines))
    return table
