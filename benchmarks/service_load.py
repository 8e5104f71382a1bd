"""The translation service under load: two bundles in one `onnxformer serve`, 32 clients over its three APIs.

    flock /tmp/onnxformer-bench.lock python benchmarks/service_load.py [--dates BUNDLE] [--marian BUNDLE]
        [--clients 32] [--requests 8] [--duration 600] [--threads 2] [--work DIR] [--json FILE]

Two real text models whose outputs vary with the input: the dates example (examples/dates/checkpoint, exported) and
a tiny Marian model with SentencePiece tokenizers (toolkit/testing/tiny_marian: trained briefly to reverse word
order, imported and exported), each built under --work unless given. One server on 127.0.0.1 (a free port, API
keys) serves both, `--languages dates=en:iso --languages marian=en:de`. Clients (threads) take turns over the models
and the APIs: LibreTranslate /translate (JSON bodies with lists, and forms), DeepL /v2/translate (forms with repeated
`text`) and /v1/generate; each sends --requests requests of 1-3 texts drawn from a seeded pool of mixed lengths
(one date or sentence; several joined with varied whitespace; for /translate and /v2/translate also texts over the
model's max_len). It stops by itself: after every request is answered, or at --duration (the rest unsent).

Every answer must equal `onnxformer generate`'s on the same bundle with the same options (greedy, max_new_tokens =
max_len): the compatible APIs' texts the output of `generate` (which splits texts into sentences as they do),
/v1/generate's that of `generate --no-split`. Then the same load again on two processes, one bundle each (each
server gets its model's half of the clients, both at once), for the memory of one process against two. Reports
per setup and API: requests, errors (an HTTP answer other than 200), lost (no answer at all), mismatches, requests
and generated tokens per second over the run's wall time, p50/p99 latency; and each server's resident memory
(VmRSS) after the same warm-up requests and after the load. Prints a table (--json FILE: the report). Exit 1 on
any error, lost request, mismatch or a server that does not exit 0 after SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from toolkit.apps.serve.loadtest import check_loopback, latency_ms  # noqa: E402

LANGUAGES = {"dates": ("en", "iso"), "marian": ("en", "de")}
APIS = ("libretranslate", "deepl", "generate")
KEY = "service-load-key"
SPACES = (" ", "  ", "\n", " \t")


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """`onnxformer ARGS` from this tree, checked (stdout kept)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "toolkit.apps.cli", *args], check=True, env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, **kwargs)


def build_bundles(work: Path, dates: Path | None, marian: Path | None) -> dict[str, Path]:
    """The two bundles: those given, else built under `work` (kept there for the next run)."""
    if dates is None:
        dates = work / "dates"
        if not (dates / "manifest.json").exists():
            cli("export", "examples/dates/checkpoint", "--out", str(dates), "--force")
    if marian is None:
        marian = work / "marian"
        if not (marian / "manifest.json").exists():
            from toolkit.testing.tiny_marian import build_tiny_marian

            build_tiny_marian(work / "marian-hf", steps=150)
            cli("import", str(work / "marian-hf"), "--out", str(work / "marian-checkpoint"), "--force")
            cli("export", str(work / "marian-checkpoint"), "--out", str(marian), "--force")
    return {"dates": dates, "marian": marian}


def pools(rng: random.Random, max_len: dict[str, int]) -> dict[str, dict[str, list[str]]]:
    """Per model: `single` texts (one date or sentence, within max_len: every API) and `joined` ones (2-4 sentences
    with varied whitespace around and between them; and texts without a sentence end, about three times max_len
    characters, that the service cuts into pieces: the compatible APIs only)."""
    from toolkit.reference.tasks.dates import held_out_examples
    from toolkit.testing.tiny_marian import held_out

    singles = {"dates": sorted({s for s, _ in held_out_examples()[:40]}), "marian": held_out(40)}
    out = {}
    for name, texts in singles.items():
        end = "." if name == "dates" else ""               # the Marian sentences end in punctuation already
        joined = [rng.choice(SPACES).join(t + end for t in rng.sample(texts, rng.randint(2, 4))) for _ in range(20)]
        for _ in range(6):
            words: list[str] = []
            while len(" and ".join(words)) <= 3 * max_len[name]:
                words.append(rng.choice(texts).rstrip(".!?,"))
            joined.append(" and ".join(words))
        out[name] = {"single": texts, "joined": [f" {t}\n" if i % 5 == 0 else t for i, t in enumerate(joined)]}
    return out


def references(bundle: Path, texts: list[str], max_len: int, split: bool) -> dict[str, dict]:
    """text -> its `onnxformer generate --json` record (greedy, max_new_tokens = max_len; --no-split unless
    `split`), all texts in one call as TEXT arguments."""
    out = cli("generate", str(bundle), *texts, "--provider", "cpu", "--max-new-tokens", str(max_len), "--json",
              *([] if split else ["--no-split"]), stderr=subprocess.DEVNULL).stdout
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in recs] == list(range(len(texts))), "generate gave other records than asked"
    return {texts[r["index"]]: r for r in recs}


class Server:
    """`onnxformer serve` of some bundles on 127.0.0.1 (a free port) with one API key, as a child process."""

    def __init__(self, bundles: dict[str, Path], work: Path, threads: int):
        keys = work / "keys.txt"
        keys.write_text(KEY + "\n")
        args = [f"{n}={p}" for n, p in bundles.items()]
        args += [f"--languages={n}={LANGUAGES[n][0]}:{LANGUAGES[n][1]}" for n in bundles]
        self.log = work / f"serve-{'-'.join(bundles)}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "toolkit.apps.cli", "serve", *args, "--api-keys",
                                          str(keys), "--host", "127.0.0.1", "--port", "0", "--provider", "cpu",
                                          "--threads", str(threads)], stderr=log, cwd=ROOT,
                                         env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline, self.url = time.monotonic() + 600, ""
        while not self.url:
            lines = [ln for ln in self.log.read_text().splitlines() if ln.startswith("ready: ")]
            self.url = check_loopback(lines[0][len("ready: "):]) if lines else ""
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: the server did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def rss_mb(self) -> dict[str, float]:
        """The server's resident memory now (VmRSS) and at its peak so far (VmHWM), in MiB (Linux /proc)."""
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines())
        return {k: round(int(fields[v].split()[0]) / 1024, 1) for k, v in (("rss", "VmRSS"), ("peak", "VmHWM"))}

    def stop(self) -> int:
        """SIGTERM (it answers what it accepted, then exits 0); its exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def send(client: httpx.Client, api: str, model: str, texts: list[str], form: bool, max_len: int) -> list[dict]:
    """One request; the answer's texts (and /v1/generate's ids) in order. httpx.HTTPError: no answer (lost);
    RuntimeError: an answer other than 200."""
    source, target = LANGUAGES[model]
    if api == "libretranslate":
        body = {"q": texts[0] if form else texts, "source": source, "target": target, "api_key": KEY}
        answer = client.post("/translate", **({"data": body} if form else {"json": body}))
    elif api == "deepl":
        answer = client.post("/v2/translate", data={"text": texts, "target_lang": target.upper(),
                                                    "source_lang": source.upper()},
                             headers={"Authorization": f"DeepL-Auth-Key {KEY}"})
    else:
        answer = client.post("/v1/generate", json={"model": model, "inputs": texts, "max_new_tokens": max_len},
                             headers={"Authorization": f"Bearer {KEY}"})
    if answer.status_code != 200:
        raise RuntimeError(f"{api} {answer.status_code}: {answer.text[:200]}")
    data = answer.json()
    if api == "libretranslate":
        out = data["translatedText"]
        return [{"text": t} for t in ([out] if isinstance(out, str) else out)]
    if api == "deepl":
        return [{"text": t["text"]} for t in data["translations"]]
    return [{"text": o["text"], "ids": o["ids"]} for o in data["outputs"]]


def load(url: str, refs: dict, texts: dict, clients: int, requests: int, duration: float, max_len: dict,
         seed: int) -> tuple[list[tuple], float]:
    """`clients` threads, client c on model c % 2 and API (c // 2) % 3, each sending `requests` requests (until
    `duration` seconds have passed); (api, model, outcome, seconds, tokens, detail) per request sent, and the wall
    time. Outcome: ok, error (an answer other than 200), lost (no answer), mismatch (not generate's)."""
    results: list[tuple] = []
    names = sorted(texts)
    deadline = time.monotonic() + duration

    def client_loop(c: int) -> None:
        model, api, rng = names[c % len(names)], APIS[(c // len(names)) % len(APIS)], random.Random(seed + c)
        pool = texts[model]["single"] + ([] if api == "generate" else texts[model]["joined"])
        expected_of = refs["whole" if api == "generate" else "split"][model]
        with httpx.Client(base_url=url, timeout=300) as client:
            for i in range(requests):
                if time.monotonic() > deadline:
                    return
                form = api == "libretranslate" and i % 2 == 1
                sample = rng.sample(pool, 1 if form else rng.randint(1, 3))
                expected = [expected_of[t] for t in sample]
                sent = time.monotonic()
                try:
                    answers = send(client, api, model, sample, form, max_len[model])
                    outcome, detail = "ok", ""
                    if [a["text"] for a in answers] != [e["text"] for e in expected] or any(
                            "ids" in a and a["ids"] != e["ids"] for a, e in zip(answers, expected)):
                        outcome, detail = "mismatch", f"{api} {model} {sample!r}: {answers!r} != {expected!r}"
                except httpx.HTTPError as exc:
                    outcome, detail = "lost", f"{api} {model}: {type(exc).__name__}: {exc}"
                except RuntimeError as exc:
                    outcome, detail = "error", str(exc)
                results.append((api, model, outcome, time.monotonic() - sent, sum(len(e["ids"]) for e in expected),
                                detail))

    start = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.monotonic() - start


def summarize(results: list[tuple], wall: float) -> dict[str, dict]:
    """Per API and in all: requests sent, outcomes, requests and generated tokens per second, latency (answered)."""
    rows = {}
    for api in (*APIS, "all"):
        mine = [r for r in results if api in ("all", r[0])]
        ok = [r for r in mine if r[2] == "ok"]
        counts = {k: sum(r[2] == k for r in mine) for k in ("error", "lost", "mismatch")}
        rows[api] = {"sent": len(mine), "ok": len(ok), "errors": counts["error"], "lost": counts["lost"],
                     "mismatches": counts["mismatch"], "rps": round(len(ok) / wall, 2),
                     "tokens_per_s": round(sum(r[4] for r in ok) / wall, 1),
                     "latency_ms": latency_ms([r[3] for r in mine if r[2] in ("ok", "mismatch")])}
    return rows


def warm_up(url: str, texts: dict, max_len: dict, models) -> None:
    """One request of every API to each of `models` (the same before every memory reading)."""
    with httpx.Client(base_url=url, timeout=300) as client:
        for model in models:
            for api in APIS:
                send(client, api, model, [texts[model]["single" if api == "generate" else "joined"][0]], False,
                     max_len[model])


def run_setup(groups: list[dict[str, Path]], args, texts: dict, refs: dict, max_len: dict) -> dict:
    """One server per group of bundles, all at once: warmed up, then loaded together (each with its share of the
    clients, its models' texts), each server's resident memory after the warm-up and after the load (MiB), the
    outcomes per API over all servers, and their exit statuses after SIGTERM."""
    servers: list[Server] = []
    try:
        for group in groups:
            servers.append(Server(group, args.work, args.threads))
            warm_up(servers[-1].url, texts, max_len, group)
        warm = [s.rss_mb() for s in servers]
        runs: list[tuple] = [([], 0.0)] * len(servers)

        def run(i: int) -> None:
            share = args.clients * len(groups[i]) // sum(map(len, groups))
            runs[i] = load(servers[i].url, refs, {n: texts[n] for n in groups[i]}, share, args.requests,
                           args.duration, max_len, args.seed)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(servers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        loaded = [s.rss_mb() for s in servers]
    finally:
        exits = [s.stop() for s in servers]
    results = [r for rs, _ in runs for r in rs]
    names = ["+".join(g) for g in groups]
    return {"servers": names, "exit": exits, "wall_s": round(max(w for _, w in runs), 2),
            "unsent": args.clients * args.requests - len(results),
            "apis": summarize(results, max(w for _, w in runs)),
            "problems": sorted({r[5] for r in results if r[5]})[:5],
            "rss_mb": {"warm": dict(zip(names, warm)), "loaded": dict(zip(names, loaded)),
                       "warm_sum": round(sum(m["rss"] for m in warm), 1),
                       "loaded_sum": round(sum(m["rss"] for m in loaded), 1)}}


def print_table(report: dict) -> None:
    print(f"{'setup':<14}{'api':<16}{'sent':>6}{'ok':>6}{'err':>5}{'lost':>5}{'diff':>5}{'req/s':>8}{'tok/s':>8}"
          f"{'p50 ms':>9}{'p99 ms':>9}")
    for setup in ("one_process", "two_processes"):
        for api, r in report[setup]["apis"].items():
            print(f"{setup:<14}{api:<16}{r['sent']:>6}{r['ok']:>6}{r['errors']:>5}{r['lost']:>5}{r['mismatches']:>5}"
                  f"{r['rps']:>8.2f}{r['tokens_per_s']:>8.1f}{r['latency_ms']['p50']:>9.0f}"
                  f"{r['latency_ms']['p99']:>9.0f}")
    for setup in ("one_process", "two_processes"):
        m, run = report[setup]["rss_mb"], report[setup]
        each = ", ".join(f"{n} {m['warm'][n]['rss']} -> {m['loaded'][n]['rss']} (peak {m['loaded'][n]['peak']})"
                         for n in run["servers"])
        print(f"{setup}: RSS MiB after warm-up -> after load: {each}; in all {m['warm_sum']} -> {m['loaded_sum']}; "
              f"wall {run['wall_s']} s, unsent {run['unsent']}, exit {run['exit']}")
    print(report["uptime"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dates", type=Path, help="the dates bundle [default: exported under --work]")
    ap.add_argument("--marian", type=Path, help="the tiny Marian bundle [default: built under --work]")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8, help="requests per client")
    ap.add_argument("--duration", type=float, default=600, help="stop sending after this many seconds")
    ap.add_argument("--threads", type=int, default=2, help="the server's intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "onnxformer-service-load")
    ap.add_argument("--json", type=Path, help="write the report here")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    bundles = build_bundles(args.work, args.dates, args.marian)
    max_len = {n: json.loads((p / "manifest.json").read_text())["model"]["max_len"] for n, p in bundles.items()}
    texts = pools(random.Random(args.seed), max_len)
    refs = {"split": {n: references(p, texts[n]["single"] + texts[n]["joined"], max_len[n], True)
                      for n, p in bundles.items()},
            "whole": {n: references(p, texts[n]["single"], max_len[n], False) for n, p in bundles.items()}}
    distinct = {n: len({r["text"] for r in refs["split"][n].values()}) for n in bundles}
    for name, count in distinct.items():                  # equality means something only if the outputs vary
        if count < max(4, len(refs["split"][name]) // 4):
            raise SystemExit(f"error: {name} gives {count} distinct outputs for {len(refs['split'][name])} texts; "
                             f"use a model whose outputs vary with the input")
    one = run_setup([bundles], args, texts, refs, max_len)
    two = run_setup([{n: p} for n, p in bundles.items()], args, texts, refs, max_len)
    report = {"command": " ".join(["python benchmarks/service_load.py", *(argv or sys.argv[1:])]),
              "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
              "bundles": {n: str(p) for n, p in bundles.items()}, "max_len": max_len, "clients": args.clients,
              "texts": {n: len(refs["split"][n]) for n in bundles}, "distinct_outputs": distinct,
              "requests_per_client": args.requests, "threads": args.threads, "one_process": one,
              "two_processes": two}
    print_table(report)
    for problem in one["problems"] + two["problems"]:
        print("problem:", problem[:500], file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    bad = [run for run in (one, two) if any(run["exit"]) or any(run["apis"]["all"][k] for k in
                                                                ("errors", "lost", "mismatches"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
