"""The prepared token store: fixed-size shards of raw tokens and a manifest (see docs/data.md).

Layout of a store (a local directory or a URI such as ``s3://bucket/c4``)::

    manifest.json           written last: a store without it is unfinished and is never read
    tokenizer/              the tokenizer (``save_pretrained``); its tokenizer.json's sha256 is in the manifest
    train-00000.bin ...     raw little-endian tokens (uint16 when the vocabulary fits, else uint32),
    val-00000.bin ...       documents separated by the tokenizer's EOS; every shard but a split's
                            last holds exactly ``shard_tokens`` tokens (nanoGPT's ``.bin`` layout, sharded)
    prepare-state.npz       only while ``prepare`` runs: what a rerun continues from

Every file is written under a temporary name and renamed (local), or put as one object (S3: a
multipart upload appears whole or not at all). The manifest lists per shard its token count, its
sha256 and a crc32 per ``chunk_bytes`` chunk; readers check a chunk's crc32 the first time they
touch it (so opening a store costs the same for 1M and 1B tokens) and refuse a corrupt shard.

:class:`TokenSplit` is one split as a read-only 1-D array (``len``, ``split[a:b]``): memory-mapped
shards when local; when remote, ``chunk_bytes`` ranges fetched on demand into a bounded LRU cache,
with :meth:`TokenSplit.prefetch` fetching ahead in background threads. It pickles as its address
(a few hundred bytes), so a Ray worker opens the shards itself and no corpus goes through the
object store (unless :meth:`TokenSplit.materialize` made it an in-memory array, the small path).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ray_diloco.components.storage import Location
from ray_diloco.errors import DataError

FORMAT = "ray-diloco-tokens"
VERSION = 1
MANIFEST = "manifest.json"
STATE = "prepare-state.npz"
TOKENIZER_DIR = "tokenizer"
#: crc32 granularity of the shards, and the size of a remote read.
CHUNK_BYTES = 1 << 20
#: Default tokens per shard (64 MiB of uint16).
SHARD_TOKENS = 1 << 25
#: Default bound of a remote split's chunk cache, in bytes.
CACHE_BYTES = 256 << 20
SPLITS = ("train", "val")


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (``vocab_size <= 65536``), else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def chunk_crcs(data: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """crc32 of each ``chunk_bytes`` slice of ``data`` (the last one may be shorter)."""
    view = memoryview(data)
    return [zlib.crc32(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)] or [0]


# ---------------------------------------------------------------------------------------
# writing


class StoreWriter:
    """Appends token batches to the shards of both splits; a rerun continues from the last flush.

    ``add(train_ids, val_ids, cursor)`` appends 1-D integer arrays (documents already joined with
    EOS) and records ``cursor`` (a JSON-able dict: where in the source the next batch starts)
    whenever a shard is finished, together with the tokens not yet in a shard (the carry), in
    ``prepare-state.npz``. :meth:`finish` writes the last shards, the tokenizer and the manifest.
    """

    def __init__(self, out: str, vocab_size: int, shard_tokens: int = SHARD_TOKENS, fingerprint: str = "",
                 field: str = "--out"):  # fmt: skip
        if shard_tokens < 1:
            raise DataError(f"--shard-tokens = {shard_tokens}: must be at least 1")
        self.loc = Location(out, field)  # errors call the store ``field``
        self.vocab_size, self.dtype, self.shard_tokens = vocab_size, dtype_for(vocab_size), shard_tokens
        self.fingerprint = fingerprint
        self.shards: dict[str, list[dict]] = {s: [] for s in SPLITS}
        self.buf: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        self.buffered = {s: 0 for s in SPLITS}
        self.documents = {s: 0 for s in SPLITS}
        self.cursor: dict[str, Any] = {}

    def resume(self) -> dict[str, Any] | None:
        """Load ``prepare-state.npz`` if it belongs to the same source and options (same
        ``fingerprint``); returns the cursor to continue from, or None to start afresh."""
        raw = self.loc.read_bytes(STATE)
        if raw is None:
            return None
        with np.load(io.BytesIO(raw)) as z:
            state = json.loads(bytes(z["state"]).decode())
            if state.get("fingerprint") != self.fingerprint or state.get("dtype") != self.dtype.str:
                return None
            for s in SPLITS:
                carry = z[f"carry_{s}"].astype(self.dtype)
                self.buf[s], self.buffered[s] = ([carry] if len(carry) else []), len(carry)
        self.shards, self.documents, self.cursor = state["shards"], state["documents"], state["cursor"]
        return self.cursor

    def add(
        self, train_ids: np.ndarray, val_ids: np.ndarray, cursor: dict[str, Any], documents: tuple[int, int] = (0, 0)
    ) -> None:
        """Append one batch's tokens (``documents`` = documents in each split); writes every
        shard that fills up, then the state."""
        flushed = False
        for s, ids, docs in zip(SPLITS, (train_ids, val_ids), documents):
            if len(ids):
                if ids.size and int(ids.max()) >= self.vocab_size:
                    raise DataError(f"token id {int(ids.max())} >= the tokenizer's vocabulary {self.vocab_size}")
                self.buf[s].append(np.asarray(ids, dtype=self.dtype))
                self.buffered[s] += len(ids)
            self.documents[s] += docs
            while self.buffered[s] >= self.shard_tokens:
                self._write_shard(s, self.shard_tokens)
                flushed = True
        self.cursor = cursor
        if flushed:
            self._save_state()

    def _write_shard(self, split: str, n: int, suffix: str = "") -> None:
        data = np.concatenate(self.buf[split]) if len(self.buf[split]) != 1 else self.buf[split][0]
        shard, rest = data[:n], data[n:]
        name = f"{split}-{len(self.shards[split]):05d}{suffix}.bin"
        raw = np.ascontiguousarray(shard).data.cast("B")
        self.loc.write_bytes(name, raw)
        self.shards[split].append(
            {"file": name, "tokens": int(n), "sha256": hashlib.sha256(raw).hexdigest(), "crc32": chunk_crcs(raw)}
        )
        self.buf[split], self.buffered[split] = ([rest] if len(rest) else []), len(rest)

    def _save_state(self) -> None:
        state = {
            "fingerprint": self.fingerprint,
            "dtype": self.dtype.str,
            "shards": self.shards,
            "documents": self.documents,
            "cursor": self.cursor,
        }
        carry: dict[str, Any] = {
            f"carry_{s}": (np.concatenate(self.buf[s]) if self.buf[s] else np.zeros(0, self.dtype)) for s in SPLITS
        }
        out = io.BytesIO()
        np.savez(out, state=np.frombuffer(json.dumps(state).encode(), dtype=np.uint8), **carry)
        self.loc.write_bytes(STATE, out.getbuffer())

    def finish(self, tokenizer: Any, meta: dict[str, Any], tail: float | None = None) -> dict[str, Any]:
        """Write the last (shorter) shards, the tokenizer and, last, the manifest; returns it.
        ``meta`` (source, split method, order, ...) is stored in the manifest as is.

        ``tail``: the tail split (``data.path``'s rule; ``prepare --val-split tail``): every token
        was added to ``train`` and its last :func:`tail_tokens` ``(total, tail)`` become ``val``.
        The finished train shards that held some are written again under new names (``-tail``) and
        the old files deleted once the manifest is written, so a prepare killed meanwhile continues
        intact; a stream that never filled a shard gets the plain names.

        Raises:
            DataError: a split is empty, or ``tail`` with tokens added to ``val``.
        """
        replaced = self._split_tail(tail) if tail is not None else []
        suffix = "-tail" if replaced else ""  # never a finished shard's name for other tokens
        for s in SPLITS:
            while self.buffered[s] > self.shard_tokens:
                self._write_shard(s, self.shard_tokens, suffix)
            if self.buffered[s]:
                self._write_shard(s, self.buffered[s], suffix)
        if not self.shards["train"]:
            raise DataError("no training tokens: every document went to the validation split or was empty")
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            tok_sha = hashlib.sha256((Path(tmp) / "tokenizer.json").read_bytes()).hexdigest()
            self.loc.put_dir(Path(tmp), TOKENIZER_DIR)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype.name,
            "vocab_size": int(self.vocab_size),
            "eos_id": getattr(tokenizer, "eos_token_id", None),
            "tokenizer": {"dir": TOKENIZER_DIR, "sha256": tok_sha},
            "shard_tokens": self.shard_tokens,
            "chunk_bytes": CHUNK_BYTES,
            "documents": self.documents,
            "tokens": {s: sum(e["tokens"] for e in self.shards[s]) for s in SPLITS},
            "shards": self.shards,
            **meta,
        }
        self.loc.write_bytes(MANIFEST, json.dumps(manifest, indent=1).encode())
        for name in replaced:
            self.loc.delete(name)
        self.loc.delete(STATE)
        return manifest

    def _split_tail(self, fraction: float) -> list[str]:
        """Move the stream's last ``tail_tokens(total, fraction)`` tokens from ``train`` to
        ``val``'s buffer, reading back the finished train shards that hold them; returns their
        files (deleted after the manifest)."""
        if self.shards["val"] or self.buffered["val"]:
            raise DataError("a tail split takes every token as train first: tokens were added to val")
        total = sum(e["tokens"] for e in self.shards["train"]) + self.buffered["train"]
        n_val, have = tail_tokens(total, fraction), self.buffered["train"]
        back: list[np.ndarray] = []
        replaced: list[str] = []
        while have < n_val and self.shards["train"]:
            e = self.shards["train"].pop()
            raw = self.loc.read_bytes(e["file"])
            if raw is None or len(raw) != e["tokens"] * self.dtype.itemsize:
                raise DataError(
                    f"{self.loc.field} {self.loc.where!r}: {e['file']} is missing or was changed while prepare ran"
                )
            back.insert(0, np.frombuffer(raw, dtype=self.dtype))
            replaced.append(e["file"])
            have += e["tokens"]
        parts = back + self.buf["train"]
        data = np.concatenate(parts) if parts else np.zeros(0, self.dtype)
        cut = len(data) - n_val
        self.buf["train"], self.buffered["train"] = ([data[:cut]] if cut else []), cut
        self.buf["val"], self.buffered["val"] = ([data[cut:]] if n_val else []), n_val
        return replaced


# ---------------------------------------------------------------------------------------
# reading


#: The window orders a manifest may name, as the reader calls them (``ShardReader`` in
#: components/data.py): ``feistel`` (``prepare``'s pipeline: a keyed permutation computed per
#: index) and ``strided`` (a corpus tokenised in process: one numpy permutation per epoch, shard
#: ``s`` of ``S`` reading ``perm[s::S]``), which manifests written before it had a name call ``legacy``.
ORDERS = {"feistel": "feistel", "strided": "strided", "legacy": "strided"}


class TokenStore:
    """A finished store, opened by its manifest (nothing else is read until a split is used).

    Raises:
        DataError: no manifest (not a store, or a prepare that has not finished), another format
        version, or an unreadable manifest.
    """

    def __init__(self, where: str, field: str = "data.prepared", cache_bytes: int = CACHE_BYTES):
        self.where, self.field, self.cache_bytes = str(where), field, cache_bytes
        self.loc = Location(where, field)
        raw = self.loc.read_bytes(MANIFEST)
        if raw is None:
            hint = (
                "its prepare has not finished: rerun it to continue"
                if self.loc.read_bytes(STATE) is not None
                else "prepare one with: ray-diloco prepare SOURCE --out DIR"
            )
            raise DataError(f"{field} = {where!r}: no {MANIFEST} ({hint})")
        try:
            self.manifest = json.loads(raw)
        except ValueError:
            raise DataError(f"{field} = {where!r}: {MANIFEST} is not valid JSON") from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise DataError(
                f"{field} = {where!r}: store format {self.manifest.get('format')!r} version "
                f"{self.manifest.get('version')!r}; this ray-diloco reads {FORMAT!r} version {VERSION}"
            )

    @property
    def id(self) -> str:
        """16 hex digits identifying the content (dtype, tokenizer, every shard's sha256)."""
        m = self.manifest
        key = json.dumps(
            [
                m["dtype"],
                m["tokenizer"]["sha256"],
                m.get("split"),
                m.get("order"),
                [[e["sha256"] for e in m["shards"][s]] for s in SPLITS],
            ]
        )
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size."""
        return int(self.manifest["vocab_size"])

    @property
    def tokenizer_sha256(self) -> str:
        """sha256 of the store's tokenizer.json."""
        return self.manifest["tokenizer"]["sha256"]

    def tokenizer(self):
        """The store's tokenizer (``PreTrainedTokenizerFast``), checked against the manifest's hash.

        Raises:
            DataError: missing or changed tokenizer files.
        """
        files = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
        if self.loc.remote:
            local = self.loc.get_dir(TOKENIZER_DIR, files, Path(tempfile.mkdtemp(prefix="ray-diloco-tok-")))
        else:
            local = Path(self.loc.path(TOKENIZER_DIR))
        tok_json = local / "tokenizer.json"
        if not tok_json.is_file() or hashlib.sha256(tok_json.read_bytes()).hexdigest() != self.tokenizer_sha256:
            raise DataError(
                f"{self.field} = {self.where!r}: its tokenizer/tokenizer.json is missing or differs from "
                "the one the manifest records; prepare the store again"
            )
        return load_saved_tokenizer(local)

    def split(self, name: str) -> TokenSplit:
        """The ``train`` or ``val`` split as a :class:`TokenSplit`."""
        m = self.manifest
        return TokenSplit(
            self.where,
            name,
            m["shards"][name],
            m["dtype"],
            m["chunk_bytes"],
            self.field,
            order=ORDERS.get(m.get("order", "feistel"), "feistel"),
            cache_bytes=self.cache_bytes,
        )


class TokenSplit:
    """One split as a read-only 1-D token array over its shards: ``len(s)`` tokens, ``s[a:b]`` a
    numpy array (the store's dtype) copied out of the shards; windows may cross shard boundaries.

    ``order`` is the window order a reader uses on it (:data:`ORDERS`). Pickled, it is
    its address only (unless :meth:`materialize` loaded it into memory).

    Raises (on reading):
        DataError: a shard is missing, has another size than the manifest's, or fails its checksum.
    """

    def __init__(
        self,
        where: str,
        name: str,
        shards: list[dict],
        dtype: str,
        chunk_bytes: int,
        field: str,
        order: str = "feistel",
        start: int = 0,
        stop: int | None = None,
        cache_bytes: int = CACHE_BYTES,
    ):
        self.where, self.name, self.shards, self.dtype = where, name, shards, np.dtype(dtype).newbyteorder("<")
        self.chunk_bytes, self.field, self.order, self.cache_bytes = chunk_bytes, field, order, cache_bytes
        self.offsets = np.concatenate([[0], np.cumsum([e["tokens"] for e in shards], dtype=np.int64)])
        self.start, self.stop = start, int(self.offsets[-1]) if stop is None else stop
        self._inline: np.ndarray | None = None
        self._io: _ShardIO | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_io": None}

    def head(self, n: int) -> TokenSplit:
        """The first ``min(n, len)`` tokens as a split of their own."""
        out = TokenSplit(
            self.where,
            self.name,
            self.shards,
            self.dtype.str,
            self.chunk_bytes,
            self.field,
            self.order,
            self.start,
            min(self.stop, self.start + int(n)),
            self.cache_bytes,
        )
        out._inline = self._inline[: len(out)] if self._inline is not None else None
        return out

    def materialize(self) -> TokenSplit:
        """Load the split into memory (small stores: it then pickles by value, as an array); returns self."""
        if self._inline is None:
            self._inline = self.read(0, len(self))
        return self

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a TokenSplit reads contiguous slices only")
        a, b, _ = key.indices(len(self))
        return self.read(a, max(a, b))

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens ``[a, b)`` of the split (``0 <= a <= b <= len``), a new array."""
        if self._inline is not None:
            return np.array(self._inline[a:b])
        if self._io is None:
            self._io = _ShardIO(self)
        return self._io.read(self.start + a, self.start + b)

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        """Start fetching the chunks of token ranges ``[(a, b), ...]`` in the background (remote
        stores; a no-op for local or in-memory ones)."""
        if self._inline is None:
            if self._io is None:
                self._io = _ShardIO(self)
            self._io.prefetch([(self.start + a, self.start + b) for a, b in ranges])

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """``np.asarray(split)``: the whole split (small splits; a large store is read whole)."""
        out = self.read(0, len(self))
        return out if dtype is None else out.astype(dtype)

    def to_array(self) -> np.ndarray:
        """The whole split as an int32 array (small splits: tests, evaluation)."""
        return self.read(0, len(self)).astype(np.int32)


class _ShardIO:
    """The shards of one split in one process: memory maps (local) or a chunk cache (remote)."""

    def __init__(self, split: TokenSplit):
        self.s, self.loc = split, Location(split.where, split.field)
        self.item = split.dtype.itemsize
        self.maps: dict[int, np.ndarray] = {}
        self.verified: set[tuple[int, int]] = set()
        self.cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self.pending: dict[tuple[int, int], Any] = {}
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="token-prefetch") if self.loc.remote else None

    def _bad(self, k: int, what: str) -> DataError:
        return DataError(
            f"{self.s.field} = {self.s.where!r}: shard {self.s.shards[k]['file']} {what}; "
            "the store is damaged: prepare it again"
        )

    def _map(self, k: int) -> np.ndarray:
        if k not in self.maps:
            path, n = self.loc.path(self.s.shards[k]["file"]), self.s.shards[k]["tokens"]
            try:
                size = os.path.getsize(path)
            except OSError:
                raise self._bad(k, "is missing") from None
            if size != n * self.item:
                raise self._bad(k, f"holds {size} bytes, the manifest says {n * self.item}")
            self.maps[k] = np.memmap(path, dtype=self.s.dtype, mode="r")
        return self.maps[k]

    def _check(self, k: int, c: int, data: bytes | memoryview) -> None:
        if zlib.crc32(data) != self.s.shards[k]["crc32"][c]:
            raise self._bad(k, f"fails its checksum (chunk {c})")
        self.verified.add((k, c))

    def _fetch(self, k: int, c: int) -> bytes:
        """Chunk ``c`` of remote shard ``k``, checked."""
        entry, cb = self.s.shards[k], self.s.chunk_bytes
        size = entry["tokens"] * self.item
        try:
            with self.loc.fs.open_input_file(self.loc.path(entry["file"])) as f:
                data = f.read_at(min(cb, size - c * cb), c * cb)
        except OSError:
            raise self._bad(k, "cannot be read") from None
        self._check(k, c, data)
        return data

    def _chunk(self, k: int, c: int) -> bytes:
        key = (k, c)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
            fut = self.pending.pop(key, None)
        data = fut.result() if fut is not None else self._fetch(k, c)
        with self.lock:
            self.cache[key] = data
            while len(self.cache) * self.s.chunk_bytes > self.s.cache_bytes and len(self.cache) > 1:
                self.cache.popitem(last=False)
        return data

    def _piece(self, k: int, a: int, b: int) -> np.ndarray:
        """Tokens ``[a, b)`` of shard ``k``."""
        cb, item = self.s.chunk_bytes, self.item
        c0, c1 = a * item // cb, max(a * item, b * item - 1) // cb
        if not self.loc.remote:
            mm = self._map(k)
            for c in range(c0, c1 + 1):
                if (k, c) not in self.verified:
                    self._check(k, c, mm[c * cb // item : (c + 1) * cb // item].data.cast("B"))
            return np.array(mm[a:b])
        raw = b"".join(self._chunk(k, c) for c in range(c0, c1 + 1))
        lo = a * item - c0 * cb
        return np.frombuffer(raw, dtype=self.s.dtype, count=b - a, offset=lo).copy()

    def read(self, a: int, b: int) -> np.ndarray:
        offsets = self.s.offsets
        parts, k = [], int(np.searchsorted(offsets, a, side="right")) - 1
        while a < b:
            end = min(b, int(offsets[k + 1]))
            parts.append(self._piece(k, a - int(offsets[k]), end - int(offsets[k])))
            a, k = end, k + 1
        if not parts:
            return np.zeros(0, dtype=self.s.dtype)
        return np.concatenate(parts) if len(parts) != 1 else parts[0]

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        if self.pool is None:
            return
        offsets, cb = self.s.offsets, self.s.chunk_bytes
        for a, b in ranges:
            k = int(np.searchsorted(offsets, a, side="right")) - 1
            while a < b and k < len(self.s.shards):
                end = min(b, int(offsets[k + 1]))
                lo, hi = (a - int(offsets[k])) * self.item, (end - int(offsets[k])) * self.item
                for c in range(lo // cb, (max(lo, hi - 1)) // cb + 1):
                    with self.lock:
                        if (k, c) not in self.cache and (k, c) not in self.pending:
                            self.pending[(k, c)] = self.pool.submit(self._fetch, k, c)
                a, k = end, k + 1


def tail_tokens(total: int, fraction: float) -> int:
    """The validation tokens of the tail split of a ``total``-token stream: the last
    ``round(total * fraction)`` (``data.path``'s rule, in memory and in a store alike)."""
    return int(round(total * fraction))


def write_store(
    out: str,
    tokenizer: Any,
    train: np.ndarray,
    val: np.ndarray | None,
    meta: dict[str, Any],
    shard_tokens: int = SHARD_TOKENS,
    vocab_size: int | None = None,
    tail: float | None = None,
) -> TokenStore:
    """Write the token streams ``train`` and ``val`` (1-D integer arrays; ``val`` None with
    ``tail``: the tail split of ``train``, :meth:`StoreWriter.finish`) as a store and open it.
    ``vocab_size`` defaults to ``len(tokenizer)``."""
    w = StoreWriter(out, vocab_size or len(tokenizer), shard_tokens)
    w.add(train, np.zeros(0, np.int64) if val is None else val, {}, (0, 0))
    w.finish(tokenizer, meta, tail)
    return TokenStore(out, "--out")


def load_saved_tokenizer(directory: Path):
    """A tokenizer saved with ``save_pretrained`` (a run's ``tokenizer/``).

    Raises:
        DataError: when it cannot be loaded.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:
        raise DataError(f"tokenizer in {directory}: cannot load ({type(e).__name__})") from None
