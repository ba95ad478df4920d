"""Turn run_all.py's summary (plain JSON data) into REPORT.md and a comparison PNG.

Pure functions of the summary, so the report can be rebuilt from results/summary.json without
rerunning anything:  python benchmarks/report.py benchmarks/results
Every table says what is missing and why (a skipped or failed stage), never an empty cell.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Summary = Mapping[str, Any]
COMPARISON_PNG = "comparison.png"


def _num(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _stage(summary: Summary, name: str) -> Mapping[str, Any] | None:
    return next((s for s in summary.get("stages", []) if s["name"] == name), None)


def _missing(summary: Summary, names: Sequence[str]) -> list[str]:
    """One line per stage of `names` that produced nothing, saying why."""
    lines = []
    for name in names:
        stage = _stage(summary, name)
        if stage is not None and stage["status"] != "ok":
            lines.append(f"- **{name}**: {stage['status']}. {stage['note']}".rstrip())
    return lines


def _missing_prefixed(summary: Summary, prefixes: Sequence[str]) -> list[str]:
    """As _missing, for every stage whose name starts with one of `prefixes` (per-round stages)."""
    names = [s["name"] for s in summary.get("stages", []) if s["name"].startswith(tuple(prefixes))]
    return _missing(summary, names)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _times(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.2f}x" if numerator and denominator else "n/a"


KIND_ORDER = ("kvserve", "kvserve-int4", "vllm", "llama.cpp")


def _by_kind(runs: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for run in sorted(runs, key=lambda r: (KIND_ORDER.index(r["kind"]) if r["kind"] in KIND_ORDER else 99, r["round"])):
        grouped.setdefault(run["kind"], []).append(run)
    return grouped


def machine_section(summary: Summary) -> list[str]:
    m = summary["machine"]
    rows = [["CPU", m["cpu"]], ["cores", str(m["cores"])], ["memory", f"{m['memory_gib']} GiB"],
            ["OS / Python", f"{m['os']} / Python {m['python']}"],
            ["load average at start (1/5/15 min)", " / ".join(str(x) for x in m["load_average_at_start"])],
            ["kvserve revision", m["git_revision"]],
            ["threads per system", str(summary.get("threads", "default"))]]
    rows += [[name, version] for name, version in m["versions"].items()]
    return ["## Machine and software", "", *_table(["", ""], rows)]


def workload_section(summary: Summary) -> list[str]:
    w = summary["workload"]
    return ["## Workload", "",
            f"`benchmarks/workload.py`: seed {w['seed']}, {w['num_requests']} requests, prompts of "
            f"{w['prompt_len'][0]}-{w['prompt_len'][1]} random token ids ({w['input_tokens']:,} in all), outputs of "
            f"{w['output_len'][0]}-{w['output_len'][1]} tokens ({w['output_tokens']:,} in all), EOS ignored, greedy. "
            f"Online runs send the same requests as token-id prompts from `{w['jsonl']}`."]


def offline_section(summary: Summary) -> list[str]:
    rows = summary.get("offline", [])
    lines = ["## 1. Offline throughput (one process, no HTTP)", ""]
    base = next((r["tokens_per_s"] for r in rows if r["kind"] == "kvserve-continuous"), None)
    if rows:
        table = []
        for r in rows:
            ratio = f"{base / r['tokens_per_s']:.2f}x" if base else "n/a"
            table.append([r["name"], f"{r['output_tokens']:,}", _num(r["seconds"]), _num(r["tokens_per_s"]), ratio])
        lines += _table(["system", "output tokens", "seconds", "tokens/s", "kvserve continuous is"], table)
        best = {}
        for r in rows:
            if r["kind"].endswith("-static") and r["tokens_per_s"] > best.get(r["kind"], {}).get("tokens_per_s", 0):
                best[r["kind"]] = r
        if base and best:
            lines += ["", "Best static batch size: " + "; ".join(
                f"{r['name']} ({_num(r['tokens_per_s'])} tokens/s, kvserve continuous is {base / r['tokens_per_s']:.2f}x)"
                for r in best.values()) + "."]
        lines += ["", "Static batches count useful tokens only: a finished request's slot idles (transformers "
                  "keeps generating into it) until the longest request of its batch ends."]
    else:
        lines.append("No offline results.")
    missing = _missing(summary, ("offline: kvserve", "offline: transformers generate (static)",
                                 "offline: transformers continuous batching"))
    lines += ["", "Not measured:", *missing] if missing else []
    return lines + offline_peers_lines(summary)


def offline_peers_lines(summary: Summary) -> list[str]:
    """kvserve's and each peer's LLM.generate, alternating on one folder: every round and the medians."""
    runs = summary.get("offline_peers") or []
    missing = _missing_prefixed(summary, ("offline vs peers:", "setup: vLLM"))
    if not runs and not missing:
        return []
    lines = ["", "### Against vLLM's CPU engine: `LLM.generate`, the same bf16 Hugging Face folder, alternating runs", ""]
    grouped = _by_kind(runs)
    peers = [k for k in grouped if k != "kvserve"]
    if "kvserve" in grouped and peers:
        rounds = sorted({r["round"] for r in runs})
        rate = {(r["kind"], r["round"]): r["tokens_per_s"] for r in runs}
        names = {k: grouped[k][0]["system"] for k in grouped}
        header = ["round", f"{names['kvserve']} tokens/s", *(f"{names[k]} tokens/s" for k in peers),
                  *(f"kvserve / {names[k].split(' LLM')[0]}" for k in peers)]
        table = [[str(n), _num(rate.get(("kvserve", n))), *(_num(rate.get((k, n))) for k in peers),
                  *(_times(rate.get(("kvserve", n)), rate.get((k, n))) for k in peers)] for n in rounds]
        medians = {k: _median([r["tokens_per_s"] for r in grouped[k]]) for k in grouped}
        table.append(["median", _num(medians["kvserve"]), *(_num(medians[k]) for k in peers),
                      *(_times(medians["kvserve"], medians[k]) for k in peers)])
        lines += _table(header, table)
        lines += ["", "Rounds run every system once, in this order, so a drift of the machine's speed between runs "
                  "moves both sides of a round's ratio alike. Targets: >= 1.5x vLLM (floor 1.1x)."]
    elif runs:
        lines.append("Only one side of the comparison finished: " + ", ".join(
            f"{r['system']} round {r['round']}: {_num(r['tokens_per_s'])} tokens/s" for r in runs) + ".")
    return lines + (["", "Not measured:", *missing] if missing else [])


ONLINE_HEADER = ["server", "completed", "failed", "seconds", "req/s", "output tok/s", "mean TTFT ms", "p99 TTFT ms",
                 "mean TPOT ms", "p99 TPOT ms", "mean ITL ms", "p99 e2e ms"]


def _online_row(name: str, r: Mapping[str, Any]) -> list[str]:
    return [name, str(r["completed"]), str(r["failed"]), _num(r["duration"]), _num(r["request_throughput"], 2),
            _num(r["output_throughput"]), _num(r["mean_ttft_ms"], 0), _num(r.get("p99_ttft_ms"), 0),
            _num(r["mean_tpot_ms"]), _num(r.get("p99_tpot_ms")), _num(r["mean_itl_ms"]), _num(r.get("p99_e2el_ms"), 0)]


def online_section(summary: Summary) -> list[str]:
    runs = summary.get("online", [])
    lines = ["## 2. Online serving: the workload at N concurrent streams (kvserve-bench)", ""]
    if runs:
        levels = sorted({r["streams"] for r in runs}, reverse=True)
        prompts = {r["streams"]: r["result"].get("num_prompts", r["result"]["completed"] + r["result"]["failed"])
                   for r in runs}
        lines.append("All requests queued at once, at most N in flight (`--max-concurrency N`); "
                     + ", ".join(f"{n} streams: {prompts[n]} requests" for n in levels)
                     + f". Medians over {summary.get('peer_repeats', 1)} alternating rounds; \"kvserve is\": kvserve's "
                       "median output tokens/s over that server's (targets at 64 streams: >= 1.5x `vllm serve`, with "
                       "lower TTFT and TPOT p50).")
        lines.append("")
        table = []
        for n in levels:
            grouped = _by_kind([r for r in runs if r["streams"] == n])
            base = _median([r["result"]["output_throughput"] for r in grouped.get("kvserve", [])])
            for kind, group in grouped.items():
                results = [r["result"] for r in group]
                tput = _median([r["output_throughput"] for r in results])
                table.append([str(n), group[0]["system"], ", ".join(_num(r["output_throughput"]) for r in results),
                              _num(tput), _num(_median([r.get("median_ttft_ms") for r in results]), 0),
                              _num(_median([r.get("median_tpot_ms") for r in results])),
                              str(sum(r["failed"] for r in results)),
                              "-" if kind == "kvserve" else _times(base, tput)])
        lines += _table(["streams", "server", "output tok/s, each round", "median output tok/s", "TTFT p50 ms",
                         "TPOT p50 ms", "failed", "kvserve is"], table)
        lines += ["", "Every run:", ""]
        lines += _table(["streams", "round", *ONLINE_HEADER],
                        [[str(r["streams"]), str(r["round"]), *_online_row(r["system"], r["result"])]
                         for n in levels for r in runs if r["streams"] == n])
        commands = {r["system"]: r["server_command"] for r in runs}
        lines += ["", "Server commands:", ""] + [f"- {system}: `{cmd}`" for system, cmd in commands.items()]
    else:
        lines.append("No online results.")
    missing = _missing_prefixed(summary, ("online:", "start:"))
    return lines + (["", "Not measured:", *missing] if missing else [])


def single_stream_section(summary: Summary) -> list[str]:
    single = summary.get("single_stream") or {}
    runs = single.get("runs", [])
    lines = ["## 4. Single stream: ms per output token, one request at a time", ""]
    if runs:
        lines.append(f"{single['requests']} requests per run, one at a time, {single['prompt_len']}-token prompts, "
                     f"{single['output_len']} output tokens, greedy; ms/token is kvserve-bench's TPOT p50 (time after "
                     "the first token over the tokens after it). Rounds alternate the servers. Targets: int4 <= "
                     "llama.cpp Q4_1 on the same GGUF; bf16 level with vLLM.")
        lines.append("")
        grouped = _by_kind(runs)
        medians = {k: _median([r["result"].get("median_tpot_ms") for r in g]) for k, g in grouped.items()}
        against = {"kvserve-int4": "llama.cpp", "kvserve": "vllm"}
        table = []
        for kind, group in grouped.items():
            other = against.get(kind)
            compared = (f"{_times(medians[kind], medians[other])} {grouped[other][0]['system']}'s ms/token"
                        if other in grouped else "-")
            table.append([group[0]["system"], ", ".join(_num(r["result"].get("median_tpot_ms"), 2) for r in group),
                          _num(medians[kind], 2), compared])
        lines += _table(["server", "ms/token, each round", "median ms/token", "compared with"], table)
    else:
        lines.append("No single-stream results.")
    missing = _missing_prefixed(summary, ("single stream:",))
    return lines + (["", "Not measured:", *missing] if missing else [])


def sweep_section(summary: Summary) -> list[str]:
    sweep = summary.get("sweep") or {}
    points = sweep.get("points", [])
    lines = ["## 3. kvserve latency vs throughput (request-rate sweep)", ""]
    if points:
        lines.append(f"{sweep['num_prompts']} requests of the workload per rate, Poisson arrivals (seed 0).")
        lines.append("")
        table = [[str(p["request_rate"]), *_online_row("", p)[1:]] for p in points]
        lines += _table(["rate (req/s)", *ONLINE_HEADER[1:]], table)
        lines += [""] + [f"![{Path(png).stem}]({Path(png).name})" for png in sweep.get("pngs", [])]
    else:
        lines.append("No sweep results.")
    missing = _missing(summary, ("sweep: kvserve",))
    return lines + (["", "Not measured:", *missing] if missing else [])


def ceiling_section(summary: Summary) -> list[str]:
    c = summary.get("ceiling") or {}
    lines = ["## 5. The matmul-bound ceiling (benchmarks/ceiling.py)", ""]
    if c:
        names = [s["name"] for s in c["shapes"]]
        lines.append("bf16 `F.linear` on the model's weight shapes, ms per matmul (minimum of 20):")
        lines.append("")
        header = ["rows", *(f"{s['name']} {s['out_features']}x{s['in_features']}" for s in c["shapes"])]
        lines += _table(header, [[rows, *(_num(by[n], 3) for n in names)] for rows, by in c["matmul_ms"].items()])
        kv = c.get("kvserve_tokens_per_s")
        lines += ["", f"Ceiling on this workload if a step cost only its matmuls ({c['input_tokens']:,} prompt + "
                  f"{c['output_tokens']:,} output tokens through the 30 layers, lm_head for sampled rows only), and "
                  f"kvserve offline in the same run ({_num(kv)} output tokens/s):", ""]
        # kvserve's layers multiply by oneDNN-prepacked weights, which skip the weight reorder
        # F.linear pays per call: the figures are F.linear's, the prepacked ones are the
        # stricter yardstick for what kvserve itself runs. Reports from before packing lack them.
        packed = c.get("packed_ceiling_tokens_per_s") or {}
        rows = [[f"{r}" + (" (headline)" if int(r) == c["headline_rows"] else ""), _num(v),
                 f"{100 * kv / v:.0f}%" if kv else "n/a",
                 *([_num(packed[r]), f"{100 * kv / packed[r]:.0f}%" if kv else "n/a"] if packed else [])]
                for r, v in c["ceiling_tokens_per_s"].items()]
        header = ["matmul rows", "ceiling, F.linear (output tokens/s)", "kvserve reaches"]
        if packed:
            header += ["ceiling, prepacked weights", "kvserve reaches"]
        lines += _table(header, rows)
        lines += ["", f"Single-stream floor (one bf16 row through every weight matrix): "
                  f"{_num(c['single_stream_floor_ms'])} ms per token with `F.linear`"
                  + (f", {_num(c['packed_single_stream_floor_ms'])} ms with prepacked weights."
                     if "packed_single_stream_floor_ms" in c else ".")]
    else:
        lines.append("Not measured.")
    missing = _missing(summary, ("ceiling: matmul-bound ceiling and kvserve",))
    return lines + (["", "Not measured:", *missing] if missing else [])


def step_profile_section(summary: Summary) -> list[str]:
    p = summary.get("step_profile") or {}
    lines = ["## 6. Where a step's time goes (benchmarks/step_profile.py)", ""]
    if p:
        steps = p["steps"]
        columns = list(steps)
        categories = list(next(iter(steps.values())))
        lines.append(f"ms per step (share of the step); decode rows have {p['prompt_len']}-token prompts in the cache.")
        lines.append("")
        table = []
        for category in categories:
            cells = []
            for column in columns:
                value, total = steps[column][category], steps[column]["step total"]
                cells.append(_num(value, 2) if category == "step total" else f"{_num(value, 2)} ({100 * value / total:.0f}%)")
            table.append([category, *cells])
        lines += _table(["", *columns], table)
    else:
        lines.append("Not measured.")
    missing = _missing(summary, ("profile: step breakdown",))
    return lines + (["", "Not measured:", *missing] if missing else [])


def quantization_section(summary: Summary) -> list[str]:
    q = summary.get("quantization") or {}
    lines = ["## 7. Weight-only quantization (benchmarks/quant_accuracy.py)", ""]
    if q:
        lines.append(f"Greedy continuations of {q['prompts']} prompts x {q['max_tokens']} tokens against bf16 weights, "
                     "and the mean NLL of a fixed passage:")
        lines.append("")
        lines += _table(["weights", "identical continuations", "tokens before first divergence", "passage NLL"],
                        [[a["weights"], f"{a['identical']}/{q['prompts']}",
                          f"{100 * a['agreeing_tokens'] / a['total_tokens']:.1f}%", _num(a["passage_nll"], 4)]
                         for a in q["accuracy"]])
        floor = q["bf16_floor_ms"]
        lines += ["", f"Single stream, against the bf16 weight pass (torch's floor, {_num(floor)} ms; targets: "
                  "int4 <= 0.5x, int8 <= 0.8x):", ""]
        lines += _table(["weights", "weight pass, 1 row (ms)", "decode ms per output token (engine)"],
                        [[mode, f"{_num(v['weight_pass_ms'])} ({v['weight_pass_ms'] / floor:.2f}x)",
                          f"{_num(v['tpot_ms'])} ({v['tpot_ms'] / floor:.2f}x)"] for mode, v in q["speed"].items()])
    else:
        lines.append("Not measured.")
    missing = _missing(summary, ("quantization: accuracy and single-stream speed",))
    return lines + (["", "Not measured:", *missing] if missing else [])


def stages_section(summary: Summary) -> list[str]:
    rows = [[s["name"], s["status"], _num(s["seconds"], 0), f"`{s['command']}`" if s["command"] else ""]
            for s in summary.get("stages", [])]
    took = f" ({summary['seconds'] / 60:.1f} min in all)" if summary.get("seconds") else ""
    return ["## Stages and exact commands", "", f"Everything above: `{summary['command']}`{took}", "",
            *_table(["stage", "status", "seconds", "command"], rows)]


def render_report(summary: Summary, has_comparison_png: bool = False) -> str:
    lines = ["# kvserve benchmark report", "",
             f"Generated {summary['generated_at']} by `{summary['command']}` (SmolLM2-135M-Instruct, the Q4_1 GGUF "
             "dequantized; every system on the same machine, model and workload)."]
    if summary.get("quick"):
        lines += ["", "**Quick smoke run (`--quick`): a tiny workload; these numbers are not a benchmark.**"]
    load = summary["machine"]["load_average_at_start"][0]
    if load > summary["machine"]["cores"]:
        lines += ["", f"**Warning: the load average was {load} on {summary['machine']['cores']} cores at the start: "
                  "other work shared the CPU, so absolute numbers are pessimistic and ratios noisy.**"]
    sections = [machine_section(summary), workload_section(summary), offline_section(summary),
                online_section(summary), sweep_section(summary), single_stream_section(summary), ceiling_section(summary),
                step_profile_section(summary), quantization_section(summary)]
    if has_comparison_png:
        sections.append(["## At a glance", "", f"![offline and online throughput]({COMPARISON_PNG})"])
    sections.append(stages_section(summary))
    for section in sections:
        lines += ["", *section]
    return "\n".join(lines) + "\n"


def plot_comparison(summary: Summary, path: Path) -> Path | None:
    """Bars of output tokens/s: every offline system, and every online server. None when nothing ran."""
    bars = [(r["name"], r["tokens_per_s"]) for r in summary.get("offline", [])]
    for kind, runs in _by_kind(summary.get("offline_peers") or []).items():
        bars.append((f"{runs[0]['system']} (bf16 folder, median)", _median([r["tokens_per_s"] for r in runs])))
    online = summary.get("online", [])
    if online:
        most = max(r["streams"] for r in online)
        for kind, runs in _by_kind([r for r in online if r["streams"] == most]).items():
            bars.append((f"online, {most} streams: {runs[0]['system']}",
                         _median([r["result"]["output_throughput"] for r in runs])))
    if not bars:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 0.45 * len(bars) + 1.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    names, values = zip(*bars)
    axes.barh(range(len(bars)), values, color=["C0" if "kvserve" in n else "C7" for n in names])
    axes.set_yticks(range(len(bars)), names, fontsize=8)
    axes.invert_yaxis()
    for y, value in enumerate(values):
        axes.annotate(f"{value:.0f}", (value, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    axes.set_xlabel("output tokens/s (higher is better)")
    axes.set_title("SmolLM2-135M on the fixed workload")
    axes.grid(axis="x", alpha=0.3)
    figure.savefig(path, dpi=110)
    return path


def write_report(summary: Summary, out_dir: Path) -> Path:
    png = plot_comparison(summary, out_dir / COMPARISON_PNG)
    path = out_dir / "REPORT.md"
    path.write_text(render_report(summary, has_comparison_png=png is not None), encoding="utf-8")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description="Rebuild REPORT.md from a results folder's summary.json.")
    parser.add_argument("results_dir", type=Path)
    args = parser.parse_args()
    summary = json.loads((args.results_dir / "summary.json").read_text())
    print(write_report(summary, args.results_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
