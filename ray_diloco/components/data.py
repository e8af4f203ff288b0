"""A run's corpus: the cache of tokenised local files, packing and disjoint sharding.

* Sources: local ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` files (default: the
  bundled Tiny Shakespeare), a hub dataset by name (streamed, capped by ``max_documents``), or a
  prepared token store. Reading and tokenising: :mod:`~ray_diloco.components.text` (in this
  process) or :mod:`~ray_diloco.components.prepare` (Ray Data, for a file over
  ``data.in_process_bytes``); both write the cache entry with the same store writer. The
  tokenizer is saved in the run directory so ``resume``, ``eval`` and the export reuse it.
* Packing: documents are joined (with the tokenizer's EOS when it has one) into one token stream,
  split 90/10 (``val_fraction``) into train and validation streams (the tail of the stream).
* Sharding (DiLoCo section 2, "each replica trains on its own shard"): every epoch the train
  windows are permuted with ``(seed, epoch)``; shard ``s`` of ``S`` (one per (replica, rank))
  reads ``perm[s::S]``. No window is read by two shards within an epoch. Each epoch shifts the
  window boundaries by a seeded offset so later epochs see new windows. The read position
  ``(epoch, pos)`` is part of every checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ray_diloco.components.text import build_tokenizer, file_type, load_texts, source_file, tokenize
from ray_diloco.components.token_store import TokenSplit
from ray_diloco.config import DataConfig
from ray_diloco.errors import ClusterError, DataError

logger = logging.getLogger(__name__)

#: One split of a corpus: an int32 array ``[n_tokens]`` (tokenised in this process) or a token
#: store's :class:`~ray_diloco.components.token_store.TokenSplit` (same ``len`` and slicing).
Split = np.ndarray | TokenSplit


def window_order(tokens: Split) -> str:
    """The order a :class:`ShardReader` reads ``tokens``' windows in: a store's split says it (its
    manifest's ``order``: ``feistel`` from ``prepare``'s pipeline, ``strided`` for a small file's cache entry); an
    array tokenised in this process is read in the ``strided`` order."""
    return tokens.order if isinstance(tokens, TokenSplit) else "strided"


@dataclass
class Corpus:
    """Tokenised corpus. ``train``/``val``: token ids, shape ``[n_tokens]``: int32 arrays, or
    :class:`~ray_diloco.components.token_store.TokenSplit` s (a prepared store's, or a cached
    local file's loaded into memory)."""

    train: Split
    val: Split
    vocab_size: int
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    store_id: str | None = None

    @property
    def fingerprint(self) -> str:
        """What a checkpoint records to detect a changed corpus on resume: ``store:ID`` for a
        prepared store (its manifest's checksums, no data read), else the sha256 (first 16 hex
        digits) of both token streams."""
        if self.store_id is not None:
            return f"store:{self.store_id}"
        h = hashlib.sha256()
        for split in (self.train, self.val):
            h.update((split.to_array() if isinstance(split, TokenSplit) else np.asarray(split, np.int32)).tobytes())
        return h.hexdigest()[:16]


#: Validation tokens an evaluation reads when ``run.eval_tokens`` is None (at most).
EVAL_TOKENS = 1 << 20


def eval_split(val: Split, eval_tokens: int | None) -> Split:
    """The validation tokens an evaluation reads: the first ``eval_tokens`` (+1, the last window's
    target) of ``val`` (default :data:`EVAL_TOKENS`); ``val`` itself when it is no longer."""
    keep = (eval_tokens if eval_tokens is not None else EVAL_TOKENS) + 1
    if len(val) <= keep:
        return val
    return val.head(keep) if isinstance(val, TokenSplit) else val[:keep]


def open_prepared(cfg: DataConfig, tokenizer: Any = None) -> Corpus:
    """The corpus of the store ``cfg.prepared`` (:mod:`~ray_diloco.components.token_store`):
    ``train``/``val`` are :class:`TokenSplit` s (nothing is read but the manifest and tokenizer).
    ``tokenizer`` (a resumed run's), or ``data.tokenizer`` when it names one (``model.init_from``'s
    model's), must be the store's.

    Raises:
        DataError: not a store, another tokenizer than the run's, a split too short for ``seq_len``.
    """
    from ray_diloco.components.token_store import TokenStore

    assert cfg.prepared is not None  # a prepared corpus: the caller checked
    store = TokenStore(cfg.prepared)
    tok = store.tokenizer()
    if tokenizer is not None and tokenizer.backend_tokenizer.to_str() != tok.backend_tokenizer.to_str():
        raise DataError(
            f"data.prepared = {cfg.prepared!r}: its tokenizer differs from the run's (tokenizer/); "
            "a run reads the store it was trained on"
        )
    if tokenizer is None and cfg.tokenizer not in ("char", "bpe"):  # a named one: model.init_from's
        from ray_diloco.components.text import build_tokenizer

        if build_tokenizer(cfg, []).backend_tokenizer.to_str() != tok.backend_tokenizer.to_str():
            raise DataError(
                f"data.prepared = {cfg.prepared!r}: its tokenizer is not data.tokenizer = {cfg.tokenizer!r} "
                "(model.init_from's unless set): vocabularies differ; prepare the store with --tokenizer "
                f"{cfg.tokenizer}"
            )
    train, val = store.split("train"), store.split("val")
    need = cfg.seq_len + 1
    if len(train) < 2 * need or len(val) < need:
        raise DataError(
            f"data.prepared = {cfg.prepared!r}: {len(train)} train / {len(val)} validation tokens; "
            f"data.seq_len = {cfg.seq_len} needs at least {2 * need} / {need}"
        )
    return Corpus(train=train, val=val, vocab_size=store.vocab_size, tokenizer=tok, store_id=store.id)


def load_corpus(
    cfg: DataConfig, tokenizer_dir: Path | None = None, tokenizer: Any = None, address: str | None = None
) -> Corpus:
    """Load, tokenise and split the corpus.

    ``cfg.prepared``: the store is opened (:func:`open_prepared`). A local file (``data.path`` or
    the bundled corpus): tokenised once into a cached store (:func:`cached_corpus`; a big one by
    Ray Data on the cluster at ``address``), loaded into memory. A hub dataset: loaded and tokenised here. ``tokenizer`` (for example one restored from
    a run directory) is used as is; otherwise one is built from ``cfg`` and, when
    ``tokenizer_dir`` is given, saved there.

    Raises:
        DataError: when loading fails or a split is shorter than one sequence.
    """
    if cfg.prepared is not None:
        return open_prepared(cfg, tokenizer)
    path = source_file(cfg)
    corpus = cached_corpus(cfg, path, tokenizer, address) if path is not None else _tokenized(cfg, tokenizer)
    need = cfg.seq_len + 1
    if len(corpus.train) < 2 * need or len(corpus.val) < need:
        raise DataError(
            f"data: corpus too small: {len(corpus.train)} train / {len(corpus.val)} validation tokens; "
            f"data.seq_len = {cfg.seq_len} needs at least {2 * need} / {need}"
        )
    if tokenizer is None and tokenizer_dir is not None:
        corpus.tokenizer.save_pretrained(str(tokenizer_dir))
    return corpus


def _stream(cfg: DataConfig, tokenizer: Any) -> tuple[np.ndarray, Any]:
    """``(ids, tokenizer)``: the corpus tokenised in this process, documents joined (one int32
    stream), with ``tokenizer`` or one built from ``cfg`` on the texts."""
    texts = load_texts(cfg)
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(cfg, texts)
    return tokenize(tokenizer, texts), tokenizer


def _tokenized(cfg: DataConfig, tokenizer: Any) -> Corpus:
    """The corpus tokenised in this process, in memory: the tail ``val_fraction`` held out."""
    return _in_memory(*_stream(cfg, tokenizer), cfg.val_fraction)


def _in_memory(ids: np.ndarray, tokenizer: Any, fraction: float) -> Corpus:
    """The stream ``ids`` as an in-memory corpus, its tail ``fraction`` held out
    (``token_store.tail_tokens``, the rule a cached store's writer applies)."""
    from ray_diloco.components.token_store import tail_tokens

    cut = len(ids) - tail_tokens(len(ids), fraction)
    return Corpus(train=ids[:cut], val=ids[cut:], vocab_size=len(tokenizer), tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------
# the small path's cache: a local file tokenised once into a token store


#: Bump when what a cache entry holds for the same key changes.
CACHE_VERSION = 1


def cache_root(cfg: DataConfig) -> Path:
    """Where tokenised local files are cached: ``data.cache_dir``, else ``$RAY_DILOCO_CACHE``, else
    ``~/.cache/ray-diloco``; the stores live in its ``tokens/`` folder."""
    root = cfg.cache_dir or os.environ.get("RAY_DILOCO_CACHE") or "~/.cache/ray-diloco"
    return Path(root).expanduser() / "tokens"


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of the file's bytes, read in 16 MiB blocks.

    Raises:
        DataError: the file cannot be read."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    except OSError as e:
        raise DataError(f"data.path = {str(path)!r}: cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    return h.hexdigest()


def by_ray_data(cfg: DataConfig, path: Path) -> bool:
    """Whether the local file ``path`` is tokenised by ``prepare``'s Ray Data pipeline (bigger
    than ``data.in_process_bytes`` and no ``max_documents`` cap) rather than in this process."""
    return cfg.max_documents is None and path.stat().st_size > cfg.in_process_bytes


def cache_key(cfg: DataConfig, path: Path, tokenizer: Any = None, file_hash: str | None = None) -> str:
    """24 hex digits naming the cache entry of ``path``: the sha256 of the file's bytes
    (``file_hash`` when the caller has it), the settings that shape its tokens (text field,
    document cap, validation fraction, the pipeline when it is Ray Data's) and the tokenizer: the
    given one's JSON and EOS, or the recipe of ``data.tokenizer`` (``char`` and ``bpe`` are built
    from the text; a name or path is loaded and its JSON hashed, so a tokenizer changed on disk
    gets a new entry)."""
    file_hash = file_hash or file_sha256(path)
    if tokenizer is None and cfg.tokenizer not in ("char", "bpe"):
        tokenizer = build_tokenizer(cfg, [])
    if tokenizer is not None:
        tok = [
            hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest(),
            getattr(tokenizer, "eos_token_id", None),
        ]
    else:
        tok = [cfg.tokenizer, cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else None]
    recipe = {
        "version": CACHE_VERSION,
        "file": file_hash,
        "format": file_type(str(path), "data.path"),
        "text_field": cfg.text_field,
        "max_documents": cfg.max_documents,
        "val_fraction": cfg.val_fraction,
        "tokenizer": tok,
    }
    if by_ray_data(cfg, path):  # its own rules (text lines, a sampled char/bpe vocabulary, Feistel order)
        recipe["pipeline"] = "ray-data"
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:24]


def cached_corpus(cfg: DataConfig, path: Path, tokenizer: Any = None, address: str | None = None) -> Corpus:
    """The corpus of the local file ``path`` through the cache (:class:`CacheEntry`): loaded from
    its entry when one was written before (no tokenising), else tokenised, written and loaded.
    The tokens equal those of tokenising in the process, so the fingerprint (sha256 of the int32
    streams) and a run's loss are those of before the cache. A slow (Python) tokenizer has no
    JSON to key an entry by: its corpus is tokenised in the process.

    Raises:
        DataError: as :func:`load_texts`, :func:`build_tokenizer`, or a corpus too small for ``seq_len``.
    """
    if tokenizer is not None and not hasattr(tokenizer, "backend_tokenizer"):
        return _tokenized(cfg, tokenizer)
    entry = CacheEntry(cfg, path, tokenizer)
    corpus = entry.load()
    return corpus if corpus is not None else entry.build(address)


class CacheEntry:
    """One entry of the data cache: the token store of a local file under ``cache_root``, named by
    :func:`cache_key` (the file's bytes, the tokenizer, the recipe). Its splits are in-memory
    :class:`~ray_diloco.components.token_store.TokenSplit` s read by the same :class:`ShardReader`.

    A file up to ``data.in_process_bytes`` is tokenised in this process, its tail ``val_fraction``
    held out, window order ``strided``; a bigger one by ``prepare``'s pipeline (Ray Data on the
    cluster at ``address``, or a Ray of its own), in that pipeline's window order (``feistel``)
    and reading rules (a text file a row per line; ``char``/``bpe`` from a sample), keyed apart.
    An entry is written under a temporary name and renamed whole (:meth:`publish`: two runs
    starting together, the first rename wins and the other uses it); a damaged one is rebuilt.

    Args:
        cfg: the run's ``data`` section. path: the local file. tokenizer: a resume's (or None:
            built from ``cfg``).
    """

    def __init__(self, cfg: DataConfig, path: Path, tokenizer: Any = None):
        self.cfg, self.path, self.tokenizer = cfg, path, tokenizer
        file_hash = file_sha256(path)  # once: a resume's two keys (its tokenizer's, the recipe's) share it
        self.root = cache_root(cfg)
        self.key = cache_key(cfg, path, tokenizer, file_hash)
        self.dir = self.root / self.key
        if tokenizer is not None and not self._written() and cfg.tokenizer in ("char", "bpe"):
            recipe = self.root / cache_key(cfg, path, file_hash=file_hash)  # the entry a resume's first run wrote
            if (recipe / "manifest.json").is_file() and self._same_tokenizer(recipe):
                self.dir = recipe

    def _written(self) -> bool:
        return (self.dir / "manifest.json").is_file()

    def _same_tokenizer(self, entry: Path) -> bool:
        from ray_diloco.components.token_store import TokenStore

        try:
            tok = TokenStore(str(entry), "data.cache_dir").tokenizer()
        except DataError:
            return False
        return bool(tok.backend_tokenizer.to_str() == self.tokenizer.backend_tokenizer.to_str())

    def load(self) -> Corpus | None:
        """The entry's corpus, or None when it is not written yet or was damaged (a file removed or
        changed: removed, to be rebuilt)."""
        import shutil

        from ray_diloco.components.token_store import TokenStore

        if not self._written():
            return None
        try:
            return _from_cache(TokenStore(str(self.dir), "data.cache_dir"), self.tokenizer)
        except DataError:
            shutil.rmtree(self.dir, ignore_errors=True)
            return None

    def publish(self, write: Any) -> None:
        """``write(tmp)`` into a new temporary directory next to the entry, then renamed to it
        whole (another run's finished entry may win); the temporary directory never stays.

        Raises:
            OSError: the cache cannot be written. What ``write`` raises."""
        import shutil

        from ray_diloco.components.storage import publish_dir

        work: Path | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            _remove_stale_temporaries(self.root)
            work = _entry_dir(self.root, self.key)
            write(work)
            publish_dir(work, self.dir, marker="manifest.json")
            work = None
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)

    def build(self, address: str | None = None) -> Corpus:
        """Tokenise the file into the entry (:meth:`publish`) and load it. In process, a cache that
        cannot be written (read-only, disk full) prints one note and the corpus stays in memory.

        Raises:
            DataError, ClusterError: the file cannot be tokenised; with Ray Data (no fallback to
                memory: a file this big is not tokenised in process) also a cache that cannot be
                written, naming ``data.cache_dir``."""
        from ray_diloco.components.storage import storage_reason
        from ray_diloco.components.token_store import TokenStore, write_store

        cfg, path = self.cfg, self.path
        if by_ray_data(cfg, path):
            try:
                self.publish(lambda work: _prepare_entry(cfg, path, self.tokenizer, work, address))
            except OSError as e:
                raise DataError(f"data.cache_dir = {str(self.root.parent)!r}: cannot hold the tokenised {path.name} "
                                f"({storage_reason(e)}); give a writable directory") from None  # fmt: skip
            except (DataError, ClusterError) as e:
                raise type(e)(f"data.path = {str(path)!r} (tokenised with Ray Data): {e}") from None
            return _from_cache(TokenStore(str(self.dir), "data.cache_dir"), self.tokenizer)
        ids, tok = _stream(cfg, self.tokenizer)
        meta = {"split": {"method": "tail", "val_fraction": cfg.val_fraction}, "order": "strided",
                "source": {"path": str(path), "cache_key": self.key}}  # fmt: skip
        try:
            self.publish(lambda work: write_store(str(work), tok, ids, None, meta, vocab_size=len(tok),
                                                  tail=cfg.val_fraction))  # fmt: skip
            return _from_cache(TokenStore(str(self.dir), "data.cache_dir"), tok)
        except (OSError, DataError) as e:
            logger.warning(
                f"note: data.cache_dir = {str(self.root.parent)!r}: cannot cache the tokenised {path.name} "
                f"({storage_reason(e)}); it stays in memory"
            )
            return _in_memory(ids, tok, cfg.val_fraction)


#: What prepare's errors call its options when it tokenises a big ``data.path`` file: the run's fields.
RUN_FIELDS = {
    "text_field": "data.text_field",
    "out": "data.cache_dir",
    "address": "run.address",
    "bpe_vocab_size": "data.bpe_vocab_size",
    "val_fraction": "data.val_fraction",
}


def _prepare_entry(cfg: DataConfig, path: Path, tokenizer: Any, out: Path, address: str | None) -> None:
    """Tokenise the big file ``path`` into the store ``out`` with ``prepare``'s pipeline (the one
    pipeline: Ray Data reading, tokenizer actors, the store writer) and ``data.path``'s split rule
    (the tail ``val_fraction`` of the stream). ``tokenizer`` (a resume's) is used as is; otherwise
    ``data.tokenizer``'s (``char``/``bpe`` built from a sample).

    Raises:
        DataError: as ``prepare_store``."""
    import sys
    import tempfile

    from ray_diloco.components.prepare import PrepareOptions, prepare_store

    logger.info(f"data.path = {str(path)!r}: {path.stat().st_size / 2**20:,.1f} MiB, tokenising it with Ray Data")
    with tempfile.TemporaryDirectory(prefix="ray-diloco-tok-") as tok_dir:
        name = cfg.tokenizer
        if tokenizer is not None:
            tokenizer.save_pretrained(tok_dir)
            name = tok_dir
        opts = PrepareOptions(sources=[str(path)], out=str(out), tokenizer=name, bpe_vocab_size=cfg.bpe_vocab_size,
                              text_field=cfg.text_field, val_fraction=cfg.val_fraction, val_split="tail",
                              progress=sys.stderr.isatty(), names=RUN_FIELDS)  # fmt: skip
        prepare_store(opts, address=address)


def _entry_dir(root: Path, key: str) -> Path:
    """A new temporary directory for cache entry ``key`` in ``root``, with the umask's mode (not
    ``mkdtemp``'s 0700: a cache shared by several users is readable by them once published)."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    mask = os.umask(0)
    os.umask(mask)
    tmp.chmod(0o777 & ~mask)
    return tmp


#: A cache entry still being written after this many seconds belongs to a killed run.
STALE_TEMPORARY_S = 3600.0


def _remove_stale_temporaries(root: Path) -> None:
    """Delete the temporary directories (``.KEY-*``) that runs killed while writing an entry left
    in ``root`` more than :data:`STALE_TEMPORARY_S` ago (a small file is tokenised in seconds)."""
    import shutil
    import time

    for p in root.glob(".*-*"):
        try:
            if p.is_dir() and time.time() - p.stat().st_mtime > STALE_TEMPORARY_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _from_cache(store: Any, tokenizer: Any) -> Corpus:
    """A cache entry's splits loaded into memory (checked against the manifest's checksums)."""
    tok = tokenizer if tokenizer is not None else store.tokenizer()
    train, val = store.split("train").materialize(), store.split("val").materialize()
    return Corpus(train=train, val=val, vocab_size=len(tok), tokenizer=tok)


# ---------------------------------------------------------------------------------------
# packing and sharding


def num_train_windows(n_tokens: int, seq_len: int) -> int:
    """Windows per epoch: ``(n_tokens - seq_len) // seq_len`` so any offset < seq_len fits."""
    return (n_tokens - seq_len) // seq_len


def epoch_offset(seed: int, epoch: int, seq_len: int) -> int:
    """Token offset of the window grid in ``epoch`` (0 in epoch 0)."""
    if epoch == 0:
        return 0
    return int(np.random.default_rng([seed, epoch, 1]).integers(seq_len))


def epoch_permutation(seed: int, epoch: int, n_windows: int) -> np.ndarray:
    """The epoch's order of window indices, shared by all shards (so shards are disjoint)."""
    return np.random.default_rng([seed, epoch]).permutation(n_windows)


class ShardReader:
    """Reads batches of packed windows for one shard (one (replica, rank) pair).

    ``tokens`` is a :data:`Split`; :func:`window_order` of it picks the window order:
    ``strided`` (default for arrays: the epoch's ``numpy`` permutation of every window, shard ``s``
    reads ``perm[s::S]``) or ``feistel`` (prepared stores: window ``perm(pos * S + s)`` of a keyed
    Feistel permutation computed per index, nothing of the corpus's size is built). Both give
    every shard disjoint windows within an epoch.

    ``next_batch(b)`` returns ``(x, y, idx)``: ``x``/``y`` int64 tensors ``[b, seq_len]``
    (``y`` is ``x`` shifted by one token) and ``idx`` an int64 array ``[b, 2]`` of
    ``(epoch, window)`` pairs. ``state()``/``load_state()`` give the resumable read position.
    """

    #: Batches whose windows are prefetched ahead of the cursor (remote stores).
    PREFETCH_BATCHES = 4

    def __init__(self, tokens: Split, seq_len: int, shard: int, num_shards: int, seed: int):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} not in [0, {num_shards})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.shard = shard
        self.num_shards = num_shards
        self.seed = seed
        self.order = window_order(tokens)
        self.n_windows = num_train_windows(len(tokens), seq_len)
        self.per_shard = self.n_windows // num_shards
        if self.per_shard < 1:
            raise DataError(
                f"data: {self.n_windows} training sequences of {seq_len} tokens cannot feed "
                f"{num_shards} shards (replicas x workers)"
            )
        self.epoch = 0
        self.pos = 0
        self._cache: tuple[int, Any, int] | None = None

    def _epoch_plan(self, epoch: int) -> tuple[Any, int]:
        """The epoch's windows of this shard (an array, or a Feistel permutation) and grid offset."""
        if self._cache is None or self._cache[0] != epoch:
            if self.order == "feistel":
                from ray_diloco.components.permutation import FeistelPermutation

                plan: Any = FeistelPermutation(self.per_shard * self.num_shards, self.seed, epoch)
            else:
                perm = epoch_permutation(self.seed, epoch, self.n_windows)
                plan = perm[self.shard :: self.num_shards][: self.per_shard]
            self._cache = (epoch, plan, epoch_offset(self.seed, epoch, self.seq_len))
        return self._cache[1], self._cache[2]

    def _windows(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        plan, _ = self._epoch_plan(epoch)
        if self.order == "feistel":
            return plan(pos * self.num_shards + self.shard)
        return plan[pos]

    def peek_indices(self, batch: int, epoch: int | None = None, pos: int | None = None) -> np.ndarray:
        """The ``batch`` ``(epoch, window)`` pairs from position ``(epoch, pos)`` (default: the
        current one), int64 ``[batch, 2]``, without moving the read position."""
        epoch, pos = (self.epoch, self.pos) if epoch is None else (epoch, pos)
        assert pos is not None  # given with epoch
        out = np.empty((batch, 2), dtype=np.int64)
        k = 0
        while k < batch:
            if pos >= self.per_shard:
                epoch, pos = epoch + 1, 0
            take = min(batch - k, self.per_shard - pos)
            out[k : k + take, 0] = epoch
            out[k : k + take, 1] = self._windows(epoch, np.arange(pos, pos + take, dtype=np.int64))
            k, pos = k + take, pos + take
        return out

    def next_indices(self, batch: int) -> np.ndarray:
        """The next ``batch`` ``(epoch, window)`` pairs, advancing the read position."""
        out = self.peek_indices(batch)
        for _ in range(batch):
            if self.pos >= self.per_shard:
                self.epoch += 1
                self.pos = 0
            self.pos += 1
        return out

    def _start(self, epoch: int, w: int) -> int:
        return self._epoch_plan(epoch)[1] + w * self.seq_len

    def next_batch(self, batch: int):
        """``(x, y, idx)``: int64 ``[batch, seq_len]`` inputs and next-token targets, and the
        ``[batch, 2]`` (epoch, window) pairs read; advances the read position."""
        import torch

        idx = self.next_indices(batch)
        T = self.seq_len
        if isinstance(self.tokens, TokenSplit):  # a remote store's chunks fetched ahead
            ahead = self.peek_indices(batch * self.PREFETCH_BATCHES)
            self.tokens.prefetch([(s, s + T + 1) for s in (self._start(int(e), int(w)) for e, w in ahead)])
        rows = [self.tokens[s : s + T + 1] for s in (self._start(int(e), int(w)) for e, w in idx)]
        arr = torch.from_numpy(np.stack(rows).astype(np.int64))
        return arr[:, :-1], arr[:, 1:], idx

    def state(self) -> dict[str, int]:
        """The resumable read position ``{epoch, pos, shard, num_shards}``."""
        return {"epoch": self.epoch, "pos": self.pos, "shard": self.shard, "num_shards": self.num_shards}

    def load_state(self, state: dict[str, int]) -> None:
        """Restore a position from :meth:`state`.

        Raises:
            DataError: if it belongs to another shard layout.
        """
        if state["shard"] != self.shard or state["num_shards"] != self.num_shards:
            raise DataError(
                f"data position is for shard {state['shard']}/{state['num_shards']}, not {self.shard}/{self.num_shards}"
            )
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def val_windows(tokens: Split, seq_len: int) -> int:
    """Non-overlapping validation windows covering the whole validation stream."""
    return (len(tokens) - 1) // seq_len


def val_batch(tokens: Split, seq_len: int, windows: np.ndarray):
    """``(x, y)`` int64 tensors ``[len(windows), seq_len]`` for validation windows."""
    import torch

    arr = np.stack([tokens[w * seq_len : w * seq_len + seq_len + 1] for w in windows]).astype(np.int64)
    t = torch.from_numpy(arr)
    return t[:, :-1], t[:, 1:]
