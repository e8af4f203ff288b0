"""The steps of the one data pipeline before the token store, shared by its two executors (a
``data.path`` file in the job's process, ``ray-diloco prepare`` and big files on Ray Data): the
file types and their reading rules, the tokenizers (``char``, ``bpe``, a named one) and the one
tokenising step (:func:`encode_documents`).
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ray_diloco.config import DataConfig
from ray_diloco.errors import DataError
from ray_diloco.log import causes, error_line

logger = logging.getLogger(__name__)

BUNDLED_CORPUS = Path(__file__).parents[1] / "data" / "tinyshakespeare.txt"
#: The file types a corpus is read from, by suffix (``data.path`` and ``ray-diloco prepare`` alike):
#: ``text`` (a document per file with ``data.path``, a row per line with ``prepare``), ``json``
#: (JSON lines), ``parquet``, ``csv`` (rows; the text in ``text_field``).
FILE_TYPES = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


def file_type(path: str, field: str) -> str:
    """The :data:`FILE_TYPES` format of ``path`` (by its suffix, any case).

    Raises:
        DataError: naming ``field`` and the path: an unsupported suffix, with the allowed ones."""
    kind = FILE_TYPES.get(posixpath.splitext(str(path))[1].lower())
    if kind is None:
        raise DataError(
            f"{field} = {str(path)!r}: unsupported file type {posixpath.splitext(str(path))[1]!r} "
            f"(allowed: {', '.join(sorted(FILE_TYPES))})"
        )
    return kind


# ---------------------------------------------------------------------------------------
# loading text


def source_file(cfg: DataConfig) -> Path | None:
    """The local file the corpus comes from (``data.path``, or the bundled Tiny Shakespeare when
    neither ``path`` nor ``dataset`` is set); None for a hub dataset.

    Raises:
        DataError: the file is missing or of an unsupported type.
    """
    if cfg.path is None and cfg.dataset is not None:
        return None
    path = BUNDLED_CORPUS if cfg.path is None else Path(cfg.path).expanduser()
    if not path.is_file():
        raise DataError(f"data.path = {str(path)!r}: file not found")
    file_type(str(path), "data.path")
    return path


def load_texts(cfg: DataConfig) -> list[str]:
    """Documents as strings, through ``datasets.load_dataset``.

    Raises:
        DataError: missing file, unknown format, missing text field, unreachable hub dataset.
    """
    import datasets

    datasets.disable_progress_bars()
    path = source_file(cfg)
    try:
        if path is not None:
            builder = file_type(str(path), "data.path")
            kwargs = {"sample_by": "document"} if builder == "text" else {}
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
            field = "text" if builder == "text" else cfg.text_field
            if field not in ds.column_names:
                raise DataError(
                    f"data.text_field = {field!r}: not a column of {path} (columns: {', '.join(ds.column_names)})"
                )
            texts = ds[field]
            if cfg.max_documents is not None:
                texts = texts[: cfg.max_documents]
        else:
            if cfg.streaming and cfg.max_documents is None:
                raise DataError(
                    f"data.max_documents = None: a streamed hub dataset ({cfg.dataset}) needs a cap, "
                    "for example --set data.max_documents=100000"
                )
            ds = datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=cfg.split, streaming=cfg.streaming)
            texts = []
            for row in ds:
                if cfg.text_field not in row:
                    raise DataError(f"data.text_field = {cfg.text_field!r}: not a field of {cfg.dataset}")
                texts.append(row[cfg.text_field])
                if cfg.max_documents is not None and len(texts) >= cfg.max_documents:
                    break
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, ConnectionError, ...)
        src = str(path) if path is not None else cfg.dataset
        # datasets wraps the reason (bytes not UTF-8, a bad JSON line): the innermost one
        raise DataError(f"data: cannot load {src!r}: {error_line(causes(e)[-1])}") from None
    for i, t in enumerate(texts):
        if t is not None and not isinstance(t, str):
            raise DataError(
                f"data.text_field = {cfg.text_field!r}: values must be strings, "
                f"document {i} holds {type(t).__name__} {str(t)[:40]!r}"
            )
    texts = [t for t in texts if t]
    if not texts:
        raise DataError(f"data: no text found in {str(path) if path is not None else cfg.dataset!r}")
    return texts


# ---------------------------------------------------------------------------------------
# tokenizers


#: The end-of-document token of the tokenizers built here (``bpe``; ``char`` with specials).
EOS = "<|endoftext|>"


def char_tokenizer(texts: list[str], specials: bool = False):
    """Character-level ``PreTrainedTokenizerFast`` (``tokenizers`` WordLevel over single chars):
    the characters of ``texts``, sorted; with ``specials`` also ``<unk>`` for any other character
    and an :data:`EOS` after them (``prepare``'s, whose sample may miss characters), without them
    the plain vocabulary of a ``data.path`` run (its ids unchanged)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set().union(*map(set, texts)) if texts else set())
    vocab = {c: i for i, c in enumerate([*chars, "<unk>", EOS] if specials else chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>" if specials else None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if specials:
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def bpe_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE trained on ``texts`` with ``tokenizers``; :data:`EOS` ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def build_tokenizer(cfg: DataConfig, texts: list[str]):
    """The tokenizer named by ``cfg.tokenizer`` ("char", "bpe", or a HF name/path)."""
    if cfg.tokenizer == "char":
        return char_tokenizer(texts)
    if cfg.tokenizer == "bpe":
        return bpe_tokenizer(texts, cfg.bpe_vocab_size)
    from huggingface_hub.utils import logging as hub_logging
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hub_logging.set_verbosity_error()  # one error line instead of the hub client's retry log
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(cfg.tokenizer)
    except Exception as e:
        raise DataError(
            f"data.tokenizer = {cfg.tokenizer!r}: cannot load ({type(e).__name__}); "
            "use 'char', 'bpe', a local tokenizer directory or a reachable hub name"
        ) from None


def build_prepare_tokenizer(name: str, sample: list[str], bpe_vocab_size: int):
    """The tokenizer of a prepare: ``char`` (the sample's characters, ``<unk>`` for the rest, and
    an EOS), ``bpe`` (trained on the sample), or a name / directory / tokenizer.json file.

    Raises:
        DataError: it cannot be built or loaded.
    """
    from transformers import PreTrainedTokenizerFast

    if name == "char":
        return char_tokenizer(sample, specials=True)
    if name == "bpe":
        if not sample:
            raise DataError("prepare: no text in the source to train the BPE tokenizer on")
        return bpe_tokenizer(sample, bpe_vocab_size)
    if name.endswith(".json") and Path(name).expanduser().is_file():
        fast = PreTrainedTokenizerFast(tokenizer_file=str(Path(name).expanduser()))
        eos = next(
            (t for t in (EOS, "</s>", "<eos>") if fast.convert_tokens_to_ids(t) not in (None, fast.unk_token_id)), None
        )
        if eos is not None:
            fast.eos_token = eos
        return fast
    return build_tokenizer(DataConfig(tokenizer=name), [])


def encode_documents(tok: Any, texts: Sequence[str | None], eos_id: int | None, lines: bool = False) -> list[list[int]]:
    """Token ids of each document of ``texts`` with the ``tokenizers.Tokenizer`` ``tok`` (no
    special tokens added), :data:`EOS` (``eos_id``) after each non-empty one; with ``lines``
    each text is a line of a running text: its newline is kept and no EOS follows it. The one
    tokenising step of ``prepare``'s actors and of a corpus tokenised in process.

    Raises:
        Exception: as ``tok.encode_batch_fast`` (a character the vocabulary lacks)."""
    texts = [(t or "") + ("\n" if lines else "") for t in texts]
    enc = tok.encode_batch_fast(texts, add_special_tokens=False)
    eos = [eos_id] if (eos_id is not None and not lines) else []
    return [(e.ids + eos if eos else e.ids) if t else [] for e, t in zip(enc, texts)]


def tokenize(tokenizer: Any, texts: list[str]) -> np.ndarray:
    """One int32 stream: documents joined by the tokenizer's EOS token when it has one
    (:func:`encode_documents` for a fast tokenizer; a slow one's own encoding otherwise).

    Raises:
        DataError: when the tokenizer cannot encode the text.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)  # None: a slow (Python) tokenizer
    parts: list[np.ndarray] = []
    batch = 1000
    for start in range(0, len(texts), batch):
        try:
            if backend is not None:
                enc = encode_documents(backend, texts[start : start + batch], eos)
            else:
                enc = [ids + ([eos] if eos is not None else []) for ids in
                       tokenizer(texts[start : start + batch], add_special_tokens=False)["input_ids"]]  # fmt: skip
        except Exception as e:  # e.g. a char vocabulary built on another corpus
            raise DataError(
                f"data: the tokenizer cannot encode this corpus ({error_line(e, typed=False)}); "
                "was the run trained on other text?"
            ) from None
        parts.extend(np.asarray(ids, dtype=np.int32) for ids in enc)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
