#!/usr/bin/env python3
"""Does the Lab's event stream keep up with a fast training job? Starts `hf2q serve` on the
committed tiny Llama in a temporary $HF2Q_HOME, submits a `train_sft` job of many short steps,
follows GET /api/jobs/{id}/events as SSE from the start, and reports the job's step rate, whether
every sequence number arrived once and in order, and the delay from an event's append (its
`time`) to its arrival here (p50, p99, max).

Usage: bench/lab_events.py HF2Q_BINARY [STEPS]   (standard library only)
"""
import json, os, subprocess, sys, tempfile, time, urllib.request

def main():
    binary = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    tiny = os.path.join(root, "crates/models/tests/fixtures/tiny/tiny-llama")
    home = tempfile.mkdtemp()
    os.makedirs(os.path.join(home, "data"))
    with open(os.path.join(home, "data/chats.jsonl"), "w") as f:
        for i in range(32):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"say {i}"},
                                             {"role": "assistant", "content": f"OK {i}!"}]}) + "\n")
    env = dict(os.environ, HF2Q_HOME=home)
    srv = subprocess.Popen([binary, "serve", tiny, "--port", "0", "-c", "256", "--kv-mem", "64M"],
                           env=env, stderr=subprocess.PIPE, text=True)
    try:
        addr = None
        for line in srv.stderr:
            if line.startswith("listening on http://"):
                addr = line.split("http://", 1)[1].strip()
                break
        base = "http://" + addr
        # The tiny model lives outside the home: give the job a copy under models/.
        import shutil
        shutil.copytree(tiny, os.path.join(home, "models/tiny"))
        body = json.dumps({"kind": "train_sft", "params": {
            "model": "models/tiny", "data": "data/chats.jsonl", "output": "fast",
            "steps": steps, "batch": 1, "max_seq_len": 32, "device": "cpu"}}).encode()
        req = urllib.request.Request(base + "/api/jobs", body, {"Content-Type": "application/json"})
        job = json.load(urllib.request.urlopen(req))
        seqs, delays, step_events, first, last = [], [], [], None, None
        with urllib.request.urlopen(f"{base}/api/jobs/{job['id']}/events") as r:
            for raw in r:
                line = raw.decode().rstrip("\n")
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                now = time.time()
                seqs.append(ev["seq"])
                delays.append(now - ev["time"])
                d = ev.get("data", {})
                if ev["type"] == "progress" and d.get("event") == "step":
                    step_events.append(d)
                    first = first if first is not None else now
                    last = now
        delays.sort()
        rate = (len(step_events) - 1) / (last - first) if len(step_events) > 1 else 0.0
        q = lambda p: delays[min(len(delays) - 1, int(p * len(delays)))] * 1000
        print(json.dumps({
            "steps": steps, "step_events": len(step_events), "events": len(seqs),
            "gap_free": seqs == list(range(1, len(seqs) + 1)),
            "steps_per_s": round(rate, 1),
            "delay_ms": {"p50": round(q(0.5), 1), "p99": round(q(0.99), 1), "max": round(delays[-1] * 1000, 1)},
        }))
    finally:
        srv.terminate()
        srv.wait()

if __name__ == "__main__":
    main()
