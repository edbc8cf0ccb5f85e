"""The logits of a speculative decoding step, per tensor-parallel rank, in bytes (vLLM 0.26.0).

A decode step in which each of ``S`` requests proposes ``k`` draft tokens computes logits for ``S x (1 + k)`` rows:
each request's drafts plus its bonus token. The LM head is sharded over the vocabulary: each rank computes
``rows x Vp / tp`` logits, then ``LogitsProcessor._gather_logits`` all-gathers them (CUDA's ``use_all_gather`` is
true), so every rank holds the full-vocabulary logits and runs the sampler on them:

    Vp        = ceil(V / 64) x 64                       (ParallelLMHead pads the vocabulary to a multiple of 64)
    shard     = rows x Vp / tp x itemsize               (this rank's LM head output)
    gathered  = rows x Vp x itemsize                    (all_gather_into_tensor's [tp x rows, Vp / tp] buffer)
    reordered = rows x Vp x itemsize                    (movedim + reshape to [rows, Vp]: a copy when rows > 1)
    peak      = shard + gathered + reordered            (all three alive while the copy is made; tp = 1: shard)

Per rank this is ``rows x Vp x itemsize x (2 + 1/tp)`` with any tensor parallelism and ``rows x Vp x itemsize``
without: unlike weights and activations it does not shrink with ``tp``, and summed over the ranks it grows with
their number. The sampler's own temporaries come on top (float32 copies and probabilities of the rows); the
extensible sizing measures them with the rest of the widest speculative step (Note [The speculative step, at its
widest] in ``sizing``). ``tests/unit/test_logits_gather.py`` checks these figures against the gather run over
gloo on the CPU, with the same operations as vLLM's ``DeviceCommunicatorBase.all_gather``.
"""

from __future__ import annotations

from dataclasses import dataclass

VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the LM head pads the vocabulary to a multiple of it (not of 64 x tp)."""


def padded_vocab(vocab: int) -> int:
    """The LM head's vocabulary size: ``vocab`` rounded up to a multiple of ``VOCAB_PADDING``."""
    if vocab < 1:
        raise ValueError(f"vocab must be at least 1, got {vocab}")
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def speculative_rows(requests: int, k: int) -> int:
    """Logits rows of a step in which ``requests`` requests each propose ``k`` drafts: drafts plus bonus tokens."""
    if requests < 1 or k < 0:
        raise ValueError(f"requests must be at least 1 and k at least 0, got requests={requests}, k={k}")
    return requests * (1 + k)


@dataclass(frozen=True)
class GatheredLogits:
    """Bytes one rank holds for ``rows`` logits rows (module docstring)."""

    rows: int
    vocab: int  # padded
    tp: int
    itemsize: int

    def __post_init__(self) -> None:
        if self.rows < 1 or self.tp < 1 or self.itemsize < 1 or self.vocab % self.tp:
            raise ValueError(f"GatheredLogits needs rows, tp and itemsize of at least 1 and a padded vocabulary "
                             f"divisible by tp, got rows={self.rows}, vocab={self.vocab}, tp={self.tp}, "
                             f"itemsize={self.itemsize}")

    @property
    def shard(self) -> int:
        return self.rows * self.vocab // self.tp * self.itemsize

    @property
    def held(self) -> int:
        """What stays for the sampler: the full-vocabulary logits."""
        return self.rows * self.vocab * self.itemsize

    @property
    def gathered(self) -> int:
        return self.held if self.tp > 1 else 0

    @property
    def reordered(self) -> int:
        return self.held if self.tp > 1 and self.rows > 1 else 0

    @property
    def peak(self) -> int:
        return self.shard + self.gathered + self.reordered
