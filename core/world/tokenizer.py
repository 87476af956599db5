"""The mini world's CLIP tokenizer: byte-level base vocabulary plus one token per caption word.

ENV_NOTES' pitfall: a tokenizer that splits caption words into pieces makes the tiny text encoders'
job much harder. Here every caption word becomes exactly one token: a small, *deterministic* BPE is
learned on the world's vocabulary (most frequent adjacent pair first, ties broken alphabetically),
so applying its merges in rank order rebuilds each word (the classic BPE property). Any other text
still tokenizes, byte by byte. The tokenizer is built once by ``core.pretrain`` and shipped with the
model (tokenizer/ and tokenizer_2/), so loading never depends on this code.
"""

from __future__ import annotations

from collections import Counter

from core.world.scenes import vocabulary

END = "</w>"


def word_merges(words: list[str]) -> list[tuple[str, str]]:
    """BPE merges that turn each word (CLIP style: last symbol carries ``</w>``) into one symbol."""
    segs = {w: [*w[:-1], w[-1] + END] for w in words}
    merges: list[tuple[str, str]] = []
    while True:
        pairs = Counter()
        for seg in segs.values():
            for a, b in zip(seg, seg[1:]):
                pairs[(a, b)] += 1
        if not pairs:
            return merges
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w, seg in segs.items():
            out, i = [], 0
            while i < len(seg):
                if i + 1 < len(seg) and (seg[i], seg[i + 1]) == best:
                    out.append(seg[i] + seg[i + 1])
                    i += 2
                else:
                    out.append(seg[i])
                    i += 1
            segs[w] = out


def build_tokenizer(model_max_length: int = 16):
    """A ``CLIPTokenizer`` whose vocabulary is the 512 byte-level symbols, the merged word pieces and
    the two special tokens; each world word is one token."""
    from transformers import CLIPTokenizer

    from core.models import _byte_level_vocab

    vocab = _byte_level_vocab()
    merges = word_merges(vocabulary())
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
