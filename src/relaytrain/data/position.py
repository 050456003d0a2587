"""A data position carried from one run to another (`init.trainer_state`): where a run that
continues another's starts in its own stream of global batches.

A position is OLMo-core's: the epoch the source was in and the tokens it had consumed of that
epoch (its data loader's `epoch` and `tokens_processed`). The run continuing it starts that
epoch of its own data that many tokens in, in its own order (`data.order`, its data seed):
with the source's data, seed, global batch and sequence length, exactly the global batch the
source would have trained on next; with other data (a new mix), the same epoch and token
offset of that data, as OLMo-core's own loader resumes (`tokens_processed // global batch`).
The offset must be a whole number of the run's global batches (relaytrain's order: of its
instances, the epoch's start plus the offset a whole number of global batches), and within
the epoch, else the position is refused: a run never replays nor skips part of a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain.errors import DataError


@dataclass(frozen=True)
class Stream:
    """A run's stream of global batches: `order` (relay or olmo-core), its `n_instances` of
    `seq_len` tokens, `global_batch` instances a step."""

    order: str
    n_instances: int
    global_batch: int
    seq_len: int

    @property
    def epoch_instances(self) -> int:
        """Instances an epoch uses (OLMo-core's order drops the tail short of a batch)."""
        if self.order == "olmo-core":
            return self.n_instances // self.global_batch * self.global_batch
        return self.n_instances


def position_of(stream: Stream, batch_index: int) -> tuple[int, int]:
    """(epoch, tokens consumed of it), epoch 0-based, before global batch `batch_index`."""
    used = batch_index * stream.global_batch
    epoch, into = divmod(used, stream.epoch_instances)
    return epoch, into * stream.seq_len


def batch_at(stream: Stream, epoch: int, tokens: int) -> int:
    """The global batch a run of `stream` starts at to continue from `tokens` consumed of
    0-based `epoch`; DataError where that is not the start of a whole global batch of it."""
    into, rest = divmod(tokens, stream.seq_len)
    at = f"{tokens} tokens into epoch {epoch}"
    if rest:
        raise DataError(f"{at}: not a whole number of the run's instances of "
                        f"{stream.seq_len} tokens")
    if into > stream.epoch_instances:
        raise DataError(f"{at}: past the end of an epoch of the run's data "
                        f"({stream.epoch_instances} instances of {stream.seq_len} tokens)")
    batch, rest = divmod(epoch * stream.epoch_instances + into, stream.global_batch)
    if rest:
        raise DataError(f"{at}: {rest} instances into one of the run's global batches of "
                        f"{stream.global_batch}, not at its start")
    return batch
