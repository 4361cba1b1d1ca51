"""`python -m eval.soak [--minutes M] [--tp 1 2] [--fault remap:0.2] [--out DIR] [--decision-log PATH]
[--server-flags "..."]`: does VAMP stay up?

For each TP size, one server through our launcher (VAMP-20, a pool far below the sessions'
prefixes, `VAMP_SGLANG_FAULT` as given) gets M minutes of the closed-loop multi-turn workload from
several client threads, with random client aborts (a streamed request dropped after its first
chunks, i.e. a disconnect) and think times. Every few minutes the clients pause long enough for
the idle restore (so the pool shrinks and grows again, and the remap faults get many chances).
Then the load stops and the server idles until the experts are back. Printed and written as JSON
(plus a PNG of pool size and RSS over time):

- requests served, aborted by the client, and failed (an error, or an abort the client did not ask
  for); goal: 0 failed;
- the KV pool size over time and the remap failures the fault injected;
- RSS of the server's processes after warm-up and at the end; goal: growth under 5%;
- the page backend's live counts (reservations, mappings, handles) at start and after the final
  restore; goal: equal (no page leaked).

`--server-flags` adds SGLang flags, e.g. `--model models/tiny-qwen3-next --server-flags
"--max-mamba-cache-size 6"` soaks a hybrid model whose state pool, not its KV pool, runs short.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

import psutil
import requests
from tqdm import tqdm

from eval.servers import Server, ServerConfig, ServerSetup, ensure_tiny_model, get_json

MODEL = "models/tiny-qwen3-moe"
POOL_TOKENS = 2048
CLIENTS, TURNS, FIRST_TOKENS, GROWTH_TOKENS, NEW_TOKENS = 6, 12, 200, 80, 16
ABORT_PROBABILITY = 0.1  # of a request being streamed and dropped after its first chunks
THINK_S = (0.0, 1.0)
SAMPLE_EVERY_S = 5.0
WARMUP_FRACTION = 0.2  # RSS growth is measured from here to the end of the load
PAUSE_EVERY_S, PAUSE_S = 150.0, 25.0  # clients pause this long this often: experts come back, then go again


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.served = self.aborted = self.failed = 0
        self.errors: list[str] = []

    def add(self, outcome: str, error: str | None = None) -> None:
        with self.lock:
            setattr(self, outcome, getattr(self, outcome) + 1)
            if error and len(self.errors) < 20:
                self.errors.append(error)


def _generate(url: str, ids: list[int], timeout_s: float = 600.0) -> dict:
    response = requests.post(f"{url}/generate", timeout=timeout_s, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
    response.raise_for_status()
    return response.json()


def _disconnect_midway(url: str, ids: list[int]) -> None:
    """Stream a request and drop the connection after its first chunks (the server aborts it)."""
    with requests.post(f"{url}/generate", stream=True, timeout=600, json={
            "input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 2:
                break


def _client(url: str, seed: int, stop_at: float, tally: Tally, running: threading.Event) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        ids: list[int] = []
        for _ in range(TURNS):
            running.wait()
            if time.monotonic() >= stop_at:
                return
            ids += [rng.randrange(10, 2000) for _ in range(FIRST_TOKENS if not ids else GROWTH_TOKENS)]
            try:
                if rng.random() < ABORT_PROBABILITY:
                    _disconnect_midway(url, ids)
                    tally.add("aborted")
                    break  # that session ends; a new one starts
                out = _generate(url, ids)
                reason = out["meta_info"]["finish_reason"]["type"]
                if reason != "length" or len(out["output_ids"]) != NEW_TOKENS:
                    tally.add("failed", f"finish_reason {reason}, {len(out['output_ids'])} tokens")
                    break
                tally.add("served")
                ids += out["output_ids"]
            except (requests.RequestException, KeyError, ValueError) as e:
                tally.add("failed", repr(e)[:200])
                break
            time.sleep(rng.uniform(*THINK_S))


def _rss_bytes(pid: int) -> int:
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _live_pages(stats: dict) -> dict:
    return stats["experts"]["live_pages"]


def soak(model: str, tp: int, minutes: float, fault: str, log_dir: str, decision_log: str | None = None,
         server_flags: tuple[str, ...] = ()) -> dict:
    setup = ServerSetup(str(ensure_tiny_model(model)), max_total_tokens=POOL_TOKENS, tp_size=tp, log_dir=log_dir,
                        extra_flags=server_flags)
    flags = ("--vamp-max-offload-ratio", "0.2", "--vamp-restore-after-steps", "400")
    if decision_log:
        flags += ("--vamp-decision-log", f"{decision_log}.tp{tp}")
    config = ServerConfig(f"soak-tp{tp}", flags, env=(("VAMP_SGLANG_FAULT", fault),))
    with Server(setup, config) as server:
        url, start_stats = server.url, get_json(f"{server.url}/vamp/stats")
        tally, samples, running = Tally(), [], threading.Event()
        running.set()
        begin = time.monotonic()
        stop_at = begin + minutes * 60
        clients = [threading.Thread(target=_client, args=(url, 1000 * tp + i, stop_at, tally, running), daemon=True)
                   for i in range(CLIENTS)]
        for c in clients:
            c.start()
        with tqdm(total=int(minutes * 60), desc=f"soak TP{tp}", unit="s") as bar:
            while time.monotonic() < stop_at:
                time.sleep(SAMPLE_EVERY_S)
                phase_s = (time.monotonic() - begin) % PAUSE_EVERY_S
                if phase_s >= PAUSE_EVERY_S - PAUSE_S:
                    running.clear()
                else:
                    running.set()
                stats = get_json(f"{url}/vamp/stats")
                samples.append({"t_s": round(time.monotonic() - begin, 1), "pool_tokens": stats["kv_pool"]["tokens"],
                                "offloaded_groups": stats["experts"]["offloaded_groups"],
                                "rss_bytes": _rss_bytes(server.process.pid)})
                bar.n = min(int(time.monotonic() - begin), bar.total)
                bar.set_postfix(served=tally.served, failed=tally.failed, pool=samples[-1]["pool_tokens"])
        running.set()
        for c in clients:
            c.join()
        end_rss = _rss_bytes(server.process.pid)
        idle_from = time.monotonic()
        deadline = idle_from + 180  # idle: the experts come back after 10 s without requests
        stats = get_json(f"{url}/vamp/stats")
        while stats["experts"]["offloaded_groups"] and time.monotonic() < deadline:
            time.sleep(2)
            stats = get_json(f"{url}/vamp/stats")
        restored_after_s = None if stats["experts"]["offloaded_groups"] else round(time.monotonic() - idle_from, 1)
    warm = [s for s in samples if s["t_s"] >= WARMUP_FRACTION * minutes * 60] or samples
    warm_rss = warm[0]["rss_bytes"] if warm else end_rss
    return {
        "tp": tp, "minutes": minutes, "fault": fault, "served": tally.served, "aborted_by_client": tally.aborted,
        "failed": tally.failed, "errors": tally.errors,
        "pool_tokens": {"baseline": start_stats["kv_pool"]["baseline_tokens"],
                        "max": max((s["pool_tokens"] for s in samples), default=None),
                        "end": stats["kv_pool"]["tokens"]},
        "decisions": stats["decisions"], "failures": stats["failures"], "decision_errors": stats["decision_errors"],
        "rss_bytes": {"start": samples[0]["rss_bytes"] if samples else None, "after_warmup": warm_rss,
                      "end": end_rss, "growth_after_warmup": (end_rss - warm_rss) / warm_rss if warm_rss else None},
        "live_pages": {"start": _live_pages(start_stats), "after_restore": _live_pages(stats),
                       "offloaded_groups_after_restore": stats["experts"]["offloaded_groups"]},
        "idle_restore_s": restored_after_s,  # from the end of the load; None: experts still offloaded at 180 s
        "samples": samples,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (pool_ax, rss_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in results:
        t = [s["t_s"] / 60 for s in r["samples"]]
        pool_ax.plot(t, [s["pool_tokens"] for s in r["samples"]], label=f"TP{r['tp']}")
        rss_ax.plot(t, [s["rss_bytes"] / 2**30 for s in r["samples"]], label=f"TP{r['tp']}")
    pool_ax.set_ylabel("KV pool (tokens)")
    rss_ax.set_ylabel("server RSS (GiB)")
    rss_ax.set_xlabel("minutes")
    pool_ax.legend()
    pool_ax.set_title(f"soak with VAMP_SGLANG_FAULT={results[0]['fault']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--minutes", type=float, default=30.0, help="load per TP size")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--fault", default="remap:0.2", help="VAMP_SGLANG_FAULT for the server")
    parser.add_argument("--out", default="results/soak")
    parser.add_argument("--decision-log", help="the server's --vamp-decision-log, as PATH.tp<N> (rank r>0: .rank<r>)")
    parser.add_argument("--server-flags", default="", help="extra SGLang flags, space-separated")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [soak(args.model, tp, args.minutes, args.fault, str(out / "logs"), args.decision_log,
                    tuple(args.server_flags.split())) for tp in args.tp]
    (out / "soak.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "soak.png")
    ok = True
    for r in results:
        growth = r["rss_bytes"]["growth_after_warmup"]
        leak_free = r["live_pages"]["start"] == r["live_pages"]["after_restore"]
        back = "NOT within 180 s idle" if r["idle_restore_s"] is None else f"after {r['idle_restore_s']:g} s idle"
        ok &= r["failed"] == 0 and growth is not None and growth < 0.05 and leak_free and r["idle_restore_s"] is not None
        print(f"TP{r['tp']}: {r['minutes']:g} min, served {r['served']}, aborted by client {r['aborted_by_client']}, "
              f"failed {r['failed']}; pool {r['pool_tokens']}; remap failures {r['failures']['offload']} "
              f"(+{r['failures']['restore']} restores); RSS {r['rss_bytes']['after_warmup'] / 2**30:.2f} -> "
              f"{r['rss_bytes']['end'] / 2**30:.2f} GiB ({100 * growth:+.1f}%); live pages "
              f"{r['live_pages']['start']} -> {r['live_pages']['after_restore']}; experts back {back}")
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}; {'PASS' if ok else 'FAIL'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
