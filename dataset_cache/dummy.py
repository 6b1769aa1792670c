"""The synthetic `dummy` dataset (`data.dataset=dummy`): English-like
sentences from a fixed word list, the same on every machine, no network.

Document i depends only on i, so `data.num_samples=N` picks the first N documents
of one endless, reproducible stream (0 means DEFAULT_DOCUMENTS).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

from dataset_cache.corpus import Corpus, Piece, document_pieces

NAME = "dummy-v1"  # bump when the generator changes (the raw-text hash would catch it anyway)
DEFAULT_DOCUMENTS = 1000

_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "time people year way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change morning "
    "reason research girl guy moment air teacher force education good new first last long great little "
    "own other old big high different small large next early young important few public bad same able "
    "says made went found gave told asked seemed left felt brought began kept held stood heard"
).split()


class DummyCorpus(Corpus):
    def __init__(self, documents: int) -> None:
        self.spec = "dummy"
        self.name = NAME
        self.documents = documents or DEFAULT_DOCUMENTS
        self._fingerprint, self.total_bytes = self._hash_all()

    def fingerprint(self) -> str:
        return self._fingerprint

    def _hash_all(self) -> tuple[str, int]:
        """One pass over the generated text gives both its sha256 and its size."""
        digest, size = hashlib.sha256(), 0
        for doc in self._docs():
            raw = doc.encode()
            digest.update(raw)
            digest.update(b"\0")  # document boundaries are part of the raw text
            size += len(raw)
        return digest.hexdigest(), size

    def pieces(self, max_chars: int, splittable: bool) -> Iterator[Piece]:
        for doc in self._docs():
            yield from document_pieces(doc, max_chars, splittable)

    def _docs(self) -> Iterator[str]:
        for i in range(self.documents):
            yield dummy_document(i)


def dummy_document(index: int) -> str:
    """Paragraphs of sentences; integer-seeded Random is stable across Python versions.
    All random draws for a document are made in four calls: tests build this often."""
    rng = random.Random(index)
    n_sentences = rng.randint(3, 16)
    lengths = rng.choices(_SENTENCE_LENGTHS, k=n_sentences)
    words = rng.choices(_WORDS, k=sum(lengths))
    ends = rng.choices(_SENTENCE_ENDS, k=n_sentences)
    text, start = [], 0
    for i, (length, end) in enumerate(zip(lengths, ends, strict=True)):
        sentence = " ".join(words[start:start + length])
        start += length
        text.append(sentence[0].upper() + sentence[1:] + end)
        text.append("\n\n" if i % 4 == 3 else " ")  # a paragraph every four sentences
    text[-1] = "\n"
    return "".join(text)


_SENTENCE_LENGTHS = range(4, 15)
_SENTENCE_ENDS = ".....?!"
