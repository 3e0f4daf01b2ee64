#!/usr/bin/env python3
"""The long-prompt injection gate of chunked prefill: do running streams keep their pace while
long prompts arrive?

Against a running OpenAI-compatible server (`hf2q serve --kv-paged ...`, or llama-server), in
two phases with identical streams:
  1. baseline: STREAMS streaming completions run together (prompts of --stream-prompt token ids,
     --stream-tokens tokens each, greedy, ignore_eos);
  2. injected: the same streams again, and while they run, one completion per --inject length
     (e.g. 4096,8192,16384 token ids, 1 token out) sent --inject-every seconds apart, starting
     --inject-after seconds after the last stream produced its first token.
The streams' inter-token latencies (ITL) are counted only in the window where every stream is
running (after the last first token, before the first stream ends), so the start-up prefill of
the streams themselves is in neither phase. The gate (issue: "the running streams' ITL p99 stays
under 2x their ITL p50 without injection") is `injected ITL p99 < 2 x baseline ITL p50`; the
report also says how many streams produced the same text in both phases (greedy: a server whose
batch composition changes results shows it here) and each injected prompt's time to its token.

Prompts are token ids (`/v1/completions` with a list prompt), so no tokenizer counting is needed
and every prompt has exactly its length; stream i's ids depend on i only, each injected prompt
starts with a token no stream uses (no prefix cache can serve it).

Standard library only; reuses loadgen.py's client and statistics.

  bench/itl_gate.py --base-url http://127.0.0.1:18090 --streams 32 --inject 4096,8192,16384 --json out.json
"""

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loadgen import Client, pct, sse_chunks  # noqa: E402


def stream_completion(client, model, prompt, max_tokens, on_first=None):
    """One streamed greedy completion: {"ok", "first" (time of its first text), "times" (every
    text chunk's time), "text", "error"}; times are time.perf_counter() values. `on_first` is
    called once, at the first text."""
    res = {"ok": False, "first": None, "times": [], "text": "", "error": None, "sent": time.perf_counter()}
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        c = client.conn()
        c.request("POST", "/v1/completions", body=json.dumps(body), headers=client.headers)
        r = c.getresponse()
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read()[:200]!r}"
            return res
        for chunk in sse_chunks(r):
            if chunk is None:
                res["ok"] = res["error"] is None
                break
            if "error" in chunk:
                res["error"] = chunk["error"].get("message", "error")
                break
            for ch in chunk.get("choices", []):
                if ch.get("text"):
                    now = time.perf_counter()
                    res["times"].append(now)
                    res["text"] += ch["text"]
                    if res["first"] is None:
                        res["first"] = now
                        if on_first:
                            on_first()
        c.close()
        if not res["ok"] and res["error"] is None:
            res["error"] = "stream ended without [DONE]"
    except Exception as e:  # a failed request is a result
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def stream_prompt(i, n, vocab):
    """Stream i's prompt: n token ids in 100..vocab-8, a sequence of its own."""
    span = max(16, min(vocab - 108, 30000))
    return [100 + (i * 7919 + k * 31 + (k * k) % 97) % span for k in range(n)]


def injected_prompt(j, n, vocab):
    """Injected prompt j: n token ids, the first one no stream prompt starts with."""
    span = max(16, min(vocab - 108, 30000))
    ids = [100 + (j * 104729 + k * 13 + (k * k) % 101) % span for k in range(n)]
    ids[0] = 99 - (j % 50)
    return ids


def run_phase(client, model, args, vocab, inject):
    """Runs the streams, and the injected prompts when `inject` lists lengths. Returns (stream
    results, injected results)."""
    results = [None] * args.streams
    started = threading.Semaphore(0)
    threads = []
    for i in range(args.streams):
        def go(i=i):
            results[i] = stream_completion(client, model, stream_prompt(i, args.stream_prompt, vocab),
                                           args.stream_tokens, on_first=started.release)
        threads.append(threading.Thread(target=go, daemon=True))
    for t in threads:
        t.start()
    injected = []
    if inject:
        deadline = time.perf_counter() + args.timeout
        for _ in range(args.streams):  # every stream has its first token
            if not started.acquire(timeout=max(0.0, deadline - time.perf_counter())):
                break
        time.sleep(args.inject_after)
        for j, n in enumerate(inject):
            out = {"tokens": n}

            def go(j=j, n=n, out=out):
                out.update(stream_completion(client, model, injected_prompt(j, n, vocab), 1))
            t = threading.Thread(target=go, daemon=True)
            t.start()
            injected.append((t, out))
            time.sleep(args.inject_every)
        for t, _ in injected:
            t.join()
    for t in threads:
        t.join()
    return results, [o for _, o in injected]


def window_itl(results):
    """The gaps between text chunks of every stream inside the window where all streams run
    (after the last first token, before the first stream's last token)."""
    ok = [r for r in results if r and r["ok"] and len(r["times"]) > 1]
    if len(ok) < len(results):
        return [], None
    lo = max(r["first"] for r in ok)
    hi = min(r["times"][-1] for r in ok)
    gaps = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:]) if a >= lo and b <= hi]
    return gaps, (lo, hi)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--streams", type=int, default=32, help="running streams (default 32)")
    ap.add_argument("--stream-prompt", type=int, default=128, help="tokens of each stream's prompt")
    ap.add_argument("--stream-tokens", type=int, default=512, help="tokens each stream generates")
    ap.add_argument("--inject", default="4096,8192,16384", help="lengths of the injected prompts")
    ap.add_argument("--inject-after", type=float, default=0.5,
                    help="seconds after the last stream's first token before the first injection")
    ap.add_argument("--inject-every", type=float, default=0.5, help="seconds between injections")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args()
    inject = [int(x) for x in args.inject.split(",") if x]
    client = Client(args.base_url, args.api_key, args.timeout)
    models = client.get_json("/v1/models")["data"]
    model = models[0]["id"]
    meta = models[0].get("meta") or {}
    vocab = meta.get("vocab_size") or meta.get("n_vocab") or 32000  # hf2q's, llama-server's

    base, _ = run_phase(client, model, args, vocab, [])
    inj, injected = run_phase(client, model, args, vocab, inject)
    base_gaps, base_win = window_itl(base)
    inj_gaps, inj_win = window_itl(inj)
    same = sum(1 for a, b in zip(base, inj) if a and b and a["ok"] and b["ok"] and a["text"] == b["text"])
    errors = [r["error"] for r in base + inj + injected if r and r.get("error")]
    rep = {
        "model": model,
        "streams": args.streams,
        "stream_prompt_tokens": args.stream_prompt,
        "stream_tokens": args.stream_tokens,
        "inject": inject,
        "baseline_itl_p50_ms": pct(base_gaps, 50) * 1e3,
        "baseline_itl_p99_ms": pct(base_gaps, 99) * 1e3,
        "injected_itl_p50_ms": pct(inj_gaps, 50) * 1e3,
        "injected_itl_p99_ms": pct(inj_gaps, 99) * 1e3,
        "injected_itl_max_ms": max(inj_gaps) * 1e3 if inj_gaps else float("nan"),
        "window_s": [None if w is None else w[1] - w[0] for w in (base_win, inj_win)],
        "injected_ttft_s": [None if o.get("first") is None else o["first"] - o["sent"] for o in injected],
        "injected_in_window": inj_win is not None and all(
            o.get("first") is not None and o["first"] <= inj_win[1] for o in injected),
        "same_text": same,
        "errors": errors[:5],
        "error_count": len(errors),
    }
    rep["gate"] = rep["injected_itl_p99_ms"] < 2 * rep["baseline_itl_p50_ms"]
    print(json.dumps(rep, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
