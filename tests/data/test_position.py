"""A data position carried between runs (`init.trainer_state`): the source's epoch and tokens
consumed of it, placed in the continuing run's own stream of global batches."""

import pytest

from relaytrain.data.position import Stream, batch_at, position_of
from relaytrain.errors import DataError

RELAY = Stream("relay", n_instances=100, global_batch=8, seq_len=16)
OLMO = Stream("olmo-core", n_instances=100, global_batch=8, seq_len=16)  # 12 batches an epoch


@pytest.mark.parametrize("stream", [RELAY, OLMO])
def test_the_same_stream_continues_at_the_batch_its_source_stopped_at(stream):
    for k in range(0, 60):
        assert batch_at(stream, *position_of(stream, k)) == k


def test_a_position_is_the_epoch_and_the_tokens_consumed_of_it():
    # relaytrain's order: batch 13 starts at instance 104, 4 into epoch 1
    assert position_of(RELAY, 13) == (1, 4 * 16)
    # OLMo-core's: 12 batches an epoch (the last 4 instances dropped), batch 13 the second
    # of epoch 1
    assert position_of(OLMO, 13) == (1, 8 * 16)
    assert position_of(OLMO, 12) == (1, 0) and position_of(RELAY, 0) == (0, 0)


def test_another_run_starts_that_epoch_of_its_own_data_that_many_tokens_in():
    other = Stream("olmo-core", n_instances=1000, global_batch=4, seq_len=16)  # 250 a epoch
    assert batch_at(other, 1, 8 * 16) == 250 + 2
    relay = Stream("relay", n_instances=50, global_batch=5, seq_len=32)
    assert batch_at(relay, 2, 10 * 32) == (2 * 50 + 10) // 5


@pytest.mark.parametrize(("stream", "epoch", "tokens", "said"), [
    (RELAY, 0, 17, "not a whole number of the run's instances of 16 tokens"),
    (RELAY, 0, 101 * 16, "past the end of an epoch of the run's data (100 instances"),
    (OLMO, 0, 97 * 16, "past the end of an epoch of the run's data (96 instances"),
    (RELAY, 0, 12 * 16, "4 instances into one of the run's global batches of 8, not at its "
     "start"),
    (RELAY, 1, 0, "4 instances into one of the run's global batches of 8"),  # 100 in
])
def test_a_position_inside_a_batch_or_past_the_epoch_is_refused(stream, epoch, tokens, said):
    with pytest.raises(DataError, match=f"^{tokens} tokens into epoch {epoch}: ") as err:
        batch_at(stream, epoch, tokens)
    assert said in str(err.value)
