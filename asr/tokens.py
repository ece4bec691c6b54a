"""The special token ids, defined once: the model, the tokenizers, the search and the word-level
scorers all import them from here (a leaf: it imports nothing).

Every vocabulary of V ids is laid out as: blank (CTC) = 0, unk = 1, the real tokens 2 .. V - 2,
and sos = eos = V - 1. Padding in target tensors is -1, outside the vocabulary."""

__all__ = ["BLANK", "FIRST_TOKEN", "IGNORE_ID", "MIN_VOCAB", "UNK", "eos_id", "real_tokens", "sos_id"]

BLANK = 0
UNK = 1
FIRST_TOKEN = 2  # the first id that spells text
IGNORE_ID = -1  # padding of target tensors, ignored by the losses
MIN_VOCAB = 4  # blank, unk, one real token, sos/eos


def sos_id(vocab_size: int) -> int:
    """The start token of a vocabulary of `vocab_size` ids (the same id as eos)."""
    return vocab_size - 1


def eos_id(vocab_size: int) -> int:
    """The end token of a vocabulary of `vocab_size` ids (the same id as sos)."""
    return vocab_size - 1


def real_tokens(vocab_size: int) -> range:
    """The ids that spell text: FIRST_TOKEN .. V - 2."""
    return range(FIRST_TOKEN, vocab_size - 1)
