"""Data benchmark (issue 15): prepare throughput and peak memory, reader throughput, start-up.

    python benchmarks/data.py [--sizes-mb 100 1000] [--format jsonl|text] [--tokenizer bpe|gpt2-style|PATH/tokenizer.json]
                              [--json OUT]

* corpus: the bundled Tiny Shakespeare repeated into 16 MB files up to each size: JSONL documents of
  about 3 KB (``--format jsonl``, default: the shape of C4 / FineWeb rows) or plain text files
  (``--format text``: prepare reads them line by line, a line per ``encode`` call);
* prepare: ``ray-diloco prepare`` in a subprocess; tokens/s = all tokens / wall time; peak memory =
  the largest sum, sampled every 2 s, of the proportional set size (PSS) of the prepare and every
  Ray process started after it (Ray workers included; a shared page, such as torch's libraries or
  an object-store page, counted once); ``peak_rss_sum_bytes``: the same with RSS every 0.2 s (each shared page
  counted once per process that maps it: an upper bound);
* reader: tokens/s of one ShardReader drawing random training windows (seq_len 2048, batch 8);
* start-up: seconds to open a synthetic 1M- and 1B-token store and read a first batch (what a run
  does before its first inner step besides starting Ray and the model, which do not depend on the store).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_corpus(d: Path, mb: int, fmt: str = "jsonl") -> Path:
    """``mb`` MB of the bundled Tiny Shakespeare, repeated, in 16 MB files: ``jsonl`` (documents of
    about 3 KB, runs of whole paragraphs, the shape of C4 or FineWeb rows) or ``text`` (plain text,
    which prepare reads line by line)."""
    text = (ROOT / "ray_diloco" / "data" / "tinyshakespeare.txt").read_text()
    if fmt == "text":
        block = text * (16 * 2**20 // len(text) + 1)
        block = block[: 16 * 2**20]
    else:
        docs, cur = [], ""
        for para in text.split("\n\n"):
            cur += para + "\n\n"
            if len(cur) >= 3000:
                docs.append(json.dumps({"text": cur}) + "\n")
                cur = ""
        one = "".join(docs)
        block = "".join(itertools.islice(itertools.cycle(docs), 16 * 2**20 * len(docs) // len(one)))
    d.mkdir(parents=True, exist_ok=True)
    for i in range(max(1, mb // 16)):
        (d / f"part{i:04d}.{'txt' if fmt == 'text' else 'jsonl'}").write_text(block)
    return d


def _rss() -> dict[int, int]:
    """RSS in bytes of every process, from /proc (Linux)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = int((d / "statm").read_text().split()[1]) * 4096
            except (OSError, IndexError, ValueError):
                pass
    return out


def _pss(pids) -> int:
    """The sum of the proportional set sizes (``Pss`` of /proc/PID/smaps_rollup) of ``pids``, in
    bytes: each shared page (libraries, object-store pages) counted once over the processes
    that map it, so the sum is the memory these processes hold together."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, IndexError, ValueError):
            pass
    return total


def prepare(src: Path, out: Path, tokenizer: str) -> dict:
    before = set(_rss())
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ray_diloco.cli", "prepare", str(src), "--out", str(out),
                             "--tokenizer", tokenizer, "--no-progress"], cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = peak_rss = 0
    last_pss = 0.0
    while proc.poll() is None:
        rss = {pid: v for pid, v in _rss().items() if pid not in before}
        peak_rss = max(peak_rss, sum(rss.values()))
        if time.monotonic() - last_pss > 2.0:  # PSS walks every page table: the kernel time of a
            peak = max(peak, _pss(rss))  # sample every 0.2 s slowed the prepare by a third
            last_pss = time.monotonic()
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(proc.stderr.read().decode()[-2000:])
    m = json.loads((out / "manifest.json").read_text())
    tokens = m["tokens"]["train"] + m["tokens"]["val"]
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "peak_memory_bytes": peak,
            "peak_rss_sum_bytes": peak_rss}


def gpt2_style_tokenizer(src: Path, out: Path) -> str:
    """A Hugging Face ``tokenizer.json`` shaped like GPT-2's (byte-level BPE, 50,257 entries,
    ``<|endoftext|>``), trained on the corpus's first 16 MB (the hub's file cannot be downloaded
    here); ``prepare --tokenizer PATH`` loads it as it would GPT-2's."""
    from tokenizers import ByteLevelBPETokenizer

    first = next(iter(sorted(src.glob("part*"))))
    text = first.read_text()[: 16 * 2**20]
    if first.suffix == ".jsonl":
        text = "".join(json.loads(line)["text"] for line in text.splitlines() if line.endswith("}"))
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator([text], vocab_size=50257, min_frequency=1, special_tokens=["<|endoftext|>"])
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def synthetic_store(out: Path, tokens: int):
    from ray_diloco.components.text import char_tokenizer
    from ray_diloco.components.token_store import StoreWriter, TokenStore

    w = StoreWriter(str(out), 50000, 1 << 25)
    rng = np.random.default_rng(0)
    step = 1 << 24
    for a in range(0, tokens, step):
        w.add(rng.integers(0, 50000, min(step, tokens - a), dtype=np.uint16), np.zeros(0, np.uint16), {})
    w.add(np.zeros(0, np.uint16), rng.integers(0, 50000, 1 << 16, dtype=np.uint16), {})
    tok = char_tokenizer(["abc"])
    w.vocab_size = 50000
    w.finish(tok, {"split": {"method": "synthetic"}, "order": "feistel"})
    return TokenStore(str(out))


def reader_tokens_per_s(store, seconds: float = 5.0) -> float:
    from ray_diloco.components.data import ShardReader

    r = ShardReader(store.split("train"), 2048, 0, 4, seed=0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x, _, _ = r.next_batch(8)
        n += x.numel()
    return n / (time.perf_counter() - t0)


def startup_s(out: Path) -> float:
    from ray_diloco.components.data import ShardReader
    from ray_diloco.components.token_store import TokenStore

    t0 = time.perf_counter()
    st = TokenStore(str(out))
    st.tokenizer()
    ShardReader(st.split("train"), 2048, 0, 4, seed=0).next_batch(8)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--tokenizer", default="bpe",
                    help="bpe, char, a tokenizer.json path, or gpt2-style (a GPT-2-shaped file trained here)")
    ap.add_argument("--format", choices=["jsonl", "text"], default="jsonl",
                    help="jsonl: ~3 KB documents (C4-shaped); text: plain text files, read line by line")
    ap.add_argument("--startup-tokens", type=int, nargs=2, default=[10**6, 10**9])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res: dict = {"prepare": {}}
    with tempfile.TemporaryDirectory(dir=str(ROOT)) as tmp:
        tmp = Path(tmp)
        for mb in a.sizes_mb:
            src = build_corpus(tmp / f"src{mb}", mb, a.format)
            tok = gpt2_style_tokenizer(src, tmp / "gpt2-style") if a.tokenizer == "gpt2-style" else a.tokenizer
            res["prepare"][mb] = prepare(src, tmp / f"store{mb}", tok)
        res["tokenizer"], res["format"] = a.tokenizer, a.format
        res["prepare_tokens_per_s"] = res["prepare"][a.sizes_mb[-1]]["tokens_per_s"]
        res["prepare_peak_memory_bytes"] = {mb: r["peak_memory_bytes"] for mb, r in res["prepare"].items()}
        small, big = (synthetic_store(tmp / f"syn{n}", n) for n in a.startup_tokens)
        startup_s(Path(small.where))  # warm-up: the first call imports transformers
        res["startup_s_1m"], res["startup_s_1b"] = startup_s(Path(small.where)), startup_s(Path(big.where))
        res["reader_tokens_per_s"] = reader_tokens_per_s(big)
    print(f"{'figure':40s} value")
    for mb, r in res["prepare"].items():
        print(f"{f'prepare {mb} MB tokens/s':40s} {r['tokens_per_s']:,.0f}")
        print(f"{f'prepare {mb} MB peak memory PSS (GB)':40s} {r['peak_memory_bytes'] / 1e9:.2f}")
        print(f"{f'prepare {mb} MB peak RSS sum (GB)':40s} {r['peak_rss_sum_bytes'] / 1e9:.2f}")
    for k in ("reader_tokens_per_s", "startup_s_1m", "startup_s_1b"):
        print(f"{k:40s} {res[k]:,.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
