"""``ray-diloco prepare``: tokenise a corpus once, in parallel on Ray Data, into a token store.

Pipeline: ``ray.data.read_text / read_json / read_parquet`` (files, directories, globs; local or
any URI pyarrow knows) or a streamed ``datasets`` source (``--dataset``, hub name or local
dataset directory) -> ``map_batches`` over an actor pool (one ``tokenizers`` tokenizer per actor,
``encode_batch_fast``) -> the driver appends each batch's tokens, in source order, to the shards
of :class:`~ray_diloco.components.token_store.StoreWriter` (see that module for the format).

Documents: a row of a JSONL/Parquet/hub source is a document (EOS after it); a line of a text
file is a row whose newline is kept (a text file is one running text: no EOS inside it). A row
goes to the validation split when ``crc32(utf-8 text) / 2**32 < val_fraction``: the split
depends on the text only, not on the number of actors; ``--val-split tail`` holds out the last
``val_fraction`` of the token stream instead (``data.path``'s rule, applied by the store writer). Memory: the driver holds at most one
shard plus the batches in flight; Ray Data's object store use is capped (``OBJECT_STORE_BYTES``);
a read task holds one input file (or one Parquet row group), so split huge text files.

A killed prepare rerun with the same sources and options continues: the shards finished before
the kill are kept, the tokens after the last finished shard are redone (``prepare-state.npz``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import json
import logging
import os
import posixpath
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ray_diloco.components.address import connect_ray
from ray_diloco.components.text import build_prepare_tokenizer, encode_documents, file_type
from ray_diloco.components.token_store import SHARD_TOKENS, StoreWriter
from ray_diloco.config.schema import BPE_VOCAB_RULE, MIN_BPE_VOCAB
from ray_diloco.errors import DataError
from ray_diloco.log import causes, error_line

logger = logging.getLogger(__name__)

#: Text read to build a ``char`` vocabulary or train a ``bpe`` tokenizer (a bounded sample), bytes.
SAMPLE_BYTES = 32 << 20
#: Cap of Ray Data's object store use during a prepare, bytes.
OBJECT_STORE_BYTES = 512 << 20
#: CPUs reserved by a read task (a fraction: reads must be scheduled beside the tokenizer actors).
READ_CPUS = 0.25
#: Read tasks at a time per 8 CPUs of the cluster, at least 2 (each holds one input file or Parquet
#: row group in memory; one reader parses far faster than 8 tokenizer actors consume).
READ_TASKS_PER_8_CPUS = 1
#: CPUs reserved by a tokenizer actor (a reservation, not a limit: each actor's tokenizer uses every
#: core it gets). Half a CPU each leaves whole CPUs for Ray Data's own 1-CPU tasks: with 0.75, a
#: Parquet source on a 2-CPU cluster waited forever for one.
ACTOR_CPUS = 0.5


@dataclass
class PrepareOptions:
    """What ``ray-diloco prepare`` does (its command-line options)."""

    sources: list[str] = field(default_factory=list)
    """Files, directories or globs, local or URIs (``s3://...``); .txt/.md, .jsonl/.json or .parquet."""
    out: str = ""
    """The store's directory or URI."""
    dataset: str | None = None
    """A ``datasets`` source streamed instead of ``sources``: a hub name or a local dataset directory."""
    dataset_config: str | None = None
    """Configuration of ``dataset``."""
    split: str = "train"
    """Split of ``dataset``."""
    tokenizer: str = "bpe"
    """``char``, ``bpe`` (byte-level BPE trained on a sample) or a Hugging Face tokenizer name, directory
    or tokenizer.json file."""
    bpe_vocab_size: int = 4096
    """Vocabulary of the trained BPE."""
    text_field: str = "text"
    """Column of JSONL/Parquet/hub rows holding the text."""
    val_fraction: float = 0.01
    """Share held out for the validation split, in [0, 1): of the documents or of the tokens (``val_split``)."""
    val_split: str = "hash"
    """``hash``: a document goes to validation when the crc32 of its text is below ``val_fraction``
    (independent of the number of actors); ``tail``: the last ``val_fraction`` of the token stream
    (``data.path``'s rule, ``StoreWriter.finish``)."""
    shard_tokens: int = SHARD_TOKENS
    """Tokens per shard."""
    batch_rows: int = 1024
    """Rows per ``map_batches`` batch."""
    actors: int | None = None
    """Tokenizer actors; None: one per CPU of the cluster."""
    progress: bool = True
    """Show the progress bar."""
    names: dict[str, str] = field(default_factory=dict)
    """What errors call an option that the caller knows by another name (a big ``data.path``
    file: ``{"text_field": "data.text_field", "out": "data.cache_dir", "address": "run.address"}``);
    default: its command-line flag (:meth:`flag`)."""

    def flag(self, option: str) -> str:
        """What an error calls ``option`` (a field above): :attr:`names`, else ``--option-name``."""
        return self.names.get(option, "--" + option.replace("_", "-"))


# ---------------------------------------------------------------------------------------
# sources


def resolve_sources(sources: list[str]) -> tuple[Any, list[str], list[int], str]:
    """``(pyarrow filesystem, file paths in it, their sizes, format)`` of ``sources``, sorted.

    Raises:
        DataError: a source matches no file, a file is of an unsupported type, formats are mixed,
            every file is empty.
    """
    import pyarrow.fs as pafs

    from ray_diloco.components.storage import Location

    if not sources:
        raise DataError("prepare: no SOURCE given (files, directories or globs; or --dataset NAME)")
    files: dict[str, int] = {}
    fs = None
    for src in sources:
        loc = Location(src, "SOURCE") if "://" in src else None
        sfs, path = (
            (loc.fs, loc.root) if loc is not None else (pafs.LocalFileSystem(), str(Path(src).expanduser().absolute()))
        )
        fs = fs or sfs
        if any(ch in path for ch in "*?["):
            base = path[: min(path.index(ch) for ch in "*?[" if ch in path)].rsplit("/", 1)[0] or "/"
            infos = [
                i
                for i in sfs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
                if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, path)
            ]
        else:
            info = sfs.get_file_info(path)
            if info.type == pafs.FileType.Directory:
                infos = [
                    i
                    for i in sfs.get_file_info(pafs.FileSelector(path, recursive=True))
                    if i.type == pafs.FileType.File and not posixpath.basename(i.path).startswith((".", "_"))
                ]
            else:
                infos = [info] if info.type == pafs.FileType.File else []
        if not infos:
            raise DataError(f"SOURCE {src!r}: no such file, directory or matching file")
        files.update({i.path: i.size for i in infos})
    kinds: dict[str, str] = {}
    for p in files:
        kinds.setdefault(file_type(p, "SOURCE file"), p)
    if len(kinds) > 1:
        raise DataError(
            f"SOURCE: mixes file types ({', '.join(f'{k}: {v}' for k, v in kinds.items())}); "
            "prepare each type into its own store"
        )
    paths = sorted(p for p, size in files.items() if size > 0)
    if not paths:
        raise DataError(f"SOURCE {', '.join(sources)}: every file is empty")
    return fs, paths, [files[p] for p in paths], next(iter(kinds))


def _read(fs: Any, paths: list[str], kind: str, opts: PrepareOptions):
    """The Ray Data dataset of the source files (rows in file order; text files: a row per line)."""
    import ray
    import ray.data

    readers = min(len(paths), max(2, int(ray.cluster_resources().get("CPU", 2)) // 8 * READ_TASKS_PER_8_CPUS))
    if kind == "text":
        return ray.data.read_text(
            paths, filesystem=fs, drop_empty_lines=False, include_paths=True, num_cpus=READ_CPUS, concurrency=readers
        )
    read = {"json": ray.data.read_json, "parquet": ray.data.read_parquet, "csv": ray.data.read_csv}[kind]
    return read(
        paths,
        filesystem=fs,
        include_paths=True,
        num_cpus=READ_CPUS,  # JSON: pyarrow's newline-delimited reader
        concurrency=readers,
    )


def _hub(opts: PrepareOptions, skip_rows: int):
    """A streamed ``datasets`` source as a Ray dataset (``skip_rows`` rows skipped, untokenised)."""
    import datasets
    import ray.data

    datasets.disable_progress_bars()
    try:
        hf = datasets.load_dataset(opts.dataset, opts.dataset_config, split=opts.split, streaming=True)
        cols = hf.column_names or list(next(iter(hf)).keys())
    except Exception as e:  # noqa: BLE001 - datasets raises many types (FileNotFoundError, ConnectionError, ...)
        raise DataError(f"--dataset {opts.dataset!r}: cannot load ({error_line(e)})") from None
    if opts.text_field not in cols:
        raise DataError(
            f"{opts.flag('text_field')} {opts.text_field!r}: not a column of {opts.dataset} (columns: {', '.join(cols)})"
        )
    hf = hf.select_columns([opts.text_field])
    if skip_rows:
        hf = hf.skip(skip_rows)
    # streamed by one read task, in order (from_huggingface would try the hub's parquet export first)
    from ray.data._internal.datasource.huggingface_datasource import HuggingFaceDatasource

    return ray.data.read_datasource(HuggingFaceDatasource(dataset=hf), num_cpus=READ_CPUS)


# ---------------------------------------------------------------------------------------
# tokenizers


def _sample(
    ds: Any, column: str, limit: int = SAMPLE_BYTES, what: str = "SOURCE", field: str = "--text-field"
) -> list[str]:
    """The first ``limit`` characters of text of ``ds`` (a bounded sample, streamed; one pass over
    the source's first rows, which also checks ``column``, called ``field`` in errors).

    Raises:
        DataError: the source has no rows, or no column ``column``.
    """
    out, size = [], 0
    batches = iter(ds.iter_batches(batch_size=256 if limit > 1 else 1, batch_format="numpy"))
    try:
        first = next(batches, None)
        if first is None:
            raise DataError(f"{what}: no rows")
        if column not in first:
            raise DataError(
                f"{field} {column!r}: not a column of the source (columns: "
                f"{', '.join(k for k in first if k != 'path')})"
            )
        for batch in itertools.chain([first], batches):
            for t in batch[column]:
                if isinstance(t, str) and t:
                    out.append(t)
                    size += len(t)
            if size >= limit:
                break
    finally:
        # closed now, while Ray runs: left to the garbage collector after Ray's shutdown it started
        # Ray again and printed a traceback (or crashed Ray's core worker) after the error line
        close = getattr(batches, "close", None)
        if close is not None:
            close()
    return out


class Tokenize:
    """The ``map_batches`` actor: one ``tokenizers.Tokenizer`` per actor.

    A batch of rows becomes one output row: ``train``/``val`` (the tokens of the batch's rows of
    each split, concatenated, EOS after each document, as raw bytes of ``dtype``), ``lengths``
    (int64 per input row: its tokens, negative for the validation split, as raw bytes), ``rows``,
    ``text_bytes`` and ``paths`` (a JSON list of ``[path, rows]`` runs).
    """

    def __init__(self, tokenizer_json: str, eos_id: int | None, column: str, lines: bool, val_fraction: float,
                 dtype: str, field: str = "--text-field"):  # fmt: skip
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(tokenizer_json)
        self.eos, self.column, self.lines, self.dtype = eos_id, column, lines, np.dtype(dtype)
        self.field = field  # what errors call the column
        self.threshold = int(val_fraction * 2**32)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = batch[self.column]
        for t in values:
            if t is not None and not isinstance(t, str):
                raise DataError(
                    f"{self.field} {self.column!r}: values must be strings, a row holds "
                    f"{type(t).__name__} {str(t)[:40]!r}"
                )
        texts = [(t or "") + ("\n" if self.lines else "") for t in values]
        ids = encode_documents(self.tok, list(values), self.eos, self.lines)
        val = np.array([zlib.crc32(t.encode()) < self.threshold for t in texts], dtype=bool)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=int(lengths.sum()))
        mask = np.repeat(val, lengths)
        paths = batch.get("path")
        runs: list[list[Any]] = []
        for p in paths if paths is not None else []:
            if runs and runs[-1][0] == p:
                runs[-1][1] += 1
            else:
                runs.append([str(p), 1])
        return {
            "train": np.array([flat[~mask].tobytes()], dtype=object),
            "val": np.array([flat[mask].tobytes()], dtype=object),
            "lengths": np.array([np.where(val, -lengths, lengths).tobytes()], dtype=object),
            "rows": np.array([len(texts)]),
            "text_bytes": np.array([sum(len(t) for t in texts)]),
            "paths": np.array([json.dumps(runs)], dtype=object),
        }


# ---------------------------------------------------------------------------------------
# the prepare


def _check_options(o: PrepareOptions) -> None:
    problems = []
    if not 0 <= o.val_fraction < 1:
        problems.append(f"{o.flag('val_fraction')} = {o.val_fraction}: must be in [0, 1)")
    if o.val_split not in ("hash", "tail"):
        problems.append(f"--val-split = {o.val_split!r}: must be hash or tail")
    if o.shard_tokens < 1024:
        problems.append(f"--shard-tokens = {o.shard_tokens}: must be at least 1024")
    if o.bpe_vocab_size < MIN_BPE_VOCAB:
        problems.append(f"{o.flag('bpe_vocab_size')} = {o.bpe_vocab_size}: {BPE_VOCAB_RULE}")
    if o.actors is not None and o.actors < 1:
        problems.append(f"--actors = {o.actors}: must be at least 1")
    if bool(o.sources) == bool(o.dataset):
        problems.append("prepare: give SOURCE files or --dataset NAME (one of them)")
    if not o.out:
        problems.append(f"{o.flag('out')}: required (a directory or a URI such as s3://bucket/store)")
    elif (
        "://" not in o.out
        and (
            blocker := next(
                (q for q in [Path(o.out).expanduser(), *Path(o.out).expanduser().parents] if q.exists()), None
            )
        )
        is not None
        and not blocker.is_dir()
    ):
        problems.append(f"{o.flag('out')} = {o.out!r}: {blocker} is a file, not a directory (a store is a directory)")
    if problems:
        raise DataError("; ".join(problems))


def _data_error(e: BaseException | None) -> DataError | None:
    """The DataError a Ray task raised, found in the chain of ``e`` (Ray wraps it)."""
    for c in causes(e):
        if isinstance(c, DataError):
            return DataError(str(c))
    return None


def _failure(e: BaseException, files: list[str]) -> DataError:
    """One line for a prepare that failed in Ray: the innermost error that is not Ray's own
    (a JSON row that does not parse), not Ray Data's retry advice; bytes that are not UTF-8 (whose
    error Ray's retry wrapper garbles) name the first such local file of ``files`` and the offset."""
    inner = [c for c in causes(e) if not type(c).__module__.startswith("ray")]
    if any(isinstance(c, UnicodeDecodeError) for c in inner) and (where := _not_utf8(files)):
        return DataError(f"prepare failed: {where}")
    return DataError(f"prepare failed: {error_line(inner[-1] if inner else e, limit=300)}")


def _not_utf8(files: list[str]) -> str | None:
    """``file: not UTF-8 text (...)`` for the first local file in ``files`` that does not decode
    (read in 16 MiB pieces); None when none does or a file is remote."""
    import codecs

    for name in files:
        path = Path(name)
        if "://" in name or not path.is_file():
            return None
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as u:
                    return (
                        f"{name}: not UTF-8 text (near byte {max(0, offset + u.start):,}: {u.reason}); "
                        "convert it (iconv -f ENCODING -t UTF-8) or leave it out"
                    )
                offset += len(chunk)
    return None


def _source(opts: PrepareOptions) -> tuple[Any, dict[str, Any]]:
    """``(reader(cursor, sample_bytes=None) -> Ray dataset, source description)``; the description
    keys the rerun. With ``sample_bytes`` the dataset reads only the first files holding twice
    that many bytes (the tokenizer's sample of that much text: Ray Data would otherwise read ahead
    into every file, up to its object-store cap, for a sample it then drops)."""
    if opts.dataset:
        desc: dict[str, Any] = {
            "dataset": opts.dataset,
            "config": opts.dataset_config,
            "split": opts.split,
            "lines": False,
        }

        def hub(cursor: dict[str, Any], sample_bytes: int | None = None):
            return _hub(opts, cursor.get("rows", 0))

        hub.whole = lambda sample_bytes: True  # type: ignore[attr-defined]  # a sample streams the source itself
        return hub, desc
    fs, paths, sizes, kind = resolve_sources(opts.sources)
    desc = {"files": paths, "bytes": sizes, "format": kind, "lines": kind == "text", "sources": opts.sources}

    def first(sample_bytes: int) -> int:  # files holding twice the sample's bytes (JSON: more bytes than text)
        return int(np.searchsorted(np.cumsum(sizes), 2 * sample_bytes)) + 1

    def make(cursor: dict[str, Any], sample_bytes: int | None = None):
        todo = paths[: first(sample_bytes)] if sample_bytes is not None else paths[cursor.get("files_done", 0) :]
        return _read(fs, todo, kind, opts)

    make.whole = lambda sample_bytes: first(sample_bytes) >= len(paths)  # type: ignore[attr-defined]
    return make, desc


def _sample_bytes(opts: PrepareOptions) -> int:
    """Text the tokenizer is built from: a sample for ``char``/``bpe``; one row (the column check) else."""
    return SAMPLE_BYTES if opts.tokenizer in ("char", "bpe") else 1


def _tokenizer_for(opts: PrepareOptions, writer: StoreWriter, make: Any, column: str):
    """The run's tokenizer: the one a killed prepare saved in the store, else a new one (a sample
    read from the first files of ``make``'s source, or from all of them when those hold no rows or
    less text than the sample; ``column`` is checked)."""
    from ray_diloco.components.token_store import TOKENIZER_DIR, load_saved_tokenizer

    if writer.loc.read_bytes(f"{TOKENIZER_DIR}/tokenizer.json") is not None and writer.loc.read_bytes(
        "prepare-state.npz"
    ):
        local = writer.loc.get_dir(
            TOKENIZER_DIR,
            ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"],
            Path(__import__("tempfile").mkdtemp(prefix="ray-diloco-tok-")),
        )
        return load_saved_tokenizer(local)
    what, limit = f"SOURCE {opts.dataset or ', '.join(opts.sources)}", _sample_bytes(opts)
    try:
        sample = _sample(make({}, limit), column, limit, what, opts.flag("text_field"))
    except DataError as e:
        if not str(e).endswith("no rows") or make.whole(limit):
            raise
        sample = []
    if sum(map(len, sample)) < limit and not make.whole(limit):  # the first files were short or rowless
        sample = _sample(make({}), column, limit, what, opts.flag("text_field"))
    tok = build_prepare_tokenizer(opts.tokenizer, sample, opts.bpe_vocab_size)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        writer.loc.put_dir(Path(tmp), TOKENIZER_DIR)
    return tok


def _init_ray(address: str | None, field: str = "--address") -> bool:
    """Join ``address`` (or ``RAY_ADDRESS``) or start a local Ray of this process's own, with an
    object store big enough for the tokenised batches (:func:`~ray_diloco.components.address.connect_ray`).

    Raises:
        ClusterError: the address cannot be reached or Ray cannot start."""
    import logging

    logging.getLogger("ray.data").setLevel(logging.CRITICAL)
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")  # no core-worker notes on the prepare's output
    # a cluster joined (RAY_ADDRESS under `ray job submit`) has its own object store: sized only here
    store = {"object_store_memory": max(OBJECT_STORE_BYTES * 2, 1 << 30)}
    return connect_ray(address, field, local=store, include_dashboard=False, log_to_driver=False)


def prepare_store(opts: PrepareOptions, address: str | None = None) -> dict[str, Any]:
    """Tokenise ``opts.sources`` (or ``opts.dataset``) into the store ``opts.out``; returns its
    manifest. Starts a local Ray unless one is running (or ``address`` is given).

    Raises:
        DataError: bad options, a missing or empty source, a missing text field, an existing
            finished store at ``out``, a full disk (the manifest is not written; a rerun continues).
    """
    import ray
    from ray.data import DataContext

    _check_options(opts)
    from ray_diloco.components.storage import Location

    out = opts.flag("out")
    if Location(opts.out, out).read_bytes("manifest.json") is not None:
        raise DataError(
            f"{out} {opts.out!r}: already holds a prepared store (manifest.json); choose another {out} or delete it"
        )
    make, desc = _source(opts)  # a missing or empty source fails before Ray starts
    started = _init_ray(address, opts.flag("address"))
    try:
        ctx = DataContext.get_current()
        ctx.execution_options.preserve_order = True  # shards in source order: a rerun continues them
        ctx.enable_progress_bars = False
        ctx.execution_options.resource_limits = ctx.execution_options.resource_limits.copy(
            object_store_memory=OBJECT_STORE_BYTES
        )
        return _run(opts, make, desc)
    except (ray.exceptions.RayError, RuntimeError) as e:
        err = _data_error(e)
        if err is not None:
            raise err from None
        raise _failure(e, desc.get("files", [])) from None
    finally:
        if started:
            ray.shutdown()


def _run(opts: PrepareOptions, make: Any, desc: dict[str, Any]) -> dict[str, Any]:
    import ray

    column = "text" if desc["lines"] else opts.text_field
    writer = StoreWriter(opts.out, 1 << 16, opts.shard_tokens, field=opts.flag("out"))  # vocabulary set below
    tok = _tokenizer_for(opts, writer, make, column)
    from ray_diloco.components.token_store import dtype_for

    tok_json = tok.backend_tokenizer.to_str()
    key = {
        **desc,
        **{k: v for k, v in asdict(opts).items() if k in ("text_field", "val_fraction", "val_split", "shard_tokens")},
        "tokenizer": hashlib.sha256(tok_json.encode()).hexdigest(),
    }
    writer.fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    writer.vocab_size, writer.dtype = len(tok), dtype_for(len(tok))
    cursor = writer.resume() or {}
    if cursor:
        logger.info(
            f"prepare: continuing {opts.out}: {sum(len(v) for v in writer.shards.values())} finished shards kept"
        )
    actors = opts.actors or max(1, int(ray.cluster_resources().get("CPU", 1)))
    ds = make(cursor).map_batches(
        Tokenize,
        batch_size=opts.batch_rows,
        batch_format="numpy",
        concurrency=actors,
        num_cpus=ACTOR_CPUS,
        fn_constructor_kwargs={
            "tokenizer_json": tok_json,
            "eos_id": tok.eos_token_id,
            "column": column,
            "lines": desc["lines"],
            "val_fraction": opts.val_fraction if opts.val_split == "hash" else 0.0,  # tail: at finish
            "dtype": writer.dtype.str,
            "field": opts.flag("text_field"),
        },
    )
    _consume(ds, writer, desc, cursor, opts)
    meta = {
        "split": {"method": opts.val_split, "val_fraction": opts.val_fraction},
        "order": "feistel",
        "source": {k: v for k, v in desc.items() if k not in ("files", "bytes")}
        | {"files": len(desc.get("files", []))},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    manifest = writer.finish(tok, meta, opts.val_fraction if opts.val_split == "tail" else None)
    if not manifest["tokens"]["val"]:
        logger.warning(f"note: {opts.out} has no validation tokens (--val-fraction {opts.val_fraction}): "
                       "training on it needs some (data.prepared checks seq_len + 1)")  # fmt: skip
    logger.info(
        f"prepared {opts.out}: {manifest['tokens']['train']:,} train / {manifest['tokens']['val']:,} validation "
        f"tokens ({manifest['dtype']}, vocabulary {manifest['vocab_size']}) in "
        f"{sum(len(v) for v in manifest['shards'].values())} shards",
    )
    return manifest


def _consume(ds: Any, writer: StoreWriter, desc: dict[str, Any], cursor: dict[str, Any], opts: PrepareOptions) -> None:
    """Append the tokenised batches, in source order, to ``writer``, tracking the source cursor."""
    from tqdm import tqdm

    files = desc.get("files")
    index = {p: i for i, p in enumerate(files or [])}
    cur = dict(cursor) or ({"files_done": 0, "rows_after": 0} if files else {"rows": 0})
    skip = cur.get("rows_after", 0) if files else 0  # rows of a half-done file: tokenised again, dropped
    done_bytes = sum(desc["bytes"][: cur.get("files_done", 0)]) if files else 0
    bar = tqdm(
        total=sum(desc["bytes"]) if files else None,
        initial=done_bytes,
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=not opts.progress,
        file=sys.stderr,
        smoothing=0.1,
    )
    tokens = sum(e["tokens"] for s in writer.shards.values() for e in s) + sum(writer.buffered.values())
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2):
        for i in range(len(batch["rows"])):
            train = np.frombuffer(batch["train"][i], dtype=writer.dtype)
            val = np.frombuffer(batch["val"][i], dtype=writer.dtype)
            lengths = np.frombuffer(batch["lengths"][i], dtype=np.int64)
            if skip:
                k = min(skip, len(lengths))
                head = lengths[:k]
                train, val = train[int(head[head > 0].sum()) :], val[int(-head[head < 0].sum()) :]
                lengths, skip = lengths[k:], skip - k
            if files:
                for path, n in json.loads(batch["paths"][i]):
                    j = index.get(path, index.get(path.split("://", 1)[-1]))
                    if j is not None and j != cur["files_done"]:
                        cur = {"files_done": j, "rows_after": 0}
                    cur["rows_after"] += n
            else:
                cur["rows"] += int(batch["rows"][i])
            writer.add(train, val, dict(cur), (int((lengths > 0).sum()), int((lengths < 0).sum())))
            tokens += len(train) + len(val)
            bar.update(int(batch["text_bytes"][i]))
            bar.set_postfix(docs=f"{sum(writer.documents.values()):,}", tokens=f"{tokens:,}", refresh=False)
    bar.close()
